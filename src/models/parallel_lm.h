// The tensor-parallel part of TransformerLM (internal; see tessera/models/transformer_lm.h).
// TransformerLM's methods hand over to these when it was built with tensor_size > 1.
#pragma once

#include <memory>
#include <vector>

#include "tessera/models/transformer_lm.h"
#include "tessera/nn/parallel_transformer_layer.h"
#include "tessera/nn/vocab_parallel.h"

namespace tessera::models {

struct TransformerLM::TensorParallelParts {
  TensorParallelParts(const ModelConfig& config, DType dtype, const nn::ParallelContext& parallel);

  struct Saved {
    nn::VocabParallelEmbedding::Saved embed;
    std::vector<nn::TensorParallelTransformerLayer::Saved> layers;
    nn::Norm::Saved final_norm;
  };

  nn::ParameterList parameters(TransformerLM& m);
  std::vector<nn::ShardLayout> layouts(TransformerLM& m);
  // The norms' parameters, whose gradients cover this rank's rows only under sequence
  // parallelism (empty without it).
  nn::ParameterList sequence_parallel_parameters(TransformerLM& m);
  void to(TransformerLM& m, Device device);
  void init(TransformerLM& m, Context& ctx, uint64_t seed);
  Tensor trunk_forward(TransformerLM& m, Context& ctx, const Tensor& inputs, Saved& saved);
  double forward_backward(TransformerLM& m, Context& ctx, const Tensor& inputs, const Tensor& targets, float scale);
  double forward_loss(TransformerLM& m, Context& ctx, const Tensor& inputs, const Tensor& targets);
  Tensor logits(TransformerLM& m, Context& ctx, const Tensor& inputs);

  nn::ParallelContext parallel;
  std::shared_ptr<dist::ProcessGroup> group;
  std::unique_ptr<nn::VocabParallelEmbedding> embedding;
  std::unique_ptr<nn::VocabParallelEmbedding> head_table;  // untied embeddings only ("lm_head.weight")
  std::unique_ptr<nn::VocabParallelLMHead> head;
  std::vector<std::unique_ptr<nn::TensorParallelTransformerLayer>> layers;
};

}  // namespace tessera::models
