// Which dK/dV kernel the tensor-core attention backward runs: the software-pipelined one
// (attention_bwd_dkdv_v2.cuh, the default) or the legacy one (attention_bwd.cu's
// attention_dkdv_kernel), for side-by-side timing (bench/attention_bench.cu). The default
// comes from the environment once: TESSERA_ATTN_BWD_LEGACY=1 picks the legacy kernel.
// Both give bitwise the same dK, dV (and dQ partials in the atomic variant).
#pragma once

namespace tessera::cuda {

bool attention_backward_legacy();
void set_attention_backward_legacy(bool legacy);

}  // namespace tessera::cuda
