#include "tessera/train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "tessera/ops/elementwise.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/optimizer.h"

namespace tessera::train {

double learning_rate(const OptimizerConfig& c, int64_t step, int64_t total_steps) {
  if (c.warmup_steps > 0 && step <= c.warmup_steps) return c.lr * double(step) / double(c.warmup_steps);
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - c.warmup_steps);
  const double progress = std::min(1.0, double(step - c.warmup_steps) / double(decay_steps));
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return c.lr * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * cosine);
}

Optimizer::Optimizer(nn::ParameterList parameters, const OptimizerConfig& config)
    : params_(std::move(parameters)), config_(config) {
  for (nn::Parameter* p : params_) {
    const Tensor& w = p->weights();  // FP32 masters of a BF16 model: the moments match them
    exp_avg_.push_back(Tensor::zeros(w.shape(), w.dtype(), w.device()));
    exp_avg_sq_.push_back(Tensor::zeros(w.shape(), w.dtype(), w.device()));
  }
}

double Optimizer::step(Context& ctx, double lr) {
  // Global norm: each parameter's sum of squares into its own slot of one device tensor,
  // read back with a single copy (one host sync per step, not one per parameter).
  const DType acc = params_.empty() ? DType::F32 : params_[0]->grad.dtype();
  const int64_t n = static_cast<int64_t>(params_.size());
  Tensor partials = Tensor::empty({std::max<int64_t>(n, 1)}, acc == DType::F64 ? DType::F64 : DType::F32, ctx.device);
  for (int64_t i = 0; i < n; ++i) {
    Tensor slot = partials.slice(0, i, i + 1);
    sum_of_squares(ctx, params_[i]->grad, slot);
  }
  double total = 0;
  if (n > 0) {
    const Tensor host = partials.to(Device::cpu());
    for (int64_t i = 0; i < n; ++i) total += host.item(i);
  }
  const double norm = std::sqrt(total);
  const double clip = (config_.grad_clip > 0 && norm > config_.grad_clip) ? config_.grad_clip / (norm + 1e-6) : 1.0;
  step_ += 1;
  for (size_t i = 0; i < params_.size(); ++i) {
    nn::Parameter* p = params_[i];
    // Scaling lr and eps with the clip factor would not be the same update as clipping
    // (Adam is scale invariant except for eps), so the gradient itself is scaled.
    if (clip != 1.0) scale(ctx, p->grad, static_cast<float>(clip), p->grad);
    const AdamWOptions options{.lr = float(lr), .beta1 = float(config_.beta1), .beta2 = float(config_.beta2),
                               .eps = float(config_.eps),
                               .weight_decay = p->weight_decay ? float(config_.weight_decay) : 0.0f, .step = step_};
    adamw_step(ctx, p->weights(), p->grad, exp_avg_[i], exp_avg_sq_[i], options);
    p->refresh_value(ctx);
  }
  return norm;
}

std::vector<std::pair<std::string, Tensor>> Optimizer::state() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back(params_[i]->name + ".exp_avg", exp_avg_[i]);
    out.emplace_back(params_[i]->name + ".exp_avg_sq", exp_avg_sq_[i]);
  }
  return out;
}

void Optimizer::load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step) {
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : tensors) by_name[name] = &t;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (auto [suffix, target] : {std::pair{".exp_avg", &exp_avg_[i]}, std::pair{".exp_avg_sq", &exp_avg_sq_[i]}}) {
      const std::string name = params_[i]->name + suffix;
      auto it = by_name.find(name);
      TESSERA_CHECK(it != by_name.end(), "optimizer state: missing tensor '", name, "'");
      TESSERA_CHECK(it->second->shape() == target->shape(), "optimizer state: '", name, "' has shape ",
                    it->second->shape_string(), ", the model needs ", target->shape_string());
      Tensor converted = Tensor::empty(target->shape(), target->dtype());
      Context cpu = Context::cpu();
      cast(cpu, it->second->to(Device::cpu()).contiguous(), converted);
      target->copy_from(converted.to(target->device()));
    }
  }
  step_ = step;
}

}  // namespace tessera::train
