// CUDA multi-tensor optimizer kernels (backend/cuda/multi_tensor.cu): the global gradient
// norm and the fused AdamW step over whole lists of tensors. Declarations only; usable
// from C++. Empty tensors are skipped and may have any dtype.
#pragma once

#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/ops/optimizer.h"

namespace tessera::cuda {

// grads all F32 or all BF16; norm_out F32 or F64.
bool global_grad_norm_supported(const std::vector<Tensor>& grads, const Tensor& norm_out);
void global_grad_norm(void* stream, const std::vector<Tensor>& grads, Tensor& norm_out, MultiTensorCache& cache);

// params (and so the moments) F32; grads all F32 or all BF16; values BF16 or undefined;
// grad_norm F32, F64 or undefined (max_norm == 0). Bit-identical to the CPU reference.
// step_scalars: undefined, or F64 [4] on the device (adamw_step_scalars' layout), whose lr,
// step size and bias correction replace those of options.
bool adamw_step_multi_supported(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                                const Tensor& grad_norm);
void adamw_step_multi(void* stream, std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                      std::vector<Tensor>& exp_avgs, std::vector<Tensor>& exp_avg_sqs,
                      std::vector<Tensor>& bf16_values, const AdamWOptions& options,
                      const std::vector<float>& weight_decays, const Tensor& grad_norm, double max_norm,
                      MultiTensorCache& cache, const Tensor& step_scalars = Tensor());

// AdamW on one [E, N, K] weight (param F32 [E*N, K] or [E, N, K], grad F32 or BF16, value
// BF16 or undefined (not written), all 16-byte aligned; K % 8 == 0, N % 8 == 0) fused with
// the cast of the new BF16 value:
// data [E, N, K] and data_t [E, K, N] (E4M3 or E5M2) with scale[e] (F32 [E]), max |value|
// of expert e folded into amax[e] (F32 bits, NaN sticky). The update's bits are
// adamw_step_multi's; the codes are moe_weight_cast's of the new BF16 value.
bool adamw_step_fp8_cast_supported(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                                   const Tensor& exp_avg_sq, const Tensor& value, const Tensor& grad_norm,
                                   const Tensor& data);
void adamw_step_fp8_cast(void* stream, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                         Tensor& value, const AdamWOptions& options, float weight_decay, const Tensor& grad_norm,
                         double max_norm, const Tensor& scale, Tensor& amax, Tensor& data, Tensor& data_t);

}  // namespace tessera::cuda
