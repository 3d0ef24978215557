#include "tessera/core/dtype.h"

#include "tessera/core/error.h"

namespace tessera {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::E4M3: case DType::E5M2: case DType::E8M0: case DType::U8: return 1;
  }
  TESSERA_FAIL("dtype_size: unknown dtype code ", static_cast<int>(t));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F64: return "f64";
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::E4M3: return "e4m3";
    case DType::E5M2: return "e5m2";
    case DType::E8M0: return "e8m0";
    case DType::I64: return "i64";
    case DType::I32: return "i32";
    case DType::U8: return "u8";
  }
  return "unknown";
}

DType dtype_from_name(const std::string& name) {
  for (DType t : {DType::F64, DType::F32, DType::F16, DType::BF16, DType::E4M3, DType::E5M2, DType::E8M0,
                  DType::I64, DType::I32, DType::U8}) {
    if (name == dtype_name(t)) return t;
  }
  TESSERA_FAIL("unknown dtype '", name, "' (expected one of f64, f32, f16, bf16, e4m3, e5m2, e8m0, i64, i32, u8)");
}

bool is_floating(DType t) {
  return t == DType::F64 || t == DType::F32 || t == DType::F16 || t == DType::BF16 || is_fp8(t);
}
bool is_fp8(DType t) { return t == DType::E4M3 || t == DType::E5M2; }
bool is_integer(DType t) { return t == DType::I64 || t == DType::I32 || t == DType::U8; }

std::string Device::to_string() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

}  // namespace tessera
