// GEMM benchmark on the GPU: cuBLASLt BF16 (tessera's gemm op) against tessera's FP8 GEMMs
// (fp8_gemm, per-tensor scales; fp8_gemm_blockwise, 1x128 / 128x128 block scales), at the
// training shapes of Llama-3-8B (8192 tokens) and GPT-2 small (16384 tokens), the forward
// products and, for the MLP up-projection, the two backward ones:
//   forward  y  = x W^T      (TN)  BF16 out; FP8: E4M3 x E4M3, fast accumulation (as TE)
//   dgrad    dx = dy W       (NN)  BF16 out; FP8: E5M2 dy x E4M3 W, no fast accumulation
//   wgrad    dW += dy^T x    (TN)  F32 out, beta = 1; FP8: E5M2 dy x E4M3 x
// Block scaling uses E4M3 everywhere (TE's block recipe): 1x128 for x and dy, 128x128 for W.
// FP8 operands are quantized before timing (pre-quantized, TE's "GEMM only" figure); only
// the GEMM is timed: CUDA events, 5 warm-up calls, the median of `runs` (>= 20) calls.
// TFLOP/s = 2 M N K / time. Random data, U(-1, 1).
//
// Correctness in the same run, on the device, as the relative (Frobenius) error of:
//   bf16 / fp8 / blk vs exact: each output against an FP32 GEMM of the unquantized FP32 data;
//   fp8 / blk vs deq: the FP8 outputs against an FP32 GEMM of the dequantized FP8 copies the
//   GEMM used (this one isolates the GEMM: only accumulation and output rounding remain).
//
// Usage: bench_gemm [runs]     (needs a GPU)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <vector>

#include "gpu_timing.h"
#include "tessera/core/allocator.h"
#include "tessera/core/random.h"
#include "tessera/fp8/block_quantized_tensor.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"

using namespace tessera;
using namespace tessera::fp8;

namespace {


enum class Kind { Forward, DGrad, WGrad };

struct Problem {
  const char* name;
  int64_t m, n, k;
  Kind kind;
};


// sums[0] += sum (got - want)^2, sums[1] += sum want^2 (double; one atomic per block).
__global__ void error_sums(const float* got, const float* want, int64_t n, double* sums) {
  double d = 0, r = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double g = got[i], w = want[i];
    d += (g - w) * (g - w);
    r += w * w;
  }
  __shared__ double sd[256], sr[256];
  sd[threadIdx.x] = d;
  sr[threadIdx.x] = r;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      sd[threadIdx.x] += sd[threadIdx.x + s];
      sr[threadIdx.x] += sr[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    atomicAdd(&sums[0], sd[0]);
    atomicAdd(&sums[1], sr[0]);
  }
}

// ||got - want|| / ||want|| on the device; NaN anywhere gives NaN.
double rel_error(Context& ctx, const Tensor& got, const Tensor& want) {
  Tensor g = got;
  if (got.dtype() != DType::F32) {
    g = Tensor::empty(got.shape(), DType::F32, got.device());
    cast(ctx, got, g);
  }
  Tensor sums = Tensor::zeros({2}, DType::F64, got.device());
  error_sums<<<1024, 256>>>(g.data<float>(), want.data<float>(), g.numel(), sums.data<double>());
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<double> s = sums.to(Device::cpu()).to_doubles();
  return std::sqrt(s[0] / s[1]);
}

Tensor to_f32(Context& ctx, const Tensor& x) {
  Tensor y = Tensor::empty(x.shape(), DType::F32, x.device());
  cast(ctx, x, y);
  return y;
}

// Current scaling: the scale from the tensor's own amax (one read to the host, untimed).
Tensor current_scale(Context& ctx, const Tensor& x, DType fp8) {
  Tensor a = Tensor::empty({1}, DType::F32, x.device());
  amax(ctx, x, a);
  const float s = fp8_scale_from_amax(a.to(Device::cpu()).to_floats()[0], fp8);
  return Tensor::from_floats({s}, {1}).to(x.device());
}

// F32 [rows, K] values of the copy a TN product reads.
Tensor used_copy(Context& ctx, const QuantizedTensor& q, bool use_t) {
  Tensor out = Tensor::empty((use_t ? q.data_t : q.data).shape(), DType::F32, q.data.device());
  dequantize_per_tensor(ctx, use_t ? q.data_t : q.data, q.scale_inv, out);
  return out;
}

Tensor used_copy(Context& ctx, const BlockQuantizedTensor& q, bool use_t) {
  Tensor out = Tensor::empty((use_t ? q.data_t : q.data).shape(), DType::F32, q.data.device());
  dequantize_blockwise(ctx, use_t ? q.data_t : q.data, use_t ? q.scale_inv_t : q.scale_inv, out, q.blocks);
  return out;
}

bool g_all_ok = true;

// median_ms, or NaN (after printing why) when the call throws: one failing variant must not
// hide the others' numbers.
double timed(const char* what, const std::function<void()>& fn, int runs) {
  try {
    return median_ms(fn, runs);
  } catch (const std::exception& e) {
    std::printf("    %s failed: %s\n", what, e.what());
    g_all_ok = false;
    return NAN;
  }
}

void run(const Problem& pb, int runs) {
  Context ctx = Context::cuda();
  const Device dev = Device::cuda();
  const int64_t m = pb.m, n = pb.n, k = pb.k;
  // Storage follows the layer: forward x [M, K], W [N, K]; dgrad dy [M, K], W [K, N];
  // wgrad dy [K, M] (tokens x out), x [K, N] (tokens x in).
  const bool ta = pb.kind == Kind::WGrad, tb = pb.kind == Kind::Forward;
  const float beta = pb.kind == Kind::WGrad ? 1.0f : 0.0f;
  const DType out_dtype = pb.kind == Kind::WGrad ? DType::F32 : DType::BF16;
  Tensor a = Tensor::empty(ta ? Shape{k, m} : Shape{m, k}, DType::BF16, dev);
  Tensor b = Tensor::empty(tb ? Shape{n, k} : Shape{k, n}, DType::BF16, dev);
  fill_uniform(ctx, a, -1, 1, 1000 + m);
  fill_uniform(ctx, b, -1, 1, 2000 + n);
  Tensor c = Tensor::zeros({m, n}, out_dtype, dev);

  // BF16 through the gemm op (cuBLASLt).
  GemmOptions g;
  g.transpose_a = ta;
  g.transpose_b = tb;
  g.beta = beta;
  const double bf16_ms = timed("bf16", [&] { gemm(ctx, a, b, c, g); }, runs);

  // FP8, per-tensor scales.
  const DType da = pb.kind == Kind::Forward ? DType::E4M3 : DType::E5M2, db = DType::E4M3;
  const QuantizedTensor qa = quantize_with_transpose(ctx, a, current_scale(ctx, a, da), da);
  const QuantizedTensor qb = quantize_with_transpose(ctx, b, current_scale(ctx, b, db), db);
  Fp8GemmOptions o;
  o.beta = beta;
  o.fast_accumulate = pb.kind == Kind::Forward;
  Tensor c8 = Tensor::zeros({m, n}, out_dtype, dev);
  const double fp8_ms = timed("fp8", [&] { fp8_gemm(ctx, qa, ta, qb, tb, c8, o); }, runs);

  // FP8, block scales: W 128x128, x and dy 1x128.
  const BlockScaling v = BlockScaling::tile_1x128(), t = BlockScaling::tile_128x128();
  const BlockQuantizedTensor ba = quantize_blockwise_with_transpose(ctx, a, v, DType::E4M3);
  const BlockQuantizedTensor bb = quantize_blockwise_with_transpose(ctx, b, pb.kind == Kind::WGrad ? v : t, DType::E4M3);
  Fp8GemmOptions ob;
  ob.beta = beta;
  Tensor cb = Tensor::zeros({m, n}, out_dtype, dev);
  const double blk_ms = timed("blk", [&] { fp8_gemm_blockwise(ctx, ba, ta, bb, tb, cb, ob); }, runs);

  // Correctness: one more call of each onto zeros (beta = 1 accumulated during timing).
  c.fill_zero();
  c8.fill_zero();
  cb.fill_zero();
  CHECK_CUDA(cudaDeviceSynchronize());
  // (a variant that failed above leaves zeros, which fail the check below)
  if (!std::isnan(bf16_ms)) gemm(ctx, a, b, c, g);
  if (!std::isnan(fp8_ms)) fp8_gemm(ctx, qa, ta, qb, tb, c8, o);
  if (!std::isnan(blk_ms)) fp8_gemm_blockwise(ctx, ba, ta, bb, tb, cb, ob);
  GemmOptions f32 = g;
  f32.beta = 0;
  Tensor exact = Tensor::empty({m, n}, DType::F32, dev);
  gemm(ctx, to_f32(ctx, a), to_f32(ctx, b), exact, f32);
  const double e_bf16 = rel_error(ctx, c, exact), e_fp8 = rel_error(ctx, c8, exact), e_blk = rel_error(ctx, cb, exact);
  GemmOptions tn;
  tn.transpose_b = true;
  Tensor deq = Tensor::empty({m, n}, DType::F32, dev);
  gemm(ctx, used_copy(ctx, qa, ta), used_copy(ctx, qb, !tb), deq, tn);
  const double d_fp8 = rel_error(ctx, c8, deq);
  gemm(ctx, used_copy(ctx, ba, ta), used_copy(ctx, bb, !tb), deq, tn);
  const double d_blk = rel_error(ctx, cb, deq);
  // Output rounding (BF16: 2^-9 relative) bounds the GEMM-only errors, and for F32 output
  // the FP8 tensor cores' reduced-precision adder (~1e-4, tests/test_gpu_fp8_gemm.cpp);
  // quantization to FP8 costs a few percent against the exact product.
  const double tight = out_dtype == DType::BF16 ? 5e-3 : 3e-4;
  const bool ok = e_bf16 < 1e-2 && d_fp8 < tight && d_blk < tight && e_fp8 < 0.1 && e_blk < 0.1;
  g_all_ok = g_all_ok && ok;

  const double flop = 2.0 * m * n * k;
  const double bf16_tf = flop / bf16_ms * 1e-9, fp8_tf = flop / fp8_ms * 1e-9, blk_tf = flop / blk_ms * 1e-9;
  std::printf("| %-22s | %5lld | %5lld | %5lld | %7.1f | %7.1f | %5.2fx | %7.1f | %5.2fx | %.1e %.1e %.1e | %.1e %.1e | %s |\n",
              pb.name, (long long)m, (long long)n, (long long)k, bf16_tf, fp8_tf, fp8_tf / bf16_tf, blk_tf,
              blk_tf / bf16_tf, e_bf16, e_fp8, e_blk, d_fp8, d_blk, ok ? "ok" : "MISMATCH");
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (!cuda_available()) {
    std::printf("bench_gemm: no GPU present\n");
    return 0;
  }
  const int runs = argc > 1 ? std::max(20, std::atoi(argv[1])) : 30;
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("tessera GEMMs on %s, median of %d runs after 5 warm-ups, TFLOP/s = 2MNK / time\n", prop.name, runs);
  std::printf("bf16: cuBLASLt through gemm; fp8: fp8_gemm, per-tensor scales; blk: fp8_gemm_blockwise, 1x128 x 128x128\n");
  std::printf("(wgrad: 1x128 x 1x128). err vs exact: relative error against FP32 GEMM of the unquantized data;\n");
  std::printf("err vs deq: against FP32 GEMM of the dequantized FP8 copies (the GEMM's own error).\n\n");
  std::printf("| %-22s | %5s | %5s | %5s | %7s | %7s | %6s | %7s | %6s | %-23s | %-15s |    |\n", "shape", "M", "N", "K",
              "bf16", "fp8", "fp8/bf", "blk", "blk/bf", "err vs exact bf16/fp8/blk", "vs deq fp8/blk");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  const Problem problems[] = {
      {"llama3-8b qkv/o fwd", 8192, 4096, 4096, Kind::Forward},
      {"llama3-8b up/gate fwd", 8192, 14336, 4096, Kind::Forward},
      {"llama3-8b down fwd", 8192, 4096, 14336, Kind::Forward},
      {"llama3-8b up dgrad", 8192, 4096, 14336, Kind::DGrad},
      {"llama3-8b up wgrad", 14336, 4096, 8192, Kind::WGrad},
      {"gpt2 qkv fwd", 16384, 2304, 768, Kind::Forward},
      {"gpt2 mlp-proj fwd", 16384, 768, 3072, Kind::Forward},
      {"gpt2 lm-head fwd", 16384, 50304, 768, Kind::Forward},
  };
  for (const Problem& pb : problems) {
    try {
      run(pb, runs);
    } catch (const std::exception& e) {
      std::printf("| %-22s | failed: %s\n", pb.name, e.what());
      g_all_ok = false;
    }
  }
  std::printf("\n%s\n", g_all_ok ? "all outputs checked: ok" : "SOME OUTPUTS MISMATCH");
  return g_all_ok ? 0 : 1;
}
