// Generic attention on the GPU (forward and backward), for what the tensor-core path does
// not take: F32, F16, E4M3, E5M2, BF16 with a head dim other than 64 / 128, lse in F64,
// unaligned views. Correct, not fast: plain FP32 arithmetic on the CUDA cores, no tensor
// cores, the same formulas as the CPU reference (backend/cpu/attention.cpp). Also the
// Delta = rowsum(dO * O) kernel that both backward paths use.
//
// Layout: q, out, d_out, dq [B, T, Hq, D]; k, v, dk, dv [B, S, Hkv, D]; lse [B, Hq, T];
// contiguous; any head dim. Bottom-right causal alignment, GQA as in the op header.
//
// One 128-thread block per output row. Forward, per query row: pass 1 gives the row's max
// and sum (online, one key per thread, then a block reduction) and so lse; pass 2 walks
// the head dim in slices of 128 (a thread per column) and, per chunk of 128 keys,
// recomputes the probabilities into shared memory and accumulates P V. Backward: dQ per
// query row the same way; dK and dV per key row over every (query head of the group,
// query) pair that sees the key. Every output element has one writer: deterministic.
// Shared memory stays fixed whatever D is, at the cost of recomputing scores once per
// 128 columns.
//
// Floor: not a target. The work is ~(2 + D / 128) * 2 * T * S * D FLOPs per head on FP32
// CUDA cores (~67 TFLOP/s peak) with uncoalesced key-row reads; the tensor-core path is
// the fast one.
#include <cuda_runtime.h>

#include <type_traits>

#include "attention.h"
#include "cuda_check.h"
#include "tessera/core/numeric.h"

namespace tessera::cuda {

namespace {

constexpr int kThreads = 128;

template <typename T>
__device__ __forceinline__ float load(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>) return p[i];
  else return p[i].to_float();
}
template <typename T>
__device__ __forceinline__ void store(T* p, int64_t i, float v) {
  if constexpr (std::is_same_v<T, float>) p[i] = v;
  else p[i] = T::from_float(v);
}

template <typename T>
__device__ float dot(const T* a, const T* b, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += load(a, i) * load(b, i);
  return s;
}

struct Dims {
  int T, S, Hq, Hkv, group, D;
  float scale;
  bool causal;

  __device__ int visible_keys(int t) const { return causal ? t + (S - T) + 1 : S; }
  __device__ int first_query(int j) const { return causal ? max(0, j - (S - T)) : 0; }
  __device__ int64_t q_offset(int b, int t, int h) const {
    return ((static_cast<int64_t>(b) * T + t) * Hq + h) * D;
  }
  __device__ int64_t kv_offset(int b, int j, int kvh) const {
    return ((static_cast<int64_t>(b) * S + j) * Hkv + kvh) * D;
  }
};

// (max, sum of exp(x - max)) pairs, merged; -inf max means empty.
__device__ void merge(float& m, float& l, float m2, float l2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    l = l2;
    return;
  }
  const float mx = fmaxf(m, m2);
  l = l * expf(m - mx) + l2 * expf(m2 - mx);
  m = mx;
}

template <typename T, typename L>
__global__ void __launch_bounds__(kThreads) forward_kernel(const T* q, const T* k, const T* v, T* out, L* lse,
                                                           const Dims d) {
  __shared__ float p[kThreads];
  __shared__ float part_m[kThreads / 32], part_l[kThreads / 32], part_nan[kThreads / 32];
  const int row = blockIdx.x, tid = threadIdx.x;  // row in lse order: (b, h, t)
  const int t = row % d.T, h = (row / d.T) % d.Hq, b = row / (d.T * d.Hq), kvh = h / d.group;
  const int visible = d.visible_keys(t);
  const T* q_row = q + d.q_offset(b, t, h);

  float m = -INFINITY, l = 0.0f, nan_seen = 0.0f;
  for (int j = tid; j < visible; j += kThreads) {
    const float s = d.scale * dot(q_row, k + d.kv_offset(b, j, kvh), d.D);
    if (s != s) nan_seen = 1.0f;
    else merge(m, l, s, 1.0f);
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
    merge(m, l, m2, l2);
    nan_seen = fmaxf(nan_seen, __shfl_xor_sync(0xffffffffu, nan_seen, o));
  }
  if ((tid & 31) == 0) {
    part_m[tid / 32] = m;
    part_l[tid / 32] = l;
    part_nan[tid / 32] = nan_seen;
  }
  __syncthreads();
  m = part_m[0];
  l = part_l[0];
  nan_seen = part_nan[0];
  for (int w = 1; w < kThreads / 32; ++w) {
    merge(m, l, part_m[w], part_l[w]);
    nan_seen = fmaxf(nan_seen, part_nan[w]);
  }
  // A NaN score makes the whole row NaN, as on the CPU.
  const float row_lse = nan_seen > 0.0f ? NAN : m + logf(l);
  if (tid == 0) lse[row] = static_cast<L>(row_lse);

  for (int d0 = 0; d0 < d.D; d0 += kThreads) {
    const int col = d0 + tid;
    float acc = 0.0f;
    for (int j0 = 0; j0 < visible; j0 += kThreads) {
      const int j = j0 + tid;
      __syncthreads();
      p[tid] = j < visible ? expf(d.scale * dot(q_row, k + d.kv_offset(b, j, kvh), d.D) - row_lse) : 0.0f;
      __syncthreads();
      const int n = min(kThreads, visible - j0);
      if (col < d.D)
        for (int jj = 0; jj < n; ++jj) acc += p[jj] * load(v, d.kv_offset(b, j0 + jj, kvh) + col);
    }
    if (col < d.D) store(out, d.q_offset(b, t, h) + col, acc);
  }
}

template <typename T, typename L>
__global__ void __launch_bounds__(kThreads) dq_kernel(const T* d_out, const T* q, const T* k, const T* v,
                                                      const L* lse, const float* delta, T* dq, const Dims d) {
  __shared__ float ds[kThreads];
  const int row = blockIdx.x, tid = threadIdx.x;
  const int t = row % d.T, h = (row / d.T) % d.Hq, b = row / (d.T * d.Hq), kvh = h / d.group;
  const int visible = d.visible_keys(t);
  const int64_t offset = d.q_offset(b, t, h);
  const float row_lse = static_cast<float>(lse[row]), row_delta = delta[row];
  for (int d0 = 0; d0 < d.D; d0 += kThreads) {
    const int col = d0 + tid;
    float acc = 0.0f;
    for (int j0 = 0; j0 < visible; j0 += kThreads) {
      const int j = j0 + tid;
      __syncthreads();
      float g = 0.0f;
      if (j < visible) {
        const int64_t kv = d.kv_offset(b, j, kvh);
        const float pv = expf(d.scale * dot(q + offset, k + kv, d.D) - row_lse);
        g = pv * (dot(d_out + offset, v + kv, d.D) - row_delta);
      }
      ds[tid] = g;
      __syncthreads();
      const int n = min(kThreads, visible - j0);
      if (col < d.D)
        for (int jj = 0; jj < n; ++jj) acc += ds[jj] * load(k, d.kv_offset(b, j0 + jj, kvh) + col);
    }
    if (col < d.D) store(dq, offset + col, d.scale * acc);
  }
}

template <typename T, typename L>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(const T* d_out, const T* q, const T* k, const T* v,
                                                        const L* lse, const float* delta, T* dk, T* dv,
                                                        const Dims d) {
  __shared__ float pv_s[kThreads], ds_s[kThreads];
  __shared__ int64_t off_s[kThreads];
  const int row = blockIdx.x, tid = threadIdx.x;  // row in k order: (b, j, kvh)
  const int kvh = row % d.Hkv, j = (row / d.Hkv) % d.S, b = row / (d.Hkv * d.S);
  const int first = d.first_query(j);
  const int per_head = first < d.T ? d.T - first : 0;
  const int pairs = per_head * d.group;
  const int64_t kv = d.kv_offset(b, j, kvh);
  for (int d0 = 0; d0 < d.D; d0 += kThreads) {
    const int col = d0 + tid;
    float acc_k = 0.0f, acc_v = 0.0f;
    for (int p0 = 0; p0 < pairs; p0 += kThreads) {
      const int pair = p0 + tid;
      __syncthreads();
      float pv = 0.0f, g = 0.0f;
      int64_t offset = 0;
      if (pair < pairs) {
        const int h = kvh * d.group + pair / per_head, t = first + pair % per_head;
        const int64_t stat = (static_cast<int64_t>(b) * d.Hq + h) * d.T + t;
        offset = d.q_offset(b, t, h);
        pv = expf(d.scale * dot(q + offset, k + kv, d.D) - static_cast<float>(lse[stat]));
        g = pv * (dot(d_out + offset, v + kv, d.D) - delta[stat]);
      }
      pv_s[tid] = pv;
      ds_s[tid] = g;
      off_s[tid] = offset;
      __syncthreads();
      const int n = min(kThreads, pairs - p0);
      if (col < d.D)
        for (int i = 0; i < n; ++i) {
          acc_v += pv_s[i] * load(d_out, off_s[i] + col);
          acc_k += ds_s[i] * load(q, off_s[i] + col);
        }
    }
    if (col < d.D) {
      store(dk, kv + col, d.scale * acc_k);
      store(dv, kv + col, acc_v);
    }
  }
}

// One warp per (b, t, h) row of d_out / out; delta in lse order.
template <typename T>
__global__ void delta_kernel(const T* d_out, const T* out, float* delta, int64_t rows, int T_len, int Hq, int D,
                             bool aligned) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int64_t base = row * D;
  float s = 0.0f;
  if constexpr (std::is_same_v<T, bf16>) {
    if (aligned && D % 8 == 0) {  // 16-byte loads
      const uint4* a = reinterpret_cast<const uint4*>(d_out + base);
      const uint4* o = reinterpret_cast<const uint4*>(out + base);
      for (int c = lane; c < D / 8; c += 32) {
        const uint4 x = a[c], y = o[c];
        const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
        for (int i = 0; i < 4; ++i)
          s += bf16_bits_to_float(xs[i] & 0xffffu) * bf16_bits_to_float(ys[i] & 0xffffu) +
               bf16_bits_to_float(xs[i] >> 16) * bf16_bits_to_float(ys[i] >> 16);
      }
    } else {
      for (int c = lane; c < D; c += 32) s += load(d_out, base + c) * load(out, base + c);
    }
  } else {
    for (int c = lane; c < D; c += 32) s += load(d_out, base + c) * load(out, base + c);
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) {
    const int h = static_cast<int>(row % Hq);
    const int64_t bt = row / Hq, t = bt % T_len, b = bt / T_len;
    delta[(b * Hq + h) * T_len + t] = s;
  }
}

// Calls f(T{}) with the storage type of dtype.
template <typename F>
void with_storage(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32: f(float{}); return;
    case DType::BF16: f(bf16{}); return;
    case DType::F16: f(fp16{}); return;
    case DType::E4M3: f(fp8_e4m3{}); return;
    case DType::E5M2: f(fp8_e5m2{}); return;
    default: TESSERA_FAIL("attention on CUDA: no kernel for dtype ", dtype_name(dtype));
  }
}

template <typename F>
void with_storage_and_lse(DType dtype, DType lse_dtype, F&& f) {
  with_storage(dtype, [&](auto zero) {
    if (lse_dtype == DType::F64) f(zero, double{});
    else f(zero, float{});
  });
}

Dims make_dims(const Tensor& q, const Tensor& k, bool causal, float scale) {
  TESSERA_CHECK(q.size(1) <= 0x7fffffff && k.size(1) <= 0x7fffffff && q.size(3) <= 0x7fffffff,
                "attention on CUDA: sizes exceed 32-bit indices");
  return Dims{static_cast<int>(q.size(1)), static_cast<int>(k.size(1)), static_cast<int>(q.size(2)),
              static_cast<int>(k.size(2)),  static_cast<int>(q.size(2) / k.size(2)), static_cast<int>(q.size(3)),
              scale,                         causal};
}

unsigned grid_for(int64_t rows, const char* what) {
  TESSERA_CHECK(rows <= 0x7fffffff, "attention on CUDA: ", rows, " ", what, " rows exceed one grid");
  return static_cast<unsigned>(rows);
}

}  // namespace

void attention_backward_delta(void* stream, const Tensor& d_out, const Tensor& out, Tensor& delta) {
  const int64_t B = d_out.size(0), T = d_out.size(1), Hq = d_out.size(2), D = d_out.size(3);
  const int64_t rows = B * T * Hq;
  if (rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  constexpr int kWarpsPerBlock = 8;
  const unsigned blocks = grid_for((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, "delta");
  const bool vector_ok = reinterpret_cast<uintptr_t>(d_out.raw_data()) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(out.raw_data()) % 16 == 0;
  with_storage(d_out.dtype(), [&](auto zero) {
    using T_ = decltype(zero);
    delta_kernel<T_><<<blocks, kWarpsPerBlock * 32, 0, s>>>(static_cast<const T_*>(d_out.raw_data()),
                                                           static_cast<const T_*>(out.raw_data()),
                                                           delta.data<float>(), rows, static_cast<int>(T),
                                                           static_cast<int>(Hq), static_cast<int>(D), vector_ok);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void attention_forward_generic(void* stream, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                               Tensor& lse, bool causal, float scale) {
  const int64_t rows = q.size(0) * q.size(2) * q.size(1);
  if (rows == 0) return;
  const Dims d = make_dims(q, k, causal, scale);
  auto s = static_cast<cudaStream_t>(stream);
  const unsigned grid = grid_for(rows, "query");
  with_storage_and_lse(q.dtype(), lse.dtype(), [&](auto zero, auto lzero) {
    using T_ = decltype(zero);
    using L_ = decltype(lzero);
    forward_kernel<T_, L_><<<grid, kThreads, 0, s>>>(
        static_cast<const T_*>(q.raw_data()), static_cast<const T_*>(k.raw_data()),
        static_cast<const T_*>(v.raw_data()), static_cast<T_*>(out.raw_data()), static_cast<L_*>(lse.raw_data()), d);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void attention_backward_generic(void* stream, const Tensor& d_out, const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk,
                                Tensor& dv, bool causal, float scale) {
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), S = k.size(1), Hkv = k.size(2);
  const int64_t q_rows = B * Hq * T, kv_rows = B * S * Hkv;
  if (kv_rows == 0 && q_rows == 0) return;
  const Dims d = make_dims(q, k, causal, scale);
  auto s = static_cast<cudaStream_t>(stream);
  Tensor delta = Tensor::empty({q_rows}, DType::F32, q.device());  // caching allocator, stream-ordered reuse
  attention_backward_delta(stream, d_out, out, delta);
  with_storage_and_lse(q.dtype(), lse.dtype(), [&](auto zero, auto lzero) {
    using T_ = decltype(zero);
    using L_ = decltype(lzero);
    const auto* dO = static_cast<const T_*>(d_out.raw_data());
    const auto* qp = static_cast<const T_*>(q.raw_data());
    const auto* kp = static_cast<const T_*>(k.raw_data());
    const auto* vp = static_cast<const T_*>(v.raw_data());
    const auto* lp = static_cast<const L_*>(lse.raw_data());
    if (q_rows > 0 && S > 0) {
      dq_kernel<T_, L_><<<grid_for(q_rows, "query"), kThreads, 0, s>>>(dO, qp, kp, vp, lp, delta.data<float>(),
                                                                         static_cast<T_*>(dq.raw_data()), d);
      TESSERA_CUDA_CHECK_LAUNCH();
    }
    if (kv_rows > 0) {
      dkdv_kernel<T_, L_><<<grid_for(kv_rows, "key"), kThreads, 0, s>>>(
          dO, qp, kp, vp, lp, delta.data<float>(), static_cast<T_*>(dk.raw_data()),
          static_cast<T_*>(dv.raw_data()), d);
      TESSERA_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace tessera::cuda
