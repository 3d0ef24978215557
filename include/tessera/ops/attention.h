// Scaled dot-product attention: the reference (unfused) forward and backward, with
// causal masking and grouped-query attention (GQA / MQA).
//
// Layout is [batch, seq, heads, head_dim], what a fused QKV projection produces:
//   q, out, d_out, dq : [B, T, Hq, D]      (T queries)
//   k, v, dk, dv      : [B, S, Hkv, D]     (S keys)
//   lse               : [B, Hq, T]
// Hq must be a multiple of Hkv; query head h reads kv head h / (Hq / Hkv) (Hkv = Hq is
// plain multi-head attention, Hkv = 1 is multi-query attention).
//
// lse is contiguous; the others are contiguous or head slices of a contiguous [B, T, H', D]
// buffer (tokens at a common stride: Q, K and V sliced from a fused QKV projection, dQ, dK, dV
// written into slices of its gradient). q, k, v, out, d_out, dq, dk, dv share one floating dtype;
// lse is F32 or F64 (use F64 with F64 inputs, or backward recomputes the probabilities
// only to F32 precision). The reference computes in double for F64 tensors and in float
// otherwise (BF16, F16, FP8 are upcast exactly). Outputs are preallocated by the caller
// and must not overlap the inputs.
//
// This is the numerical reference the fused (FlashAttention-style) kernels are tested
// against, not the fast path: it is O(T * S * D) work per head with no tiling.
#pragma once

#include <string>
#include <vector>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera {

struct AttentionOptions {
  // Causal masking, aligned to the bottom-right corner of the T x S score matrix (as
  // FlashAttention does for a KV cache): query i (0-based, of T) sees keys j <= i + (S - T).
  // With S == T this is the usual lower triangle; with T == 1 the one query sees every key.
  // S < T is an error, since the first queries would see no key at all.
  bool causal = false;
  // Multiplies q . k before the softmax; 0 means 1 / sqrt(D).
  float scale = 0;
};

// out[b, t, h, :] = sum_j P[t, j] v[b, j, kvh, :], where
//   scores[t, j] = scale * q[b, t, h, :] . k[b, j, kvh, :]   (masked keys: -infinity)
//   P[t, :]      = softmax(scores[t, :])
//   lse[b, h, t] = log(sum_j exp(scores[t, j]))
// and kvh = h / (Hq / Hkv). lse is what backward needs to rebuild P without storing the
// T x S matrix (as FlashAttention saves it).
void attention_forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       const AttentionOptions& options = {});

// Gradients of attention_forward given d_out = dL/dout and the forward's out and lse:
//   P  = exp(scores - lse)           dV = P^T dO        dP = dO V^T
//   Di = rowsum(dO * O)              dS = P * (dP - D)
//   dQ = scale * dS K                dK = scale * dS^T Q
// dk and dv of a kv head are summed over the query heads of its group. q, k and v are
// activations, so dq, dk and dv are OVERWRITTEN (not accumulated into).
void attention_backward(Context& ctx, const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                        const AttentionOptions& options = {});

// ---- Which implementation runs attention on CUDA ------------------------------------------
//
// Two backends serve BF16 / F16 attention on CUDA: tessera's own FlashAttention-2-style
// kernels, and cuDNN's fused flash attention (built through the cuDNN backend graph API,
// when the build has cuDNN). Both write the same out and the same lse (natural-log
// log-sum-exp, [B, Hq, T] F32), so a forward of one and a backward of the other agree.
//  - Auto (the default): the first time a shape is seen (batch, lengths, heads, head dim,
//    dtype, causal, device), if both backends can run it, forward+backward of each is
//    timed once on scratch tensors of that shape and the faster is kept for that shape;
//    one line on stderr says which and why. Run the first step of a shape outside CUDA
//    graph capture (the timing synchronises the stream).
//  - Tessera: always tessera's kernels.
//  - Cudnn: cuDNN where it can run the shape; elsewhere tessera's kernels, with a one-time
//    note on stderr (training never fails for the choice).
// The environment variable TESSERA_ATTENTION_BACKEND=auto|tessera|cudnn sets the initial
// value. The setting is process-wide; CPU contexts ignore it.
enum class AttentionBackend { Auto, Tessera, Cudnn };

void set_attention_backend(AttentionBackend backend);
AttentionBackend attention_backend();
// "auto", "tessera" or "cudnn" (case-insensitive); Error on anything else.
AttentionBackend parse_attention_backend(const std::string& name);
const char* attention_backend_name(AttentionBackend backend);
// The lines printed so far for the choices Auto made (and for Cudnn requests that fell
// back), oldest first; empty without CUDA.
std::vector<std::string> attention_backend_choices();
// Forgets every per-shape choice and the report, so the next call of each shape decides
// again (for tests and benchmarks).
void clear_attention_backend_choices();

// ---- Deterministic backward -------------------------------------------------------------
//
// On (the default), tessera's CUDA attention backward is bitwise repeatable: every gradient
// element has one writer (a dK/dV pass, then a dQ pass that recomputes the scores and dP).
// Off, tessera's tensor-core backward (BF16, D = 64 / 128) computes dQ inside the dK/dV pass
// and sums the key blocks' contributions with FP32 atomic adds into a scratch buffer, as
// FlashAttention-2 (and cuDNN by default) do: 5 matrix products instead of 7, so faster,
// but the order of the additions varies from run to run and so do dQ's last bits (dK, dV
// stay repeatable). The setting is process-wide; CPU contexts, the generic CUDA kernels and
// cuDNN ignore it (training.deterministic_attention in a training config sets it).
void set_attention_deterministic(bool deterministic);
bool attention_deterministic();

}  // namespace tessera
