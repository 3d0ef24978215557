// The tensor-core attention backward's parameters, shared by the mma.sync kernels
// (attention_bwd.cu) and the Hopper wgmma kernel (attention_bwd_wgmma.cu), and the entry point
// of the latter. CUDA translation units only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention_common.cuh"

namespace tessera::cuda::attn {

// Layout as the forward's: q, d_out, dq [B, T, Hq, D]; k, v, dk, dv [B, S, Hkv, D]; lse and
// delta (rowsum(dO * O)) [B, Hq, T] F32; all contiguous.
struct BwdParams {
  const bf16_t* q;
  const bf16_t* k;
  const bf16_t* v;
  const bf16_t* d_out;
  const float* lse;
  const float* delta;
  bf16_t* dq;
  bf16_t* dk;
  bf16_t* dv;
  int T, S, Hq, Hkv, group;
  float scale;
  float scale_log2;
  bool causal;
  float* dq_accum;  // the atomic variants' unscaled F32 dQ [B, T, Hq, D], zeroed first
};

// The wgmma backward: writes dk and dv and, with with_dq, adds the unscaled dQ into
// p.dq_accum (which the caller zeroes before and converts to BF16 dq = scale * dq_accum
// after); without, dQ is left to the caller (the deterministic backward's own dQ pass) and
// p.dq_accum is not used. False, launching nothing, when this GPU is not Hopper or D is not
// 64 / 128. row_stats: device scratch of backward_wgmma_scratch_floats(batch, p) floats for
// the padded per-row lse and Delta, stream-ordered (the caller's caching allocator; unread
// after the launch's kernels).
bool launch_backward_wgmma(cudaStream_t stream, const BwdParams& p, int D, int64_t batch, float* row_stats,
                           bool with_dq = true);
int64_t backward_wgmma_scratch_floats(int64_t batch, const BwdParams& p);
// Whether launch_backward_wgmma runs for head dimension D on the current device.
bool backward_wgmma_runs(int D);

}  // namespace tessera::cuda::attn
