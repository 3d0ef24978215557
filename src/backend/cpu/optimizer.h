#pragma once
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/ops/optimizer.h"
namespace tessera::cpu {
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWOptions& options);
void global_grad_norm(const std::vector<Tensor>& grads, Tensor& norm_out);
void adamw_step_multi(std::vector<Tensor>& params, const std::vector<Tensor>& grads, std::vector<Tensor>& exp_avgs,
                      std::vector<Tensor>& exp_avg_sqs, std::vector<Tensor>& bf16_values, const AdamWOptions& options,
                      const std::vector<float>& weight_decays, const Tensor& grad_norm, double max_norm);
}  // namespace tessera::cpu
