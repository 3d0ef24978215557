#include "tessera/ops/optimizer.h"

#include "backend/cpu/optimizer.h"
#include "dispatch.h"
#include "optimizer_checks.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/multi_tensor.h"
#include "backend/cuda/optimizer.h"
#endif

#include <algorithm>
#include <cmath>
#include <string>

namespace tessera {
namespace {

// Views of one arena may share a storage; only intersecting bytes are an error.
bool memory_overlaps(const Tensor& x, const Tensor& y) {
  if (x.numel() == 0 || y.numel() == 0) return false;
  const auto* x0 = static_cast<const char*>(x.raw_data());
  const auto* y0 = static_cast<const char*>(y.raw_data());
  return x0 < y0 + y.nbytes() && y0 < x0 + x.nbytes();
}

// The hyperparameter rules of torch.optim.AdamW (the weight decay is checked by the caller).
void check_adamw_options(const AdamWOptions& options, const char* op) {
  TESSERA_CHECK(options.step >= 1, op, ": step must be >= 1 (1-based, for bias correction), got ", options.step);
  TESSERA_CHECK(options.lr >= 0.0f, op, ": lr must be >= 0, got ", options.lr);
  TESSERA_CHECK(options.eps >= 0.0f, op, ": eps must be >= 0, got ", options.eps);
  TESSERA_CHECK(options.beta1 >= 0.0f && options.beta1 < 1.0f, op, ": beta1 must be in [0, 1), got ", options.beta1);
  TESSERA_CHECK(options.beta2 >= 0.0f && options.beta2 < 1.0f, op, ": beta2 must be in [0, 1), got ", options.beta2);
}

// One tensor's AdamW operands: what adamw_step checks, with `what` naming the tensor.
void check_adamw_tensors(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                         const char* op, const std::string& what) {
  const std::string p = what + "param", g = what + "grad", m = what + "exp_avg", v = what + "exp_avg_sq";
  check_contiguous(param, op, p.c_str());
  check_contiguous(grad, op, g.c_str());
  check_contiguous(exp_avg, op, m.c_str());
  check_contiguous(exp_avg_sq, op, v.c_str());
  TESSERA_CHECK(param.dtype() == DType::F32 || param.dtype() == DType::F64, op, ": ", p,
                " (master weights) must be F32 or F64, got ", param.describe());
  check_floating(grad, op, g.c_str());
  check_dtype(exp_avg, param.dtype(), op, m.c_str());
  check_dtype(exp_avg_sq, param.dtype(), op, v.c_str());
  check_shape(grad, param.shape(), op, g.c_str());
  check_shape(exp_avg, param.shape(), op, m.c_str());
  check_shape(exp_avg_sq, param.shape(), op, v.c_str());
}

// Every tensor written must be disjoint from every other tensor of the call (written or
// read); read-only tensors may overlap each other. Sorting the byte ranges by start makes
// this O(n log n): any earlier range that overlaps the current one ends after its start.
struct ByteRange {
  const char* begin;
  const char* end;
  bool written;
};
void check_disjoint(std::vector<ByteRange>& ranges, const char* op) {
  std::sort(ranges.begin(), ranges.end(), [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  const char* written_end = nullptr;
  const char* any_end = nullptr;
  for (const ByteRange& r : ranges) {
    const bool hits_written = written_end && r.begin < written_end;
    const bool hits_any = any_end && r.begin < any_end;
    TESSERA_CHECK(!hits_written && !(r.written && hits_any), op,
                  ": the tensors it writes (params, moments, values) must not overlap each other or the gradients");
    if (r.written) written_end = std::max(written_end ? written_end : r.end, r.end);
    any_end = std::max(any_end ? any_end : r.end, r.end);
  }
}
void add_range(std::vector<ByteRange>& ranges, const Tensor& t, bool written) {
  if (!t.defined() || t.numel() == 0) return;
  const auto* begin = static_cast<const char*>(t.raw_data());
  ranges.push_back({begin, begin + t.nbytes(), written});
}

std::string tensor_label(size_t index) { return "tensor " + std::to_string(index) + ": "; }

}  // namespace

void adamw_step(Context& ctx, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamWOptions& options) {
  const char* op = "adamw_step";
  check_contiguous(param, op, "param");
  check_contiguous(grad, op, "grad");
  check_contiguous(exp_avg, op, "exp_avg");
  check_contiguous(exp_avg_sq, op, "exp_avg_sq");
  TESSERA_CHECK(param.dtype() == DType::F32 || param.dtype() == DType::F64, op,
                ": param (master weights) must be F32 or F64, got ", param.describe());
  check_floating(grad, op, "grad");
  check_dtype(exp_avg, param.dtype(), op, "exp_avg");
  check_dtype(exp_avg_sq, param.dtype(), op, "exp_avg_sq");
  check_shape(grad, param.shape(), op, "grad");
  check_shape(exp_avg, param.shape(), op, "exp_avg");
  check_shape(exp_avg_sq, param.shape(), op, "exp_avg_sq");
  TESSERA_CHECK(!memory_overlaps(param, exp_avg) && !memory_overlaps(param, exp_avg_sq) &&
                    !memory_overlaps(exp_avg, exp_avg_sq),
                op, ": param, exp_avg and exp_avg_sq must not overlap in memory");
  check_adamw_options(options, op);
  TESSERA_CHECK(options.weight_decay >= 0.0f, op, ": weight_decay must be >= 0, got ", options.weight_decay);
  check_on_device(ctx, op, {&param, &grad, &exp_avg, &exp_avg_sq});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::adamw_step_supported(param, grad)) {
      cuda::adamw_step(ctx.stream, param, grad, exp_avg, exp_avg_sq, options);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::adamw_step(param, grad, exp_avg, exp_avg_sq, options);
}

void global_grad_norm(Context& ctx, const std::vector<Tensor>& grads, Tensor& norm_out, MultiTensorCache* cache) {
  const char* op = "global_grad_norm";
  check_contiguous(norm_out, op, "norm_out");
  TESSERA_CHECK(norm_out.dtype() == DType::F32 || norm_out.dtype() == DType::F64, op,
                ": norm_out must be F32 or F64, got ", norm_out.describe());
  check_shape(norm_out, {1}, op, "norm_out");
  check_on_device(ctx, op, {&norm_out});
  std::vector<ByteRange> ranges;
  add_range(ranges, norm_out, true);
  for (size_t t = 0; t < grads.size(); ++t) {
    const std::string name = "grads[" + std::to_string(t) + "]";
    check_contiguous(grads[t], op, name.c_str());
    check_floating(grads[t], op, name.c_str());
    check_on_device(ctx, op, {&grads[t]});
    add_range(ranges, grads[t], false);
  }
  check_disjoint(ranges, op);
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::global_grad_norm_supported(grads, norm_out)) {
      MultiTensorCache local;
      cuda::global_grad_norm(ctx.stream, grads, norm_out, cache ? *cache : local);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  (void)cache;
  cpu::global_grad_norm(grads, norm_out);
}

std::array<double, kAdamWStepScalars> adamw_step_scalars(const AdamWOptions& options) {
  check_adamw_options(options, "adamw_step_scalars");
  // The CPU reference's expressions (backend/cpu/optimizer.cpp, T = float).
  const double step = static_cast<double>(options.step);
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(options.beta1), step);
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(options.beta2), step);
  const float step_size = static_cast<float>(static_cast<double>(options.lr) / bias_correction1);
  const float bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  return {static_cast<double>(options.lr), step, static_cast<double>(step_size),
          static_cast<double>(bias_correction2_sqrt)};
}

void check_adamw_step_multi(Context& ctx, const char* op, const std::vector<Tensor>& params,
                            const std::vector<Tensor>& grads, const std::vector<Tensor>& exp_avgs,
                            const std::vector<Tensor>& exp_avg_sqs, const std::vector<Tensor>& bf16_values,
                            const AdamWOptions& options, const std::vector<float>& weight_decays,
                            const Tensor& grad_norm, double max_norm, const Tensor& step_scalars) {
  const size_t n = params.size();
  TESSERA_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && weight_decays.size() == n,
                op, ": params, grads, exp_avgs, exp_avg_sqs and weight_decays must have one entry per tensor, got ",
                n, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), " and ",
                weight_decays.size());
  TESSERA_CHECK(bf16_values.empty() || bf16_values.size() == n, op,
                ": bf16_values must be empty or have one (possibly undefined) tensor per param, got ",
                bf16_values.size(), " for ", n, " params");
  check_adamw_options(options, op);
  TESSERA_CHECK(max_norm >= 0.0, op, ": max_norm must be >= 0 (0 disables clipping), got ", max_norm);
  if (max_norm > 0.0 || grad_norm.defined()) {
    check_contiguous(grad_norm, op, "grad_norm");
    TESSERA_CHECK(grad_norm.dtype() == DType::F32 || grad_norm.dtype() == DType::F64, op,
                  ": grad_norm must be F32 or F64, got ", grad_norm.describe());
    check_shape(grad_norm, {1}, op, "grad_norm");
    check_on_device(ctx, op, {&grad_norm});
  }
  std::vector<ByteRange> ranges;
  add_range(ranges, grad_norm, false);
  add_range(ranges, step_scalars, false);
  for (size_t t = 0; t < n; ++t) {
    const std::string what = tensor_label(t);
    check_adamw_tensors(params[t], grads[t], exp_avgs[t], exp_avg_sqs[t], op, what);
    TESSERA_CHECK(weight_decays[t] >= 0.0f, op, ": ", what, "weight_decay must be >= 0, got ", weight_decays[t]);
    check_on_device(ctx, op, {&params[t], &grads[t], &exp_avgs[t], &exp_avg_sqs[t]});
    add_range(ranges, params[t], true);
    add_range(ranges, grads[t], false);
    add_range(ranges, exp_avgs[t], true);
    add_range(ranges, exp_avg_sqs[t], true);
    if (!bf16_values.empty() && bf16_values[t].defined()) {
      const Tensor& value = bf16_values[t];
      const std::string name = what + "bf16_value";
      check_contiguous(value, op, name.c_str());
      check_dtype(value, DType::BF16, op, name.c_str());
      check_shape(value, params[t].shape(), op, name.c_str());
      check_on_device(ctx, op, {&value});
      add_range(ranges, value, true);
    }
  }
  check_disjoint(ranges, op);
}

void adamw_step_multi(Context& ctx, std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                      std::vector<Tensor>& exp_avgs, std::vector<Tensor>& exp_avg_sqs,
                      std::vector<Tensor>& bf16_values, const AdamWOptions& given_options,
                      const std::vector<float>& weight_decays, const Tensor& grad_norm, double max_norm,
                      MultiTensorCache* cache, const Tensor& step_scalars) {
  const char* op = "adamw_step_multi";
  AdamWOptions options = given_options;
  if (step_scalars.defined()) {
    // lr and step come from step_scalars: options' own are placeholders, checked no further.
    check_contiguous(step_scalars, op, "step_scalars");
    check_dtype(step_scalars, DType::F64, op, "step_scalars");
    check_shape(step_scalars, {kAdamWStepScalars}, op, "step_scalars");
    check_on_device(ctx, op, {&step_scalars});
    options.lr = 0.0f;
    options.step = 1;
  }
  check_adamw_step_multi(ctx, op, params, grads, exp_avgs, exp_avg_sqs, bf16_values, options, weight_decays,
                         grad_norm, max_norm, step_scalars);
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::adamw_step_multi_supported(params, grads, grad_norm)) {
      MultiTensorCache local;
      cuda::adamw_step_multi(ctx.stream, params, grads, exp_avgs, exp_avg_sqs, bf16_values, options, weight_decays,
                             grad_norm, max_norm, cache ? *cache : local, step_scalars);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (step_scalars.defined()) {
    // On the CPU the scalars are in host memory: the reference takes lr and step from them
    // and recomputes the rest with the same expressions.
    const double* s = step_scalars.data<double>();
    options.lr = static_cast<float>(s[0]);
    options.step = static_cast<int64_t>(s[1]);
    check_adamw_options(options, op);
  }
  cpu::adamw_step_multi(params, grads, exp_avgs, exp_avg_sqs, bf16_values, options, weight_decays, grad_norm,
                        max_norm);
}

void adamw_step_one(Context& ctx, AdamWTensorStep& step) {
  std::vector<Tensor> params{step.param}, grads{step.grad}, avgs{step.exp_avg}, avg_sqs{step.exp_avg_sq};
  std::vector<Tensor> values{step.value};
  adamw_step_multi(ctx, params, grads, avgs, avg_sqs, values, step.options, {step.weight_decay}, step.grad_norm,
                   step.max_norm);
}

}  // namespace tessera
