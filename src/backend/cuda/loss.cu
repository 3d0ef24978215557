// Cross-entropy on the GPU with the CPU reference's rules (backend/cpu/loss.cpp): per-row
// log-sum-exp, the mean over rows whose target is not ignore_index (0 when there is none),
// and the gradient (softmax - one-hot) * d_loss / n_valid, zero on ignored rows. A bad
// target (outside [0, V), not ignore_index) is reported lazily (index_error.h): the loss
// becomes NaN, the row's gradient NaN, and the next embedding/cross-entropy call throws.
//
// Layout: logits / d_logits [N, V] row-major (row stride >= V). Forward, one read of each
// row: rows of up to 32768 BF16 / 16384 F32 logits whose rows are 16-byte aligned are held
// in registers as loaded (BF16 packed two to a register, so a thread holds 8 vectors in 32
// registers and more rows are in flight per SM) by a group of threads: the max, then the sum
// of exp2((x - max) * log2 e) from the registers. Wider or unaligned rows (GPT-2's 50257
// starts rows at any 2- or 4-byte boundary) take one 512-thread block per row, walked as a
// scalar head up to the first 16-byte boundary, 8-element vectors (four in flight per
// thread) and a scalar tail, with an online max and rescaled sum per thread merged across
// the block. Thread 0 of a row loads the target index before the row and the target logit
// after issuing the row's loads, so the row's term lse - logits[n, target] costs no memory
// round trip after the reductions. One block (a programmatic dependent launch: it counts
// the targets while the last rows run, then waits) sums the terms in a fixed order
// (deterministic). Backward: a one-block kernel computes d_loss / n_valid; the row kernel
// (its programmatic dependent) starts at once, 256 threads a row, two vectors in flight per
// thread, and reads the scale after its first loads are issued; the row's target and lse
// are loaded beside the row and ignored / bad rows go through the same walk (a select), so
// no load waits on another. It may run in place (d_logits == logits): every element is
// read and written by one thread.
// Floors: forward N * V * bytes / 4.1 TB/s (1024 x 128256 BF16 = 263 MB -> 64 us);
// backward twice that. Measured on the H200 against cudaMemcpy D2D (3.8 TB/s) in the same
// run (bench_bandwidth, 16384 x 4096 BF16): forward 12 -> 53% (single-pass rows, the
// target gathered per row), backward 66 -> 68%; then with the packed rows, the target
// logit loaded beside the row, PDL and exp2 (2026-11-30): forward 68%, backward 72%; at
// 16384 x 768 (rows of 1.5 KB, launch and tail bound) 45% / 44%. Still short of the 85%
// goal: a row of 4096 is too short to keep enough bytes in flight per SM.
// Warp-row forward and flat backward (the defaults where they apply; softmax_tuning.h keeps
// the kernels above selectable): rows of up to 4096 BF16 / 2048 F32 logits with vocabulary
// and stride multiples of 8 are held by 4 to 32 lanes of one warp (row_lse.cuh: one online
// pass over the registers, one merged butterfly, no barrier), and the loss block reduces
// with shuffles. The backward needs no reduction: it maps 16-byte vectors of the whole
// [N, V] gradient, 4 (or 8) per thread with all loads issued first, so short rows fill whole
// blocks. Floors as above. Speed: not yet measured.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "cuda_check.h"
#include "index_error.h"
#include "loss.h"
#include "row_lse.cuh"
#include "softmax_tuning.h"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace {

using vec::kWidth;

constexpr int kRowThreads = 512;     // the looping forward kernel: one block per row
constexpr int kGradThreads = 256;    // the backward: one block per row
constexpr int kReduceThreads = 1024;
constexpr int kLseMaxGroup = 512;    // the register forward kernel: threads per row ...
constexpr int kLseMaxVectors = 4;    // ... and F32 vectors per thread (rows up to 16384 logits;
                                     // BF16, packed: 8, rows up to 32768)
constexpr int kUnroll = 8;           // rows per thread per step of the single-block sums
constexpr int kRowVectors = 4;       // the looping forward kernel: vectors in flight per thread

// exp(d) as exp2f(d * log2(e)): one multiply and the SFU's exp2. d is x - max (or x - lse),
// exact near the max where the terms matter, so the scaling's rounding stays relative to d.
constexpr float kLog2e = 1.4426950408889634f;

// Programmatic dependent launch (sm_90): a kernel launched with launch_pdl may start before
// the one ahead of it in the stream ends, once every block of that one has called
// pdl_launch_dependents (or exited); it must call pdl_wait before touching anything the
// earlier kernel writes, and every one of its blocks calls it (so it cannot end first).
// Without the launch attribute, or below sm_90, both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- Online log-sum-exp ------------------------------------------------------------------
//
// (m, s) stands for s * exp(m): a running max and the sum of exp(x - m). -inf entries add
// nothing (so masked logits before the first finite one do not make 0 * inf), NaN
// entries make s NaN. A row whose max is +-inf gets NaN, as exp(inf - inf) gives on the CPU.

struct Lse {
  float m = -INFINITY, s = 0.0f;
};

template <int K>
__device__ __forceinline__ void lse_add(Lse& a, const float (&v)[K]) {
  float vmax = -INFINITY;
#pragma unroll
  for (int i = 0; i < K; ++i) vmax = fmaxf(vmax, v[i]);
  if (vmax > a.m) {
    a.s *= exp2f((a.m - vmax) * kLog2e);  // 0 * exp(-inf) = 0; NaN stays NaN
    a.m = vmax;
  }
#pragma unroll
  for (int i = 0; i < K; ++i)
    if (v[i] != -INFINITY) a.s += exp2f((v[i] - a.m) * kLog2e);
}

__device__ __forceinline__ float lse_rescaled(float s, float m, float to) {
  return m == -INFINITY ? s : s * expf(m - to);
}

__device__ __forceinline__ Lse lse_merge(Lse a, Lse b) {
  Lse r;
  r.m = fmaxf(a.m, b.m);
  r.s = lse_rescaled(a.s, a.m, r.m) + lse_rescaled(b.s, b.m, r.m);
  return r;
}

// Reduces one Lse per thread of a kRowThreads block; every thread gets the result.
__device__ Lse block_lse(Lse v) {
  __shared__ float shared_m[32], shared_s[32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    Lse other;
    other.m = __shfl_xor_sync(0xffffffffu, v.m, offset);
    other.s = __shfl_xor_sync(0xffffffffu, v.s, offset);
    v = lse_merge(v, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared_m[warp] = v.m, shared_s[warp] = v.s;
  __syncthreads();
  Lse r;
  for (int w = 0; w < kRowThreads / 32; ++w) r = lse_merge(r, Lse{shared_m[w], shared_s[w]});
  return r;
}

// The row's loss term lse - logits[n, target], in double, is written by thread 0 of the row
// next to lse; 0 for an ignored or bad target (the sum skips those rows). Thread 0 loads the
// target index before the row and the target logit once the row's loads are issued, so
// neither wait is on the row's path: the logit comes from lines the row is bringing in and
// is needed only after the reductions.
// fetch() only loads the index (code testing it there would stall the warp before the row's
// loads); gather() tests it and loads the logit, after the row's loads are issued.
struct RowTarget {
  int64_t t = 0;
  bool ok = false;
  float x = 0.0f;
  template <typename Tg>
  __device__ __forceinline__ void fetch(const Tg* targets, int64_t row) {
    t = static_cast<int64_t>(targets[row]);
  }
  template <typename T>
  __device__ __forceinline__ void gather(const T* row_logits, int64_t vocab, int64_t ignore_index) {
    ok = t != ignore_index && t >= 0 && t < vocab;
    if (ok) x = vec::load(row_logits, t);
  }
  __device__ __forceinline__ void write(int64_t row, float lse_value, double* terms) const {
    terms[row] = ok ? static_cast<double>(lse_value) - static_cast<double>(x) : 0.0;
  }
};

__device__ __forceinline__ float lse_value(float m, float s) {
  return (m == INFINITY || m == -INFINITY) ? NAN : m + logf(s);
}

// One block per row of any width and alignment: a scalar head to the first 16-byte
// boundary, kRowVectors vectors in flight per thread per step, a scalar tail; an online
// (max, rescaled sum) per thread, merged across the block. One read of the row.
template <typename T, typename Tg>
__global__ void __launch_bounds__(kRowThreads)
    lse_kernel(const T* logits, const Tg* targets, float* lse, double* terms, int64_t vocab, int64_t ld,
               int64_t ignore_index) {
  const T* x = logits + blockIdx.x * ld;
  pdl_launch_dependents();  // the loss kernel may start; it waits before reading terms
  RowTarget target;
  if (threadIdx.x == 0) target.fetch(targets, blockIdx.x);
  const int64_t head = min(vec::misalignment_head(x), vocab);
  const int64_t vectors = (vocab - head) / kWidth;
  Lse acc;
  for (int64_t c = threadIdx.x; c < head; c += kRowThreads) lse_add<1>(acc, {vec::load(x, c)});
  for (int64_t u0 = threadIdx.x; u0 < vectors; u0 += int64_t(kRowVectors) * kRowThreads) {
    vec::Packed8<T> p[kRowVectors];
#pragma unroll
    for (int q = 0; q < kRowVectors; ++q) {
      const int64_t u = u0 + int64_t(q) * kRowThreads;
      if (u < vectors) vec::load_packed(x + head + u * kWidth, p[q]);
    }
#pragma unroll
    for (int q = 0; q < kRowVectors; ++q) {
      if (u0 + int64_t(q) * kRowThreads >= vectors) break;
      float v[kWidth];
      vec::unpack(p[q], v);
      lse_add<kWidth>(acc, v);
    }
  }
  for (int64_t c = head + vectors * kWidth + threadIdx.x; c < vocab; c += kRowThreads) lse_add<1>(acc, {vec::load(x, c)});
  if (threadIdx.x == 0) target.gather(x, vocab, ignore_index);  // an L2 hit: the row was just read
  const Lse row = block_lse(acc);
  if (threadIdx.x != 0) return;
  const float value = lse_value(row.m, row.s);
  lse[blockIdx.x] = value;
  target.write(blockIdx.x, value, terms);
}

// Reduces v over the blockDim.x threads of a row group; every thread of the group gets the
// same bits. Up to a warp: xor butterfly; several warps (the group is then the whole block):
// warp results through `shared`, combined in warp order.
template <typename Op>
__device__ __forceinline__ float group_reduce(float v, float* shared, Op op) {
  const int width = blockDim.x < 32 ? blockDim.x : 32;
  for (int offset = width / 2; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if (blockDim.x <= 32) return v;
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = shared[0];
  for (int w = 1; w < int(blockDim.x >> 5); ++w) r = op(r, shared[w]);
  return r;
}

// Rows of vocab % 8 == 0 logits, 16-byte aligned, held in registers as loaded (BF16
// packed, half the registers of floats: more rows in flight per SM): NV vectors per thread
// of a group of blockDim.x threads (a warp's loads contiguous); blockDim.y rows per block.
// The max first, then the sum of exp(x - max) from the registers: one read of the row, and
// a more accurate sum than the online rescaling. -inf entries (and the padding of a partial
// group, set to -inf) add exp(-inf) = 0; a NaN makes the sum NaN; a max of +-inf gives NaN.
template <typename T, typename Tg, int NV>
__global__ void __launch_bounds__(kLseMaxGroup)
    lse_rows_kernel(const T* logits, const Tg* targets, float* lse, double* terms, int64_t rows, int64_t vocab,
                    int64_t ld, int64_t ignore_index) {
  __shared__ float red[2][32];
  pdl_launch_dependents();  // the loss kernel may start; it waits before reading terms
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const T* x = logits + (live ? row : 0) * ld;
  RowTarget target;
  if (live && threadIdx.x == 0) target.fetch(targets, row);
  const int width = int(vocab);  // at most kLseMaxGroup * 8 * kWidth: 32-bit column offsets
  vec::Packed8<T> u[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = (j * int(blockDim.x) + int(threadIdx.x)) * kWidth;
    if (live && c < width) vec::load_packed(x + c, u[j]);
    else vec::fill_neg_inf(u[j]);
  }
  if (live && threadIdx.x == 0) target.gather(x, vocab, ignore_index);
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    float v[kWidth];
    vec::unpack(u[j], v);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) m = fmaxf(m, v[k]);
  }
  m = group_reduce(m, red[0], [](float a, float b) { return fmaxf(a, b); });
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    float v[kWidth];
    vec::unpack(u[j], v);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) s += exp2f((v[k] - m) * kLog2e);
  }
  s = group_reduce(s, red[1], [](float a, float b) { return a + b; });
  if (!live || threadIdx.x != 0) return;
  const float value = lse_value(m, s);
  lse[row] = value;
  target.write(row, value, terms);
}

// The warp-row forward (the default where it applies): rows of vocab % 8 == 0 logits, row
// stride a multiple of 8 and 16-byte aligned, held by G lanes of one warp (row_lse.cuh: one
// merged (max, sum) butterfly, no barrier); 128-thread blocks of 128 / G rows. The target is
// handled as in lse_rows_kernel (lane 0: index before the row, logit after its loads).
template <typename T, typename Tg, int NV>
__global__ void __launch_bounds__(warprow::kThreads, (warprow::min_blocks<T, NV>()))
    lse_warp_kernel(const T* logits, const Tg* targets, float* lse, double* terms, int64_t rows, int vocab,
                    int64_t ld, int64_t ignore_index, int g) {
  pdl_launch_dependents();  // the loss kernel may start; it waits before reading terms
  const int lane = int(threadIdx.x) & (g - 1);
  const int64_t row = int64_t(blockIdx.x) * (warprow::kThreads / g) + threadIdx.x / g;
  const bool live = row < rows;
  const T* x = logits + (live ? row : 0) * ld;
  RowTarget target;
  if (live && lane == 0) target.fetch(targets, row);
  warprow::RegRow<T, NV> r;
  r.load(x, live, lane, g, vocab);
  if (live && lane == 0) target.gather(x, vocab, ignore_index);
  float m, sum;
  r.lse_online(g, m, sum);
  if (!live || lane != 0) return;
  const float value = lse_value(m, sum);
  lse[row] = value;
  target.write(row, value, terms);
}

// ---- Fixed-order block sums ---------------------------------------------------------------

template <typename V>
__device__ V block_sum(V v) {
  __shared__ V shared[kReduceThreads];
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kReduceThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  const V result = shared[0];
  __syncthreads();  // shared is rewritten by the next call
  return result;
}

// The same sum over a kReduceThreads block in a fixed order with shuffles: a butterfly per
// warp, then one over the 32 warp sums (two barrier-free steps and one barrier, against the
// tree's eleven). `shared`: 32 entries, one array per call site (no reuse: no trailing barrier).
template <typename V>
__device__ __forceinline__ V warp_sum(V v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
template <typename V>
__device__ __forceinline__ V block_sum_shfl(V v, V* shared) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = v;
  __syncthreads();
  return warp_sum(threadIdx.x % 32 < kReduceThreads / 32 ? shared[threadIdx.x % 32] : V(0));
}

// loss = sum over valid rows of terms[n] (= lse[n] - logits[n, target]) / n_valid, in double;
// NaN when a target is bad. One block of kReduceThreads; thread i takes rows i, i + 1024, ...
// in that order, loading kUnroll of them before adding (the loads overlap; the order of the
// additions does not change). Ignored and bad rows have terms[n] = 0, so all terms are
// added: the same bits as adding the valid ones only. Launched as a programmatic dependent
// of the row kernel: the targets (written before that kernel) are counted while its last
// rows run; the terms only after pdl_wait.
// kFast (the warp-row path's): the counts are reduced before pdl_wait, with shuffles.
template <typename Tg, bool kFast>
__global__ void __launch_bounds__(kReduceThreads)
    loss_kernel(const Tg* targets, const double* terms, void* loss, bool loss_f64, int64_t rows, int64_t vocab,
                int64_t ignore_index, IndexErrorSink sink) {
  int64_t valid = 0, bad = 0;
  for (int64_t n0 = threadIdx.x; n0 < rows; n0 += int64_t(kUnroll) * kReduceThreads) {
    int64_t t[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t n = n0 + int64_t(u) * kReduceThreads;
      t[u] = n < rows ? static_cast<int64_t>(targets[n]) : ignore_index;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (t[u] == ignore_index) continue;
      if (t[u] < 0 || t[u] >= vocab) {
        record_bad_index(sink, t[u], n0 + int64_t(u) * kReduceThreads);
        ++bad;
        continue;
      }
      ++valid;
    }
  }
  __shared__ int64_t shared_valid[32], shared_bad[32];
  __shared__ double shared_sum[32];
  if constexpr (kFast) {
    valid = block_sum_shfl(valid, shared_valid);
    bad = block_sum_shfl(bad, shared_bad);
  }
  pdl_wait();
  // kFast: 16 terms in flight per thread, so up to 16384 rows cost one round trip after the
  // wait (the addition order is the same: row i, i + 1024, ... per thread).
  constexpr int kTerms = kFast ? 16 : kUnroll;
  double sum = 0;
  for (int64_t n0 = threadIdx.x; n0 < rows; n0 += int64_t(kTerms) * kReduceThreads) {
    double term[kTerms];
#pragma unroll
    for (int u = 0; u < kTerms; ++u) {
      const int64_t n = n0 + int64_t(u) * kReduceThreads;
      term[u] = n < rows ? terms[n] : 0.0;
    }
#pragma unroll
    for (int u = 0; u < kTerms; ++u) sum += term[u];
  }
  if constexpr (kFast) {
    sum = block_sum_shfl(sum, shared_sum);
  } else {
    sum = block_sum(sum);
    valid = block_sum(valid);
    bad = block_sum(bad);
  }
  if (threadIdx.x != 0) return;
  const double value = bad > 0 ? NAN : (valid > 0 ? sum / static_cast<double>(valid) : 0.0);
  if (loss_f64) *static_cast<double*>(loss) = value;
  else *static_cast<float*>(loss) = static_cast<float>(value);
}

// scale = d_loss / n_valid (0 when no row is valid), rounded once to float as the CPU does.
// It lets the gradient kernel (its programmatic dependent) start at once: that kernel loads
// its rows, then waits for this one's result.
template <typename Tg, bool kFast>
__global__ void __launch_bounds__(kReduceThreads)
    grad_scale_kernel(const Tg* targets, int64_t rows, int64_t ignore_index, float d_loss, float* scale) {
  pdl_launch_dependents();
  constexpr int kTargets = kFast ? 16 : kUnroll;  // kFast: 16384 rows in one round trip
  int64_t valid = 0;
  for (int64_t n0 = threadIdx.x; n0 < rows; n0 += int64_t(kTargets) * kReduceThreads) {
    int64_t t[kTargets];
#pragma unroll
    for (int u = 0; u < kTargets; ++u) {
      const int64_t n = n0 + int64_t(u) * kReduceThreads;
      t[u] = n < rows ? static_cast<int64_t>(targets[n]) : ignore_index;
    }
#pragma unroll
    for (int u = 0; u < kTargets; ++u) valid += t[u] != ignore_index;
  }
  if constexpr (kFast) {
    __shared__ int64_t shared_valid[32];
    valid = block_sum_shfl(valid, shared_valid);
  } else {
    valid = block_sum(valid);
  }
  if (threadIdx.x == 0)
    *scale = valid > 0 ? static_cast<float>(static_cast<double>(d_loss) / static_cast<double>(valid)) : 0.0f;
}

// ---- Backward ------------------------------------------------------------------------------

// Applies y[v] = f(v, x[v]) over one row with the block: scalar head to x's first 16-byte
// boundary, 8-element vectors, scalar tail (all scalar when y is not aligned with x).
// Each element is read and written by the same thread, so y may be x. ready() runs once per
// thread before its first f, after the loads of its first vector step are issued (before
// anything else on the scalar paths), so whatever it waits for overlaps those loads.
template <typename In, typename Out, typename Ready, typename F>
__device__ __forceinline__ void map_row(const In* x, Out* y, int64_t n, Ready ready, F f) {
  const int64_t head = min(vec::misalignment_head(x), n);
  const int64_t vectors = (n - head) / kWidth;
  if (vectors == 0 || !vec::aligned16(y + head)) {
    ready();
    for (int64_t v = threadIdx.x; v < n; v += blockDim.x) vec::store(y, v, f(v, vec::load(x, v)));
    return;
  }
  bool waited = false;
  if (head > 0) {
    ready();
    waited = true;
  }
  for (int64_t v = threadIdx.x; v < head; v += blockDim.x) vec::store(y, v, f(v, vec::load(x, v)));
  // Two vectors per thread per step, both loaded before either is stored.
  for (int64_t u = threadIdx.x; u < vectors; u += 2 * int64_t(blockDim.x)) {
    const int64_t u1 = u + blockDim.x;
    const int64_t v0 = head + u * kWidth, v1 = head + u1 * kWidth;
    float w0[kWidth], w1[kWidth];
    vec::load8(x + v0, w0);
    if (u1 < vectors) vec::load8(x + v1, w1);
    if (!waited) {
      ready();
      waited = true;
    }
#pragma unroll
    for (int k = 0; k < kWidth; ++k) w0[k] = f(v0 + k, w0[k]);
    vec::store8(y + v0, w0);
    if (u1 < vectors) {
#pragma unroll
      for (int k = 0; k < kWidth; ++k) w1[k] = f(v1 + k, w1[k]);
      vec::store8(y + v1, w1);
    }
  }
  if (!waited) ready();
  for (int64_t v = head + vectors * kWidth + threadIdx.x; v < n; v += blockDim.x)
    vec::store(y, v, f(v, vec::load(x, v)));
}

// The row's loads come first: the target, lse and the scale (from grad_scale_kernel, this
// kernel's programmatic predecessor: read after pdl_wait) are loaded in map_row's ready(),
// once the thread's first vectors are in flight, so their latency overlaps the row's (code
// that tested the target before the walk would stall the warp on it). An ignored row (0)
// or a bad target (NaN) goes through the same walk, the value selected per element (0 * NaN
// or inf logits would not be 0): that costs a read of each ignored row.
template <typename T, typename Out, typename Tg>
__global__ void __launch_bounds__(kGradThreads)
    grad_kernel(const T* logits, const Tg* targets, const float* lse, const float* scale_ptr, Out* d_logits,
                int64_t vocab, int64_t ld, int64_t ld_out, int64_t ignore_index, IndexErrorSink sink) {
  const int64_t row = blockIdx.x;
  int64_t t = 0;
  float row_lse = 0.0f, scale = 0.0f, fixed_value = 0.0f;
  bool fixed = false;
  map_row(
      logits + row * ld, d_logits + row * ld_out, vocab,
      [&] {
        t = static_cast<int64_t>(targets[row]);
        row_lse = lse[row];
        pdl_wait();
        scale = *scale_ptr;
        const bool ignored = t == ignore_index;
        fixed = ignored || t < 0 || t >= vocab;
        fixed_value = ignored ? 0.0f : NAN;
      },
      [&](int64_t v, float x) {
        const float p = scale * exp2f((x - row_lse) * kLog2e);
        return fixed ? fixed_value : (v == t ? p - scale : p);
      });
  pdl_wait();  // every thread, also one without elements (see pdl_wait)
  // After the walk: a store the compiler cannot tell from the row's would hold back its loads.
  if (threadIdx.x == 0) {
    const int64_t tt = static_cast<int64_t>(targets[row]);
    if (tt != ignore_index && (tt < 0 || tt >= vocab)) record_bad_index(sink, tt, row);
  }
}

// The flat backward (the default where it applies): the gradient is a map of each logit
// given its row's lse and target, so no row needs a block. The [N, V] logits are walked as
// N * V / 8 16-byte vectors (vocab, both row strides multiples of 8, both bases 16-byte
// aligned, fewer than 2^32 vectors), K per thread, a warp's contiguous: every thread issues
// its K loads first, then its rows' target and lse (cached: a row's vectors share them),
// then waits for the scale (pdl_wait: grad_scale_kernel is its programmatic predecessor).
// Short rows (768) thus fill whole blocks instead of leaving most of a 256-thread row block
// idle. Same arithmetic as grad_kernel (the FP8 backward's bytes rely on it); a bad target's
// row is NaN and reported by the thread holding its first vector; d_logits may be logits.
template <typename T, typename Out, typename Tg, int K>
__global__ void __launch_bounds__(kGradThreads, (sizeof(T) == 2 ? (K <= 4 ? 4 : 2) : 1))
    grad_flat_kernel(const T* logits, const Tg* targets, const float* lse, const float* scale_ptr, Out* d_logits,
                     uint32_t total, uint32_t vectors_per_row, int64_t vocab, int64_t ld, int64_t ld_out,
                     int64_t ignore_index, IndexErrorSink sink) {
  const uint32_t first = blockIdx.x * uint32_t(kGradThreads * K) + threadIdx.x;
  vec::Packed8<T> p[K];
  uint32_t row[K], col[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const uint32_t i = first + uint32_t(k * kGradThreads);
    row[k] = i / vectors_per_row;
    col[k] = (i - row[k] * vectors_per_row) * kWidth;
    if (i < total) vec::load_packed(logits + int64_t(row[k]) * ld + col[k], p[k]);
  }
  // Per vector, what the target makes of it (int, not the int64 target: fewer registers,
  // more vectors in flight): kIgnored, kBad, or the target's offset in the vector (0..7),
  // kWidth when it lies elsewhere in the row.
  constexpr int kIgnored = -1, kBad = -2;
  int code[K];
  float row_lse[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const bool in = first + uint32_t(k * kGradThreads) < total;
    const int64_t t = in ? static_cast<int64_t>(targets[row[k]]) : ignore_index;
    const int64_t offset = t - int64_t(col[k]);
    code[k] = t == ignore_index          ? kIgnored
              : (t < 0 || t >= vocab)   ? kBad
              : (offset >= 0 && offset < kWidth) ? int(offset)
                                                 : kWidth;
    row_lse[k] = in ? lse[row[k]] : 0.0f;
  }
  pdl_wait();  // every thread (see pdl_wait)
  const float scale = *scale_ptr;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (first + uint32_t(k * kGradThreads) >= total) break;
    const bool fixed = code[k] < 0;
    const float fixed_value = code[k] == kIgnored ? 0.0f : NAN;
    float w[kWidth];
    vec::unpack(p[k], w);
#pragma unroll
    for (int e = 0; e < kWidth; ++e) {
      const float q = scale * exp2f((w[e] - row_lse[k]) * kLog2e);
      w[e] = fixed ? fixed_value : (e == code[k] ? q - scale : q);
    }
    vec::store8(d_logits + int64_t(row[k]) * ld_out + col[k], w);
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (first + uint32_t(k * kGradThreads) >= total) break;
    if (col[k] == 0 && code[k] == kBad) record_bad_index(sink, static_cast<int64_t>(targets[row[k]]), row[k]);
  }
}

// Launches kernel as a programmatic dependent of the previous work on stream s (see pdl_wait).
// kUsePdl = false makes it an ordinary launch (the kernels stay correct: pdl_wait is then a
// no-op and the stream orders them).
constexpr bool kUsePdl = true;
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), unsigned blocks, unsigned threads, cudaStream_t s, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = 0;
  config.stream = s;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = kUsePdl ? 1 : 0;
  TESSERA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
}

template <typename Fn>
void dispatch_targets(const Tensor& targets, Fn&& fn) {
  if (targets.dtype() == DType::I64) fn(static_cast<int64_t*>(nullptr));
  else fn(static_cast<int32_t*>(nullptr));
}

}  // namespace

bool cross_entropy_forward_supported(const Tensor& logits, const Tensor& loss, const Tensor& lse) {
  return vec::is_f32_or_bf16(logits.dtype()) && lse.dtype() == DType::F32 &&
         (loss.dtype() == DType::F32 || loss.dtype() == DType::F64);
}

void cross_entropy_forward(void* stream, const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse,
                           int64_t ignore_index) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TESSERA_CHECK(rows <= 0x7fffffff, "cross_entropy_forward on CUDA: ", rows, " rows exceed one grid");
  auto s = static_cast<cudaStream_t>(stream);
  const IndexErrorSink sink =
      index_error_sink(logits.device().index, IndexOp::CrossEntropyForward, vocab, ignore_index);
  // terms[n] = lse[n] - logits[n, target]: written beside lse, summed by loss_kernel.
  Tensor terms = Tensor::empty({std::max<int64_t>(rows, 1)}, DType::F64, logits.device());
  const int64_t ld = logits.stride(0);
  vec::dispatch(logits.dtype(), "cross_entropy_forward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x = logits.data<T>();
    dispatch_targets(targets, [&](auto* ttag) {
      using Tg = std::remove_pointer_t<decltype(ttag)>;
      const Tg* tg = targets.data<Tg>();
      const RowTuning tuning = row_tuning();
      const warprow::Shape warp_shape =
          tuning.cross_entropy_forward == 0 && vocab % kWidth == 0 && ld % kWidth == 0 && vec::aligned16(x)
              ? warprow::shape_for(vocab / kWidth, int(sizeof(vec::Packed8<T>) / 4), tuning.group)
              : warprow::Shape{};
      if (rows > 0 && warp_shape.nv > 0) {
        const int per_block = warprow::kThreads / warp_shape.group;
        const unsigned blocks = static_cast<unsigned>((rows + per_block - 1) / per_block);
        warprow::dispatch_nv<warprow::max_nv<T>()>(warp_shape.nv, [&](auto nv_tag) {
          lse_warp_kernel<T, Tg, decltype(nv_tag)::value><<<blocks, warprow::kThreads, 0, s>>>(
              x, tg, lse.data<float>(), terms.data<double>(), rows, int(vocab), ld, ignore_index, warp_shape.group);
        });
      } else if (rows > 0) {
        // Registers when the rows are 16-byte aligned and short enough; else the looping kernel.
        const int64_t units = vocab % kWidth == 0 && ld % kWidth == 0 && vec::aligned16(x) ? vocab / kWidth : 0;
        // A thread holds about 32 registers of the row: 8 packed BF16 vectors or 4 F32 ones.
        const int per_thread = sizeof(T) == 2 ? 8 : 4, max_nv = sizeof(T) == 2 ? 8 : kLseMaxVectors;
        int tpr = 1;
        while (tpr < (units + per_thread - 1) / per_thread && tpr < kLseMaxGroup) tpr *= 2;
        int nv = 1;
        while (nv < (units + tpr - 1) / tpr) nv *= 2;
        if (units > 0 && nv <= max_nv) {
          const int rpb = tpr > 32 ? 1 : 128 / tpr;
          const unsigned blocks = static_cast<unsigned>((rows + rpb - 1) / rpb);
          const dim3 block(tpr, rpb);
          auto launch = [&](auto kernel) {
            kernel<<<blocks, block, 0, s>>>(x, tg, lse.data<float>(), terms.data<double>(), rows, vocab, ld,
                                            ignore_index);
          };
          if (nv == 1) launch(lse_rows_kernel<T, Tg, 1>);
          else if (nv == 2) launch(lse_rows_kernel<T, Tg, 2>);
          else if (nv == 4) launch(lse_rows_kernel<T, Tg, 4>);
          else if constexpr (sizeof(T) == 2) launch(lse_rows_kernel<T, Tg, 8>);
        } else {
          lse_kernel<T, Tg><<<static_cast<unsigned>(rows), kRowThreads, 0, s>>>(x, tg, lse.data<float>(),
                                                                                terms.data<double>(), vocab, ld,
                                                                                ignore_index);
        }
      }
      // Also for rows = 0: the loss is then written as 0.
      auto loss_launch = [&](auto kernel) {
        launch_pdl(kernel, 1, kReduceThreads, s, tg, static_cast<const double*>(terms.data<double>()),
                   loss.raw_data(), loss.dtype() == DType::F64, rows, vocab, ignore_index, sink);
      };
      if (tuning.cross_entropy_forward == 0) loss_launch(loss_kernel<Tg, true>);
      else loss_launch(loss_kernel<Tg, false>);
    });
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

bool cross_entropy_backward_supported(const Tensor& logits, const Tensor& lse, const Tensor& d_logits) {
  return vec::is_f32_or_bf16(logits.dtype()) && vec::is_f32_or_bf16(d_logits.dtype()) && lse.dtype() == DType::F32;
}

void cross_entropy_backward(void* stream, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            float d_loss, Tensor& d_logits, int64_t ignore_index) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (rows == 0) return;
  TESSERA_CHECK(rows <= 0x7fffffff, "cross_entropy_backward on CUDA: ", rows, " rows exceed one grid");
  auto s = static_cast<cudaStream_t>(stream);
  const IndexErrorSink sink =
      index_error_sink(logits.device().index, IndexOp::CrossEntropyBackward, vocab, ignore_index);
  Tensor scale = Tensor::empty({1}, DType::F32, logits.device());  // d_loss / n_valid, computed on the device
  const RowTuning tuning = row_tuning();
  const int64_t ld = logits.stride(0), ld_out = d_logits.stride(0);
  const int64_t total = rows * (vocab / kWidth);
  const bool flat = tuning.cross_entropy_backward == 0 && vocab % kWidth == 0 && ld % kWidth == 0 &&
                    ld_out % kWidth == 0 && vec::aligned16(logits.raw_data()) && vec::aligned16(d_logits.raw_data()) &&
                    total > 0 && total < (int64_t(1) << 32) - int64_t(kGradThreads) * 8;
  const int per_thread = tuning.backward_vectors == 8 ? 8 : 4;
  dispatch_targets(targets, [&](auto* ttag) {
    using Tg = std::remove_pointer_t<decltype(ttag)>;
    if (flat)
      grad_scale_kernel<Tg, true><<<1, kReduceThreads, 0, s>>>(targets.data<Tg>(), rows, ignore_index, d_loss,
                                                               scale.data<float>());
    else
      grad_scale_kernel<Tg, false><<<1, kReduceThreads, 0, s>>>(targets.data<Tg>(), rows, ignore_index, d_loss,
                                                                scale.data<float>());
    vec::dispatch(logits.dtype(), "cross_entropy_backward", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      vec::dispatch(d_logits.dtype(), "cross_entropy_backward", [&](auto* otag) {
        using Out = std::remove_pointer_t<decltype(otag)>;
        const T* x = logits.data<T>();
        const Tg* tg = targets.data<Tg>();
        const float *lse_p = lse.data<float>(), *scale_p = scale.data<float>();
        if (flat) {
          auto launch = [&](auto kernel, int k) {
            const int64_t blocks = (total + int64_t(kGradThreads) * k - 1) / (int64_t(kGradThreads) * k);
            launch_pdl(kernel, static_cast<unsigned>(blocks), kGradThreads, s, x, tg, lse_p, scale_p,
                       d_logits.data<Out>(), static_cast<uint32_t>(total), static_cast<uint32_t>(vocab / kWidth),
                       vocab, ld, ld_out, ignore_index, sink);
          };
          if (per_thread == 8) launch(grad_flat_kernel<T, Out, Tg, 8>, 8);
          else launch(grad_flat_kernel<T, Out, Tg, 4>, 4);
        } else {
          launch_pdl(grad_kernel<T, Out, Tg>, static_cast<unsigned>(rows), kGradThreads, s, x, tg, lse_p, scale_p,
                     d_logits.data<Out>(), vocab, ld, ld_out, ignore_index, sink);
        }
      });
    });
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
