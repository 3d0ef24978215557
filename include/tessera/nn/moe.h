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

#include <vector>

#include "tessera/nn/linear.h"
#include "tessera/ops/moe.h"

namespace tessera::nn {

// E linear layers y_e = x_e W_e^T, no bias. weight is one Parameter [E * out, in]: expert
// e's [out, in] matrix is rows [e * out, (e + 1) * out) (the layout the op reads as
// [E, out, in]).
class GroupedLinear {
 public:
  GroupedLinear(const std::string& name, int64_t num_experts, int64_t in_features, int64_t out_features, DType dtype);
  Tensor forward(Context& ctx, const Tensor& x, const std::vector<int64_t>& splits) const;  // [M, in] -> [M, out]
  Tensor backward_input(Context& ctx, const Tensor& dy, const std::vector<int64_t>& splits) const;
  void backward_weight(Context& ctx, const Tensor& dy, const Tensor& x, const std::vector<int64_t>& splits);
  void parameters(ParameterList& out) { out.push_back(&weight); }
  Tensor weight3d() const { return weight.value.reshape({experts_, out_, in_}); }

  int64_t num_experts() const { return experts_; }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Parameter weight;

 private:
  int64_t experts_, in_, out_;
};

// fc: [gate | up] per expert (2 * ffn outputs), proj: ffn -> hidden. The routing
// probability scales the SwiGLU output of each row (mathematically the same as scaling the
// expert's output, as Mixtral does).
class GroupedMLP {
 public:
  struct Saved {
    Tensor x, h_pre, h, scale;
    std::vector<int64_t> splits;
    Tensor d_h_pre, d_scale;  // filled by backward_input
  };
  GroupedMLP(const std::string& name, int64_t num_experts, int64_t hidden, int64_t ffn, DType dtype);
  // x [M, hidden] expert-contiguous rows, scale [M] (undefined: 1).
  Tensor forward(Context& ctx, const Tensor& x, const Tensor& scale, const std::vector<int64_t>& splits,
                 Saved& saved) const;
  // dx [M, hidden]; also saved.d_scale [M] (when scale was given) and saved.d_h_pre.
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved) const;
  void backward_weight(Context& ctx, const Tensor& dy, const Saved& saved);
  void parameters(ParameterList& out);

  GroupedLinear fc, proj;
};

struct MoEOptions {
  int64_t hidden = 0, ffn = 0, num_experts = 8;
  RouterOptions router;
  // > 0: auxiliary-loss-free balancing; update_expert_bias() moves the bias by this much.
  float expert_bias_rate = 0.0f;
};

class MoELayer {
 public:
  struct Saved {
    Linear::Saved router_in;
    Tensor logits, scores, probs, indices, counts, losses, row_map, offsets, permuted_probs, expert_out;
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
