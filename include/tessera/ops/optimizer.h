// Optimizer steps over parameter tensors.
//
// An optimizer updates parameters in place from their gradients; it does not produce
// gradients, so the overwrite / accumulate rule of the other ops does not apply here:
// param, exp_avg and exp_avg_sq are read and updated in place, grad is only read.
//
// Two forms: adamw_step updates one tensor; global_grad_norm and adamw_step_multi work on
// whole lists of tensors (all of a model's parameters) in one or two launches on CUDA,
// with the gradient-clipping factor computed on the device, so that an optimizer step
// needs no host synchronisation.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera {

struct AdamWOptions {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  int64_t step = 1;  // 1-based count of steps taken including this one, for bias correction
};

// One AdamW step with the semantics of PyTorch's torch.optim.AdamW, for every element:
//   p  = p * (1 - lr * weight_decay)                 (decoupled weight decay)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g^2
//   p -= lr * (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps)
// param: F32 or F64 master weights; exp_avg (m) and exp_avg_sq (v): same dtype and shape
// as param, zero before step 1; grad: same shape, any floating dtype (BF16 gradients are
// upcast). Computes in double for F64 params, float otherwise; the bias corrections are
// computed in double. Requires step >= 1, lr >= 0, eps >= 0, weight_decay >= 0 and
// beta1, beta2 in [0, 1), as PyTorch does.
void adamw_step(Context& ctx, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamWOptions& options);

// What the CUDA multi-tensor ops keep between calls on one list of tensors: the device
// table of pointers and sizes (uploaded again, on the stream, only when a pointer or a
// size changed) and scratch for partial sums. Owned by the caller; use one per list and
// per stream, and keep it alive while the list is stepped. Optional: without one the
// table is uploaded on every call (and a copy from pageable memory may wait for the
// stream). The CPU ignores it. Treat the members as private to the ops.
struct MultiTensorCache {
  std::vector<unsigned char> host_table;  // the table last uploaded
  Tensor device_table;                    // the same bytes on the device
  Tensor scratch;                         // F64 partial sums (global_grad_norm)
};

// norm_out[0] = sqrt(sum over every tensor t and element i of grads[t][i]^2): the global
// L2 norm used for gradient clipping, written on the device (no host read).
//   grads: any floating dtypes, contiguous, any shapes (empty tensors allowed, and an
//   empty list gives 0); norm_out: [1], F32 or F64, overwritten.
// Deterministic: each tensor's sum of squares is accumulated in double in a fixed order
// (fixed-size chunks), then rounded to float (to double for F64 gradients), which is the
// value sum_of_squares writes into an F32 [1] slot; the per-tensor values are added in
// double in list order and the square root is taken in double, then rounded to norm_out's
// dtype. (The per-tensor rounding keeps the training optimizer's norm identical to its
// earlier per-tensor implementation; a tensor whose sum of squares exceeds FLT_MAX counts
// as +Inf.) The CUDA kernel orders the additions inside a tensor differently from the CPU
// (its per-tensor doubles differ in the last bits, so almost always round to the same
// floats): the two agree to well within 1e-6 relative, not always bit for bit; each is
// reproducible run to run.
// A NaN or Inf gradient makes the norm NaN or Inf.
void global_grad_norm(Context& ctx, const std::vector<Tensor>& grads, Tensor& norm_out,
                      MultiTensorCache* cache = nullptr);

// AdamW over a list of tensors in one pass, with gradient clipping by the global norm and
// an optional BF16 copy of the updated weights. For every tensor t (all lists the same
// length; bf16_values may also be empty, meaning none):
//   clip = max_norm / (norm + 1e-6)  if max_norm > 0 and norm > max_norm,  else 1
//          (in double from norm = grad_norm[0], read on the device, then rounded to float)
//   g    = clip * grads[t]          (in the compute type; the gradients are not written)
//   adamw_step(params[t], g, exp_avgs[t], exp_avg_sqs[t]) with options, except that the
//          weight decay is weight_decays[t] (options.weight_decay is not used)
//   bf16_values[t] = params[t] rounded to BF16 (nearest even), when bf16_values[t] is defined
// Bit for bit the same as, per tensor: scale(grad, float(clip)) when clip != 1, then
// adamw_step, then cast(param -> bf16 value), i.e. the training optimizer's earlier path
// with the gradient scaled in place (for F32 and F64 gradients; a BF16 gradient is scaled
// in float here, where scale would have rounded it back to BF16).
// Dtypes: params F32 or F64, moments of the param's dtype, grads any floating dtype, values
// BF16; shapes equal per tensor; everything contiguous; no tensor written may overlap any
// other tensor of the call. grad_norm: [1] F32 or F64 (as global_grad_norm writes it);
// it may be undefined when max_norm == 0. max_norm >= 0 (0 disables clipping).
// NaN/Inf: a NaN norm compares false, so clip = 1 and each NaN gradient element turns its
// own parameter and moments NaN; an Inf norm gives clip = 0, so finite gradients become 0
// (the step only decays the moments and weights) and the Inf elements become NaN. This is
// what the earlier per-tensor path did.
//
// step_scalars (optional): the learning rate and step count from memory on ctx's device
// instead of options.lr and options.step, so that a step captured into a CUDA graph
// replays with each step's values (the host writes them there before each replay). F64 [4]
// as adamw_step_scalars lays them out; the kernel reads only these values, the host
// checks them when it computes them. The result is bit for bit that of passing the same
// lr and step in options.
void adamw_step_multi(Context& ctx, std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                      std::vector<Tensor>& exp_avgs, std::vector<Tensor>& exp_avg_sqs,
                      std::vector<Tensor>& bf16_values, const AdamWOptions& options,
                      const std::vector<float>& weight_decays, const Tensor& grad_norm, double max_norm,
                      MultiTensorCache* cache = nullptr, const Tensor& step_scalars = Tensor());

// One tensor's share of an adamw_step_multi call (handles to its tensors and the call's
// scalars), for code that runs the update of some parameters itself
// (train::Optimizer::set_custom_update).
struct AdamWTensorStep {
  Tensor param, grad, exp_avg, exp_avg_sq, value;  // value: the BF16 copy, or undefined
  AdamWOptions options;
  float weight_decay = 0.0f;
  Tensor grad_norm;  // as adamw_step_multi takes it
  double max_norm = 0.0;
};
// adamw_step_multi on that one tensor.
void adamw_step_one(Context& ctx, AdamWTensorStep& step);

// The per-step scalars of an AdamW step, computed on the host by the CPU reference's
// expressions (in double, then rounded to float as the kernels use them) and stored exactly
// as doubles: {lr, step, lr / (1 - beta1^step), sqrt(1 - beta2^step)}. Checks the options
// as adamw_step_multi does.
constexpr int64_t kAdamWStepScalars = 4;
std::array<double, kAdamWStepScalars> adamw_step_scalars(const AdamWOptions& options);

}  // namespace tessera
