// Checks and the per-expert loop shared by the MoE op files (ops/moe.cpp, ops/moe_fp8.cpp).
// Internal to src/ops.
#pragma once

#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "tessera/core/context.h"
#include "tessera/core/error.h"
#include "tessera/core/stream.h"
#include "tessera/core/tensor.h"
#include "tessera/ops/moe.h"

#if TESSERA_WITH_CUDA
#include "backend/cuda/fp8_scaling.h"
#include "backend/cuda/stream_fan.h"
#endif

namespace tessera::moe_detail {

// TESSERA_MOE_LEGACY=1: the MoE ops' older kernels (for timing them side by side); each
// switch reads it once, at its first use.
inline bool legacy_from_environment() {
  const char* v = std::getenv("TESSERA_MOE_LEGACY");
  return v != nullptr && std::string(v) == "1";
}

inline void check_matrix(const Tensor& t, const char* op, const char* name) {
  TESSERA_CHECK(t.defined() && t.dim() == 2 && t.is_contiguous(), op, ": ", name,
                " must be a contiguous 2-D tensor, got ", t.defined() ? t.describe() : std::string("undefined"));
}

inline void check_float(const Tensor& t, const char* op, const char* name) {
  TESSERA_CHECK(is_floating(t.dtype()), op, ": ", name, " must be floating point, got ", t.describe());
}

inline void check_shaped(const Tensor& t, const Shape& shape, const char* op, const char* name) {
  TESSERA_CHECK(t.defined() && t.is_contiguous() && t.shape() == shape && is_floating(t.dtype()), op, ": ", name,
                " must be a contiguous floating tensor of shape ", shape_to_string(shape), ", got ",
                t.defined() ? t.describe() : std::string("undefined"));
}

// The routing-scaled SwiGLU ops all take x [M, 2F] (gate and up halves side by side) with one
// routing probability per row; returns F, the width of their h / dy.
inline int64_t check_swiglu_input(const Tensor& x, const Tensor& scale, const char* op) {
  check_matrix(x, op, "x");
  check_float(x, op, "x");
  TESSERA_CHECK(x.size(1) % 2 == 0, op, ": x must be [M, 2F], got ", x.describe());
  check_shaped(scale, {x.size(0)}, op, "scale");
  return x.size(1) / 2;
}

inline void check_splits(const std::vector<int64_t>& splits, int64_t experts, int64_t rows, const char* op) {
  TESSERA_CHECK(static_cast<int64_t>(splits.size()) == experts, op, ": ", splits.size(), " split sizes for ", experts,
                " experts");
  int64_t total = 0;
  for (int64_t s : splits) {
    TESSERA_CHECK(s >= 0, op, ": split sizes must be >= 0, got ", s);
    total += s;
  }
  TESSERA_CHECK(total <= rows, op, ": split sizes sum to ", total, ", more than the ", rows, " rows");
}

// dw[e] = 0 for every expert without rows, on ctx's stream: a weight gradient that is
// overwritten (not accumulated) gets no GEMM for those experts.
inline void zero_experts_without_rows(Context& ctx, const std::vector<int64_t>& splits, Tensor& dw) {
  StreamGuard on_stream(ctx);
  for (size_t e = 0; e < splits.size(); ++e)
    if (splits[e] == 0) dw.select(0, static_cast<int64_t>(e)).fill_zero();
}

// fn(expert_ctx, e, first_row) for every expert with rows, in expert order.
template <typename Fn>
void for_each_expert(Context& ctx, const std::vector<int64_t>& splits, Fn&& fn) {
#if TESSERA_WITH_CUDA
  int with_rows = 0;
  for (int64_t s : splits) with_rows += s > 0;
  if (ctx.device.is_cuda() && grouped_gemm_streams() > 1 && with_rows > 1) {
    cuda::StreamFan fan(ctx.stream, ctx.device.index);
    int64_t row = 0;
    int i = 0;
    for (size_t e = 0; e < splits.size(); ++e) {
      if (splits[e] == 0) continue;
      Context side{ctx.device, fan.side(i++ % grouped_gemm_streams())};
      fn(side, e, row);
      row += splits[e];
    }
    fan.join();
    return;
  }
#endif
  int64_t row = 0;
  for (size_t e = 0; e < splits.size(); ++e) {
    if (splits[e] == 0) continue;
    fn(ctx, e, row);
    row += splits[e];
  }
}

// target = fold(target, a): delayed scaling's pending-amax rule (NaN sticky, else the max),
// for the casts that reduce their amax separately (the CPU, and CUDA fallbacks).
inline void fold_amax_into(Context& ctx, const Tensor& a, Tensor& target) {
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    cuda::fold_amax(ctx.stream, a, target);
    return;
#endif
  }
  const float v = a.data<float>()[0];
  float& t = target.data<float>()[0];
  t = (std::isnan(v) || std::isnan(t)) ? std::numeric_limits<float>::quiet_NaN() : std::max(t, v);
}

// Under delayed scaling: q's entries for the listed experts (q sized for all of them) as
// views of the codes data [A, N, K] and data_t [A, K, N] (undefined: none), slot i for
// experts[i], with the state's scales and a copy of its inverse scales made now, 16 bytes
// apart (cuBLASLt's scale alignment). ops/moe_fp8.cpp.
void set_delayed_weight_codes(Context& ctx, const Tensor& data, const Tensor& data_t,
                              const std::vector<int64_t>& experts, const MoEFp8Options& o, MoEFp8Weights& q);

}  // namespace tessera::moe_detail
