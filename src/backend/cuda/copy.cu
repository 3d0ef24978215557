// Strided device-to-device copy and zero fill.
//
// copy_strided moves a view with arbitrary strides into another (the QKV split of a fused
// projection, gathering gradients back into it, transposed views). Dimensions that are
// contiguous in both tensors are merged first, so the common "rows of D contiguous
// elements at a stride" case becomes a 2-D copy; when the merged rows are long and
// 16-byte aligned on both sides, each thread moves 16 bytes. Memory bound: the floor is
// 2 * bytes / 4.1 TB/s.
#include <cuda_runtime.h>

#include <algorithm>

#include "copy.h"
#include "cuda_check.h"
#include "tessera/core/error.h"

namespace tessera::cuda {
namespace {

constexpr int kMaxDims = 8;

struct Layout {
  int dims;
  int64_t shape[kMaxDims];
  int64_t dst_stride[kMaxDims];
  int64_t src_stride[kMaxDims];
};

// Element type T moved as a unit; `unit` elements of the logical tensor per T.
template <typename T>
__global__ void copy_strided_kernel(T* __restrict__ dst, const T* __restrict__ src, Layout layout, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = i, d_off = 0, s_off = 0;
    for (int d = layout.dims - 1; d >= 0; --d) {
      const int64_t idx = rest % layout.shape[d];
      rest /= layout.shape[d];
      d_off += idx * layout.dst_stride[d];
      s_off += idx * layout.src_stride[d];
    }
    dst[d_off] = src[s_off];
  }
}

template <typename T>
void launch(cudaStream_t stream, void* dst, const void* src, const Layout& layout) {
  int64_t count = 1;
  for (int d = 0; d < layout.dims; ++d) count *= layout.shape[d];
  if (count == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((count + threads - 1) / threads, 132 * 32);
  copy_strided_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(static_cast<T*>(dst), static_cast<const T*>(src),
                                                                       layout, count);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void fill_zero_bytes(void* stream, void* ptr, size_t bytes) {
  if (bytes == 0) return;
  TESSERA_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, static_cast<cudaStream_t>(stream)));
}

void copy_strided(void* stream, void* dst, const int64_t* dst_strides, const void* src, const int64_t* src_strides,
                  const int64_t* shape, int dims, size_t element_size) {
  TESSERA_CHECK(dims >= 0 && dims <= kMaxDims, "copy_strided: at most ", kMaxDims, " dimensions, got ", dims);
  auto s = static_cast<cudaStream_t>(stream);
  // Drop size-1 dimensions, then merge neighbours that are contiguous in both tensors.
  Layout l{};
  l.dims = 0;
  for (int d = 0; d < dims; ++d) {
    if (shape[d] == 1) continue;
    if (l.dims > 0 && l.dst_stride[l.dims - 1] == dst_strides[d] * shape[d] &&
        l.src_stride[l.dims - 1] == src_strides[d] * shape[d]) {
      l.shape[l.dims - 1] *= shape[d];
      l.dst_stride[l.dims - 1] = dst_strides[d];
      l.src_stride[l.dims - 1] = src_strides[d];
      continue;
    }
    l.shape[l.dims] = shape[d];
    l.dst_stride[l.dims] = dst_strides[d];
    l.src_stride[l.dims] = src_strides[d];
    l.dims += 1;
  }
  if (l.dims == 0) {  // a single element
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, src, element_size, cudaMemcpyDeviceToDevice, s));
    return;
  }
  // Widen the unit to 16 bytes when the innermost run is contiguous on both sides, its
  // length a multiple of the widening and every offset aligned.
  const int last = l.dims - 1;
  if (l.dst_stride[last] == 1 && l.src_stride[last] == 1) {
    const size_t widen = 16 / element_size;
    bool ok = widen > 1 && l.shape[last] % int64_t(widen) == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(src) % 16 == 0;
    for (int d = 0; d < last && ok; ++d) ok = l.dst_stride[d] % int64_t(widen) == 0 && l.src_stride[d] % int64_t(widen) == 0;
    if (ok) {
      l.shape[last] /= int64_t(widen);
      for (int d = 0; d < last; ++d) {
        l.dst_stride[d] /= int64_t(widen);
        l.src_stride[d] /= int64_t(widen);
      }
      launch<uint4>(s, dst, src, l);
      return;
    }
  }
  switch (element_size) {
    case 1: launch<uint8_t>(s, dst, src, l); break;
    case 2: launch<uint16_t>(s, dst, src, l); break;
    case 4: launch<uint32_t>(s, dst, src, l); break;
    case 8: launch<uint64_t>(s, dst, src, l); break;
    default: TESSERA_FAIL("copy_strided: element size ", element_size, " is not 1, 2, 4 or 8 bytes");
  }
}

}  // namespace tessera::cuda
