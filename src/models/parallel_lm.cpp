// TransformerLM under tensor (and sequence) parallelism, and the full-layout state API
// (see tessera/models/transformer_lm.h and docs/distributed.md).
//
// The step mirrors the single-device one (transformer_lm.cpp) with the sharded modules:
//   vocab-parallel embedding: each rank looks up its ids (zeros elsewhere), GPT-2's
//     positions are added on tensor rank 0 only, then all-reduce (or reduce-scatter along
//     the rows under sequence parallelism)
//   TensorParallelTransformerLayers, final norm (replicated, or on this rank's rows)
//   vocab-parallel head + cross-entropy, chunked (nn/vocab_parallel.h)
//   backward in reverse; the embedding's output gradient is gathered to the full rows, so
//     the position embedding's gradient is complete on every rank without a reduction
// Under sequence parallelism the norms' weight gradients of this step are computed into a
// scratch buffer, summed over the tensor group in one all-reduce and added to the
// accumulated gradients, so forward_backward still returns complete, accumulated
// gradients (and gradient accumulation over micro-batches sums each once).
#include "models/parallel_lm.h"

#include <algorithm>
#include <map>

#include "tessera/dist/process_group.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/embedding.h"

namespace tessera::models {

// ---- Config checks ----

void TransformerLM::validate_parallel(const ModelConfig& c, const nn::ParallelContext& parallel) {
  const int tp = parallel.tensor_size;
  TESSERA_CHECK(tp >= 1 && parallel.tensor_rank >= 0 && parallel.tensor_rank < tp, "parallel.tensor: size ", tp,
                " / rank ", parallel.tensor_rank, " is not a tensor-parallel position");
  if (tp == 1) return;
  TESSERA_CHECK(!c.is_moe(), "model.architecture ", c.architecture,
                ": tensor parallelism is not built for mixture-of-experts models; use parallel.tensor 1 (got ", tp,
                ")");
  TESSERA_CHECK(c.num_heads % tp == 0, "model.num_heads (", c.num_heads, ") must divide by parallel.tensor (", tp,
                ")");
  TESSERA_CHECK(c.num_kv_heads % tp == 0 || tp % c.num_kv_heads == 0, "model.num_kv_heads (", c.num_kv_heads,
                ") does not fit parallel.tensor (", tp,
                "): K/V heads are split when num_kv_heads divides by the tensor size and replicated when the tensor "
                "size divides by num_kv_heads");
  TESSERA_CHECK(c.ffn_size() % tp == 0, "model.intermediate_size (", c.ffn_size(),
                ") must divide by parallel.tensor (", tp, ")");
  TESSERA_CHECK(parallel.tensor_group != nullptr && parallel.tensor_group->size() == tp, "TransformerLM: tensor size ",
                tp, " needs its tensor group (dist::ParallelGrid::context())");
}

// ---- The tensor-parallel parts ----

TransformerLM::TensorParallelParts::TensorParallelParts(const ModelConfig& c, DType dtype,
                                                        const nn::ParallelContext& p)
    : parallel(p), group(p.tensor_group) {
  embedding = std::make_unique<nn::VocabParallelEmbedding>("embed.weight", c.vocab_size, c.hidden_size, dtype, p);
  for (int64_t i = 0; i < c.num_layers; ++i)
    layers.push_back(std::make_unique<nn::TensorParallelTransformerLayer>("layers." + std::to_string(i), c, dtype, p));
  if (!c.tie_embeddings)
    head_table = std::make_unique<nn::VocabParallelEmbedding>("lm_head.weight", c.vocab_size, c.hidden_size, dtype, p);
  head = std::make_unique<nn::VocabParallelLMHead>(head_table ? *head_table : *embedding, kHeadChunkRows);
}

nn::ParameterList TransformerLM::TensorParallelParts::parameters(TransformerLM& m) {
  nn::ParameterList out;
  embedding->parameters(out);
  if (m.position_embedding.value.defined()) out.push_back(&m.position_embedding);
  for (auto& layer : layers) layer->parameters(out);
  m.final_norm.parameters(out);
  if (head_table) head_table->parameters(out);
  return out;
}

std::vector<nn::ShardLayout> TransformerLM::TensorParallelParts::layouts(TransformerLM& m) {
  std::vector<nn::ShardLayout> out{embedding->layout()};
  if (m.position_embedding.value.defined())
    out.push_back(nn::ShardLayout::replicated(m.position_embedding.value.shape()));
  for (auto& layer : layers) layer->layouts(out);
  nn::ParameterList norm;
  m.final_norm.parameters(norm);
  for (nn::Parameter* p : norm) out.push_back(nn::ShardLayout::replicated(p->value.shape()));
  if (head_table) out.push_back(head_table->layout());
  return out;
}

nn::ParameterList TransformerLM::TensorParallelParts::sequence_parallel_parameters(TransformerLM& m) {
  nn::ParameterList out;
  if (!parallel.sequence_parallel) return out;
  for (auto& layer : layers) layer->sequence_parallel_parameters(out);
  m.final_norm.parameters(out);
  return out;
}

void TransformerLM::TensorParallelParts::to(TransformerLM&, Device device) {
  embedding->to(device);
  if (head_table) head_table->to(device);
}

void TransformerLM::TensorParallelParts::init(TransformerLM& m, Context& ctx, uint64_t seed) {
  // The single-device model's draws, parameter by parameter in its order: each full tensor
  // is drawn on the device from the same offset of the seed's stream and this rank keeps
  // its shard, so a tensor-parallel run starts from the weights of the single-device one.
  const nn::ParameterList params = parameters(m);
  const std::vector<nn::ShardLayout> shapes = layouts(m);
  uint64_t stream = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    nn::Parameter* p = params[i];
    Tensor& w = p->weights();
    Tensor full = Tensor::empty(shapes[i].full, w.dtype(), w.device());
    init_tensor(ctx, p->name, full, m.config_.num_layers, seed, stream);
    w.copy_from(nn::slice_full(shapes[i], parallel.tensor_rank, full));
    p->refresh_value(ctx);
    stream += static_cast<uint64_t>(full.numel());
  }
  m.zero_grad();
  embedding->clear_padding_grad();
  if (head_table) head_table->clear_padding_grad();
}

Tensor TransformerLM::TensorParallelParts::trunk_forward(TransformerLM& m, Context& ctx, const Tensor& inputs,
                                                         Saved& saved) {
  TESSERA_CHECK(inputs.dim() == 2, "TransformerLM: inputs must be [batch, seq] token ids, got ", inputs.describe());
  const int64_t batch = inputs.size(0), seq = inputs.size(1), rows = batch * seq;
  TESSERA_CHECK(seq <= m.config_.max_seq_len, "TransformerLM: sequence length ", seq, " exceeds model.max_seq_len ",
                m.config_.max_seq_len);
  TESSERA_CHECK(!parallel.sequence_parallel || rows % parallel.tensor_size == 0,
                "TransformerLM: sequence parallelism needs batch x seq (", batch, " x ", seq,
                ") divisible by the tensor size ", parallel.tensor_size);
  Tensor x = embedding->forward_partial(ctx, inputs, saved.embed);
  // GPT-2's positions join on one rank before the sum, so they are counted once; the sum
  // then adds one nonzero embedding to them, exactly the single-device add.
  if (m.position_embedding.value.defined() && parallel.tensor_rank == 0) {
    Tensor pos = m.position_embedding.value.slice(0, 0, seq);
    for (int64_t b = 0; b < batch; ++b) {
      Tensor part = x.slice(0, b * seq, (b + 1) * seq);
      add(ctx, part, pos, part);
    }
  }
  x = embedding->reduce(ctx, x);
  saved.layers.resize(layers.size());
  Tensor branch;
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto out = layers[i]->forward(ctx, x, branch, batch, seq, saved.layers[i]);
    x = out.residual;
    branch = out.branch;
  }
  return branch.defined() ? m.final_norm.forward_add(ctx, x, branch, saved.final_norm)
                          : m.final_norm.forward(ctx, x, saved.final_norm);
}

namespace {

// Points the listed parameters' gradients at zeroed slices of one scratch buffer for a
// step, then sums the scratch over the group and adds it to the real gradients. Restores
// the gradients also when the step throws.
class SequenceParallelGrads {
 public:
  SequenceParallelGrads(Context& ctx, nn::ParameterList params) : params_(std::move(params)) {
    if (params_.empty()) return;
    int64_t total = 0;
    for (nn::Parameter* p : params_) total += p->grad.numel();
    scratch_ = Tensor::zeros({total}, params_[0]->grad.dtype(), ctx.device);
    int64_t at = 0;
    for (nn::Parameter* p : params_) {
      kept_.push_back(p->grad);
      p->grad = scratch_.slice(0, at, at + p->grad.numel()).reshape(p->grad.shape());
      at += kept_.back().numel();
    }
  }
  void finish(Context& ctx, dist::ProcessGroup& group) {
    if (params_.empty()) return;
    group.all_reduce(ctx, scratch_);
    for (size_t i = 0; i < params_.size(); ++i) add(ctx, kept_[i], params_[i]->grad, kept_[i]);
    restore();
  }
  ~SequenceParallelGrads() { restore(); }

 private:
  void restore() {
    for (size_t i = 0; i < kept_.size(); ++i) params_[i]->grad = kept_[i];
    kept_.clear();
  }
  nn::ParameterList params_;
  std::vector<Tensor> kept_;
  Tensor scratch_;
};

}  // namespace

double TransformerLM::TensorParallelParts::forward_backward(TransformerLM& m, Context& ctx, const Tensor& inputs,
                                                            const Tensor& targets, float scale) {
  TESSERA_CHECK(targets.shape() == inputs.shape(), "TransformerLM: targets ", targets.describe(), " must match inputs ",
                inputs.describe());
  const int64_t batch = inputs.size(0), seq = inputs.size(1);
  if (m.position_embedding.value.defined() &&
      !(m.positions_.defined() && m.positions_seq_ == seq && m.positions_.numel() == batch * seq &&
        m.positions_.device() == ctx.device)) {
    Tensor host_positions = Tensor::empty({batch * seq}, DType::I32);
    for (int64_t i = 0; i < batch * seq; ++i) host_positions.data<int32_t>()[i] = static_cast<int32_t>(i % seq);
    m.positions_ = host_positions.to(ctx.device);
    m.positions_seq_ = seq;
  }
  Saved saved;
  m.grads_notified_.clear();
  const Tensor h = trunk_forward(m, ctx, inputs, saved);
  const nn::ParameterList sp_params = sequence_parallel_parameters(m);
  SequenceParallelGrads sp_grads(ctx, sp_params);
  Tensor d = Tensor::empty(h.shape(), m.dtype_, ctx.device);
  const nn::VocabParallelLMHead::Loss loss = head->loss(ctx, h, targets, &d, scale, kIgnoreIndex);
  d = m.final_norm.backward_input(ctx, d, saved.final_norm);
  for (size_t i = layers.size(); i-- > 0;) {
    const Tensor dy = d;
    d = layers[i]->backward_input(ctx, dy, saved.layers[i]);
    layers[i]->backward_weight(ctx, dy, saved.layers[i]);
    if (m.grad_ready_) {
      // Final now, except the norms under sequence parallelism (summed over the group below).
      nn::ParameterList all, done;
      layers[i]->parameters(all);
      for (nn::Parameter* p : all)
        if (std::find(sp_params.begin(), sp_params.end(), p) == sp_params.end()) done.push_back(p);
      m.notify_grads_ready(ctx, done);
    }
  }
  const Tensor d_full = embedding->gather_grad(ctx, d);
  embedding->backward_weight(ctx, d_full, saved.embed);
  if (m.position_embedding.value.defined()) embedding_backward(ctx, m.positions_, d_full, m.position_embedding.grad);
  sp_grads.finish(ctx, *group);
  embedding->clear_padding_grad();
  if (head_table) head_table->clear_padding_grad();
  m.notify_rest(ctx);
  m.last_aux_loss_ = 0;
  return loss.read();
}

double TransformerLM::TensorParallelParts::forward_loss(TransformerLM& m, Context& ctx, const Tensor& inputs,
                                                        const Tensor& targets) {
  TESSERA_CHECK(targets.shape() == inputs.shape(), "TransformerLM: targets ", targets.describe(), " must match inputs ",
                inputs.describe());
  Saved saved;
  const Tensor h = trunk_forward(m, ctx, inputs, saved);
  return head->loss(ctx, h, targets, nullptr, 1.0f, kIgnoreIndex).read();
}

Tensor TransformerLM::TensorParallelParts::logits(TransformerLM& m, Context& ctx, const Tensor& inputs) {
  Saved saved;
  const Tensor h = trunk_forward(m, ctx, inputs, saved);
  return head->logits(ctx, h).reshape({inputs.size(0), inputs.size(1), m.config_.vocab_size});
}

// ---- The full-layout API ----

namespace {

// The parameter a tensor belongs to: its own name, or its longest dotted prefix.
size_t parameter_index(const std::map<std::string, size_t>& index, const std::string& name, const char* op) {
  std::string key = name;
  while (true) {
    auto it = index.find(key);
    if (it != index.end()) return it->second;
    const size_t dot = key.rfind('.');
    TESSERA_CHECK(dot != std::string::npos, op, ": '", name, "' names no parameter of the model");
    key.resize(dot);
  }
}

std::map<std::string, size_t> index_by_name(const nn::ParameterList& params) {
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) index.emplace(params[i]->name, i);
  return index;
}

}  // namespace

std::vector<nn::ShardLayout> TransformerLM::shard_layouts() {
  if (tp_) return tp_->layouts(*this);
  std::vector<nn::ShardLayout> out;
  for (nn::Parameter* p : parameters()) out.push_back(nn::ShardLayout::replicated(p->value.shape()));
  return out;
}

TransformerLM::NamedTensors TransformerLM::full_state_dict(Context& ctx, Device dst) {
  const nn::ParameterList params = parameters();
  const std::vector<nn::ShardLayout> layouts = shard_layouts();
  dist::GroupPtr group = parallel_.tensor_group ? parallel_.tensor_group : dist::local_group();
  NamedTensors out;
  for (size_t i = 0; i < params.size(); ++i)
    out.emplace_back(params[i]->name, nn::gather_full(ctx, *group, layouts[i], params[i]->weights(), dst));
  return out;
}

void TransformerLM::load_full_state(Context& ctx, const NamedTensors& full) {
  const nn::ParameterList params = parameters();
  const std::vector<nn::ShardLayout> layouts = shard_layouts();
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : full) by_name.emplace(name, &t);
  for (size_t i = 0; i < params.size(); ++i) {
    nn::Parameter* p = params[i];
    auto it = by_name.find(p->name);
    TESSERA_CHECK(it != by_name.end(), "TransformerLM::load_full_state: no tensor named '", p->name, "'");
    const Tensor& t = *it->second;
    TESSERA_CHECK(t.shape() == layouts[i].full, "TransformerLM::load_full_state: '", p->name, "' is ", t.describe(),
                  ", the model's full tensor is ", shape_to_string(layouts[i].full));
    p->weights().copy_from(nn::slice_full(layouts[i], parallel_.tensor_rank, nn::host_copy_as(t, p->weights().dtype())));
    p->refresh_value(ctx);
  }
  if (tp_) {
    tp_->embedding->clear_padding_grad();
    if (tp_->head_table) tp_->head_table->clear_padding_grad();
  }
}

TransformerLM::NamedTensors TransformerLM::gather_full(Context& ctx, const NamedTensors& local, Device dst) {
  const nn::ParameterList params = parameters();
  const std::vector<nn::ShardLayout> layouts = shard_layouts();
  const auto index = index_by_name(params);
  dist::GroupPtr group = parallel_.tensor_group ? parallel_.tensor_group : dist::local_group();
  NamedTensors out;
  for (const auto& [name, t] : local) {
    const size_t i = parameter_index(index, name, "TransformerLM::gather_full");
    out.emplace_back(name, nn::gather_full(ctx, *group, layouts[i], t.to(ctx.device), dst));
  }
  return out;
}

TransformerLM::NamedTensors TransformerLM::shard_full(const NamedTensors& full) {
  const nn::ParameterList params = parameters();
  const std::vector<nn::ShardLayout> layouts = shard_layouts();
  const auto index = index_by_name(params);
  NamedTensors out;
  for (const auto& [name, t] : full) {
    const size_t i = parameter_index(index, name, "TransformerLM::shard_full");
    out.emplace_back(name, nn::slice_full(layouts[i], parallel_.tensor_rank, t));
  }
  return out;
}

double TransformerLM::grad_norm(Context& ctx) {
  dist::GroupPtr group = parallel_.tensor_group ? parallel_.tensor_group : dist::local_group();
  return nn::tensor_parallel_grad_norm(ctx, *group, parameters(), shard_layouts());
}

double TransformerLM::clip_grad_norm(Context& ctx, double max_norm) {
  const double norm = grad_norm(ctx);
  if (max_norm > 0 && norm > max_norm) {
    const float factor = static_cast<float>(max_norm / (norm + 1e-6));
    for (nn::Parameter* p : parameters()) scale(ctx, p->grad, factor, p->grad);
  }
  return norm;
}

}  // namespace tessera::models
