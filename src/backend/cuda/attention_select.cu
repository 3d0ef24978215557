// Which attention backend runs a CUDA call: tessera's own kernels (attention_fwd.cu,
// attention_bwd.cu, attention_generic.cu) or cuDNN's fused flash attention
// (attention_cudnn.cu), per tessera::attention_backend().
//
// Auto decides once per shape key (device, B, T, S, Hq, Hkv, D, dtype, causal): when both
// backends can run it, forward+backward of each runs once untimed (cuDNN builds its plans
// there) and twice timed with CUDA events on scratch tensors of that shape (random data,
// from the caching allocator, returned afterwards); the faster is kept and one line on
// stderr says which and by how much. When tessera has only its generic (CUDA-core) kernel
// for the shape, cuDNN is taken without timing. The timing synchronises the stream, so a
// shape must first be seen outside CUDA graph capture (the usual warm-up step); under
// capture an unseen shape runs tessera's kernels and is decided later. Both backends write
// the same lse, so a forward from one and a backward from the other agree anyway.
//
// No kernels here; the cost is the one-time timing (~3 forward+backward per backend).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <vector>

#include "attention.h"
#include "attention_cudnn.h"
#include "cuda_check.h"
#include "tessera/core/random.h"
#include "tessera/ops/attention.h"

namespace tessera::cuda {

namespace {

using Key = std::vector<int64_t>;

struct Registry {
  std::mutex mutex;
  std::map<Key, bool> use_cudnn;  // Auto's decisions
  std::set<Key> noted;            // Cudnn requests that fell back, noted once
  std::vector<std::string> log;
};

Registry& registry() {
  static auto* r = new Registry();  // leaked on purpose: read during static destruction
  return *r;
}

Key key_of(const Tensor& q, const Tensor& k, bool causal) {
  return {q.device().index, q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3),
          static_cast<int64_t>(q.dtype()), causal ? 1 : 0};
}

std::string shape_text(const Tensor& q, const Tensor& k, bool causal) {
  std::ostringstream out;
  out << "attention B=" << q.size(0) << " T=" << q.size(1);
  if (k.size(1) != q.size(1)) out << " S=" << k.size(1);
  out << " Hq=" << q.size(2) << " Hkv=" << k.size(2) << " D=" << q.size(3) << (causal ? " causal " : " ")
      << dtype_name(q.dtype());
  return out.str();
}

void report(Registry& r, const std::string& line) {
  std::fprintf(stderr, "tessera: %s\n", line.c_str());
  r.log.push_back(line);
}

// Best of two timed runs of f (after one untimed run), in milliseconds.
template <typename F>
float time_ms(cudaStream_t stream, F&& f) {
  f();
  cudaEvent_t start, stop;
  TESSERA_CUDA_CHECK(cudaEventCreate(&start));
  TESSERA_CUDA_CHECK(cudaEventCreate(&stop));
  float best = 0;
  for (int rep = 0; rep < 2; ++rep) {
    TESSERA_CUDA_CHECK(cudaEventRecord(start, stream));
    f();
    TESSERA_CUDA_CHECK(cudaEventRecord(stop, stream));
    TESSERA_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    TESSERA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    best = rep == 0 ? ms : std::min(best, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

// Auto's decision for the shape of q and k, made with scratch tensors; `line` says why.
bool decide(void* stream, const Tensor& q, const Tensor& k, bool causal, float scale, std::string& line) {
  const Device dev = q.device();
  const DType t = q.dtype();
  const Shape q_shape = q.shape(), kv_shape = k.shape(), lse_shape{q.size(0), q.size(2), q.size(1)};
  Tensor sq = Tensor::empty(q_shape, t, dev), sk = Tensor::empty(kv_shape, t, dev), sv = Tensor::empty(kv_shape, t, dev);
  Tensor so = Tensor::empty(q_shape, t, dev), sdo = Tensor::empty(q_shape, t, dev);
  Tensor sdq = Tensor::empty(q_shape, t, dev), sdk = Tensor::empty(kv_shape, t, dev), sdv = Tensor::empty(kv_shape, t, dev);
  Tensor slse = Tensor::empty(lse_shape, DType::F32, dev);
  Context ctx = Context::cuda(dev.index, stream);
  fill_normal(ctx, sq, 0.0f, 1.0f, 0x5eed1);
  fill_normal(ctx, sk, 0.0f, 1.0f, 0x5eed2);
  fill_normal(ctx, sv, 0.0f, 1.0f, 0x5eed3);
  fill_normal(ctx, sdo, 0.0f, 1.0f, 0x5eed4);
  const std::string head = shape_text(q, k, causal);

  std::string why;
  if (!cudnn_attention_forward_ready(sq, sk, sv, so, slse, causal, &why) ||
      !cudnn_attention_backward_ready(sdo, sq, sk, sv, so, slse, sdq, sdk, sdv, causal, &why)) {
    line = head + " -> tessera (cuDNN has no plan: " + why + ")";
    return false;
  }
  if (!attention_fast_path(sq, sk, slse, {&sv, &so, &sdo, &sdq, &sdk, &sdv})) {
    line = head + " -> cudnn (tessera has only its generic CUDA-core kernel for this shape)";
    return true;
  }
  auto s = static_cast<cudaStream_t>(stream);
  float cudnn_ms = 0;
  try {
    cudnn_ms = time_ms(s, [&] {
      cudnn_attention_forward(stream, sq, sk, sv, so, slse, causal, scale);
      cudnn_attention_backward(stream, sdo, sq, sk, sv, so, slse, sdq, sdk, sdv, causal, scale);
    });
  } catch (const Error& e) {
    line = head + " -> tessera (cuDNN failed: " + e.what() + ")";
    return false;
  }
  const float tessera_ms = time_ms(s, [&] {
    attention_forward_fast(stream, sq, sk, sv, so, slse, causal, scale);
    attention_backward_fast(stream, sdo, sq, sk, sv, so, slse, sdq, sdk, sdv, causal, scale, attention_deterministic());
  });
  const bool use_cudnn = cudnn_ms < tessera_ms;
  char times[128];
  std::snprintf(times, sizeof(times), " (fwd+bwd %.3f ms vs %s %.3f ms)", use_cudnn ? cudnn_ms : tessera_ms,
                use_cudnn ? "tessera" : "cudnn", use_cudnn ? tessera_ms : cudnn_ms);
  line = head + (use_cudnn ? " -> cudnn" : " -> tessera") + times;
  return use_cudnn;
}

bool capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TESSERA_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  return status != cudaStreamCaptureStatusNone;
}

// Whether cuDNN should take a call with these tensors; `ready` builds (or finds) the plan
// for this call's exact tensors and says why not when there is none.
template <typename Ready>
bool use_cudnn(void* stream, const Tensor& q, const Tensor& k, bool causal, float scale, const std::string& reason,
               Ready&& ready) {
  const AttentionBackend mode = attention_backend();
  if (mode == AttentionBackend::Tessera) return false;
  Registry& r = registry();
  const Key key = key_of(q, k, causal);
  std::string why = reason;
  // A cuDNN failure while planning (no handle, say) means tessera runs the call.
  auto safe_ready = [&](std::string* w) {
    try {
      return ready(w);
    } catch (const Error& e) {
      *w = e.what();
      return false;
    }
  };
  if (mode == AttentionBackend::Cudnn) {
    if (why.empty() && safe_ready(&why)) return true;
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.noted.insert(key).second)
      report(r, shape_text(q, k, causal) + " -> tessera (cuDNN was asked for but cannot run it: " + why + ")");
    return false;
  }
  if (!why.empty()) return false;  // Auto: cuDNN cannot take these tensors at all
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.use_cudnn.find(key);
    if (it == r.use_cudnn.end()) {
      if (capturing(stream)) return false;  // decided at the shape's next uncaptured call
      std::string line;
      bool choice = false;
      try {
        choice = decide(stream, q, k, causal, scale, line);
      } catch (const Error& e) {
        line = shape_text(q, k, causal) + " -> tessera (cuDNN failed: " + e.what() + ")";
      }
      it = r.use_cudnn.emplace(key, choice).first;
      report(r, line);
    }
    if (!it->second) return false;
  }
  // This call's strides may differ from the scratch tensors'; without a plan for them,
  // tessera runs the call (same results, same lse).
  return safe_ready(&why);
}

}  // namespace

bool attention_use_cudnn_forward(void* stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                 const Tensor& lse, bool causal, float scale) {
  if (attention_backend() == AttentionBackend::Tessera) return false;
  return use_cudnn(stream, q, k, causal, scale, cudnn_attention_unsupported_reason(q, k, lse, causal, {&v, &out}),
                   [&](std::string* why) { return cudnn_attention_forward_ready(q, k, v, out, lse, causal, why); });
}

bool attention_use_cudnn_backward(void* stream, const Tensor& d_out, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dq,
                                  const Tensor& dk, const Tensor& dv, bool causal, float scale) {
  if (attention_backend() == AttentionBackend::Tessera) return false;
  return use_cudnn(
      stream, q, k, causal, scale, cudnn_attention_unsupported_reason(q, k, lse, causal, {&v, &d_out, &out, &dq, &dk, &dv}),
      [&](std::string* why) { return cudnn_attention_backward_ready(d_out, q, k, v, out, lse, dq, dk, dv, causal, why); });
}

std::vector<std::string> attention_backend_choice_log() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.log;
}

void clear_attention_backend_choice_log() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.use_cudnn.clear();
  r.noted.clear();
  r.log.clear();
}

}  // namespace tessera::cuda
