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
// Every tensor is contiguous. q, k, v, out, d_out, dq, dk, dv share one floating dtype;
// lse is F32 or F64 (use F64 with F64 inputs, or backward recomputes the probabilities
// only to F32 precision). The reference computes in double for F64 tensors and in float
// otherwise (BF16, F16, FP8 are upcast exactly). Outputs are preallocated by the caller
// and must not overlap the inputs.
//
// This is the numerical reference the fused (FlashAttention-style) kernels are tested
// against, not the fast path: it is O(T * S * D) work per head with no tiling.
#pragma once

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

}  // namespace tessera
