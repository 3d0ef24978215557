#include "tessera/nn/moe.h"

#include <algorithm>

#include "tessera/core/stream.h"
#include "tessera/ops/elementwise.h"

namespace tessera::nn {

GroupedLinear::GroupedLinear(const std::string& name, int64_t num_experts, int64_t in_features, int64_t out_features,
                             DType dtype)
    : weight(name + ".weight", {num_experts * out_features, in_features}, dtype, true),
      experts_(num_experts),
      in_(in_features),
      out_(out_features) {
  TESSERA_CHECK(num_experts > 0 && in_features > 0 && out_features > 0, "GroupedLinear ", name,
                ": sizes must be positive");
  weight.grad_overwrite_ok = true;  // backward_weight(_fp8) is its only gradient writer
}

Tensor GroupedLinear::forward(Context& ctx, const Tensor& x, const std::vector<int64_t>& splits) const {
  Tensor y = Tensor::empty({x.size(0), out_}, weight.value.dtype(), ctx.device);
  grouped_linear_forward(ctx, x, current_weight3d(ctx), splits, y);
  return y;
}

Tensor GroupedLinear::backward_input(Context& ctx, const Tensor& dy, const std::vector<int64_t>& splits) const {
  Tensor dx = Tensor::empty({dy.size(0), in_}, weight.value.dtype(), ctx.device);
  grouped_linear_backward_input(ctx, dy, current_weight3d(ctx), splits, dx);
  return dx;
}

void GroupedLinear::backward_weight(Context& ctx, const Tensor& dy, const Tensor& x, const std::vector<int64_t>& splits) {
  const bool overwrite = weight.begin_grad_write(ctx);  // the step's first gradient: beta 0
  Tensor dw = weight.grad.reshape({experts_, out_, in_});
  grouped_linear_backward_weight(ctx, dy, x, splits, dw, /*accumulate=*/!overwrite);
}

Tensor GroupedLinear::current_weight3d(Context& ctx) const {
  // Refreshing the BF16 copy from the FP32 master changes no weight, so a const method may.
  if (weight.value_stale) const_cast<Parameter&>(weight).refresh_value(ctx);
  return weight3d();
}

bool GroupedLinear::runs_fp8(DType input) const {
  // in and out are the K of the forward and dgrad GEMMs (cuBLASLt FP8: multiples of 16); the
  // wgrad's K, an expert's row count, is padded by the cast (tessera/ops/moe.h).
  return fp8_.has_value() && input == DType::BF16 && weight.value.dtype() == DType::BF16 && in_ % 16 == 0 &&
         out_ % 16 == 0;
}

Tensor GroupedLinear::forward_fp8(Context& ctx, MoEFp8Rows x, Fp8Saved& saved) const {
  TESSERA_CHECK(runs_fp8(DType::BF16) && x.data.defined() && x.data.dim() == 2 && x.data.size(1) == in_, "GroupedLinear ",
                weight.name, ": forward_fp8 needs an FP8 setting, a BF16 weight, in and out multiples of 16 and an ",
                "FP8 input [M, ", in_, "]");
  // Under gradient accumulation (an open weight cache) every expert is cast once a step, with
  // W^T too, and the later micro-batches reuse the codes, whatever their splits. A cache open
  // only to serve fp8.cast_in_optimizer's primed casts keeps nothing new: a cast made there
  // (no primed one: the first step, after a resume or a rewind) is of every expert as well,
  // recording every expert's amax as the optimizer's casts do, but W^T only as uncached.
  const bool cached = fp8_->weight_cache && fp8_->weight_cache->is_open();
  if (cached) {
    const bool kept = fp8_->weight_cache->keeps_new();
    saved.w = fp8_->weight_cache->get_or_make<MoEFp8Weights>(&weight, [&] {
      MoEFp8Options all = *fp8_;
      all.keep_weight_transpose = fp8_->keep_weight_transpose || kept;
      return moe_fp8_quantize_weights(ctx, current_weight3d(ctx), std::vector<int64_t>(static_cast<size_t>(experts_), 1),
                                      all);
    });
  } else {
    saved.w = moe_fp8_quantize_weights(ctx, current_weight3d(ctx), x.splits, *fp8_);
  }
  bool with_transpose = fp8_->keep_weight_transpose;  // cached codes: W^T as made or primed
  if (cached)
    for (const fp8::QuantizedTensor& e : saved.w.experts) with_transpose = with_transpose || e.data_t.defined();
  Tensor y = Tensor::empty({x.data.size(0), out_}, weight.value.dtype(), ctx.device);
  grouped_linear_forward_fp8(ctx, x, saved.w, y);
  // The backward reads the transposed codes only (dgrad: W^T, wgrad: x^T). The GEMMs queued
  // above still read the row-wise ones: their blocks serve later work on the same stream.
  saved.x = std::move(x);
  saved.x.data = Tensor();
  // Without keep_weight_transpose W^T goes too (backward_input_fp8 re-casts it with the
  // kept per-expert scales: the same codes); with it, the scales go.
  if (with_transpose) saved.w.scales.clear();
  else saved.w.experts.assign(saved.w.experts.size(), fp8::QuantizedTensor());
  for (auto& w : saved.w.experts) w.data = Tensor();
  return y;
}

Tensor GroupedLinear::backward_input_fp8(Context& ctx, const Tensor& dy, Fp8Saved& saved, const Tensor& dy_amax) const {
  TESSERA_CHECK(fp8_.has_value() && saved.x.data_t.defined(), "GroupedLinear ", weight.name,
                ": backward_input_fp8 needs forward_fp8 first");
  return backward_input_fp8(ctx,
                            moe_fp8_cast_rows_for(ctx, dy, saved.x.splits, fp8_->gradient_dtype(), *fp8_,
                                                  MoEFp8Options::kDelayedGradOutput, dy_amax),
                            saved);
}

Tensor GroupedLinear::backward_input_fp8(Context& ctx, MoEFp8Rows dy, Fp8Saved& saved) const {
  TESSERA_CHECK(fp8_.has_value() && saved.x.data_t.defined(), "GroupedLinear ", weight.name,
                ": backward_input_fp8 needs forward_fp8 first");
  TESSERA_CHECK(dy.data.defined() && dy.data.dim() == 2 && dy.data.size(1) == out_ && dy.splits == saved.x.splits &&
                    dy.dtype == fp8_->gradient_dtype(),
                "GroupedLinear ", weight.name, ": backward_input_fp8 needs dy cast to ",
                dtype_name(fp8_->gradient_dtype()), " as [M, ", out_, "] rows with the forward's split sizes");
  saved.dy = std::move(dy);
  Tensor dx = Tensor::empty({saved.dy.data.size(0), in_}, weight.value.dtype(), ctx.device);
  if (!saved.w.scales.empty()) {
    // W^T of each expert with rows, cast again with its forward scale (the weight is
    // unchanged since the forward): the forward's codes, without the row-wise copy.
    const Tensor w3 = current_weight3d(ctx);
    for (size_t e = 0; e < saved.w.experts.size(); ++e) {
      if (saved.w.experts[e].data_t.defined() || !saved.w.scales[e].defined()) continue;
      saved.w.experts[e] = fp8::quantize_transposed(ctx, w3.select(0, static_cast<int64_t>(e)), saved.w.scales[e],
                                                    fp8_->forward_dtype());
    }
  }
  grouped_linear_backward_input_fp8(ctx, saved.dy, saved.w, dx);
  saved.dy.data = Tensor();  // the wgrad reads dy^T only
  saved.w = MoEFp8Weights();
  return dx;
}

void GroupedLinear::backward_weight_fp8(Context& ctx, const Fp8Saved& saved) {
  TESSERA_CHECK(saved.dy.data_t.defined() && saved.x.data_t.defined(), "GroupedLinear ", weight.name,
                ": backward_weight_fp8 needs forward_fp8 and backward_input_fp8 first");
  // Deferred to the step's end: one GEMM per expert over all micro-batches' rows instead of
  // one per micro-batch that reads and rewrites the FP32 gradient. Only under delayed
  // scaling, whose scales are the same in every micro-batch of the step.
  if (fp8_ && fp8_->defer_weight_grad && fp8_->delayed && fp8_->weight_cache && fp8_->weight_cache->is_open()) {
    if (deferred_.empty()) fp8_->weight_cache->defer([this](Context& c) { flush_weight_grad_fp8(c); });
    Fp8Saved kept;
    kept.dy = saved.dy;
    kept.x = saved.x;
    kept.dy.data = kept.x.data = Tensor();
    deferred_.push_back(std::move(kept));
    return;
  }
  const bool overwrite = weight.begin_grad_write(ctx);  // the step's first gradient: beta 0
  Tensor dw = weight.grad.reshape({experts_, out_, in_});
  grouped_linear_backward_weight_fp8(ctx, saved.dy, saved.x, dw, /*accumulate=*/!overwrite);
}

void GroupedLinear::optimizer_update(Context& ctx, AdamWTensorStep& step) {
  if (!fp8_ || !fp8_->delayed || !fp8_->weight_cache || !runs_fp8(DType::BF16) || !step.value.defined()) {
    if (step.value.defined() && weight.value_memory_lent) {  // write the copy, not over lent memory
      weight.own_value_memory();
      step.value = weight.value;
    }
    adamw_step_one(ctx, step);
    weight.value_stale = false;
    return;
  }
  const int64_t first = fp8_->delayed_base + MoEFp8Options::kDelayedWeight;
  const DType fp8 = fp8_->forward_dtype();
  MoEFp8WeightCast cast;
  cast.scale = fp8_->delayed->scales().slice(0, first, first + experts_);
  cast.amax = fp8_->delayed->pending_amaxes().slice(0, first, first + experts_);
  // The BF16 copy is not written (2 of the update's 32 bytes an element): the next forward
  // reads the casts, and whatever reads the copy first refreshes it from the master. Its
  // memory, 2 bytes an element, holds the casts (1 + 1), so that they cost no memory.
  const Shape rows = {experts_, out_, in_}, cols = {experts_, in_, out_};
  const Tensor& value = weight.value;
  if (value.defined() && value.is_contiguous() && value.device() == ctx.device && value.numel() == experts_ * out_ * in_) {
    cast.data = value.bytes_as(fp8, rows);
    cast.data_t = value.bytes_as(fp8, cols, static_cast<size_t>(value.numel()));
    weight.value_memory_lent = true;
  } else {
    cast.data = Tensor::empty(rows, fp8, ctx.device);
    cast.data_t = Tensor::empty(cols, fp8, ctx.device);
  }
  Tensor no_value;
  moe_fp8_adamw_cast_weights(ctx, step.param, step.grad, step.exp_avg, step.exp_avg_sq, no_value, step.options,
                             step.weight_decay, step.grad_norm, step.max_norm, cast);
  weight.value_stale = true;
  fp8_->weight_cache->prime<MoEFp8Weights>(&weight, moe_fp8_weights_from_cast(ctx, cast, *fp8_));
}

namespace {

// The micro-batches' transposed codes of one operand side by side: expert e's padded columns
// of every micro-batch, in micro-batch order, then expert e + 1's. Each piece is a multiple
// of 16 columns (zero codes in its padding), so the result is a MoEFp8Rows whose expert e
// has the step's rows (splits summed) and whose padded widths add up likewise.
MoEFp8Rows concatenate_columns(const std::vector<const MoEFp8Rows*>& parts) {
  const MoEFp8Rows& first = *parts.front();
  const size_t experts = first.splits.size();
  MoEFp8Rows out;
  out.dtype = first.dtype;
  out.scale_inv = first.scale_inv;  // delayed scaling: the same value in every micro-batch
  out.splits.assign(experts, 0);
  out.padded_offsets.assign(experts + 1, 0);
  for (size_t e = 0; e < experts; ++e) {
    int64_t width = 0;
    for (const MoEFp8Rows* p : parts) {
      out.splits[e] += p->splits[e];
      width += p->padded_offsets[e + 1] - p->padded_offsets[e];
    }
    out.padded_offsets[e + 1] = out.padded_offsets[e] + width;
  }
  out.data_t = Tensor::empty({first.data_t.size(0), out.padded_offsets[experts]}, first.dtype, first.data_t.device());
  int64_t column = 0;
  for (size_t e = 0; e < experts; ++e)
    for (const MoEFp8Rows* p : parts) {
      const int64_t from = p->padded_offsets[e], width = p->padded_offsets[e + 1] - from;
      if (width == 0) continue;
      out.data_t.slice(1, column, column + width).copy_from(p->data_t.slice(1, from, from + width));
      column += width;
    }
  return out;
}

}  // namespace

void GroupedLinear::flush_weight_grad_fp8(Context& ctx) {
  if (deferred_.empty()) return;
  std::vector<Fp8Saved> parts;
  parts.swap(deferred_);  // whatever happens below, the next step starts clean
  const bool overwrite = weight.begin_grad_write(ctx);
  Tensor dw = weight.grad.reshape({experts_, out_, in_});
  if (parts.size() == 1) {
    grouped_linear_backward_weight_fp8(ctx, parts[0].dy, parts[0].x, dw, /*accumulate=*/!overwrite);
    return;
  }
  std::vector<const MoEFp8Rows*> dys, xs;
  for (const Fp8Saved& p : parts) {
    dys.push_back(&p.dy);
    xs.push_back(&p.x);
  }
  StreamGuard on_stream(ctx);  // the copies in order with the casts that made the codes
  const MoEFp8Rows dy = concatenate_columns(dys), x = concatenate_columns(xs);
  parts.clear();  // the per-micro-batch codes go before the GEMMs
  grouped_linear_backward_weight_fp8(ctx, dy, x, dw, /*accumulate=*/!overwrite);
}

GroupedMLP::GroupedMLP(const std::string& name, int64_t num_experts, int64_t hidden, int64_t ffn, DType dtype)
    : fc(name + ".fc", num_experts, hidden, 2 * ffn, dtype), proj(name + ".proj", num_experts, ffn, hidden, dtype) {}

Tensor GroupedMLP::forward(Context& ctx, const Tensor& x, const Tensor& scale, const std::vector<int64_t>& splits,
                           Saved& saved) const {
  saved = Saved();  // nothing of an earlier call (a reused Saved) may survive: e.g. h under recompute
  saved.splits = splits;
  saved.scale = scale;
  Tensor ones;
  if (!scale.defined()) {
    ones = Tensor::empty({x.size(0)}, x.dtype());
    for (int64_t i = 0; i < ones.numel(); ++i) ones.set_item(i, 1.0);
    ones = ones.to(ctx.device);
    saved.scale = ones;
  }
  if (runs_fp8(x)) {
    // x cast once; the SwiGLU writes h straight to FP8 (two passes over h_pre: amax, cast),
    // so h never exists in BF16 and only its transposed codes are kept.
    saved.fp8 = true;
    const MoEFp8Options& fc_o = *fc.fp8_options();
    const MoEFp8Options& proj_o = *proj.fp8_options();
    saved.h_pre = fc.forward_fp8(
        ctx, moe_fp8_cast_rows_for(ctx, x, splits, fc_o.forward_dtype(), fc_o, MoEFp8Options::kDelayedInput),
        saved.fc8);
    MoEFp8Rows h;
    if (proj_o.delayed) {
      // Delayed scaling: one pass (the cast with the state's scale, recording h's amax).
      Tensor h_amax = proj_o.delayed_amax(MoEFp8Options::kDelayedInput);
      h = moe_swiglu_scaled_cast(ctx, saved.h_pre, saved.scale, proj_o.delayed_scale(MoEFp8Options::kDelayedInput),
                                 splits, proj_o.forward_dtype(), &h_amax);
    } else {
      h = moe_swiglu_scaled_quantize(ctx, saved.h_pre, saved.scale, splits, proj_o.forward_dtype(), proj_o);
    }
    return proj.forward_fp8(ctx, std::move(h), saved.proj8);
  }
  saved.fp8 = false;
  saved.x = x;
  saved.h_pre = fc.forward(ctx, x, splits);
  Tensor h = Tensor::empty({x.size(0), proj.in_features()}, x.dtype(), ctx.device);
  moe_swiglu_scaled_forward(ctx, saved.h_pre, saved.scale, h);
  Tensor out = proj.forward(ctx, h, splits);
  if (!recompute_activation) saved.h = h;
  return out;
}

Tensor GroupedMLP::backward_input(Context& ctx, const Tensor& dy, Saved& saved) const {
  if (saved.fp8) {
    const Tensor d_h = proj.backward_input_fp8(ctx, dy, saved.proj8);
    saved.d_scale = Tensor::empty(saved.scale.shape(), saved.scale.dtype(), ctx.device);
    const MoEFp8Options& fc_o = *fc.fp8_options();
    if (fc_o.delayed) {
      // Delayed scaling: d_h_pre cast in the same pass that computes it and d_scale.
      Tensor amax = fc_o.delayed_amax(MoEFp8Options::kDelayedGradOutput);
      MoEFp8Rows d_h_pre = moe_swiglu_scaled_backward_cast(
          ctx, saved.h_pre, saved.scale, d_h, fc_o.delayed_scale(MoEFp8Options::kDelayedGradOutput), saved.splits,
          fc_o.gradient_dtype(), saved.d_scale, &amax);
      saved.h_pre = Tensor();
      return fc.backward_input_fp8(ctx, std::move(d_h_pre), saved.fc8);
    }
    if (!moe_swiglu_legacy()) {
      // d_h_pre, fc's dy, straight to FP8 (never stored in BF16; the same codes as below).
      MoEFp8Rows d_h_pre = moe_swiglu_scaled_backward_quantize(ctx, saved.h_pre, saved.scale, d_h, saved.splits,
                                                               fc_o.gradient_dtype(), fc_o, saved.d_scale);
      saved.h_pre = Tensor();  // nothing reads it again
      return fc.backward_input_fp8(ctx, std::move(d_h_pre), saved.fc8);
    }
    Tensor d_h_pre = Tensor::empty(saved.h_pre.shape(), saved.h_pre.dtype(), ctx.device);
    // The SwiGLU backward also reduces d_h_pre's amax, so its FP8 cast needs no amax pass.
    Tensor d_h_pre_amax = Tensor::empty({1}, DType::F32, ctx.device);
    moe_swiglu_scaled_backward(ctx, saved.h_pre, saved.scale, d_h, d_h_pre, saved.d_scale, &d_h_pre_amax);
    saved.h_pre = Tensor();  // nothing reads it again
    // d_h_pre is fc's dy: cast (kept as its transposed codes for the wgrad), then dropped.
    return fc.backward_input_fp8(ctx, d_h_pre, saved.fc8, d_h_pre_amax);
  }
  // The same kernel on the same inputs as the forward's: the same bits.
  if (!saved.h.defined()) {
    saved.h = Tensor::empty({saved.h_pre.size(0), proj.in_features()}, saved.h_pre.dtype(), ctx.device);
    moe_swiglu_scaled_forward(ctx, saved.h_pre, saved.scale, saved.h);
  }
  const Tensor d_h = proj.backward_input(ctx, dy, saved.splits);
  saved.d_h_pre = Tensor::empty(saved.h_pre.shape(), saved.h_pre.dtype(), ctx.device);
  saved.d_scale = Tensor::empty(saved.scale.shape(), saved.scale.dtype(), ctx.device);
  moe_swiglu_scaled_backward(ctx, saved.h_pre, saved.scale, d_h, saved.d_h_pre, saved.d_scale);
  saved.h_pre = Tensor();  // backward_weight reads x, h and d_h_pre only
  return fc.backward_input(ctx, saved.d_h_pre, saved.splits);
}

void GroupedMLP::backward_weight(Context& ctx, const Tensor& dy, const Saved& saved) {
  if (saved.fp8) {
    proj.backward_weight_fp8(ctx, saved.proj8);
    fc.backward_weight_fp8(ctx, saved.fc8);
    return;
  }
  proj.backward_weight(ctx, dy, saved.h, saved.splits);
  fc.backward_weight(ctx, saved.d_h_pre, saved.x, saved.splits);
}

void GroupedMLP::use_fp8(std::optional<MoEFp8Options> options) {
  fc.use_fp8(options);
  if (options && options->delayed)  // proj's slots follow fc's
    options->delayed_base += MoEFp8Options::delayed_slots(fc.num_experts());
  proj.use_fp8(options);
}

int64_t GroupedMLP::delayed_slots() const { return 2 * MoEFp8Options::delayed_slots(fc.num_experts()); }

std::vector<fp8::Role> GroupedMLP::delayed_roles() const {
  std::vector<fp8::Role> roles = MoEFp8Options::delayed_roles(fc.num_experts());
  const std::vector<fp8::Role> more = MoEFp8Options::delayed_roles(proj.num_experts());
  roles.insert(roles.end(), more.begin(), more.end());
  return roles;
}

bool GroupedMLP::runs_fp8(const Tensor& x) const {
  return x.dim() == 2 && x.size(1) == fc.in_features() && fc.runs_fp8(x.dtype()) && proj.runs_fp8(x.dtype());
}

void GroupedMLP::parameters(ParameterList& out) {
  fc.parameters(out);
  proj.parameters(out);
}

MoELayer::MoELayer(const std::string& name, const MoEOptions& o, DType dtype)
    : options(o),
      router(name + ".router", o.hidden, o.num_experts, false, dtype),
      experts(name + ".experts", o.num_experts, o.hidden, o.ffn, dtype),
      load(static_cast<size_t>(o.num_experts), 0) {
  experts.recompute_activation = o.recompute_activation;
  if (o.expert_bias_rate > 0) expert_bias = Tensor::zeros({o.num_experts}, DType::F32);
}

Tensor MoELayer::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  const int64_t n = x.size(0), e = options.num_experts, k = options.router.top_k;
  const DType dt = x.dtype(), stats = master_dtype(dt);
  saved.logits = router.forward(ctx, x, saved.router_in);
  saved.scores = Tensor::empty({n, e}, stats, ctx.device);
  saved.probs = Tensor::empty({n, k}, dt, ctx.device);
  saved.indices = Tensor::empty({n, k}, DType::I32, ctx.device);
  saved.counts = Tensor::empty({e}, DType::I32, ctx.device);
  saved.losses = Tensor::empty({2}, stats, ctx.device);
  moe_router_forward(ctx, saved.logits, expert_bias, options.router, saved.scores, saved.probs, saved.indices,
                     saved.counts, saved.losses);
  saved.row_map = Tensor::empty({n, k}, DType::I32, ctx.device);
  saved.offsets = Tensor::empty({e + 1}, DType::I32, ctx.device);
  moe_routing_map(ctx, saved.indices, e, saved.row_map, saved.offsets);
  Tensor permuted = Tensor::empty({n * k, x.size(1)}, dt, ctx.device);
  saved.permuted_probs = Tensor::empty({n * k}, dt, ctx.device);
  moe_permute_forward(ctx, x, saved.row_map, saved.probs, permuted, saved.permuted_probs);
  // The per-expert GEMMs need the row counts on the host (a sync on CUDA).
  saved.splits = saved.counts.to(Device::cpu()).to_ints();
  const Tensor expert_out = experts.forward(ctx, permuted, saved.permuted_probs, saved.splits, saved.mlp);
  Tensor y = Tensor::empty(x.shape(), dt, ctx.device);
  moe_unpermute_forward(ctx, expert_out, saved.row_map, Tensor(), y);
  return y;  // expert_out [N*k, C] is not kept: the backward of this unweighted sum does not read it
}

Tensor MoELayer::backward_input(Context& ctx, const Tensor& dy, Saved& saved) const {
  const int64_t n = dy.size(0), k = options.router.top_k;
  saved.d_expert_out = Tensor::empty({n * k, dy.size(1)}, dy.dtype(), ctx.device);
  Tensor no_probs;
  // Without probabilities the op does not read expert_out (only its shape is checked), so
  // the output stands in for the freed forward tensor.
  moe_unpermute_backward(ctx, saved.d_expert_out, saved.row_map, Tensor(), dy, saved.d_expert_out, no_probs);
  const Tensor d_permuted = experts.backward_input(ctx, saved.d_expert_out, saved.mlp);
  if (saved.mlp.fp8) saved.d_expert_out = Tensor();  // proj keeps its FP8 cast for the wgrad
  Tensor dx = Tensor::empty(dy.shape(), dy.dtype(), ctx.device);
  Tensor d_probs = Tensor::empty({n, k}, saved.probs.dtype(), ctx.device);
  moe_permute_backward(ctx, saved.row_map, d_permuted, saved.mlp.d_scale, dx, d_probs);
  saved.d_logits = Tensor::empty(saved.logits.shape(), saved.logits.dtype(), ctx.device);
  moe_router_backward(ctx, saved.logits, saved.scores, saved.indices, d_probs, options.router, saved.loss_scale,
                      saved.d_logits);
  const Tensor dx_router = router.backward_input(ctx, saved.d_logits, saved.router_in);
  add(ctx, dx, dx_router, dx);
  return dx;
}

void MoELayer::backward_weight(Context& ctx, const Tensor&, const Saved& saved) {
  experts.backward_weight(ctx, saved.d_expert_out, saved.mlp);
  router.backward_weight(ctx, saved.d_logits, saved.router_in);
}

void MoELayer::parameters(ParameterList& out) {
  router.parameters(out);
  experts.parameters(out);
}

void MoELayer::to(Device device) {
  if (expert_bias.defined()) expert_bias = expert_bias.to(device);
}

void MoELayer::record_load(const Saved& saved) {
  for (size_t e = 0; e < load.size() && e < saved.splits.size(); ++e) load[e] += saved.splits[e];
}

void MoELayer::update_expert_bias(Context& ctx) {
  if (expert_bias.defined()) {
    const Tensor host = Tensor::from_ints(load, {options.num_experts}, DType::I64);
    moe_update_expert_bias(ctx, host.to(expert_bias.device()), options.expert_bias_rate, expert_bias);
  }
  std::fill(load.begin(), load.end(), 0);
}

}  // namespace tessera::nn
