// See cublaslt_state.h.
#include "cublaslt_state.h"

#include <mutex>

#include "stream_fan.h"

namespace tessera::cuda {

LtState& lt_state(int device) {
  static std::mutex mutex;
  static LtState* states[64] = {};  // leaked on purpose, like the allocators: used until exit
  std::lock_guard<std::mutex> lock(mutex);
  TESSERA_CHECK(device >= 0 && device < 64, "cuBLASLt: device index ", device, " out of range");
  if (!states[device]) {
    auto* s = new LtState();
    TESSERA_CUBLAS_CHECK(cublasLtCreate(&s->handle));
    s->workspace = Tensor::empty({static_cast<int64_t>(kLtWorkspaceBytes)}, DType::U8, Device::cuda(device));
    states[device] = s;
  }
  return *states[device];
}

void* lt_workspace(LtState& state, int device, void* stream) {
  static_assert(sizeof(LtState::side_workspaces) / sizeof(Tensor) == kSideStreams);
  const int side = side_stream_index(device, stream);
  if (side < 0) return state.workspace.raw_data();
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  Tensor& w = state.side_workspaces[side];
  if (!w.defined()) w = Tensor::empty({static_cast<int64_t>(kLtWorkspaceBytes)}, DType::U8, Device::cuda(device));
  return w.raw_data();
}

}  // namespace tessera::cuda
