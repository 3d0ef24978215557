// Elementwise kernels on the GPU: residual add, scale, GELU (tanh) and SwiGLU, forward and
// backward. Same formulas as the CPU reference (backend/cpu/{elementwise,activation}.cpp),
// computed in float; every operand F32, or every operand BF16. Also the 2-D transpose
// copy of any 1-, 2-, 4- or 8-byte dtype (see transpose_kernel).
//
// Layout: contiguous tensors; SwiGLU's input rows are [gate | up], each F wide. One thread
// per output element, grid-stride. These are memory-bound: the floor is bytes moved over
// ~4.1 TB/s; the vectorised (16-byte) versions and their measured fraction of that floor
// come with the fused-operator stage.
#include <cuda_runtime.h>

#include "cuda_backend.h"
#include "cuda_check.h"
#include "tessera/core/numeric.h"

namespace tessera::cuda {

namespace {

template <typename T>
struct Io;
template <>
struct Io<float> {
  __device__ static float load(const float* p, int64_t i) { return p[i]; }
  __device__ static void store(float* p, int64_t i, float v) { p[i] = v; }
};
template <>
struct Io<uint16_t> {  // BF16 bits
  __device__ static float load(const uint16_t* p, int64_t i) { return bf16_bits_to_float(p[i]); }
  __device__ static void store(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16_bits(v); }
};

#define TESSERA_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

__device__ float gelu(float x) {
  const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + tanhf(inner));
}
__device__ float gelu_grad(float x) {
  const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const float t = tanhf(inner);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
}
__device__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename T>
__global__ void add_kernel(const T* a, const T* b, T* out, int64_t n) {
  TESSERA_GRID_STRIDE(i, n) Io<T>::store(out, i, Io<T>::load(a, i) + Io<T>::load(b, i));
}
template <typename T>
__global__ void scale_kernel(const T* in, float alpha, T* out, int64_t n) {
  TESSERA_GRID_STRIDE(i, n) Io<T>::store(out, i, alpha * Io<T>::load(in, i));
}
template <typename T>
__global__ void gelu_forward_kernel(const T* x, T* y, int64_t n) {
  TESSERA_GRID_STRIDE(i, n) Io<T>::store(y, i, gelu(Io<T>::load(x, i)));
}
template <typename T>
__global__ void gelu_backward_kernel(const T* x, const T* dy, T* dx, int64_t n) {
  TESSERA_GRID_STRIDE(i, n) Io<T>::store(dx, i, Io<T>::load(dy, i) * gelu_grad(Io<T>::load(x, i)));
}
template <typename T>
__global__ void swiglu_forward_kernel(const T* x, T* y, int64_t rows, int64_t f) {
  TESSERA_GRID_STRIDE(i, rows * f) {
    const int64_t r = i / f, c = i % f;
    const float g = Io<T>::load(x, r * 2 * f + c), u = Io<T>::load(x, r * 2 * f + f + c);
    Io<T>::store(y, i, g * sigmoid(g) * u);
  }
}
template <typename T>
__global__ void swiglu_backward_kernel(const T* x, const T* dy, T* dx, int64_t rows, int64_t f) {
  TESSERA_GRID_STRIDE(i, rows * f) {
    const int64_t r = i / f, c = i % f;
    const float g = Io<T>::load(x, r * 2 * f + c), u = Io<T>::load(x, r * 2 * f + f + c);
    const float s = sigmoid(g), d = Io<T>::load(dy, i);
    Io<T>::store(dx, r * 2 * f + c, d * u * s * (1.0f + g * (1.0f - s)));
    Io<T>::store(dx, r * 2 * f + f + c, d * g * s);
  }
}

dim3 grid_for(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return dim3(static_cast<unsigned>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535));
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

// Runs fn with a typed null pointer selecting the storage type of `t` (F32 or BF16).
template <typename Fn>
void dispatch_storage(const Tensor& t, const char* op, Fn&& fn) {
  if (t.dtype() == DType::F32) fn(static_cast<float*>(nullptr));
  else if (t.dtype() == DType::BF16) fn(static_cast<uint16_t*>(nullptr));
  else TESSERA_FAIL(op, " on CUDA: dtype ", dtype_name(t.dtype()), " has no kernel (F32, BF16)");
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
  dispatch_storage(out, "add", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    add_kernel<T><<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(a.data<T>(), b.data<T>(), out.data<T>(), n);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void scale(void* stream, const Tensor& in, float alpha, Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  dispatch_storage(out, "scale", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    scale_kernel<T><<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(in.data<T>(), alpha, out.data<T>(), n);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void gelu_forward(void* stream, const Tensor& x, Tensor& y) {
  const int64_t n = y.numel();
  if (n == 0) return;
  dispatch_storage(y, "gelu_forward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    gelu_forward_kernel<T><<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(x.data<T>(), y.data<T>(), n);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void gelu_backward(void* stream, const Tensor& x, const Tensor& dy, Tensor& dx) {
  const int64_t n = dx.numel();
  if (n == 0) return;
  dispatch_storage(dx, "gelu_backward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    gelu_backward_kernel<T><<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(x.data<T>(), dy.data<T>(),
                                                                                          dx.data<T>(), n);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void swiglu_forward(void* stream, const Tensor& x, Tensor& y) {
  const int64_t f = y.size(-1), rows = f ? y.numel() / f : 0;
  if (rows * f == 0) return;
  dispatch_storage(y, "swiglu_forward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_forward_kernel<T><<<grid_for(rows * f), 256, 0, static_cast<cudaStream_t>(stream)>>>(x.data<T>(), y.data<T>(),
                                                                                                 rows, f);
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

void swiglu_backward(void* stream, const Tensor& x, const Tensor& dy, Tensor& dx) {
  const int64_t f = dy.size(-1), rows = f ? dy.numel() / f : 0;
  if (rows * f == 0) return;
  dispatch_storage(dx, "swiglu_backward", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_backward_kernel<T><<<grid_for(rows * f), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        x.data<T>(), dy.data<T>(), dx.data<T>(), rows, f);
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
      transpose_kernel<<<blocks, block, 0, s>>>(in.data<uint8_t>(), out.data<uint8_t>(), rows, cols);
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
