// Multi-tensor optimizer kernels: every parameter of a model in one or two launches, with
// nothing read back to the host.
//   global_grad_norm: norm_out[0] = sqrt(sum_t float(sum_i grads[t][i]^2)), in double
//   adamw_step_multi: clip by that norm (computed on the device), AdamW, and the BF16
//                     copy of the updated weights, in one pass
// Semantics and rounding are those of the CPU reference (backend/cpu/optimizer.cpp).
//
// Work is split into chunks of kChunk elements of one tensor; block b handles chunk b and
// finds its tensor by binary search over the tensors' first chunk numbers. The list is
// described by a table of pointers, sizes and per-tensor values, built on the host and
// copied to the device (cudaMemcpyAsync on the stream) only when it differs from the one
// the caller's MultiTensorCache holds, so a training loop uploads it once. Empty tensors
// are left out of the table. A tensor is moved in 16-byte vectors when all its pointers
// are 16-byte aligned (chunk starts are multiples of 8 elements, so they stay aligned),
// else element by element.
//
// global_grad_norm: launch 1 writes one double per chunk (a fixed tree over the block);
// launch 2 (one block) adds each tensor's chunk partials with one warp per tensor (a fixed
// shuffle tree), rounds each tensor's sum to float as the CPU's F32 slot does, then adds
// the tensors in list order on one thread. The order depends only on the sizes, so the
// result is reproducible; it differs from the CPU's sequential order in the last bits of
// the doubles only. Floor: numel * 4 B (F32 grads) / 4.1 TB/s, 124M parameters -> 0.12 ms.
//
// adamw_step_multi: bit-identical to the CPU, as optimizer.cu is: the step's scalars are
// computed on the host by the CPU's expressions (adamw_step_scalars), and either passed as
// kernel arguments or, for a step captured into a CUDA graph, read by every block from a
// small device buffer the host refills before each replay; the per-tensor decay 1 - lr * wd and the
// clip factor max_norm / (norm + 1e-6) are computed on the device in double with the
// round-to-nearest intrinsics (__dmul_rn, __dsub_rn, __dadd_rn, __ddiv_rn: no FMA
// contraction), which give the host's IEEE results, then rounded once to float; the
// element update uses the CPU's float operations in its order with __f*_rn intrinsics.
// Floor: 28 B per element with F32 grads (4 reads, 3 writes) plus 2 B for a BF16 value:
// 124M parameters with BF16 values -> 3.7 GB / 4.1 TB/s = 0.91 ms.
//
// adamw_step_fp8_cast (fp8.cast_in_optimizer): one MoE expert weight [E, N, K] updated as
// adamw_multi_kernel updates it (the same expressions, so the same bits), and in the same
// pass its new BF16 value cast to FP8 with each expert's delayed scale, row-wise and
// transposed, the expert's amax folded in: what GroupedLinear's forward would otherwise cast
// from the BF16 value in the next step. The BF16 value itself is written only when given
// (GroupedLinear leaves it stale). Tiles of 64 x 128 (code_tile.cuh) over a persistent grid.
// Floor without the value: 28 B + 2 B of codes per element, the bytes of the plain update
// with its value (30 B): 10.3 ms at 4.1 TB/s for Mixtral's fc + proj weights (1.41G
// elements). Measured on the H200 (2026-12-03; bench/RESULTS.md, twenty-fourth session):
// 11.42 ms without the value (3.70 TB/s), 12.60 with it, against 11.04 for adamw_multi_kernel
// with its value (3.83 TB/s); in bench_moe 11.51-11.56 against 10.94 + 1.76 for the update
// and the separate cast: the cast costs 0.6 ms in the update instead of 1.76 in the forward.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "code_tile.cuh"
#include "cuda_backend.h"
#include "cuda_check.h"
#include "fp8_cvt.cuh"
#include "multi_tensor.h"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace {

using vec::kWidth;

constexpr int kThreads = 256;                                // chunk blocks
constexpr int64_t kChunk = int64_t(kThreads) * kWidth * 4;   // elements per chunk (8192)
constexpr int kFinalThreads = 1024;                          // the norm's final block
constexpr int kWarp = 32;

// Table rows. Plain data without padding, so that comparing bytes compares rows.
struct NormEntry {
  const void* x;
  int64_t numel;
  int64_t first_chunk;  // chunks of the tensors before this one
  int64_t aligned;      // x is 16-byte aligned
};
static_assert(sizeof(NormEntry) == 32, "NormEntry has no padding");

struct AdamEntry {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  bf16* value;  // null: no BF16 copy
  int64_t numel;
  int64_t first_chunk;
  float weight_decay;
  int32_t aligned;  // every pointer above is 16-byte aligned
};
static_assert(sizeof(AdamEntry) == 64, "AdamEntry has no padding");

struct AdamScalars {
  float step_size, bias_correction2_sqrt, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, lr;
};

__host__ __device__ __forceinline__ int64_t chunks_of(int64_t numel) { return (numel + kChunk - 1) / kChunk; }

// The row whose chunks include `chunk`: the last with first_chunk <= chunk (every row has
// at least one chunk). Copied out, so that the kernel's stores cannot make the compiler
// reload it.
template <typename Entry>
__device__ __forceinline__ Entry entry_of(const Entry* entries, int count, int64_t chunk) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (entries[mid].first_chunk <= chunk) lo = mid;
    else hi = mid - 1;
  }
  return entries[lo];
}

// Lane 0 receives the warp's sum, always added in the same tree.
__device__ __forceinline__ double warp_sum(double s) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) s += __shfl_down_sync(0xffffffffu, s, offset);
  return s;
}

// Thread 0 receives the block's sum (kThreads threads), always added in the same tree.
__device__ double block_sum(double s) {
  constexpr int kWarps = kThreads / kWarp;
  __shared__ double warp_sums[kWarps];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  s = warp_sum(s);
  if (lane == 0) warp_sums[warp] = s;
  __syncthreads();
  double total = 0;
  if (warp == 0) total = warp_sum(lane < kWarps ? warp_sums[lane] : 0.0);
  return total;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) norm_partials_kernel(const NormEntry* entries, int count, double* partial) {
  const int64_t chunk = blockIdx.x;
  const NormEntry e = entry_of(entries, count, chunk);
  const T* x = static_cast<const T*>(e.x);
  const int64_t begin = (chunk - e.first_chunk) * kChunk;
  const int64_t end = e.numel < begin + kChunk ? e.numel : begin + kChunk;
  double s = 0;
  int64_t i = begin + threadIdx.x;
  if (e.aligned) {
    const int64_t vector_end = begin + (end - begin) / kWidth * kWidth;
    for (int64_t j = begin + int64_t(threadIdx.x) * kWidth; j < vector_end; j += int64_t(kThreads) * kWidth) {
      float v[kWidth];
      vec::load8(x + j, v);
#pragma unroll
      for (int k = 0; k < kWidth; ++k) s += static_cast<double>(v[k]) * static_cast<double>(v[k]);
    }
    i = vector_end + threadIdx.x;
  }
  for (; i < end; i += kThreads) {
    const double v = vec::load(x, i);
    s += v * v;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) partial[chunk] = s;
}

// tensor_sums: scratch of `count` doubles, written and read by this block only.
__global__ void __launch_bounds__(kFinalThreads)
    norm_final_kernel(const NormEntry* entries, int count, const double* partial, double* tensor_sums, void* out,
                      bool out_f64) {
  constexpr int kWarps = kFinalThreads / kWarp;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int t = warp; t < count; t += kWarps) {  // uniform per warp, so the shuffles see all lanes
    const int64_t first = entries[t].first_chunk, chunks = chunks_of(entries[t].numel);
    double s = 0;
    for (int64_t k = lane; k < chunks; k += kWarp) s += partial[first + k];
    s = warp_sum(s);
    // Rounded to float, as sum_of_squares into the CPU's F32 slot is (overflow: +Inf).
    if (lane == 0) tensor_sums[t] = static_cast<double>(__double2float_rn(s));
  }
  __syncthreads();  // makes the block's global writes visible to thread 0
  if (threadIdx.x != 0) return;
  double total = 0;
  for (int t = 0; t < count; ++t) total += tensor_sums[t];
  const double norm = sqrt(total);
  if (out_f64) *static_cast<double*>(out) = norm;
  else *static_cast<float*>(out) = __double2float_rn(norm);
}

__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, const AdamScalars& c,
                                              float decay) {
  const float mi = __fadd_rn(__fmul_rn(c.beta1, m), __fmul_rn(c.one_minus_beta1, g));
  const float vi = __fadd_rn(__fmul_rn(c.beta2, v), __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
  m = mi;
  v = vi;
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bias_correction2_sqrt), c.eps);
  p = __fsub_rn(__fmul_rn(p, decay), __fmul_rn(c.step_size, __fdiv_rn(mi, denom)));
}

// The host's clip expression, in double (rounded to float by the caller, as scale() received
// it). norm: F64 when norm_f64, else F32; read only when max_norm > 0.
__device__ __forceinline__ double clip_factor(const void* norm, bool norm_f64, double max_norm) {
  double clip = 1.0;
  if (max_norm > 0.0) {
    const double n =
        norm_f64 ? *static_cast<const double*>(norm) : static_cast<double>(*static_cast<const float*>(norm));
    if (n > max_norm) clip = __ddiv_rn(max_norm, __dadd_rn(n, 1e-6));  // a NaN norm compares false
  }
  return clip;
}

// 1 - lr * weight_decay in double, rounded once to float.
__device__ __forceinline__ float decay_factor(float lr, float weight_decay) {
  return __double2float_rn(__dsub_rn(1.0, __dmul_rn(static_cast<double>(lr), static_cast<double>(weight_decay))));
}

// norm: F64 when norm_f64, else F32; read only when max_norm > 0. step_scalars: null, or
// adamw_step_scalars' four doubles, whose lr, step size and bias correction (floats stored
// exactly) replace c's.
template <typename G>
__global__ void __launch_bounds__(kThreads)
    adamw_multi_kernel(const AdamEntry* entries, int count, AdamScalars c, const void* norm, bool norm_f64,
                       double max_norm, const double* step_scalars) {
  if (step_scalars) {
    c.lr = __double2float_rn(step_scalars[0]);
    c.step_size = __double2float_rn(step_scalars[2]);
    c.bias_correction2_sqrt = __double2float_rn(step_scalars[3]);
  }
  const int64_t chunk = blockIdx.x;
  const AdamEntry e = entry_of(entries, count, chunk);
  const double clip = clip_factor(norm, norm_f64, max_norm);
  const bool scaled = clip != 1.0;
  const float clip_f = __double2float_rn(clip);
  const float decay = decay_factor(c.lr, e.weight_decay);
  const G* grad = static_cast<const G*>(e.grad);
  const int64_t begin = (chunk - e.first_chunk) * kChunk;
  const int64_t end = e.numel < begin + kChunk ? e.numel : begin + kChunk;
  int64_t i = begin + threadIdx.x;
  if (e.aligned) {
    const int64_t vector_end = begin + (end - begin) / kWidth * kWidth;
    for (int64_t j = begin + int64_t(threadIdx.x) * kWidth; j < vector_end; j += int64_t(kThreads) * kWidth) {
      float p[kWidth], m[kWidth], v[kWidth], g[kWidth];
      vec::load8(e.param + j, p);
      vec::load8(e.exp_avg + j, m);
      vec::load8(e.exp_avg_sq + j, v);
      vec::load8(grad + j, g);
#pragma unroll
      for (int k = 0; k < kWidth; ++k) adamw_element(p[k], m[k], v[k], scaled ? __fmul_rn(clip_f, g[k]) : g[k], c, decay);
      vec::store8(e.param + j, p);
      vec::store8(e.exp_avg + j, m);
      vec::store8(e.exp_avg_sq + j, v);
      if (e.value) vec::store8(e.value + j, p);
    }
    i = vector_end + threadIdx.x;
  }
  for (; i < end; i += kThreads) {
    float p = e.param[i], m = e.exp_avg[i], v = e.exp_avg_sq[i];
    const float g = vec::load(grad, i);
    adamw_element(p, m, v, scaled ? __fmul_rn(clip_f, g) : g, c, decay);
    e.param[i] = p;
    e.exp_avg[i] = m;
    e.exp_avg_sq[i] = v;
    if (e.value) vec::store(e.value, i, p);
  }
}

// adamw_step_fp8_cast's kernel. Tile t of the grid's loop is tile t % per_expert of expert
// t / per_expert, row-major over the expert's [rows = N, cols = K]; each thread takes four
// 8-element pieces of it (16 to a tile row), all four's loads issued before the first is used
// (512 bytes a thread in flight). It updates them, then casts their BF16 values into the
// row-wise codes and the shared tile that the transposed store reads. Two shared tiles,
// alternating, so one barrier a tile. Measured on the H200 (Mixtral's two expert weights,
// with the value): 12.60 ms with four pieces in flight at 1 block a SM (206 registers),
// against 13.02 for two at 2 blocks, 12.68 for the next group's loads issued before the
// current group's math (software pipelining), 13.3 for 128 x 64 tiles (128-byte runs of
// W^T, 64-byte row-wise runs) and 15.5 for 256 x 32 tiles.
constexpr int kCastPieces = code_tile::kRows * code_tile::kCols / kWidth / kThreads;  // 4
constexpr int kInFlight = 4, kCastBlocksPerSm = 1;

template <typename G, bool kE4M3>
__global__ void __launch_bounds__(kThreads, kCastBlocksPerSm)
    adamw_cast_kernel(AdamEntry e, AdamScalars c, const void* norm, bool norm_f64, double max_norm,
                      const float* scale, uint32_t* amax_bits, uint8_t* q, uint8_t* q_t, int64_t rows, int64_t cols,
                      int64_t tiles_across, int64_t per_expert, int64_t tiles) {
  static_assert(kCastPieces % kInFlight == 0, "whole groups of pieces");
  constexpr int kPiecesPerRow = code_tile::kCols / kWidth;
  __shared__ uint32_t tile[2][code_tile::kRows][code_tile::kWords];
  const double clip = clip_factor(norm, norm_f64, max_norm);
  const bool scaled = clip != 1.0;
  const float clip_f = __double2float_rn(clip);
  const float decay = decay_factor(c.lr, e.weight_decay);
  const G* grad = static_cast<const G*>(e.grad);
  const int64_t size = rows * cols;
  uint32_t m = 0;  // the amax of the expert this block is on, flushed when it changes
  int64_t amax_expert = -1;
  int buffer = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x, buffer ^= 1) {
    const int64_t expert = t / per_expert, local = t % per_expert;
    if (expert != amax_expert) {  // block-uniform
      if (amax_expert >= 0) fp8cvt::block_atomic_max(m, amax_bits + amax_expert);
      m = 0;
      amax_expert = expert;
    }
    const int64_t r0 = (local / tiles_across) * code_tile::kRows, c0 = (local % tiles_across) * code_tile::kCols;
    const float s = scale[expert];
#pragma unroll
    for (int k0 = 0; k0 < kCastPieces; k0 += kInFlight) {
      float p[kInFlight][kWidth], mo[kInFlight][kWidth], v[kInFlight][kWidth], g[kInFlight][kWidth];
      int64_t at[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int id = int(threadIdx.x) + (k0 + u) * kThreads, row = id / kPiecesPerRow, piece = id % kPiecesPerRow;
        const int64_t r = r0 + row, col = c0 + int64_t(piece) * kWidth;
        at[u] = r < rows && col < cols ? expert * size + r * cols + col : -1;
        if (at[u] < 0) continue;
        vec::load8(e.param + at[u], p[u]);
        vec::load8(e.exp_avg + at[u], mo[u]);
        vec::load8(e.exp_avg_sq + at[u], v[u]);
        vec::load8(grad + at[u], g[u]);
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        if (at[u] < 0) continue;
        const int id = int(threadIdx.x) + (k0 + u) * kThreads, row = id / kPiecesPerRow, piece = id % kPiecesPerRow;
        const int64_t j = at[u];
#pragma unroll
        for (int i = 0; i < kWidth; ++i)
          adamw_element(p[u][i], mo[u][i], v[u][i], scaled ? __fmul_rn(clip_f, g[u][i]) : g[u][i], c, decay);
        vec::store8(e.param + j, p[u]);
        vec::store8(e.exp_avg + j, mo[u]);
        vec::store8(e.exp_avg_sq + j, v[u]);
        if (e.value) vec::store8(e.value + j, p[u]);
        // The codes of the new BF16 value: what the forward's cast would read.
#pragma unroll
        for (int i = 0; i < kWidth; ++i) {
          p[u][i] = vec::round_bf16(p[u][i]);
          m = max(m, fp8cvt::abs_bits(p[u][i]));
        }
        uint32_t words[2];
        fp8cvt::quantize_words<kE4M3, kWidth>(p[u], s, words);
        *reinterpret_cast<uint2*>(q + j) = make_uint2(words[0], words[1]);
        tile[buffer][row][code_tile::swizzle(row, 2 * piece)] = words[0];
        tile[buffer][row][code_tile::swizzle(row, 2 * piece + 1)] = words[1];
      }
    }
    // The one barrier a tile: this tile is complete, and every thread has finished reading the
    // other buffer (its previous tile's transposed store came before this barrier).
    __syncthreads();
    code_tile::store_transposed(tile[buffer], q_t + expert * size, rows, r0, c0, cols);
  }
  if (amax_expert >= 0) fp8cvt::block_atomic_max(m, amax_bits + amax_expert);
}

// The CPU reference's scalar expressions (T = float), evaluated the same way.
AdamScalars scalars_for(const AdamWOptions& options) {
  const auto step = adamw_step_scalars(options);
  AdamScalars c;
  c.step_size = static_cast<float>(step[2]);
  c.bias_correction2_sqrt = static_cast<float>(step[3]);
  c.beta1 = options.beta1;
  c.beta2 = options.beta2;
  c.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(options.beta1));
  c.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(options.beta2));
  c.eps = options.eps;
  c.lr = options.lr;
  return c;
}

// The table on the device: reused when the bytes are those uploaded last time, else copied
// on the stream (ordered before the launch that reads it) into a fresh buffer.
template <typename Entry>
const Entry* device_table(cudaStream_t stream, const std::vector<Entry>& rows, Device device, MultiTensorCache& cache) {
  const size_t bytes = rows.size() * sizeof(Entry);
  const auto* raw = reinterpret_cast<const unsigned char*>(rows.data());
  const bool same = cache.device_table.defined() && cache.device_table.device() == device &&
                    cache.host_table.size() == bytes && std::memcmp(cache.host_table.data(), raw, bytes) == 0;
  if (!same) {
    cache.host_table.assign(raw, raw + bytes);
    cache.device_table = Tensor::empty({static_cast<int64_t>(bytes)}, DType::U8, device);
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(cache.device_table.raw_data(), cache.host_table.data(), bytes,
                                       cudaMemcpyHostToDevice, stream));
  }
  return static_cast<const Entry*>(cache.device_table.raw_data());
}

// One dtype for every non-empty tensor of the list, F32 or BF16 (DType::F32 for none).
bool uniform_f32_or_bf16(const std::vector<Tensor>& list, DType* dtype) {
  bool found = false;
  *dtype = DType::F32;
  for (const Tensor& t : list) {
    if (t.numel() == 0) continue;
    if (!vec::is_f32_or_bf16(t.dtype()) || (found && t.dtype() != *dtype)) return false;
    *dtype = t.dtype();
    found = true;
  }
  return true;
}

void check_grid(int64_t chunks, size_t rows, const char* op) {
  TESSERA_CHECK(chunks <= INT_MAX && rows <= size_t(INT_MAX), op, " on CUDA: ", chunks, " chunks of ", kChunk,
                " elements exceed one grid");
}

}  // namespace

bool global_grad_norm_supported(const std::vector<Tensor>& grads, const Tensor& norm_out) {
  DType dtype;
  return uniform_f32_or_bf16(grads, &dtype) && (norm_out.dtype() == DType::F32 || norm_out.dtype() == DType::F64);
}

void global_grad_norm(void* stream, const std::vector<Tensor>& grads, Tensor& norm_out, MultiTensorCache& cache) {
  auto s = static_cast<cudaStream_t>(stream);
  DType dtype;
  uniform_f32_or_bf16(grads, &dtype);
  std::vector<NormEntry> rows;
  int64_t chunks = 0;
  for (const Tensor& g : grads) {
    if (g.numel() == 0) continue;
    rows.push_back(NormEntry{g.raw_data(), g.numel(), chunks, vec::aligned16(g.raw_data()) ? 1 : 0});
    chunks += chunks_of(g.numel());
  }
  if (rows.empty()) {  // +0.0 in either dtype
    TESSERA_CUDA_CHECK(cudaMemsetAsync(norm_out.raw_data(), 0, norm_out.nbytes(), s));
    return;
  }
  check_grid(chunks, rows.size(), "global_grad_norm");
  const NormEntry* table = device_table(s, rows, norm_out.device(), cache);
  const int64_t scratch_size = chunks + static_cast<int64_t>(rows.size());
  if (!cache.scratch.defined() || cache.scratch.device() != norm_out.device() || cache.scratch.numel() < scratch_size)
    cache.scratch = Tensor::empty({scratch_size}, DType::F64, norm_out.device());
  double* partial = cache.scratch.data<double>();
  const int count = static_cast<int>(rows.size());
  vec::dispatch(dtype, "global_grad_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    norm_partials_kernel<T><<<static_cast<unsigned>(chunks), kThreads, 0, s>>>(table, count, partial);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
  norm_final_kernel<<<1, kFinalThreads, 0, s>>>(table, count, partial, partial + chunks, norm_out.raw_data(),
                                                norm_out.dtype() == DType::F64);
  TESSERA_CUDA_CHECK_LAUNCH();
}

bool adamw_step_multi_supported(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                                const Tensor& grad_norm) {
  for (const Tensor& p : params)
    if (p.numel() > 0 && p.dtype() != DType::F32) return false;
  DType dtype;
  return uniform_f32_or_bf16(grads, &dtype) &&
         (!grad_norm.defined() || grad_norm.dtype() == DType::F32 || grad_norm.dtype() == DType::F64);
}

void adamw_step_multi(void* stream, std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                      std::vector<Tensor>& exp_avgs, std::vector<Tensor>& exp_avg_sqs,
                      std::vector<Tensor>& bf16_values, const AdamWOptions& options,
                      const std::vector<float>& weight_decays, const Tensor& grad_norm, double max_norm,
                      MultiTensorCache& cache, const Tensor& step_scalars) {
  auto s = static_cast<cudaStream_t>(stream);
  DType dtype;
  uniform_f32_or_bf16(grads, &dtype);
  std::vector<AdamEntry> rows;
  int64_t chunks = 0;
  for (size_t t = 0; t < params.size(); ++t) {
    if (params[t].numel() == 0) continue;
    AdamEntry e;
    e.param = params[t].data<float>();
    e.grad = grads[t].raw_data();
    e.exp_avg = exp_avgs[t].data<float>();
    e.exp_avg_sq = exp_avg_sqs[t].data<float>();
    e.value = !bf16_values.empty() && bf16_values[t].defined() ? bf16_values[t].data<bf16>() : nullptr;
    e.numel = params[t].numel();
    e.first_chunk = chunks;
    e.weight_decay = weight_decays[t];
    e.aligned = vec::aligned16(e.param) && vec::aligned16(e.grad) && vec::aligned16(e.exp_avg) &&
                vec::aligned16(e.exp_avg_sq) && (!e.value || vec::aligned16(e.value));
    rows.push_back(e);
    chunks += chunks_of(e.numel);
  }
  if (rows.empty()) return;
  check_grid(chunks, rows.size(), "adamw_step_multi");
  const Device device = params[0].device();
  const AdamEntry* table = device_table(s, rows, device, cache);
  const AdamScalars c = scalars_for(options);
  const void* norm = max_norm > 0.0 ? grad_norm.raw_data() : nullptr;
  const bool norm_f64 = grad_norm.defined() && grad_norm.dtype() == DType::F64;
  const int count = static_cast<int>(rows.size());
  vec::dispatch(dtype, "adamw_step_multi", [&](auto* tag) {
    using G = std::remove_pointer_t<decltype(tag)>;
    adamw_multi_kernel<G><<<static_cast<unsigned>(chunks), kThreads, 0, s>>>(
        table, count, c, norm, norm_f64, max_norm, step_scalars.defined() ? step_scalars.data<double>() : nullptr);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

bool adamw_step_fp8_cast_supported(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                                   const Tensor& exp_avg_sq, const Tensor& value, const Tensor& grad_norm,
                                   const Tensor& data) {
  const int64_t experts = data.size(0), rows = data.size(1), cols = data.size(2);
  const bool aligned = vec::aligned16(param.raw_data()) && vec::aligned16(grad.raw_data()) &&
                       vec::aligned16(exp_avg.raw_data()) && vec::aligned16(exp_avg_sq.raw_data()) &&
                       (!value.defined() || vec::aligned16(value.raw_data()));
  return param.dtype() == DType::F32 && (grad.dtype() == DType::F32 || grad.dtype() == DType::BF16) && aligned &&
         (!grad_norm.defined() || grad_norm.dtype() == DType::F32 || grad_norm.dtype() == DType::F64) &&
         experts > 0 && cols % kWidth == 0 && rows % 8 == 0;
}

void adamw_step_fp8_cast(void* stream, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                         Tensor& value, const AdamWOptions& options, float weight_decay, const Tensor& grad_norm,
                         double max_norm, const Tensor& scale, Tensor& amax, Tensor& data, Tensor& data_t) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t experts = data.size(0), rows = data.size(1), cols = data.size(2);
  if (rows == 0 || cols == 0) return;
  AdamEntry e{};
  e.param = param.data<float>();
  e.grad = grad.raw_data();
  e.exp_avg = exp_avg.data<float>();
  e.exp_avg_sq = exp_avg_sq.data<float>();
  e.value = value.defined() ? value.data<bf16>() : nullptr;
  e.numel = param.numel();
  e.weight_decay = weight_decay;
  e.aligned = 1;
  const AdamScalars c = scalars_for(options);
  const void* norm = max_norm > 0.0 ? grad_norm.raw_data() : nullptr;
  const bool norm_f64 = grad_norm.defined() && grad_norm.dtype() == DType::F64;
  const int64_t down = (rows + code_tile::kRows - 1) / code_tile::kRows;
  const int64_t across = (cols + code_tile::kCols - 1) / code_tile::kCols;
  const int64_t per_expert = down * across, tiles = per_expert * experts;
  const int64_t wave = int64_t(multiprocessor_count(param.device().index)) * kCastBlocksPerSm;
  const unsigned grid = unsigned(std::min(tiles, wave));
  auto launch = [&](auto* grad_tag, auto e4m3_tag) {
    using G = std::remove_pointer_t<decltype(grad_tag)>;
    constexpr bool kE4M3 = decltype(e4m3_tag)::value;
    adamw_cast_kernel<G, kE4M3><<<grid, kThreads, 0, s>>>(e, c, norm, norm_f64, max_norm, scale.data<float>(), amax.data<uint32_t>(),
                                     data.data<uint8_t>(), data_t.data<uint8_t>(), rows, cols, across, per_expert,
                                     tiles);
  };
  const bool e4m3 = data.dtype() == DType::E4M3;
  vec::dispatch(grad.dtype(), "adamw_step_fp8_cast", [&](auto* tag) {
    if (e4m3) launch(tag, std::true_type{});
    else launch(tag, std::false_type{});
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
