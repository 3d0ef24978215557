// Token embedding on the GPU: out[t, :] = table[ids[t], :] and its scatter-add backward
// d_table[ids[t], :] += d_out[t, :], with the CPU reference's rules (backend/cpu/embedding.cpp)
// except for how a bad id is reported (index_error.h: NaN row / skipped row, error raised
// by the next embedding or cross-entropy call).
//
// Layout: ids flattened to T positions; table/d_table [V, C], out/d_out [T, C], row-major.
// Forward: a block holds a few rows (threads across the channels); equal dtypes copy raw
// 16/8/4/2/1-byte chunks (bit-exact, any dtype), F32<->BF16 convert 8 elements per
// 16-byte vector. Floor: T * C * (in + out bytes) / 4.1 TB/s, e.g. 16K x 768 BF16 =
// 50 MB -> 12 us.
// Backward, deterministic without atomics: sort (id, position) pairs by id with CUB's
// stable radix sort (positions stay in order within an id), cut the sorted list into
// fixed chunks of 16 entries (more for huge shapes), sum each chunk's runs of equal ids
// in order, add whole runs straight into their d_table rows and combine the runs that
// cross chunk boundaries in chunk order (chunk_sums_kernel, finish_runs_kernel). Every
// d_table row has one writer and every sum a fixed order, so results are run-to-run
// bit-identical, and a very frequent id (padding, "the") is spread over many blocks.
// Floor: T * C * d_out bytes read + the touched table rows read and written, plus the
// sort (about 10-20 us for 16K ids).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <cub/device/device_radix_sort.cuh>

#include "cuda_check.h"
#include "embedding.h"
#include "index_error.h"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace {

using vec::kWidth;

constexpr int kThreads = 256;

// Threads across a row (a power of two in [32, 256]) and rows per 256-thread block.
dim3 row_block(int64_t units_per_row) {
  int tpr = 32;
  while (tpr < kThreads && tpr < units_per_row) tpr *= 2;
  return dim3(tpr, kThreads / tpr);
}

// ---- Forward -------------------------------------------------------------------------

template <typename Id, typename Chunk>
__global__ void gather_raw_kernel(const Id* ids, const Chunk* table, Chunk* out, int64_t tokens, int64_t vocab,
                                  int64_t chunks_per_row, uint4 nan_pattern, IndexErrorSink sink) {
  const int64_t t = blockIdx.x * int64_t(blockDim.y) + threadIdx.y;
  if (t >= tokens) return;
  const int64_t id = static_cast<int64_t>(ids[t]);
  Chunk* dst = out + t * chunks_per_row;
  if (id < 0 || id >= vocab) {
    if (threadIdx.x == 0) record_bad_index(sink, id, t);
    Chunk nan;
    memcpy(&nan, &nan_pattern, sizeof(Chunk));
    for (int64_t c = threadIdx.x; c < chunks_per_row; c += blockDim.x) dst[c] = nan;
    return;
  }
  const Chunk* src = table + id * chunks_per_row;
  for (int64_t c = threadIdx.x; c < chunks_per_row; c += blockDim.x) dst[c] = src[c];
}

template <typename Id, typename In, typename Out, int W>
__global__ void gather_convert_kernel(const Id* ids, const In* table, Out* out, int64_t tokens, int64_t vocab,
                                      int64_t channels, IndexErrorSink sink) {
  const int64_t t = blockIdx.x * int64_t(blockDim.y) + threadIdx.y;
  if (t >= tokens) return;
  const int64_t id = static_cast<int64_t>(ids[t]);
  Out* dst = out + t * channels;
  if (id < 0 || id >= vocab) {
    if (threadIdx.x == 0) record_bad_index(sink, id, t);
    for (int64_t c = threadIdx.x; c < channels; c += blockDim.x) vec::store(dst, c, NAN);
    return;
  }
  const In* src = table + id * channels;
  if constexpr (W == kWidth) {
    for (int64_t u = threadIdx.x; u < channels / kWidth; u += blockDim.x) {
      float v[kWidth];
      vec::load8(src + u * kWidth, v);
      vec::store8(dst + u * kWidth, v);
    }
  } else {
    for (int64_t c = threadIdx.x; c < channels; c += blockDim.x) vec::store(dst, c, vec::load(src, c));
  }
}

// 16 bytes of the dtype's quiet NaN, repeated: what a row of a bad id is filled with.
uint4 nan_pattern(DType t) {
  unsigned char bytes[16];
  const size_t es = dtype_size(t);
  unsigned char one[8] = {};
  switch (t) {
    case DType::F64: {
      const double v = NAN;
      std::memcpy(one, &v, 8);
      break;
    }
    case DType::F32: {
      const float v = NAN;
      std::memcpy(one, &v, 4);
      break;
    }
    case DType::F16: {
      const uint16_t v = float_to_fp16_bits(NAN);
      std::memcpy(one, &v, 2);
      break;
    }
    case DType::BF16: {
      const uint16_t v = float_to_bf16_bits(NAN);
      std::memcpy(one, &v, 2);
      break;
    }
    case DType::E4M3: one[0] = float_to_e4m3(NAN); break;
    case DType::E5M2: one[0] = float_to_e5m2(NAN); break;
    default: break;  // not a floating table: the front end rejects it
  }
  for (size_t i = 0; i < 16; ++i) bytes[i] = one[i % es];
  uint4 out;
  std::memcpy(&out, bytes, 16);
  return out;
}

template <typename Id>
void launch_gather_raw(cudaStream_t s, const Tensor& ids, const Tensor& table, Tensor& out, IndexErrorSink sink) {
  const int64_t tokens = ids.numel(), vocab = table.size(0);
  const size_t row_bytes = static_cast<size_t>(table.size(1)) * dtype_size(table.dtype());
  const uint4 nan = nan_pattern(table.dtype());
  auto fits = [&](size_t chunk) {
    return row_bytes % chunk == 0 && reinterpret_cast<uintptr_t>(table.raw_data()) % chunk == 0 &&
           reinterpret_cast<uintptr_t>(out.raw_data()) % chunk == 0;
  };
  auto launch = [&](auto* tag) {
    using Chunk = std::remove_pointer_t<decltype(tag)>;
    const int64_t chunks = static_cast<int64_t>(row_bytes / sizeof(Chunk));
    const dim3 block = row_block(chunks);
    const unsigned grid = static_cast<unsigned>((tokens + block.y - 1) / block.y);
    gather_raw_kernel<Id, Chunk><<<grid, block, 0, s>>>(ids.data<Id>(), static_cast<const Chunk*>(table.raw_data()),
                                                        static_cast<Chunk*>(out.raw_data()), tokens, vocab, chunks,
                                                        nan, sink);
  };
  if (fits(16)) launch(static_cast<uint4*>(nullptr));
  else if (fits(8)) launch(static_cast<uint2*>(nullptr));
  else if (fits(4)) launch(static_cast<uint32_t*>(nullptr));
  else if (fits(2)) launch(static_cast<uint16_t*>(nullptr));
  else launch(static_cast<uint8_t*>(nullptr));
}

template <typename Id>
void launch_gather_convert(cudaStream_t s, const Tensor& ids, const Tensor& table, Tensor& out, IndexErrorSink sink) {
  const int64_t tokens = ids.numel(), vocab = table.size(0), channels = table.size(1);
  const bool vectorised = channels % kWidth == 0 && vec::aligned16(table.raw_data()) && vec::aligned16(out.raw_data());
  vec::dispatch(table.dtype(), "embedding_forward", [&](auto* in_tag) {
    using In = std::remove_pointer_t<decltype(in_tag)>;
    vec::dispatch(out.dtype(), "embedding_forward", [&](auto* out_tag) {
      using Out = std::remove_pointer_t<decltype(out_tag)>;
      const dim3 block = row_block(vectorised ? channels / kWidth : channels);
      const unsigned grid = static_cast<unsigned>((tokens + block.y - 1) / block.y);
      if (vectorised)
        gather_convert_kernel<Id, In, Out, kWidth>
            <<<grid, block, 0, s>>>(ids.data<Id>(), table.data<In>(), out.data<Out>(), tokens, vocab, channels, sink);
      else
        gather_convert_kernel<Id, In, Out, 1>
            <<<grid, block, 0, s>>>(ids.data<Id>(), table.data<In>(), out.data<Out>(), tokens, vocab, channels, sink);
    });
  });
}

// ---- Backward ------------------------------------------------------------------------

// Sort keys: the id, or `vocab` for a bad id (sorted last and skipped).
template <typename Id>
__global__ void sort_keys_kernel(const Id* ids, uint32_t* keys, int32_t* positions, int64_t tokens, int64_t vocab,
                                 IndexErrorSink sink) {
  TESSERA_VEC_GRID_STRIDE(t, tokens) {
    const int64_t id = static_cast<int64_t>(ids[t]);
    const bool ok = id >= 0 && id < vocab;
    if (!ok) record_bad_index(sink, id, t);
    keys[t] = static_cast<uint32_t>(ok ? id : vocab);
    positions[t] = static_cast<int32_t>(t);
  }
}

// v = d_out[position, u*W .. u*W+W) in float
template <typename G, int W>
__device__ __forceinline__ void load_unit(const G* __restrict__ d_out, int64_t position, int64_t channels, int64_t u,
                                          float (&v)[W]) {
  const G* src = d_out + position * channels + u * W;
  if constexpr (W == kWidth) vec::load8(src, v);
  else v[0] = vec::load(src, 0);
}

template <typename D, int W>
__device__ __forceinline__ void add_to_row(D* __restrict__ row, int64_t u, const float (&acc)[W]) {
  if constexpr (W == kWidth) {
    float cur[kWidth];
    vec::load8(row + u * kWidth, cur);
#pragma unroll
    for (int w = 0; w < W; ++w) cur[w] += acc[w];
    vec::store8(row + u * kWidth, cur);
  } else {
    vec::store(row, u, vec::load(row, u) + acc[0]);
  }
}

// The sorted (id, position) list is cut into chunks of `chunk` entries, one block column
// per chunk, one thread per column unit (8 channels, or 1 on the scalar path). A thread
// walks its chunk in order, summing consecutive rows of one id (a "piece") in float.
// A piece that is a whole run of its id is added into d_table here. A piece whose run
// began in an earlier chunk is left in spill[chunk]; a piece whose run goes on into the
// next chunk (and began in this one) is left to finish_runs_kernel. So every d_table row
// has exactly one writer, and every sum has a fixed order.
template <typename G, typename D, int W>
__global__ void chunk_sums_kernel(const uint32_t* __restrict__ keys, const int32_t* __restrict__ positions,
                                  const G* __restrict__ d_out, D* __restrict__ d_table, float* __restrict__ spill,
                                  int64_t tokens, int64_t vocab, int64_t channels, int64_t chunk) {
  const int64_t units = channels / W;
  const int64_t u = blockIdx.y * int64_t(blockDim.x) + threadIdx.x;
  if (u >= units) return;
  const int64_t begin = blockIdx.x * chunk, end = min(tokens, begin + chunk);
  const uint32_t none = 0xffffffffu;  // never a key: keys are <= vocab < 2^31
  const uint32_t before = begin > 0 ? keys[begin - 1] : none, after = end < tokens ? keys[end] : none;
  float acc[W], cur[W];
#pragma unroll
  for (int w = 0; w < W; ++w) acc[w] = 0.0f;
  load_unit<G, W>(d_out, positions[begin], channels, u, cur);
  int64_t piece_start = begin;
  for (int64_t i = begin; i < end; ++i) {
    float next[W];
    if (i + 1 < end) load_unit<G, W>(d_out, positions[i + 1], channels, u, next);  // in flight while we add
#pragma unroll
    for (int w = 0; w < W; ++w) acc[w] += cur[w];
    const uint32_t k = keys[i];
    if (i + 1 == end || keys[i + 1] != k) {  // the piece ends here
      if (k < vocab) {
        const bool cut_before = piece_start == begin && before == k;
        const bool cut_after = i + 1 == end && after == k;
        if (cut_before) {
#pragma unroll
          for (int w = 0; w < W; ++w) spill[blockIdx.x * channels + u * W + w] = acc[w];
        } else if (!cut_after) {
          add_to_row<D, W>(d_table + static_cast<int64_t>(k) * channels, u, acc);
        }
      }
#pragma unroll
      for (int w = 0; w < W; ++w) acc[w] = 0.0f;
      piece_start = i + 1;
    }
#pragma unroll
    for (int w = 0; w < W; ++w) cur[w] = next[w];
  }
}

// Runs that cross chunk boundaries, finished by the chunk holding their first entry: its
// own piece (summed again from d_out, at most `chunk` rows), then the spilled pieces of
// the following chunks in chunk order, added into d_table.
template <typename G, typename D, int W>
__global__ void finish_runs_kernel(const uint32_t* __restrict__ keys, const int32_t* __restrict__ positions,
                                   const G* __restrict__ d_out, D* __restrict__ d_table,
                                   const float* __restrict__ spill, int64_t tokens, int64_t vocab, int64_t channels,
                                   int64_t chunk) {
  const int64_t units = channels / W;
  const int64_t u = blockIdx.y * int64_t(blockDim.x) + threadIdx.x;
  const int64_t begin = blockIdx.x * chunk, end = min(tokens, begin + chunk);
  if (u >= units || end >= tokens) return;
  const uint32_t k = keys[end - 1];
  if (k >= vocab || keys[end] != k) return;  // the last piece does not go on
  int64_t piece_start = end - 1;
  while (piece_start > begin && keys[piece_start - 1] == k) --piece_start;
  if (piece_start == begin && begin > 0 && keys[begin - 1] == k) return;  // an earlier chunk owns the run
  int64_t lo = end, hi = tokens;  // run end: the first index past `end` whose key differs
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] == k) lo = mid + 1;
    else hi = mid;
  }
  const int64_t last_chunk = (lo - 1) / chunk;
  float acc[W];
#pragma unroll
  for (int w = 0; w < W; ++w) acc[w] = 0.0f;
  for (int64_t i = piece_start; i < end; ++i) {
    float v[W];
    load_unit<G, W>(d_out, positions[i], channels, u, v);
#pragma unroll
    for (int w = 0; w < W; ++w) acc[w] += v[w];
  }
#pragma unroll 4
  for (int64_t c = blockIdx.x + 1; c <= last_chunk; ++c)
#pragma unroll
    for (int w = 0; w < W; ++w) acc[w] += spill[c * channels + u * W + w];
  add_to_row<D, W>(d_table + static_cast<int64_t>(k) * channels, u, acc);
}

int bits_for(int64_t max_key) {
  int bits = 1;
  while (bits < 32 && (int64_t(1) << bits) <= max_key) ++bits;
  return bits;
}

}  // namespace

bool embedding_forward_supported(const Tensor& table, const Tensor& out) {
  return table.dtype() == out.dtype() || (vec::is_f32_or_bf16(table.dtype()) && vec::is_f32_or_bf16(out.dtype()));
}

void embedding_forward(void* stream, const Tensor& ids, const Tensor& table, Tensor& out) {
  const int64_t tokens = ids.numel();
  if (tokens == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const IndexErrorSink sink = index_error_sink(out.device().index, IndexOp::EmbeddingForward, table.size(0));
  // Launched even for C = 0, so that the ids are still checked.
  if (table.dtype() == out.dtype()) {
    if (ids.dtype() == DType::I64) launch_gather_raw<int64_t>(s, ids, table, out, sink);
    else launch_gather_raw<int32_t>(s, ids, table, out, sink);
  } else {
    if (ids.dtype() == DType::I64) launch_gather_convert<int64_t>(s, ids, table, out, sink);
    else launch_gather_convert<int32_t>(s, ids, table, out, sink);
  }
  TESSERA_CUDA_CHECK_LAUNCH();
}

bool embedding_backward_supported(const Tensor& d_out, const Tensor& d_table) {
  return vec::is_f32_or_bf16(d_out.dtype()) && vec::is_f32_or_bf16(d_table.dtype());
}

void embedding_backward(void* stream, const Tensor& ids, const Tensor& d_out, Tensor& d_table) {
  const int64_t tokens = ids.numel(), vocab = d_table.size(0), channels = d_table.size(1);
  if (tokens == 0) return;
  TESSERA_CHECK(tokens <= 0x7fffffff && vocab < 0x7fffffff, "embedding_backward on CUDA: ", tokens, " ids and a ",
                vocab, "-row table exceed the 32-bit sort keys");
  auto s = static_cast<cudaStream_t>(stream);
  const IndexErrorSink sink = index_error_sink(d_table.device().index, IndexOp::EmbeddingBackward, vocab);
  const int n = static_cast<int>(tokens);
  const int end_bit = bits_for(vocab);  // the bad-id key `vocab` included
  // Chunk length: 16 entries, longer when the spill buffer (one float row per chunk) would
  // pass 64 MiB. A function of the shape alone, so the summation order is too.
  const int64_t chunk = std::max<int64_t>(16, (tokens * channels * 4 + (int64_t(64) << 20) - 1) / (int64_t(64) << 20));
  const int64_t chunks = (tokens + chunk - 1) / chunk;

  // One workspace: keys and positions, unsorted and sorted, the spill rows, CUB's scratch.
  size_t sort_bytes = 0;
  TESSERA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr),
                                                     static_cast<uint32_t*>(nullptr),
                                                     static_cast<const int32_t*>(nullptr),
                                                     static_cast<int32_t*>(nullptr), n, 0, end_bit, s));
  const int64_t stride = (tokens + 63) / 64 * 64;  // keeps each array 256-byte aligned
  const int64_t spill_floats = (chunks * channels + 63) / 64 * 64;
  Tensor work = Tensor::empty({static_cast<int64_t>(4 * stride * 4 + spill_floats * 4 + sort_bytes)}, DType::U8,
                              d_table.device());
  uint32_t* keys = static_cast<uint32_t*>(work.raw_data());
  int32_t* positions = reinterpret_cast<int32_t*>(keys + stride);
  uint32_t* sorted_keys = keys + 2 * stride;
  int32_t* sorted_positions = reinterpret_cast<int32_t*>(keys + 3 * stride);
  float* spill = reinterpret_cast<float*>(keys + 4 * stride);
  void* sort_scratch = spill + spill_floats;

  if (ids.dtype() == DType::I64)
    sort_keys_kernel<<<vec::blocks_for(tokens, kThreads), kThreads, 0, s>>>(ids.data<int64_t>(), keys, positions,
                                                                             tokens, vocab, sink);
  else
    sort_keys_kernel<<<vec::blocks_for(tokens, kThreads), kThreads, 0, s>>>(ids.data<int32_t>(), keys, positions,
                                                                             tokens, vocab, sink);
  TESSERA_CUDA_CHECK_LAUNCH();
  if (channels == 0) return;  // the ids are checked; nothing to add
  TESSERA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_scratch, sort_bytes, keys, sorted_keys, positions,
                                                     sorted_positions, n, 0, end_bit, s));

  const bool vectorised =
      channels % kWidth == 0 && vec::aligned16(d_out.raw_data()) && vec::aligned16(d_table.raw_data());
  const int64_t units = vectorised ? channels / kWidth : channels;
  int threads = 32;
  while (threads < 128 && threads < units) threads *= 2;
  const int64_t unit_tiles = (units + threads - 1) / threads;
  TESSERA_CHECK(chunks <= 0x7fffffff && unit_tiles <= 65535, "embedding_backward on CUDA: [", tokens, ", ", channels,
                "] exceeds one grid");
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(unit_tiles));
  vec::dispatch(d_out.dtype(), "embedding_backward", [&](auto* g_tag) {
    using G = std::remove_pointer_t<decltype(g_tag)>;
    vec::dispatch(d_table.dtype(), "embedding_backward", [&](auto* d_tag) {
      using D = std::remove_pointer_t<decltype(d_tag)>;
      auto launch = [&](auto width) {
        constexpr int W = decltype(width)::value;
        chunk_sums_kernel<G, D, W><<<grid, threads, 0, s>>>(sorted_keys, sorted_positions, d_out.data<G>(),
                                                            d_table.data<D>(), spill, tokens, vocab, channels, chunk);
        TESSERA_CUDA_CHECK_LAUNCH();
        finish_runs_kernel<G, D, W><<<grid, threads, 0, s>>>(sorted_keys, sorted_positions, d_out.data<G>(),
                                                             d_table.data<D>(), spill, tokens, vocab, channels, chunk);
        TESSERA_CUDA_CHECK_LAUNCH();
      };
      if (vectorised) launch(std::integral_constant<int, kWidth>{});
      else launch(std::integral_constant<int, 1>{});
    });
  });
}

}  // namespace tessera::cuda
