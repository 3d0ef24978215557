// Helpers of the norm GPU tests that pick kernels through cuda::NormTuning
// (test_gpu_norm_warp.cpp, test_gpu_norm_backward_variants.cpp). CUDA builds only.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "backend/cuda/norm.h"
#include "gpu_testing.h"
#include "testing.h"

namespace tessera::testing {

// Sets the norm tuning for one scope.
class TuningScope {
 public:
  explicit TuningScope(const cuda::NormTuning& t) : saved_(cuda::norm_tuning()) { cuda::set_norm_tuning(t); }
  ~TuningScope() { cuda::set_norm_tuning(saved_); }

 private:
  cuda::NormTuning saved_;
};

inline double tolerance(DType t) { return t == DType::BF16 ? 1e-2 : 1e-5; }
inline Tensor host(const Tensor& t) { return t.defined() ? t.to(Device::cpu()) : Tensor(); }
inline Tensor dev(const Tensor& t) { return t.defined() ? t.to(kCuda) : Tensor(); }

// NaN exactly where the reference has NaN, close elsewhere.
inline void expect_close(const Tensor& got_any, const Tensor& want, double tol, const std::string& what) {
  const std::vector<double> got = host(got_any).to_doubles(), ref = host(want).to_doubles();
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::vector<double> g, r;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(ref[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << what << ": element " << i << " should be NaN";
      continue;
    }
    EXPECT_FALSE(std::isnan(got[i])) << what << ": element " << i << " is NaN";
    if (std::isnan(got[i])) return;
    g.push_back(got[i]);
    r.push_back(ref[i]);
  }
  EXPECT_LT(relative_error(g, r), tol) << what;
}

}  // namespace tessera::testing
