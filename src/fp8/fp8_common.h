// Shared by the FP8 tensor front ends (quantized_tensor.cpp, block_quantized_tensor.cpp):
// argument checks of the GEMM options and the CPU GEMM with an optional FP8 output.
#pragma once

#include "tessera/core/error.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/gemm_fp8.h"
#endif

namespace tessera::fp8 {

// The value of an F32 [1] tensor on any device, read to the host (CPU paths only).
inline float host_scalar(const Tensor& t, const char* op, const char* name) {
  check_defined(t, op, name);
  check_dtype(t, DType::F32, op, name);
  check_shape(t, {1}, op, name);
  return t.to_floats()[0];
}

// Rules of Fp8GemmOptions that hold on every device (CUDA adds its own in fp8_gemm_check).
inline void check_fp8_output_options(const Tensor& c, const Fp8GemmOptions& o, const char* op) {
  const DType t = c.dtype();
  TESSERA_CHECK(t == DType::F64 || t == DType::F32 || t == DType::BF16 || t == DType::E4M3, op,
                ": c must be F32, BF16, F64 or E4M3, got ", c.describe());
  if (t == DType::E4M3) {
    TESSERA_CHECK(o.beta == 0, op, ": an E4M3 output cannot accumulate (beta must be 0, got ", o.beta, ")");
    for (const Tensor* s : {&o.out_scale, &o.amax_out}) {
      if (!s->defined()) continue;
      TESSERA_CHECK(s->dtype() == DType::F32 && s->shape() == Shape{1}, op,
                    ": out_scale and amax_out must be F32 [1], got ", s->describe());
    }
  } else {
    TESSERA_CHECK(!o.out_scale.defined() && !o.amax_out.defined(), op,
                  ": out_scale and amax_out need an E4M3 output, c is ", c.describe());
  }
}

// c = gemm(a, b) with the options; for an E4M3 c the product (bias included) goes through
// an F32 buffer and quantize_per_tensor, whose amax is the unscaled product's, as cuBLASLt's.
inline void gemm_maybe_fp8_out(Context& ctx, const Tensor& a, const Tensor& b, Tensor& c, const GemmOptions& g,
                               const Fp8GemmOptions& o) {
  if (c.dtype() != DType::E4M3) {
    gemm(ctx, a, b, c, g, o.bias);
    return;
  }
  Tensor product = Tensor::empty(c.shape(), DType::F32, ctx.device);
  gemm(ctx, a, b, product, g, o.bias);
  const Tensor scale = o.out_scale.defined() ? o.out_scale : Tensor::from_floats({1.0f}, {1}).to(ctx.device);
  Tensor amax = o.amax_out;
  quantize_per_tensor(ctx, product, scale, c, amax);
}

#if TESSERA_WITH_CUDA
inline cuda::Fp8GemmParams to_cuda_params(const Fp8GemmOptions& o) {
  cuda::Fp8GemmParams p;
  p.alpha = o.alpha;
  p.beta = o.beta;
  p.fast_accumulate = o.fast_accumulate;
  p.bias = o.bias;
  p.out_scale = o.out_scale;
  p.amax_out = o.amax_out;
  return p;
}
#endif

}  // namespace tessera::fp8
