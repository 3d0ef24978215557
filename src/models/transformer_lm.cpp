#include "tessera/models/transformer_lm.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "tessera/core/random.h"
#include "tessera/fp8/device_scaling.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/embedding.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/loss.h"
#include "tessera/ops/quantize.h"
#include "models/parallel_lm.h"

namespace tessera::models {

TransformerLM::TransformerLM(const ModelConfig& config, DType dtype, const nn::ParallelContext& parallel)
    : config_((config.validate(), validate_parallel(config, parallel), config)),
      dtype_(dtype),
      parallel_(parallel),
      // Under tensor parallelism the vocab-parallel embedding in tp_ holds this rank's rows.
      token_embedding(parallel.tensor_size > 1 ? nn::Parameter()
                                               : nn::Parameter("embed.weight", {config.vocab_size, config.hidden_size},
                                                               dtype, true)),
      final_norm("final_norm", config.is_gpt2() ? nn::NormKind::LayerNorm : nn::NormKind::RMSNorm, config.hidden_size,
                 config.norm_eps, dtype) {
  TESSERA_CHECK(dtype == DType::F32 || dtype == DType::F64 || dtype == DType::BF16,
                "TransformerLM: the compute dtype must be f32, f64 or bf16, got ", dtype_name(dtype));
  if (config.is_gpt2())
    position_embedding = nn::Parameter("pos_embed.weight", {config.max_seq_len, config.hidden_size}, dtype, true);
  if (parallel.tensor_size > 1) {
    tp_ = std::make_shared<TensorParallelParts>(config, dtype, parallel);
    return;
  }
  for (int64_t i = 0; i < config.num_layers; ++i) {
    layers.push_back(std::make_unique<nn::TransformerLayer>("layers." + std::to_string(i), config, dtype, parallel));
    // model.keep_activation_layers: the last layers keep h (they are the first the backward
    // frees; every kept h is live at the activation peak either way).
    if (i >= config.num_layers - config.keep_activation_layers) layers.back()->mlp.recompute_activation = false;
  }
  if (!config.tie_embeddings) lm_head = nn::Parameter("lm_head.weight", {config.vocab_size, config.hidden_size}, dtype, true);
  // The head's dW GEMM is its weight's first gradient writer in a step (with tied embeddings
  // the embedding's scatter-add comes last and adds): it may overwrite a lazily zeroed grad.
  head_weight().grad_overwrite_ok = true;
}

void TransformerLM::notify_grads_ready(Context& ctx, const nn::ParameterList& ps) {
  if (!grad_ready_) return;
  for (nn::Parameter* p : ps) {
    p->materialize_grad(ctx);  // a gradient no writer touched is read as zeros
    grads_notified_.push_back(p);
    grad_ready_(ctx, *p);
  }
}

void TransformerLM::notify_rest(Context& ctx) {
  if (!grad_ready_) return;
  std::sort(grads_notified_.begin(), grads_notified_.end());
  for (nn::Parameter* p : parameters())
    if (!std::binary_search(grads_notified_.begin(), grads_notified_.end(), p)) {
      p->materialize_grad(ctx);
      grad_ready_(ctx, *p);
    }
  grads_notified_.clear();
}

nn::ParameterList TransformerLM::parameters() {
  if (tp_) return tp_->parameters(*this);
  nn::ParameterList out{&token_embedding};
  if (position_embedding.value.defined()) out.push_back(&position_embedding);
  for (auto& layer : layers) layer->parameters(out);
  final_norm.parameters(out);
  if (lm_head.value.defined()) out.push_back(&lm_head);
  return out;
}

int64_t TransformerLM::num_parameters() {
  int64_t n = 0;
  for (nn::Parameter* p : parameters()) n += p->numel();
  return n;
}

void TransformerLM::zero_grad() {
  // Lazy where every writer of the gradient can overwrite it (nn::Parameter::grad_unwritten):
  // the step's first GEMM then writes with beta 0, and no memset runs. Tensor parallelism's
  // layers write their own parameters' gradients, so it zeroes them all.
  for (nn::Parameter* p : parameters()) {
    if (p->grad_overwrite_ok && !tp_) {
      p->grad_unwritten = true;
    } else {
      p->grad_unwritten = false;
      p->grad.fill_zero();
    }
  }
}

void TransformerLM::materialize_grads(Context& ctx) {
  for (nn::Parameter* p : parameters()) p->materialize_grad(ctx);
}

void TransformerLM::to(Device device) {
  for (nn::Parameter* p : parameters()) p->to(device);
  if (tp_) {
    tp_->to(*this, device);
    return;
  }
  for (auto& layer : layers)
    if (layer->moe) layer->moe->to(device);
  head_value_padded_ = head_grad_padded_ = Tensor();
  // On the GPU the LM head weight lives in a buffer with its rows padded to a multiple of
  // 64 (GPT-2's 50257 -> 50304), as llm.c does: the head's three GEMMs then have aligned
  // shapes, which is worth a third of GPT-2's step. The parameter's value and gradient are
  // views of the first V rows; the padding rows stay zero (their logits are exactly 0, their
  // gradient rows receive 0 * h), and no optimizer, checkpoint or import ever sees them.
  const int64_t vocab = config_.vocab_size, padded = (vocab + 63) / 64 * 64;
  if (!device.is_cuda() || padded == vocab) return;
  nn::Parameter& w = head_weight();
  head_value_padded_ = Tensor::zeros({padded, config_.hidden_size}, w.value.dtype(), device);
  head_grad_padded_ = Tensor::zeros({padded, config_.hidden_size}, w.grad.dtype(), device);
  Tensor value = head_value_padded_.slice(0, 0, vocab), grad = head_grad_padded_.slice(0, 0, vocab);
  value.copy_from(w.value);
  grad.copy_from(w.grad);
  w.value = value;
  w.grad = grad;
}

void TransformerLM::refresh_values(Context& ctx) {
  for (nn::Parameter* p : parameters()) p->refresh_value(ctx);
}

void TransformerLM::init_tensor(Context& ctx, const std::string& name, Tensor& w, int64_t num_layers, uint64_t seed,
                                uint64_t stream) {
  const float residual_std = 0.02f / std::sqrt(2.0f * num_layers);
  const bool is_norm = name.find("norm") != std::string::npos;
  const bool is_bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
  const bool is_residual_proj = name.find(".proj.weight") != std::string::npos;
  if (is_norm && !is_bias) {
    Tensor ones = Tensor::empty(w.shape(), w.dtype());
    for (int64_t i = 0; i < ones.numel(); ++i) ones.set_item(i, 1.0);
    w.copy_from(ones);
  } else if (is_bias) {
    w.fill_zero();
  } else {
    fill_normal(ctx, w, 0.0f, is_residual_proj ? residual_std : 0.02f, seed, stream);
  }
}

void TransformerLM::init(Context& ctx, uint64_t seed) {
  // Tensor parallel: each full tensor drawn as below, this rank's shard kept.
  if (tp_) {
    tp_->init(*this, ctx, seed);
    return;
  }
  uint64_t stream = 0;  // each parameter draws from its own offset of the seed's stream
  for (nn::Parameter* p : parameters()) {
    init_tensor(ctx, p->name, p->weights(), config_.num_layers, seed, stream);
    p->refresh_value(ctx);
    stream += static_cast<uint64_t>(p->numel());  // a fill of n normals uses n/2 counters: no overlap
  }
  zero_grad();
}

Tensor TransformerLM::embed(Context& ctx, const Tensor& inputs) const {
  TESSERA_CHECK(inputs.dim() == 2, "TransformerLM: inputs must be [batch, seq] token ids, got ", inputs.describe());
  const int64_t batch = inputs.size(0), seq = inputs.size(1);
  TESSERA_CHECK(seq <= config_.max_seq_len, "TransformerLM: sequence length ", seq, " exceeds model.max_seq_len ",
                config_.max_seq_len);
  Tensor x = Tensor::empty({batch * seq, config_.hidden_size}, dtype_, ctx.device);
  embedding_forward(ctx, inputs.reshape({batch * seq}).to(ctx.device), token_embedding.value, x);
  if (position_embedding.value.defined()) {
    Tensor pos = position_embedding.value.slice(0, 0, seq);
    for (int64_t b = 0; b < batch; ++b) {
      Tensor rows = x.slice(0, b * seq, (b + 1) * seq);
      add(ctx, rows, pos, rows);
    }
  }
  return x;
}

Tensor TransformerLM::trunk_forward(Context& ctx, const Tensor& inputs, Saved& saved) {
  const int64_t batch = inputs.size(0), seq = inputs.size(1);
  Tensor x = embed(ctx, inputs);
  saved.layers.resize(layers.size());
  // Each block hands on its output as two summands; the next norm adds them in its own pass.
  Tensor branch;
  for (size_t i = 0; i < layers.size(); ++i) {
    const nn::TransformerLayer::Output out = layers[i]->forward(ctx, x, branch, batch, seq, saved.layers[i]);
    x = out.residual;
    branch = out.branch;
  }
  return branch.defined() ? final_norm.forward_add(ctx, x, branch, saved.final_norm)
                          : final_norm.forward(ctx, x, saved.final_norm);
}

// Mean cross-entropy of h W^T against targets, chunk by chunk. With d_h, also writes the
// gradient w.r.t. h and accumulates the head weight's gradient, both times `scale`.
double TransformerLM::HeadLoss::read() const {
  if (!chunk_losses.defined()) return 0.0;  // no valid target
  const Tensor host = chunk_losses.to(Device::cpu());
  double loss = 0;
  for (size_t i = 0; i < weights.size(); ++i) loss += host.item(static_cast<int64_t>(i)) * weights[i];
  return loss;
}

namespace {

// Rows per LM-head chunk: kHeadChunkRows, or TESSERA_HEAD_CHUNK_ROWS (a positive multiple of
// 16) to measure the trade between the chunk's logits memory (rows x vocabulary) and the
// number of passes the head's dW GEMMs make over the FP32 gradient (one per chunk).
int64_t head_chunk_rows() {
  static const int64_t rows = [] {
    const char* v = std::getenv("TESSERA_HEAD_CHUNK_ROWS");
    if (v == nullptr || *v == '\0') return TransformerLM::kHeadChunkRows;
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    TESSERA_CHECK(end != v && *end == '\0' && n > 0 && n % 16 == 0,
                  "TESSERA_HEAD_CHUNK_ROWS must be a positive multiple of 16, got '", v, "'");
    return static_cast<int64_t>(n);
  }();
  return rows;
}

}  // namespace

TransformerLM::HeadLoss TransformerLM::head_loss(Context& ctx, const Tensor& h, const Tensor* targets,
                                                 const Tensor& device_targets, Tensor* d_h, float scale) {
  const int64_t rows = h.size(0), vocab = config_.vocab_size, chunk_rows = head_chunk_rows();
  const Tensor flat_targets = device_targets.reshape({rows});
  // Counting the valid targets first lets every chunk scale its gradient by the global mean.
  // Targets come from the host-side loader, so this reads host memory, not the device.
  // Without them (forward_backward_into) every target is valid by contract.
  const std::vector<int64_t> host_targets = targets ? targets->reshape({rows}).to_ints() : std::vector<int64_t>();
  std::vector<int64_t> chunk_valid_counts;
  int64_t valid = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t r1 = std::min(rows, r0 + chunk_rows);
    chunk_valid_counts.push_back(targets ? std::count_if(host_targets.begin() + r0, host_targets.begin() + r1,
                                                         [](int64_t t) { return t != kIgnoreIndex; })
                                         : r1 - r0);
    valid += chunk_valid_counts.back();
  }
  if (valid == 0) {
    if (d_h) d_h->fill_zero();
    return {};
  }
  nn::Parameter& w = head_weight();
  // The head's GEMMs run over all rows of the padded weight when there is one (see to()).
  const Tensor w_full = head_value_padded_.defined() ? head_value_padded_ : w.value;
  Tensor grad_full = head_grad_padded_.defined() ? head_grad_padded_ : w.grad;
  const int64_t vocab_full = w_full.size(0);
  const DType stats = nn::master_dtype(dtype_);
  // Each chunk's mean loss lands in its own slot on the device; one copy at the end, so the
  // loop never waits for the GPU.
  const int64_t num_chunks = static_cast<int64_t>(chunk_valid_counts.size());
  Tensor chunk_losses = Tensor::zeros({num_chunks}, stats, ctx.device);
  // FP8 head: W and h cast once per call (not per chunk), each chunk's GEMMs slice them.
  const bool fp8_head = head_runs_fp8(rows, h, w_full);
  fp8::QuantizedTensor w_q, h_q;
  Tensor dl_scale;
  DType dl_dtype = DType::E5M2;
  if (fp8_head) {
    // Current scaling for both, whatever the blocks' recipe: the head is outside its state,
    // and the weight changes every step. amax and scale stay on the device.
    const auto cast_current = [&](const Tensor& x) {
      Tensor x_amax = Tensor::empty({1}, DType::F32, ctx.device), x_scale = Tensor::empty({1}, DType::F32, ctx.device);
      amax(ctx, x, x_amax);
      fp8::scale_from_amax(ctx, x_amax, DType::E4M3, 0.0f, false, x_scale);
      return fp8::quantize_with_transpose(ctx, x, x_scale, DType::E4M3);
    };
    w_q = cast_current(w_full);
    h_q = cast_current(h);
    if (d_h) {
      // Static dlogits scale: every chunk's d_loss / chunk_valid is scale / valid, and
      // |softmax - onehot| <= 1, so |dlogits| <= |scale| / valid maps to at most fp8_max (the
      // cast saturates, so a rounding above the bound clamps instead of overflowing).
      dl_dtype = fp8::fp8_dtype(*fp8_head_format_, fp8::Role::Gradient);
      const double bound = std::fabs(double(scale)) / double(valid);
      const float value = bound > 0 ? static_cast<float>(double(fp8_max(dl_dtype)) / bound) : 1.0f;
      if (!fp8_head_one_.defined() || fp8_head_one_.device() != ctx.device)
        fp8_head_one_ = Tensor::from_floats({1.0f}, {1}).to(ctx.device);
      dl_scale = Tensor::empty({1}, DType::F32, ctx.device);
      tessera::scale(ctx, fp8_head_one_, value, dl_scale);  // the value travels as a kernel argument
    }
  }
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t r1 = std::min(rows, r0 + chunk_rows), n = r1 - r0;
    const Tensor h_chunk = h.slice(0, r0, r1), t_chunk = flat_targets.slice(0, r0, r1);
    const int64_t chunk_valid = chunk_valid_counts[r0 / chunk_rows];
    if (chunk_valid == 0) {
      if (d_h) d_h->slice(0, r0, r1).fill_zero();
      continue;
    }
    // On the GPU the logits' row stride is padded to a multiple of 8 elements: with GPT-2's
    // odd vocabulary (50257) unpadded rows would push all three head GEMMs off cuBLASLt's
    // aligned tensor-core kernels.
    // (The padded weight's extra columns come out exactly 0 and the loss ignores them.)
    const int64_t row_stride = ctx.device.is_cuda() ? (vocab_full + 7) / 8 * 8 : vocab_full;
    Tensor logits_full = Tensor::empty({n, row_stride}, dtype_, ctx.device).slice(1, 0, vocab_full);
    fp8::QuantizedTensor h_q_chunk;
    if (fp8_head) {
      h_q_chunk.dtype = h_q.dtype;
      h_q_chunk.data = h_q.data.slice(0, r0, r1);        // [n, C]
      h_q_chunk.data_t = h_q.data_t.slice(1, r0, r1);    // [C, n], row stride `rows` (a multiple of 16)
      h_q_chunk.scale_inv = h_q.scale_inv;
      fp8::Fp8GemmOptions forward;
      forward.fast_accumulate = true;  // forward only, as nn::Linear
      fp8::fp8_gemm(ctx, h_q_chunk, false, w_q, true, logits_full, forward);  // logits = h W^T
    } else {
      gemm(ctx, h_chunk, w_full, logits_full, {.transpose_b = true});
    }
    Tensor logits = logits_full.slice(1, 0, vocab);
    Tensor chunk_loss = chunk_losses.slice(0, r0 / chunk_rows, r0 / chunk_rows + 1);
    Tensor lse = Tensor::empty({n}, stats, ctx.device);
    const double weight = double(chunk_valid) / double(valid);
    // The BF16 head's gradient replaces the logits in place, the loss and gradient in one
    // pass over them where the backend can (one read of the logits, not two).
    const bool fused_loss = d_h && !fp8_head;
    if (fused_loss) {
      Tensor d_logits = logits;
      cross_entropy_forward_backward(ctx, logits, t_chunk, chunk_loss, lse, static_cast<float>(weight * scale),
                                     d_logits, {.ignore_index = kIgnoreIndex});
    } else {
      cross_entropy_forward(ctx, logits, t_chunk, chunk_loss, lse, {.ignore_index = kIgnoreIndex});
    }
    if (!d_h) continue;
    Tensor d_h_chunk = d_h->slice(0, r0, r1);
    // dW = or += dlogits^T h: the first chunk of a step overwrites a lazily zeroed gradient.
    const float dw_beta = w.begin_grad_write(ctx) ? 0.0f : 1.0f;
    if (fp8_head) {
      // The FP8 gradient straight from the cross-entropy backward (on CUDA one kernel, no BF16
      // gradient written), the padding columns as code 0; then its transposed copy for dW.
      Tensor dl_codes = Tensor::empty({n, vocab_full}, dl_dtype, ctx.device);
      cross_entropy_backward_fp8(ctx, logits, t_chunk, lse, static_cast<float>(weight * scale), dl_scale, dl_codes,
                                 {.ignore_index = kIgnoreIndex});
      fp8::QuantizedTensor dl_q = fp8::quantized_from_codes(ctx, dl_codes, dl_scale);
      fp8::fp8_gemm(ctx, dl_q, false, w_q, false, d_h_chunk);  // dh = dlogits W
      dl_q.data = Tensor();                                     // dW reads the transposed copy only
      fp8::Fp8GemmOptions accumulate;
      accumulate.beta = dw_beta;
      fp8::fp8_gemm(ctx, dl_q, true, h_q_chunk, false, grad_full, accumulate);  // dW += dlogits^T h
      continue;
    }
    // The gradient (fused_loss above) is a view of logits_full, whose padding columns still hold 0.
    gemm(ctx, logits_full, w_full, d_h_chunk);                                 // dh = dlogits W
    gemm(ctx, logits_full, h_chunk, grad_full, {.transpose_a = true, .beta = dw_beta});  // dW += dlogits^T h
  }
  HeadLoss out{chunk_losses, {}};
  for (int64_t count : chunk_valid_counts) out.weights.push_back(double(count) / double(valid));
  return out;
}

bool TransformerLM::head_runs_fp8(int64_t rows, const Tensor& h, const Tensor& w_full) const {
  // cuBLASLt's FP8 GEMMs want K (C, the padded vocabulary, the chunk rows) and the operands'
  // row strides multiples of 16; the CPU emulation takes the same path under the same rule.
  // Chunks hold head_chunk_rows() (a multiple of 16) rows but the last, so rows % 16 covers all.
  return fp8_head_format_.has_value() && !tp_ && dtype_ == DType::BF16 && h.dtype() == DType::BF16 &&
         w_full.dtype() == DType::BF16 && rows > 0 && rows % 16 == 0 && config_.hidden_size % 16 == 0 &&
         w_full.size(0) % 16 == 0 && h.is_contiguous() && w_full.is_contiguous();
}

void TransformerLM::use_fp8_lm_head(std::optional<fp8::Format> format) {
  TESSERA_CHECK(!format || !tp_, "TransformerLM: the FP8 LM head (fp8.lm_head) is not built for tensor parallelism");
  fp8_head_format_ = format;
}

double TransformerLM::head_forward_backward(Context& ctx, const Tensor& h, const Tensor& targets, Tensor* d_h,
                                            float scale) {
  TESSERA_CHECK(!tp_, "TransformerLM::head_forward_backward: not built for tensor parallelism");
  TESSERA_CHECK(h.dim() == 2 && h.size(1) == config_.hidden_size && h.dtype() == dtype_ && h.device() == ctx.device,
                "TransformerLM::head_forward_backward: h must be [N, ", config_.hidden_size, "] ", dtype_name(dtype_),
                " on ", ctx.device.to_string(), ", got ", h.describe());
  TESSERA_CHECK(targets.numel() == h.size(0), "TransformerLM::head_forward_backward: targets ", targets.describe(),
                " must hold ", h.size(0), " ids");
  if (d_h)
    TESSERA_CHECK(d_h->shape() == h.shape() && d_h->dtype() == dtype_ && d_h->device() == ctx.device,
                  "TransformerLM::head_forward_backward: d_h ", d_h->describe(), " must match h ", h.describe());
  const Tensor device_targets = targets.to(ctx.device);
  return head_loss(ctx, h, &targets, device_targets, d_h, scale).read();
}

double TransformerLM::forward_backward(Context& ctx, const Tensor& inputs, const Tensor& targets, float scale) {
  if (tp_) return tp_->forward_backward(*this, ctx, inputs, targets, scale);
  TESSERA_CHECK(targets.shape() == inputs.shape(), "TransformerLM: targets ", targets.describe(), " must match inputs ",
                inputs.describe());
  // Every host-to-device copy of the step happens here, before the first kernel: a copy
  // from pageable host memory waits for the GPU to drain, which costs nothing only here.
  const Tensor ids = inputs.to(ctx.device), device_targets = targets.to(ctx.device);
  Saved saved;
  grads_notified_.clear();
  const HeadLoss loss = forward_backward_queued(ctx, ids, &targets, device_targets, scale, saved);
  notify_rest(ctx);  // embedding, positions, final norm, head: final once the backward is
  double total = loss.read();  // the step's only wait for the GPU, after its whole backward is queued
  last_aux_loss_ = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!layers[i]->moe) continue;
    const Tensor losses = saved.layers[i].moe.losses.to(Device::cpu());
    last_aux_loss_ += losses.item(0) + losses.item(1);
  }
  return total + last_aux_loss_;
}

void TransformerLM::forward_backward_into(Context& ctx, const Tensor& inputs, const Tensor& targets, float scale,
                                          Tensor& loss_acc, double loss_divisor) {
  const char* op = "TransformerLM::forward_backward_into";
  TESSERA_CHECK(!tp_, op, ": not built for tensor parallelism (use forward_backward)");
  TESSERA_CHECK(!config_.is_moe(), op, ": mixture-of-experts models read their per-expert token counts on the ",
                "host every step, so they have no device-resident step (use forward_backward)");
  TESSERA_CHECK(targets.shape() == inputs.shape(), op, ": targets ", targets.describe(), " must match inputs ",
                inputs.describe());
  TESSERA_CHECK(inputs.device() == ctx.device && targets.device() == ctx.device, op, ": inputs ", inputs.describe(),
                " and targets ", targets.describe(), " must already be on ", ctx.device.to_string());
  Saved saved;
  const HeadLoss loss = forward_backward_queued(ctx, inputs, nullptr, targets, scale, saved);
  const Tensor chunk_losses =
      loss.chunk_losses.defined() ? loss.chunk_losses : Tensor::empty({0}, nn::master_dtype(dtype_), ctx.device);
  accumulate_weighted_loss(ctx, chunk_losses, loss.weights, loss_divisor, loss_acc);
  last_aux_loss_ = 0;
}

std::vector<Tensor> TransformerLM::step_buffers() const {
  std::vector<Tensor> out;
  for (const Tensor* t : {&positions_, &head_value_padded_, &head_grad_padded_, &fp8_head_one_})
    if (t->defined()) out.push_back(*t);
  return out;
}

TransformerLM::HeadLoss TransformerLM::forward_backward_queued(Context& ctx, const Tensor& ids, const Tensor* targets,
                                                               const Tensor& device_targets, float scale,
                                                               Saved& saved) {
  const int64_t batch = ids.size(0), seq = ids.size(1);
  // GPT-2's position ids for the backward: the same for every step of one shape, so built
  // and copied once.
  if (position_embedding.value.defined() &&
      !(positions_.defined() && positions_seq_ == seq && positions_.numel() == batch * seq &&
        positions_.device() == ctx.device)) {
    Tensor host_positions = Tensor::empty({batch * seq}, DType::I32);
    for (int64_t i = 0; i < batch * seq; ++i) host_positions.data<int32_t>()[i] = static_cast<int32_t>(i % seq);
    positions_ = host_positions.to(ctx.device);
    positions_seq_ = seq;
  }
  const Tensor h = trunk_forward(ctx, ids, saved);
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!layers[i]->moe) continue;
    layers[i]->moe->record_load(saved.layers[i].moe);
    saved.layers[i].moe.loss_scale = scale;  // the aux losses are averaged like the cross-entropy
  }
  Tensor d = Tensor::empty(h.shape(), dtype_, ctx.device);
  HeadLoss loss = head_loss(ctx, h, targets, device_targets, &d, scale);
  d = final_norm.backward_input(ctx, d, saved.final_norm);
  for (size_t i = layers.size(); i-- > 0;) {
    const Tensor dy = d;
    d = layers[i]->backward_input(ctx, dy, saved.layers[i]);
    layers[i]->backward_weight(ctx, dy, saved.layers[i]);
    // Nothing reads this layer's activations again: free them now, so that memory falls
    // layer by layer through the backward instead of holding every layer's to its end.
    // (The MoE auxiliary losses are read once the step is done.)
    Tensor moe_losses = std::move(saved.layers[i].moe.losses);
    saved.layers[i] = {};
    saved.layers[i].moe.losses = std::move(moe_losses);
    if (grad_ready_) {
      nn::ParameterList done;
      layers[i]->parameters(done);
      notify_grads_ready(ctx, done);
    }
  }
  token_embedding.materialize_grad(ctx);  // a scatter-add: tied to a head that wrote nothing
  embedding_backward(ctx, ids.reshape({batch * seq}), d, token_embedding.grad);
  if (position_embedding.value.defined()) embedding_backward(ctx, positions_, d, position_embedding.grad);
  materialize_grads(ctx);  // whatever no writer touched (e.g. a layer whose input had no rows)
  return loss;
}

std::vector<nn::GroupedLinear*> TransformerLM::expert_linears() {
  std::vector<nn::GroupedLinear*> linears;
  for (auto& layer : layers)
    if (layer->moe) linears.insert(linears.end(), {&layer->moe->experts.fc, &layer->moe->experts.proj});
  return linears;
}

std::vector<std::vector<int64_t>> TransformerLM::expert_loads() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& layer : layers)
    if (layer->moe) out.push_back(layer->moe->load);
  return out;
}

void TransformerLM::update_expert_biases(Context& ctx) {
  for (auto& layer : layers)
    if (layer->moe) layer->moe->update_expert_bias(ctx);
}

std::map<std::string, Tensor> TransformerLM::expert_biases() const {
  std::map<std::string, Tensor> out;
  for (size_t i = 0; i < layers.size(); ++i)
    if (layers[i]->moe && layers[i]->moe->expert_bias.defined())
      out["layers." + std::to_string(i) + ".expert_bias"] = layers[i]->moe->expert_bias.to(Device::cpu());
  return out;
}

void TransformerLM::load_expert_biases(Context& ctx, const std::map<std::string, Tensor>& biases) {
  (void)ctx;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!layers[i]->moe || !layers[i]->moe->expert_bias.defined()) continue;
    Tensor& bias = layers[i]->moe->expert_bias;
    const std::string name = "layers." + std::to_string(i) + ".expert_bias";
    auto it = biases.find(name);
    TESSERA_CHECK(it != biases.end(), "TransformerLM::load_expert_biases: no '", name, "'");
    TESSERA_CHECK(it->second.shape() == bias.shape() && it->second.dtype() == bias.dtype(),
                  "TransformerLM::load_expert_biases: '", name, "' is ", it->second.describe(), ", the model's ",
                  bias.describe());
    bias.copy_from(it->second.to(bias.device()));
  }
}

double TransformerLM::forward_loss(Context& ctx, const Tensor& inputs, const Tensor& targets) {
  if (tp_) return tp_->forward_loss(*this, ctx, inputs, targets);
  Saved saved;
  const Tensor ids = inputs.to(ctx.device), device_targets = targets.to(ctx.device);
  return head_loss(ctx, trunk_forward(ctx, ids, saved), &targets, device_targets, nullptr, 1.0f).read();
}

Tensor TransformerLM::logits(Context& ctx, const Tensor& inputs) {
  if (tp_) return tp_->logits(*this, ctx, inputs);
  Saved saved;
  const Tensor h = trunk_forward(ctx, inputs, saved);
  Tensor out = Tensor::empty({h.size(0), config_.vocab_size}, DType::F32, ctx.device);
  gemm(ctx, h, head_weight().value, out, {.transpose_b = true});
  return out.reshape({inputs.size(0), inputs.size(1), config_.vocab_size});
}

}  // namespace tessera::models
