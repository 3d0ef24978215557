// `tessera plot`: the loss curves of one or more runs (their metrics.jsonl) as a PNG chart.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "tessera/io/plot.h"

namespace tessera::cli {

namespace {

struct PlotCommandOptions {
  std::vector<std::string> runs;
  std::string out;
  io::PlotOptions plot;
};

}  // namespace

void add_plot_command(CLI::App& app) {
  static PlotCommandOptions options;
  CLI::App* cmd = app.add_subcommand("plot", "Draw the training and validation loss of runs into a PNG file");
  cmd->add_option("runs", options.runs, "Run directories (or their metrics.jsonl files)")->required();
  cmd->add_option("--out,-o", options.out, "PNG file to write")->required();
  cmd->add_option("--width", options.plot.width, "Image width in pixels")->capture_default_str()->check(CLI::Range(320, io::Image::kMaxSide));
  cmd->add_option("--height", options.plot.height, "Image height in pixels")->capture_default_str()->check(CLI::Range(240, io::Image::kMaxSide));
  cmd->add_option("--smooth", options.plot.smoothing, "EMA weight for the training loss, in [0, 1); 0 draws it raw")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_flag("--log-y", options.plot.log_y, "Logarithmic loss axis");
  cmd->add_option("--title", options.plot.title, "Chart title")->capture_default_str();
  cmd->callback([] {
    io::plot_runs(options.runs, options.out, options.plot);
    std::printf("plot: wrote %s (%zu run%s)\n", options.out.c_str(), options.runs.size(),
                options.runs.size() == 1 ? "" : "s");
  });
}

}  // namespace tessera::cli
