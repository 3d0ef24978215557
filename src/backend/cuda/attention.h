// Scaled dot-product attention on the GPU (backend/cuda/attention_*.cu). Shapes, dtypes and
// devices are checked by the front end (src/ops/attention.cpp); `scale` is the resolved
// softmax scale (never 0). Layout as in include/tessera/ops/attention.h:
//   q, out, d_out, dq [B, T, Hq, D];  k, v, dk, dv [B, S, Hkv, D];  lse [B, Hq, T].
//
// Three paths behind one entry point each:
//  - cuDNN (attention_cudnn.cu, when the build has cuDNN): BF16 / F16 with lse F32, head
//    dim a multiple of 8; taken when tessera::attention_backend() says so (Auto: whichever
//    was faster for the shape, timed once; attention_select.cu);
//  - fast (attention_fwd.cu, attention_bwd.cu): BF16 with D = 64 or 128, lse F32, 16-byte
//    aligned pointers; FlashAttention-2-style tiles on the tensor cores (mma.sync);
//  - generic (attention_generic.cu): every other floating dtype except F64 (F32, BF16,
//    F16, E4M3, E5M2), any head dim, lse F32 or F64; plain CUDA cores, correct but slow.
#pragma once

#include <initializer_list>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// Whether attention_forward / attention_backward below run these dtypes (everything
// floating except F64 inputs).
bool attention_supported(const Tensor& q, const Tensor& lse);

void attention_forward(void* stream, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       bool causal, float scale);
void attention_backward(void* stream, const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, bool causal,
                        float scale);

// ---- The pieces, for the dispatcher and for benchmarks that check one path against the other.

// True when the tensor-core path takes these tensors.
bool attention_fast_path(const Tensor& q, const Tensor& k, const Tensor& lse,
                         std::initializer_list<const Tensor*> others);

// variant: the tile shape, for benchmarks. 0-2 are in attention_fwd.cu
// (0: 4 warps x 32 rows, 64-key tiles; 1: 8 warps x 16 rows; 2: 32-key tiles); 3 to
// kLastAttentionForwardVariant are experiments on the D = 128 register problem in
// attention_fwd_variants.cu (fewer rows per warp, Q in registers, 3-stage pipelines, a
// cheaper online softmax). Numbers past the last run variant 0.
// Variants 16-19 are the Hopper kernel on wgmma and TMA (attention_fwd_wgmma.cu) in four
// schedules (attention_fwd_variants.h, WgmmaMode): 16 serial, 17 software-pipelined (the
// softmax of one key tile beside the P V product of the previous one), 18 pipelined with the
// two warpgroups taking turns on the tensor cores, 19 serial with the scale folded into
// exp2 and O rescaled only when a row max moved; 20-23 are 17 and 18 on 96- and 80-key tiles
// (fewer live registers; measured 270-309 at D = 128, slower than 19). On other GPUs they
// run variant 9.
// The default (variant < 0) depends on the head dim, as measured on the H200 (2026-11-30,
// bench_attention 20, causal, tenth session):
//  - D = 128: variant 19, 455.0 TFLOP/s at B=4 H=32 T=4096 against 449.6 for 16 and 309.1
//    for 9 in the same run (17 and 18 spill: 305 and 274);
//  - D = 64: variant 9 (variant 0's tiles with a cheaper softmax), 221.3 at B=16 H=12 T=1024
//    against 204.0 for 19 (but 258.7 against 271.6 at B=4 Hq=32 Hkv=8 T=2048).
inline constexpr int kWgmmaForwardVariant = 16;
inline constexpr int kLastAttentionForwardVariant = 23;
inline int default_attention_forward_variant(int64_t head_dim) { return head_dim == 128 ? 19 : 9; }
void attention_forward_fast(void* stream, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                            Tensor& lse, bool causal, float scale, int variant = -1);
// deterministic: the dK/dV pass plus a separate dQ pass, bitwise repeatable (the default);
// false: dQ accumulated inside the dK/dV pass with FP32 atomics into a scratch buffer and
// converted at the end (FlashAttention-2's scheme: fewer products, faster, run-to-run
// differences in dQ's last bits). attention_backward passes tessera::attention_deterministic().
void attention_backward_fast(void* stream, const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, bool causal,
                             float scale, bool deterministic = true);

void attention_forward_generic(void* stream, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                               Tensor& lse, bool causal, float scale);
void attention_backward_generic(void* stream, const Tensor& d_out, const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk,
                                Tensor& dv, bool causal, float scale);

// Whether cuDNN runs this call (attention_select.cu), following tessera::attention_backend():
// Tessera never; Cudnn whenever cuDNN can (else a one-time note on stderr); Auto as timed
// for the shape on its first call (both directions, on scratch tensors, printing one line).
// The backward asks with the same shape key, so it follows the forward's choice. The first
// call of a shape must not be inside CUDA graph capture (the timing synchronises); under
// capture an unseen shape runs tessera's kernels and is decided at its next uncaptured call.
bool attention_use_cudnn_forward(void* stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                 const Tensor& lse, bool causal, float scale);
bool attention_use_cudnn_backward(void* stream, const Tensor& d_out, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dq,
                                  const Tensor& dk, const Tensor& dv, bool causal, float scale);
// The lines printed for the choices so far, and forgetting them (with the choices).
std::vector<std::string> attention_backend_choice_log();
void clear_attention_backend_choice_log();

// delta[b, h, t] = sum_d d_out[b, t, h, d] * out[b, t, h, d] in F32 (any dtype but F64);
// delta is a contiguous F32 tensor of B * Hq * T elements. Shared by both backward paths.
void attention_backward_delta(void* stream, const Tensor& d_out, const Tensor& out, Tensor& delta);

}  // namespace tessera::cuda
