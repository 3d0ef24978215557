// Kernel choice for the row-wise softmax forward and cross-entropy kernels (softmax.cu,
// loss.cu), for tuning sweeps (`bench_bandwidth 20 softmax,cross_entropy --sweep-softmax`)
// and for tests that run every variant. Host-side, process-wide; not thread-safe (set it
// before launching work, as the benchmark and the tests do). Declarations only.
#pragma once

namespace tessera::cuda {

struct RowTuning {
  // 0: the warp-row kernels (row_lse.cuh): a row held in registers by 4 to 32 lanes of one
  //    warp, a thread-local max and sum merged in one shuffle butterfly (no barrier); rows
  //    these do not take (unaligned, odd widths, too wide) go to the previous kernels.
  // 1: the previous kernels only (block-group register kernels, looping kernels).
  int softmax_forward = 0;
  int cross_entropy_forward = 0;
  // 0: the flat backward (16-byte vectors of the whole [N, V] gradient, `backward_vectors`
  //    per thread, no row blocks); 1: the previous one-block-per-row kernel.
  int cross_entropy_backward = 0;
  // 0: cross_entropy_forward_backward in one pass where it applies (loss_fused.cu: a cluster
  //    of blocks holds each row); 1: the forward and backward kernels above, one after the
  //    other. 1 by default: on the H200 the pass is still slower than the two kernels
  //    (loss_fused.cu; TESSERA_CROSS_ENTROPY_FUSED=1 starts a process with it on).
  int cross_entropy_fused = 1;
  // Lanes per row for the warp-row kernels: 0 = automatic (the fewest lanes, at least 4,
  // that hold the row in at most 64 registers of data), else 4, 8, 16 or 32 (a forced value
  // that cannot hold the row falls back to the automatic one).
  int group = 0;
  // 16-byte vectors per thread of the flat cross-entropy backward: 0 = automatic (4), 4 or 8.
  int backward_vectors = 0;
};
void set_row_tuning(const RowTuning& tuning);
RowTuning row_tuning();

// Shorthand for the softmax forward alone (0 = default warp-row kernel, 1 = previous kernel).
void set_softmax_kernel(int kernel);

}  // namespace tessera::cuda
