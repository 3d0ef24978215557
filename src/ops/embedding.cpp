#include "tessera/ops/embedding.h"

#include "backend/cpu/embedding.h"
#include "dispatch.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/embedding.h"
#include "backend/cuda/index_error.h"
#endif

namespace tessera {
namespace {

// ids.shape + [channels]
Shape embedded_shape(const Tensor& ids, int64_t channels) {
  Shape s = ids.shape();
  s.push_back(channels);
  return s;
}

void check_ids(const Tensor& ids, const char* op) {
  check_contiguous(ids, op, "ids");
  TESSERA_CHECK(ids.dtype() == DType::I32 || ids.dtype() == DType::I64, op, ": ids must be I32 or I64, got ",
                ids.describe());
}

}  // namespace

void embedding_forward(Context& ctx, const Tensor& ids, const Tensor& table, Tensor& out) {
  const char* op = "embedding_forward";
  check_ids(ids, op);
  check_contiguous(table, op, "table");
  check_contiguous(out, op, "out");
  check_floating(table, op, "table");
  check_floating(out, op, "out");
  TESSERA_CHECK(table.dim() == 2, op, ": table must be 2-D [V, C], got ", table.describe());
  check_shape(out, embedded_shape(ids, table.size(1)), op, "out");
  check_on_device(ctx, op, {&ids, &table, &out});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    // Bad ids are checked inside the kernels and reported here by the next call.
    cuda::raise_pending_index_error(ctx.device.index, ctx.stream, op);
    if (cuda::embedding_forward_supported(table, out)) {
      cuda::embedding_forward(ctx.stream, ids, table, out);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::embedding_forward(ids, table, out);
}

void embedding_backward(Context& ctx, const Tensor& ids, const Tensor& d_out, Tensor& d_table) {
  const char* op = "embedding_backward";
  check_ids(ids, op);
  check_contiguous(d_out, op, "d_out");
  check_contiguous(d_table, op, "d_table");
  check_floating(d_out, op, "d_out");
  check_floating(d_table, op, "d_table");
  TESSERA_CHECK(d_table.dim() == 2, op, ": d_table must be 2-D [V, C], got ", d_table.describe());
  check_shape(d_out, embedded_shape(ids, d_table.size(1)), op, "d_out");
  check_on_device(ctx, op, {&ids, &d_out, &d_table});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    cuda::raise_pending_index_error(ctx.device.index, ctx.stream, op);
    if (cuda::embedding_backward_supported(d_out, d_table)) {
      cuda::embedding_backward(ctx.stream, ids, d_out, d_table);
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  cpu::embedding_backward(ids, d_out, d_table);
}

}  // namespace tessera
