// Helpers shared by the MoE tests (test_moe_fp8, test_moe_fp8_delayed, test_gpu_moe,
// test_gpu_moe_fp8_delayed): expert-contiguous inputs, one GroupedMLP forward + backward with
// everything it returns, and the comparison of FP8 codes that may differ by a rounding step.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <utility>
#include <vector>

#include "tessera/nn/moe.h"
#include "testing.h"

namespace tessera::testing {

// x with its rows past the split sum zeroed, as the permutation leaves them.
inline Tensor zero_tail(Tensor x, const std::vector<int64_t>& splits) {
  int64_t used = 0;
  for (int64_t v : splits) used += v;
  if (used < x.size(0)) x.slice(0, used, x.size(0)).fill_zero();
  return x;
}

// A random BF16 [rows, cols] in [-scale, scale] with zero_tail's rule.
inline Tensor rows_input(int64_t rows, int64_t cols, const std::vector<int64_t>& splits, uint64_t seed,
                         float scale = 1.0f) {
  return zero_tail(random_tensor({rows, cols}, DType::BF16, seed, -scale, scale), splits);
}

// What one GroupedMLP forward + backward gives, on the host.
struct MlpRun {
  Tensor y, dx, d_scale, dfc, dproj;
};

// The step's first micro-batch (gradients zeroed first) on ctx: forward, backward_input,
// backward_weight.
inline MlpRun run_mlp(nn::GroupedMLP& mlp, Context& ctx, const Tensor& x, const Tensor& prob, const Tensor& dy,
                      const std::vector<int64_t>& splits) {
  mlp.fc.weight.grad.fill_zero();
  mlp.proj.weight.grad.fill_zero();
  nn::GroupedMLP::Saved saved;
  MlpRun r;
  r.y = mlp.forward(ctx, x, prob, splits, saved).to(Device::cpu());
  r.dx = mlp.backward_input(ctx, dy, saved).to(Device::cpu());
  r.d_scale = saved.d_scale.to(Device::cpu());
  mlp.backward_weight(ctx, dy, saved);
  r.dfc = mlp.fc.weight.grad.to(Device::cpu()).clone();
  r.dproj = mlp.proj.weight.grad.to(Device::cpu()).clone();
  return r;
}

// FP8 codes that differ, and whether each differs by at most one rounding step (adjacent
// codes of the same sign: FP8 codes are ordered like sign-magnitude integers).
inline std::pair<int64_t, bool> code_mismatches(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  int64_t n = 0;
  bool adjacent = a.size() == b.size();
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (a[i] == b[i]) continue;
    ++n;
    adjacent = adjacent && (a[i] & 0x80) == (b[i] & 0x80) && std::abs(int(a[i] & 0x7f) - int(b[i] & 0x7f)) == 1;
  }
  return {n, adjacent};
}

}  // namespace tessera::testing
