// Helpers of the grouped-GEMM GPU tests (test_gpu_grouped_gemm_wgmma.cpp): poisoned BF16
// outputs, the comparison against a reference (relative Frobenius error, NaN, a loose
// per-element bound, poison left past the experts' rows), the experts' row offsets on the
// device, the loop that runs and checks every kernel variant, and the checks the forward
// and the input gradient (dgrad) share: small cases against the CPU reference, the front
// end with the own kernels, the kernels against the cuBLASLt loop. Needs the CUDA backend
// (include it under TESSERA_WITH_CUDA).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cuda/grouped_gemm_wgmma.h"
#include "gpu_testing.h"
#include "tessera/core/numeric.h"
#include "tessera/ops/moe.h"

namespace tessera::testing {

// A device BF16 tensor whose every bit is set (0xFFFF is a NaN).
inline Tensor poisoned_bf16(const Shape& shape) {
  Tensor host = Tensor::empty(shape, DType::BF16);
  std::memset(host.raw_data(), 0xFF, host.nbytes());
  return host.to(kCuda);
}

struct GemmCheck {
  double rel = 0;            // relative Frobenius error over the checked rows
  int64_t nan = 0;           // NaN in got where want is finite
  int64_t bad = 0;           // elements off by more than the loose per-element bound
  int64_t first_bad = -1;    // flat index of the first NaN or bad element
  float want_at = 0, got_at = 0;
  int64_t poison_written = 0;  // rows >= `rows` that are no longer all-ones bits
  std::string describe(int64_t n) const {
    std::ostringstream s;
    s << "relative error " << rel << ", " << nan << " NaN, " << bad << " elements off";
    if (first_bad >= 0)
      s << "; first at row " << first_bad / n << " column " << first_bad % n << ": expected " << want_at << ", got "
        << got_at;
    if (poison_written) s << "; " << poison_written << " elements written past the experts' rows";
    return s.str();
  }
};

// got and want [R, n] BF16 (any device): rows [0, rows) compared; with poison_tail, rows
// [rows, R) of got must still hold the poison bits. skip_row (>= 0) is left out.
inline GemmCheck compare_gemm(const Tensor& got_any, const Tensor& want_any, int64_t rows, bool poison_tail,
                              int64_t skip_row = -1) {
  const Tensor got = got_any.to(Device::cpu()).contiguous(), want = want_any.to(Device::cpu()).contiguous();
  const int64_t n = got.size(1);
  const bf16* g = got.data<bf16>();
  const bf16* w = want.data<bf16>();
  double ss_want = 0;
  for (int64_t i = 0; i < rows * n; ++i) {
    if (i / n == skip_row) continue;
    const double v = w[i].to_float();
    ss_want += v * v;
  }
  const double rms = std::sqrt(ss_want / std::max<double>(1.0, static_cast<double>(rows * n)));
  GemmCheck c;
  double ss_diff = 0;
  for (int64_t i = 0; i < rows * n; ++i) {
    if (i / n == skip_row) continue;
    const float gv = g[i].to_float(), wv = w[i].to_float();
    const bool is_nan = std::isnan(gv) && !std::isnan(wv);
    const double d = static_cast<double>(gv) - wv;
    const bool off = !is_nan && std::fabs(d) > 0.1 * rms + 0.05 * std::fabs(wv);
    if (is_nan) ++c.nan;
    if (off) ++c.bad;
    if ((is_nan || off) && c.first_bad < 0) {
      c.first_bad = i;
      c.want_at = wv;
      c.got_at = gv;
    }
    if (!is_nan) ss_diff += d * d;
  }
  c.rel = c.nan ? INFINITY : std::sqrt(ss_diff / std::max(ss_want, 1e-30));
  if (poison_tail)
    for (int64_t i = rows * n; i < got.numel(); ++i) c.poison_written += g[i].bits != 0xFFFF;
  return c;
}

// DESIGN.md's BF16 GEMM bound (relative Frobenius error < 1e-2), no NaN, nothing off by
// more than the loose per-element bound, the poison past the rows intact.
inline bool passed(const GemmCheck& c) { return c.rel < 1e-2 && c.nan == 0 && c.bad == 0 && c.poison_written == 0; }

inline std::string splits_string(const std::vector<int64_t>& splits) {
  std::ostringstream s;
  for (size_t i = 0; i < splits.size(); ++i) s << (i ? "," : "{") << splits[i];
  s << "}";
  return s.str();
}

inline Tensor device_offsets(const std::vector<int64_t>& splits) {
  std::vector<int64_t> off(splits.size() + 1, 0);
  for (size_t e = 0; e < splits.size(); ++e) off[e + 1] = off[e] + splits[e];
  return Tensor::from_ints(off, {static_cast<int64_t>(off.size())}, DType::I64).to(kCuda);
}

// The rows of a small case: `experts` = splits.size(), `used` = their sum (the rows that
// are computed), `rows` = used + extra rows past the splits.
struct SplitRows {
  int64_t experts, used, rows;
};
inline SplitRows split_rows(const std::vector<int64_t>& splits, int64_t extra_rows) {
  const int64_t used = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  return {static_cast<int64_t>(splits.size()), used, used + extra_rows};
}

// fn() with the own kernels (GroupedGemmBackend::Own, variant v) chosen process-wide, then
// the cuBLASLt loop (Cublas) again.
template <typename Fn>
void with_own_backend(cuda::GroupedGemmVariant v, Fn&& fn) {
  cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Own);
  cuda::set_grouped_gemm_variant(v);
  fn();
  cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Cublas);
}

// For each variant: a fresh poisoned output of out_shape [R, n], run(out, variant), then the
// output against want on rows [0, rows) (poison_tail: the rows past them must still hold the
// poison), failing with "<what> variant <name>: <check>". Returns false, running nothing
// more, as soon as supported(out) is false: the caller skips (not a Hopper GPU).
template <typename Variants, typename Supported, typename Run>
bool expect_variants_match(const Variants& variants, const Shape& out_shape, const Tensor& want, int64_t rows,
                           bool poison_tail, const std::string& what, Supported&& supported, Run&& run) {
  for (cuda::GroupedGemmVariant v : variants) {
    Tensor got = poisoned_bf16(out_shape);
    if (!supported(got)) return false;
    run(got, v);
    const GemmCheck c = compare_gemm(got, want, rows, poison_tail);
    EXPECT_TRUE(passed(c)) << what << " variant " << cuda::grouped_gemm_variant_name(v) << ": "
                           << c.describe(out_shape[1]);
  }
  return true;
}

// One of the two products, w [E, n, k]: the forward x [rows, k] -> y [rows, n], or the
// input gradient dy [rows, n] -> dx [rows, k] (dgrad). `in` and `out` below are the widths
// of the product's input and output (forward: k and n; dgrad: n and k).
struct GemmOp {
  bool dgrad = false;

  Shape w_shape(int64_t experts, int64_t in, int64_t out) const {
    return dgrad ? Shape{experts, in, out} : Shape{experts, out, in};
  }
  bool supported(const Tensor& in, const Tensor& w, const Tensor& out) const {
    return dgrad ? cuda::grouped_gemm_wgmma_backward_input_supported(in, w, out)
                 : cuda::grouped_gemm_wgmma_supported(in, w, out);
  }
  // The own kernel, called directly.
  void kernel(void* stream, const Tensor& in, const Tensor& w, const std::vector<int64_t>& splits, Tensor& out,
              cuda::GroupedGemmVariant v) const {
    if (dgrad) cuda::grouped_gemm_wgmma_backward_input(stream, in, w, device_offsets(splits), out, v);
    else cuda::grouped_gemm_wgmma_forward(stream, in, w, device_offsets(splits), out, v);
  }
  // The op's front end (grouped_linear_forward / _backward_input), with the backend chosen.
  void front_end(Context& ctx, const Tensor& in, const Tensor& w, const std::vector<int64_t>& splits,
                 Tensor& out) const {
    if (dgrad) grouped_linear_backward_input(ctx, in, w, splits, out);
    else grouped_linear_forward(ctx, in, w, splits, out);
  }
};

// Mixtral's experts (E 8, hidden 4096, ffn 14336) over 16384 rows: w [8, 14336, 4096] and the
// product's input (forward: x [16384, 4096]; dgrad: dy [16384, 14336]), uniform on the device
// (the input in [-1, 1) from `seed`, then w in [-0.02, 0.02) from seed + 1).
struct MixtralOperands {
  static constexpr int64_t kExperts = 8, kHidden = 4096, kFfn = 14336, kRows = 16384;
  Tensor in, w;
};
inline MixtralOperands mixtral_operands(const GemmOp& op, Context& gpu, uint64_t seed) {
  using M = MixtralOperands;
  MixtralOperands m{Tensor::empty({M::kRows, op.dgrad ? M::kFfn : M::kHidden}, DType::BF16, kCuda),
                    Tensor::empty({M::kExperts, M::kFfn, M::kHidden}, DType::BF16, kCuda)};
  fill_uniform(gpu, m.in, -1, 1, seed);
  fill_uniform(gpu, m.w, -0.02f, 0.02f, seed + 1);
  return m;
}

// The kernel, every variant, called directly on (in, w) against want [R, n]: rows [0, rows)
// compared, with poison_tail the rows past them still poisoned. False: not a Hopper GPU.
template <typename Variants>
bool expect_kernel_matches(const GemmOp& op, const Variants& variants, Context& gpu, const Tensor& in, const Tensor& w,
                           const std::vector<int64_t>& splits, const Tensor& want, int64_t rows, bool poison_tail,
                           const std::string& what) {
  return expect_variants_match(
      variants, want.shape(), want, rows, poison_tail, what,
      [&](const Tensor& out) { return op.supported(in, w, out); },
      [&](Tensor& out, cuda::GroupedGemmVariant v) { op.kernel(gpu.stream, in, w, splits, out, v); });
}

// A small case: the input's and output's widths, the experts' splits, rows past them.
struct SmallGemmCase {
  int64_t in, out;
  std::vector<int64_t> splits;
  int64_t extra_rows;
};

// Each case on fresh random data (input, then w, from `seed` on) against the CPU reference,
// the kernel called directly, every variant, the poison past the splits intact; failures
// named "<label> <in name> <in> <out name> <out> splits {..} extra rows <n>". False: not a
// Hopper GPU.
inline bool expect_small_cases_match(const GemmOp& op, const std::vector<SmallGemmCase>& cases, uint64_t seed,
                                     const std::string& label) {
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (const SmallGemmCase& cs : cases) {
    const auto [e, used, rows] = split_rows(cs.splits, cs.extra_rows);
    const Tensor in = random_tensor({rows, cs.in}, DType::BF16, seed++);
    const Tensor w = random_tensor(op.w_shape(e, cs.in, cs.out), DType::BF16, seed++, -0.1f, 0.1f);
    Tensor ref = Tensor::empty({rows, cs.out}, DType::BF16);
    op.front_end(cpu, in, w, cs.splits, ref);
    const std::string what = label + (op.dgrad ? " N " : " K ") + std::to_string(cs.in) + (op.dgrad ? " K " : " N ") +
                             std::to_string(cs.out) + " splits " + splits_string(cs.splits) + " extra rows " +
                             std::to_string(cs.extra_rows);
    if (!expect_kernel_matches(op, cuda::kGroupedGemmVariants, gpu, in.to(kCuda), w.to(kCuda), cs.splits, ref, used,
                               true, what))
      return false;
  }
  return true;
}

// want = the cuBLASLt loop (the front end with backend Cublas) on (in, w, splits); then for
// every variant the own kernel, called directly or (through_front_end) as the front end's
// backend (Own), compared over all rows with want. False: not a Hopper GPU.
template <typename Variants>
bool expect_own_matches_cublas(const GemmOp& op, const Variants& variants, Context& gpu, const Tensor& in,
                               const Tensor& w, const std::vector<int64_t>& splits, int64_t out_width,
                               bool through_front_end, const std::string& what) {
  const int64_t rows = in.size(0);
  Tensor want = poisoned_bf16({rows, out_width});
  cuda::set_grouped_gemm_backend(cuda::GroupedGemmBackend::Cublas);
  op.front_end(gpu, in, w, splits, want);
  return expect_variants_match(
      variants, want.shape(), want, rows, false, what, [&](const Tensor& out) { return op.supported(in, w, out); },
      [&](Tensor& out, cuda::GroupedGemmVariant v) {
        if (through_front_end) with_own_backend(v, [&] { op.front_end(gpu, in, w, splits, out); });
        else op.kernel(gpu.stream, in, w, splits, out, v);
      });
}

}  // namespace tessera::testing
