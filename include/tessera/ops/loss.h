// Cross-entropy loss over a vocabulary, the training objective of a language model.
//
// logits [N, V] (row-major, any floating dtype), targets [N] (I32 or I64). Rows whose
// target equals ignore_index (padding, prompt tokens) contribute neither loss nor gradient.
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera {

struct CrossEntropyOptions {
  int64_t ignore_index = -100;
};

// lse[n]  = log(sum_v exp(logits[n, v]))                 (max-subtracted, so 1e4 logits stay finite)
// loss[0] = (1 / n_valid) * sum over valid n of (lse[n] - logits[n, targets[n]])
// n_valid is the number of rows whose target is not ignore_index. With no valid row the
// loss is 0 (not NaN), so a batch made only of padding adds nothing.
// loss is [1], F32 or F64. lse is [N], the statistic saved for the backward: F64 when
// logits are F64, F32 otherwise; ignored rows get their lse too. Both are overwritten.
// Computes in double when logits are F64, otherwise in float, with row sums in double.
// A target outside [0, V) that is not ignore_index throws Error.
void cross_entropy_forward(Context& ctx, const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse,
                           const CrossEntropyOptions& options = {});

// d_logits[n, v] = d_loss * (exp(logits[n, v] - lse[n]) - [v == targets[n]]) / n_valid
// for valid rows, and 0 for ignored rows (all zero when no row is valid). logits are an
// activation, so d_logits is OVERWRITTEN. d_logits is [N, V], any floating dtype; lse is
// the one cross_entropy_forward produced for the same logits. d_logits may be logits
// itself, so the gradient replaces the logits in place and saves an [N, V] buffer; no
// other overlap is allowed.
void cross_entropy_backward(Context& ctx, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            float d_loss, Tensor& d_logits, const CrossEntropyOptions& options = {});

// cross_entropy_forward, then cross_entropy_backward with the lse it wrote (same rules,
// same arguments), where the backend can in one pass over the logits: on CUDA, F32 or
// BF16 logits with d_logits of their dtype, 16-byte aligned rows whose strides are
// multiples of 8 and 16384 <= V <= 262144 (an LM head's vocabulary) are read once instead
// of twice (backend/cuda/loss_fused.cu; off by default while it is slower than the two
// kernels, see docs/ops/loss.md: TESSERA_CROSS_ENTROPY_FUSED=1 turns it on). lse may then differ from cross_entropy_forward's
// in the last bit (a two-pass instead of an online sum). d_logits may be logits itself.
void cross_entropy_forward_backward(Context& ctx, const Tensor& logits, const Tensor& targets, Tensor& loss,
                                    Tensor& lse, float d_loss, Tensor& d_logits,
                                    const CrossEntropyOptions& options = {});

// The FP8 LM head's backward (models/transformer_lm.cpp): q[n, v] = fp8(bf16(d_logits[n, v])
// * fp8_scale) for v < V, the codes quantize_per_tensor gives for the BF16 gradient that
// cross_entropy_backward writes, and code 0 for V <= v < W (vocabulary padding). logits
// [N, V] (row-strided), q [N, W] contiguous E4M3 or E5M2 with W >= V, fp8_scale F32 [1],
// all on ctx's device; q is OVERWRITTEN. On CUDA, BF16 logits with 16-byte aligned rows and
// W % 8 == 0 take one kernel (backend/cuda/loss_fp8.cu) that never writes the BF16
// gradient; otherwise (and on the CPU) the BF16 gradient is written to a scratch buffer and
// cast. The codes are the same either way (the CUDA backward's and cast's arithmetic).
void cross_entropy_backward_fp8(Context& ctx, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                                float d_loss, const Tensor& fp8_scale, Tensor& q,
                                const CrossEntropyOptions& options = {});

// A training step's loss kept on the device (a step captured into a CUDA graph reads it
// once, after the replay, instead of once per micro-batch):
//   total  = 0;  for i in 0..n-1:  total = total + double(chunk_losses[i]) * weights[i]
//   acc[0] = acc[0] + total / divisor
// in double, in this order, each operation rounded once (no fused multiply-add), which is
// the host's own arithmetic: the value is bit for bit what the host computes from the same
// chunk losses (TransformerLM's weighted mean of its head chunks, divided by the number of
// micro-batches). chunk_losses: [n] F32 or F64 (n = weights.size(), may be 0); acc: F64
// [1], read and written; divisor > 0. No host synchronisation, nothing copied from the
// host (the weights travel as kernel arguments), so it can be captured.
void accumulate_weighted_loss(Context& ctx, const Tensor& chunk_losses, const std::vector<double>& weights,
                              double divisor, Tensor& acc);

}  // namespace tessera
