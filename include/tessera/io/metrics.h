// Reading the training metrics a run writes: `metrics.jsonl` in the run directory, one JSON
// object per line, for example
//   {"step": 10, "loss": 3.21, "lr": 0.0003, "tokens_per_s": 5123.4}
//   {"step": 500, "loss": 2.10, "val_loss": 2.25}
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tessera::io {

struct MetricPoint {
  int64_t step = 0;
  std::optional<double> loss;      // training loss of this step
  std::optional<double> val_loss;  // validation loss, on the steps that evaluated
  std::optional<double> lr;
  std::optional<double> tokens_per_s;
};

// The metrics of a run, sorted by step, one point per step. `run_dir_or_file` is a run
// directory (its metrics.jsonl is read) or the .jsonl file itself.
//
// A resumed run appends to the same file, and a resume from an earlier checkpoint logs
// steps again: a line whose step is not past the last one seen rewinds the history, so
// points after that step (the abandoned continuation) are dropped and the line's values
// replace those already recorded for its step (values the line lacks are kept, so a
// validation loss logged on its own line joins the training loss of the same step).
//
// "step" is a required integer; "loss", "val_loss", "lr" and "tokens_per_s" are numbers or
// null (NaN as written by nlohmann::json: no value); other keys are ignored. Blank lines are
// skipped, and so is a last line without its newline that does not parse (a line still
// being written by a live run). Error, naming the file and the line number, for a line that
// is not a JSON object or has a missing or mistyped field; Error when the run has no
// training loss at all or the path does not exist.
std::vector<MetricPoint> read_metrics(const std::string& run_dir_or_file);

// The name a run goes by in legends: the last component of the run directory ("runs/a/"
// and "runs/a/metrics.jsonl" are both "a"; a .jsonl file outside a run directory is named
// by its stem).
std::string run_name(const std::string& run_dir_or_file);

}  // namespace tessera::io
