// Mixture-of-experts modules: GroupedLinear (every expert's linear layer in one call),
// GroupedMLP (GroupedLinear -> SwiGLU scaled by the routing probability -> GroupedLinear)
// and MoELayer (router + permute + GroupedMLP + unpermute), the FFN of a Mixtral block.
//
// Shapes: tokens x [N, C]; each token goes to k of E experts; the permuted tensors have
// N*k rows, expert-contiguous, rows past the kept total zero (see tessera/ops/moe.h).
// The per-expert row counts are needed on the host for the per-expert GEMMs, so on CUDA
// MoELayer::forward copies E integers back (one synchronisation per MoE layer); the
// router, the routing map and the permutation themselves run without host syncs.
#pragma once

#include <optional>
#include <vector>

#include "tessera/nn/linear.h"
#include "tessera/ops/moe.h"

namespace tessera::nn {

// E linear layers y_e = x_e W_e^T, no bias. weight is one Parameter [E * out, in]: expert
// e's [out, in] matrix is rows [e * out, (e + 1) * out) (the layout the op reads as
// [E, out, in]).
//
// FP8 (use_fp8; docs/ops/moe.md, "FP8"): with BF16 input and weight and in, out multiples
// of 16, the three grouped GEMMs can run in FP8 through the *_fp8 methods: the input cast
// once (one current scale, padded transposed copy), each expert's weight with its own scale,
// the output gradient cast in backward_input_fp8; any split sizes (the padding rule of
// tessera/ops/moe.h). The Tensor methods above stay the BF16 path, unchanged.
class GroupedLinear {
 public:
  // What the FP8 backward reads, kept between the calls: after the forward only the
  // transposed codes of x and W (data_t), after backward_input_fp8 only dy's data_t.
  struct Fp8Saved {
    MoEFp8Rows x, dy;
    MoEFp8Weights w;
  };
  GroupedLinear(const std::string& name, int64_t num_experts, int64_t in_features, int64_t out_features, DType dtype);
  Tensor forward(Context& ctx, const Tensor& x, const std::vector<int64_t>& splits) const;  // [M, in] -> [M, out]
  Tensor backward_input(Context& ctx, const Tensor& dy, const std::vector<int64_t>& splits) const;
  void backward_weight(Context& ctx, const Tensor& dy, const Tensor& x, const std::vector<int64_t>& splits);
  void parameters(ParameterList& out) { out.push_back(&weight); }
  // The BF16 weights as [E, out, in]: a view of weight.value, which may lag the master after
  // a cast_in_optimizer update (Parameter::value_stale); current_weight3d refreshes it first.
  Tensor weight3d() const { return weight.value.reshape({experts_, out_, in_}); }
  Tensor current_weight3d(Context& ctx) const;

  // FP8: an empty optional turns it off.
  void use_fp8(std::optional<MoEFp8Options> options) { fp8_ = options; }
  const std::optional<MoEFp8Options>& fp8_options() const { return fp8_; }
  // Whether the layer has an FP8 setting and the dtypes and sizes the FP8 path takes.
  bool runs_fp8(DType input) const;
  // y [M, out] (BF16) from x already cast (saved.x keeps x; its row-wise codes are dropped).
  Tensor forward_fp8(Context& ctx, MoEFp8Rows x, Fp8Saved& saved) const;
  // dx [M, in] (BF16); casts dy (the recipe's gradient format) into saved.dy. dy_amax
  // (F32 [1]), when given, is dy's amax already reduced (no amax pass).
  Tensor backward_input_fp8(Context& ctx, const Tensor& dy, Fp8Saved& saved, const Tensor& dy_amax = Tensor()) const;
  // The same with dy [M, out] already cast (the recipe's gradient format, saved.x's splits),
  // e.g. by moe_swiglu_scaled_backward_quantize; it moves into saved.dy.
  Tensor backward_input_fp8(Context& ctx, MoEFp8Rows dy, Fp8Saved& saved) const;
  // dW += dy^T x per expert, into the F32 gradient (the caller frees saved afterwards).
  // Deferred (MoEFp8Options::defer_weight_grad, delayed scaling, weight cache open): keeps
  // saved's transposed codes and, at the first such call of the step, asks the cache to run
  // flush_weight_grad_fp8 when the step's last micro-batch ends.
  void backward_weight_fp8(Context& ctx, const Fp8Saved& saved);
  // The deferred gradient: every kept micro-batch's rows of expert e side by side in K (one
  // copy of the codes), one GEMM per expert. Called by the weight cache's flush.
  void flush_weight_grad_fp8(Context& ctx);

  // fp8.cast_in_optimizer (train::Optimizer::set_custom_update): this weight's AdamW step
  // fused with its FP8 casts for the next step under delayed scaling
  // (moe_fp8_adamw_cast_weights), which then prime the weight cache (fp8/weight_cache.h) for
  // the next forward; the plain step without a delayed FP8 setting. Run it after the
  // scaling's end_step, whose new scales the casts use. The fused update leaves the BF16 copy
  // (weight.value) stale: current_weight3d and Parameter::refresh_value_if_stale renew it.
  void optimizer_update(Context& ctx, AdamWTensorStep& step);

  int64_t num_experts() const { return experts_; }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Parameter weight;

 private:
  int64_t experts_, in_, out_;
  std::optional<MoEFp8Options> fp8_;
  std::vector<Fp8Saved> deferred_;  // the step's micro-batches awaiting flush_weight_grad_fp8
};

// fc: [gate | up] per expert (2 * ffn outputs), proj: ffn -> hidden. The routing
// probability scales the SwiGLU output of each row (mathematically the same as scaling the
// expert's output, as Mixtral does).
class GroupedMLP {
 public:
  // What the backward reads (sizes for Mixtral, M = 16384 rows, hidden 4096, ffn 14336, BF16):
  //   x [M, hidden] (128 MiB; fc's weight gradient), h_pre [M, 2 ffn] (896 MiB; the SwiGLU
  //   backward, freed by backward_input), h [M, ffn] (448 MiB; proj's weight gradient, not
  //   kept with recompute_activation: backward_input recomputes it from h_pre), scale [M].
  // The FP8 path keeps instead x and h as transposed FP8 codes (64 and 224 MiB) and h_pre.
  struct Saved {
    Tensor x, h_pre, h, scale;
    std::vector<int64_t> splits;
    Tensor d_h_pre, d_scale;  // filled by backward_input (d_h_pre: BF16 path only)
    bool fp8 = false;
    GroupedLinear::Fp8Saved fc8, proj8;  // the FP8 path's casts
  };
  GroupedMLP(const std::string& name, int64_t num_experts, int64_t hidden, int64_t ffn, DType dtype);
  // x [M, hidden] expert-contiguous rows, scale [M] (undefined: 1).
  Tensor forward(Context& ctx, const Tensor& x, const Tensor& scale, const std::vector<int64_t>& splits,
                 Saved& saved) const;
  // dx [M, hidden]; also saved.d_scale [M] (when scale was given) and saved.d_h_pre.
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved) const;
  void backward_weight(Context& ctx, const Tensor& dy, const Saved& saved);
  void parameters(ParameterList& out);

  // FP8 for both GEMM layers (and the fused SwiGLU -> FP8 cast between them); empty: off.
  // Under delayed scaling (options->delayed) fc takes the slots from options->delayed_base
  // on and proj the ones after them: delayed_slots() in all, with delayed_roles().
  void use_fp8(std::optional<MoEFp8Options> options);
  int64_t delayed_slots() const;
  std::vector<fp8::Role> delayed_roles() const;
  bool runs_fp8(const Tensor& x) const;

  GroupedLinear fc, proj;
  // Recompute h = SwiGLU(h_pre) * scale in backward_input instead of keeping it from the
  // forward (BF16 path; bit-identical, one more pass over h_pre). Config: model.moe_recompute_activation.
  bool recompute_activation = false;
};

struct MoEOptions {
  int64_t hidden = 0, ffn = 0, num_experts = 8;
  RouterOptions router;
  // > 0: auxiliary-loss-free balancing; update_expert_bias() moves the bias by this much.
  float expert_bias_rate = 0.0f;
  bool recompute_activation = false;  // GroupedMLP::recompute_activation
};

class MoELayer {
 public:
  struct Saved {
    Linear::Saved router_in;
    // expert_out is not kept (the unweighted unpermute's backward does not read it).
    Tensor logits, scores, probs, indices, counts, losses, row_map, offsets, permuted_probs;
    std::vector<int64_t> splits;  // kept tokens per expert (host copy of counts)
    GroupedMLP::Saved mlp;
    Tensor d_logits, d_expert_out;  // filled by backward_input
    float loss_scale = 1.0f;        // weight of the aux losses in the objective (set before backward)
  };
  MoELayer(const std::string& name, const MoEOptions& options, DType dtype);

  // x [N, C] -> [N, C]. saved.losses [2] = {aux loss, z loss} on x's device (F32, F64 for
  // F64 models), saved.splits the per-expert load of this call.
  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const;
  // dx; the router receives the gradient of the aux losses times saved.loss_scale.
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved) const;
  void backward_weight(Context& ctx, const Tensor& dy, const Saved& saved);
  void parameters(ParameterList& out);
  void to(Device device);

  // Adds a forward's per-expert counts to `load` (the statistics since the last reset).
  void record_load(const Saved& saved);
  // Auxiliary-loss-free balancing step from `load`, then resets it. No-op when disabled.
  void update_expert_bias(Context& ctx);

  MoEOptions options;
  Linear router;  // hidden -> E, no bias ("gate" in Mixtral)
  GroupedMLP experts;
  Tensor expert_bias;          // F32 [E], defined when expert_bias_rate > 0
  std::vector<int64_t> load;   // kept tokens per expert since the last update/reset
};

}  // namespace tessera::nn
