#include "tessera/ops/quantize.h"

#include "backend/cpu/quantize.h"
#include "dispatch.h"
#include "tessera/core/numeric.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/quantize.h"
#endif

namespace tessera {
namespace {

void check_fp8(const Tensor& t, const char* op, const char* name) {
  check_defined(t, op, name);
  TESSERA_CHECK(is_fp8(t.dtype()), op, ": ", name, " must be E4M3 or E5M2, got ", t.describe());
}

// Dequantized outputs: a dtype that holds every FP8 value times a scale (not FP8 itself).
void check_dequantized(const Tensor& t, const char* op, const char* name) {
  check_defined(t, op, name);
  const DType d = t.dtype();
  TESSERA_CHECK(d == DType::F64 || d == DType::F32 || d == DType::F16 || d == DType::BF16, op, ": ", name,
                " must be F64, F32, F16 or BF16, got ", t.describe());
}

void check_scalar_f32(const Tensor& t, const char* op, const char* name) {
  check_contiguous(t, op, name);
  check_dtype(t, DType::F32, op, name);
  check_shape(t, {1}, op, name);
}

void check_2d(const Tensor& t, const char* op, const char* name) {
  TESSERA_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D [rows, cols], got ", t.describe());
}

void check_same_shape(const Tensor& a, const Tensor& b, const char* op, const char* name_a, const char* name_b) {
  TESSERA_CHECK(a.shape() == b.shape(), op, ": ", name_a, " ", a.describe(), " and ", name_b, " ", b.describe(),
                " differ in shape");
}

void check_blocks(const BlockScaling& blocks, const char* op) {
  TESSERA_CHECK(blocks.block_rows >= 1 && blocks.block_cols >= 1, op, ": block size must be positive, got ",
                blocks.block_rows, "x", blocks.block_cols);
}

// Written so that a huge block size cannot overflow.
int64_t ceil_div(int64_t a, int64_t b) { return a == 0 ? 0 : 1 + (a - 1) / b; }

}  // namespace

float fp8_max(DType fp8) {
  if (fp8 == DType::E4M3) return kE4M3Max;
  if (fp8 == DType::E5M2) return kE5M2Max;
  TESSERA_FAIL("fp8_max: ", dtype_name(fp8), " is not an FP8 dtype (E4M3 or E5M2)");
}

int fp8_max_exponent(DType fp8) {
  if (fp8 == DType::E4M3) return 8;   // 448 = 1.75 * 2^8
  if (fp8 == DType::E5M2) return 15;  // 57344 = 1.75 * 2^15
  TESSERA_FAIL("fp8_max_exponent: ", dtype_name(fp8), " is not an FP8 dtype (E4M3 or E5M2)");
}

float fp8_scale_from_amax(float amax, DType fp8, float margin, bool power_of_two) {
  return fp8_scale_for_amax(amax, fp8_max(fp8), margin, power_of_two);
}

Shape block_scale_shape(int64_t rows, int64_t cols, const BlockScaling& blocks) {
  check_blocks(blocks, "block_scale_shape");
  return {ceil_div(rows, blocks.block_rows), ceil_div(cols, blocks.block_cols)};
}

void amax(Context& ctx, const Tensor& x, Tensor& amax_out) {
  const char* op = "amax";
  check_contiguous(x, op, "x");
  check_floating(x, op, "x");
  check_scalar_f32(amax_out, op, "amax_out");
  check_on_device(ctx, op, {&x, &amax_out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::quantize_input_supported(x.dtype())) {
      cuda::amax(ctx.stream, x, amax_out);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::amax(x, amax_out);
}

void quantize_per_tensor(Context& ctx, const Tensor& x, const Tensor& scale, Tensor& out, Tensor& amax_out) {
  const char* op = "quantize_per_tensor";
  check_contiguous(x, op, "x");
  check_floating(x, op, "x");
  check_scalar_f32(scale, op, "scale");
  check_contiguous(out, op, "out");
  check_fp8(out, op, "out");
  check_same_shape(x, out, op, "x", "out");
  if (amax_out.defined()) check_scalar_f32(amax_out, op, "amax_out");
  check_on_device(ctx, op, {&x, &scale, &out, &amax_out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::quantize_input_supported(x.dtype())) {
      cuda::quantize_per_tensor(ctx.stream, x, scale, out, amax_out);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::quantize_per_tensor(x, scale, out, amax_out);
}

void quantize_per_tensor(Context& ctx, const Tensor& x, const Tensor& scale, Tensor& out) {
  Tensor no_amax;
  quantize_per_tensor(ctx, x, scale, out, no_amax);
}

void dequantize_per_tensor(Context& ctx, const Tensor& q, const Tensor& scale_inv, Tensor& out) {
  const char* op = "dequantize_per_tensor";
  check_contiguous(q, op, "q");
  check_fp8(q, op, "q");
  check_scalar_f32(scale_inv, op, "scale_inv");
  check_contiguous(out, op, "out");
  check_dequantized(out, op, "out");
  check_same_shape(q, out, op, "q", "out");
  check_on_device(ctx, op, {&q, &scale_inv, &out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::dequantize_output_supported(out.dtype())) {
      cuda::dequantize_per_tensor(ctx.stream, q, scale_inv, out);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::dequantize_per_tensor(q, scale_inv, out);
}

void quantize_blockwise(Context& ctx, const Tensor& x, Tensor& out, Tensor& scale_inv, const BlockScaling& blocks) {
  const char* op = "quantize_blockwise";
  check_blocks(blocks, op);
  check_contiguous(x, op, "x");
  check_floating(x, op, "x");
  check_2d(x, op, "x");
  check_contiguous(out, op, "out");
  check_fp8(out, op, "out");
  check_same_shape(x, out, op, "x", "out");
  check_contiguous(scale_inv, op, "scale_inv");
  check_dtype(scale_inv, DType::F32, op, "scale_inv");
  check_shape(scale_inv, block_scale_shape(x.size(0), x.size(1), blocks), op, "scale_inv");
  check_on_device(ctx, op, {&x, &out, &scale_inv});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::quantize_input_supported(x.dtype()) && cuda::blockwise_supported(x.size(0), x.size(1), blocks)) {
      cuda::quantize_blockwise(ctx.stream, x, out, scale_inv, blocks);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::quantize_blockwise(x, out, scale_inv, blocks);
}

void dequantize_blockwise(Context& ctx, const Tensor& q, const Tensor& scale_inv, Tensor& out,
                          const BlockScaling& blocks) {
  const char* op = "dequantize_blockwise";
  check_blocks(blocks, op);
  check_contiguous(q, op, "q");
  check_fp8(q, op, "q");
  check_2d(q, op, "q");
  check_contiguous(scale_inv, op, "scale_inv");
  check_dtype(scale_inv, DType::F32, op, "scale_inv");
  check_shape(scale_inv, block_scale_shape(q.size(0), q.size(1), blocks), op, "scale_inv");
  check_contiguous(out, op, "out");
  check_dequantized(out, op, "out");
  check_same_shape(q, out, op, "q", "out");
  check_on_device(ctx, op, {&q, &scale_inv, &out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::dequantize_output_supported(out.dtype())) {
      cuda::dequantize_blockwise(ctx.stream, q, scale_inv, out, blocks);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::dequantize_blockwise(q, scale_inv, out, blocks);
}

void quantize_mxfp8(Context& ctx, const Tensor& x, Tensor& out, Tensor& scales) {
  const char* op = "quantize_mxfp8";
  check_contiguous(x, op, "x");
  check_floating(x, op, "x");
  check_2d(x, op, "x");
  check_contiguous(out, op, "out");
  check_fp8(out, op, "out");
  check_same_shape(x, out, op, "x", "out");
  check_contiguous(scales, op, "scales");
  check_dtype(scales, DType::E8M0, op, "scales");
  check_shape(scales, {x.size(0), ceil_div(x.size(1), kMxBlockSize)}, op, "scales");
  check_on_device(ctx, op, {&x, &out, &scales});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::quantize_input_supported(x.dtype())) {
      cuda::quantize_mxfp8(ctx.stream, x, out, scales);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::quantize_mxfp8(x, out, scales);
}

void dequantize_mxfp8(Context& ctx, const Tensor& q, const Tensor& scales, Tensor& out) {
  const char* op = "dequantize_mxfp8";
  check_contiguous(q, op, "q");
  check_fp8(q, op, "q");
  check_2d(q, op, "q");
  check_contiguous(scales, op, "scales");
  check_dtype(scales, DType::E8M0, op, "scales");
  check_shape(scales, {q.size(0), ceil_div(q.size(1), kMxBlockSize)}, op, "scales");
  check_contiguous(out, op, "out");
  check_dequantized(out, op, "out");
  check_same_shape(q, out, op, "q", "out");
  check_on_device(ctx, op, {&q, &scales, &out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::dequantize_output_supported(out.dtype())) {
      cuda::dequantize_mxfp8(ctx.stream, q, scales, out);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::dequantize_mxfp8(q, scales, out);
}

}  // namespace tessera
