#pragma once
#include "tessera/core/tensor.h"
#include "tessera/ops/moe.h"
namespace tessera::cpu {
void moe_router_forward(const Tensor& logits, const Tensor& expert_bias, const RouterOptions& options, Tensor& scores,
                        Tensor& probs, Tensor& indices, Tensor& counts, Tensor& losses);
void moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& indices, const Tensor& d_probs,
                         const RouterOptions& options, float loss_scale, Tensor& d_logits);
void moe_update_expert_bias(const Tensor& load, float rate, Tensor& bias);
void moe_routing_map(const Tensor& indices, int64_t num_experts, Tensor& row_map, Tensor& offsets);
void moe_permute_forward(const Tensor& x, const Tensor& row_map, const Tensor& probs, Tensor& permuted,
                         Tensor& permuted_probs);
void moe_permute_backward(const Tensor& row_map, const Tensor& d_permuted, const Tensor& d_permuted_probs, Tensor& dx,
                          Tensor& d_probs);
void moe_unpermute_forward(const Tensor& expert_out, const Tensor& row_map, const Tensor& probs, Tensor& y);
void moe_unpermute_backward(const Tensor& expert_out, const Tensor& row_map, const Tensor& probs, const Tensor& dy,
                            Tensor& d_expert_out, Tensor& d_probs);
void moe_swiglu_scaled_forward(const Tensor& x, const Tensor& scale, Tensor& y);
void moe_swiglu_scaled_backward(const Tensor& x, const Tensor& scale, const Tensor& dy, Tensor& dx, Tensor& d_scale);
// FP8 codes data [M, K] -> data_t [K, P] with expert e's rows at columns padded[e].. and
// zeros in the padding columns (ops/moe.h, MoEFp8Rows).
void moe_fp8_transpose_padded(const Tensor& data, const std::vector<int64_t>& splits,
                              const std::vector<int64_t>& padded, Tensor& data_t);
}  // namespace tessera::cpu
