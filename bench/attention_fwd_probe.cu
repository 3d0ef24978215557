// A quick probe of the tensor-core attention forward's variants (attention_forward_fast's
// `variant`, src/backend/cuda/attention.h): each is checked against an FP64 reference on the
// host (several odd shapes: partial tiles, GQA, decode, more or fewer keys than queries, a
// negative scale, D = 64 and 128), then timed side by side at the shapes of bench_attention.
//
// Why it exists: it links only the forward's kernel files (no libtessera), so
// scripts/attention-fwd-probe.sh compiles it on the development machine in about 40 s and the
// binary runs on the H200 as it is (static CUDA runtime, only libstdc++ / libc needed): a
// device call of seconds instead of a library build of minutes, for iterating on a kernel.
// The full checks stay tests/test_gpu_attention.cpp and the full benchmark bench_attention.
//
// Usage: attention_fwd_probe [variant ...]      (default: 9 and 16 .. kLastAttentionForwardVariant)
// Output: one line per (check shape, variant) with the relative errors of out and lse, then
// one line per (speed shape, variant) with the median time and TFLOP/s (FlashAttention's
// count: 4 B H T S D, halved when causal). Exit 2 when a check fails, 1 on a CUDA error.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "backend/cuda/attention.h"
#include "probe_util.h"
#include "backend/cuda/attention_fwd_variants.h"

using namespace tessera::cuda;
using namespace tessera::cuda::attn;

namespace {

struct Problem {
  int B, Hq, Hkv, T, S, D;
  bool causal;
  float scale;  // 0: 1 / sqrt(D)
  float softmax_scale() const { return scale != 0 ? scale : 1.0f / std::sqrt(static_cast<float>(D)); }
  double flops() const { return 4.0 * B * Hq * double(T) * S * D / (causal ? 2 : 1); }
};

// Inputs on the host (BF16 values kept as float for the reference) and on the device.
struct Buffers {
  std::vector<float> q, k, v;
  __nv_bfloat16 *dq = nullptr, *dk = nullptr, *dv = nullptr, *dout = nullptr;
  float* dlse = nullptr;
};

Buffers make_buffers(const Problem& p, unsigned seed) {
  std::mt19937 gen(seed);
  Buffers b;
  const size_t nq = size_t(p.B) * p.T * p.Hq * p.D, nk = size_t(p.B) * p.S * p.Hkv * p.D;
  b.q = random_bf16(nq, gen, -2, 2);  // far from a flat softmax, as the tests do
  b.k = random_bf16(nk, gen, -2, 2);
  b.v = random_bf16(nk, gen, -1, 1);
  b.dq = to_device(b.q);
  b.dk = to_device(b.k);
  b.dv = to_device(b.v);
  CHECK_CUDA(cudaMalloc(&b.dout, nq * 2));
  CHECK_CUDA(cudaMalloc(&b.dlse, size_t(p.B) * p.Hq * p.T * 4));
  return b;
}

void free_buffers(Buffers& b) {
  for (void* ptr : {static_cast<void*>(b.dq), static_cast<void*>(b.dk), static_cast<void*>(b.dv),
                    static_cast<void*>(b.dout), static_cast<void*>(b.dlse)})
    CHECK_CUDA(cudaFree(ptr));
}

// out [B, T, Hq, D] and lse [B, Hq, T] in FP64, bottom-right causal mask.
void reference(const Problem& p, const Buffers& b, std::vector<double>& out, std::vector<double>& lse) {
  out.assign(size_t(p.B) * p.T * p.Hq * p.D, 0.0);
  lse.assign(size_t(p.B) * p.Hq * p.T, 0.0);
  const double scale = p.softmax_scale();
  std::vector<double> s(p.S);
  for (int bb = 0; bb < p.B; ++bb)
    for (int h = 0; h < p.Hq; ++h) {
      const int kvh = h / (p.Hq / p.Hkv);
      for (int i = 0; i < p.T; ++i) {
        const float* qi = &b.q[((size_t(bb) * p.T + i) * p.Hq + h) * p.D];
        const int seen = p.causal ? std::min(p.S, i + (p.S - p.T) + 1) : p.S;
        double mx = -INFINITY;
        for (int j = 0; j < seen; ++j) {
          const float* kj = &b.k[((size_t(bb) * p.S + j) * p.Hkv + kvh) * p.D];
          double dot = 0;
          for (int d = 0; d < p.D; ++d) dot += double(qi[d]) * kj[d];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (int j = 0; j < seen; ++j) sum += (s[j] = std::exp(s[j] - mx));
        double* oi = &out[((size_t(bb) * p.T + i) * p.Hq + h) * p.D];
        for (int j = 0; j < seen; ++j) {
          const float* vj = &b.v[((size_t(bb) * p.S + j) * p.Hkv + kvh) * p.D];
          for (int d = 0; d < p.D; ++d) oi[d] += s[j] / sum * vj[d];
        }
        lse[(size_t(bb) * p.Hq + h) * p.T + i] = seen > 0 ? mx + std::log(sum) : -INFINITY;
      }
    }
}

FwdParams params(const Problem& p, const Buffers& b) {
  return FwdParams{b.dq, b.dk, b.dv, b.dout, b.dlse, p.T, p.S, p.Hq, p.Hkv, p.Hq / p.Hkv,
                   p.softmax_scale() * kLog2e, p.causal};
}

// Runs `variant` as attention_forward_fast would (variants 0-2 live in attention_fwd.cu, which
// needs libtessera: not probed). False when the variant does not exist.
bool run_variant(const Problem& p, const Buffers& b, int variant) {
  return launch_forward_variant(nullptr, params(p, b), p.D, variant, int64_t(p.B) * p.Hq, p.T);
}

double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    ref += want[i] * want[i];
  }
  return std::sqrt(diff / std::max(ref, 1e-300));
}

bool check(const Problem& p, const std::vector<int>& variants) {
  Buffers b = make_buffers(p, 1000u + p.T * 7u + p.S);
  std::vector<double> r_out, r_lse;
  reference(p, b, r_out, r_lse);
  bool ok = true;
  for (int variant : variants) {
    CHECK_CUDA(cudaMemset(b.dout, 0xff, r_out.size() * 2));  // NaN: an unwritten element shows
    CHECK_CUDA(cudaMemset(b.dlse, 0xff, r_lse.size() * 4));
    if (!run_variant(p, b, variant)) continue;
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<__nv_bfloat16> h(r_out.size());
    std::vector<float> out(r_out.size()), lse(r_lse.size());
    CHECK_CUDA(cudaMemcpy(h.data(), b.dout, h.size() * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(lse.data(), b.dlse, lse.size() * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < h.size(); ++i) out[i] = __bfloat162float(h[i]);
    const double e_out = relative_error(out, r_out), e_lse = relative_error(lse, r_lse);
    const bool good = e_out < 1e-2 && e_lse < 1e-4;  // tests/test_gpu_attention.cpp's bounds
    ok &= good;
    std::printf("check B=%d H=%d/%d T=%d S=%d D=%d %s scale %.3g | variant %2d | out %.2e lse %.2e | %s\n", p.B, p.Hq,
                p.Hkv, p.T, p.S, p.D, p.causal ? "causal" : "full", p.softmax_scale(), variant, e_out, e_lse,
                good ? "ok" : "MISMATCH");
  }
  free_buffers(b);
  return ok;
}

void time_variants(const Problem& p, const std::vector<int>& variants) {
  Buffers b = make_buffers(p, 99);
  for (int variant : variants) {
    if (!run_variant(p, b, variant)) continue;
    const double median = median_ms([&] { run_variant(p, b, variant); }, 25, 3);
    std::printf("time  B=%d H=%d/%d T=%d D=%d %s | variant %2d | %.3f ms | %.1f TFLOP/s\n", p.B, p.Hq, p.Hkv, p.T, p.D,
                p.causal ? "causal" : "full", variant, median, p.flops() / median * 1e-9);
  }
  free_buffers(b);
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("attention_fwd_probe: no GPU present\n");
    return 0;
  }
  std::vector<int> variants;
  for (int i = 1; i < argc; ++i) variants.push_back(std::atoi(argv[i]));
  if (variants.empty()) {
    variants.push_back(9);
    for (int v = kWgmmaForwardVariant; v <= kLastAttentionForwardVariant; ++v) variants.push_back(v);
  }
  const Problem checks[] = {
      {2, 4, 2, 300, 300, 128, true, 0},   {1, 2, 1, 129, 600, 128, false, -0.3f}, {1, 2, 2, 70, 400, 128, true, 0},
      {1, 4, 4, 257, 257, 64, true, 0},    {2, 8, 2, 1, 300, 128, true, 0},        {1, 2, 2, 257, 130, 128, false, 0},
      {1, 4, 1, 513, 1000, 64, true, 0.3f},
  };
  bool ok = true;
  for (const Problem& p : checks) ok &= check(p, variants);
  std::printf("checks: %s\n", ok ? "all ok" : "SOME MISMATCH");
  const Problem speed[] = {{4, 32, 32, 4096, 4096, 128, true, 0}, {16, 12, 12, 1024, 1024, 64, true, 0},
                           {4, 32, 8, 2048, 2048, 64, true, 0}};
  for (const Problem& p : speed) time_variants(p, variants);
  return ok ? 0 : 2;
}
