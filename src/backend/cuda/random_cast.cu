// Philox random fills and dtype casts on the GPU.
//
// Both use the very header code of the CPU reference (philox.h, numeric.h), so element
// i gets the same bits on either backend. Layout: contiguous tensors, one thread per
// element (grid-stride). Memory-bound; the fills run at set-up time, not in the step.
//
// Casts follow the CPU's cast (backend/cpu/elementwise.cpp), which reads every element as
// a double and stores it with store_element: floating outputs round to nearest even
// through float (FP16/BF16 overflow to inf, FP8 saturates to its largest finite value,
// NaN stays NaN: numeric.h), integer outputs truncate toward zero. Equal dtypes are a
// byte copy. Sources that float holds exactly (F32, F16, BF16, FP8, E8M0, U8) are read as
// float, which gives the same result as the CPU's double; F64, I64 and I32 sources go
// through double, so large integers and F64 -> I64 keep the CPU's exact values. Out-of-
// range float -> integer conversions are undefined in C++ and may differ from the CPU.
// F32 <-> BF16, the cast of every training step (master weights to the compute copy),
// moves 8 elements per thread as 16-byte vectors: floor (4 + 2) B/element / 4.1 TB/s.
#include <cuda_runtime.h>

#include "cuda_backend.h"
#include "cuda_check.h"
#include "tessera/core/numeric.h"
#include "tessera/core/philox.h"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace {

__device__ float load_as_float(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::F64: return static_cast<float>(static_cast<const double*>(base)[i]);
    case DType::F32: return static_cast<const float*>(base)[i];
    case DType::F16: return fp16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::BF16: return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::E4M3: return e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::E5M2: return e5m2_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::E8M0: return e8m0_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::I64: return static_cast<float>(static_cast<const int64_t*>(base)[i]);
    case DType::I32: return static_cast<float>(static_cast<const int32_t*>(base)[i]);
    case DType::U8: return static_cast<const uint8_t*>(base)[i];
  }
  return 0.0f;
}

__device__ void store_from_float(void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::F64: static_cast<double*>(base)[i] = v; return;
    case DType::F32: static_cast<float*>(base)[i] = v; return;
    case DType::F16: static_cast<uint16_t*>(base)[i] = float_to_fp16_bits(v); return;
    case DType::BF16: static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(v); return;
    case DType::E4M3: static_cast<uint8_t*>(base)[i] = float_to_e4m3(v); return;
    case DType::E5M2: static_cast<uint8_t*>(base)[i] = float_to_e5m2(v); return;
    case DType::E8M0: static_cast<uint8_t*>(base)[i] = float_to_e8m0_floor(v); return;
    case DType::I64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); return;
    case DType::I32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); return;
    case DType::U8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); return;
  }
}

__global__ void fill_uniform_kernel(void* out, DType t, int64_t n, float low, float high, uint64_t seed,
                                    uint64_t offset) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float u = uniform_from_word(philox_word(seed, offset, static_cast<uint64_t>(i)));
    store_from_float(out, t, i, low + (high - low) * u);
  }
}

__global__ void fill_normal_kernel(void* out, DType t, int64_t n, float mean, float std, uint64_t seed,
                                   uint64_t offset) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t w = 2 * static_cast<uint64_t>(i);
    store_from_float(out, t, i, mean + std * normal_from_words(philox_word(seed, offset, w), philox_word(seed, offset, w + 1)));
  }
}

__device__ double load_as_double(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::F64: return static_cast<const double*>(base)[i];
    case DType::I64: return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DType::I32: return static_cast<const int32_t*>(base)[i];
    default: return load_as_float(base, t, i);
  }
}

// The CPU's store_element: doubles go to non-F64 floating dtypes through float.
__device__ void store_from_double(void* base, DType t, int64_t i, double v) {
  switch (t) {
    case DType::F64: static_cast<double*>(base)[i] = v; return;
    case DType::I64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); return;
    case DType::I32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); return;
    case DType::U8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); return;
    default: store_from_float(base, t, i, static_cast<float>(v)); return;
  }
}

// Float-exact sources: a float read then the float store is what the CPU's double gives
// (an exact float widened to double and narrowed back; integer outputs truncate alike).
__global__ void cast_via_float_kernel(const void* in, DType in_t, void* out, DType out_t, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_from_float(out, out_t, i, load_as_float(in, in_t, i));
}

__global__ void cast_via_double_kernel(const void* in, DType in_t, void* out, DType out_t, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_from_double(out, out_t, i, load_as_double(in, in_t, i));
}

// F32 <-> BF16 with 8-element vectors; the scalar tail starts at `done`.
template <typename In, typename Out>
__global__ void cast_f32_bf16_kernel(const In* in, Out* out, int64_t n) {
  const int64_t vectors = n / vec::kWidth;
  TESSERA_VEC_GRID_STRIDE(u, vectors) {
    float v[vec::kWidth];
    vec::load8(in + u * vec::kWidth, v);
    vec::store8(out + u * vec::kWidth, v);
  }
  const int64_t done = vectors * vec::kWidth;
  TESSERA_VEC_GRID_STRIDE(j, n - done) vec::store(out, done + j, vec::load(in, done + j));
}

bool float_exact(DType t) { return t != DType::F64 && t != DType::I64 && t != DType::I32; }

dim3 grid_for(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return dim3(static_cast<unsigned>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535));
}

}  // namespace

void fill_uniform(void* stream, Tensor& out, float low, float high, uint64_t seed, uint64_t offset) {
  if (out.numel() == 0) return;
  fill_uniform_kernel<<<grid_for(out.numel()), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      out.raw_data(), out.dtype(), out.numel(), low, high, seed, offset);
  TESSERA_CUDA_CHECK_LAUNCH();
}

void fill_normal(void* stream, Tensor& out, float mean, float std, uint64_t seed, uint64_t offset) {
  if (out.numel() == 0) return;
  fill_normal_kernel<<<grid_for(out.numel()), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      out.raw_data(), out.dtype(), out.numel(), mean, std, seed, offset);
  TESSERA_CUDA_CHECK_LAUNCH();
}

void cast(void* stream, const Tensor& in, Tensor& out) {
  const int64_t n = in.numel();
  if (n == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const DType it = in.dtype(), ot = out.dtype();
  if (it == ot) {
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(out.raw_data(), in.raw_data(), out.nbytes(), cudaMemcpyDeviceToDevice, s));
    return;
  }
  const bool f32_bf16 = (it == DType::F32 && ot == DType::BF16) || (it == DType::BF16 && ot == DType::F32);
  if (f32_bf16 && vec::aligned16(in.raw_data()) && vec::aligned16(out.raw_data())) {
    const unsigned blocks = vec::blocks_for((n + vec::kWidth - 1) / vec::kWidth, 256);
    if (it == DType::F32)
      cast_f32_bf16_kernel<<<blocks, 256, 0, s>>>(in.data<float>(), out.data<bf16>(), n);
    else
      cast_f32_bf16_kernel<<<blocks, 256, 0, s>>>(in.data<bf16>(), out.data<float>(), n);
  } else if (float_exact(it)) {
    cast_via_float_kernel<<<grid_for(n), 256, 0, s>>>(in.raw_data(), it, out.raw_data(), ot, n);
  } else {
    cast_via_double_kernel<<<grid_for(n), 256, 0, s>>>(in.raw_data(), it, out.raw_data(), ot, n);
  }
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
