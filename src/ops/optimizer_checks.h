// The argument checks of adamw_step_multi (ops/optimizer.cpp), for ops that run the same
// update in a kernel of their own (moe_fp8_adamw_cast_weights). Internal to src/ops.
#pragma once

#include <vector>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"
#include "tessera/ops/optimizer.h"

namespace tessera {

// Everything adamw_step_multi checks before it runs, with `op` naming the caller in errors:
// list lengths, options, the norm, each tensor's dtype, shape, contiguity and device, and
// that nothing written overlaps anything else. options: lr and step already taken from
// step_scalars when given (then placeholders).
void check_adamw_step_multi(Context& ctx, const char* op, const std::vector<Tensor>& params,
                            const std::vector<Tensor>& grads, const std::vector<Tensor>& exp_avgs,
                            const std::vector<Tensor>& exp_avg_sqs, const std::vector<Tensor>& bf16_values,
                            const AdamWOptions& options, const std::vector<float>& weight_decays,
                            const Tensor& grad_norm, double max_norm, const Tensor& step_scalars);

}  // namespace tessera
