#include "tessera/fp8/block_quantized_tensor.h"

#include "fp8_common.h"
#include "ops/dispatch.h"
#include "tessera/core/error.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/gemm.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/block_cast_transpose.h"
#include "backend/cuda/gemm_fp8.h"
#endif

namespace tessera::fp8 {

namespace {

bool is_gemm_block(const BlockScaling& b) {
  return b.block_cols == 128 && (b.block_rows == 1 || b.block_rows == 128);
}

void check_blocks(const BlockScaling& b, const char* op) {
  TESSERA_CHECK(is_gemm_block(b), op, ": blocks must be 1x128 or 128x128 (the block shapes cuBLASLt multiplies), got ",
                b.block_rows, "x", b.block_cols);
}

// need_data / need_data_t: which copies (with their scales) the caller reads. A layer may drop
// the copy its backward does not read (nn::Linear keeps only what its backward GEMMs use);
// when both are present they must be [M, K] and [K, M].
void check_block_tensor(const BlockQuantizedTensor& q, const char* op, const char* name, bool need_data = true,
                        bool need_data_t = true) {
  // A copy is its codes and its scales: both present, or both dropped.
  const bool has = q.data.defined(), has_t = q.data_t.defined();
  TESSERA_CHECK(has == q.scale_inv.defined() && has_t == q.scale_inv_t.defined(), op, ": ", name,
                " has codes without scales or scales without codes (data / scale_inv, data_t / scale_inv_t)");
  TESSERA_CHECK((has || !need_data) && (has_t || !need_data_t) && (has || has_t), op, ": ", name,
                " is not a block-quantized tensor (an undefined copy, data or data_t, that this call reads)");
  check_blocks(q.blocks, op);
  TESSERA_CHECK((!has || q.data.dim() == 2) && (!has_t || q.data_t.dim() == 2), op, ": ", name, " must be 2-D");
  if (has && has_t)
    TESSERA_CHECK(q.data.size(0) == q.data_t.size(1) && q.data.size(1) == q.data_t.size(0), op, ": ", name,
                  ".data ", q.data.describe(), " and ", name, ".data_t ", q.data_t.describe(),
                  " are not [M, K] and [K, M]");
  const int64_t m = q.rows(), k = q.cols();
  if (has) check_shape(q.scale_inv, block_scale_shape(m, k, q.blocks), op, "scale_inv");
  if (has_t) check_shape(q.scale_inv_t, block_scale_shape(k, m, q.blocks), op, "scale_inv_t");
}

// One side of the TN product: the FP8 copy used and its scales.
struct Side {
  const Tensor* data;
  const Tensor* scale_inv;
  const Tensor* gemm_scale_inv;
};

Side pick(const BlockQuantizedTensor& q, bool use_t) {
  return use_t ? Side{&q.data_t, &q.scale_inv_t, &q.gemm_scale_inv_t} : Side{&q.data, &q.scale_inv, &q.gemm_scale_inv};
}

}  // namespace

namespace {

void check_cast_arguments(Context& ctx, const Tensor& x, const BlockScaling& blocks, DType fp8, const char* op) {
  check_defined(x, op, "x");
  TESSERA_CHECK(x.dim() == 2, op, ": x must be 2-D, got ", x.describe());
  TESSERA_CHECK(fp8 == DType::E4M3 || fp8 == DType::E5M2, op, ": fp8 must be E4M3 or E5M2, got ", dtype_name(fp8));
  check_blocks(blocks, op);
  check_on_device(ctx, op, {&x});
}

BlockQuantizedTensor allocate(Context& ctx, int64_t m, int64_t k, const BlockScaling& blocks, DType fp8) {
  BlockQuantizedTensor q;
  q.blocks = blocks;
  q.dtype = fp8;
  q.data = Tensor::empty({m, k}, fp8, ctx.device);
  q.scale_inv = Tensor::empty(block_scale_shape(m, k, blocks), DType::F32, ctx.device);
  q.data_t = Tensor::empty({k, m}, fp8, ctx.device);
  q.scale_inv_t = Tensor::empty(block_scale_shape(k, m, blocks), DType::F32, ctx.device);
#if TESSERA_WITH_CUDA
  if (ctx.device.is_cuda()) {
    const auto mode = q.is_2d() ? cuda::Fp8ScaleMode::Block128 : cuda::Fp8ScaleMode::Vec128;
    q.gemm_scale_inv = Tensor::empty(cuda::gemm_block_scale_shape(m, k, mode), DType::F32, ctx.device);
    q.gemm_scale_inv_t = Tensor::empty(cuda::gemm_block_scale_shape(k, m, mode), DType::F32, ctx.device);
  }
#endif
  return q;
}

}  // namespace

BlockQuantizedTensor quantize_blockwise_with_transpose_two_pass(Context& ctx, const Tensor& x,
                                                                const BlockScaling& blocks, DType fp8) {
  check_cast_arguments(ctx, x, blocks, fp8, "quantize_blockwise_with_transpose");
  const int64_t m = x.size(0), k = x.size(1);
  BlockQuantizedTensor q = allocate(ctx, m, k, blocks, fp8);
  quantize_blockwise(ctx, x, q.data, q.scale_inv, blocks);
  if (q.is_2d()) {  // a tile is the same elements either way: transposing is exact (and cheap: bytes)
    transpose_2d(ctx, q.data, q.data_t);
    transpose_2d(ctx, q.scale_inv, q.scale_inv_t);
  } else {  // 1x128 along the other dimension: quantize x^T itself
    Tensor xt = Tensor::empty({k, m}, x.dtype(), ctx.device);
    transpose_2d(ctx, x, xt);
    quantize_blockwise(ctx, xt, q.data_t, q.scale_inv_t, blocks);
  }
#if TESSERA_WITH_CUDA
  if (ctx.device.is_cuda()) {
    const auto mode = q.is_2d() ? cuda::Fp8ScaleMode::Block128 : cuda::Fp8ScaleMode::Vec128;
    cuda::to_gemm_block_scales(ctx.stream, q.scale_inv, m, k, mode, q.gemm_scale_inv);
    cuda::to_gemm_block_scales(ctx.stream, q.scale_inv_t, k, m, mode, q.gemm_scale_inv_t);
  }
#endif
  return q;
}

BlockQuantizedTensor quantize_blockwise_with_transpose(Context& ctx, const Tensor& x, const BlockScaling& blocks,
                                                       DType fp8) {
  check_cast_arguments(ctx, x, blocks, fp8, "quantize_blockwise_with_transpose");
#if TESSERA_WITH_CUDA
  // 1x128 on CUDA: one kernel reads x once and writes both copies and all four scale grids.
  if (ctx.device.is_cuda() && blocks.block_rows == 1 && cuda::block_cast_transpose_supported(x)) {
    BlockQuantizedTensor q = allocate(ctx, x.size(0), x.size(1), blocks, fp8);
    cuda::block_cast_transpose(ctx.stream, x, q.data, q.scale_inv, q.data_t, q.scale_inv_t, q.gemm_scale_inv,
                               q.gemm_scale_inv_t, blocks.power_of_two_scales);
    return q;
  }
#endif
  return quantize_blockwise_with_transpose_two_pass(ctx, x, blocks, fp8);
}

Tensor dequantize(Context& ctx, const BlockQuantizedTensor& q, DType out_dtype) {
  check_block_tensor(q, "dequantize", "q", true, false);
  Tensor out = Tensor::empty(q.data.shape(), out_dtype, ctx.device);
  dequantize_blockwise(ctx, q.data, q.scale_inv, out, q.blocks);
  return out;
}

void fp8_gemm_blockwise(Context& ctx, const BlockQuantizedTensor& a, bool transpose_a, const BlockQuantizedTensor& b,
                        bool transpose_b, Tensor& c, const Fp8GemmOptions& options) {
  const char* op = "fp8_gemm_blockwise";
  // Only the copies this orientation reads must be present.
  check_block_tensor(a, op, "a", !transpose_a, transpose_a);
  check_block_tensor(b, op, "b", transpose_b, !transpose_b);
  check_defined(c, op, "c");
  TESSERA_CHECK(!(a.is_2d() && b.is_2d()), op,
                ": both operands use 128x128 tiles; cuBLASLt has no 2-D x 2-D block-scaled GEMM (quantize one of "
                "them, usually the activation or gradient, with 1x128 blocks)");
  TESSERA_CHECK(c.dtype() != DType::E4M3 && c.dtype() != DType::E5M2, op,
                ": block-scaled GEMMs write F32 or BF16, not FP8 (c is ", c.describe(), ")");
  check_fp8_output_options(c, options, op);
  const Side sa = pick(a, transpose_a);   // op(A) as [M, K]
  const Side sb = pick(b, !transpose_b);  // op(B)^T as [N, K]
  check_on_device(ctx, op,
                  {sa.data, sa.scale_inv, sa.gemm_scale_inv, sb.data, sb.scale_inv, sb.gemm_scale_inv, &c, &options.bias});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    auto operand = [&](const Side& s, bool two_d) {
      const auto mode = two_d ? cuda::Fp8ScaleMode::Block128 : cuda::Fp8ScaleMode::Vec128;
      const int64_t rows = s.data->size(0), k = s.data->size(1);
      Tensor scales = *s.gemm_scale_inv;
      if (!scales.defined()) {
        scales = Tensor::empty(cuda::gemm_block_scale_shape(rows, k, mode), DType::F32, ctx.device);
        cuda::to_gemm_block_scales(ctx.stream, *s.scale_inv, rows, k, mode, scales);
      }
      return cuda::Fp8Operand{*s.data, scales, mode};
    };
    cuda::fp8_gemm(ctx.stream, operand(sa, a.is_2d()), operand(sb, b.is_2d()), c, to_cuda_params(options));
    return;
#else
    fail_no_kernel(op, ctx);
#endif
  }
  // The reference: both operands dequantized to F32, then one FP32 GEMM.
  Tensor a_f = Tensor::empty(sa.data->shape(), DType::F32, ctx.device);
  Tensor b_f = Tensor::empty(sb.data->shape(), DType::F32, ctx.device);
  dequantize_blockwise(ctx, *sa.data, *sa.scale_inv, a_f, a.blocks);
  dequantize_blockwise(ctx, *sb.data, *sb.scale_inv, b_f, b.blocks);
  GemmOptions g;
  g.transpose_b = true;
  g.alpha = options.alpha;
  g.beta = options.beta;
  gemm(ctx, a_f, b_f, c, g, options.bias);
}

void fp8_gemm_blockwise(Context& ctx, const BlockQuantizedTensor& a, bool transpose_a, const BlockQuantizedTensor& b,
                        bool transpose_b, Tensor& c, float alpha, float beta) {
  Fp8GemmOptions options;
  options.alpha = alpha;
  options.beta = beta;
  fp8_gemm_blockwise(ctx, a, transpose_a, b, transpose_b, c, options);
}

}  // namespace tessera::fp8
