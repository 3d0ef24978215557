// FP8 training for a TransformerLM: every linear layer of its blocks (the QKV projection,
// the attention output, the MLP's two layers) runs its GEMMs in FP8 under one recipe; the
// embeddings, norms, attention core and LM head stay in the model's dtype, as in Transformer
// Engine's recipes. Needs BF16 compute (training.precision bf16); layers whose sizes the FP8
// GEMMs cannot take run in BF16 (see nn/linear.h).
#pragma once

#include <memory>

#include "tessera/fp8/recipe.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/nn/fp8_scaling.h"

namespace tessera::models {

// Binds the block linears to a new Fp8Scaling on ctx.device and returns it: call its
// end_micro_batch after each micro-batch's backward and end_step after each optimizer step
// (delayed scaling's bookkeeping; a train::CudaGraphStep step queues both itself), and keep
// its state_dict with the checkpoint.
std::shared_ptr<nn::Fp8Scaling> enable_fp8(Context& ctx, TransformerLM& model, const fp8::Recipe& recipe);

// Turns FP8 off again (every layer back to its own dtype).
void disable_fp8(TransformerLM& model);

// The Fp8Scaling the model's block linears are bound to, or null when none is (throws if
// they are bound to several). train::CudaGraphStep uses it to queue the scaling's
// bookkeeping inside the captured step.
std::shared_ptr<nn::Fp8Scaling> fp8_scaling_of(TransformerLM& model);

}  // namespace tessera::models
