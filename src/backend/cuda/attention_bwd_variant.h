// Which dK/dV kernel the tensor-core attention backward runs: the software-pipelined one
// (attention_bwd_dkdv_v2.cuh, the default) or the legacy one (attention_bwd.cu's
// attention_dkdv_kernel), for side-by-side timing (bench/attention_bench.cu). The default
// comes from the environment once: TESSERA_ATTN_BWD_LEGACY=1 picks the legacy kernel.
// Both give bitwise the same dK, dV (and dQ partials in the atomic variant).
#pragma once

namespace tessera::cuda {

bool attention_backward_legacy();
void set_attention_backward_legacy(bool legacy);

// Whether the backward runs the Hopper wgmma kernel (attention_bwd_wgmma.cu) where it can:
// the default. Atomic (set_attention_deterministic(false)): that kernel does everything;
// deterministic at D = 128: it computes dK and dV and the mma.sync dQ pass follows. TESSERA_ATTN_BWD_WGMMA=0
// (read once) or set_attention_backward_wgmma(false) keep the mma.sync dK/dV kernel above,
// which other GPUs run anyway. The two give dK, dV and dQ equal to rounding, not bitwise.
bool attention_backward_wgmma();
void set_attention_backward_wgmma(bool on);

}  // namespace tessera::cuda
