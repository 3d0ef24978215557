// Subcommands of the `tessera` tool.
#pragma once

namespace CLI {
class App;
}

namespace tessera::cli {

inline constexpr const char* kVersion = "0.1.0";

void add_info_command(CLI::App& app);   // tessera info: build and device facts
void add_plot_command(CLI::App& app);   // tessera plot: loss curves of runs as a PNG
void add_train_commands(CLI::App& app); // tessera train, prepare, eval, generate
void add_convert_command(CLI::App& app); // tessera convert: Hugging Face <-> tessera checkpoints
void add_launch_command(CLI::App& app);  // tessera launch: N ranks of a command on this host
// `tessera launch ... -- COMMAND ARGS`: keeps the words after `--` for launch (CLI11 would
// parse them) and returns the argc to parse.
int split_launch_args(int argc, char** argv);

}  // namespace tessera::cli
