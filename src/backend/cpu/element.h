// Reading and writing one element of any dtype as a double or float, for the CPU
// reference. Conversions go through numeric.h, so they round exactly like the CUDA side.
#pragma once

#include <cstdint>

#include "tessera/core/dtype.h"
#include "tessera/core/error.h"
#include "tessera/core/numeric.h"

namespace tessera::cpu {

inline double load_element(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::F64: return static_cast<const double*>(base)[i];
    case DType::F32: return static_cast<const float*>(base)[i];
    case DType::F16: return fp16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::BF16: return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::E4M3: return e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::E5M2: return e5m2_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::E8M0: return e8m0_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::I64: return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DType::I32: return static_cast<const int32_t*>(base)[i];
    case DType::U8: return static_cast<const uint8_t*>(base)[i];
  }
  TESSERA_FAIL("load_element: unknown dtype");
}

// Stores `v` rounded to nearest even in floating dtypes; integers truncate toward zero.
// E8M0 stores the power of two at or below v.
inline void store_element(void* base, DType t, int64_t i, double v) {
  switch (t) {
    case DType::F64: static_cast<double*>(base)[i] = v; return;
    case DType::F32: static_cast<float*>(base)[i] = static_cast<float>(v); return;
    case DType::F16: static_cast<uint16_t*>(base)[i] = float_to_fp16_bits(static_cast<float>(v)); return;
    case DType::BF16: static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(static_cast<float>(v)); return;
    case DType::E4M3: static_cast<uint8_t*>(base)[i] = float_to_e4m3(static_cast<float>(v)); return;
    case DType::E5M2: static_cast<uint8_t*>(base)[i] = float_to_e5m2(static_cast<float>(v)); return;
    case DType::E8M0: static_cast<uint8_t*>(base)[i] = float_to_e8m0_floor(static_cast<float>(v)); return;
    case DType::I64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); return;
    case DType::I32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); return;
    case DType::U8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); return;
  }
  TESSERA_FAIL("store_element: unknown dtype");
}

}  // namespace tessera::cpu
