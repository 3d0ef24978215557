#include "tessera/ops/gemm.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "backend/cpu/gemm.h"
#include "tessera/core/stream.h"
#include "tessera/ops/activation.h"
#include "tessera/ops/elementwise.h"
#include "dispatch.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/cublaslt_state.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/reduce.h"
#endif

namespace tessera {
namespace {

bool is_gemm_input_dtype(DType t) {
  return t == DType::F64 || t == DType::F32 || t == DType::BF16 || t == DType::F16 || t == DType::E4M3 ||
         t == DType::E5M2;
}

bool is_gemm_output_dtype(DType t) { return t == DType::F64 || t == DType::F32 || t == DType::BF16; }

// True when the byte ranges of two defined tensors intersect: a kernel writing one while
// reading the other would read its own partial results.
bool memory_overlaps(const Tensor& x, const Tensor& y) {
  if (!x.defined() || !y.defined() || x.numel() == 0 || y.numel() == 0) return false;
  const auto* x0 = static_cast<const char*>(x.raw_data());
  const auto* y0 = static_cast<const char*>(y.raw_data());
  return x0 < y0 + span_bytes(y) && y0 < x0 + span_bytes(x);
}

// Every check of gemm (shapes, dtypes, layout, overlap), for gemm and its fused variants.
void check_gemm(const Context& ctx, const Tensor& a, const Tensor& b, const Tensor& c, const GemmOptions& options,
                const Tensor& bias, const char* op) {
  check_row_strided(a, op, "a");
  check_row_strided(b, op, "b");
  check_row_strided(c, op, "c");
  TESSERA_CHECK(is_gemm_input_dtype(a.dtype()), op, ": a must be F64, F32, BF16, F16, E4M3 or E5M2, got ",
                a.describe());
  TESSERA_CHECK(is_gemm_input_dtype(b.dtype()), op, ": b must be F64, F32, BF16, F16, E4M3 or E5M2, got ",
                b.describe());
  TESSERA_CHECK(is_gemm_output_dtype(c.dtype()), op, ": c must be F64, F32 or BF16, got ", c.describe());
  TESSERA_CHECK(a.dim() == 2, op, ": a must be 2-D, got ", a.describe());
  TESSERA_CHECK(b.dim() == 2, op, ": b must be 2-D, got ", b.describe());
  TESSERA_CHECK(c.dim() == 2, op, ": c must be 2-D, got ", c.describe());
  const int64_t m = options.transpose_a ? a.size(1) : a.size(0);
  const int64_t k = options.transpose_a ? a.size(0) : a.size(1);
  const int64_t kb = options.transpose_b ? b.size(1) : b.size(0);
  const int64_t n = options.transpose_b ? b.size(0) : b.size(1);
  TESSERA_CHECK(k == kb, op, ": inner dimensions differ: op(a) is [", m, ", ", k, "] (a ", a.describe(),
                options.transpose_a ? ", transposed" : "", "), op(b) is [", kb, ", ", n, "] (b ", b.describe(),
                options.transpose_b ? ", transposed" : "", ")");
  TESSERA_CHECK(c.size(0) == m && c.size(1) == n, op, ": c must have shape [", m, ", ", n, "], got ", c.describe());
  if (bias.defined()) {
    check_contiguous(bias, op, "bias");
    check_floating(bias, op, "bias");
    check_shape(bias, {n}, op, "bias");
  }
  TESSERA_CHECK(!memory_overlaps(c, a) && !memory_overlaps(c, b) && !memory_overlaps(c, bias), op,
                ": c ", c.describe(), " overlaps an input in memory");
  check_on_device(ctx, op, {&a, &b, &c, &bias});
}

}  // namespace

void gemm(Context& ctx, const Tensor& a, const Tensor& b, Tensor& c, const GemmOptions& options, const Tensor& bias) {
  const char* op = "gemm";
  check_gemm(ctx, a, b, c, options, bias, op);
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::gemm_supported(a, b, c, bias)) {
      cuda::gemm(ctx.stream, a, b, c, options.transpose_a, options.transpose_b,
                 options.alpha * options.a_scale_inv * options.b_scale_inv, options.beta, bias);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (c.is_contiguous()) {
    cpu::gemm(a.contiguous(), b.contiguous(), c, options, bias);
  } else {  // the reference wants packed matrices
    Tensor packed = c.contiguous();
    cpu::gemm(a.contiguous(), b.contiguous(), packed, options, bias);
    c.copy_from(packed);
  }
}

void gemm_bias_gelu(Context& ctx, const Tensor& a, const Tensor& b, const Tensor& bias, Tensor& pre, Tensor& c,
                    const GemmOptions& options) {
  const char* op = "gemm_bias_gelu";
  check_contiguous(pre, op, "pre");
  check_contiguous(c, op, "c");
  check_shape(pre, c.shape(), op, "pre");
  check_dtype(pre, c.dtype(), op, "pre");
  TESSERA_CHECK(options.beta == 0, op, ": beta must be 0 (the output is an activation), got ", options.beta);
  TESSERA_CHECK(!memory_overlaps(pre, c), op, ": pre and c overlap in memory");
#if TESSERA_WITH_CUDA
  if (ctx.device.is_cuda() && cuda::gemm_epilogue_supported(a, b, c, bias, pre)) {
    check_gemm(ctx, a, b, c, options, bias, op);
    cuda::gemm(ctx.stream, a, b, c, options.transpose_a, options.transpose_b,
               options.alpha * options.a_scale_inv * options.b_scale_inv, 0.0f, bias, GemmEpilogue::Gelu, pre);
    return;
  }
#endif
  gemm(ctx, a, b, pre, options, bias);
  gelu_forward(ctx, pre, c);
}

void gemm_gelu_backward(Context& ctx, const Tensor& a, const Tensor& b, const Tensor& pre, Tensor& c,
                        const GemmOptions& options) {
  const char* op = "gemm_gelu_backward";
  check_contiguous(pre, op, "pre");
  check_contiguous(c, op, "c");
  check_shape(pre, c.shape(), op, "pre");
  TESSERA_CHECK(options.beta == 0, op, ": beta must be 0 (the output is an activation gradient), got ", options.beta);
  TESSERA_CHECK(!memory_overlaps(pre, c), op, ": pre and c overlap in memory");
#if TESSERA_WITH_CUDA
  if (ctx.device.is_cuda() && cuda::gemm_epilogue_supported(a, b, c, Tensor(), pre)) {
    check_gemm(ctx, a, b, c, options, Tensor(), op);
    check_on_device(ctx, op, {&pre});
    cuda::gemm(ctx.stream, a, b, c, options.transpose_a, options.transpose_b,
               options.alpha * options.a_scale_inv * options.b_scale_inv, 0.0f, Tensor(), GemmEpilogue::GeluBackward, pre);
    return;
  }
#endif
  Tensor product = Tensor::empty(c.shape(), c.dtype(), c.device());
  gemm(ctx, a, b, product, options);
  gelu_backward(ctx, pre, product, c);
}

void bias_grad(Context& ctx, const Tensor& dy, Tensor& dbias) {
  const char* op = "bias_grad";
  check_contiguous(dy, op, "dy");
  check_contiguous(dbias, op, "dbias");
  check_floating(dy, op, "dy");
  check_floating(dbias, op, "dbias");
  TESSERA_CHECK(dy.dim() == 2, op, ": dy must be 2-D [M, N], got ", dy.describe());
  check_shape(dbias, {dy.size(1)}, op, "dbias");
  check_on_device(ctx, op, {&dy, &dbias});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::bias_grad_supported(dy, dbias)) {
      cuda::bias_grad(ctx.stream, dy, dbias);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::bias_grad(dy, dbias);
}

void linear_weight_grad(Context& ctx, const Tensor& dy, const Tensor& x, Tensor& dweight, Tensor& dbias,
                        bool accumulate_weight, bool accumulate_bias) {
  const GemmOptions options{.transpose_a = true, .beta = accumulate_weight ? 1.0f : 0.0f};
#if TESSERA_WITH_CUDA
  // The bias gradient out of the weight GEMM's epilogue: cuBLASLt overwrites a vector. An
  // accumulating gradient takes the sums in a scratch vector that is then added (N floats,
  // against a second pass over all of dy); an overwritten one takes them directly.
  if (ctx.device.is_cuda() && dbias.defined() && dbias.dtype() == DType::F32 && dbias.is_contiguous() &&
      dy.dim() == 2 && dbias.dim() == 1 && dbias.size(0) == dy.size(1) && dbias.device() == ctx.device &&
      (dy.dtype() == DType::BF16 || dy.dtype() == DType::F32)) {
    check_gemm(ctx, dy, x, dweight, options, Tensor(), "linear_weight_grad");
    Tensor sums = accumulate_bias ? Tensor::empty({dy.size(1)}, DType::F32, ctx.device) : dbias;
    if (cuda::gemm_bias_grad_available(dy, x, dweight, true, false, 1.0f, sums)) {
      cuda::gemm(ctx.stream, dy, x, dweight, true, false, 1.0f, options.beta, sums, GemmEpilogue::BiasGrad);
      if (accumulate_bias) add(ctx, dbias, sums, dbias);
      return;
    }
  }
#endif
  gemm(ctx, dy, x, dweight, options);
  if (dbias.defined()) {
    if (!accumulate_bias) {
      StreamGuard on_stream(ctx);  // in order with the GEMM above and the sum below
      dbias.fill_zero();
    }
    bias_grad(ctx, dy, dbias);
  }
}

void sum_of_squares(Context& ctx, const Tensor& x, Tensor& out) {
  const char* op = "sum_of_squares";
  check_contiguous(x, op, "x");
  check_contiguous(out, op, "out");
  check_floating(x, op, "x");
  TESSERA_CHECK(out.dtype() == DType::F32 || out.dtype() == DType::F64, op, ": out must be F32 or F64, got ",
                out.describe());
  check_shape(out, {1}, op, "out");
  check_on_device(ctx, op, {&x, &out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::sum_of_squares_supported(x, out)) {
      cuda::sum_of_squares(ctx.stream, x, out);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::sum_of_squares(x, out);
}

namespace {
std::atomic<int> g_gemm_autotune{-1};  // -1: not read from the environment yet
}  // namespace

void set_gemm_autotune(bool on) { g_gemm_autotune.store(on ? 1 : 0); }

bool gemm_autotune() {
  int value = g_gemm_autotune.load();
  if (value < 0) {
    int initial = 0;
    if (const char* env = std::getenv("TESSERA_GEMM_AUTOTUNE"); env && *env) {
      const std::string v = env;
      TESSERA_CHECK(v == "0" || v == "1", "environment variable TESSERA_GEMM_AUTOTUNE must be 0 or 1, got \"", v, "\"");
      initial = v == "1" ? 1 : 0;
    }
    g_gemm_autotune.compare_exchange_strong(value, initial);
    value = g_gemm_autotune.load();
  }
  return value == 1;
}

std::vector<std::string> gemm_autotune_log() {
#if TESSERA_WITH_CUDA
  return cuda::lt_autotune_log();
#else
  return {};
#endif
}

}  // namespace tessera
