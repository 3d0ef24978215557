// cuDNN's fused flash attention as a second CUDA attention backend (attention_cudnn.cu),
// built directly on the cuDNN backend graph API (no cudnn_frontend). Same arguments and
// semantics as attention_forward_fast / attention_backward_fast (attention.h): tessera's
// [B, T, H, D] tensors, lse [B, Hq, T] F32 holding the natural-log log-sum-exp (cuDNN's
// "stats"), bottom-right causal mask, GQA, dq/dk/dv overwritten.
//
// Strides come from the tensors (Tensor::stride), so q, k, v may be strided views (for
// instance slices of one fused [B, T, Hq + 2 Hkv, D] QKV buffer) as long as the head dim
// is contiguous. Built without cuDNN (TESSERA_WITH_CUDNN=0), nothing is supported and the
// entry points throw.
#pragma once

#include <initializer_list>
#include <string>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// Empty when cuDNN can take these tensors (checked before any plan is built): BF16 or F16
// q, k, v (and `others`), lse F32, head dim a multiple of 8 up to 128 (256 on Hopper),
// every pointer 16-byte aligned, head dim contiguous, other strides multiples of 8
// elements, at least one query and one key, not T = S = 1 (cuDNN's backward refuses it),
// a GPU of compute capability 8.0 or newer. Otherwise a sentence saying why not.
std::string cudnn_attention_unsupported_reason(const Tensor& q, const Tensor& k, const Tensor& lse, bool causal,
                                               std::initializer_list<const Tensor*> others = {});
bool cudnn_attention_supported(const Tensor& q, const Tensor& k, const Tensor& lse, bool causal,
                               std::initializer_list<const Tensor*> others = {});

// Builds (or finds in the cache) the execution plan for these tensors. False when cuDNN
// has no engine for the graph; the failure is cached and `why` (when given) says what
// cuDNN answered. Plans are cached per (device, shape, strides, dtype, causal); the scale
// is passed by value at execution, so it does not key them.
bool cudnn_attention_forward_ready(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                   const Tensor& lse, bool causal, std::string* why = nullptr);
bool cudnn_attention_backward_ready(const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& out, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                    const Tensor& dv, bool causal, std::string* why = nullptr);

// Runs the plan on `stream` (the handle of q's device is bound to it for the call).
// Throws Error (with cuDNN's status and message) when the tensors are unsupported, no plan
// exists, or execution fails. Workspace comes from tessera's caching allocator.
void cudnn_attention_forward(void* stream, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                             Tensor& lse, bool causal, float scale);
void cudnn_attention_backward(void* stream, const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, bool causal,
                              float scale);

// cudnnGetVersion() of the loaded library (e.g. 91900), 0 without cuDNN.
int cudnn_version();

}  // namespace tessera::cuda
