// One-call setup of the world, the grid and the device (see tessera/dist/runtime.h).
#include "tessera/dist/runtime.h"

#include "tessera/dist/nccl_group.h"
#include "tessera/dist/watchdog.h"

#if TESSERA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace tessera::dist {

Runtime init_from_env(const ParallelConfig& config, Context device, GroupPtr world) {
  set_timeout(config.timeout_s);
  Runtime rt;
  rt.world = world ? std::move(world) : init_from_env();
  rt.local_rank = local_rank();
  Context cpu = Context::cpu();
  rt.host = std::make_shared<ParallelGrid>(cpu, rt.world, config);
  rt.ctx = device;
  if (!device.device.is_cuda()) {
    rt.grid = rt.host;
    return rt;
  }
#if TESSERA_WITH_CUDA
  int count = 0;
  TESSERA_CHECK(cudaGetDeviceCount(&count) == cudaSuccess && count > 0, "dist: rank ", rt.rank(),
                " was asked to run on CUDA but sees no GPU");
  const int gpu = rt.size() == 1 ? device.device.index : rt.local_rank % count;
  TESSERA_CHECK(cudaSetDevice(gpu) == cudaSuccess, "dist: rank ", rt.rank(), ": cannot select GPU ", gpu);
  rt.ctx.device = Device::cuda(gpu);
  if (rt.size() == 1) {
    rt.grid = rt.host;
    return rt;
  }
  TESSERA_CHECK(nccl_available(), "dist: CUDA training on ", rt.size(), " ranks needs NCCL, and this build has none");
  GroupPtr nccl_world = nccl_group(rt.ctx, *rt.world, gpu);
  rt.grid = std::make_shared<ParallelGrid>(rt.ctx, nccl_world, config);
  return rt;
#else
  TESSERA_FAIL("dist: CUDA was asked for, but this build has no CUDA backend");
#endif
}

}  // namespace tessera::dist
