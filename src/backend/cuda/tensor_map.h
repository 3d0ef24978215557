// Host-side support of the Hopper (sm_90a) kernels that load tiles with cp.async.bulk.tensor
// and multiply with wgmma: the grouped GEMM (grouped_gemm_wgmma.cu) and the attention forward
// (attention_fwd_wgmma.cu) and backward (attention_bwd_wgmma.cu). TMA tensor maps
// (cuTensorMapEncodeTiled comes through the runtime's driver entry point, so tessera does not
// link libcuda) and the device check.
// CUDA translation units only.
#pragma once

#include <cuda.h>  // the CUtensorMap types only

#include <cstdint>

namespace tessera::cuda {

// A BF16 tensor map whose boxes land in shared memory with the 128-byte swizzle the wgmma
// descriptors of sm90_ptx.cuh expect (16-byte chunk c of box row r at chunk c ^ (r % 8)).
// dims and box innermost first (rank 1 to 5; box[0] * 2 bytes must be at most 128); strides
// in bytes, rank - 1 of them, each a multiple of 16. Elements outside dims are read as zero.
// `who` names the caller in the error thrown when the driver refuses the map.
//
// Whether `device` is a Hopper GPU (compute capability 9.x), the only one these kernels run
// on (callers fall back to portable kernels otherwise). Cached per device; false on error.
bool device_is_hopper(int device);

CUtensorMap make_bf16_tensor_map(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                                 const cuuint32_t* box, const char* who);

// The attention kernels' view of a contiguous [batch, rows, heads, D] BF16 tensor: a 4-D map
// (D innermost) whose box is 64 columns x box_rows rows of one head of one batch.
CUtensorMap make_bhd_tensor_map(const void* base, int64_t batch, int64_t rows, int64_t heads, int D, int box_rows,
                                const char* who);

}  // namespace tessera::cuda
