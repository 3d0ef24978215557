// TMA tensor maps for the Hopper kernels (tensor_map.h).
#include "backend/cuda/tensor_map.h"

#include <cuda_runtime.h>

#include <atomic>

#include "backend/cuda/cuda_check.h"
#include "tessera/core/error.h"

namespace tessera::cuda {
namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    TESSERA_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status));
    TESSERA_CHECK(status == cudaDriverEntryPointSuccess && p != nullptr,
                  "TMA tensor maps: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

}  // namespace

bool device_is_hopper(int device) {
  static std::atomic<int> cache[64];  // 0 unknown, 1 no, 2 yes
  if (device >= 0 && device < 64 && cache[device].load(std::memory_order_relaxed) != 0) return cache[device].load() == 2;
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();  // not sticky: the caller runs a portable kernel instead
    return false;
  }
  if (device >= 0 && device < 64) cache[device].store(major == 9 ? 2 : 1);
  return major == 9;
}

CUtensorMap make_bf16_tensor_map(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                                 const cuuint32_t* box, const char* who) {
  TESSERA_CHECK(rank >= 1 && rank <= 5, who, ": a tensor map has 1 to 5 dimensions, not ", rank);
  CUtensorMap map{};
  const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, static_cast<cuuint32_t>(rank),
                                    const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                    CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TESSERA_CHECK(r == CUDA_SUCCESS, who, ": cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(r), ")");
  return map;
}

CUtensorMap make_bhd_tensor_map(const void* base, int64_t batch, int64_t rows, int64_t heads, int D, int box_rows,
                                const char* who) {
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(D) * 2, static_cast<cuuint64_t>(heads * D) * 2,
                                 static_cast<cuuint64_t>(rows * heads * D) * 2};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(box_rows), 1};
  return make_bf16_tensor_map(base, 4, dims, strides, box, who);
}

}  // namespace tessera::cuda
