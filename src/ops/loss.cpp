#include "tessera/ops/loss.h"

#include "backend/cpu/loss.h"
#include "dispatch.h"
#include "tessera/ops/quantize.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/index_error.h"
#include "backend/cuda/loss.h"
#include "backend/cuda/loss_accumulate.h"
#include "backend/cuda/loss_fp8.h"
#endif

namespace tessera {
namespace {

// The dtype the saved log-sum-exp must have: the statistics rule of every op.
DType lse_dtype_for(const Tensor& logits) { return logits.dtype() == DType::F64 ? DType::F64 : DType::F32; }

void check_logits_and_targets(const Tensor& logits, const Tensor& targets, const char* op) {
  check_row_strided(logits, op, "logits");
  check_contiguous(targets, op, "targets");
  check_floating(logits, op, "logits");
  TESSERA_CHECK(logits.dim() == 2, op, ": logits must be 2-D [N, V], got ", logits.describe());
  TESSERA_CHECK(logits.size(1) > 0, op, ": logits need a vocabulary of at least one entry, got ", logits.describe());
  TESSERA_CHECK(targets.dtype() == DType::I32 || targets.dtype() == DType::I64, op,
                ": targets must be I32 or I64, got ", targets.describe());
  check_shape(targets, {logits.size(0)}, op, "targets");
}

void check_lse(const Tensor& logits, const Tensor& lse, const char* op) {
  check_contiguous(lse, op, "lse");
  check_dtype(lse, lse_dtype_for(logits), op, "lse");
  check_shape(lse, {logits.size(0)}, op, "lse");
}

}  // namespace

void cross_entropy_forward(Context& ctx, const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse,
                           const CrossEntropyOptions& options) {
  const char* op = "cross_entropy_forward";
  check_logits_and_targets(logits, targets, op);
  check_contiguous(loss, op, "loss");
  TESSERA_CHECK(loss.dtype() == DType::F32 || loss.dtype() == DType::F64, op, ": loss must be F32 or F64, got ",
                loss.describe());
  check_shape(loss, {1}, op, "loss");
  check_lse(logits, lse, op);
  check_on_device(ctx, op, {&logits, &targets, &loss, &lse});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    // Bad targets are checked inside the kernels and reported here by the next call.
    cuda::raise_pending_index_error(ctx.device.index, ctx.stream, op);
    if (cuda::cross_entropy_forward_supported(logits, loss, lse)) {
      cuda::cross_entropy_forward(ctx.stream, logits, targets, loss, lse, options.ignore_index);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::cross_entropy_forward(logits.contiguous(), targets, loss, lse, options);
}

void cross_entropy_backward(Context& ctx, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            float d_loss, Tensor& d_logits, const CrossEntropyOptions& options) {
  const char* op = "cross_entropy_backward";
  check_logits_and_targets(logits, targets, op);
  check_lse(logits, lse, op);
  check_row_strided(d_logits, op, "d_logits");
  check_floating(d_logits, op, "d_logits");
  check_shape(d_logits, logits.shape(), op, "d_logits");
  check_on_device(ctx, op, {&logits, &targets, &lse, &d_logits});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    cuda::raise_pending_index_error(ctx.device.index, ctx.stream, op);
    if (cuda::cross_entropy_backward_supported(logits, lse, d_logits)) {
      cuda::cross_entropy_backward(ctx.stream, logits, targets, lse, d_loss, d_logits, options.ignore_index);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (d_logits.is_contiguous()) {
    cpu::cross_entropy_backward(logits.contiguous(), targets, lse, d_loss, d_logits, options);
  } else {
    Tensor packed = Tensor::empty(d_logits.shape(), d_logits.dtype());
    cpu::cross_entropy_backward(logits.contiguous(), targets, lse, d_loss, packed, options);
    d_logits.copy_from(packed);
  }
}

void cross_entropy_forward_backward(Context& ctx, const Tensor& logits, const Tensor& targets, Tensor& loss,
                                    Tensor& lse, float d_loss, Tensor& d_logits, const CrossEntropyOptions& options) {
  const char* op = "cross_entropy_forward_backward";
  check_logits_and_targets(logits, targets, op);
  check_contiguous(loss, op, "loss");
  check_shape(loss, {1}, op, "loss");
  check_lse(logits, lse, op);
  check_row_strided(d_logits, op, "d_logits");
  check_shape(d_logits, logits.shape(), op, "d_logits");
  check_on_device(ctx, op, {&logits, &targets, &loss, &lse, &d_logits});
#if TESSERA_WITH_CUDA
  if (ctx.device.is_cuda() && cuda::cross_entropy_fused_supported(logits, loss, lse, d_logits)) {
    cuda::raise_pending_index_error(ctx.device.index, ctx.stream, op);
    cuda::cross_entropy_fused(ctx.stream, logits, targets, loss, lse, d_loss, d_logits, options.ignore_index);
    return;
  }
#endif
  // Elsewhere (and on the CPU) the two ops, which check the rest.
  cross_entropy_forward(ctx, logits, targets, loss, lse, options);
  cross_entropy_backward(ctx, logits, targets, lse, d_loss, d_logits, options);
}

void cross_entropy_backward_fp8(Context& ctx, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                                float d_loss, const Tensor& fp8_scale, Tensor& q, const CrossEntropyOptions& options) {
  const char* op = "cross_entropy_backward_fp8";
  check_logits_and_targets(logits, targets, op);
  check_lse(logits, lse, op);
  check_contiguous(q, op, "q");
  TESSERA_CHECK(q.dtype() == DType::E4M3 || q.dtype() == DType::E5M2, op, ": q must be E4M3 or E5M2, got ",
                q.describe());
  TESSERA_CHECK(q.dim() == 2 && q.size(0) == logits.size(0) && q.size(1) >= logits.size(1), op, ": q ",
                q.describe(), " must be [N, W] with W >= V for logits ", logits.describe());
  check_contiguous(fp8_scale, op, "fp8_scale");
  check_dtype(fp8_scale, DType::F32, op, "fp8_scale");
  check_shape(fp8_scale, {1}, op, "fp8_scale");
  check_on_device(ctx, op, {&logits, &targets, &lse, &fp8_scale, &q});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    cuda::raise_pending_index_error(ctx.device.index, ctx.stream, op);
    if (cuda::cross_entropy_backward_fp8_supported(logits, lse, q)) {
      cuda::cross_entropy_backward_fp8(ctx.stream, logits, targets, lse, d_loss, fp8_scale, q, options.ignore_index);
      return;
    }
#endif
  }
  // The BF16 gradient in a scratch buffer whose padding columns are 0, then the cast.
  Tensor scratch = Tensor::zeros({q.size(0), q.size(1)}, DType::BF16, ctx.device);
  Tensor d_logits = scratch.slice(1, 0, logits.size(1));
  cross_entropy_backward(ctx, logits, targets, lse, d_loss, d_logits, options);
  quantize_per_tensor(ctx, scratch, fp8_scale, q);
}

void accumulate_weighted_loss(Context& ctx, const Tensor& chunk_losses, const std::vector<double>& weights,
                              double divisor, Tensor& acc) {
  const char* op = "accumulate_weighted_loss";
  check_contiguous(chunk_losses, op, "chunk_losses");
  TESSERA_CHECK(chunk_losses.dtype() == DType::F32 || chunk_losses.dtype() == DType::F64, op,
                ": chunk_losses must be F32 or F64, got ", chunk_losses.describe());
  check_shape(chunk_losses, {static_cast<int64_t>(weights.size())}, op, "chunk_losses");
  check_contiguous(acc, op, "acc");
  check_dtype(acc, DType::F64, op, "acc");
  check_shape(acc, {1}, op, "acc");
  TESSERA_CHECK(divisor > 0, op, ": divisor must be positive, got ", divisor);
  check_on_device(ctx, op, {&chunk_losses, &acc});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::accumulate_weighted_loss_supported(chunk_losses, acc)) {
      cuda::accumulate_weighted_loss(ctx.stream, chunk_losses, weights, divisor, acc);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  double total = 0;
  for (size_t i = 0; i < weights.size(); ++i) total += chunk_losses.item(static_cast<int64_t>(i)) * weights[i];
  acc.data<double>()[0] += total / divisor;
}

}  // namespace tessera
