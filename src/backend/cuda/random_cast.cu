// Philox random fills and dtype casts on the GPU.
//
// Both use the very header code of the CPU reference (philox.h, numeric.h), so element
// i gets the same bits on either backend. Layout: contiguous tensors, one thread per
// element (grid-stride). Memory-bound; these run at set-up time, not in the step, so they
// are written for clarity rather than the last byte per second.
#include <cuda_runtime.h>

#include "cuda_backend.h"
#include "cuda_check.h"
#include "tessera/core/numeric.h"
#include "tessera/core/philox.h"

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

// F64 <-> F64 and integer casts keep full precision by going through double.
__global__ void cast_kernel(const void* in, DType in_t, void* out, DType out_t, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (in_t == DType::F64 && out_t == DType::F64) {
      static_cast<double*>(out)[i] = static_cast<const double*>(in)[i];
    } else if (in_t == DType::F64 && (out_t == DType::I64 || out_t == DType::I32)) {
      const double v = static_cast<const double*>(in)[i];
      if (out_t == DType::I64) static_cast<int64_t*>(out)[i] = static_cast<int64_t>(v);
      else static_cast<int32_t*>(out)[i] = static_cast<int32_t>(v);
    } else if (in_t == DType::I64 && out_t == DType::F64) {
      static_cast<double*>(out)[i] = static_cast<double>(static_cast<const int64_t*>(in)[i]);
    } else {
      store_from_float(out, out_t, i, load_as_float(in, in_t, i));
    }
  }
}

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
  if (in.numel() == 0) return;
  cast_kernel<<<grid_for(in.numel()), 256, 0, static_cast<cudaStream_t>(stream)>>>(in.raw_data(), in.dtype(),
                                                                                    out.raw_data(), out.dtype(),
                                                                                    in.numel());
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
