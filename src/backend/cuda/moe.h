// CUDA kernels of the MoE ops (backend/cuda/moe.cu). Declarations only; usable from C++.
// Semantics are those of include/tessera/ops/moe.h and the CPU reference.
#pragma once

#include <initializer_list>

#include "tessera/core/tensor.h"
#include "tessera/ops/moe.h"

namespace tessera::cuda {

// Router: logits F32 or BF16 (scores F32), probs F32 or BF16, losses F32 or F64, E <= 1024.
bool moe_router_supported(const Tensor& logits, const Tensor& probs, const Tensor& losses, const RouterOptions& options);
void moe_router_forward(void* stream, const Tensor& logits, const Tensor& expert_bias, const RouterOptions& options,
                        Tensor& scores, Tensor& probs, Tensor& indices, Tensor& counts, Tensor& losses);
bool moe_router_backward_supported(const Tensor& logits, const Tensor& scores, const Tensor& d_probs,
                                   const Tensor& d_logits, const RouterOptions& options);
void moe_router_backward(void* stream, const Tensor& logits, const Tensor& scores, const Tensor& indices,
                         const Tensor& d_probs, const RouterOptions& options, float loss_scale, Tensor& d_logits);

// Routing map: per-expert ranks, counts and offsets computed on the device (no host sync).
void moe_routing_map(void* stream, const Tensor& indices, int64_t num_experts, Tensor& row_map, Tensor& offsets);

// Data movement: the `main` tensors all F32 or all BF16; each defined `extra` tensor (the
// probabilities and scales) F32 or BF16.
bool moe_permute_supported(std::initializer_list<const Tensor*> main, std::initializer_list<const Tensor*> extra);
void moe_permute_forward(void* stream, const Tensor& x, const Tensor& row_map, const Tensor& probs, Tensor& permuted,
                         Tensor& permuted_probs);
void moe_permute_backward(void* stream, const Tensor& row_map, const Tensor& d_permuted, const Tensor& d_permuted_probs,
                          Tensor& dx, Tensor& d_probs);
void moe_unpermute_forward(void* stream, const Tensor& expert_out, const Tensor& row_map, const Tensor& probs, Tensor& y);
void moe_unpermute_backward(void* stream, const Tensor& expert_out, const Tensor& row_map, const Tensor& probs,
                            const Tensor& dy, Tensor& d_expert_out, Tensor& d_probs);
// The scaled SwiGLU (moe_swiglu.cu): x, y / dy, dx all F32 or all BF16. legacy: the scalar
// one-block-per-row kernels even where the vector ones apply (TESSERA_MOE_LEGACY, to time both).
void moe_swiglu_scaled_forward(void* stream, const Tensor& x, const Tensor& scale, Tensor& y, bool legacy = false);
// dx_amax (F32 [1], optional): max |dx| of the stored values, from the same pass.
void moe_swiglu_scaled_backward(void* stream, const Tensor& x, const Tensor& scale, const Tensor& dy, Tensor& dx,
                                Tensor& d_scale, Tensor* dx_amax = nullptr, bool legacy = false);

}  // namespace tessera::cuda
