// MoE router on the GPU: scores (softmax or sigmoid), group-limited top-k, renormalised
// routing probabilities, the capacity limit, per-expert counts and the two auxiliary
// losses, forward and backward, with the CPU reference's rules (backend/cpu/moe.cpp).
//
// Layout: logits [N, E] row-major, E <= 1024. Forward: one 256-thread block per token keeps
// the row's scores in shared memory and runs k block-wide argmax rounds (ties to the lower
// index, as the CPU). A second launch, one block per expert, walks the assignments in token
// order with a block scan: the rank of each assignment within its expert decides the
// capacity drop, and the same pass counts the expert's load and sums its scores column.
// A one-block launch then forms the losses. Every sum has a fixed order: no atomics.
// Floor: the router reads N*E logits and writes N*E scores (8 experts x 16K tokens:
// ~1 MB, a few microseconds); the per-expert pass rereads the N*k indices E times from L2,
// fine up to a few hundred experts.
#include <cub/block/block_scan.cuh>

#include <climits>
#include <cmath>

#include "cuda_check.h"
#include "moe.h"
#include "moe_common.cuh"

namespace tessera::cuda {
namespace {

using namespace moe_detail;

constexpr int kThreads = 256;

struct RouterParams {
  int64_t tokens, experts, k;
  bool sigmoid, normalize;
  int64_t groups, topk_groups;
  float scaling;
  int64_t capacity;  // LLONG_MAX: none
};

__device__ __forceinline__ int expert_of(int32_t index) { return index >= 0 ? index : -index - 1; }

__global__ void router_topk_kernel(AnyPtr logits, const float* bias, float* scores, AnyPtr probs, int32_t* indices,
                                   float* lse_out, RouterParams p) {
  extern __shared__ float shared[];
  float* s = shared;                   // [E] scores
  float* sel = shared + p.experts;     // [E] selection scores
  float* gscore = sel + p.experts;     // [groups]
  unsigned char* taken = reinterpret_cast<unsigned char*>(gscore + (p.groups > 1 ? p.groups : 1));  // [E]
  __shared__ int chosen[1024];
  const int64_t n = blockIdx.x, E = p.experts;
  const int tid = threadIdx.x;

  float m = -INFINITY;
  for (int64_t e = tid; e < E; e += blockDim.x) {
    const float x = logits.load(n * E + e);
    s[e] = x;
    m = fmaxf(m, x);
  }
  m = block_max(m);
  float part = 0;
  for (int64_t e = tid; e < E; e += blockDim.x) part += expf(s[e] - m);
  const float sum = block_sum(part);
  if (tid == 0) lse_out[n] = m + logf(sum);
  for (int64_t e = tid; e < E; e += blockDim.x) {
    const float x = s[e];
    const float v = p.sigmoid ? 1.0f / (1.0f + expf(-x)) : expf(x - m) / sum;
    s[e] = v;
    scores[n * E + e] = v;
    sel[e] = v + (bias ? bias[e] : 0.0f);
    taken[e] = 0;
  }
  __syncthreads();
  if (p.groups > 1) {
    const int64_t gsize = E / p.groups;
    for (int64_t g = tid; g < p.groups; g += blockDim.x) {
      int b0 = -1, b1 = -1;
      for (int64_t e = g * gsize; e < (g + 1) * gsize; ++e) {
        if (better(sel[e], int(e), b0 < 0 ? 0.0f : sel[b0], b0)) {
          b1 = b0;
          b0 = int(e);
        } else if (better(sel[e], int(e), b1 < 0 ? 0.0f : sel[b1], b1)) {
          b1 = int(e);
        }
      }
      gscore[g] = sel[b0] + (b1 >= 0 ? sel[b1] : 0.0f);
    }
    __syncthreads();
    if (tid == 0) {
      // A handful of groups: one thread picks them (ties to the lower group).
      for (int64_t g = 0; g < p.groups; ++g) chosen[g] = 0;
      for (int64_t r = 0; r < p.topk_groups; ++r) {
        int best = -1;
        for (int64_t g = 0; g < p.groups; ++g)
          if (!chosen[g] && better(gscore[g], int(g), best < 0 ? 0.0f : gscore[best], best)) best = int(g);
        chosen[best] = 1;
      }
    }
    __syncthreads();
    for (int64_t e = tid; e < E; e += blockDim.x)
      if (!chosen[e / gsize]) taken[e] = 1;
    __syncthreads();
  }
  __shared__ int picked[1024];
  for (int64_t j = 0; j < p.k; ++j) {
    float bv = 0;
    int bi = -1;
    for (int64_t e = tid; e < E; e += blockDim.x)
      if (!taken[e] && better(sel[e], int(e), bv, bi)) {
        bv = sel[e];
        bi = int(e);
      }
    const int best = block_argmax(bv, bi);
    if (tid == 0) {
      taken[best] = 1;
      picked[j] = best;
    }
    __syncthreads();
  }
  if (tid == 0) {
    double total = 0;
    for (int64_t j = 0; j < p.k; ++j) total += s[picked[j]];
    for (int64_t j = 0; j < p.k; ++j) {
      float w = s[picked[j]];
      if (p.normalize && total > 0) w = static_cast<float>(double(w) / total);
      probs.store(n * p.k + j, w * p.scaling);
      indices[n * p.k + j] = picked[j];
    }
  }
}

// One block per expert: walks the assignments in token order, drops those past the
// capacity, and writes the expert's kept count, routed count and score column sum.
__global__ void router_expert_kernel(int32_t* indices, AnyPtr probs, const float* scores, int32_t* counts,
                                     int32_t* routed_out, float* colsum, RouterParams p, bool want_colsum) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int e = blockIdx.x;
  const int64_t assignments = p.tokens * p.k;
  int64_t routed = 0;
  for (int64_t base = 0; base < assignments; base += kThreads) {
    const int64_t a = base + threadIdx.x;
    const int flag = a < assignments && indices[a] == e;
    int rank, total;
    Scan(scan).ExclusiveSum(flag, rank, total);
    if (flag && routed + rank >= p.capacity) {
      indices[a] = -e - 1;
      probs.store(a, 0.0f);
    }
    routed += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    counts[e] = static_cast<int32_t>(routed < p.capacity ? routed : p.capacity);
    if (routed_out) routed_out[e] = static_cast<int32_t>(routed);
  }
  if (want_colsum) {
    float part = 0;
    for (int64_t n = threadIdx.x; n < p.tokens; n += blockDim.x) part += scores[n * p.experts + e];
    const float sum = block_sum(part);
    if (threadIdx.x == 0) colsum[e] = sum;
  }
}

__global__ void router_losses_kernel(const int32_t* routed, const float* colsum, const float* lse, void* losses,
                                     bool losses_f64, int64_t tokens, int64_t experts, int64_t k, float aux_coeff,
                                     float z_coeff) {
  float aux = 0, z = 0;
  if (aux_coeff != 0)
    for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) aux += float(routed[e]) * colsum[e];
  if (z_coeff != 0)
    for (int64_t n = threadIdx.x; n < tokens; n += blockDim.x) z += lse[n] * lse[n];
  aux = block_sum(aux);
  z = block_sum(z);
  if (threadIdx.x != 0) return;
  const double a = tokens > 0 ? double(aux_coeff) * double(experts) / double(tokens * k) * double(aux) / double(tokens) : 0.0;
  const double zl = tokens > 0 ? double(z_coeff) * double(z) / double(tokens) : 0.0;
  if (losses_f64) {
    static_cast<double*>(losses)[0] = a;
    static_cast<double*>(losses)[1] = zl;
  } else {
    static_cast<float*>(losses)[0] = static_cast<float>(a);
    static_cast<float*>(losses)[1] = static_cast<float>(zl);
  }
}

__global__ void routed_count_kernel(const int32_t* indices, int32_t* routed, int64_t assignments) {
  const int e = blockIdx.x;
  int part = 0;
  for (int64_t a = threadIdx.x; a < assignments; a += blockDim.x) part += expert_of(indices[a]) == e;
  const float total = block_sum(static_cast<float>(part));  // exact below 2^24 assignments
  if (threadIdx.x == 0) routed[e] = static_cast<int32_t>(total);
}

__global__ void router_backward_kernel(AnyPtr logits, const float* scores, const int32_t* indices, AnyPtr d_probs,
                                       const int32_t* routed, AnyPtr d_logits, RouterParams p, float aux_grad,
                                       float z_grad) {
  extern __shared__ float shared[];
  float* s = shared;
  float* ds = shared + p.experts;
  const int64_t n = blockIdx.x, E = p.experts;
  const int tid = threadIdx.x;
  for (int64_t e = tid; e < E; e += blockDim.x) {
    s[e] = scores[n * E + e];
    ds[e] = aux_grad != 0 ? aux_grad * float(routed[e]) : 0.0f;
  }
  __syncthreads();
  if (tid == 0) {
    double total = 0, dot = 0;
    for (int64_t j = 0; j < p.k; ++j) {
      const int32_t idx = indices[n * p.k + j];
      const int e = expert_of(idx);
      const double g = idx >= 0 ? double(d_probs.load(n * p.k + j)) * p.scaling : 0.0;
      total += s[e];
      dot += g * s[e];
    }
    for (int64_t j = 0; j < p.k; ++j) {
      const int32_t idx = indices[n * p.k + j];
      const int e = expert_of(idx);
      const double g = idx >= 0 ? double(d_probs.load(n * p.k + j)) * p.scaling : 0.0;
      ds[e] += (p.normalize && total > 0) ? static_cast<float>(g / total - dot / (total * total)) : static_cast<float>(g);
    }
  }
  __syncthreads();
  float sd = 0;
  if (!p.sigmoid) {
    for (int64_t e = tid; e < E; e += blockDim.x) sd += ds[e] * s[e];
    sd = block_sum(sd);
  }
  float lse = 0;
  if (z_grad != 0) {
    float m = -INFINITY;
    for (int64_t e = tid; e < E; e += blockDim.x) m = fmaxf(m, logits.load(n * E + e));
    m = block_max(m);
    float part = 0;
    for (int64_t e = tid; e < E; e += blockDim.x) part += expf(logits.load(n * E + e) - m);
    lse = m + logf(block_sum(part));
  }
  for (int64_t e = tid; e < E; e += blockDim.x) {
    float dl = p.sigmoid ? ds[e] * s[e] * (1.0f - s[e]) : s[e] * (ds[e] - sd);
    if (z_grad != 0) dl += z_grad * lse * expf(logits.load(n * E + e) - lse);
    d_logits.store(n * E + e, dl);
  }
}

RouterParams params_of(const Tensor& logits, const RouterOptions& o) {
  RouterParams p;
  p.tokens = logits.size(0);
  p.experts = logits.size(1);
  p.k = o.top_k;
  p.sigmoid = o.score == RouterScore::Sigmoid;
  p.normalize = o.normalize;
  p.groups = o.num_groups > 1 ? o.num_groups : 1;
  p.topk_groups = o.topk_groups;
  p.scaling = o.scaling;
  p.capacity = o.capacity_factor > 0
                   ? static_cast<int64_t>(std::ceil(double(o.capacity_factor) * double(p.tokens * p.k) / double(p.experts)))
                   : LLONG_MAX;
  return p;
}

}  // namespace

bool moe_router_supported(const Tensor& logits, const Tensor& probs, const Tensor& losses, const RouterOptions& o) {
  return f32_or_bf16(logits) && f32_or_bf16(probs) && logits.size(1) <= 1024 && o.top_k <= 1024 &&
         (losses.dtype() == DType::F32 || losses.dtype() == DType::F64);
}

void moe_router_forward(void* stream, const Tensor& logits, const Tensor& expert_bias, const RouterOptions& o,
                        Tensor& scores, Tensor& probs, Tensor& indices, Tensor& counts, Tensor& losses) {
  auto s = static_cast<cudaStream_t>(stream);
  const RouterParams p = params_of(logits, o);
  const Device dev = logits.device();
  Tensor lse = Tensor::empty({p.tokens > 0 ? p.tokens : 1}, DType::F32, dev);
  Tensor routed = Tensor::empty({p.experts}, DType::I32, dev);
  Tensor colsum = Tensor::empty({p.experts}, DType::F32, dev);
  if (p.tokens > 0) {
    const size_t smem = sizeof(float) * (2 * p.experts + p.groups) + p.experts;
    router_topk_kernel<<<static_cast<unsigned>(p.tokens), kThreads, smem, s>>>(
        any_ptr(logits), expert_bias.defined() ? expert_bias.data<float>() : nullptr, scores.data<float>(), any_ptr(probs),
        indices.data<int32_t>(), lse.data<float>(), p);
    TESSERA_CUDA_CHECK_LAUNCH();
  }
  router_expert_kernel<<<static_cast<unsigned>(p.experts), kThreads, 0, s>>>(
      indices.data<int32_t>(), any_ptr(probs), scores.data<float>(), counts.data<int32_t>(), routed.data<int32_t>(),
      colsum.data<float>(), p, o.aux_loss_coeff != 0);
  TESSERA_CUDA_CHECK_LAUNCH();
  router_losses_kernel<<<1, kThreads, 0, s>>>(routed.data<int32_t>(), colsum.data<float>(), lse.data<float>(),
                                              losses.raw_data(), losses.dtype() == DType::F64, p.tokens, p.experts, p.k,
                                              o.aux_loss_coeff, o.z_loss_coeff);
  TESSERA_CUDA_CHECK_LAUNCH();
}

bool moe_router_backward_supported(const Tensor& logits, const Tensor& scores, const Tensor& d_probs,
                                   const Tensor& d_logits, const RouterOptions&) {
  return f32_or_bf16(logits) && scores.dtype() == DType::F32 && f32_or_bf16(d_probs) && f32_or_bf16(d_logits) &&
         logits.size(1) <= 1024;
}

void moe_router_backward(void* stream, const Tensor& logits, const Tensor& scores, const Tensor& indices,
                         const Tensor& d_probs, const RouterOptions& o, float loss_scale, Tensor& d_logits) {
  auto s = static_cast<cudaStream_t>(stream);
  const RouterParams p = params_of(logits, o);
  if (p.tokens == 0) return;
  Tensor routed = Tensor::empty({p.experts}, DType::I32, logits.device());
  float aux_grad = 0;
  if (o.aux_loss_coeff != 0) {
    routed_count_kernel<<<static_cast<unsigned>(p.experts), kThreads, 0, s>>>(indices.data<int32_t>(),
                                                                               routed.data<int32_t>(), p.tokens * p.k);
    TESSERA_CUDA_CHECK_LAUNCH();
    aux_grad = static_cast<float>(double(loss_scale) * o.aux_loss_coeff * double(p.experts) /
                                  (double(p.tokens * p.k) * double(p.tokens)));
  }
  const float z_grad = static_cast<float>(double(loss_scale) * o.z_loss_coeff * 2.0 / double(p.tokens));
  router_backward_kernel<<<static_cast<unsigned>(p.tokens), kThreads, sizeof(float) * 2 * p.experts, s>>>(
      any_ptr(logits), scores.data<float>(), indices.data<int32_t>(), any_ptr(d_probs), routed.data<int32_t>(),
      any_ptr(d_logits), p, aux_grad, z_grad);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
