// The arithmetic shared by the CPU transports (MPI and TCP): which dtype a reduction
// accumulates in, conversions into and out of it, and the reduction of `parts` chunks in
// rank order. Both backends reduce with these, so their results are bitwise the same.
#pragma once

#include <algorithm>
#include <cstring>

#include "tessera/dist/process_group.h"
#include "tessera/ops/elementwise.h"

namespace tessera::dist::detail {

// The dtype a reduction accumulates in: F64 stays F64, floats of 32 bits or fewer sum in
// F32 (one rounding at the end), integers in I64.
inline DType accumulate_dtype(DType t, const char* op) {
  switch (t) {
    case DType::F64: return DType::F64;
    case DType::F32:
    case DType::BF16:
    case DType::F16: return DType::F32;
    case DType::I32:
    case DType::I64: return DType::I64;
    default: TESSERA_FAIL(op, ": cannot reduce ", dtype_name(t), " (f64, f32, bf16, f16, i32, i64 only)");
  }
}

// dst (its own dtype, same element count) = src converted; both contiguous CPU buffers.
inline void convert(const Tensor& src, Tensor& dst) {
  if (src.numel() == 0) return;  // (an empty tensor may have no storage at all)
  if (src.dtype() == dst.dtype()) {
    std::memcpy(dst.raw_data(), src.raw_data(), src.nbytes());
  } else if (is_integer(src.dtype()) && is_integer(dst.dtype())) {
    const int64_t n = src.numel();
    if (src.dtype() == DType::I32 && dst.dtype() == DType::I64) {
      for (int64_t i = 0; i < n; ++i) dst.data<int64_t>()[i] = src.data<int32_t>()[i];
    } else if (src.dtype() == DType::I64 && dst.dtype() == DType::I32) {
      for (int64_t i = 0; i < n; ++i) dst.data<int32_t>()[i] = static_cast<int32_t>(src.data<int64_t>()[i]);
    } else {
      TESSERA_FAIL("collective: no conversion from ", dtype_name(src.dtype()), " to ", dtype_name(dst.dtype()));
    }
  } else {
    Context cpu = Context::cpu();
    cast(cpu, src, dst);
  }
}

// out[i] = in[0 * chunk + i] (op) in[1 * chunk + i] (op) ... over `parts` parts, in order.
template <typename T>
void reduce_parts(const T* in, T* out, int64_t chunk, int parts, ReduceOp op) {
  std::copy(in, in + chunk, out);
  for (int p = 1; p < parts; ++p) {
    const T* x = in + static_cast<int64_t>(p) * chunk;
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        for (int64_t i = 0; i < chunk; ++i) out[i] += x[i];
        break;
      case ReduceOp::Max:
        for (int64_t i = 0; i < chunk; ++i) out[i] = std::max(out[i], x[i]);
        break;
      case ReduceOp::Min:
        for (int64_t i = 0; i < chunk; ++i) out[i] = std::min(out[i], x[i]);
        break;
    }
  }
  if (op == ReduceOp::Avg) {
    const T n = static_cast<T>(parts);
    for (int64_t i = 0; i < chunk; ++i) out[i] /= n;
  }
}

// `recv` (acc dtype) holds `parts` chunks of `chunk` elements, one from each rank in rank
// order; returns their reduction.
inline Tensor reduce_received(const Tensor& recv, int64_t chunk, int parts, ReduceOp op, DType acc) {
  Tensor mine = Tensor::empty({chunk}, acc);
  switch (acc) {
    case DType::F64: reduce_parts(recv.data<double>(), mine.data<double>(), chunk, parts, op); break;
    case DType::F32: reduce_parts(recv.data<float>(), mine.data<float>(), chunk, parts, op); break;
    default: reduce_parts(recv.data<int64_t>(), mine.data<int64_t>(), chunk, parts, op); break;
  }
  return mine;
}

inline void check_cpu_tensor(const Tensor& t, const char* backend, const char* op, const char* name) {
  check_defined(t, op, name);
  check_contiguous(t, op, name);
  TESSERA_CHECK(t.device().is_cpu(), op, ": the ", backend, " backend takes CPU tensors, ", name, " is ", t.describe(),
                " (use an NCCL group for CUDA tensors)");
}

}  // namespace tessera::dist::detail
