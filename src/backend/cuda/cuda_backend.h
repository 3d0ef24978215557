// What the core layer asks of the CUDA backend. Compiled only when TESSERA_WITH_CUDA is on;
// everything here takes the CUDA runtime's types as plain pointers so that C++-only
// translation units can include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "tessera/core/allocator.h"
#include "tessera/core/tensor.h"
#include "tessera/ops/gemm.h"

namespace tessera::cuda {

bool device_present();
// Streaming multiprocessors of `device` (cached; kernels size one wave of blocks by it).
int multiprocessor_count(int device);
Allocator& caching_allocator(int device_index);
// A copy on this thread's current stream of the CUDA device involved (tessera/core/stream.h):
// cudaMemcpy when that is the default stream; otherwise cudaMemcpyAsync, followed by a
// synchronisation of that stream when the host is one side.
void memcpy_any(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
void synchronize(void* stream);

// A non-blocking stream on `device` (cudaStreamNonBlocking) of CUDA stream priority
// `priority` (0: the default, which is also the lowest; negative: higher, clamped to the
// device's range), and its end (waits for its work; never throws).
void* create_stream(int device, int priority = 0);
void destroy_stream(int device, void* stream);
// Work queued on `waiter` from now on waits for everything queued on `producer` so far (an
// event, no host wait; capturable).
void stream_wait(void* waiter, void* producer);

// cudaMemcpyAsync on `stream` (any direction; no synchronisation: with host memory, use
// pinned buffers the host leaves alone until the stream has passed the copy).
void memcpy_async(void* dst, const void* src, size_t bytes, void* stream);

// Page-locked host memory (cudaHostAlloc), for copies that must not be staged.
void* pinned_host_alloc(size_t bytes);
void pinned_host_free(void* ptr);

// Private allocation pools of the caching allocator, for CUDA graphs (runtime.cu says how
// blocks move between a pool and the general free lists). Pool ids are never 0; selecting
// 0 returns this thread to the general lists. The selection is per thread and per device.
uint64_t create_allocation_pool(int device);
void select_allocation_pool(int device, uint64_t pool);
uint64_t selected_allocation_pool(int device);
// Call after the graph that used the pool is destroyed and its stream synchronised.
void release_allocation_pool(int device, uint64_t pool);

void fill_uniform(void* stream, Tensor& out, float low, float high, uint64_t seed, uint64_t offset);
void fill_normal(void* stream, Tensor& out, float mean, float std, uint64_t seed, uint64_t offset);
void cast(void* stream, const Tensor& in, Tensor& out);

// Elementwise kernels (backend/cuda/elementwise.cu): every operand F32, or every one BF16.
bool elementwise_supported(std::initializer_list<const Tensor*> tensors);
void add(void* stream, const Tensor& a, const Tensor& b, Tensor& out);
void scale(void* stream, const Tensor& in, float alpha, Tensor& out);
void gelu_forward(void* stream, const Tensor& x, Tensor& y);
void gelu_backward(void* stream, const Tensor& x, const Tensor& dy, Tensor& dx);
void swiglu_forward(void* stream, const Tensor& x, Tensor& y);
void swiglu_backward(void* stream, const Tensor& x, const Tensor& dy, Tensor& dx, Tensor* y = nullptr);

// 2-D transpose (backend/cuda/elementwise.cu): any dtype of 1, 2, 4 or 8 bytes, moved as
// raw bits through shared-memory tiles.
bool transpose_2d_supported(const Tensor& in);
void transpose_2d(void* stream, const Tensor& in, Tensor& out);

// Softmax over the last dimension (backend/cuda/softmax.cu); same dtype rule as above.
void softmax_forward(void* stream, const Tensor& x, Tensor& y);
void softmax_backward(void* stream, const Tensor& y, const Tensor& dy, Tensor& dx);

// cuBLASLt GEMM (backend/cuda/gemm.cu); gemm_supported says whether the dtypes have a path.
// With GemmEpilogue::Gelu, aux receives the pre-activation; with GeluBackward it is read.
// gemm_epilogue_supported says whether the GELU epilogues run for these tensors.
bool gemm_supported(const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& bias);
bool gemm_epilogue_supported(const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& bias, const Tensor& aux);
void gemm(void* stream, const Tensor& a, const Tensor& b, Tensor& c, bool transpose_a, bool transpose_b, float alpha,
          float beta, const Tensor& bias, GemmEpilogue epilogue = GemmEpilogue::None, const Tensor& aux = Tensor());
// Whether cuBLASLt has a kernel for this GEMM with the BiasGrad epilogue (bias: F32, the
// row sums of op(a)); builds and caches the plan, so the gemm call that follows reuses it.
bool gemm_bias_grad_available(const Tensor& a, const Tensor& b, const Tensor& c, bool transpose_a, bool transpose_b,
                              float beta, const Tensor& bias);

// Allocator statistics, for tests and the benchmark reports.
struct AllocatorStats {
  size_t bytes_in_use = 0;
  size_t bytes_cached = 0;
  size_t device_allocations = 0;  // calls that reached cudaMalloc
  size_t peak_bytes_in_use = 0;    // highwater marks since the start, for benchmark reports
  size_t peak_bytes_reserved = 0;  // in use + cached: what the process holds of the GPU
};
AllocatorStats allocator_stats(int device_index);

}  // namespace tessera::cuda
