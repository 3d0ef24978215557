// Elementwise kernels on the GPU: residual add, scale, GELU (tanh) and SwiGLU, forward and
// backward, with the formulas of the CPU reference (backend/cpu/{elementwise,activation}.cpp)
// computed in float; every operand F32, or every operand BF16. Also the 2-D transpose copy
// of any 1-, 2-, 4- or 8-byte dtype (see transpose_kernel).
//
// Layout: contiguous tensors; SwiGLU's input rows are [gate | up], each F wide. Each thread
// moves 8-element vectors (one 16-byte access per BF16 operand, two per F32 one) when every
// pointer is 16-byte aligned (and, for SwiGLU, F % 8 == 0); otherwise one element at a time.
// SwiGLU's row index comes from a 32-bit division when the vector count allows (a 64-bit one
// per element cost more than the memory time).
//
// BF16 GELU and SwiGLU use the hardware exponential (__expf, a few ulp of float) and write
// GELU as x * sigmoid(2u), which is 0.5 x (1 + tanh u) rewritten: float-accurate to ~1e-6,
// far below BF16's rounding (4e-3), and short enough that the kernels stay memory-bound.
// F32 keeps the reference's tanhf / expf formulas (tests hold it to 1e-6).
//
// Floor: bytes moved / ~4.1 TB/s (bench_bandwidth: add 3, scale and GELU forward 2, GELU
// backward 3, SwiGLU forward 3, SwiGLU backward 5 activations). Measured on the H200 at
// 16384 x 4096 BF16 against cudaMemcpy D2D (3.8 TB/s) in the same run, before -> after the
// vector paths: add 60 -> 108%, scale 46 -> 99%, GELU forward 41 -> 85%, backward 53 -> 96%,
// SwiGLU forward 41 -> 108%, backward 48 -> 110% (over 100%: more reads than writes, which
// DRAM serves better than a copy's half-and-half). SwiGLU backward with y (the forward's
// output written again, for nn::MLP's recomputation) moves 6 activations; not timed apart.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda_backend.h"
#include "cuda_check.h"
#include "tessera/core/numeric.h"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace {

using vec::kWidth;

constexpr int kThreads = 256;

template <typename T>
constexpr bool kIsBf16 = std::is_same_v<T, bf16>;

constexpr float kSqrt2OverPi = 0.7978845608028654f, kCubic = 0.044715f;

// GELU and its derivative. T selects the formula: the reference's for F32, the sigmoid form
// with fast intrinsics for BF16 (see the top of the file).
template <typename T>
__device__ __forceinline__ float gelu(float x) {
  const float inner = kSqrt2OverPi * (x + kCubic * x * x * x);
  if constexpr (kIsBf16<T>) return __fdividef(x, 1.0f + __expf(-2.0f * inner));
  else return 0.5f * x * (1.0f + tanhf(inner));
}

template <typename T>
__device__ __forceinline__ float gelu_grad(float x) {
  const float inner = kSqrt2OverPi * (x + kCubic * x * x * x);
  if constexpr (kIsBf16<T>) {
    // 0.5 (1 + t) = s and 0.5 (1 - t^2) = 2 s (1 - s), with s = sigmoid(2u), t = tanh(u).
    const float s = __fdividef(1.0f, 1.0f + __expf(-2.0f * inner));
    const float h = s * (1.0f - s);
    if (h == 0.0f) return s;  // the tails, where x^2 may overflow (as the reference guards)
    return s + 2.0f * x * h * kSqrt2OverPi * (1.0f + 3.0f * kCubic * x * x);
  } else {
    const float t = tanhf(inner);
    const float sech2 = 1.0f - t * t;
    if (sech2 == 0.0f) return 0.5f * (1.0f + t);
    return 0.5f * (1.0f + t) + 0.5f * x * sech2 * kSqrt2OverPi * (1.0f + 3.0f * kCubic * x * x);
  }
}

template <typename T>
__device__ __forceinline__ float sigmoid(float g) {
  if constexpr (kIsBf16<T>) return __fdividef(1.0f, 1.0f + __expf(-g));
  else return 1.0f / (1.0f + expf(-g));
}

// ---- Flat maps: out[i] = f(in_0[i], ..., in_{K-1}[i]) --------------------------------------

template <typename T, int K>
struct Inputs {
  const T* p[K];
};

template <typename T, int K, typename F>
__device__ __forceinline__ float apply(const F& f, const float (&v)[K]) {
  if constexpr (K == 1) return f(v[0]);
  else return f(v[0], v[1]);
}

// kVec: 8-element vectors (every pointer 16-byte aligned); the n % 8 tail goes element-wise.
template <typename T, int K, bool kVec, typename F>
__global__ void __launch_bounds__(kThreads) map_kernel(Inputs<T, K> in, T* __restrict__ out, int64_t n, F f) {
  int64_t done = 0;
  if constexpr (kVec) {
    const int64_t vectors = n / kWidth;
    TESSERA_VEC_GRID_STRIDE(u, vectors) {
      float v[K][kWidth], r[kWidth];
#pragma unroll
      for (int k = 0; k < K; ++k) vec::load8(in.p[k] + u * kWidth, v[k]);
#pragma unroll
      for (int e = 0; e < kWidth; ++e) {
        float a[K];
#pragma unroll
        for (int k = 0; k < K; ++k) a[k] = v[k][e];
        r[e] = apply<T, K>(f, a);
      }
      vec::store8(out + u * kWidth, r);
    }
    done = vectors * kWidth;
  }
  TESSERA_VEC_GRID_STRIDE(j, n - done) {
    const int64_t i = done + j;
    float a[K];
#pragma unroll
    for (int k = 0; k < K; ++k) a[k] = vec::load(in.p[k], i);
    vec::store(out, i, apply<T, K>(f, a));
  }
}

struct AddOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct ScaleOp {
  float alpha;
  __device__ float operator()(float a) const { return alpha * a; }
};
template <typename T>
struct GeluOp {
  __device__ float operator()(float x) const { return gelu<T>(x); }
};
template <typename T>
struct GeluGradOp {
  __device__ float operator()(float x, float d) const { return d * gelu_grad<T>(x); }
};

// Enough blocks that each thread has about one vector (or element); grid-stride beyond 2^20.
unsigned grid_for(int64_t work) { return vec::blocks_for(work, kThreads, int64_t(1) << 20); }

template <typename T, int K, typename F>
void launch_map(cudaStream_t s, Inputs<T, K> in, T* out, int64_t n, F f) {
  bool aligned = vec::aligned16(out);
  for (int k = 0; k < K; ++k) aligned = aligned && vec::aligned16(in.p[k]);
  if (aligned && n >= kWidth) map_kernel<T, K, true><<<grid_for(n / kWidth), kThreads, 0, s>>>(in, out, n, f);
  else map_kernel<T, K, false><<<grid_for(n), kThreads, 0, s>>>(in, out, n, f);
}

// ---- SwiGLU: x [rows, 2F] -> y [rows, F] --------------------------------------------------

// Row and column of unit u of a [rows, per_row] grid; 32-bit division when the count fits.
__device__ __forceinline__ void split_index(int64_t u, int64_t per_row, bool narrow, int64_t& r, int64_t& c) {
  if (narrow) {
    const uint32_t q = uint32_t(u) / uint32_t(per_row);
    r = q;
    c = int64_t(uint32_t(u) - q * uint32_t(per_row));
  } else {
    r = u / per_row;
    c = u - r * per_row;
  }
}

// kVec: units are 8-element vectors (F % 8 == 0, pointers aligned), else single elements.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t f) {
  constexpr int V = kVec ? kWidth : 1;
  const int64_t per_row = f / V, units = rows * per_row;
  const bool narrow = units <= 0xffffffffLL;
  TESSERA_VEC_GRID_STRIDE(u, units) {
    int64_t r, c;
    split_index(u, per_row, narrow, r, c);
    const T* gate = x + r * 2 * f + c * V;
    float g[V], up[V], out[V];
    if constexpr (kVec) {
      vec::load8(gate, g);
      vec::load8(gate + f, up);
    } else {
      g[0] = vec::load(gate, 0);
      up[0] = vec::load(gate, f);
    }
#pragma unroll
    for (int e = 0; e < V; ++e) out[e] = g[e] * sigmoid<T>(g[e]) * up[e];
    if constexpr (kVec) vec::store8(y + u * V, out);
    else vec::store(y, u, out[0]);
  }
}

// dx may be x: each unit's gate and up are read before they are written, by the same thread.
// y (nullable): the forward's output recomputed in the same pass, with swiglu_forward_kernel's
// expression (same bits), for an MLP that did not keep it.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const T* x, const T* __restrict__ dy, T* dx, T* __restrict__ y, int64_t rows, int64_t f) {
  constexpr int V = kVec ? kWidth : 1;
  const int64_t per_row = f / V, units = rows * per_row;
  const bool narrow = units <= 0xffffffffLL;
  TESSERA_VEC_GRID_STRIDE(u, units) {
    int64_t r, c;
    split_index(u, per_row, narrow, r, c);
    const int64_t at = r * 2 * f + c * V;
    float g[V], up[V], d[V], dg[V], du[V], out[V];
    if constexpr (kVec) {
      vec::load8(x + at, g);
      vec::load8(x + at + f, up);
      vec::load8(dy + u * V, d);
    } else {
      g[0] = vec::load(x, at);
      up[0] = vec::load(x, at + f);
      d[0] = vec::load(dy, u);
    }
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float s = sigmoid<T>(g[e]);
      dg[e] = d[e] * up[e] * s * (1.0f + g[e] * (1.0f - s));
      du[e] = d[e] * g[e] * s;
      out[e] = g[e] * s * up[e];
    }
    if constexpr (kVec) {
      vec::store8(dx + at, dg);
      vec::store8(dx + at + f, du);
      if (y) vec::store8(y + u * V, out);
    } else {
      vec::store(dx, at, dg[0]);
      vec::store(dx, at + f, du[0]);
      if (y) vec::store(y, u, out[0]);
    }
  }
}

template <typename T, typename Launch>
void launch_swiglu(const T* x, const T* dy, const T* out, int64_t rows, int64_t f, Launch&& launch,
                   const T* out2 = nullptr) {
  const bool vectorised = f % kWidth == 0 && vec::aligned16(x) && vec::aligned16(out) && (!dy || vec::aligned16(dy)) &&
                          (!out2 || vec::aligned16(out2));
  if (vectorised) launch(std::true_type{}, grid_for(rows * (f / kWidth)));
  else launch(std::false_type{}, grid_for(rows * f));
}

// out[j, i] = in[i, j] as raw bits. A 32 x 8 block moves one 32 x 32 tile at a time through
// shared memory (padded a column against bank conflicts), so both the reads of `in` and
// the writes of `out` run along rows: a warp touches 32 consecutive elements of each.
// Tiles are numbered row-major over the tile grid and strided over the blocks, so any
// shape fits one launch. Floor: 2 * numel * bytes / 4.1 TB/s; 1- and 2-byte elements move
// 32 or 64 bytes per warp access and stay below it.
constexpr int kTile = 32, kTileRows = 8;

template <typename T>
__global__ void transpose_kernel(const T* in, T* out, int64_t rows, int64_t cols) {
  __shared__ T tile[kTile][kTile + 1];
  const int64_t row_tiles = (rows + kTile - 1) / kTile, col_tiles = (cols + kTile - 1) / kTile;
  for (int64_t t = blockIdx.x; t < row_tiles * col_tiles; t += gridDim.x) {
    const int64_t r0 = (t / col_tiles) * kTile, c0 = (t % col_tiles) * kTile;
    for (int k = threadIdx.y; k < kTile; k += kTileRows) {
      const int64_t r = r0 + k, c = c0 + threadIdx.x;
      if (r < rows && c < cols) tile[k][threadIdx.x] = in[r * cols + c];
    }
    __syncthreads();
    for (int k = threadIdx.y; k < kTile; k += kTileRows) {
      const int64_t out_row = c0 + k, out_col = r0 + threadIdx.x;  // out is [cols, rows]
      if (out_row < cols && out_col < rows) out[out_row * rows + out_col] = tile[threadIdx.x][k];
    }
    __syncthreads();  // the tile is refilled by the next iteration
  }
}


// The FP8 linears transpose 1-byte codes (a norm's FP8 output for the weight-gradient GEMM),
// where the 32 x 32 element tile above moves only 32 bytes per warp access and ran at a fifth
// of the bandwidth. This one moves a 64 x 64 byte tile with 16-byte accesses: 256 threads each
// load one 16-byte piece (four threads cover a 64-byte row run), the tile sits in shared memory
// as words with rows padded to 17 words (the column reads below then hit distinct banks), and
// each thread gathers the 16 bytes of one output row piece (16 source rows, one column) and
// stores them as one 16-byte word; four threads again cover a 64-byte run of the output row.
// Needs rows and cols multiples of 16 and 16-byte aligned pointers (transpose_2d checks).
constexpr int kByteTile = 64, kByteTileWords = kByteTile / 4 + 1;

__global__ void __launch_bounds__(256) transpose_bytes_kernel(const uint8_t* in, uint8_t* out, int64_t rows,
                                                              int64_t cols) {
  __shared__ uint32_t tile[kByteTile][kByteTileWords];
  const int64_t row_tiles = (rows + kByteTile - 1) / kByteTile, col_tiles = (cols + kByteTile - 1) / kByteTile;
  const int load_row = threadIdx.x / 4, load_piece = threadIdx.x % 4;
  // Output piece of this thread: output row (source column) j of the tile, source rows 16q..16q+15.
  const int q = threadIdx.x % 4, j = threadIdx.x / 4;
  for (int64_t t = blockIdx.x; t < row_tiles * col_tiles; t += gridDim.x) {
    const int64_t r0 = (t / col_tiles) * kByteTile, c0 = (t % col_tiles) * kByteTile;
    {
      const int64_t r = r0 + load_row, c = c0 + 16 * load_piece;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < rows && c < cols) v = *reinterpret_cast<const uint4*>(in + r * cols + c);
      uint32_t* dst = &tile[load_row][4 * load_piece];
      dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
    }
    __syncthreads();
    const int64_t out_row = c0 + j, out_col = r0 + 16 * q;
    if (out_row < cols && out_col < rows) {
      const int word = j / 4, shift = 8 * (j % 4);
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        uint32_t packed = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) packed |= ((tile[16 * q + 4 * k + b][word] >> shift) & 0xffu) << (8 * b);
        w[k] = packed;
      }
      *reinterpret_cast<uint4*>(out + out_row * rows + out_col) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    __syncthreads();  // the tile is refilled by the next iteration
  }
}

}  // namespace

bool elementwise_supported(std::initializer_list<const Tensor*> tensors) {
  const DType first = (*tensors.begin())->dtype();
  if (first != DType::F32 && first != DType::BF16) return false;
  for (const Tensor* t : tensors)
    if (t->dtype() != first) return false;
  return true;
}

void add(void* stream, const Tensor& a, const Tensor& b, Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  vec::dispatch(out.dtype(), "add", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_map<T, 2>(static_cast<cudaStream_t>(stream), {{a.data<T>(), b.data<T>()}}, out.data<T>(), n, AddOp{});
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void scale(void* stream, const Tensor& in, float alpha, Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  vec::dispatch(out.dtype(), "scale", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_map<T, 1>(static_cast<cudaStream_t>(stream), {{in.data<T>()}}, out.data<T>(), n, ScaleOp{alpha});
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void gelu_forward(void* stream, const Tensor& x, Tensor& y) {
  const int64_t n = y.numel();
  if (n == 0) return;
  vec::dispatch(y.dtype(), "gelu_forward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_map<T, 1>(static_cast<cudaStream_t>(stream), {{x.data<T>()}}, y.data<T>(), n, GeluOp<T>{});
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void gelu_backward(void* stream, const Tensor& x, const Tensor& dy, Tensor& dx) {
  const int64_t n = dx.numel();
  if (n == 0) return;
  vec::dispatch(dx.dtype(), "gelu_backward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_map<T, 2>(static_cast<cudaStream_t>(stream), {{x.data<T>(), dy.data<T>()}}, dx.data<T>(), n,
                     GeluGradOp<T>{});
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void swiglu_forward(void* stream, const Tensor& x, Tensor& y) {
  const int64_t f = y.size(-1), rows = f ? y.numel() / f : 0;
  if (rows * f == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  vec::dispatch(y.dtype(), "swiglu_forward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_swiglu<T>(x.data<T>(), nullptr, y.data<T>(), rows, f, [&](auto vec_tag, unsigned grid) {
      swiglu_forward_kernel<T, decltype(vec_tag)::value><<<grid, kThreads, 0, s>>>(x.data<T>(), y.data<T>(), rows, f);
    });
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void swiglu_backward(void* stream, const Tensor& x, const Tensor& dy, Tensor& dx, Tensor* y) {
  const int64_t f = dy.size(-1), rows = f ? dy.numel() / f : 0;
  if (rows * f == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  vec::dispatch(dx.dtype(), "swiglu_backward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* yp = y ? y->data<T>() : nullptr;
    launch_swiglu<T>(
        x.data<T>(), dy.data<T>(), dx.data<T>(), rows, f,
        [&](auto vec_tag, unsigned grid) {
          swiglu_backward_kernel<T, decltype(vec_tag)::value>
              <<<grid, kThreads, 0, s>>>(x.data<T>(), dy.data<T>(), dx.data<T>(), yp, rows, f);
        },
        yp);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

bool transpose_2d_supported(const Tensor& in) {
  const size_t es = dtype_size(in.dtype());
  return es == 1 || es == 2 || es == 4 || es == 8;
}

void transpose_2d(void* stream, const Tensor& in, Tensor& out) {
  const int64_t rows = in.size(0), cols = in.size(1);
  if (rows == 0 || cols == 0) return;
  const int64_t tiles = ((rows + kTile - 1) / kTile) * ((cols + kTile - 1) / kTile);
  const unsigned blocks = static_cast<unsigned>(tiles < (1 << 20) ? tiles : (1 << 20));
  const dim3 block(kTile, kTileRows);
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype_size(in.dtype())) {
    case 1:
      if (rows % 16 == 0 && cols % 16 == 0 && reinterpret_cast<uintptr_t>(in.raw_data()) % 16 == 0 &&
          reinterpret_cast<uintptr_t>(out.raw_data()) % 16 == 0) {
        const int64_t byte_tiles = ((rows + kByteTile - 1) / kByteTile) * ((cols + kByteTile - 1) / kByteTile);
        transpose_bytes_kernel<<<unsigned(std::min<int64_t>(byte_tiles, 1 << 20)), 256, 0, s>>>(
            in.data<uint8_t>(), out.data<uint8_t>(), rows, cols);
      } else {
        transpose_kernel<<<blocks, block, 0, s>>>(in.data<uint8_t>(), out.data<uint8_t>(), rows, cols);
      }
      break;
    case 2:
      transpose_kernel<<<blocks, block, 0, s>>>(in.data<uint16_t>(), out.data<uint16_t>(), rows, cols);
      break;
    case 4:
      transpose_kernel<<<blocks, block, 0, s>>>(in.data<uint32_t>(), out.data<uint32_t>(), rows, cols);
      break;
    case 8:
      transpose_kernel<<<blocks, block, 0, s>>>(in.data<uint64_t>(), out.data<uint64_t>(), rows, cols);
      break;
    default: TESSERA_FAIL("transpose_2d on CUDA: no kernel for ", dtype_name(in.dtype()));
  }
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
