// Helpers shared by the op tests: random tensors, error norms, finite differences.
//
// Gradient checks follow one pattern: pick a random weight tensor W of the output's
// shape, define the scalar L = sum(out * W), so dL/dout = W; run the op's backward with
// d_out = W and compare each input gradient with central differences of L in FP64.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tessera/core/context.h"
#include "tessera/core/random.h"
#include "tessera/core/tensor.h"

namespace tessera::testing {

// A CPU tensor with values uniform in [low, high), drawn from the Philox stream of `seed`.
inline Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed, float low = -1.0f, float high = 1.0f) {
  Tensor t = Tensor::empty(shape, dtype);
  Context ctx = Context::cpu();
  fill_uniform(ctx, t, low, high, seed);
  return t;
}

// A CPU I64 tensor of token ids uniform in [0, vocab), from a small LCG seeded by `seed`
// (the same ids on every machine, without touching the Philox stream of the weights).
inline Tensor random_ids(const Shape& shape, int64_t vocab, uint64_t seed) {
  std::vector<int64_t> ids(static_cast<size_t>(shape_numel(shape)));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& id : ids) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    id = static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(vocab));
  }
  return Tensor::from_ints(ids, shape);
}

// ||got - want|| / ||want|| (or ||got - want|| when want is all zeros).
inline double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double diff = 0, ref = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(want[i])) return INFINITY;  // NaN never passes
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    ref += want[i] * want[i];
  }
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

inline double relative_error(const Tensor& got, const Tensor& want) {
  return relative_error(got.to_doubles(), want.to_doubles());
}

// sum(out * weights) in double.
inline double weighted_sum(const Tensor& out, const Tensor& weights) {
  const std::vector<double> o = out.to_doubles(), w = weights.to_doubles();
  double s = 0;
  for (size_t i = 0; i < o.size(); ++i) s += o[i] * w[i];
  return s;
}

// Central differences of loss() with respect to every element of `x` (a CPU F64 tensor
// that loss() reads): (L(x + h e_i) - L(x - h e_i)) / 2h.
inline std::vector<double> numeric_gradient(Tensor& x, const std::function<double()>& loss, double h = 1e-6) {
  std::vector<double> grad(static_cast<size_t>(x.numel()));
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double saved = x.item(i);
    x.set_item(i, saved + h);
    const double plus = loss();
    x.set_item(i, saved - h);
    const double minus = loss();
    x.set_item(i, saved);
    grad[i] = (plus - minus) / (2 * h);
  }
  return grad;
}

// Expects the analytic gradient `got` to match central differences within `tol`.
inline void expect_gradient(const Tensor& got, Tensor& x, const std::function<double()>& loss, const std::string& what,
                            double tol = 1e-6) {
  const std::vector<double> want = numeric_gradient(x, loss);
  const double err = relative_error(got.to_doubles(), want);
  EXPECT_LT(err, tol) << what << ": analytic gradient differs from finite differences (relative error " << err << ")";
}

// Fills a tensor with NaN so that elements an op forgets to write are caught.
inline void poison(Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, NAN);
}

// Whether a and b are the same dtype, shape and bytes (both undefined counts as the same).
inline bool same_bits(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  return ca.nbytes() == 0 || std::memcmp(ca.raw_data(), cb.raw_data(), ca.nbytes()) == 0;  // empty: no pointers
}

}  // namespace tessera::testing
