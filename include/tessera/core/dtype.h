// Element types and devices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tessera {

enum class DType : uint8_t {
  F64,
  F32,
  F16,
  BF16,
  E4M3,  // FP8, finite only, max 448 ("e4m3fn")
  E5M2,  // FP8, IEEE-like, max finite 57344
  E8M0,  // unsigned power-of-two scale (MXFP8 block scales)
  I64,
  I32,
  U8,
};

size_t dtype_size(DType t);
const char* dtype_name(DType t);
DType dtype_from_name(const std::string& name);  // throws Error on an unknown name
bool is_floating(DType t);   // F64..E5M2: values a kernel computes with
bool is_fp8(DType t);        // E4M3 or E5M2
bool is_integer(DType t);    // I64, I32, U8

enum class DeviceKind : uint8_t { CPU, CUDA };

struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;

  static Device cpu() { return {DeviceKind::CPU, 0}; }
  static Device cuda(int index = 0) { return {DeviceKind::CUDA, index}; }
  bool is_cpu() const { return kind == DeviceKind::CPU; }
  bool is_cuda() const { return kind == DeviceKind::CUDA; }
  bool operator==(const Device& o) const { return kind == o.kind && (kind == DeviceKind::CPU || index == o.index); }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string to_string() const;
};

}  // namespace tessera
