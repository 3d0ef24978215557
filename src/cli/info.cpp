// `tessera info`: what this build has (backends, BLAS, threads) and which devices it sees.
#include <CLI/CLI.hpp>
#include <omp.h>

#include <cstdio>

#include "cli/commands.h"
#include "tessera/core/allocator.h"
#if TESSERA_WITH_CUDNN
#include <cudnn.h>
#endif
#if TESSERA_WITH_NCCL
#include <nccl.h>
#endif

namespace tessera::cli {

void add_info_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("info", "Print the build configuration and the devices tessera can use");
  cmd->callback([] {
    std::printf("tessera %s\n", kVersion);
    std::printf("  CPU backend : yes (%d OpenMP threads)\n", omp_get_max_threads());
    std::printf("  BLAS        : %s\n", TESSERA_WITH_BLAS ? "OpenBLAS" : "built-in loop (no OpenBLAS found at build time)");
    std::printf("  CUDA backend: %s\n", TESSERA_WITH_CUDA ? "built" : "not built (configure with -DTESSERA_CUDA=ON)");
    std::printf("  GPU present : %s\n", cuda_available() ? "yes" : "no");
#if TESSERA_WITH_CUDNN
    {
      // cuDNN 9 encodes versions as major * 10000 + minor * 100 + patch.
      const size_t loaded = cudnnGetVersion();
      std::printf("  cuDNN       : %zu.%zu.%zu loaded (built with %d.%d.%d headers)%s\n", loaded / 10000,
                  loaded / 100 % 100, loaded % 100, CUDNN_MAJOR, CUDNN_MINOR, CUDNN_PATCHLEVEL,
                  loaded / 100 == static_cast<size_t>(CUDNN_VERSION) / 100
                      ? ""
                      : "  WARNING: versions differ; set CUDNN_ROOT to one installation");
    }
#else
    std::printf("  cuDNN       : not found at build time (set CUDNN_ROOT)\n");
#endif
#if TESSERA_WITH_NCCL
    int nccl_version = 0;
    ncclGetVersion(&nccl_version);
    std::printf("  NCCL        : %d.%d.%d loaded (built with %d.%d.%d headers)\n", nccl_version / 10000,
                nccl_version / 100 % 100, nccl_version % 100, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
#else
    std::printf("  NCCL        : not found at build time (set NCCL_ROOT)\n");
#endif
  });
}

}  // namespace tessera::cli
