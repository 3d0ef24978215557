// Loss curves of training runs as a PNG line chart, drawn without a plotting library.
//
//   io::PlotOptions options;
//   options.smoothing = 0.9;
//   io::plot_runs({"runs/a", "runs/b"}, "loss.png", options);
//
// Each run gets one colour (run_colour): its training loss is a thin line (with smoothing,
// the raw loss stays behind it, faint), its validation loss markers joined by a thicker line.
// The chart has a title, axes with round tick values (1, 2 or 5 x 10^k), light grid lines,
// the axis labels "step" and "loss", and a legend ("<run> train", "<run> val") placed in
// the corner of the plot with the least ink.
#pragma once

#include <string>
#include <vector>

#include "tessera/io/metrics.h"
#include "tessera/io/png.h"

namespace tessera::io {

struct RunSeries {
  std::string name;                 // shown in the legend
  std::vector<MetricPoint> points;  // sorted by step, as read_metrics returns them
};

struct PlotOptions {
  int width = 1000, height = 600;  // pixels; Error outside 320x240 .. Image::kMaxSide
  double smoothing = 0.0;          // EMA weight in [0, 1) for the training loss; 0 draws it raw
  bool log_y = false;              // logarithmic loss axis (every loss must be > 0)
  std::string title = "Training loss";
};

// Draws the chart. Error when there is no run, a run has no training loss, the options are
// out of range, or log_y meets a loss <= 0 (naming the run and step).
Image plot_loss_curves(const std::vector<RunSeries>& runs, const PlotOptions& options);

// read_metrics + run_name for each path, plot_loss_curves, then write_png(out_path).
// Runs whose names coincide are told apart by their parent directory ("x/a", "y/a").
void plot_runs(const std::vector<std::string>& run_paths, const std::string& out_path, const PlotOptions& options);

// The colour of the run at `index` (a ten-colour palette, repeating).
Rgb run_colour(size_t index);

// The training loss after exponential smoothing with `weight` in [0, 1), debiased so the
// first values are not pulled toward zero: s_i = w s_(i-1) + (1 - w) x_i, out_i = s_i / (1 - w^(i+1)).
std::vector<double> ema_smooth(const std::vector<double>& values, double weight);

// The round step (1, 2 or 5 x 10^k) that splits `span` into about `target` intervals.
double nice_step(double span, int target);
// The multiples of nice_step(hi - lo, target) within [lo, hi], ascending. Needs lo < hi.
std::vector<double> nice_ticks(double lo, double hi, int target);
// Ticks for a logarithmic axis over [lo, hi], 0 < lo < hi: powers of ten when the range
// spans three or more, else 1/2/5 x 10^k when that gives four or more, else 1..9 x 10^k
// (three to twelve of them), else 1/2/5 x 10^k, else nice_ticks.
std::vector<double> log_ticks(double lo, double hi, int target);
// A tick label with the decimals that `step` needs: format_tick(0.5, 0.25) is "0.50",
// format_tick(20000, 5000) is "20k"; values below 1e-4 in scientific form ("2e-5").
std::string format_tick(double value, double step);

}  // namespace tessera::io
