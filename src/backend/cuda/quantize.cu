// FP8 quantization on the GPU: amax, per-tensor scaling, 2-D block scaling (1x128,
// 128x128 or any tile) and MXFP8 (1x32 blocks, E8M0 scales), quantize and dequantize.
// Every byte equals the CPU reference's (backend/cpu/quantize.cpp): inputs are upcast to
// float exactly as the CPU does, products are single float multiplications with x86's NaN
// results (mul_x86_nan), scales come from numeric.h's fp8_scale_for_amax and
// mx_scale_code_for_amax, and FP8 codes from bit-level encoders checked against numeric.h
// (the per-tensor kernel: from the hardware's cvt.rn.satfinite, the same bytes for every
// non-NaN product; test_gpu_quantize and bench_bandwidth's every-BF16-pattern check hold it
// to that; NaN products still take the encoders).
//
// Layout: contiguous tensors; block ops take row-major [rows, cols] and write row-major
// scale grids. Loads are 16 bytes wide when the pointers are 16-byte aligned (and, for
// block ops, when cols and the block width are multiples of the vector), else scalar.
// amax is order-free (max of the float bits, NaN mapped above Inf), so the atomics that
// combine thread blocks keep every result deterministic.
//
// Floor: memory-bound, bytes moved / ~4.1 TB/s. Quantize reads the input once and writes
// one byte per element (F32 in: 5 B/element, ~0.8 Telement/s; BF16 in: 3 B/element; the
// per-tensor kernel converts with the hardware's FP8 conversion to stay memory-bound:
// 16384 x 4096 BF16 -> E4M3 with amax measured 58 -> 98% of cudaMemcpy D2D in the same run,
// amax alone 87 -> 92%);
// dequantize reads one byte and writes sizeof(out). Block kernels hold a tile's chunks in
// registers between the amax pass and the quantize pass, so the input is read once, for
// tiles up to 4096 16-byte chunks (a vector-loaded 128x128 F32 or BF16 tile); beyond that
// (scalar-path 128x128, 256x256) the second pass re-reads the rest, mostly from L2.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "cuda_check.h"
#include "quantize.h"

namespace tessera::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride loops beyond this
constexpr int kChunk = 16;            // elements per chunk in the per-tensor and dequantize kernels
constexpr int kCachedChunks = 8;      // chunks a thread keeps in registers in the block kernels
constexpr int kMaxBlockThreads = 512; // a whole-block team (large tiles); two such blocks fit an SM
constexpr uint32_t kNanBits = 0x7fc00000u;

template <DType D>
using DTypeTag = std::integral_constant<DType, D>;

// ---- Element access -----------------------------------------------------------------------

// Input element -> float, exactly as the CPU's ReadBuffer<float> converts.
template <DType D>
struct In;
template <>
struct In<DType::F32> { using S = float; __device__ static float load(S v) { return v; } };
template <>
struct In<DType::BF16> { using S = uint16_t; __device__ static float load(S v) { return bf16_bits_to_float(v); } };
template <>
struct In<DType::F16> { using S = uint16_t; __device__ static float load(S v) { return fp16_bits_to_float(v); } };
template <>
struct In<DType::F64> {
  using S = double;
  // Only a NaN's sign can reach an output (amax canonicalises NaN), so the payload is dropped.
  __device__ static float load(S v) {
    if (v != v) return bits_float((static_cast<uint32_t>(__double_as_longlong(v) >> 32) & 0x80000000u) | kNanBits);
    return __double2float_rn(v);
  }
};
template <>
struct In<DType::E4M3> { using S = uint8_t; __device__ static float load(S v) { return decode_e4m3_bits(v); } };
template <>
struct In<DType::E5M2> { using S = uint8_t; __device__ static float load(S v) { return decode_e5m2_bits(v); } };

// float -> dequantized output element, exactly as the CPU's WriteBuffer<float>::commit stores it.
template <DType D>
struct Out;
template <>
struct Out<DType::F32> { using S = float; __device__ static S store(float v) { return v; } };
template <>
struct Out<DType::F64> {
  using S = double;
  // x86's float -> double keeps a NaN's sign and payload (shifted up); built by hand, since
  // the GPU conversion is not documented to keep them.
  __device__ static S store(float v) {
    if (v != v) {
      const uint32_t b = float_bits(v);
      return __longlong_as_double(static_cast<long long>((static_cast<uint64_t>(b >> 31) << 63) |
                                                         0x7ff8000000000000ull |
                                                         (static_cast<uint64_t>(b & 0x7fffffu) << 29)));
    }
    return static_cast<double>(v);
  }
};
template <>
struct Out<DType::BF16> { using S = uint16_t; __device__ static S store(float v) { return float_to_bf16_bits(v); } };
template <>
struct Out<DType::F16> { using S = uint16_t; __device__ static S store(float v) { return float_to_fp16_bits(v); } };

template <bool kE4M3>
__device__ uint8_t encode(float v) {
  return kE4M3 ? encode_e4m3_bits(v) : encode_e5m2_bits(v);
}
template <bool kE4M3>
__device__ float decode(uint8_t c) {
  return kE4M3 ? decode_e4m3_bits(c) : decode_e5m2_bits(c);
}

// |v| as ordered bits: every NaN becomes 0x7fc00000, above +Inf, so an unsigned max of
// these is max |x| with NaN winning, and its float is exactly the CPU's amax (NAN included).
__device__ uint32_t abs_bits(float v) {
  const uint32_t a = float_bits(v) & 0x7fffffffu;
  return a > 0x7f800000u ? kNanBits : a;
}

// N elements of S from / to 16-byte aligned memory, as whole 16-byte words when they fill
// them (N * sizeof(S) is 16 or a multiple) and as one narrower word otherwise.
template <typename S, int N>
__device__ void load_vector(const S* p, S (&v)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(S));
  static_assert(kBytes % 16 == 0, "vector loads are whole 16-byte words");
#pragma unroll
  for (int w = 0; w < kBytes / 16; ++w) {
    const uint4 word = __ldg(reinterpret_cast<const uint4*>(p) + w);
    memcpy(reinterpret_cast<char*>(v) + 16 * w, &word, 16);
  }
}

template <typename S, int N>
__device__ void store_vector(S* p, const S (&v)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(S));
  if constexpr (kBytes >= 16) {
    static_assert(kBytes % 16 == 0, "vector stores are whole 16-byte words");
#pragma unroll
    for (int w = 0; w < kBytes / 16; ++w) {
      uint4 word;
      memcpy(&word, reinterpret_cast<const char*>(v) + 16 * w, 16);
      reinterpret_cast<uint4*>(p)[w] = word;
    }
  } else if constexpr (kBytes == 8) {
    uint2 word;
    memcpy(&word, v, 8);
    *reinterpret_cast<uint2*>(p) = word;
  } else if constexpr (kBytes == 4) {
    uint32_t word;
    memcpy(&word, v, 4);
    *reinterpret_cast<uint32_t*>(p) = word;
  } else if constexpr (kBytes == 2) {
    uint16_t word;
    memcpy(&word, v, 2);
    *reinterpret_cast<uint16_t*>(p) = word;
  } else {
    *p = v[0];
  }
}

// ---- Reductions ---------------------------------------------------------------------------

__device__ uint32_t warp_max(uint32_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Combines every thread's value into *target (zeroed beforehand) with one atomic per block.
__device__ void atomic_max_over_block(uint32_t v, uint32_t* target) {
  __shared__ uint32_t partial[32];
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0u;
    v = warp_max(v);
    if (threadIdx.x == 0 && v != 0u) atomicMax(target, v);
  }
}

// Max over a team: `team` consecutive lanes of one warp (a power of two up to 32), or the
// whole thread block when cta_team. Every thread of the team must call it.
__device__ uint32_t team_max(uint32_t v, int team, bool cta_team, uint32_t* partial) {
  if (!cta_team) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned mask = team == 32 ? 0xffffffffu : ((1u << team) - 1u) << (lane & ~static_cast<unsigned>(team - 1));
    for (int offset = team / 2; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(mask, v, offset));
    return v;
  }
  // partial[0..31] is rewritten only after every thread has passed the second barrier below,
  // and partial[32] only after the next call's first barrier, so one tile's result is read
  // before the next tile overwrites it.
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    uint32_t w = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0u;
    w = warp_max(w);
    if (threadIdx.x == 0) partial[32] = w;
  }
  __syncthreads();
  return partial[32];
}

#define TESSERA_GRID_STRIDE(i, start, n)                                                     \
  for (int64_t i = (start) + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

// ---- amax and per-tensor scaling ----------------------------------------------------------

// Two chunks per thread per step (both loaded before either is used) keep 32-64 bytes of
// loads in flight per thread; a grid-stride loop covers the rest. Chunk c's partner is
// c + stride (stride = threads in the grid).

// n_vec: how many leading 16-element chunks take vector loads (0 when misaligned).
template <DType D>
__global__ void amax_kernel(const typename In<D>::S* x, int64_t n, int64_t n_vec, uint32_t* amax_bits) {
  using S = typename In<D>::S;
  uint32_t m = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < n_vec; c += 2 * stride) {
    const bool second = c + stride < n_vec;
    S v[kChunk], w[kChunk];
    load_vector(x + c * kChunk, v);
    if (second) load_vector(x + (c + stride) * kChunk, w);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) m = max(m, abs_bits(In<D>::load(v[i])));
    if (second)
#pragma unroll
      for (int i = 0; i < kChunk; ++i) m = max(m, abs_bits(In<D>::load(w[i])));
  }
  TESSERA_GRID_STRIDE(i, n_vec * kChunk, n) m = max(m, abs_bits(In<D>::load(x[i])));
  atomic_max_over_block(m, amax_bits);
}

// The FP8 codes of a chunk of 16 products f[i] * s, stored to q (16-byte aligned). The
// hardware conversion (cvt.rn.satfinite, two values per instruction) rounds to nearest even
// and saturates exactly as encode<> does for every non-NaN product, infinities included;
// it writes an unsigned NaN, so a chunk with any NaN product is encoded again element by
// element with the x86 NaN rules (mul_x86_nan, encode<>). The software encoder alone is
// ~20 instructions an element, which made the kernel compute-bound.
template <bool kE4M3>
__device__ __forceinline__ void quantize_chunk(const float (&f)[kChunk], float s, uint8_t* q) {
  uint32_t words[kChunk / 4];
  bool nan = false;
#pragma unroll
  for (int i = 0; i < kChunk; i += 2) {
    const float lo = f[i] * s, hi = f[i + 1] * s;
    nan |= (lo != lo) | (hi != hi);
    uint16_t pair;
    if constexpr (kE4M3) asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
    else asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
    if (i % 4 == 0) words[i / 4] = pair;
    else words[i / 4] |= uint32_t(pair) << 16;
  }
  if (nan) {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const uint32_t code = encode<kE4M3>(mul_x86_nan(f[i], s));
      const int shift = 8 * (i % 4);
      words[i / 4] = (words[i / 4] & ~(0xffu << shift)) | (code << shift);
    }
  }
  *reinterpret_cast<uint4*>(q) = make_uint4(words[0], words[1], words[2], words[3]);
}

template <DType D, bool kE4M3, bool kAmax>
__global__ void quantize_tensor_kernel(const typename In<D>::S* x, const float* scale, uint8_t* q, int64_t n,
                                       int64_t n_vec, uint32_t* amax_bits) {
  using S = typename In<D>::S;
  const float s = *scale;
  uint32_t m = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < n_vec; c += 2 * stride) {
    const bool second = c + stride < n_vec;
    S v[kChunk], w[kChunk];
    load_vector(x + c * kChunk, v);
    if (second) load_vector(x + (c + stride) * kChunk, w);
    float f[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      f[i] = In<D>::load(v[i]);
      if (kAmax) m = max(m, abs_bits(f[i]));
    }
    quantize_chunk<kE4M3>(f, s, q + c * kChunk);
    if (second) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        f[i] = In<D>::load(w[i]);
        if (kAmax) m = max(m, abs_bits(f[i]));
      }
      quantize_chunk<kE4M3>(f, s, q + (c + stride) * kChunk);
    }
  }
  TESSERA_GRID_STRIDE(i, n_vec * kChunk, n) {
    const float f = In<D>::load(x[i]);
    if (kAmax) m = max(m, abs_bits(f));
    q[i] = encode<kE4M3>(mul_x86_nan(f, s));
  }
  if constexpr (kAmax) atomic_max_over_block(m, amax_bits);
}

template <bool kE4M3, DType D>
__global__ void dequantize_tensor_kernel(const uint8_t* q, const float* scale_inv, typename Out<D>::S* out, int64_t n,
                                         int64_t n_vec) {
  using S = typename Out<D>::S;
  const float s = *scale_inv;
  TESSERA_GRID_STRIDE(c, 0, n_vec) {
    uint8_t codes[kChunk];
    S v[kChunk];
    load_vector(q + c * kChunk, codes);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) v[i] = Out<D>::store(mul_x86_nan(decode<kE4M3>(codes[i]), s));
    store_vector(out + c * kChunk, v);
  }
  TESSERA_GRID_STRIDE(i, n_vec * kChunk, n) out[i] = Out<D>::store(mul_x86_nan(decode<kE4M3>(q[i]), s));
}

// ---- Block scaling and MXFP8 --------------------------------------------------------------

// How block kernels cut the work: one team of threads per tile (scaling block), sized so
// each thread holds at most kCachedChunks chunks: `team` lanes of a warp for small tiles
// (1x128: 4 lanes for F32, 2 for BF16; 1x32: 1 lane), a whole thread block (cta_team) for
// tiles of more than 32 * kCachedChunks chunks (128x128), up to kMaxBlockThreads threads.
struct TileGrid {
  int64_t rows, cols, block_rows, block_cols;
  int64_t grid_cols, tiles;
  int team;
  bool cta_team;
};

// 2^-X for the E8M0 code X + 127 (never 0xff here): a normal float, or 2^-127 for code 254.
__device__ float mx_multiplier(uint8_t code) {
  return code == 254 ? bits_float(0x00400000u) : bits_float(static_cast<uint32_t>(254 - code) << 23);
}

// The float value of an E8M0 scale, as numeric.h's e8m0_to_float (0xff is NaN).
__device__ float mx_scale_value(uint8_t code) {
  if (code == 0xff) return bits_float(kNanBits);
  return code == 0 ? bits_float(0x00400000u) : bits_float(static_cast<uint32_t>(code) << 23);
}

// kVec: chunks of one 16-byte word (16 / sizeof(S) elements), possible when cols and the
// block width are multiples of it and x is 16-byte aligned; otherwise chunks of one element.
// A tile's chunks are numbered row by row; a thread keeps its first kCachedChunks in
// registers for the second pass and re-reads any beyond that (only very large tiles).
template <DType D, bool kE4M3, bool kMx, bool kVec>
__global__ void __launch_bounds__(kMaxBlockThreads, 2)
    quantize_block_kernel(const typename In<D>::S* x, uint8_t* q, void* scales, TileGrid g, bool power_of_two) {
  using S = typename In<D>::S;
  constexpr int V = kVec ? 16 / static_cast<int>(sizeof(S)) : 1;
  struct Chunk {
    S v[V];
  };
  __shared__ uint32_t partial[33];
  const int team = g.cta_team ? static_cast<int>(blockDim.x) : g.team;
  const int lane = static_cast<int>(threadIdx.x) % team;
  const int teams_per_block = static_cast<int>(blockDim.x) / team;
  const int64_t first = int64_t(blockIdx.x) * teams_per_block + static_cast<int>(threadIdx.x) / team;

  for (int64_t tile = first; tile < g.tiles; tile += int64_t(gridDim.x) * teams_per_block) {
    const int64_t bi = tile / g.grid_cols, bj = tile - bi * g.grid_cols;
    const int64_t r0 = bi * g.block_rows, c0 = bj * g.block_cols;
    const uint32_t tile_rows = static_cast<uint32_t>(g.rows - r0 < g.block_rows ? g.rows - r0 : g.block_rows);
    const uint32_t per_row = static_cast<uint32_t>(g.cols - c0 < g.block_cols ? g.cols - c0 : g.block_cols) / V;
    const uint32_t chunks = tile_rows * per_row;
    const S* xt = x + r0 * g.cols + c0;
    uint8_t* qt = q + r0 * g.cols + c0;
    auto offset_of = [&](uint32_t k) {
      const uint32_t r = k / per_row;
      return int64_t(r) * g.cols + int64_t(k - r * per_row) * V;
    };
    auto load_chunk = [&](uint32_t k) {
      Chunk c;
      if constexpr (kVec) load_vector(xt + offset_of(k), c.v);
      else c.v[0] = xt[offset_of(k)];
      return c;
    };
    auto chunk_amax = [](const Chunk& c) {
      uint32_t m = 0;
#pragma unroll
      for (int i = 0; i < V; ++i) m = max(m, abs_bits(In<D>::load(c.v[i])));
      return m;
    };

    Chunk cache[kCachedChunks];
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < kCachedChunks; ++j) {
      const uint32_t k = lane + j * team;
      if (k < chunks) {
        cache[j] = load_chunk(k);
        m = max(m, chunk_amax(cache[j]));
      }
    }
    for (uint32_t k = lane + kCachedChunks * team; k < chunks; k += team) m = max(m, chunk_amax(load_chunk(k)));
    m = team_max(m, team, g.cta_team, partial);

    float multiplier;
    if constexpr (kMx) {
      const uint8_t code = mx_scale_code_for_amax(bits_float(m), kE4M3 ? 8 : 15);
      multiplier = code == 0xff ? 1.0f : mx_multiplier(code);
      if (lane == 0) static_cast<uint8_t*>(scales)[tile] = code;
    } else {
      multiplier = fp8_scale_for_amax(bits_float(m), kE4M3 ? kE4M3Max : kE5M2Max, 0.0f, power_of_two);
      if (lane == 0) static_cast<float*>(scales)[tile] = 1.0f / multiplier;
    }

    auto store_chunk = [&](uint32_t k, const Chunk& c) {
      uint8_t codes[V];
#pragma unroll
      for (int i = 0; i < V; ++i) codes[i] = encode<kE4M3>(mul_x86_nan(In<D>::load(c.v[i]), multiplier));
      store_vector(qt + offset_of(k), codes);
    };
#pragma unroll
    for (int j = 0; j < kCachedChunks; ++j) {
      const uint32_t k = lane + j * team;
      if (k < chunks) store_chunk(k, cache[j]);
    }
    for (uint32_t k = lane + kCachedChunks * team; k < chunks; k += team) store_chunk(k, load_chunk(k));
  }
}

// out[i, j] = float(q[i, j]) * scale of its block. kVec: 16-element chunks, when cols and
// the block width are multiples of 16 and the pointers aligned, so a chunk has one scale.
template <bool kE4M3, DType D, bool kMx, bool kVec>
__global__ void dequantize_block_kernel(const uint8_t* q, const void* scales, typename Out<D>::S* out, int64_t rows,
                                        int64_t cols, int64_t block_rows, int64_t block_cols, int64_t grid_cols) {
  using S = typename Out<D>::S;
  constexpr int V = kVec ? kChunk : 1;
  const int64_t per_row = cols / V;
  TESSERA_GRID_STRIDE(c, 0, rows * per_row) {
    const int64_t r = c / per_row, col = (c - r * per_row) * V;
    const int64_t s_index = (r / block_rows) * grid_cols + col / block_cols;
    const float s = kMx ? mx_scale_value(static_cast<const uint8_t*>(scales)[s_index])
                        : static_cast<const float*>(scales)[s_index];
    if constexpr (kVec) {
      uint8_t codes[V];
      S v[V];
      load_vector(q + c * V, codes);
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = Out<D>::store(mul_x86_nan(decode<kE4M3>(codes[i]), s));
      store_vector(out + c * V, v);
    } else {
      out[c] = Out<D>::store(mul_x86_nan(decode<kE4M3>(q[c]), s));
    }
  }
}

// ---- Launch helpers -----------------------------------------------------------------------

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

int64_t ceil_div(int64_t a, int64_t b) { return a == 0 ? 0 : 1 + (a - 1) / b; }

unsigned grid_for(int64_t work_items, int threads = kThreads) {
  return static_cast<unsigned>(std::clamp<int64_t>(ceil_div(work_items, threads), 1, kMaxBlocks));
}

int next_pow2(int64_t v) {
  int p = 1;
  while (p < v) p *= 2;
  return p;
}

template <typename Fn>
void dispatch_input(DType t, const char* op, Fn&& fn) {
  switch (t) {
    case DType::F64: fn(DTypeTag<DType::F64>{}); return;
    case DType::F32: fn(DTypeTag<DType::F32>{}); return;
    case DType::F16: fn(DTypeTag<DType::F16>{}); return;
    case DType::BF16: fn(DTypeTag<DType::BF16>{}); return;
    case DType::E4M3: fn(DTypeTag<DType::E4M3>{}); return;
    case DType::E5M2: fn(DTypeTag<DType::E5M2>{}); return;
    default: TESSERA_FAIL(op, " on CUDA: input dtype ", dtype_name(t), " has no kernel");
  }
}

template <typename Fn>
void dispatch_output(DType t, const char* op, Fn&& fn) {
  switch (t) {
    case DType::F64: fn(DTypeTag<DType::F64>{}); return;
    case DType::F32: fn(DTypeTag<DType::F32>{}); return;
    case DType::F16: fn(DTypeTag<DType::F16>{}); return;
    case DType::BF16: fn(DTypeTag<DType::BF16>{}); return;
    default: TESSERA_FAIL(op, " on CUDA: output dtype ", dtype_name(t), " has no kernel");
  }
}

// fn(std::true_type{}) or fn(std::false_type{}): a runtime flag made a template argument.
template <typename Fn>
void dispatch_bool(bool b, Fn&& fn) {
  if (b) fn(std::true_type{});
  else fn(std::false_type{});
}

// Shared by quantize_blockwise and quantize_mxfp8 (kMx selects the recipe).
template <bool kMx>
void launch_quantize_blocks(cudaStream_t stream, const Tensor& x, Tensor& out, void* scales, int64_t block_rows,
                            int64_t block_cols, bool power_of_two, const char* op) {
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0 || cols == 0) return;
  TileGrid g{rows, cols, block_rows, block_cols, ceil_div(cols, block_cols), 0, 1, false};
  g.tiles = ceil_div(rows, block_rows) * g.grid_cols;
  dispatch_input(x.dtype(), op, [&](auto in_tag) {
    constexpr DType D = decltype(in_tag)::value;
    using S = typename In<D>::S;
    constexpr int64_t V = 16 / sizeof(S);
    // Vector chunks for the 2- and 4-byte inputs, the ones the recipes are used with.
    const bool vec = (D == DType::F32 || D == DType::BF16 || D == DType::F16) && cols % V == 0 &&
                     block_cols % V == 0 && aligned16(x.raw_data()) && aligned16(out.raw_data());
    const int64_t chunk = vec ? V : 1;
    const int64_t tile_chunks = std::min(block_rows, rows) * (std::min(block_cols, cols) / chunk);
    // As few lanes per tile as keep every chunk in registers: each lane then has up to
    // kCachedChunks independent 16-byte loads in flight before the team's reduction.
    const int64_t lanes = ceil_div(tile_chunks, kCachedChunks);
    int threads = kThreads;
    if (lanes <= 32) {
      g.team = next_pow2(lanes);
    } else {
      g.cta_team = true;
      threads = std::clamp(next_pow2(lanes), 64, kMaxBlockThreads);
      g.team = threads;
    }
    const int64_t blocks = std::clamp<int64_t>(ceil_div(g.tiles, threads / g.team), 1, int64_t(1) << 20);
    dispatch_bool(out.dtype() == DType::E4M3, [&](auto fp8_tag) {
      constexpr bool kE4M3 = decltype(fp8_tag)::value;
      if constexpr (D == DType::F32 || D == DType::BF16 || D == DType::F16) {
        dispatch_bool(vec, [&](auto vec_tag) {
          quantize_block_kernel<D, kE4M3, kMx, decltype(vec_tag)::value><<<unsigned(blocks), threads, 0, stream>>>(
              x.data<S>(), out.data<uint8_t>(), scales, g, power_of_two);
        });
      } else {
        quantize_block_kernel<D, kE4M3, kMx, false><<<unsigned(blocks), threads, 0, stream>>>(
            x.data<S>(), out.data<uint8_t>(), scales, g, power_of_two);
      }
    });
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

template <bool kMx>
void launch_dequantize_blocks(cudaStream_t stream, const Tensor& q, const void* scales, Tensor& out,
                              int64_t block_rows, int64_t block_cols, const char* op) {
  const int64_t rows = q.size(0), cols = q.size(1);
  if (rows == 0 || cols == 0) return;
  const int64_t grid_cols = ceil_div(cols, block_cols);
  const bool vec = cols % kChunk == 0 && block_cols % kChunk == 0 && aligned16(q.raw_data()) &&
                   aligned16(out.raw_data());
  const int64_t work = rows * (vec ? cols / kChunk : cols);
  dispatch_bool(q.dtype() == DType::E4M3, [&](auto fp8_tag) {
    constexpr bool kE4M3 = decltype(fp8_tag)::value;
    dispatch_output(out.dtype(), op, [&](auto out_tag) {
      constexpr DType D = decltype(out_tag)::value;
      dispatch_bool(vec, [&](auto vec_tag) {
        dequantize_block_kernel<kE4M3, D, kMx, decltype(vec_tag)::value><<<grid_for(work), kThreads, 0, stream>>>(
            q.data<uint8_t>(), scales, out.data<typename Out<D>::S>(), rows, cols, block_rows, block_cols, grid_cols);
      });
    });
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace

// ---- Entry points ---------------------------------------------------------------------------

bool quantize_input_supported(DType x) {
  return x == DType::F64 || x == DType::F32 || x == DType::F16 || x == DType::BF16 || x == DType::E4M3 ||
         x == DType::E5M2;
}

bool dequantize_output_supported(DType out) {
  return out == DType::F64 || out == DType::F32 || out == DType::F16 || out == DType::BF16;
}

bool blockwise_supported(int64_t rows, int64_t cols, const BlockScaling& blocks) {
  // Chunk numbers inside a tile are 32-bit.
  return std::min(blocks.block_rows, rows) * std::min(blocks.block_cols, cols) < (int64_t(1) << 31);
}

void amax(void* stream, const Tensor& x, Tensor& amax_out) {
  auto s = static_cast<cudaStream_t>(stream);
  uint32_t* target = amax_out.data<uint32_t>();
  TESSERA_CUDA_CHECK(cudaMemsetAsync(target, 0, sizeof(uint32_t), s));
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_input(x.dtype(), "amax", [&](auto in_tag) {
    constexpr DType D = decltype(in_tag)::value;
    const int64_t n_vec = aligned16(x.raw_data()) ? n / kChunk : 0;
    amax_kernel<D><<<grid_for(n_vec + (n - n_vec * kChunk)), kThreads, 0, s>>>(x.data<typename In<D>::S>(), n, n_vec, target);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void quantize_per_tensor(void* stream, const Tensor& x, const Tensor& scale, Tensor& out, Tensor& amax_out) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t n = x.numel();
  // When amax_out is the scale tensor itself, zeroing it first would change the scale the
  // kernel reads: then amax runs as its own pass after the quantization.
  const bool separate_amax = amax_out.defined() && amax_out.raw_data() == scale.raw_data();
  const bool fused_amax = amax_out.defined() && !separate_amax;
  uint32_t* amax_bits = fused_amax ? amax_out.data<uint32_t>() : nullptr;
  if (fused_amax) TESSERA_CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, sizeof(uint32_t), s));
  if (n > 0) {
    dispatch_input(x.dtype(), "quantize_per_tensor", [&](auto in_tag) {
      constexpr DType D = decltype(in_tag)::value;
      const int64_t n_vec = aligned16(x.raw_data()) && aligned16(out.raw_data()) ? n / kChunk : 0;
      const unsigned grid = grid_for(n_vec + (n - n_vec * kChunk));
      dispatch_bool(out.dtype() == DType::E4M3, [&](auto fp8_tag) {
        constexpr bool kE4M3 = decltype(fp8_tag)::value;
        dispatch_bool(fused_amax, [&](auto amax_tag) {
          quantize_tensor_kernel<D, kE4M3, decltype(amax_tag)::value><<<grid, kThreads, 0, s>>>(
              x.data<typename In<D>::S>(), scale.data<float>(), out.data<uint8_t>(), n, n_vec, amax_bits);
        });
      });
    });
    TESSERA_CUDA_CHECK_LAUNCH();
  }
  if (separate_amax) amax(stream, x, amax_out);
}

void dequantize_per_tensor(void* stream, const Tensor& q, const Tensor& scale_inv, Tensor& out) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t n = q.numel();
  if (n == 0) return;
  const int64_t n_vec = aligned16(q.raw_data()) && aligned16(out.raw_data()) ? n / kChunk : 0;
  dispatch_bool(q.dtype() == DType::E4M3, [&](auto fp8_tag) {
    constexpr bool kE4M3 = decltype(fp8_tag)::value;
    dispatch_output(out.dtype(), "dequantize_per_tensor", [&](auto out_tag) {
      constexpr DType D = decltype(out_tag)::value;
      dequantize_tensor_kernel<kE4M3, D><<<grid_for(n_vec + (n - n_vec * kChunk)), kThreads, 0, s>>>(
          q.data<uint8_t>(), scale_inv.data<float>(), out.data<typename Out<D>::S>(), n, n_vec);
    });
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void quantize_blockwise(void* stream, const Tensor& x, Tensor& out, Tensor& scale_inv, const BlockScaling& blocks) {
  launch_quantize_blocks<false>(static_cast<cudaStream_t>(stream), x, out, scale_inv.raw_data(), blocks.block_rows,
                                blocks.block_cols, blocks.power_of_two_scales, "quantize_blockwise");
}

void dequantize_blockwise(void* stream, const Tensor& q, const Tensor& scale_inv, Tensor& out,
                          const BlockScaling& blocks) {
  launch_dequantize_blocks<false>(static_cast<cudaStream_t>(stream), q, scale_inv.raw_data(), out, blocks.block_rows,
                                  blocks.block_cols, "dequantize_blockwise");
}

void quantize_mxfp8(void* stream, const Tensor& x, Tensor& out, Tensor& scales) {
  launch_quantize_blocks<true>(static_cast<cudaStream_t>(stream), x, out, scales.raw_data(), 1, kMxBlockSize, false,
                               "quantize_mxfp8");
}

void dequantize_mxfp8(void* stream, const Tensor& q, const Tensor& scales, Tensor& out) {
  launch_dequantize_blocks<true>(static_cast<cudaStream_t>(stream), q, scales.raw_data(), out, 1, kMxBlockSize,
                                 "dequantize_mxfp8");
}

}  // namespace tessera::cuda
