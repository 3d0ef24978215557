// A quick probe of the Hopper wgmma attention backward (launch_backward_wgmma,
// src/backend/cuda/attention_bwd_wgmma.h): dQ, dK and dV are checked against an FP64 host
// reference on several odd shapes (partial tiles, GQA, more or fewer keys than queries, query
// rows that see no key, a negative scale, D = 64 and 128), then timed at the shapes of
// bench_attention.
//
// Why it exists: as bench/attention_fwd_probe.cu, it links only the kernel's own files (no
// libtessera), so scripts/attention-bwd-probe.sh builds it on the development machine and the
// binary runs on the H200 as it is: a device call of seconds for iterating on the kernel. The
// full checks stay tests/test_gpu_attention.cpp and the full benchmark bench_attention.
//
// Usage: attention_bwd_probe [--check-only | --time-only]
// Output: one line per check shape with the relative L2 errors and max abs errors of dq, dk
// and dv, then per speed shape the median time of memset(dq_accum) + kernel (what the library
// runs per backward) and of the kernel alone, with TFLOP/s (FlashAttention's backward count:
// 2.5 * 4 B Hq T S D, halved when causal). Exit 2 when a check fails, 1 on a CUDA error.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "backend/cuda/attention_bwd_wgmma.h"
#include "probe_util.h"

using namespace tessera::cuda::attn;

namespace {

struct Problem {
  int B, Hq, Hkv, T, S, D;
  bool causal;
  float scale;  // 0: 1 / sqrt(D)
  float softmax_scale() const { return scale != 0 ? scale : 1.0f / std::sqrt(static_cast<float>(D)); }
  double flops() const { return 2.5 * 4.0 * B * Hq * double(T) * S * D / (causal ? 2 : 1); }
  // Keys query row i sees (bottom-right causal alignment); 0 or less: none.
  int seen(int i) const { return causal ? std::min(S, i + (S - T) + 1) : S; }
  size_t nq() const { return size_t(B) * T * Hq * D; }
  size_t nk() const { return size_t(B) * S * Hkv * D; }
  size_t nrows() const { return size_t(B) * Hq * T; }
};

// The device side of one problem; the reference keeps its own host copies.
struct Buffers {
  bf16_t *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr;
  bf16_t *dq = nullptr, *dk = nullptr, *dv = nullptr;
  float *lse = nullptr, *delta = nullptr, *dq_accum = nullptr, *row_stats = nullptr;
};

float* to_device_f32(const std::vector<float>& x) {
  float* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, x.size() * 4));
  CHECK_CUDA(cudaMemcpy(d, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

void alloc_outputs(const Problem& p, Buffers& b) {
  CHECK_CUDA(cudaMalloc(&b.dq, p.nq() * 2));
  CHECK_CUDA(cudaMalloc(&b.dk, p.nk() * 2));
  CHECK_CUDA(cudaMalloc(&b.dv, p.nk() * 2));
  CHECK_CUDA(cudaMalloc(&b.dq_accum, p.nq() * 4));
  BwdParams shape{};
  shape.T = p.T;
  shape.Hq = p.Hq;
  CHECK_CUDA(cudaMalloc(&b.row_stats, backward_wgmma_scratch_floats(p.B, shape) * 4));
}

void free_buffers(Buffers& b) {
  for (void* ptr : {static_cast<void*>(b.q), static_cast<void*>(b.k), static_cast<void*>(b.v),
                    static_cast<void*>(b.dout), static_cast<void*>(b.dq), static_cast<void*>(b.dk),
                    static_cast<void*>(b.dv), static_cast<void*>(b.lse), static_cast<void*>(b.delta),
                    static_cast<void*>(b.dq_accum), static_cast<void*>(b.row_stats)})
    CHECK_CUDA(cudaFree(ptr));
}

BwdParams params(const Problem& p, const Buffers& b) {
  BwdParams bp{};
  bp.q = b.q;
  bp.k = b.k;
  bp.v = b.v;
  bp.d_out = b.dout;
  bp.lse = b.lse;
  bp.delta = b.delta;
  bp.dq = b.dq;
  bp.dk = b.dk;
  bp.dv = b.dv;
  bp.T = p.T;
  bp.S = p.S;
  bp.Hq = p.Hq;
  bp.Hkv = p.Hkv;
  bp.group = p.Hq / p.Hkv;
  bp.scale = p.softmax_scale();
  bp.scale_log2 = p.softmax_scale() * kLog2e;
  bp.causal = p.causal;
  bp.dq_accum = b.dq_accum;
  return bp;
}

bool launch(const Problem& p, const Buffers& b) {
  return launch_backward_wgmma(nullptr, params(p, b), p.D, p.B, b.row_stats);
}

// Runs f(0 .. n-1) over the host's cores: the reference runs on the H200 machine's 16.
template <class F>
void parallel_for(int n, const F& f) {
  const int threads = std::max(1, std::min<int>(n, static_cast<int>(std::thread::hardware_concurrency())));
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      for (int i; (i = next.fetch_add(1)) < n;) f(i);
    });
  for (std::thread& t : pool) t.join();
}

double dot(const float* a, const float* b, int n) {
  double s = 0;
  for (int d = 0; d < n; ++d) s += double(a[d]) * b[d];
  return s;
}

// Host inputs, what the forward hands the backward (lse and delta as the GPU stores them),
// and the FP64 gradients.
struct Reference {
  std::vector<float> q, k, v, dout, lse, delta;
  std::vector<double> dq, dk, dv;
};

// The forward in FP64; the backward sees its lse as float and delta from the BF16 output,
// as it would after the GPU forward.
void forward(const Problem& p, Reference& r) {
  r.lse.assign(p.nrows(), 0.f);
  r.delta.assign(p.nrows(), 0.f);
  const double scale = p.softmax_scale();
  parallel_for(p.B * p.Hq * p.T, [&](int row) {
    const int i = row % p.T, h = row / p.T % p.Hq, bb = row / p.T / p.Hq;
    const int kvh = h / (p.Hq / p.Hkv), seen = std::max(0, p.seen(i));
    const size_t qoff = ((size_t(bb) * p.T + i) * p.Hq + h) * p.D;
    std::vector<double> s(std::max(seen, 1)), out(p.D, 0.0);
    double mx = -INFINITY;
    for (int j = 0; j < seen; ++j) {
      s[j] = scale * dot(&r.q[qoff], &r.k[((size_t(bb) * p.S + j) * p.Hkv + kvh) * p.D], p.D);
      mx = std::max(mx, s[j]);
    }
    double sum = 0;
    for (int j = 0; j < seen; ++j) sum += (s[j] = std::exp(s[j] - mx));
    for (int j = 0; j < seen; ++j) {
      const float* vj = &r.v[((size_t(bb) * p.S + j) * p.Hkv + kvh) * p.D];
      for (int d = 0; d < p.D; ++d) out[d] += s[j] / sum * vj[d];
    }
    double delta = 0;
    for (int d = 0; d < p.D; ++d) delta += double(r.dout[qoff + d]) * __bfloat162float(__float2bfloat16(float(out[d])));
    r.lse[row] = seen > 0 ? static_cast<float>(mx + std::log(sum)) : -INFINITY;
    r.delta[row] = static_cast<float>(delta);
  });
}

// The backward in FP64 from P recomputed with the float lse, as the kernel does.
void backward(const Problem& p, Reference& r) {
  r.dq.assign(p.nq(), 0.0);
  r.dk.assign(p.nk(), 0.0);
  r.dv.assign(p.nk(), 0.0);
  const double scale = p.softmax_scale();
  std::vector<double> P(size_t(p.T) * p.S), dS(size_t(p.T) * p.S);
  for (int bb = 0; bb < p.B; ++bb)
    for (int h = 0; h < p.Hq; ++h) {  // serial over heads: a GQA group's heads add into one dK/dV
      const int kvh = h / (p.Hq / p.Hkv);
      auto qrow = [&](const std::vector<float>& x, int i) { return &x[((size_t(bb) * p.T + i) * p.Hq + h) * p.D]; };
      auto krow = [&](const std::vector<float>& x, int j) { return &x[((size_t(bb) * p.S + j) * p.Hkv + kvh) * p.D]; };
      parallel_for(p.T, [&](int i) {
        const float lse = r.lse[(size_t(bb) * p.Hq + h) * p.T + i], delta = r.delta[(size_t(bb) * p.Hq + h) * p.T + i];
        const int seen = std::isinf(lse) ? 0 : std::max(0, p.seen(i));
        double* dq = &r.dq[((size_t(bb) * p.T + i) * p.Hq + h) * p.D];
        for (int j = 0; j < p.S; ++j) {
          double pij = 0, dsij = 0;
          if (j < seen) {
            pij = std::exp(scale * dot(qrow(r.q, i), krow(r.k, j), p.D) - double(lse));
            dsij = pij * (dot(qrow(r.dout, i), krow(r.v, j), p.D) - double(delta));
            const float* kj = krow(r.k, j);
            for (int d = 0; d < p.D; ++d) dq[d] += scale * dsij * kj[d];
          }
          P[size_t(i) * p.S + j] = pij;
          dS[size_t(i) * p.S + j] = dsij;
        }
      });
      parallel_for(p.S, [&](int j) {
        double* dk = &r.dk[((size_t(bb) * p.S + j) * p.Hkv + kvh) * p.D];
        double* dv = &r.dv[((size_t(bb) * p.S + j) * p.Hkv + kvh) * p.D];
        for (int i = 0; i < p.T; ++i) {
          const double pij = P[size_t(i) * p.S + j], dsij = dS[size_t(i) * p.S + j];
          if (pij == 0 && dsij == 0) continue;
          const float *qi = qrow(r.q, i), *doi = qrow(r.dout, i);
          for (int d = 0; d < p.D; ++d) {
            dv[d] += pij * doi[d];
            dk[d] += scale * dsij * qi[d];
          }
        }
      });
    }
}

struct Error {
  double rel, max_abs;
};

// Relative L2 error and max abs error; infinite when got holds a NaN or inf.
Error compare(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0, ref = 0, max_abs = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return {INFINITY, INFINITY};
    const double e = got[i] - want[i];
    diff += e * e;
    ref += want[i] * want[i];
    max_abs = std::max(max_abs, std::fabs(e));
  }
  return {std::sqrt(diff / std::max(ref, 1e-300)), max_abs};
}

std::vector<float> read_bf16(const bf16_t* d, size_t n) {
  std::vector<bf16_t> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = __bfloat162float(h[i]);
  return x;
}

// True when the shape passes; exits 0 when this GPU has no wgmma backward.
bool check(const Problem& p) {
  std::mt19937 gen(2000u + p.T * 7u + p.S);
  Reference r;
  r.q = random_bf16(p.nq(), gen, -2, 2);  // far from a flat softmax, as the forward probe
  r.k = random_bf16(p.nk(), gen, -2, 2);
  r.v = random_bf16(p.nk(), gen, -1, 1);
  r.dout = random_bf16(p.nq(), gen, -1, 1);
  forward(p, r);
  backward(p, r);

  Buffers b;
  b.q = to_device(r.q);
  b.k = to_device(r.k);
  b.v = to_device(r.v);
  b.dout = to_device(r.dout);
  b.lse = to_device_f32(r.lse);
  b.delta = to_device_f32(r.delta);
  alloc_outputs(p, b);
  CHECK_CUDA(cudaMemset(b.dk, 0xff, p.nk() * 2));  // NaN: an unwritten element shows
  CHECK_CUDA(cudaMemset(b.dv, 0xff, p.nk() * 2));
  CHECK_CUDA(cudaMemset(b.dq_accum, 0, p.nq() * 4));
  if (!launch(p, b)) {
    std::printf("wgmma backward not available on this GPU\n");
    std::exit(0);
  }
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());

  const std::vector<float> dk = read_bf16(b.dk, p.nk()), dv = read_bf16(b.dv, p.nk());
  std::vector<float> dq(p.nq());
  CHECK_CUDA(cudaMemcpy(dq.data(), b.dq_accum, dq.size() * 4, cudaMemcpyDeviceToHost));
  for (float& x : dq) x *= p.softmax_scale();
  free_buffers(b);

  // Rows that see no key must get an exact zero dQ (not merely a small one: no NaN from -inf).
  size_t empty_rows = 0, nonzero = 0;
  for (int bb = 0; bb < p.B; ++bb)
    for (int i = 0; i < p.T; ++i) {
      if (p.seen(i) > 0) continue;
      empty_rows += p.Hq;
      const float* row = &dq[(size_t(bb) * p.T + i) * p.Hq * p.D];
      for (int e = 0; e < p.Hq * p.D; ++e) nonzero += row[e] != 0;
    }

  const Error eq = compare(dq, r.dq), ek = compare(dk, r.dk), ev = compare(dv, r.dv);
  const double bound = 2e-2;  // BF16 outputs; loose until the kernel's numbers are in
  const bool good = eq.rel < bound && ek.rel < bound && ev.rel < bound && nonzero == 0;
  std::printf("check B=%d H=%d/%d T=%d S=%d D=%d %s scale %.3g | rel dq %.2e dk %.2e dv %.2e | max abs dq %.2e dk "
              "%.2e dv %.2e",
              p.B, p.Hq, p.Hkv, p.T, p.S, p.D, p.causal ? "causal" : "full", p.softmax_scale(), eq.rel, ek.rel, ev.rel,
              eq.max_abs, ek.max_abs, ev.max_abs);
  if (empty_rows > 0) std::printf(" | %zu empty rows, %zu nonzero dq", empty_rows, nonzero);
  std::printf(" | %s\n", good ? "ok" : "MISMATCH");
  return good;
}

// Deterministic uniform values in [lo, hi) from a hash of the index: the speed shapes' inputs
// are hundreds of MB, too slow to draw on the host.
__device__ float hash_uniform(uint64_t i, uint32_t seed) {
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}

// T is float or bf16_t (its float constructor rounds to nearest, as __float2bfloat16).
template <typename T>
__global__ void fill_uniform(T* x, size_t n, uint32_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = T(lo + (hi - lo) * hash_uniform(i, seed));
}

template <typename T>
T* random_device(size_t n, uint32_t seed, float lo, float hi) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, n * sizeof(T)));
  fill_uniform<T><<<1024, 256>>>(d, n, seed, lo, hi);
  CHECK_CUDA(cudaGetLastError());
  return d;
}

// Median over 20 runs after 3 warm-ups, in ms; with_memset adds the dq_accum zeroing the
// library issues before every backward.
double time_ms(const Problem& p, const Buffers& b, bool with_memset) {
  const double ms = median_ms(
      [&] {
        if (with_memset) CHECK_CUDA(cudaMemsetAsync(b.dq_accum, 0, p.nq() * 4, nullptr));
        launch(p, b);
      },
      20, 3);
  CHECK_CUDA(cudaGetLastError());
  return ms;
}

void time_backward(const Problem& p) {
  Buffers b;
  b.q = random_device<bf16_t>(p.nq(), 1, -2, 2);
  b.k = random_device<bf16_t>(p.nk(), 2, -2, 2);
  b.v = random_device<bf16_t>(p.nk(), 3, -1, 1);
  b.dout = random_device<bf16_t>(p.nq(), 4, -1, 1);
  // Not the forward's lse: plausible values that keep exp(s - lse) finite (the scaled scores
  // of these inputs stay within about +-10), which is all the timing needs.
  b.lse = random_device<float>(p.nrows(), 5, 4.5f, 5.5f);
  b.delta = random_device<float>(p.nrows(), 6, -0.1f, 0.1f);
  alloc_outputs(p, b);
  CHECK_CUDA(cudaMemset(b.dq_accum, 0, p.nq() * 4));
  CHECK_CUDA(cudaDeviceSynchronize());
  if (!launch(p, b)) {
    std::printf("wgmma backward not available on this GPU\n");
    std::exit(0);
  }
  const double total = time_ms(p, b, true), kernel = time_ms(p, b, false);
  std::printf("time  B=%d H=%d/%d T=%d D=%d %s | memset+kernel %.3f ms %.1f TFLOP/s | kernel %.3f ms %.1f TFLOP/s\n",
              p.B, p.Hq, p.Hkv, p.T, p.D, p.causal ? "causal" : "full", total, p.flops() / total * 1e-9, kernel,
              p.flops() / kernel * 1e-9);
  free_buffers(b);
}

}  // namespace

int main(int argc, char** argv) {
  bool checks_on = true, timing_on = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--check-only") == 0) {
      timing_on = false;
    } else if (std::strcmp(argv[i], "--time-only") == 0) {
      checks_on = false;
    } else {
      std::printf("usage: attention_bwd_probe [--check-only | --time-only]\n");
      return 1;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("attention_bwd_probe: no GPU present\n");
    return 0;
  }
  bool ok = true;
  if (checks_on) {
    const Problem checks[] = {
        {1, 2, 2, 257, 130, 128, false, 0},   {1, 4, 1, 513, 1000, 64, true, 0.3f},
        {2, 2, 2, 384, 384, 128, true, 0},    {1, 2, 1, 200, 333, 64, false, 0},
        {1, 2, 2, 130, 70, 128, true, 0},  // S < T: the first 60 query rows see no key
        {1, 1, 1, 64, 64, 128, true, -0.1f},
    };
    for (const Problem& p : checks) ok &= check(p);
    std::printf("checks: %s\n", ok ? "all ok" : "SOME MISMATCH");
  }
  if (timing_on) {
    const Problem speed[] = {{4, 32, 32, 4096, 4096, 128, true, 0}, {16, 12, 12, 1024, 1024, 64, true, 0},
                             {4, 32, 8, 2048, 2048, 64, true, 0}};
    for (const Problem& p : speed) time_backward(p);
  }
  return ok ? 0 : 2;
}
