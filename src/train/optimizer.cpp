#include "tessera/train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "tessera/models/transformer_lm.h"
#include "tessera/nn/moe.h"
#include "tessera/ops/elementwise.h"
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
  if (armed_) return finish_overlapped_step(ctx, lr);
  queue(ctx, options_for(lr, step_ + 1), Tensor());
  step_ += 1;
  // The one host wait of the step: everything above is queued by now.
  synchronize(ctx);
  return norm_.to(Device::cpu()).item(0);
}

AdamWOptions Optimizer::options_for(double lr, int64_t step) const {
  return AdamWOptions{.lr = float(lr), .beta1 = float(config_.beta1), .beta2 = float(config_.beta2),
                      .eps = float(config_.eps), .weight_decay = 0.0f, .step = step};
}

std::array<double, kAdamWStepScalars> Optimizer::step_scalars_for(double lr) const {
  return adamw_step_scalars(options_for(lr, step_ + 1));
}

void Optimizer::queue_step(Context& ctx, const Tensor& step_scalars) {
  TESSERA_CHECK(step_scalars.defined(), "Optimizer::queue_step: step_scalars is undefined");
  // lr and step are placeholders: the kernels read step_scalars.
  queue(ctx, options_for(0.0, 1), step_scalars);
}

std::vector<Tensor> Optimizer::step_buffers() const {
  std::vector<Tensor> out;
  for (const Tensor* t : {&norm_, &norm_cache_.device_table, &norm_cache_.scratch, &adamw_cache_.device_table,
                          &adamw_cache_.scratch})
    if (t->defined()) out.push_back(*t);
  return out;
}

void Optimizer::reset_device_tables() { norm_cache_ = adamw_cache_ = MultiTensorCache(); }

void Optimizer::queue(Context& ctx, const AdamWOptions& options, const Tensor& step_scalars) {
  // The norm stays F64 so that the clip factor is computed from the very double the
  // earlier per-parameter path computed on the host (the same bits on the CPU).
  if (!norm_.defined() || norm_.device() != ctx.device) norm_ = Tensor::zeros({1}, DType::F64, ctx.device);
  std::vector<size_t> all(params_.size()), multi;
  // A captured step cannot run the custom updates (they allocate and prime host-side caches).
  const bool custom = !step_scalars.defined() && !custom_order_.empty();
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i]->materialize_grad(ctx);  // a lazily zeroed gradient no backward wrote is zeros
    all[i] = i;
    if (!custom || !custom_[i]) multi.push_back(i);
  }
  const double max_norm = config_.grad_clip > 0 ? config_.grad_clip : 0.0;
  Lists l = lists_for(all, /*writes_values=*/!custom);
  global_grad_norm(ctx, l.grads, norm_, &norm_cache_);
  // Clipping scales the gradient, not lr and eps: Adam is scale invariant except for eps,
  // so scaling those would be another update.
  if (custom) l = lists_for(multi, /*writes_values=*/true);
  adamw_step_multi(ctx, l.weights, l.grads, l.exp_avg, l.exp_avg_sq, l.values, options, l.weight_decays, norm_,
                   max_norm, &adamw_cache_, step_scalars);
  for (size_t i : custom ? multi : all) params_[i]->value_stale = false;  // their values were written
  if (!custom) return;
  for (size_t i : custom_order_) {
    const Lists one = lists_for({i}, /*writes_values=*/false);
    AdamWTensorStep step{one.weights[0], one.grads[0], one.exp_avg[0], one.exp_avg_sq[0], one.values[0], options,
                         one.weight_decays[0], norm_, max_norm};
    custom_[i](ctx, step);
  }
}

void Optimizer::set_custom_update(const nn::Parameter& parameter, CustomUpdate update) {
  const auto it = std::find(params_.begin(), params_.end(), &parameter);
  TESSERA_CHECK(it != params_.end(), "Optimizer::set_custom_update: ", parameter.name, " is not one of this ",
                "optimizer's parameters");
  const size_t i = static_cast<size_t>(it - params_.begin());
  custom_.resize(params_.size());
  custom_order_.erase(std::remove(custom_order_.begin(), custom_order_.end(), i), custom_order_.end());
  custom_[i] = std::move(update);
  if (custom_[i]) custom_order_.push_back(i);
}

int use_cast_in_optimizer(models::TransformerLM& model, Optimizer& optimizer) {
  const std::vector<nn::GroupedLinear*> linears = model.expert_linears();
  for (nn::GroupedLinear* linear : linears)
    optimizer.set_custom_update(linear->weight,
                                [linear](Context& x, AdamWTensorStep& s) { linear->optimizer_update(x, s); });
  return static_cast<int>(linears.size());
}

Optimizer::Lists Optimizer::lists_for(const std::vector<size_t>& indices, bool writes_values) {
  Lists l;
  for (size_t i : indices) {
    nn::Parameter* p = params_[i];
    if (writes_values) p->own_value_memory();
    l.weights.push_back(p->weights());
    l.grads.push_back(p->grad);
    l.values.push_back(p->master.defined() ? p->value : Tensor());  // the BF16 copy to refresh
    l.exp_avg.push_back(exp_avg_[i]);
    l.exp_avg_sq.push_back(exp_avg_sq_[i]);
    l.weight_decays.push_back(p->weight_decay ? float(config_.weight_decay) : 0.0f);
  }
  return l;
}

// ---- The update overlapped with the backward -------------------------------------------

void Optimizer::begin_step(Context& ctx, double lr) {
  TESSERA_CHECK(config_.overlap_backward, "Optimizer::begin_step: optimizer.overlap_backward is off");
  TESSERA_CHECK(config_.grad_clip == 0, "optimizer.overlap_backward needs optimizer.grad_clip = 0 (clipping scales ",
                "every gradient by the norm of all of them, known only when the whole backward is done); got ",
                config_.grad_clip);
  TESSERA_CHECK(!armed_, "Optimizer::begin_step: the previous overlapped step was not finished by step()");
  armed_ = true;
  armed_lr_ = lr;
  updated_.assign(params_.size(), false);
  bucket_.clear();
  bucket_elements_ = 0;
  buckets_queued_ = 0;
  if (ctx.device.is_cuda() && (!side_.get() || side_.device() != ctx.device)) side_ = Stream::create(ctx.device);
  const int64_t slots = std::max<int64_t>(1, static_cast<int64_t>(params_.size()));
  if (!bucket_norms_.defined() || bucket_norms_.device() != ctx.device || bucket_norms_.numel() < slots)
    bucket_norms_ = Tensor::zeros({slots}, DType::F64, ctx.device);
}

void Optimizer::mark_ready(Context& ctx, nn::Parameter& parameter) {
  if (!armed_) return;
  const auto it = std::find(params_.begin(), params_.end(), &parameter);
  TESSERA_CHECK(it != params_.end(), "Optimizer::mark_ready: ", parameter.name, " is not one of this optimizer's ",
                "parameters");
  const size_t i = static_cast<size_t>(it - params_.begin());
  TESSERA_CHECK(!updated_[i], "Optimizer::mark_ready: ", parameter.name, " was marked twice in one step");
  updated_[i] = true;
  bucket_.push_back(i);
  bucket_elements_ += parameter.weights().numel();
  if (bucket_elements_ >= overlap_bucket_elements_) queue_bucket(ctx);
}

// The bucket's gradient norm and AdamW update, on the side stream (on the CPU: now, on ctx),
// after everything ctx's stream has queued so far: the backward that wrote these gradients.
void Optimizer::queue_bucket(Context& ctx) {
  if (bucket_.empty()) return;
  const size_t b = buckets_queued_++;
  if (bucket_norm_caches_.size() <= b) {
    bucket_norm_caches_.resize(b + 1);
    bucket_adamw_caches_.resize(b + 1);
  }
  Context side = ctx;
  if (ctx.device.is_cuda()) {
    side = side_.context();
    stream_wait(ctx.device, side.stream, ctx.stream);
  }
  // Tensor-level work of the ops below (a multi-tensor table's first upload) goes on the side
  // stream too.
  const StreamGuard guard(side);
  Lists l = lists_for(bucket_, /*writes_values=*/true);
  Tensor norm = bucket_norms_.slice(0, static_cast<int64_t>(b), static_cast<int64_t>(b) + 1);
  global_grad_norm(side, l.grads, norm, &bucket_norm_caches_[b]);
  adamw_step_multi(side, l.weights, l.grads, l.exp_avg, l.exp_avg_sq, l.values, options_for(armed_lr_, step_ + 1),
                   l.weight_decays, Tensor(), 0.0, &bucket_adamw_caches_[b]);
  for (size_t i : bucket_) params_[i]->value_stale = false;  // their values were written
  bucket_.clear();
  bucket_elements_ = 0;
}

double Optimizer::finish_overlapped_step(Context& ctx, double lr) {
  armed_ = false;  // first: an error below leaves the optimizer unarmed
  TESSERA_CHECK(lr == armed_lr_, "Optimizer::step: lr ", lr, " is not the ", armed_lr_, " begin_step armed");
  // What the backward did not mark (or marked into the last, partial bucket) goes last.
  for (size_t i = 0; i < params_.size(); ++i)
    if (!updated_[i]) {
      params_[i]->materialize_grad(ctx);  // a lazily zeroed gradient no backward wrote is zeros
      updated_[i] = true;
      bucket_.push_back(i);
    }
  queue_bucket(ctx);
  if (ctx.device.is_cuda()) stream_wait(ctx.device, ctx.stream, side_.get());
  step_ += 1;
  synchronize(ctx);
  const Tensor norms = bucket_norms_.slice(0, 0, static_cast<int64_t>(buckets_queued_)).to(Device::cpu());
  double sum = 0;
  for (size_t b = 0; b < buckets_queued_; ++b) sum += norms.item(static_cast<int64_t>(b)) * norms.item(static_cast<int64_t>(b));
  return std::sqrt(sum);
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
