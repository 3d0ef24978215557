// Attention forward and backward through cuDNN's fused flash attention, written directly
// against the cuDNN backend graph API: tensor, pointwise, matmul, reduction and reshape
// descriptors form an operation graph in the shape cuDNN's runtime-fusion SDPA engines
// recognise; engine heuristics (mode A, then the fallback list) give engine configs, the
// first that finalizes becomes the execution plan, cached per shape, strides, dtype, causal
// flag and device. No cudnn_frontend: the graphs below follow the SDPA nodes of NVIDIA's
// cudnn-frontend (read for the pattern the engines match, not copied).
//
// Layout: tessera's [B, T, H, D] tensors are handed over as cuDNN's [b, h, s, d] with their
// own strides (b: stride(0), h: stride(2), s: stride(1), d: stride(3) = 1), so strided views
// work; K (and V in backward) enter transposed, [b, h, d, s], by swapping two strides. GQA
// is cuDNN's broadcast of the kv heads in the matmuls (Hq a multiple of Hkv); in backward the
// per-query-head dK/dV are reduced over the group inside the graph, so dk and dv come out
// summed and overwritten. Causal masking is bottom-right aligned like tessera's: the row
// index is shifted by S - T (two INT32 pointwise ops) before the row >= column comparison;
// with T == S the shift is left out. The forward's stats output (F32 [b, h, s_q, 1]) is the
// natural-log log-sum-exp of the scaled, masked scores, i.e. tessera's lse [B, Hq, T]
// exactly, and the backward reads it back the same way, so lse crosses backends.
//
// The backward graph needs two F32 buffers of its own besides cuDNN's workspace: rowsum(dO*O)
// ([b, hq, s_q, 1]) and the dQ accumulator ([b, hq, s_q, d], which cuDNN >= 9.6 clears
// itself). All three come from tessera's caching allocator per call. cuDNN's dQ uses atomics:
// unlike tessera's backward it is not bitwise repeatable.
//
// Floor: the same FLOPs as tessera's kernels (forward 4 * B * Hq * T * S * D, half when
#include "attention_cudnn.h"

#if TESSERA_WITH_CUDNN
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <vector>

#include "attention_cudnn_graph.h"
#include "cuda_check.h"
#endif

namespace tessera::cuda {

#if TESSERA_WITH_CUDNN

namespace {

using namespace cudnn_graph;

// ---- Handles, plans, execution -----------------------------------------------------------

struct DeviceState {
  cudnnHandle_t handle = nullptr;
  std::mutex mutex;  // the handle's stream binding and execution
};

DeviceState& device_state(int device) {
  static std::mutex mutex;
  static DeviceState* states[64] = {};  // leaked on purpose, like the allocator
  std::lock_guard<std::mutex> lock(mutex);
  TESSERA_CHECK(device >= 0 && device < 64, "attention on cuDNN: device index ", device, " out of range");
  if (!states[device]) {
    int previous = 0;
    TESSERA_CUDA_CHECK(cudaGetDevice(&previous));
    TESSERA_CUDA_CHECK(cudaSetDevice(device));
    auto* s = new DeviceState();
    const cudnnStatus_t status = cudnnCreate(&s->handle);
    TESSERA_CUDA_CHECK(cudaSetDevice(previous));
    if (status != CUDNN_STATUS_SUCCESS) {
      delete s;
      fail_cudnn("cudnnCreate", status);
    }
    if (verbose())
      std::fprintf(stderr, "tessera cuDNN: handle for cuda:%d, cuDNN %zu (built against %d), cudart %zu\n", device,
                   cudnnGetVersion(), CUDNN_VERSION, cudnnGetCudartVersion());
    states[device] = s;
  }
  return *states[device];
}

struct Plan {
  bool ok = false;
  std::string why;  // why there is no plan, or the build log
  std::vector<Desc> keep;
  Raw plan = nullptr;
  int64_t workspace = 0;
  std::vector<int64_t> bound_uids;
};

std::shared_ptr<Plan> make_plan(GraphBuilder& g, cudnnHandle_t handle, const std::string& what) {
  auto p = std::make_shared<Plan>();
  std::ostringstream log;
  log << what << ": " << g.ops.size() << " operations";
  try {
    Desc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    SET_ATTR(graph.get(), CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    SET_ATTR(graph.get(), CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
             static_cast<int64_t>(g.ops.size()), g.ops.data());
    finalize(graph.get(), "operation graph");
    int64_t engines = -1, n = 0;
    if (cudnnBackendGetAttribute(graph.get(), CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT, CUDNN_TYPE_INT64, 1, &n,
                                 &engines) == CUDNN_STATUS_SUCCESS)
      log << ", " << engines << " engines in total";
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      const char* mode_name = mode == CUDNN_HEUR_MODE_A ? "A" : "fallback";
      Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
      Raw graph_raw = graph.get();
      SET_ATTR(heur.get(), CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph_raw);
      SET_ATTR(heur.get(), CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
      cudnnStatus_t s = cudnnBackendFinalize(heur.get());
      if (s != CUDNN_STATUS_SUCCESS) {
        log << "; heuristics " << mode_name << ": " << status_text(s);
        continue;
      }
      int64_t count = 0;
      s = cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                   nullptr);
      if (s != CUDNN_STATUS_SUCCESS) {
        log << "; heuristics " << mode_name << " count: " << status_text(s);
        continue;
      }
      std::vector<Desc> configs;
      std::vector<Raw> raw;
      for (int64_t i = 0; i < count; ++i) {
        configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config");
        raw.push_back(configs.back().get());
      }
      int64_t returned = 0;
      if (count > 0) {
        s = cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                                     &returned, raw.data());
        if (s != CUDNN_STATUS_SUCCESS) {
          log << "; heuristics " << mode_name << " results: " << status_text(s);
          continue;
        }
      }
      log << "; heuristics " << mode_name << ": " << returned << " engine configs";
      for (int64_t i = 0; i < returned; ++i) {
        Desc plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
        SET_ATTR(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
        SET_ATTR(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw[i]);
        s = cudnnBackendFinalize(plan.get());
        if (s != CUDNN_STATUS_SUCCESS) {
          log << "; config " << i << ": " << status_text(s);
          continue;
        }
        int64_t ws = 0, got = 0;
        s = cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got,
                                     &ws);
        if (s != CUDNN_STATUS_SUCCESS) {
          log << "; config " << i << " workspace size: " << status_text(s);
          continue;
        }
        log << "; config " << i << " finalized, workspace " << ws << " bytes";
        p->ok = true;
        p->plan = plan.get();
        p->workspace = ws;
        p->bound_uids = g.bound_uids;
        p->keep = std::move(g.keep);
        p->keep.push_back(std::move(graph));
        p->keep.push_back(std::move(configs[static_cast<size_t>(i)]));
        p->keep.push_back(std::move(plan));
        p->why = log.str();
        if (verbose()) std::fprintf(stderr, "tessera cuDNN: %s\n", p->why.c_str());
        return p;
      }
    }
  } catch (const Error& e) {
    log << "; " << e.what();
  }
  p->why = log.str();
  if (verbose()) std::fprintf(stderr, "tessera cuDNN: no plan: %s\n", p->why.c_str());
  return p;
}

std::string describe_shape(const Tensor& q, const Tensor& k, bool causal) {
  std::ostringstream out;
  out << "B=" << q.size(0) << " T=" << q.size(1) << " S=" << k.size(1) << " Hq=" << q.size(2) << " Hkv=" << k.size(2)
      << " D=" << q.size(3) << " " << dtype_name(q.dtype()) << (causal ? " causal" : "");
  return out.str();
}

// The plan for these tensors, built on first sight and cached (failures too) for the
// process. `build` fills the operation graph.
template <typename Build>
std::shared_ptr<Plan> cached_plan(const char* what, const Tensor& q, const Tensor& k, bool backward, bool causal,
                                  std::initializer_list<const Tensor*> tensors, Build&& build) {
  const int device = q.device().index;
  std::vector<int64_t> key{device, backward ? 1 : 0, static_cast<int64_t>(q.dtype()), causal ? 1 : 0};
  for (const Tensor* t : tensors) {
    key.push_back(t->dim());
    for (int i = 0; i < t->dim(); ++i) {
      key.push_back(t->size(i));
      key.push_back(t->stride(i));
    }
  }
  static std::mutex mutex;
  static auto* plans = new std::map<std::vector<int64_t>, std::shared_ptr<Plan>>();  // leaked on purpose
  std::lock_guard<std::mutex> lock(mutex);
  auto it = plans->find(key);
  if (it != plans->end()) return it->second;
  const std::string name = std::string(what) + " " + describe_shape(q, k, causal);
  DeviceState& state = device_state(device);
  std::shared_ptr<Plan> plan;
  try {
    GraphBuilder g;
    build(g);
    plan = make_plan(g, state.handle, name);
  } catch (const Error& e) {
    plan = std::make_shared<Plan>();
    plan->why = name + ": building the operation graph: " + e.what();
    if (verbose()) std::fprintf(stderr, "tessera cuDNN: no plan: %s\n", plan->why.c_str());
  }
  plans->emplace(std::move(key), plan);
  return plan;
}

std::shared_ptr<Plan> forward_plan(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                   const Tensor& lse, bool causal) {
  return cached_plan("forward", q, k, false, causal, {&q, &k, &v, &out, &lse},
                     [&](GraphBuilder& g) { build_forward(g, q, k, v, out, lse, causal); });
}

std::shared_ptr<Plan> backward_plan(const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& out, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                    const Tensor& dv, bool causal) {
  return cached_plan("backward", q, k, true, causal, {&d_out, &q, &k, &v, &out, &lse, &dq, &dk, &dv},
                     [&](GraphBuilder& g) { build_backward(g, d_out, q, k, v, out, lse, dq, dk, dv, causal); });
}

// Binds the tensors (pointers indexed by uid) and runs the plan on `stream`.
void execute(const Plan& plan, int device, void* stream, void* const* pointers, void* workspace) {
  std::vector<int64_t> uids = plan.bound_uids;
  std::vector<void*> data;
  for (int64_t uid : uids) data.push_back(pointers[uid]);
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack");
  SET_ATTR(pack.get(), CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()),
           uids.data());
  SET_ATTR(pack.get(), CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(data.size()),
           data.data());
  SET_ATTR(pack.get(), CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  finalize(pack.get(), "variant pack");
  DeviceState& state = device_state(device);
  std::lock_guard<std::mutex> lock(state.mutex);
  TESSERA_CUDNN_CHECK(cudnnSetStream(state.handle, static_cast<cudaStream_t>(stream)));
  TESSERA_CUDNN_CHECK(cudnnBackendExecute(state.handle, plan.plan, pack.get()));
}

int compute_major(int device) {
  static std::mutex mutex;
  static int majors[64] = {};
  std::lock_guard<std::mutex> lock(mutex);
  if (device < 0 || device >= 64) return 0;
  if (majors[device] == 0) TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&majors[device], cudaDevAttrComputeCapabilityMajor, device));
  return majors[device];
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0; }

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

}  // namespace

int cudnn_version() { return static_cast<int>(cudnnGetVersion()); }

std::string cudnn_attention_unsupported_reason(const Tensor& q, const Tensor& k, const Tensor& lse, bool causal,
                                               std::initializer_list<const Tensor*> others) {
  if (q.dtype() != DType::BF16 && q.dtype() != DType::F16)
    return std::string("cuDNN attention runs BF16 and F16 only, not ") + dtype_name(q.dtype());
  if (lse.dtype() != DType::F32) return std::string("cuDNN's stats (lse) are F32, not ") + dtype_name(lse.dtype());
  if (q.dim() != 4 || k.dim() != 4 || lse.dim() != 3) return "q and k must be 4-D and lse 3-D";
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), S = k.size(1), Hkv = k.size(2);
  if (B < 1 || T < 1 || S < 1 || Hq < 1 || Hkv < 1) return "no batch, query, key or head to compute";
  if (Hq % Hkv != 0) return "q heads are not a multiple of kv heads";
  if (T == 1 && S == 1) return "one query and one key (cuDNN's backward refuses s_q = s_kv = 1)";
  if (causal && T > S) return "causal with more queries than keys";
  if (T > 0x7fffffff || S > 0x7fffffff) return "sequences longer than 2^31";
  if (cudnn_version() < 90000) return "needs cuDNN 9, loaded " + std::to_string(cudnn_version());
  const int major = compute_major(q.device().index);
  if (major < 8) return "needs a GPU of compute capability 8.0 or newer";
  const int64_t max_d = major == 9 ? 256 : 128;
  if (D % 8 != 0 || D > max_d)
    return "head dim " + std::to_string(D) + " is not a multiple of 8 up to " + std::to_string(max_d);
  std::vector<const Tensor*> all{&q, &k};
  all.insert(all.end(), others.begin(), others.end());
  for (const Tensor* t : all) {
    if (t->dtype() != q.dtype() || t->dim() != 4) return t->describe() + " is not a 4-D tensor of q's dtype";
    if (t->stride(3) != 1) return "the head dim of " + t->describe() + " is not contiguous";
    for (int i = 0; i < 3; ++i)
      if (t->stride(i) % 8 != 0) return "the strides of " + t->describe() + " are not multiples of 16 bytes";
    if (!aligned16(*t)) return t->describe() + " is not 16-byte aligned";
  }
  if (lse.stride(2) != 1 || !aligned16(lse)) return "lse " + lse.describe() + " is not contiguous along T or not 16-byte aligned";
  return "";
}

bool cudnn_attention_supported(const Tensor& q, const Tensor& k, const Tensor& lse, bool causal,
                               std::initializer_list<const Tensor*> others) {
  return cudnn_attention_unsupported_reason(q, k, lse, causal, others).empty();
}

bool cudnn_attention_forward_ready(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                   const Tensor& lse, bool causal, std::string* why) {
  std::string reason = cudnn_attention_unsupported_reason(q, k, lse, causal, {&v, &out});
  if (reason.empty()) {
    auto plan = forward_plan(q, k, v, out, lse, causal);
    if (plan->ok) return true;
    reason = plan->why;
  }
  if (why) *why = reason;
  return false;
}

bool cudnn_attention_backward_ready(const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& out, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                    const Tensor& dv, bool causal, std::string* why) {
  std::string reason = cudnn_attention_unsupported_reason(q, k, lse, causal, {&v, &d_out, &out, &dq, &dk, &dv});
  if (reason.empty()) {
    auto plan = backward_plan(d_out, q, k, v, out, lse, dq, dk, dv, causal);
    if (plan->ok) return true;
    reason = plan->why;
  }
  if (why) *why = reason;
  return false;
}

void cudnn_attention_forward(void* stream, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                             Tensor& lse, bool causal, float scale) {
  const std::string reason = cudnn_attention_unsupported_reason(q, k, lse, causal, {&v, &out});
  TESSERA_CHECK(reason.empty(), "attention_forward on cuDNN: ", reason);
  const std::shared_ptr<Plan> plan = forward_plan(q, k, v, out, lse, causal);
  TESSERA_CHECK(plan->ok, "attention_forward on cuDNN: no execution plan: ", plan->why);
  float scale_value = scale, neg_inf = -std::numeric_limits<float>::infinity();
  int32_t seq_q = static_cast<int32_t>(q.size(1)), seq_kv = static_cast<int32_t>(k.size(1));
  void* pointers[kUidCount] = {};
  pointers[kQ] = q.raw_data();
  pointers[kK] = k.raw_data();
  pointers[kV] = v.raw_data();
  pointers[kO] = out.raw_data();
  pointers[kStats] = lse.raw_data();
  pointers[kScale] = &scale_value;
  pointers[kNegInf] = &neg_inf;
  pointers[kSeqQ] = &seq_q;
  pointers[kSeqKV] = &seq_kv;
  // Scratch from the caching allocator: returned when this returns, reused in stream order.
  Tensor workspace;
  if (plan->workspace > 0) workspace = Tensor::empty({plan->workspace}, DType::U8, q.device());
  execute(*plan, q.device().index, stream, pointers, plan->workspace > 0 ? workspace.raw_data() : nullptr);
}

void cudnn_attention_backward(void* stream, const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, bool causal,
                              float scale) {
  const std::string reason = cudnn_attention_unsupported_reason(q, k, lse, causal, {&v, &d_out, &out, &dq, &dk, &dv});
  TESSERA_CHECK(reason.empty(), "attention_backward on cuDNN: ", reason);
  const std::shared_ptr<Plan> plan = backward_plan(d_out, q, k, v, out, lse, dq, dk, dv, causal);
  TESSERA_CHECK(plan->ok, "attention_backward on cuDNN: no execution plan: ", plan->why);
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  // cuDNN's workspace, then rowsum(dO * O) and the F32 dQ accumulator the graph names.
  const int64_t ws_bytes = round_up(plan->workspace, 256), delta_bytes = round_up(B * Hq * T * 4, 256),
                accum_bytes = B * Hq * T * D * 4;
  Tensor scratch = Tensor::empty({ws_bytes + delta_bytes + accum_bytes}, DType::U8, q.device());
  char* base = static_cast<char*>(scratch.raw_data());
  if (cudnn_version() < 90600)  // older cuDNN leaves clearing the accumulator to the caller
    TESSERA_CUDA_CHECK(cudaMemsetAsync(base + ws_bytes + delta_bytes, 0, static_cast<size_t>(accum_bytes),
                                       static_cast<cudaStream_t>(stream)));
  float scale_value = scale, neg_inf = -std::numeric_limits<float>::infinity(), one = 1.0f;
  int32_t seq_q = static_cast<int32_t>(T), seq_kv = static_cast<int32_t>(k.size(1));
  void* pointers[kUidCount] = {};
  pointers[kQ] = q.raw_data();
  pointers[kK] = k.raw_data();
  pointers[kV] = v.raw_data();
  pointers[kO] = out.raw_data();
  pointers[kStats] = lse.raw_data();
  pointers[kDO] = d_out.raw_data();
  pointers[kDQ] = dq.raw_data();
  pointers[kDK] = dk.raw_data();
  pointers[kDV] = dv.raw_data();
  pointers[kScale] = &scale_value;
  pointers[kNegInf] = &neg_inf;
  pointers[kSeqQ] = &seq_q;
  pointers[kSeqKV] = &seq_kv;
  pointers[kOne] = &one;
  pointers[kSoftmaxSum] = base + ws_bytes;
  pointers[kDQAccum] = base + ws_bytes + delta_bytes;
  execute(*plan, q.device().index, stream, pointers, ws_bytes > 0 ? base : nullptr);
}

#else  // no cuDNN in this build

int cudnn_version() { return 0; }

std::string cudnn_attention_unsupported_reason(const Tensor&, const Tensor&, const Tensor&, bool,
                                               std::initializer_list<const Tensor*>) {
  return "this build has no cuDNN (TESSERA_WITH_CUDNN=0)";
}

bool cudnn_attention_supported(const Tensor&, const Tensor&, const Tensor&, bool, std::initializer_list<const Tensor*>) {
  return false;
}

bool cudnn_attention_forward_ready(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool,
                                   std::string* why) {
  if (why) *why = "this build has no cuDNN (TESSERA_WITH_CUDNN=0)";
  return false;
}

bool cudnn_attention_backward_ready(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                    const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, std::string* why) {
  if (why) *why = "this build has no cuDNN (TESSERA_WITH_CUDNN=0)";
  return false;
}

void cudnn_attention_forward(void*, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, bool, float) {
  TESSERA_FAIL("attention_forward on cuDNN: this build has no cuDNN (TESSERA_WITH_CUDNN=0)");
}

void cudnn_attention_backward(void*, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, Tensor&, Tensor&, Tensor&, bool, float) {
  TESSERA_FAIL("attention_backward on cuDNN: this build has no cuDNN (TESSERA_WITH_CUDNN=0)");
}

#endif  // TESSERA_WITH_CUDNN

}  // namespace tessera::cuda