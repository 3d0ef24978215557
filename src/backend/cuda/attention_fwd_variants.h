// The tensor-core attention forward's parameters, shared by the default kernel
// (attention_fwd.cu) and the experimental tile shapes (attention_fwd_variants.cu), and the
// entry point of the latter. CUDA translation units only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention.h"
#include "attention_common.cuh"

namespace tessera::cuda::attn {

struct FwdParams {
  const bf16_t* q;
  const bf16_t* k;
  const bf16_t* v;
  bf16_t* out;
  float* lse;
  int T, S, Hq, Hkv, group;
  float scale_log2;  // scale * log2(e): the scores live in the log2 domain
  bool causal;
};

// Forward variants 3 .. kLastAttentionForwardVariant (attention.h) of attention_forward_fast;
// D is 64 or 128. The wgmma variants run variant 9 on GPUs other than Hopper. Returns false
// for a variant number it does not know (the caller runs the default).
bool launch_forward_variant(cudaStream_t stream, const FwdParams& p, int D, int variant, int64_t batch_heads,
                            int64_t T);

// What the compiled kernel of a variant (3 and up) uses, for benchmark tables: registers per
// thread, local memory (spills) per thread, dynamic shared memory per block, resident blocks
// per SM. False for an unknown variant.
struct FwdVariantInfo {
  const char* shape;  // e.g. "MT=1 4 warps 64 keys 2 stages Q in regs"
  int registers, local_bytes, smem_bytes, blocks_per_sm;
};
bool forward_variant_info(int D, int variant, FwdVariantInfo* info);

// The wgmma forward (attention_fwd_wgmma.cu) in its three schedules: variants
// kWgmmaForwardVariant + mode (attention.h). False when this GPU cannot run it (not Hopper)
// or D is not 64 / 128: the caller runs variant 9 instead.
enum WgmmaMode : int {
  kSerial = 0,     // each tile's two products waited for at once
  kPipelined = 1,  // the softmax of tile n + 1 beside the P V product of tile n
  kPingPong = 2,   // kPipelined, and the two warpgroups take turns issuing their products
  kSerialFolded = 3,  // kSerial with the scale folded into exp2 and O rescaled only when needed
};
// schedule = variant - kWgmmaForwardVariant: 0-3 the modes above on 128-key tiles; 4, 5
// kPipelined and kPingPong on 96-key tiles; 6, 7 the same on 80-key tiles.
bool launch_forward_wgmma(cudaStream_t stream, const FwdParams& p, int D, int schedule, int64_t batch_heads);
bool forward_wgmma_info(int D, int schedule, FwdVariantInfo* info);

}  // namespace tessera::cuda::attn
