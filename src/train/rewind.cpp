#include "train/rewind.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

namespace tessera::train {

namespace {

double median(std::vector<double> v) {
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + mid, v.end());
  const double upper = v[mid];
  if (v.size() % 2 == 1) return upper;
  return 0.5 * (upper + *std::max_element(v.begin(), v.begin() + mid));
}

std::deque<double> values(const std::deque<std::pair<int64_t, double>>& h) {
  std::deque<double> out;
  for (const auto& [step, v] : h) out.push_back(v);
  return out;
}

std::string describe(const char* what, double x, double z, const std::deque<double>& history) {
  char text[200];
  std::snprintf(text, sizeof(text), "%s spike: %.6g is %.1f robust standard deviations above the median of the last %zu steps",
                what, x, z, history.size());
  return text;
}

}  // namespace

double robust_z_score(const std::deque<double>& history, double x) {
  if (history.size() < 3) return NAN;
  const std::vector<double> v(history.begin(), history.end());
  const double m = median(v);
  std::vector<double> dev;
  dev.reserve(v.size());
  for (double e : v) dev.push_back(std::fabs(e - m));
  const double scale = std::max(1.4826 * median(dev), 0.01 * std::fabs(m) + 1e-12);
  return (x - m) / scale;
}

std::optional<std::string> AnomalyDetector::check(int64_t, double loss, double grad_norm) const {
  if (!std::isfinite(loss)) return "non-finite loss (" + std::to_string(loss) + ")";
  if (!std::isfinite(grad_norm)) return "non-finite gradient norm (" + std::to_string(grad_norm) + ")";
  if (config_.loss_z > 0 && static_cast<int64_t>(losses_.size()) >= config_.min_history) {
    const std::deque<double> h = values(losses_);
    const double z = robust_z_score(h, loss);
    if (z > config_.loss_z) return describe("loss", loss, z, h);
  }
  if (config_.grad_norm_z > 0 && static_cast<int64_t>(grad_norms_.size()) >= config_.min_history) {
    const std::deque<double> h = values(grad_norms_);
    const double z = robust_z_score(h, grad_norm);
    if (z > config_.grad_norm_z) return describe("gradient-norm", grad_norm, z, h);
  }
  return std::nullopt;
}

void AnomalyDetector::accept(int64_t step, double loss, double grad_norm) {
  losses_.emplace_back(step, loss);
  grad_norms_.emplace_back(step, grad_norm);
  while (static_cast<int64_t>(losses_.size()) > config_.window) losses_.pop_front();
  while (static_cast<int64_t>(grad_norms_.size()) > config_.window) grad_norms_.pop_front();
}

void AnomalyDetector::rewind_to(int64_t step) {
  while (!losses_.empty() && losses_.back().first > step) losses_.pop_back();
  while (!grad_norms_.empty() && grad_norms_.back().first > step) grad_norms_.pop_back();
}

}  // namespace tessera::train
