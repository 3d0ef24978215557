// MoE token movement on the GPU: the routing map (row of each assignment in the
// expert-contiguous order) and permute / unpermute forward and backward (the scaled SwiGLU
// between the expert GEMMs is in moe_swiglu.cu). Rules of the CPU reference
// (backend/cpu/moe.cpp); see include/tessera/ops/moe.h.
//
// Routing map without a host sync: one block per expert scans the assignments in token
// order (block scan) and writes each assignment's rank within its expert and the expert's
// count; one block scans the counts into offsets; a last pass adds the offsets. Ranks come
// from scans, not atomics, so the permuted order is the CPU's, bit for bit.
// Data movement: one block per row (assignment or token), threads across the C columns.
// Outputs that scatter (permute forward, unpermute backward) are zeroed first with
// cudaMemsetAsync, so rows no assignment maps to (dropped capacity, the tail past
// offsets[E]) are 0 without reading the offsets on the host.
// Floor: each pass moves N*k*C elements in and out once (permute of 16K tokens x top-2 x
// 4096 BF16: 2 x 268 MB -> ~130 us at 4.1 TB/s); these scalar kernels are not yet at it
// (16-byte vector loads are the next step).
#include <cub/block/block_scan.cuh>

#include "cuda_check.h"
#include "moe.h"
#include "moe_common.cuh"

namespace tessera::cuda {
namespace {

using namespace moe_detail;

constexpr int kThreads = 256;

__global__ void expert_rank_kernel(const int32_t* indices, int32_t* row_map, int32_t* counts, int64_t assignments) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int e = blockIdx.x;
  int64_t running = 0;
  for (int64_t base = 0; base < assignments; base += kThreads) {
    const int64_t a = base + threadIdx.x;
    const int32_t idx = a < assignments ? indices[a] : INT32_MAX;
    const int flag = idx == e;
    int rank, total;
    Scan(scan).ExclusiveSum(flag, rank, total);
    if (flag) row_map[a] = static_cast<int32_t>(running + rank);
    if (a < assignments && idx < 0 && -idx - 1 == e) row_map[a] = -1;  // dropped: written by its expert's block
    running += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) counts[e] = static_cast<int32_t>(running);
}

__global__ void offsets_kernel(const int32_t* counts, int32_t* offsets, int64_t experts) {
  using Scan = cub::BlockScan<int, 1024>;
  __shared__ typename Scan::TempStorage scan;
  const int e = threadIdx.x;
  const int c = e < experts ? counts[e] : 0;
  int prefix, total;
  Scan(scan).ExclusiveSum(c, prefix, total);
  if (e < experts) offsets[e] = prefix;
  if (e == 0) offsets[experts] = total;
}

__global__ void add_offsets_kernel(const int32_t* indices, const int32_t* offsets, int32_t* row_map, int64_t assignments) {
  const int64_t a = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (a < assignments && indices[a] >= 0) row_map[a] += offsets[indices[a]];
}

// One block per assignment: copies its token's row (raw elements, no rounding).
template <typename T>
__global__ void permute_kernel(const T* x, const int32_t* row_map, AnyPtr probs, T* out, AnyPtr out_probs, int64_t k,
                               int64_t width) {
  const int64_t a = blockIdx.x;
  const int32_t r = row_map[a];
  if (r < 0) return;
  const T* src = x + (a / k) * width;
  T* dst = out + int64_t(r) * width;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) dst[c] = src[c];
  if (threadIdx.x == 0 && probs.defined()) out_probs.store(r, probs.load(a));
}

// One block per token: the sum of its k permuted rows, in slot order.
template <typename T>
__global__ void gather_sum_kernel(const T* in, const int32_t* row_map, AnyPtr weights, T* out, int64_t k, int64_t width) {
  const int64_t n = blockIdx.x;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    float acc = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = row_map[n * k + j];
      if (r < 0) continue;
      const float w = weights.defined() ? weights.load(n * k + j) : 1.0f;
      acc += w * ld(in, int64_t(r) * width + c);
    }
    st(out, n * width + c, acc);
  }
}

__global__ void gather_probs_kernel(const int32_t* row_map, AnyPtr d_permuted_probs, AnyPtr d_probs, int64_t assignments) {
  const int64_t a = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (a >= assignments) return;
  const int32_t r = row_map[a];
  d_probs.store(a, r >= 0 ? d_permuted_probs.load(r) : 0.0f);
}

// One block per assignment: d_out[row] = w * dy[token], d_probs = dot(dy[token], out[row]).
template <typename T>
__global__ void unpermute_backward_kernel(const T* expert_out, const int32_t* row_map, AnyPtr probs, const T* dy,
                                          T* d_expert_out, AnyPtr d_probs, int64_t k, int64_t width) {
  const int64_t a = blockIdx.x;
  const int32_t r = row_map[a];
  if (r < 0) {
    if (threadIdx.x == 0 && d_probs.defined()) d_probs.store(a, 0.0f);
    return;
  }
  const float w = probs.defined() ? probs.load(a) : 1.0f;
  const T* g = dy + (a / k) * width;
  // Without d_probs, expert_out is not read (MoELayer frees it after the forward and passes
  // another tensor of its shape).
  const bool want_dot = d_probs.defined();
  float dot = 0;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    const float gv = ld(g, c);
    st(d_expert_out, int64_t(r) * width + c, w * gv);
    if (want_dot) dot += gv * ld(expert_out, int64_t(r) * width + c);
  }
  if (!want_dot) return;
  dot = block_sum(dot);
  if (threadIdx.x == 0) d_probs.store(a, dot);
}

unsigned grid(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

bool moe_permute_supported(std::initializer_list<const Tensor*> main, std::initializer_list<const Tensor*> extra) {
  DType d = DType::U8;
  for (const Tensor* t : main) {
    if (!f32_or_bf16(*t)) return false;
    if (d != DType::U8 && t->dtype() != d) return false;
    d = t->dtype();
  }
  for (const Tensor* t : extra)
    if (t->defined() && !f32_or_bf16(*t)) return false;
  return true;
}

void moe_routing_map(void* stream, const Tensor& indices, int64_t num_experts, Tensor& row_map, Tensor& offsets) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t assignments = indices.numel();
  Tensor counts = Tensor::empty({num_experts}, DType::I32, indices.device());
  expert_rank_kernel<<<static_cast<unsigned>(num_experts), kThreads, 0, s>>>(
      indices.data<int32_t>(), row_map.data<int32_t>(), counts.data<int32_t>(), assignments);
  TESSERA_CUDA_CHECK_LAUNCH();
  offsets_kernel<<<1, 1024, 0, s>>>(counts.data<int32_t>(), offsets.data<int32_t>(), num_experts);
  TESSERA_CUDA_CHECK_LAUNCH();
  if (assignments == 0) return;
  add_offsets_kernel<<<grid(assignments), kThreads, 0, s>>>(indices.data<int32_t>(), offsets.data<int32_t>(),
                                                             row_map.data<int32_t>(), assignments);
  TESSERA_CUDA_CHECK_LAUNCH();
}

void moe_permute_forward(void* stream, const Tensor& x, const Tensor& row_map, const Tensor& probs, Tensor& permuted,
                         Tensor& permuted_probs) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t assignments = row_map.numel(), k = row_map.size(1), width = x.size(1);
  TESSERA_CUDA_CHECK(cudaMemsetAsync(permuted.raw_data(), 0, permuted.nbytes(), s));
  if (permuted_probs.defined()) TESSERA_CUDA_CHECK(cudaMemsetAsync(permuted_probs.raw_data(), 0, permuted_probs.nbytes(), s));
  if (assignments == 0 || width == 0) return;
  by_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    permute_kernel<T><<<static_cast<unsigned>(assignments), kThreads, 0, s>>>(
        x.data<T>(), row_map.data<int32_t>(), any_ptr(probs), permuted.data<T>(), any_ptr(permuted_probs), k, width);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void moe_permute_backward(void* stream, const Tensor& row_map, const Tensor& d_permuted, const Tensor& d_permuted_probs,
                          Tensor& dx, Tensor& d_probs) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t tokens = dx.size(0), k = row_map.size(1), width = dx.size(1);
  if (tokens == 0) return;
  if (width > 0) {
    by_dtype(dx, [&](auto zero) {
      using T = decltype(zero);
      gather_sum_kernel<T><<<static_cast<unsigned>(tokens), kThreads, 0, s>>>(d_permuted.data<T>(), row_map.data<int32_t>(),
                                                                             AnyPtr{}, dx.data<T>(), k, width);
    });
    TESSERA_CUDA_CHECK_LAUNCH();
  }
  if (d_probs.defined()) {
    gather_probs_kernel<<<grid(tokens * k), kThreads, 0, s>>>(row_map.data<int32_t>(), any_ptr(d_permuted_probs),
                                                              any_ptr(d_probs), tokens * k);
    TESSERA_CUDA_CHECK_LAUNCH();
  }
}

void moe_unpermute_forward(void* stream, const Tensor& expert_out, const Tensor& row_map, const Tensor& probs, Tensor& y) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t tokens = y.size(0), k = row_map.size(1), width = y.size(1);
  if (tokens == 0 || width == 0) return;
  by_dtype(y, [&](auto zero) {
    using T = decltype(zero);
    gather_sum_kernel<T><<<static_cast<unsigned>(tokens), kThreads, 0, s>>>(expert_out.data<T>(), row_map.data<int32_t>(),
                                                                           any_ptr(probs), y.data<T>(), k, width);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void moe_unpermute_backward(void* stream, const Tensor& expert_out, const Tensor& row_map, const Tensor& probs,
                            const Tensor& dy, Tensor& d_expert_out, Tensor& d_probs) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t assignments = row_map.numel(), k = row_map.size(1), width = dy.size(1);
  TESSERA_CUDA_CHECK(cudaMemsetAsync(d_expert_out.raw_data(), 0, d_expert_out.nbytes(), s));
  if (assignments == 0) return;
  by_dtype(dy, [&](auto zero) {
    using T = decltype(zero);
    unpermute_backward_kernel<T><<<static_cast<unsigned>(assignments), kThreads, 0, s>>>(
        expert_out.data<T>(), row_map.data<int32_t>(), any_ptr(probs), dy.data<T>(), d_expert_out.data<T>(),
        any_ptr(d_probs), k, width);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
