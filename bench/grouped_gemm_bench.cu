// The forward grouped GEMM of a Mixtral-shaped MoE layer alone: tessera's own persistent
// wgmma kernel (backend/cuda/grouped_gemm_wgmma.cu) against the cuBLASLt per-expert loop of
// grouped_linear_forward (one stream, and GroupedLinear's four side streams).
//
// Shapes: 16384 expert rows (8192 tokens top-2), 8 experts; "gate+up" K = 4096, N = 28672
// (the fused [gate | up] projection), "down" K = 14336, N = 4096. Splits: balanced (2048 per
// expert) and skewed (4096, 3072, 2048, 2048, 1536, 1536, 1024, 1024). BF16, random data.
//
// "dgrad gu" rows: the input gradient of gate+up, dx [16384, 4096] = dy [16384, 28672] * w[e]
// (grouped_linear_backward_input; own kernel through the transpose bit), same columns.
//
// Rows per case: cublas s1 / cublas s4 (the loop on 1 / 4 streams); one row per kernel
// variant (cuda::kGroupedGemmVariants, device offsets built once outside the timed region):
//   coop256 wait0 / coop128 wait0  the round-1 kernel (baseline), 128 x 256 / 128 x 128 tiles;
//   coop256 pipe / coop128 pipe    the same with the MMAs kept in flight across k-blocks
//                                  (dgrad: one wide transposed-B MMA per k16 step);
//   pingpong128                    each consumer warpgroup owns a 128 x 128 tile, the two
//                                  alternate so one's epilogue overlaps the other's MMAs;
// then "op <variant>": grouped_linear_forward / grouped_linear_backward_input with the
// backend switched to Own and the fastest variant of the rows above (the kernel plus the
// small host-to-device copy of the offsets). A second table, after all cases, times the
// cluster variants (coop256 mc2: TMA multicast of the w tile to pairs of CTAs) with cublas
// s1 again as the reference: run last, so that a failure there loses no other row. CUDA events, 3 warm-ups, median of `runs`;
// TFLOP/s = 2 rows N K / time. error: relative Frobenius error of that row's output against
// cublas s1 on the same data ("ok" below 1e-2, DESIGN.md's BF16 GEMM bound), and the largest
// element difference over the output's RMS.
//
// Usage: bench_grouped_gemm [runs]     (needs an sm_90a GPU for the own rows)
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cuda/grouped_gemm_wgmma.h"
#include "gpu_timing.h"
#include "tessera/core/numeric.h"
#include "tessera/core/random.h"
#include "tessera/ops/moe.h"

using namespace tessera;

namespace {

constexpr int64_t kRows = 16384, kExperts = 8;

struct Error {
  double rel = 0, max_over_rms = 0;
};

Error compare(const Tensor& got_d, const Tensor& want_d) {
  const Tensor got = got_d.to(Device::cpu()), want = want_d.to(Device::cpu());
  const bf16* g = got.data<bf16>();
  const bf16* w = want.data<bf16>();
  double dd = 0, ww = 0, dmax = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double a = g[i].to_float(), b = w[i].to_float();
    const double d = std::isnan(a) ? INFINITY : std::fabs(a - b);
    dd += d * d;
    ww += b * b;
    dmax = std::max(dmax, d);
  }
  const double rms = std::sqrt(ww / std::max<double>(1, static_cast<double>(got.numel())));
  return {std::sqrt(dd / std::max(ww, 1e-30)), dmax / std::max(rms, 1e-30)};
}

// Forward: x [rows, k] * w[e]^T, w [E, n, k]. dgrad: dy [rows, k] * w[e], w [E, k, n]
// (grouped_linear_backward_input; the "k" of the product is then w's N).
void run_case(const char* proj, int64_t k, int64_t n, const char* split_name, const std::vector<int64_t>& splits,
              int runs, bool dgrad, bool cluster) {
  Context ctx = Context::cuda(0);
  Tensor x = Tensor::empty({kRows, k}, DType::BF16, ctx.device);
  Tensor w = dgrad ? Tensor::empty({kExperts, k, n}, DType::BF16, ctx.device)
                   : Tensor::empty({kExperts, n, k}, DType::BF16, ctx.device);
  fill_uniform(ctx, x, -1, 1, 11);
  fill_uniform(ctx, w, -0.02f, 0.02f, 12);
  std::vector<int64_t> off(splits.size() + 1, 0);
  for (size_t e = 0; e < splits.size(); ++e) off[e + 1] = off[e] + splits[e];
  const Tensor offsets = Tensor::from_ints(off, {kExperts + 1}, DType::I64).to(ctx.device);
  const double flop = 2.0 * kRows * n * k;

  Tensor ref = Tensor::empty({kRows, n}, DType::BF16, ctx.device);
  cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Cublas);
  set_grouped_gemm_streams(1);
  auto front_end = [&](Tensor& out) {  // the cuBLASLt loop unless the backend is Own
    if (dgrad) {
      grouped_linear_backward_input(ctx, x, w, splits, out);
    } else {
      grouped_linear_forward(ctx, x, w, splits, out);
    }
  };
  front_end(ref);

  // Prints the row; false when the output is off (such a variant is never "best").
  auto report = [&](const char* what, double ms, const Tensor* out) {
    std::string err = "-";
    bool ok = true;
    if (out) {
      const Error e = compare(*out, ref);
      ok = e.rel < 1e-2;
      char buf[96];
      std::snprintf(buf, sizeof(buf), "%.1e (max %.1e rms) %s", e.rel, e.max_over_rms, e.rel < 1e-2 ? "ok" : "WRONG");
      err = buf;
    }
    std::printf("| %-8s | %-8s | %-16s | %7.3f | %6.1f | %s |\n", proj, split_name, what, ms, flop / ms * 1e-9,
                err.c_str());
    std::fflush(stdout);
    return ok;
  };

  Tensor y = Tensor::empty({kRows, n}, DType::BF16, ctx.device);
  if (cluster) {
    report("cublas s1", median_ms([&] { front_end(y); }, runs, 3), nullptr);
    if (dgrad ? !cuda::grouped_gemm_wgmma_backward_input_supported(x, w, y) : !cuda::grouped_gemm_wgmma_supported(x, w, y))
      return;
    for (cuda::GroupedGemmVariant v : cuda::kGroupedGemmClusterVariants) {
      Tensor yo = Tensor::empty({kRows, n}, DType::BF16, ctx.device);
      const double ms = median_ms(
          [&] {
            if (dgrad) {
              cuda::grouped_gemm_wgmma_backward_input(ctx.stream, x, w, offsets, yo, v);
            } else {
              cuda::grouped_gemm_wgmma_forward(ctx.stream, x, w, offsets, yo, v);
            }
          },
          runs, 3);
      report(cuda::grouped_gemm_variant_name(v), ms, &yo);
    }
    return;
  }
  for (int streams : {1, 4}) {
    set_grouped_gemm_streams(streams);
    const double ms = median_ms([&] { front_end(y); }, runs, 3);
    report(streams == 1 ? "cublas s1" : "cublas s4", ms, streams == 1 ? nullptr : &y);
  }
  set_grouped_gemm_streams(1);
  if (dgrad ? !cuda::grouped_gemm_wgmma_backward_input_supported(x, w, y)
            : !cuda::grouped_gemm_wgmma_supported(x, w, y)) {
    std::printf("| %-8s | %-8s | own              | (not supported on this GPU / shape) |\n", proj, split_name);
    return;
  }
  cuda::GroupedGemmVariant best = cuda::GroupedGemmVariant::Coop256;
  double best_ms = INFINITY;
  for (cuda::GroupedGemmVariant v : cuda::kGroupedGemmVariants) {
    Tensor yo = Tensor::empty({kRows, n}, DType::BF16, ctx.device);
    const double ms = median_ms(
        [&] {
          if (dgrad) {
            cuda::grouped_gemm_wgmma_backward_input(ctx.stream, x, w, offsets, yo, v);
          } else {
            cuda::grouped_gemm_wgmma_forward(ctx.stream, x, w, offsets, yo, v);
          }
        },
        runs, 3);
    if (report(cuda::grouped_gemm_variant_name(v), ms, &yo) && ms < best_ms) best_ms = ms, best = v;
  }
  const cuda::GroupedGemmVariant saved = cuda::grouped_gemm_variant();
  cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Own);
  cuda::set_grouped_gemm_variant(best);
  Tensor yf = Tensor::empty({kRows, n}, DType::BF16, ctx.device);
  const double ms = median_ms([&] { front_end(yf); }, runs, 3);
  const std::string what = std::string("op ") + cuda::grouped_gemm_variant_name(best);
  report(what.c_str(), ms, &yf);
  cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Cublas);
  cuda::set_grouped_gemm_variant(saved);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int runs = argc > 1 ? std::max(5, std::atoi(argv[1])) : 20;
    cudaDeviceProp prop{};
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("grouped GEMM (forward and dgrad) on %s: %lld rows over %lld experts, BF16, median of %d runs after 3 warm-ups;\n"
                "error against the cuBLASLt loop on one stream\n\n",
                prop.name, static_cast<long long>(kRows), static_cast<long long>(kExperts), runs);
    std::printf("| proj     | splits   | kernel           |      ms | TFLOP/s | error |\n|---|---|---|---|---|---|\n");
    const std::vector<int64_t> balanced(kExperts, kRows / kExperts);
    const std::vector<int64_t> skewed = {4096, 3072, 2048, 2048, 1536, 1536, 1024, 1024};
    for (bool cluster : {false, true}) {
      if (cluster)
        std::printf("\ncluster variants (last: a failure here loses no row above)\n\n"
                    "| proj     | splits   | kernel           |      ms | TFLOP/s | error |\n|---|---|---|---|---|---|\n");
      run_case("gate+up", 4096, 28672, "balanced", balanced, runs, false, cluster);
      run_case("gate+up", 4096, 28672, "skewed", skewed, runs, false, cluster);
      run_case("down", 14336, 4096, "balanced", balanced, runs, false, cluster);
      run_case("down", 14336, 4096, "skewed", skewed, runs, false, cluster);
      // dx of gate+up: dy [16384, 28672] * w[e] [28672, 4096].
      run_case("dgrad gu", 28672, 4096, "balanced", balanced, runs, true, cluster);
      run_case("dgrad gu", 28672, 4096, "skewed", skewed, runs, true, cluster);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_grouped_gemm: %s\n", e.what());
    return 1;
  }
}
