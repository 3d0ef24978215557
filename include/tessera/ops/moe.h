// Mixture of experts: the router, token permutation, the grouped expert GEMM and the
// scaled SwiGLU between the expert GEMMs.
//
// One MoE layer over N tokens of width C with E experts, each token sent to k of them:
//
//   logits = x Wr^T                                   [N, E]  (a plain gemm)
//   router:   scores, top-k -> probs [N, k], indices [N, k], counts [E], aux losses
//   permute:  x -> xp [N*k, C], expert-contiguous (expert 0's rows first, each expert's
//             rows in token order); row_map [N, k] says where each (token, slot) went
//   grouped_linear(xp, W1) -> swiglu scaled by the routing probability -> grouped_linear(W2)
//   unpermute: y[n] = sum_j out[row_map[n, j]]   (times probs[n, j] when they are given)
//
// Conventions:
// - indices are I32; an index >= 0 is a kept assignment to that expert, an index < 0 an
//   assignment to expert -index-1 that the capacity limit dropped (its probability is 0).
// - row_map is I32 [N, k]: the permuted row of each assignment, -1 for dropped ones. The
//   permuted tensors always have N*k rows, so nothing depends on the (data-dependent)
//   number of kept rows: rows past offsets[E] are zero. offsets is I32 [E+1], the exclusive
//   prefix sum of the kept per-expert counts, computed on the device on CUDA.
// - Everything is deterministic: ties in top-k go to the lower expert index, the capacity
//   limit keeps assignments in token order, and no reduction depends on thread counts.
// - Gradient rule: input and activation gradients are OVERWRITTEN, parameter gradients
//   (grouped_linear's dw) ACCUMULATE.
// - Compute type: double when the main input is F64, float otherwise (as every op).
#pragma once

#include <memory>
#include <vector>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"
#include "tessera/fp8/device_scaling.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/fp8/recipe.h"
#include "tessera/fp8/weight_cache.h"
#include "tessera/ops/optimizer.h"

namespace tessera {

enum class RouterScore { Softmax, Sigmoid };

struct RouterOptions {
  int64_t top_k = 2;
  RouterScore score = RouterScore::Softmax;
  // Group-limited top-k (DeepSeek-V3): the E experts form num_groups equal groups; each
  // token first keeps the topk_groups groups with the best group score (the sum of the
  // group's two best selection scores, or its one score for groups of one) and then picks
  // its top_k experts among them. num_groups <= 1 disables it.
  int64_t num_groups = 0;
  int64_t topk_groups = 0;
  // Divide the k selected scores by their sum (Mixtral; DeepSeek-V3's sigmoid router).
  bool normalize = true;
  float scaling = 1.0f;  // multiplies the final routing probabilities
  // Switch/GShard load-balancing loss: coeff * E / (N*k) * sum_e routed_e * mean_n(s[n, e]),
  // with routed_e the assignments to e before any dropping and s the (unbiased) scores.
  // This is Megatron's normalisation; Hugging Face Mixtral's load_balancing_loss_func is
  // k times it.
  float aux_loss_coeff = 0.0f;
  // ST-MoE router z-loss: coeff * mean_n(logsumexp(logits[n, :])^2).
  float z_loss_coeff = 0.0f;
  // > 0: each expert keeps at most ceil(capacity_factor * N * k / E) assignments, the
  // earliest tokens first; the rest are dropped (index -e-1, probability 0).
  float capacity_factor = 0.0f;
};

// Router forward.
//   logits [N, E] (F64, F32 or BF16), E <= 1024; expert_bias [E] F32 or undefined: the
//   auxiliary-loss-free balancing bias, added to the scores for the choice of experts only.
// Outputs (preallocated, overwritten):
//   scores [N, E]  the softmax or sigmoid of the logits, F64 for F64 logits, else F32
//                  (what the backward reads)
//   probs [N, k]   routing probabilities of the selected experts (any floating dtype)
//   indices [N, k] I32 selected experts, in descending order of selection score
//   counts [E]     I32 kept assignments per expert (the load statistics)
//   losses [2]     F32 or F64: {aux loss, z loss}, coefficients applied (0 when unused)
void moe_router_forward(Context& ctx, const Tensor& logits, const Tensor& expert_bias, const RouterOptions& options,
                        Tensor& scores, Tensor& probs, Tensor& indices, Tensor& counts, Tensor& losses);

// Router backward: d_logits [N, E] (OVERWRITTEN) from the gradient of the probabilities
// d_probs [N, k] and of the two losses, both multiplied by loss_scale (the weight the aux
// losses carry in the objective, e.g. the micro-batch scale). Dropped assignments get no
// gradient through their own probability.
void moe_router_backward(Context& ctx, const Tensor& logits, const Tensor& scores, const Tensor& indices,
                         const Tensor& d_probs, const RouterOptions& options, float loss_scale, Tensor& d_logits);

// Auxiliary-loss-free balancing (DeepSeek-V3), once per optimizer step:
//   bias[e] += rate * sign(mean(load) - load[e])
// load [E] is the per-expert token count over the step (I32, I64, F32 or F64); bias [E] F32.
void moe_update_expert_bias(Context& ctx, const Tensor& load, float rate, Tensor& bias);

// The routing map: row_map [N, k] and offsets [E+1] (I32) from indices [N, k] (see above).
void moe_routing_map(Context& ctx, const Tensor& indices, int64_t num_experts, Tensor& row_map, Tensor& offsets);

// permuted[row_map[n, j]] = x[n] for every kept assignment; rows no assignment maps to
// are zero. x [N, C], permuted [N*k, C]. With probs [N, k] and permuted_probs [N*k] both
// defined, the probabilities move the same way (0 in unmapped rows).
void moe_permute_forward(Context& ctx, const Tensor& x, const Tensor& row_map, const Tensor& probs, Tensor& permuted,
                         Tensor& permuted_probs);
// dx[n] = sum_j d_permuted[row_map[n, j]] (OVERWRITTEN; 0 for a token with no kept
// assignment). With d_permuted_probs and d_probs defined: d_probs[n, j] =
// d_permuted_probs[row_map[n, j]] (0 where dropped).
void moe_permute_backward(Context& ctx, const Tensor& row_map, const Tensor& d_permuted, const Tensor& d_permuted_probs,
                          Tensor& dx, Tensor& d_probs);

// y[n] = sum_j w[n, j] * expert_out[row_map[n, j]], w = probs or 1 when probs is undefined;
// the k copies are summed in slot order. expert_out [N*k, C], y [N, C].
void moe_unpermute_forward(Context& ctx, const Tensor& expert_out, const Tensor& row_map, const Tensor& probs,
                           Tensor& y);
// d_expert_out[row_map[n, j]] = w[n, j] * dy[n] (unmapped rows 0), and with probs defined
// d_probs[n, j] = dot(dy[n], expert_out[row_map[n, j]]) (0 where dropped). Both OVERWRITTEN.
void moe_unpermute_backward(Context& ctx, const Tensor& expert_out, const Tensor& row_map, const Tensor& probs,
                            const Tensor& dy, Tensor& d_expert_out, Tensor& d_probs);

// The expert MLP's activation scaled by the routing probability, per row:
//   y[r, c] = scale[r] * silu(gate[r, c]) * up[r, c]      x [M, 2F] = [gate | up], y [M, F]
// scale [M] any floating dtype.
void moe_swiglu_scaled_forward(Context& ctx, const Tensor& x, const Tensor& scale, Tensor& y);
// dx [M, 2F] and d_scale[r] = dot(dy[r], swiglu(x[r])), both OVERWRITTEN. With dx_amax
// (F32 [1]) non-null it also receives max |dx| over the stored dx (NaN if any is NaN), the
// statistic dx's FP8 cast needs, from the same pass on CUDA.
void moe_swiglu_scaled_backward(Context& ctx, const Tensor& x, const Tensor& scale, const Tensor& dy, Tensor& dx,
                                Tensor& d_scale, Tensor* dx_amax = nullptr);

// The earlier SwiGLU kernels, to time them against the current ones in one run: on CUDA the
// scaled SwiGLU runs its scalar one-block-per-row kernels, and nn::GroupedMLP's FP8 backward
// the unfused path (BF16 dx, then its cast). Starts as TESSERA_MOE_LEGACY=1 in the
// environment (read once); process-wide. Results are the same but for d_scale's last bits.
bool moe_swiglu_legacy();
void set_moe_swiglu_legacy(bool legacy);

// GroupedLinear: every expert's linear layer in one call.
//   x [M, K] expert-contiguous rows, w [E, N, K] (PyTorch's [out, in] per expert),
//   split_sizes: E host-side row counts (zeros allowed), sum <= M.
//   y[o_e : o_e + s_e] = x[o_e : o_e + s_e] W_e^T, o_e the prefix sum; rows past the sum
//   are zero. On CUDA each expert is one cuBLASLt GEMM, so the result is bit-identical to
//   a loop of gemm calls (it is that loop); the GEMMs are spread over
//   grouped_gemm_streams() side streams forked from and joined back into the context's
//   stream, so that small experts run side by side. The split sizes are host values: a
//   caller whose counts live on the GPU copies them back first.
void grouped_linear_forward(Context& ctx, const Tensor& x, const Tensor& w, const std::vector<int64_t>& split_sizes,
                            Tensor& y);
// dx = dy_e W_e per group (OVERWRITTEN; rows past the sum zero).
void grouped_linear_backward_input(Context& ctx, const Tensor& dy, const Tensor& w,
                                   const std::vector<int64_t>& split_sizes, Tensor& dx);
// dw[e] += dy_e^T x_e (ACCUMULATES; an expert with no rows leaves its slice unchanged).
// accumulate false OVERWRITES instead, dw[e] = dy_e^T x_e (beta 0: dw's old contents are
// never read; an expert with no rows gets zeros): a step's first gradient after a lazy
// zero_grad (nn::Parameter::grad_unwritten).
void grouped_linear_backward_weight(Context& ctx, const Tensor& dy, const Tensor& x,
                                    const std::vector<int64_t>& split_sizes, Tensor& dw, bool accumulate = true);

// ---- FP8 (current scaling) ---------------------------------------------------------------
// The grouped GEMMs in FP8 (docs/ops/moe.md, "FP8"). Each operand is cast once with one
// per-tensor scale from its own amax (current scaling; computed on the device), except the
// weights: each expert's W_e has its own scale, so that one large expert does not crush the
// resolution of the others.
//
// Alignment. cuBLASLt's FP8 GEMMs want K and every row stride a multiple of 16 and 16-byte
// aligned pointers. The forward (K = in) and dgrad (K = out) GEMMs read row blocks of the
// row-wise codes, which qualify whenever in and out are multiples of 16, whatever the split
// sizes. The wgrad GEMM of expert e contracts over its n_e rows: it reads the columns
// [o_e, o_e + n_e) of the transposed codes, K = n_e. So the transposed copy is written
// PADDED: expert e's rows start at column p_e = sum_{j<e} round_up(n_j, 16) of a
// [K, round_up-sum] matrix, the columns in between zero. Zero columns add exact zeros to
// the FP32 sums, so padding changes no bit, and any split sizes run in FP8. (The
// permutation itself is not padded: the BF16 path and everything around it see the same
// tensors as before.)
struct MoEFp8Options {
  fp8::Format format = fp8::Format::Hybrid;  // E4M3 for x, W, h; E5M2 for gradients under Hybrid
  float margin = 0;
  bool power_of_two_scales = false;
  // fp8.keep_weight_transpose (fp8/recipe.h): keep each expert's W^T codes from forward to
  // backward (nn::GroupedLinear); off, they are re-cast in backward with the kept scales.
  bool keep_weight_transpose = false;
  // Delayed scaling (the "delayed" recipe, Transformer Engine's default): every cast reads
  // its scale from this state, which earlier steps' amaxes made, and records the amax of
  // what it cast into the state's pending slot IN THE SAME PASS, so no cast waits for an
  // amax pass over its input (the SwiGLU backward becomes one pass instead of two). Null:
  // current scaling. One GroupedLinear takes delayed_slots(E) slots from delayed_base on:
  // kDelayedInput (x), kDelayedGradOutput (dy), kDelayedWeight + e (expert e's weight);
  // GroupedMLP::use_fp8 gives proj the slots after fc's. The owner of the state runs its
  // record / update (nn::Fp8Scaling::end_micro_batch / end_step for a model).
  std::shared_ptr<fp8::DeviceDelayedScaling> delayed;
  int64_t delayed_base = 0;
  // fp8.cache_weights (fp8/weight_cache.h): while this cache is open, nn::GroupedLinear casts
  // every expert's weight (both copies) once and reuses the casts in the step's later
  // micro-batches. Null or closed: cast in every forward. models::enable_fp8 passes the
  // model's Fp8Scaling::weight_cache().
  std::shared_ptr<fp8::WeightCache> weight_cache;
  // fp8.defer_expert_wgrad (fp8/recipe.h): with delayed scaling and the weight cache open,
  // nn::GroupedLinear keeps each micro-batch's transposed codes and computes the weight
  // gradient once, when the cache flushes at the step's last micro-batch.
  bool defer_weight_grad = false;
  static constexpr int64_t kDelayedInput = 0, kDelayedGradOutput = 1, kDelayedWeight = 2;
  static int64_t delayed_slots(int64_t experts) { return kDelayedWeight + experts; }
  // The roles of one GroupedLinear's slots, in order (for DeviceDelayedScaling's constructor).
  static std::vector<fp8::Role> delayed_roles(int64_t experts);
  // The state's scale and pending-amax views (F32 [1]) of slot delayed_base + slot.
  Tensor delayed_scale(int64_t slot) const;
  Tensor delayed_amax(int64_t slot) const;

  // From a recipe: "current" and "delayed" with their format and margin (delayed then needs
  // `delayed` set: models::enable_fp8 makes the state); block and mxfp8 fall back to current
  // scaling with their format, since per-expert block scales are not wired.
  static MoEFp8Options from_recipe(const fp8::Recipe& recipe);
  DType forward_dtype() const { return fp8::fp8_dtype(format, fp8::Role::Forward); }
  DType gradient_dtype() const { return fp8::fp8_dtype(format, fp8::Role::Gradient); }
};

// p_e of the padding rule above: E + 1 column offsets (the last is the padded width, a
// multiple of 16; 0 experts with rows give 0).
std::vector<int64_t> moe_fp8_padded_offsets(const std::vector<int64_t>& split_sizes);

// An expert-contiguous activation [M, K] in FP8: data [M, K] the codes fp8(x * scale) (zero
// codes in the rows past the split sum, which no GEMM reads), data_t [K, P] the padded
// transposed codes (P = padded_offsets[E]), scale_inv F32 [1]. Either copy may be dropped
// once nothing reads it (data after the forward / dgrad GEMM). The amax covers every row.
struct MoEFp8Rows {
  Tensor data, data_t, scale_inv;
  DType dtype = DType::E4M3;
  std::vector<int64_t> splits, padded_offsets;
};

// Each expert's weight [N, K] cast with its own scale (experts without rows are skipped:
// their entry stays empty). experts[e].data [N, K], data_t [K, N], scale_inv [1]; scales[e]
// the F32 [1] scale it was cast with (fp8::quantize_with_transpose of the same weight with it
// gives the same codes: how nn::GroupedLinear re-casts W^T in backward). On CUDA the
// one-launch casts (BF16 w, K % 8 == 0) write data_t only under keep_weight_transpose, and
// the entries are views of shared tensors: data of an [A, N, K] tensor (A experts with
// rows), scale_inv and scales of [4A] ones, 16 bytes apart (cuBLASLt's scale alignment).
struct MoEFp8Weights {
  std::vector<fp8::QuantizedTensor> experts;
  std::vector<Tensor> scales;
};

// Current scaling of x [M, K] (F32 or BF16): amax, scale, then the cast with the padded
// transpose. On CUDA the cast and both copies are one kernel (backend/cuda/moe_fp8.cu).
MoEFp8Rows moe_fp8_quantize_rows(Context& ctx, const Tensor& x, const std::vector<int64_t>& split_sizes, DType fp8,
                                 const MoEFp8Options& options);
// The same with x's amax (F32 [1]) already known (e.g. from moe_swiglu_scaled_backward).
MoEFp8Rows moe_fp8_quantize_rows(Context& ctx, const Tensor& x, const Tensor& x_amax,
                                 const std::vector<int64_t>& split_sizes, DType fp8, const MoEFp8Options& options);
// The same cast with a given scale (F32 [1] on ctx.device): delayed scaling's cast, and the
// building block of the above. amax_out (F32 [1]), when given, receives max |x| folded in as
// DeviceDelayedScaling's pending amax is (NaN sticky, else the max; not reset first), from
// the cast's own read of x on CUDA.
MoEFp8Rows moe_fp8_cast_rows(Context& ctx, const Tensor& x, const Tensor& scale, const std::vector<int64_t>& split_sizes,
                             DType fp8, Tensor* amax_out = nullptr);
// Casts x [M, K] for a GroupedLinear's slot (kDelayedInput or kDelayedGradOutput) as options
// say: delayed, moe_fp8_cast_rows with the slot's scale recording its amax; current,
// moe_fp8_quantize_rows (with x_amax when given).
MoEFp8Rows moe_fp8_cast_rows_for(Context& ctx, const Tensor& x, const std::vector<int64_t>& split_sizes, DType fp8,
                                 const MoEFp8Options& options, int64_t slot, const Tensor& x_amax = Tensor());
// w [E, N, K]: experts with split_sizes[e] > 0 cast with their own current scale. On CUDA
// three launches in all (every amax, every scale, every cast; backend/cuda/moe_weight_cast.cu)
// where supported, else three per expert; the bytes are the same. Under delayed scaling
// (options.delayed) expert e is cast with slot kDelayedWeight + e's scale and its amax
// recorded there, in one launch on CUDA; scales[e] is a view of the state, scale_inv a copy
// of the state's (on CUDA 16-byte aligned, for cuBLASLt).
MoEFp8Weights moe_fp8_quantize_weights(Context& ctx, const Tensor& w, const std::vector<int64_t>& split_sizes,
                                       const MoEFp8Options& options);

// fp8.cast_in_optimizer: one AdamW step of a GroupedLinear's weight (param: its F32 master,
// E*N*K elements; grad, exp_avg, exp_avg_sq and its BF16 value as adamw_step_multi takes
// them for one tensor, with weight_decay its decay) and, in the same pass, the delayed-scaling
// cast of each expert's new BF16 value [N, K] for the next step's forward:
//   data[e] = fp8(value_e * scale[e]) [N, K],  data_t[e] = its transpose [K, N]
//   amax[e] = fold(amax[e], max |value_e|)     (NaN sticky, as pending amaxes fold)
// The weights, moments and value get adamw_step_multi's bits; the codes are
// fp8::quantize_with_transpose's of the new BF16 value with scale[e] (so
// moe_fp8_quantize_weights' under delayed scaling, read from the value). value may be
// undefined: the BF16 copy is then not written (the codes are computed from the master's
// BF16 rounding all the same), which is what GroupedLinear::optimizer_update does. On CUDA
// one kernel (16-byte aligned tensors, K % 8 == 0, N % 8 == 0; backend/cuda/multi_tensor.cu
// has its speed); elsewhere the composition. scale and amax: F32 [E]
// (the delayed state's weight slots of the layer); data, data_t: E4M3 or E5M2, overwritten.
struct MoEFp8WeightCast {
  Tensor scale, amax, data, data_t;
};
void moe_fp8_adamw_cast_weights(Context& ctx, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                                Tensor& value, const AdamWOptions& options, float weight_decay,
                                const Tensor& grad_norm, double max_norm, MoEFp8WeightCast& out);
// The casts above as the FP8 grouped GEMMs take them (moe_fp8_quantize_weights' result for
// every expert under delayed scaling): expert e's entries are views of data / data_t, its
// scale_inv a copy of the delayed state's (options.delayed, slot kDelayedWeight + e) made
// now, so call it after the state's update for the step the casts serve.
MoEFp8Weights moe_fp8_weights_from_cast(Context& ctx, const MoEFp8WeightCast& cast, const MoEFp8Options& options);
// Whether moe_fp8_quantize_weights takes the per-expert loop on CUDA too (process-wide; the
// default is TESSERA_MOE_LEGACY=1 in the environment, read once): for timing the two and for
// the tests that compare them.
void set_moe_fp8_legacy_weight_cast(bool legacy);
bool moe_fp8_legacy_weight_cast();

// The SwiGLU scaled by the routing probability (moe_swiglu_scaled_forward's h) straight to
// FP8: h is computed in float and never stored in BF16. Two passes over x [M, 2F]: the amax
// of h (computed on the fly), then the cast of h (recomputed) with both copies. With a
// scale given, only the cast pass runs (moe_swiglu_scaled_cast).
MoEFp8Rows moe_swiglu_scaled_quantize(Context& ctx, const Tensor& x, const Tensor& scale,
                                      const std::vector<int64_t>& split_sizes, DType fp8, const MoEFp8Options& options);
// amax_out F32 [1] = max |h| (NaN if any h is NaN).
void moe_swiglu_scaled_amax(Context& ctx, const Tensor& x, const Tensor& scale, Tensor& amax_out);
// amax_out as moe_fp8_cast_rows's: max |h| folded in from the cast's own pass.
MoEFp8Rows moe_swiglu_scaled_cast(Context& ctx, const Tensor& x, const Tensor& scale, const Tensor& fp8_scale,
                                  const std::vector<int64_t>& split_sizes, DType fp8, Tensor* amax_out = nullptr);

// The scaled SwiGLU backward straight to FP8: d_scale [M] (OVERWRITTEN) and dx [M, 2F] cast
// with current scaling, with exactly the codes and scale of moe_swiglu_scaled_backward into
// a dx of x's dtype, then moe_fp8_quantize_rows of it with the amax it reduced. On CUDA (BF16
// x and dy, F % 8 == 0) two passes over x and dy, dx never stored: d_scale and dx's amax,
// then dx recomputed and cast with both copies (backend/cuda/moe_swiglu.cu); elsewhere that
// composition.
MoEFp8Rows moe_swiglu_scaled_backward_quantize(Context& ctx, const Tensor& x, const Tensor& scale, const Tensor& dy,
                                               const std::vector<int64_t>& split_sizes, DType fp8,
                                               const MoEFp8Options& options, Tensor& d_scale);
// The same with the FP8 scale given (delayed scaling): ONE pass over x and dy on CUDA (the
// cases above), which writes d_scale (from per-tile partial sums, reduced in a fixed order:
// deterministic, though not the bits of the two-pass form's sums), the codes of BF16(dx) and
// folds max |BF16(dx)| into amax_out (when given). Elsewhere: the BF16 dx stored, its amax
// folded in, then moe_fp8_cast_rows.
MoEFp8Rows moe_swiglu_scaled_backward_cast(Context& ctx, const Tensor& x, const Tensor& scale, const Tensor& dy,
                                           const Tensor& fp8_scale, const std::vector<int64_t>& split_sizes, DType fp8,
                                           Tensor& d_scale, Tensor* amax_out = nullptr);

// The FP8 grouped GEMMs, per expert fp8_gemm (cuBLASLt on CUDA, the dequantized reference
// on the CPU); the same row conventions as the BF16 ones:
//   forward  y_e  = x_e W_e^T     (x.data; fast accumulation, as Transformer Engine's forward)
//   dgrad    dx_e = dy_e W_e      (dy.data, W's data_t), OVERWRITTEN
//   wgrad    dw_e += dy_e^T x_e   (both padded data_t; F32 dw, beta = 1), ACCUMULATES
//            (accumulate false: OVERWRITES, beta 0, experts without rows zeroed)
// y / dx rows past the split sum are zero.
void grouped_linear_forward_fp8(Context& ctx, const MoEFp8Rows& x, const MoEFp8Weights& w, Tensor& y);
void grouped_linear_backward_input_fp8(Context& ctx, const MoEFp8Rows& dy, const MoEFp8Weights& w, Tensor& dx);
void grouped_linear_backward_weight_fp8(Context& ctx, const MoEFp8Rows& dy, const MoEFp8Rows& x, Tensor& dw,
                                        bool accumulate = true);

// How many CUDA streams GroupedLinear spreads its experts' GEMMs over (process-wide; 1, the
// default: every GEMM on the context's stream, one after another; at most 4, more act as 4).
void set_grouped_gemm_streams(int streams);
int grouped_gemm_streams();

}  // namespace tessera
