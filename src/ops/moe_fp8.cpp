// The FP8 half of the MoE ops (include/tessera/ops/moe.h, "FP8"): the expert-contiguous
// activation casts with their padded transposes, the expert weight casts, the SwiGLU fused
// with its FP8 cast (forward and backward), and the FP8 grouped GEMMs. Split from ops/moe.cpp.
#include "tessera/ops/moe.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <variant>

#include "backend/cpu/moe.h"
#include "dispatch.h"
#include "moe_checks.h"
#include "tessera/fp8/device_scaling.h"
#include "tessera/ops/quantize.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/gemm_fp8.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/moe_fp8.h"
#include "backend/cuda/fp8_scaling.h"
#include "backend/cuda/moe_weight_cast.h"
#endif

namespace tessera {
namespace {
using namespace moe_detail;
}  // namespace

// ---- FP8 ------------------------------------------------------------------------------------

MoEFp8Options MoEFp8Options::from_recipe(const fp8::Recipe& recipe) {
  MoEFp8Options o;
  o.keep_weight_transpose = recipe.keep_weight_transpose;
  o.defer_weight_grad = recipe.defer_expert_wgrad;
  if (const auto* c = std::get_if<fp8::CurrentScalingConfig>(&recipe.config)) {
    o.format = c->format;
    o.margin = c->margin;
    o.power_of_two_scales = c->power_of_two_scales;
  } else if (const auto* d = std::get_if<fp8::DelayedScalingConfig>(&recipe.config)) {
    o.format = d->format;
    o.margin = d->margin;
  } else if (const auto* b = std::get_if<fp8::BlockScalingConfig>(&recipe.config)) {
    o.format = b->format;
    o.power_of_two_scales = b->power_of_two_scales;
  } else if (const auto* m = std::get_if<fp8::Mxfp8Config>(&recipe.config)) {
    o.format = m->format;
  }
  return o;
}

std::vector<fp8::Role> MoEFp8Options::delayed_roles(int64_t experts) {
  std::vector<fp8::Role> roles = {fp8::Role::Forward, fp8::Role::Gradient};  // x, dy
  roles.insert(roles.end(), static_cast<size_t>(experts), fp8::Role::Forward);
  return roles;
}

Tensor MoEFp8Options::delayed_scale(int64_t slot) const {
  TESSERA_CHECK(delayed, "MoEFp8Options: no delayed-scaling state");
  return delayed->scale(delayed_base + slot);
}

Tensor MoEFp8Options::delayed_amax(int64_t slot) const {
  TESSERA_CHECK(delayed, "MoEFp8Options: no delayed-scaling state");
  return delayed->pending_amax(delayed_base + slot);
}

std::vector<int64_t> moe_fp8_padded_offsets(const std::vector<int64_t>& splits) {
  std::vector<int64_t> padded(splits.size() + 1, 0);
  for (size_t e = 0; e < splits.size(); ++e) padded[e + 1] = padded[e] + (splits[e] + 15) / 16 * 16;
  return padded;
}

namespace {

void check_fp8_dtype(DType fp8, const char* op) {
  TESSERA_CHECK(fp8 == DType::E4M3 || fp8 == DType::E5M2, op, ": the FP8 dtype must be E4M3 or E5M2, got ",
                dtype_name(fp8));
}

void check_scale1(const Tensor& scale, const char* op, const char* name) {
  TESSERA_CHECK(scale.defined() && scale.dtype() == DType::F32 && scale.shape() == Shape{1} && scale.is_contiguous(),
                op, ": ", name, " must be a contiguous f32[1]");
}

// scale_inv = 1.0f / scale[0]: on the device on CUDA (no sync), checked on the host on the CPU
// (quantize_with_transpose's rule, so the codes dequantize the same way).
Tensor reciprocal_scale(Context& ctx, const Tensor& scale, const char* op) {
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    Tensor inv = Tensor::empty({1}, DType::F32, ctx.device);
    cuda::fp8_reciprocal_scale(ctx.stream, scale, inv);
    return inv;
#else
    fail_no_kernel(op, ctx);
#endif
  }
  const float s = scale.data<float>()[0];
  TESSERA_CHECK(s > 0 && std::isfinite(s), op, ": scale must be finite and > 0, got ", s);
  return Tensor::from_floats({1.0f / s}, {1});
}

Tensor current_scale(Context& ctx, const Tensor& amax_value, DType fp8, const MoEFp8Options& o) {
  Tensor scale = Tensor::empty({1}, DType::F32, ctx.device);
  fp8::scale_from_amax(ctx, amax_value, fp8, o.margin, o.power_of_two_scales, scale);
  return scale;
}

MoEFp8Rows empty_rows(Context& ctx, int64_t rows, int64_t cols, const std::vector<int64_t>& splits, DType fp8) {
  MoEFp8Rows q;
  q.dtype = fp8;
  q.splits = splits;
  q.padded_offsets = moe_fp8_padded_offsets(splits);
  q.data = Tensor::empty({rows, cols}, fp8, ctx.device);
  q.data_t = Tensor::empty({cols, q.padded_offsets.back()}, fp8, ctx.device);
  return q;
}

// The rows past the split sum hold zero codes (the CUDA kernels' rule; no GEMM reads them).
void zero_unkept_rows(Tensor& data, const std::vector<int64_t>& splits) {
  const int64_t kept = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  if (kept < data.size(0)) data.slice(0, kept, data.size(0)).fill_zero();
}

// Expert e's share of a MoEFp8Rows: the row block of data or the padded column block of data_t.
fp8::QuantizedTensor rows_of(const MoEFp8Rows& q, size_t e, int64_t row) {
  fp8::QuantizedTensor t;
  t.dtype = q.dtype;
  t.scale_inv = q.scale_inv;
  if (q.data.defined()) t.data = q.data.slice(0, row, row + q.splits[e]);
  return t;
}
fp8::QuantizedTensor columns_of(const MoEFp8Rows& q, size_t e) {
  fp8::QuantizedTensor t;
  t.dtype = q.dtype;
  t.scale_inv = q.scale_inv;
  TESSERA_CHECK(q.data_t.defined(), "grouped_linear_backward_weight_fp8: the transposed codes were dropped");
  t.data_t = q.data_t.slice(1, q.padded_offsets[e], q.padded_offsets[e + 1]);
  return t;
}

void check_rows(const MoEFp8Rows& q, int64_t experts, const char* op, const char* name, bool need_data) {
  TESSERA_CHECK(static_cast<int64_t>(q.splits.size()) == experts && q.padded_offsets.size() == q.splits.size() + 1 &&
                    q.scale_inv.defined() && (!need_data || q.data.defined()),
                op, ": ", name, " is not an FP8 row tensor for ", experts, " experts (or its row-wise codes were dropped)");
}

}  // namespace

MoEFp8Rows moe_fp8_cast_rows(Context& ctx, const Tensor& x, const Tensor& scale, const std::vector<int64_t>& splits,
                             DType fp8, Tensor* amax_out) {
  const char* op = "moe_fp8_cast_rows";
  check_matrix(x, op, "x");
  check_float(x, op, "x");
  check_fp8_dtype(fp8, op);
  check_scale1(scale, op, "scale");
  check_splits(splits, static_cast<int64_t>(splits.size()), x.size(0), op);
  check_on_device(ctx, op, {&x, &scale});
  if (amax_out) {
    check_scale1(*amax_out, op, "amax_out");
    check_on_device(ctx, op, {amax_out});
  }
  MoEFp8Rows q = empty_rows(ctx, x.size(0), x.size(1), splits, fp8);
  q.scale_inv = reciprocal_scale(ctx, scale, op);
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::moe_fp8_cast_supported(x, static_cast<int64_t>(splits.size()))) {
      cuda::moe_fp8_cast_rows(ctx.stream, x, scale, splits, q.padded_offsets, q.data, q.data_t, amax_out);
      return q;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (amax_out) {
    // The kept rows only, as the CUDA kernels read (the rows past them hold no codes).
    const int64_t kept = std::accumulate(splits.begin(), splits.end(), int64_t{0});
    Tensor a = Tensor::zeros({1}, DType::F32);
    if (kept > 0) amax(ctx, x.slice(0, 0, kept), a);
    fold_amax_into(ctx, a, *amax_out);
  }
  quantize_per_tensor(ctx, x, scale, q.data);
  zero_unkept_rows(q.data, splits);
  cpu::moe_fp8_transpose_padded(q.data, splits, q.padded_offsets, q.data_t);
  return q;
}

MoEFp8Rows moe_fp8_quantize_rows(Context& ctx, const Tensor& x, const std::vector<int64_t>& splits, DType fp8,
                                 const MoEFp8Options& o) {
  Tensor a = Tensor::empty({1}, DType::F32, ctx.device);
  amax(ctx, x, a);
  return moe_fp8_cast_rows(ctx, x, current_scale(ctx, a, fp8, o), splits, fp8);
}

MoEFp8Rows moe_fp8_quantize_rows(Context& ctx, const Tensor& x, const Tensor& x_amax, const std::vector<int64_t>& splits,
                                 DType fp8, const MoEFp8Options& o) {
  check_scale1(x_amax, "moe_fp8_quantize_rows", "x_amax");
  return moe_fp8_cast_rows(ctx, x, current_scale(ctx, x_amax, fp8, o), splits, fp8);
}

MoEFp8Rows moe_fp8_cast_rows_for(Context& ctx, const Tensor& x, const std::vector<int64_t>& splits, DType fp8,
                                 const MoEFp8Options& o, int64_t slot, const Tensor& x_amax) {
  if (o.delayed) {
    Tensor a = o.delayed_amax(slot);
    return moe_fp8_cast_rows(ctx, x, o.delayed_scale(slot), splits, fp8, &a);
  }
  return x_amax.defined() ? moe_fp8_quantize_rows(ctx, x, x_amax, splits, fp8, o)
                          : moe_fp8_quantize_rows(ctx, x, splits, fp8, o);
}

void moe_detail::set_delayed_weight_codes(Context& ctx, const Tensor& data, const Tensor& data_t,
                                          const std::vector<int64_t>& experts, const MoEFp8Options& o,
                                          MoEFp8Weights& q) {
  const int64_t first = o.delayed_base + MoEFp8Options::kDelayedWeight, e_count = static_cast<int64_t>(q.experts.size());
  const int64_t a = static_cast<int64_t>(experts.size());
  // The GEMMs' inverse scales, copied where cuBLASLt takes them (16-byte aligned).
  Tensor scale_inv = Tensor::empty({4 * a}, DType::F32, ctx.device);
  const Tensor from = o.delayed->scale_invs().slice(0, first, first + e_count);
#if TESSERA_WITH_CUDA
  if (ctx.device.is_cuda()) cuda::moe_weight_gather_scales(ctx.stream, from, experts, scale_inv);
#endif
  if (!ctx.device.is_cuda())
    for (int64_t i = 0; i < a; ++i) scale_inv.data<float>()[4 * i] = from.data<float>()[experts[static_cast<size_t>(i)]];
  for (int64_t i = 0; i < a; ++i) {
    const int64_t e = experts[static_cast<size_t>(i)];
    fp8::QuantizedTensor& t = q.experts[static_cast<size_t>(e)];
    t.dtype = data.dtype();
    t.data = data.select(0, i);
    if (data_t.defined()) t.data_t = data_t.select(0, i);
    t.scale_inv = scale_inv.slice(0, 4 * i, 4 * i + 1);
    q.scales[static_cast<size_t>(e)] = o.delayed->scale(first + e);
  }
}

namespace {

std::atomic<bool>& legacy_weight_cast_flag() {
  static std::atomic<bool> flag{legacy_from_environment()};
  return flag;
}

#if TESSERA_WITH_CUDA
// The experts with rows in three launches (backend/cuda/moe_weight_cast.cu); each entry of q
// a view into the shared outputs, with the per-expert loop's bytes.
void quantize_weights_one_launch(Context& ctx, const Tensor& w, const std::vector<int64_t>& splits, DType fp8,
                                 const MoEFp8Options& o, MoEFp8Weights& q) {
  std::vector<int64_t> experts;
  for (size_t e = 0; e < splits.size(); ++e)
    if (splits[e] > 0) experts.push_back(static_cast<int64_t>(e));
  if (experts.empty()) return;
  const int64_t a = static_cast<int64_t>(experts.size()), n = w.size(1), k = w.size(2);
  if (o.delayed) {
    // One launch: each expert with its state slot's scale, its amax folded into the slot.
    const int64_t first = o.delayed_base + MoEFp8Options::kDelayedWeight, e_count = w.size(0);
    const Tensor scales = o.delayed->scales().slice(0, first, first + e_count);
    Tensor pending = o.delayed->pending_amaxes().slice(0, first, first + e_count);
    Tensor data = Tensor::empty({a, n, k}, fp8, ctx.device);
    Tensor data_t = o.keep_weight_transpose ? Tensor::empty({a, k, n}, fp8, ctx.device) : Tensor();
    cuda::moe_weight_cast(ctx.stream, w, scales, experts, data, data_t, /*by_expert=*/true, &pending);
    set_delayed_weight_codes(ctx, data, data_t, experts, o, q);
    return;
  }
  Tensor amax_t = Tensor::empty({a}, DType::F32, ctx.device);
  Tensor scale = Tensor::empty({4 * a}, DType::F32, ctx.device);
  Tensor scale_inv = Tensor::empty({4 * a}, DType::F32, ctx.device);
  Tensor data = Tensor::empty({a, n, k}, fp8, ctx.device);
  Tensor data_t = o.keep_weight_transpose ? Tensor::empty({a, k, n}, fp8, ctx.device) : Tensor();
  cuda::moe_weight_amax(ctx.stream, w, experts, amax_t);
  cuda::moe_weight_scales(ctx.stream, amax_t, fp8_max(fp8), o.margin, o.power_of_two_scales, scale, scale_inv);
  cuda::moe_weight_cast(ctx.stream, w, scale, experts, data, data_t);
  for (int64_t i = 0; i < a; ++i) {
    fp8::QuantizedTensor& t = q.experts[static_cast<size_t>(experts[static_cast<size_t>(i)])];
    t.dtype = fp8;
    t.data = data.select(0, i);
    if (data_t.defined()) t.data_t = data_t.select(0, i);
    t.scale_inv = scale_inv.slice(0, 4 * i, 4 * i + 1);
    q.scales[static_cast<size_t>(experts[static_cast<size_t>(i)])] = scale.slice(0, 4 * i, 4 * i + 1);
  }
}
#endif

}  // namespace

void set_moe_fp8_legacy_weight_cast(bool legacy) { legacy_weight_cast_flag() = legacy; }
bool moe_fp8_legacy_weight_cast() { return legacy_weight_cast_flag(); }

MoEFp8Weights moe_fp8_quantize_weights(Context& ctx, const Tensor& w, const std::vector<int64_t>& splits,
                                       const MoEFp8Options& o) {
  const char* op = "moe_fp8_quantize_weights";
  TESSERA_CHECK(w.defined() && w.dim() == 3 && w.is_contiguous(), op, ": w must be a contiguous [E, N, K] tensor");
  check_splits(splits, w.size(0), std::numeric_limits<int64_t>::max(), op);
  if (o.delayed)
    TESSERA_CHECK(o.delayed_base >= 0 && o.delayed_base + MoEFp8Options::delayed_slots(w.size(0)) <= o.delayed->size() &&
                      o.delayed->history().device() == ctx.device,
                  op, ": the delayed-scaling state has no slots ", o.delayed_base, "..",
                  o.delayed_base + MoEFp8Options::delayed_slots(w.size(0)) - 1, " on ", ctx.device.to_string(),
                  " for ", w.size(0), " experts");
  MoEFp8Weights q;
  q.experts.resize(splits.size());
  q.scales.resize(splits.size());
  const DType fp8 = o.forward_dtype();
#if TESSERA_WITH_CUDA
  if (ctx.device.is_cuda() && !moe_fp8_legacy_weight_cast() &&
      cuda::moe_weight_cast_supported(w, o.keep_weight_transpose)) {
    check_on_device(ctx, op, {&w});
    quantize_weights_one_launch(ctx, w, splits, fp8, o, q);
    return q;
  }
#endif
  for (size_t e = 0; e < splits.size(); ++e) {
    if (splits[e] == 0) continue;
    const Tensor we = w.select(0, static_cast<int64_t>(e));
    Tensor a = Tensor::empty({1}, DType::F32, ctx.device);
    amax(ctx, we, a);
    if (o.delayed) {
      // The state's scale; the amax reduced above goes to the pending slot.
      const int64_t slot = MoEFp8Options::kDelayedWeight + static_cast<int64_t>(e);
      Tensor pending = o.delayed_amax(slot);
      fold_amax_into(ctx, a, pending);
      q.scales[e] = o.delayed_scale(slot);
    } else {
      q.scales[e] = current_scale(ctx, a, fp8, o);
    }
    q.experts[e] = fp8::quantize_with_transpose(ctx, we, q.scales[e], fp8);
  }
  return q;
}

void moe_swiglu_scaled_amax(Context& ctx, const Tensor& x, const Tensor& scale, Tensor& amax_out) {
  const char* op = "moe_swiglu_scaled_amax";
  const int64_t f = check_swiglu_input(x, scale, op);
  check_scale1(amax_out, op, "amax_out");
  check_on_device(ctx, op, {&x, &scale, &amax_out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::moe_fp8_cast_supported(x, 1) && cuda::moe_permute_supported({&x}, {&scale})) {
      cuda::moe_swiglu_scaled_amax(ctx.stream, x, scale, amax_out);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  // The reference: h in float (the CPU op's compute type for F32/BF16 x), then its amax.
  Tensor h = Tensor::empty({x.size(0), f}, DType::F32);
  cpu::moe_swiglu_scaled_forward(x, scale, h);
  amax(ctx, h, amax_out);
}

MoEFp8Rows moe_swiglu_scaled_cast(Context& ctx, const Tensor& x, const Tensor& scale, const Tensor& fp8_scale,
                                  const std::vector<int64_t>& splits, DType fp8, Tensor* amax_out) {
  const char* op = "moe_swiglu_scaled_cast";
  const int64_t f = check_swiglu_input(x, scale, op);
  check_fp8_dtype(fp8, op);
  check_scale1(fp8_scale, op, "fp8_scale");
  check_splits(splits, static_cast<int64_t>(splits.size()), x.size(0), op);
  check_on_device(ctx, op, {&x, &scale, &fp8_scale});
  if (amax_out) {
    check_scale1(*amax_out, op, "amax_out");
    check_on_device(ctx, op, {amax_out});
  }
  MoEFp8Rows q = empty_rows(ctx, x.size(0), f, splits, fp8);
  q.scale_inv = reciprocal_scale(ctx, fp8_scale, op);
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::moe_fp8_cast_supported(x, static_cast<int64_t>(splits.size())) &&
        cuda::moe_permute_supported({&x}, {&scale})) {
      cuda::moe_swiglu_scaled_cast(ctx.stream, x, scale, fp8_scale, splits, q.padded_offsets, q.data, q.data_t,
                                   amax_out);
      return q;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  Tensor h = Tensor::empty({x.size(0), f}, DType::F32);
  cpu::moe_swiglu_scaled_forward(x, scale, h);
  if (amax_out) {
    const int64_t kept = std::accumulate(splits.begin(), splits.end(), int64_t{0});
    Tensor a = Tensor::zeros({1}, DType::F32);
    if (kept > 0) amax(ctx, h.slice(0, 0, kept), a);
    fold_amax_into(ctx, a, *amax_out);
  }
  quantize_per_tensor(ctx, h, fp8_scale, q.data);
  zero_unkept_rows(q.data, splits);
  cpu::moe_fp8_transpose_padded(q.data, splits, q.padded_offsets, q.data_t);
  return q;
}

MoEFp8Rows moe_swiglu_scaled_quantize(Context& ctx, const Tensor& x, const Tensor& scale,
                                      const std::vector<int64_t>& splits, DType fp8, const MoEFp8Options& o) {
  Tensor a = Tensor::empty({1}, DType::F32, ctx.device);
  moe_swiglu_scaled_amax(ctx, x, scale, a);
  return moe_swiglu_scaled_cast(ctx, x, scale, current_scale(ctx, a, fp8, o), splits, fp8);
}

MoEFp8Rows moe_swiglu_scaled_backward_quantize(Context& ctx, const Tensor& x, const Tensor& scale, const Tensor& dy,
                                               const std::vector<int64_t>& splits, DType fp8, const MoEFp8Options& o,
                                               Tensor& d_scale) {
  const char* op = "moe_swiglu_scaled_backward_quantize";
  const int64_t f = check_swiglu_input(x, scale, op);
  check_shaped(dy, {x.size(0), f}, op, "dy");
  check_shaped(d_scale, {x.size(0)}, op, "d_scale");
  check_fp8_dtype(fp8, op);
  check_splits(splits, static_cast<int64_t>(splits.size()), x.size(0), op);
  check_on_device(ctx, op, {&x, &scale, &dy, &d_scale});
#if TESSERA_WITH_CUDA
  if (ctx.device.is_cuda() && cuda::moe_swiglu_backward_cast_supported(x, scale, dy, int64_t(splits.size())) &&
      cuda::moe_permute_supported({&x, &dy}, {&scale, &d_scale})) {
    Tensor a = Tensor::empty({1}, DType::F32, ctx.device);
    cuda::moe_swiglu_scaled_backward_amax(ctx.stream, x, scale, dy, d_scale, a);
    const Tensor fp8_scale = current_scale(ctx, a, fp8, o);
    MoEFp8Rows q = empty_rows(ctx, x.size(0), x.size(1), splits, fp8);
    q.scale_inv = reciprocal_scale(ctx, fp8_scale, op);
    cuda::moe_swiglu_scaled_backward_cast(ctx.stream, x, scale, dy, fp8_scale, splits, q.padded_offsets, q.data,
                                          q.data_t);
    return q;
  }
#endif
  // The definition (and the CUDA fallback): dx stored, then cast with the amax reduced with it.
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), ctx.device), a = Tensor::empty({1}, DType::F32, ctx.device);
  moe_swiglu_scaled_backward(ctx, x, scale, dy, dx, d_scale, &a);
  return moe_fp8_quantize_rows(ctx, dx, a, splits, fp8, o);
}

MoEFp8Rows moe_swiglu_scaled_backward_cast(Context& ctx, const Tensor& x, const Tensor& scale, const Tensor& dy,
                                           const Tensor& fp8_scale, const std::vector<int64_t>& splits, DType fp8,
                                           Tensor& d_scale, Tensor* amax_out) {
  const char* op = "moe_swiglu_scaled_backward_cast";
  const int64_t f = check_swiglu_input(x, scale, op);
  check_shaped(dy, {x.size(0), f}, op, "dy");
  check_shaped(d_scale, {x.size(0)}, op, "d_scale");
  check_fp8_dtype(fp8, op);
  check_scale1(fp8_scale, op, "fp8_scale");
  check_splits(splits, static_cast<int64_t>(splits.size()), x.size(0), op);
  check_on_device(ctx, op, {&x, &scale, &dy, &d_scale, &fp8_scale});
  if (amax_out) {
    check_scale1(*amax_out, op, "amax_out");
    check_on_device(ctx, op, {amax_out});
  }
#if TESSERA_WITH_CUDA
  if (ctx.device.is_cuda() && cuda::moe_swiglu_backward_cast_supported(x, scale, dy, int64_t(splits.size())) &&
      cuda::moe_permute_supported({&x, &dy}, {&scale, &d_scale})) {
    MoEFp8Rows q = empty_rows(ctx, x.size(0), x.size(1), splits, fp8);
    q.scale_inv = reciprocal_scale(ctx, fp8_scale, op);
    Tensor partial =
        Tensor::empty({x.size(0), cuda::moe_swiglu_backward_partial_columns(f)}, DType::F32, ctx.device);
    cuda::moe_swiglu_scaled_backward_cast_fused(ctx.stream, x, scale, dy, fp8_scale, splits, q.padded_offsets, q.data,
                                                q.data_t, partial, d_scale, amax_out);
    return q;
  }
#endif
  // The definition: the BF16 dx stored, then the cast, which records the amax of the kept
  // rows as the fused pass does.
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), ctx.device);
  moe_swiglu_scaled_backward(ctx, x, scale, dy, dx, d_scale);
  return moe_fp8_cast_rows(ctx, dx, fp8_scale, splits, fp8, amax_out);
}

void grouped_linear_forward_fp8(Context& ctx, const MoEFp8Rows& x, const MoEFp8Weights& w, Tensor& y) {
  const char* op = "grouped_linear_forward_fp8";
  const int64_t experts = static_cast<int64_t>(w.experts.size());
  check_rows(x, experts, op, "x", true);
  check_matrix(y, op, "y");
  TESSERA_CHECK(y.size(0) == x.data.size(0), op, ": y must have x's ", x.data.size(0), " rows, got ", y.describe());
  fp8::Fp8GemmOptions options;
  options.fast_accumulate = true;
  for_each_expert(ctx, x.splits, [&](Context& c, size_t e, int64_t row) {
    TESSERA_CHECK(w.experts[e].data.defined(), op, ": expert ", e, " has rows but its weight was not cast");
    Tensor ye = y.slice(0, row, row + x.splits[e]);
    fp8::fp8_gemm(c, rows_of(x, e, row), false, w.experts[e], true, ye, options);
  });
  const int64_t rows = std::accumulate(x.splits.begin(), x.splits.end(), int64_t{0});
  if (rows < y.size(0)) y.slice(0, rows, y.size(0)).fill_zero();
}

void grouped_linear_backward_input_fp8(Context& ctx, const MoEFp8Rows& dy, const MoEFp8Weights& w, Tensor& dx) {
  const char* op = "grouped_linear_backward_input_fp8";
  const int64_t experts = static_cast<int64_t>(w.experts.size());
  check_rows(dy, experts, op, "dy", true);
  check_matrix(dx, op, "dx");
  TESSERA_CHECK(dx.size(0) == dy.data.size(0), op, ": dx must have dy's ", dy.data.size(0), " rows, got ",
                dx.describe());
  for_each_expert(ctx, dy.splits, [&](Context& c, size_t e, int64_t row) {
    TESSERA_CHECK(w.experts[e].data_t.defined(), op, ": expert ", e, " has rows but its weight was not cast");
    Tensor dxe = dx.slice(0, row, row + dy.splits[e]);
    fp8::fp8_gemm(c, rows_of(dy, e, row), false, w.experts[e], false, dxe);
  });
  const int64_t rows = std::accumulate(dy.splits.begin(), dy.splits.end(), int64_t{0});
  if (rows < dx.size(0)) dx.slice(0, rows, dx.size(0)).fill_zero();
}

void grouped_linear_backward_weight_fp8(Context& ctx, const MoEFp8Rows& dy, const MoEFp8Rows& x, Tensor& dw,
                                        bool accumulate) {
  const char* op = "grouped_linear_backward_weight_fp8";
  TESSERA_CHECK(dw.defined() && dw.dim() == 3 && dw.is_contiguous(), op, ": dw must be a contiguous [E, N, K] tensor");
  const int64_t experts = dw.size(0);
  check_rows(dy, experts, op, "dy", false);
  check_rows(x, experts, op, "x", false);
  TESSERA_CHECK(dy.splits == x.splits, op, ": dy and x have different split sizes");
  if (!accumulate) zero_experts_without_rows(ctx, x.splits, dw);
  const float beta = accumulate ? 1.0f : 0.0f;
  for_each_expert(ctx, x.splits, [&](Context& c, size_t e, int64_t) {
    Tensor dwe = dw.select(0, static_cast<int64_t>(e));
    fp8::fp8_gemm(c, columns_of(dy, e), true, columns_of(x, e), false, dwe, 1.0f, beta);
  });
}

}  // namespace tessera
