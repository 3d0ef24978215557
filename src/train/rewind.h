// Detectors behind automatic rewinds: non-finite loss or gradient norm, and loss or
// gradient-norm spikes measured as a robust z-score against the recent good steps,
//   z = (x - median) / (1.4826 * MAD),   MAD = median |x_i - median|
// (1.4826 * MAD estimates the standard deviation of normal data, and neither the median nor
// the MAD moves much when a few outliers are in the window). Only upward spikes count: a
// loss that falls faster than usual is no fault. The scale has a floor of 1% of the median
// so that a nearly constant history does not make every wiggle a spike.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>

#include "tessera/train/config.h"

namespace tessera::train {

// The robust z-score of x against `history` (NaN when history has fewer than 3 values).
double robust_z_score(const std::deque<double>& history, double x);

class AnomalyDetector {
 public:
  explicit AnomalyDetector(const RewindConfig& config) : config_(config) {}

  // Why step `step` (with these loss and gradient norm) is bad, or nullopt when it is fine.
  // Does not record the step: call accept() for steps that are kept.
  std::optional<std::string> check(int64_t step, double loss, double grad_norm) const;
  void accept(int64_t step, double loss, double grad_norm);
  // Forgets steps after `step` (they are being undone).
  void rewind_to(int64_t step);

 private:
  RewindConfig config_;
  std::deque<std::pair<int64_t, double>> losses_, grad_norms_;
};

}  // namespace tessera::train
