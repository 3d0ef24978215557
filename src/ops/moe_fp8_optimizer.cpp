// moe_fp8_adamw_cast_weights (include/tessera/ops/moe.h): an expert weight's AdamW update
// with its FP8 cast for the next step in the same pass (fp8.cast_in_optimizer). On CUDA one
// kernel (backend/cuda/multi_tensor.cu, adamw_cast_kernel); elsewhere, and for shapes it does
// not take, the composition it equals bit for bit: adamw_step_multi on the one tensor, then
// each expert's amax and fp8::quantize_with_transpose of its new BF16 value (in a scratch
// tensor when the caller leaves the value unwritten).
#include <cmath>
#include <limits>

#include "dispatch.h"
#include "moe_checks.h"
#include "optimizer_checks.h"
#include "tessera/ops/moe.h"
#include "tessera/ops/quantize.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/multi_tensor.h"
#endif

namespace tessera {

using moe_detail::fold_amax_into;

void moe_fp8_adamw_cast_weights(Context& ctx, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                                Tensor& value, const AdamWOptions& options, float weight_decay,
                                const Tensor& grad_norm, double max_norm, MoEFp8WeightCast& out) {
  const char* op = "moe_fp8_adamw_cast_weights";
  TESSERA_CHECK(out.data.defined() && out.data.dim() == 3 && out.data.is_contiguous() &&
                    (out.data.dtype() == DType::E4M3 || out.data.dtype() == DType::E5M2),
                op, ": data must be a contiguous E4M3 or E5M2 [E, N, K] tensor, got ", out.data.describe());
  const int64_t experts = out.data.size(0), n = out.data.size(1), k = out.data.size(2);
  TESSERA_CHECK(out.data_t.defined() && out.data_t.is_contiguous() && out.data_t.dtype() == out.data.dtype() &&
                    (out.data_t.shape() == Shape{experts, k, n}),
                op, ": data_t must be a contiguous ", dtype_name(out.data.dtype()), " [", experts, ", ", k, ", ", n,
                "] tensor, got ", out.data_t.describe());
  for (const Tensor* t : {&out.scale, &out.amax})
    TESSERA_CHECK(t->defined() && t->is_contiguous() && t->dtype() == DType::F32 && (t->shape() == Shape{experts}), op,
                  ": scale and amax must be contiguous F32 [", experts, "] tensors, got ", t->describe());
  TESSERA_CHECK(param.defined() && param.numel() == experts * n * k &&
                    (!value.defined() || (value.numel() == param.numel() && value.dtype() == DType::BF16)),
                op, ": param (", param.describe(), ") and its BF16 value (", value.describe(), ", or undefined) must ",
                "hold ", experts, " x ", n, " x ", k, " elements");
  check_on_device(ctx, op, {&out.data, &out.data_t, &out.scale, &out.amax});
  // The update's own operands, as adamw_step_multi checks them for this one tensor.
  std::vector<Tensor> params{param}, grads{grad}, avgs{exp_avg}, avg_sqs{exp_avg_sq}, values{value};
  check_adamw_step_multi(ctx, op, params, grads, avgs, avg_sqs, values, options, {weight_decay}, grad_norm, max_norm,
                         Tensor());
  const DType fp8 = out.data.dtype();
#if TESSERA_WITH_CUDA
  if (ctx.device.is_cuda() &&
      cuda::adamw_step_fp8_cast_supported(param, grad, exp_avg, exp_avg_sq, value, grad_norm, out.data)) {
    cuda::adamw_step_fp8_cast(ctx.stream, param, grad, exp_avg, exp_avg_sq, value, options, weight_decay, grad_norm,
                              max_norm, out.scale, out.amax, out.data, out.data_t);
    return;
  }
#endif
  // Without a value to write, the codes come from a scratch copy of the new BF16 weights.
  if (!value.defined()) values[0] = Tensor::empty(param.shape(), DType::BF16, ctx.device);
  adamw_step_multi(ctx, params, grads, avgs, avg_sqs, values, options, {weight_decay}, grad_norm, max_norm);
  const Tensor w = values[0].reshape({experts, n, k});
  for (int64_t e = 0; e < experts; ++e) {
    const Tensor we = w.select(0, e);
    Tensor a = Tensor::empty({1}, DType::F32, ctx.device);
    amax(ctx, we, a);
    Tensor target = out.amax.slice(0, e, e + 1);
    fold_amax_into(ctx, a, target);
    const fp8::QuantizedTensor q = fp8::quantize_with_transpose(ctx, we, out.scale.slice(0, e, e + 1), fp8);
    Tensor data = out.data.select(0, e), data_t = out.data_t.select(0, e);
    data.copy_from(q.data);
    data_t.copy_from(q.data_t);
  }
}

MoEFp8Weights moe_fp8_weights_from_cast(Context& ctx, const MoEFp8WeightCast& cast, const MoEFp8Options& o) {
  const char* op = "moe_fp8_weights_from_cast";
  const int64_t experts = cast.data.size(0);
  TESSERA_CHECK(o.delayed && o.delayed_base >= 0 && o.delayed_base + MoEFp8Options::delayed_slots(experts) <= o.delayed->size(),
                op, ": needs the delayed-scaling state with the layer's ", MoEFp8Options::delayed_slots(experts), " slots");
  MoEFp8Weights q;
  q.experts.resize(static_cast<size_t>(experts));
  q.scales.resize(static_cast<size_t>(experts));
  std::vector<int64_t> all(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) all[static_cast<size_t>(e)] = e;
  moe_detail::set_delayed_weight_codes(ctx, cast.data, cast.data_t, all, o, q);
  return q;
}

}  // namespace tessera
