#include "tessera/ops/rope.h"

#include <cmath>

#include "backend/cpu/rope.h"
#include "dispatch.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/rope.h"
#endif

namespace tessera {
namespace {

// [B, T, H, D] with each token's H * D values packed and tokens at a common stride: a
// contiguous tensor, or the Q or K heads sliced out of a fused [B, T, Hq + 2 Hkv, D] QKV
// projection (so the split and the rotation are one pass).
bool heads_packed(const Tensor& t) {
  return t.dim() == 4 && (t.is_contiguous() || (t.stride(3) == 1 && t.stride(2) == t.size(3) &&
                                                t.stride(1) >= t.size(2) * t.size(3) &&
                                                t.stride(0) == t.size(1) * t.stride(1)));
}

void check_rope_arguments(const Tensor& in, const char* in_name, const Tensor& out, const char* out_name,
                          const RopeOptions& options, const char* op) {
  check_floating(in, op, in_name);
  TESSERA_CHECK(in.dim() == 4, op, ": ", in_name, " must be 4-D [B, T, H, D], got ", in.describe());
  TESSERA_CHECK(heads_packed(in), op, ": ", in_name, " must be contiguous or a head slice of a contiguous ",
                "[B, T, heads, D] tensor, got ", in.describe());
  TESSERA_CHECK(in.size(3) % 2 == 0, op, ": the head dimension D of ", in_name,
                " must be even (pairs (i, i + D/2) rotate together), got ", in.describe());
  check_floating(out, op, out_name);
  check_shape(out, in.shape(), op, out_name);
  TESSERA_CHECK(heads_packed(out), op, ": ", out_name, " must be contiguous or a head slice of a contiguous ",
                "[B, T, heads, D] tensor, got ", out.describe());
  TESSERA_CHECK(std::isfinite(options.theta) && options.theta > 0.0f, op, ": theta must be finite and > 0, got ",
                options.theta);
  TESSERA_CHECK(options.position_offset >= 0, op, ": position_offset must be >= 0, got ", options.position_offset);
  // The kernel reads each pair before writing it, so the exact same memory is safe; a
  // partial overlap would read values already rotated.
  const int64_t in_begin = in.offset() * static_cast<int64_t>(dtype_size(in.dtype()));
  const int64_t out_begin = out.offset() * static_cast<int64_t>(dtype_size(out.dtype()));
  const int64_t in_end = in_begin + span_bytes(in);
  const int64_t out_end = out_begin + span_bytes(out);
  const bool overlap = in.shares_storage(out) && in_begin < out_end && out_begin < in_end;
  TESSERA_CHECK(!overlap || (in_begin == out_begin && in.dtype() == out.dtype() && in.strides() == out.strides()), op,
                ": ", out_name,
                " overlaps ", in_name, " without being the same tensor");
}

}  // namespace

void rope_forward(Context& ctx, const Tensor& x, Tensor& y, const RopeOptions& options) {
  const char* op = "rope_forward";
  check_rope_arguments(x, "x", y, "y", options, op);
  check_on_device(ctx, op, {&x, &y});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::rope_supported(x, y)) {
      cuda::rope_forward(ctx.stream, x, y, options);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  if (y.is_contiguous()) {
    cpu::rope_forward(x.contiguous(), y, options);
  } else {  // the reference wants packed tensors
    Tensor packed = Tensor::empty(y.shape(), y.dtype());
    cpu::rope_forward(x.contiguous(), packed, options);
    y.copy_from(packed);
  }
}

void rope_backward(Context& ctx, const Tensor& dy, Tensor& dx, const RopeOptions& options) {
  const char* op = "rope_backward";
  check_rope_arguments(dy, "dy", dx, "dx", options, op);
  check_on_device(ctx, op, {&dy, &dx});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::rope_supported(dy, dx)) {
      cuda::rope_backward(ctx.stream, dy, dx, options);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  if (dx.is_contiguous()) {
    cpu::rope_backward(dy.contiguous(), dx, options);
  } else {
    Tensor packed = Tensor::empty(dx.shape(), dx.dtype());
    cpu::rope_backward(dy.contiguous(), packed, options);
    dx.copy_from(packed);
  }
}

}  // namespace tessera
