#include "tessera/ops/moe.h"

#include <atomic>
#include <numeric>

#include "backend/cpu/moe.h"
#include "dispatch.h"
#include "moe_checks.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/grouped_gemm_wgmma.h"
#include "backend/cuda/moe.h"
#endif

namespace tessera {
namespace {

using namespace moe_detail;




void check_i32(const Tensor& t, const char* op, const char* name, const Shape& shape) {
  TESSERA_CHECK(t.defined() && t.dtype() == DType::I32 && t.is_contiguous() && t.shape() == shape, op, ": ", name,
                " must be a contiguous i32", shape_to_string(shape), ", got ",
                t.defined() ? t.describe() : std::string("undefined"));
}


void check_options(const RouterOptions& o, int64_t experts, const char* op) {
  TESSERA_CHECK(experts >= 1 && experts <= 1024, op, ": the number of experts must be in [1, 1024], got ", experts);
  TESSERA_CHECK(o.top_k >= 1 && o.top_k <= experts, op, ": top_k must be in [1, ", experts, "], got ", o.top_k);
  if (o.num_groups > 1) {
    TESSERA_CHECK(experts % o.num_groups == 0, op, ": num_groups (", o.num_groups, ") must divide the experts (",
                  experts, ")");
    TESSERA_CHECK(o.topk_groups >= 1 && o.topk_groups <= o.num_groups, op, ": topk_groups must be in [1, ",
                  o.num_groups, "], got ", o.topk_groups);
    TESSERA_CHECK(o.topk_groups * (experts / o.num_groups) >= o.top_k, op, ": topk_groups (", o.topk_groups,
                  ") groups of ", experts / o.num_groups, " experts cannot hold top_k = ", o.top_k);
  }
}

DType scores_dtype(DType logits) { return logits == DType::F64 ? DType::F64 : DType::F32; }

}  // namespace

void moe_router_forward(Context& ctx, const Tensor& logits, const Tensor& expert_bias, const RouterOptions& o,
                        Tensor& scores, Tensor& probs, Tensor& indices, Tensor& counts, Tensor& losses) {
  const char* op = "moe_router_forward";
  check_matrix(logits, op, "logits");
  check_float(logits, op, "logits");
  const int64_t n = logits.size(0), e = logits.size(1);
  check_options(o, e, op);
  if (expert_bias.defined())
    TESSERA_CHECK(expert_bias.dtype() == DType::F32 && expert_bias.is_contiguous() && expert_bias.shape() == Shape{e},
                  op, ": expert_bias must be f32[", e, "], got ", expert_bias.describe());
  check_shaped(scores, {n, e}, op, "scores");
  TESSERA_CHECK(scores.dtype() == scores_dtype(logits.dtype()), op, ": scores must be ",
                dtype_name(scores_dtype(logits.dtype())), " for ", dtype_name(logits.dtype()), " logits");
  check_shaped(probs, {n, o.top_k}, op, "probs");
  check_i32(indices, op, "indices", {n, o.top_k});
  check_i32(counts, op, "counts", {e});
  TESSERA_CHECK(losses.defined() && losses.shape() == Shape{2} && (losses.dtype() == DType::F32 || losses.dtype() == DType::F64),
                op, ": losses must be f32[2] or f64[2]");
  check_on_device(ctx, op, {&logits, &expert_bias, &scores, &probs, &indices, &counts, &losses});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::moe_router_supported(logits, probs, losses, o)) {
      cuda::moe_router_forward(ctx.stream, logits, expert_bias, o, scores, probs, indices, counts, losses);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::moe_router_forward(logits, expert_bias, o, scores, probs, indices, counts, losses);
}

void moe_router_backward(Context& ctx, const Tensor& logits, const Tensor& scores, const Tensor& indices,
                         const Tensor& d_probs, const RouterOptions& o, float loss_scale, Tensor& d_logits) {
  const char* op = "moe_router_backward";
  check_matrix(logits, op, "logits");
  check_float(logits, op, "logits");
  const int64_t n = logits.size(0), e = logits.size(1);
  check_options(o, e, op);
  check_shaped(scores, {n, e}, op, "scores");
  check_i32(indices, op, "indices", {n, o.top_k});
  check_shaped(d_probs, {n, o.top_k}, op, "d_probs");
  check_shaped(d_logits, {n, e}, op, "d_logits");
  check_on_device(ctx, op, {&logits, &scores, &indices, &d_probs, &d_logits});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::moe_router_backward_supported(logits, scores, d_probs, d_logits, o)) {
      cuda::moe_router_backward(ctx.stream, logits, scores, indices, d_probs, o, loss_scale, d_logits);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::moe_router_backward(logits, scores, indices, d_probs, o, loss_scale, d_logits);
}

void moe_update_expert_bias(Context& ctx, const Tensor& load, float rate, Tensor& bias) {
  const char* op = "moe_update_expert_bias";
  TESSERA_CHECK(bias.defined() && bias.dim() == 1 && bias.dtype() == DType::F32 && bias.is_contiguous(), op,
                ": bias must be a contiguous f32 vector");
  TESSERA_CHECK(load.defined() && load.shape() == bias.shape(), op, ": load must have bias's shape ",
                bias.shape_string());
  check_on_device(ctx, op, {&load, &bias});
  // E values once per optimizer step: computed on the host wherever they live.
  if (ctx.device.is_cuda()) {
    Tensor host_bias = bias.to(Device::cpu());
    cpu::moe_update_expert_bias(load.to(Device::cpu()), rate, host_bias);
    bias.copy_from(host_bias);
    return;
  }
  cpu::moe_update_expert_bias(load, rate, bias);
}

void moe_routing_map(Context& ctx, const Tensor& indices, int64_t num_experts, Tensor& row_map, Tensor& offsets) {
  const char* op = "moe_routing_map";
  TESSERA_CHECK(indices.defined() && indices.dim() == 2, op, ": indices must be i32[N, k]");
  check_i32(indices, op, "indices", indices.shape());
  check_i32(row_map, op, "row_map", indices.shape());
  check_i32(offsets, op, "offsets", {num_experts + 1});
  check_on_device(ctx, op, {&indices, &row_map, &offsets});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (num_experts <= 1024) {
      cuda::moe_routing_map(ctx.stream, indices, num_experts, row_map, offsets);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::moe_routing_map(indices, num_experts, row_map, offsets);
}

void moe_permute_forward(Context& ctx, const Tensor& x, const Tensor& row_map, const Tensor& probs, Tensor& permuted,
                         Tensor& permuted_probs) {
  const char* op = "moe_permute_forward";
  check_matrix(x, op, "x");
  check_float(x, op, "x");
  TESSERA_CHECK(row_map.defined() && row_map.dim() == 2 && row_map.size(0) == x.size(0), op,
                ": row_map must be i32[N, k] with N = ", x.size(0));
  check_i32(row_map, op, "row_map", row_map.shape());
  const int64_t n = x.size(0), k = row_map.size(1);
  check_shaped(permuted, {n * k, x.size(1)}, op, "permuted");
  TESSERA_CHECK(permuted.dtype() == x.dtype(), op, ": permuted must have x's dtype");
  TESSERA_CHECK(probs.defined() == permuted_probs.defined(), op, ": probs and permuted_probs come together");
  if (probs.defined()) {
    check_shaped(probs, {n, k}, op, "probs");
    check_shaped(permuted_probs, {n * k}, op, "permuted_probs");
  }
  check_on_device(ctx, op, {&x, &row_map, &probs, &permuted, &permuted_probs});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::moe_permute_supported({&x, &permuted}, {&probs, &permuted_probs})) {
      cuda::moe_permute_forward(ctx.stream, x, row_map, probs, permuted, permuted_probs);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::moe_permute_forward(x, row_map, probs, permuted, permuted_probs);
}

void moe_permute_backward(Context& ctx, const Tensor& row_map, const Tensor& d_permuted, const Tensor& d_permuted_probs,
                          Tensor& dx, Tensor& d_probs) {
  const char* op = "moe_permute_backward";
  check_matrix(dx, op, "dx");
  check_float(dx, op, "dx");
  TESSERA_CHECK(row_map.defined() && row_map.dim() == 2 && row_map.size(0) == dx.size(0), op,
                ": row_map must be i32[N, k] with N = ", dx.size(0));
  check_i32(row_map, op, "row_map", row_map.shape());
  const int64_t n = dx.size(0), k = row_map.size(1);
  check_shaped(d_permuted, {n * k, dx.size(1)}, op, "d_permuted");
  TESSERA_CHECK(d_permuted.dtype() == dx.dtype(), op, ": d_permuted must have dx's dtype");
  TESSERA_CHECK(d_probs.defined() == d_permuted_probs.defined(), op, ": d_probs and d_permuted_probs come together");
  if (d_probs.defined()) {
    check_shaped(d_probs, {n, k}, op, "d_probs");
    check_shaped(d_permuted_probs, {n * k}, op, "d_permuted_probs");
  }
  check_on_device(ctx, op, {&row_map, &d_permuted, &d_permuted_probs, &dx, &d_probs});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::moe_permute_supported({&d_permuted, &dx}, {&d_permuted_probs, &d_probs})) {
      cuda::moe_permute_backward(ctx.stream, row_map, d_permuted, d_permuted_probs, dx, d_probs);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::moe_permute_backward(row_map, d_permuted, d_permuted_probs, dx, d_probs);
}

void moe_unpermute_forward(Context& ctx, const Tensor& expert_out, const Tensor& row_map, const Tensor& probs,
                           Tensor& y) {
  const char* op = "moe_unpermute_forward";
  check_matrix(y, op, "y");
  check_float(y, op, "y");
  TESSERA_CHECK(row_map.defined() && row_map.dim() == 2 && row_map.size(0) == y.size(0), op,
                ": row_map must be i32[N, k] with N = ", y.size(0));
  check_i32(row_map, op, "row_map", row_map.shape());
  const int64_t n = y.size(0), k = row_map.size(1);
  check_shaped(expert_out, {n * k, y.size(1)}, op, "expert_out");
  TESSERA_CHECK(expert_out.dtype() == y.dtype(), op, ": expert_out must have y's dtype");
  if (probs.defined()) check_shaped(probs, {n, k}, op, "probs");
  check_on_device(ctx, op, {&expert_out, &row_map, &probs, &y});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::moe_permute_supported({&expert_out, &y}, {&probs})) {
      cuda::moe_unpermute_forward(ctx.stream, expert_out, row_map, probs, y);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::moe_unpermute_forward(expert_out, row_map, probs, y);
}

void moe_unpermute_backward(Context& ctx, const Tensor& expert_out, const Tensor& row_map, const Tensor& probs,
                            const Tensor& dy, Tensor& d_expert_out, Tensor& d_probs) {
  const char* op = "moe_unpermute_backward";
  check_matrix(dy, op, "dy");
  check_float(dy, op, "dy");
  TESSERA_CHECK(row_map.defined() && row_map.dim() == 2 && row_map.size(0) == dy.size(0), op,
                ": row_map must be i32[N, k] with N = ", dy.size(0));
  check_i32(row_map, op, "row_map", row_map.shape());
  const int64_t n = dy.size(0), k = row_map.size(1);
  check_shaped(expert_out, {n * k, dy.size(1)}, op, "expert_out");
  check_shaped(d_expert_out, {n * k, dy.size(1)}, op, "d_expert_out");
  TESSERA_CHECK(expert_out.dtype() == dy.dtype() && d_expert_out.dtype() == dy.dtype(), op,
                ": expert_out, dy and d_expert_out must share a dtype");
  if (probs.defined()) check_shaped(probs, {n, k}, op, "probs");
  if (d_probs.defined()) {
    TESSERA_CHECK(probs.defined(), op, ": d_probs needs probs");
    check_shaped(d_probs, {n, k}, op, "d_probs");
  }
  check_on_device(ctx, op, {&expert_out, &row_map, &probs, &dy, &d_expert_out, &d_probs});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::moe_permute_supported({&expert_out, &dy, &d_expert_out}, {&probs, &d_probs})) {
      cuda::moe_unpermute_backward(ctx.stream, expert_out, row_map, probs, dy, d_expert_out, d_probs);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::moe_unpermute_backward(expert_out, row_map, probs, dy, d_expert_out, d_probs);
}

namespace {

std::atomic<bool>& swiglu_legacy_flag() {
  static std::atomic<bool> flag{legacy_from_environment()};
  return flag;
}

}  // namespace

bool moe_swiglu_legacy() { return swiglu_legacy_flag().load(std::memory_order_relaxed); }
void set_moe_swiglu_legacy(bool legacy) { swiglu_legacy_flag().store(legacy, std::memory_order_relaxed); }

void moe_swiglu_scaled_forward(Context& ctx, const Tensor& x, const Tensor& scale, Tensor& y) {
  const char* op = "moe_swiglu_scaled_forward";
  const int64_t f = check_swiglu_input(x, scale, op);
  check_shaped(y, {x.size(0), f}, op, "y");
  check_on_device(ctx, op, {&x, &scale, &y});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::moe_permute_supported({&x, &y}, {&scale})) {
      cuda::moe_swiglu_scaled_forward(ctx.stream, x, scale, y, moe_swiglu_legacy());
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::moe_swiglu_scaled_forward(x, scale, y);
}

void moe_swiglu_scaled_backward(Context& ctx, const Tensor& x, const Tensor& scale, const Tensor& dy, Tensor& dx,
                                Tensor& d_scale, Tensor* dx_amax) {
  const char* op = "moe_swiglu_scaled_backward";
  const int64_t f = check_swiglu_input(x, scale, op);
  check_shaped(dy, {x.size(0), f}, op, "dy");
  check_shaped(dx, x.shape(), op, "dx");
  check_shaped(d_scale, {x.size(0)}, op, "d_scale");
  if (dx_amax)
    TESSERA_CHECK(dx_amax->defined() && dx_amax->dtype() == DType::F32 && dx_amax->shape() == Shape{1} &&
                      dx_amax->is_contiguous(),
                  op, ": dx_amax must be a contiguous f32[1]");
  const Tensor no_amax;
  check_on_device(ctx, op, {&x, &scale, &dy, &dx, &d_scale, dx_amax ? dx_amax : &no_amax});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::moe_permute_supported({&x, &dy, &dx}, {&scale, &d_scale})) {
      cuda::moe_swiglu_scaled_backward(ctx.stream, x, scale, dy, dx, d_scale, dx_amax, moe_swiglu_legacy());
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::moe_swiglu_scaled_backward(x, scale, dy, dx, d_scale);
  if (dx_amax) amax(ctx, dx, *dx_amax);
}

// GroupedLinear is a loop of the gemm op over the experts' row blocks, on every device: on
// CUDA each is one cuBLASLt call, so a result is bit-identical to calling gemm per expert.
// Empty experts issue no GEMM. On CUDA the experts' GEMMs go round-robin to side streams
// (stream_fan.h) when grouped_gemm_streams() > 1: one expert's GEMM rarely fills an H200,
// and on one stream they run one after another. Same calls, so the same bits.
namespace {

// 1: on the H200 four side streams measured no faster than one (bench_moe, Mixtral's expert
// MLP; bench/RESULTS.md), so the default keeps every GEMM on the context's stream.
int g_grouped_gemm_streams = 1;
}  // namespace

void set_grouped_gemm_streams(int streams) {
  TESSERA_CHECK(streams >= 1, "set_grouped_gemm_streams: need at least 1 stream, got ", streams);
  g_grouped_gemm_streams = streams;
}
int grouped_gemm_streams() { return g_grouped_gemm_streams; }

void grouped_linear_forward(Context& ctx, const Tensor& x, const Tensor& w, const std::vector<int64_t>& splits,
                            Tensor& y) {
  const char* op = "grouped_linear_forward";
  check_matrix(x, op, "x");
  TESSERA_CHECK(w.defined() && w.dim() == 3 && w.is_contiguous() && w.size(2) == x.size(1), op,
                ": w must be a contiguous [E, N, K] tensor with K = ", x.size(1), ", got ", w.describe());
  check_matrix(y, op, "y");
  TESSERA_CHECK(y.size(0) == x.size(0) && y.size(1) == w.size(1), op, ": y must be [", x.size(0), ", ", w.size(1),
                "], got ", y.describe());
  check_splits(splits, w.size(0), x.size(0), op);
  check_on_device(ctx, op, {&x, &w, &y});
#if TESSERA_WITH_CUDA
  // tessera's own persistent wgmma grouped GEMM (one launch for all experts) when selected
  // and the shapes qualify; rows past the splits are zeroed below as on the loop path.
  if (ctx.device.is_cuda() && cuda::grouped_gemm_backend() == cuda::GroupedGemmBackend::Own &&
      cuda::grouped_gemm_wgmma_supported(x, w, y)) {
    cuda::grouped_gemm_wgmma_forward(ctx.stream, x, w, splits, y);
  } else
#endif
  for_each_expert(ctx, splits, [&](Context& c, size_t e, int64_t row) {
    Tensor ye = y.slice(0, row, row + splits[e]);
    gemm(c, x.slice(0, row, row + splits[e]), w.select(0, static_cast<int64_t>(e)), ye, {.transpose_b = true});
  });
  const int64_t rows = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  if (rows < y.size(0)) y.slice(0, rows, y.size(0)).fill_zero();
}

void grouped_linear_backward_input(Context& ctx, const Tensor& dy, const Tensor& w, const std::vector<int64_t>& splits,
                                   Tensor& dx) {
  const char* op = "grouped_linear_backward_input";
  check_matrix(dy, op, "dy");
  TESSERA_CHECK(w.defined() && w.dim() == 3 && w.is_contiguous() && w.size(1) == dy.size(1), op,
                ": w must be a contiguous [E, N, K] tensor with N = ", dy.size(1), ", got ", w.describe());
  check_matrix(dx, op, "dx");
  TESSERA_CHECK(dx.size(0) == dy.size(0) && dx.size(1) == w.size(2), op, ": dx must be [", dy.size(0), ", ", w.size(2),
                "], got ", dx.describe());
  check_splits(splits, w.size(0), dy.size(0), op);
  check_on_device(ctx, op, {&dy, &w, &dx});
#if TESSERA_WITH_CUDA
  // The own kernel's dgrad (w read N-major) under the same switch as the forward.
  if (ctx.device.is_cuda() && cuda::grouped_gemm_backend() == cuda::GroupedGemmBackend::Own &&
      cuda::grouped_gemm_wgmma_backward_input_supported(dy, w, dx)) {
    cuda::grouped_gemm_wgmma_backward_input(ctx.stream, dy, w, splits, dx);
  } else
#endif
  for_each_expert(ctx, splits, [&](Context& c, size_t e, int64_t row) {
    Tensor dxe = dx.slice(0, row, row + splits[e]);
    gemm(c, dy.slice(0, row, row + splits[e]), w.select(0, static_cast<int64_t>(e)), dxe);
  });
  const int64_t rows = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  if (rows < dx.size(0)) dx.slice(0, rows, dx.size(0)).fill_zero();
}

void grouped_linear_backward_weight(Context& ctx, const Tensor& dy, const Tensor& x, const std::vector<int64_t>& splits,
                                    Tensor& dw, bool accumulate) {
  const char* op = "grouped_linear_backward_weight";
  check_matrix(dy, op, "dy");
  check_matrix(x, op, "x");
  TESSERA_CHECK(dy.size(0) == x.size(0), op, ": dy and x must have the same rows");
  TESSERA_CHECK(dw.defined() && dw.dim() == 3 && dw.is_contiguous() && dw.size(1) == dy.size(1) && dw.size(2) == x.size(1),
                op, ": dw must be a contiguous [E, ", dy.size(1), ", ", x.size(1), "] tensor, got ", dw.describe());
  check_splits(splits, dw.size(0), dy.size(0), op);
  check_on_device(ctx, op, {&dy, &x, &dw});
  if (!accumulate) moe_detail::zero_experts_without_rows(ctx, splits, dw);
  const float beta = accumulate ? 1.0f : 0.0f;
  for_each_expert(ctx, splits, [&](Context& c, size_t e, int64_t row) {
    Tensor dwe = dw.select(0, static_cast<int64_t>(e));
    gemm(c, dy.slice(0, row, row + splits[e]), x.slice(0, row, row + splits[e]), dwe,
         {.transpose_a = true, .beta = beta});
  });
}

}  // namespace tessera
