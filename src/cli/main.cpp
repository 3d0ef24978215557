// The `tessera` command-line tool. Each subcommand lives in its own file (cli/<name>.cpp)
// and registers itself here; errors become one clear line on stderr and exit code 1.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "tessera/core/error.h"
#include "tessera/dist/process_group.h"

int main(int argc, char** argv) {
  CLI::App app{"tessera: trains and serves Transformer models fast (C++20/CUDA)", "tessera"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(tessera::cli::kVersion));
  tessera::cli::add_info_command(app);
  tessera::cli::add_plot_command(app);
  tessera::cli::add_train_commands(app);
  tessera::cli::add_convert_command(app);
  tessera::cli::add_launch_command(app);
  try {
    app.parse(tessera::cli::split_launch_args(argc, argv), argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const tessera::Error& e) {
    std::fprintf(stderr, "tessera: error: %s\n", e.what());
    tessera::dist::abort_job(1);  // one rank of several under mpirun: end them all now
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera: unexpected error: %s\n", e.what());
    tessera::dist::abort_job(1);
    return 1;
  }
  return 0;
}
