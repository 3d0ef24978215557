// `tessera info`: what this build has (backends, BLAS, threads) and which devices it sees.
#include <CLI/CLI.hpp>
#include <omp.h>

#include <cstdio>

#include "cli/commands.h"
#include "tessera/core/allocator.h"

namespace tessera::cli {

void add_info_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("info", "Print the build configuration and the devices tessera can use");
  cmd->callback([] {
    std::printf("tessera %s\n", kVersion);
    std::printf("  CPU backend : yes (%d OpenMP threads)\n", omp_get_max_threads());
    std::printf("  BLAS        : %s\n", TESSERA_WITH_BLAS ? "OpenBLAS" : "built-in loop (no OpenBLAS found at build time)");
    std::printf("  CUDA backend: %s\n", TESSERA_WITH_CUDA ? "built" : "not built (configure with -DTESSERA_CUDA=ON)");
    std::printf("  GPU present : %s\n", cuda_available() ? "yes" : "no");
  });
}

}  // namespace tessera::cli
