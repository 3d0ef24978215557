// Host side of the LayerNorm/RMSNorm kernels (norm_kernels.cuh): launch shapes, the vector
// width and alignment checks, the scratch partials of the parameter gradients, and one
// launcher each for forward and backward, templated like the kernels on kLayer and kAdd.
// The warp-row kernels (norm_warp.cuh) are launched from the same two launchers when
// NormTuning::kernel selects them and the row fits; the row-group kernels otherwise.
// Included by norm.cu, add_norm.cu and norm_fp8.cu only (anonymous namespace, as the kernels).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "cuda_check.h"
#include "norm.h"
#include "norm_kernels.cuh"
#include "norm_warp.cuh"
#include "pdl.cuh"
#include "tessera/core/tensor.h"

namespace tessera::cuda {

namespace {

// ---- Host side -----------------------------------------------------------------------------

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

Param param_of(const Tensor& t) {
  return {t.defined() ? t.raw_data() : nullptr, t.defined() && t.dtype() == DType::BF16};
}

// A parameter read in vectors of `vec` elements must be aligned to one vector (16 bytes at most).
bool param_aligned(const Tensor& t, int vec) {
  if (!t.defined()) return true;
  const size_t bytes = static_cast<size_t>(vec) * dtype_size(t.dtype());
  return aligned(t.raw_data(), bytes < 16 ? bytes : 16);
}

// Multiprocessors of `device` and resident blocks of `kernel` per multiprocessor (with
// `smem` bytes of dynamic shared memory a block), cached.
int device_query(const void* kernel, int threads, int device, size_t smem = 0) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, size_t>, int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, threads, device, smem);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int value = 0;
  if (kernel) TESSERA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&value, kernel, threads, smem));
  else TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device));
  value = value > 0 ? value : 1;
  cache.emplace(key, value);
  return value;
}

// Threads per row (tpr, a power of two up to kMaxGroupThreads), rows per block and vectors
// per thread (nv, a power of two; 0 when the row needs more than max_nv). The group is sized
// so each thread holds about target_nv vectors.
struct RowConfig {
  int tpr, rpb, nv;
};
RowConfig row_config(int64_t vectors, int target_nv, int max_nv) {
  int tpr = 1;
  while (tpr < ceil_div(vectors, target_nv) && tpr < kMaxGroupThreads) tpr *= 2;
  int nv = 1;
  while (nv < ceil_div(vectors, tpr)) nv *= 2;
  return {tpr, tpr >= 64 ? 1 : 128 / tpr, nv <= max_nv ? nv : 0};
}

// fn(Int<nv>) for nv in {1, 2, 4, 8} up to kMax (only those get instantiated).
template <int kMax, typename Fn>
void dispatch_nv(int nv, Fn&& fn) {
  if (nv == 1) fn(Int<1>{});
  else if (nv == 2) fn(Int<2>{});
  else if constexpr (kMax >= 4) {
    if (nv == 4) fn(Int<4>{});
    else if constexpr (kMax >= 8) fn(Int<8>{});
  }
}

// The warp-row kernels (norm_warp.cuh) for a row of `vectors` 16-byte vectors: the fewest
// warps per row (1 to 8) with at most max_words words of the row per lane (or, when eight
// warps do not suffice, up to max_nv vectors), and the vectors per lane (a power of two);
// warps = 0 when the row does not fit (or is under one vector per lane of a warp, where a
// warp would idle), so the row-group kernels run.
struct WarpRowConfig {
  int warps, nv;
};
WarpRowConfig warp_row_config(int64_t vectors, int max_words, int max_nv) {
  if (vectors < 32) return {0, 0};
  for (int cap : {std::min(max_words / 4, max_nv), max_nv})
    for (int warps = 1; warps <= kWarpRowMaxWarps; warps *= 2) {
      const int64_t per_lane = ceil_div(vectors, 32 * warps);
      if (per_lane > cap) continue;
      int nv = 1;
      while (nv < per_lane) nv *= 2;
      return {warps, nv};
    }
  return {0, 0};
}

// Whether the warp-row kernels are chosen (NormTuning::kernel). Measured on the H200
// (bench/RESULTS.md, seventh session): the warp-row forward beats the row-group one in every
// form (LayerNorm 59 -> 71%, add+LayerNorm 71 -> 86%, RMSNorm 82 -> 90%, add+RMSNorm 82 -> 96%
// of copy), so it is the default; the warp-row backward is not better overall (better for
// plain LayerNorm, worse with the residual), so the backward default stays row-group.
bool warp_rows_selected(const NormTuning& tuning, bool forward) {
  return forward ? tuning.kernel != 1 : tuning.kernel == 2;
}

int warp_words_or(const NormTuning& tuning, int fallback) {
  return tuning.warp_words >= 4 && tuning.warp_words <= 64 ? tuning.warp_words : fallback;
}

// fn(Int<nv>) for nv in {1, 2, 4, 8, 16} up to kMax.
template <int kMax, typename Fn>
void dispatch_nv16(int nv, Fn&& fn) {
  if (nv == 1) fn(Int<1>{});
  else if (nv == 2) fn(Int<2>{});
  else if (nv == 4) fn(Int<4>{});
  else if constexpr (kMax >= 8) {
    if (nv == 8) fn(Int<8>{});
    else if constexpr (kMax >= 16) fn(Int<16>{});
  }
}

// fn(tag) with a typed null pointer for x's storage type.
template <typename Fn>
void dispatch_storage(DType t, Fn&& fn) {
  if (t == DType::F32) fn(static_cast<float*>(nullptr));
  else fn(static_cast<uint16_t*>(nullptr));
}

// kAdd: residual and sum are the fused add's operand and output (null otherwise); the
// front end has checked that they are x's shape and dtype. make_sink(T* tag) returns the
// kernels' output sink for storage type T (norm_kernels.cuh): StoreY<T>{y} for the plain ops.
template <bool kLayer, bool kAdd, typename MakeSink>
void norm_forward_to(void* stream, const Tensor& x, const Tensor* residual, Tensor* sum, const Tensor& gamma,
                     const Tensor& beta, double eps, MakeSink&& make_sink, Tensor* mean, Tensor& rstd) {
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  if (rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const Param g = param_of(gamma), b = param_of(beta);
  float* mean_ptr = mean ? mean->data<float>() : nullptr;
  dispatch_storage(x.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int kVec = 16 / sizeof(T);
    const auto sink = make_sink(tag);
    using Sink = std::remove_const_t<decltype(sink)>;
    const T* residual_ptr = kAdd ? residual->data<T>() : nullptr;
    T* sum_ptr = kAdd ? sum->data<T>() : nullptr;
    const bool vectorized = cols % kVec == 0 && aligned(x.raw_data(), 16) && sink.aligned_for(kVec) &&
                            param_aligned(gamma, kVec) && param_aligned(beta, kVec) &&
                            (!kAdd || (aligned(residual_ptr, 16) && aligned(sum_ptr, 16)));
    const NormTuning tuning = norm_tuning();
    if (vectorized && warp_rows_selected(tuning, /*forward=*/true)) {
      // Up to 16 vectors a lane for BF16 (warp_words = 64: C = 4096 in one warp, 128
      // registers, no spills); F32 stops at 8 (16 took 203 registers for LayerNorm). The
      // default, 16 words (C = 4096 BF16 on four warps; the fastest for the add forms, within
      // 1.5% of 32 words for the plain ones), is the same for the plain and the add forms:
      // the same reduction order, so add + norm equals the fused form to the bit.
      constexpr int kMaxNv = std::is_same_v<T, float> ? 8 : 16;
      const WarpRowConfig wcfg = warp_row_config(cols / kVec, warp_words_or(tuning, 16), kMaxNv);
      if (wcfg.warps > 0) {
        const int groups_per_block = kWarpRowThreads / 32 / wcfg.warps;
        dispatch_nv16<kMaxNv>(wcfg.nv, [&](auto nv_tag) {
          constexpr int NV = decltype(nv_tag)::value;
          const bool persistent = tuning.forward_persistent == 1;
          auto kernel = persistent ? warp_norm_forward_kernel<T, NV, kLayer, kAdd, true, Sink>
                                   : warp_norm_forward_kernel<T, NV, kLayer, kAdd, false, Sink>;
          const int device = x.device().index;
          const int64_t resident = int64_t(device_query(nullptr, 0, device)) *
                                   device_query(reinterpret_cast<const void*>(kernel), kWarpRowThreads, device);
          const int64_t needed = ceil_div(rows, groups_per_block);
          const int64_t blocks = persistent ? std::min(needed, resident) : needed;
          TESSERA_CHECK(blocks <= 0x7fffffff, "norm forward on CUDA: ", rows, " rows exceed one grid");
          kernel<<<unsigned(blocks), dim3(32 * wcfg.warps, groups_per_block), 0, s>>>(
              x.data<T>(), residual_ptr, sum_ptr, g, b, sink, mean_ptr, rstd.data<float>(), rows, cols, eps);
        });
        return;
      }
    }
    const int target_nv = tuning.forward_vectors > 0 ? tuning.forward_vectors : 4;
    const bool persistent = tuning.forward_persistent >= 0 ? tuning.forward_persistent == 1 : !kAdd;
    const RowConfig cfg = row_config(ceil_div(cols, vectorized ? kVec : 1), target_nv, kMaxForwardVectors);
    if (cfg.nv == 0) {
      TESSERA_CHECK(rows <= 0x7fffffff, "norm forward on CUDA: ", rows, " rows exceed one grid");
      norm_forward_wide_kernel<T, kLayer, kAdd, Sink><<<unsigned(rows), kWideThreads, 0, s>>>(
          x.data<T>(), residual_ptr, sum_ptr, g, b, sink, mean_ptr, rstd.data<float>(), cols, eps);
      return;
    }
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      dispatch_nv<kMaxForwardVectors>(cfg.nv, [&](auto nv_tag) {
        constexpr int NV = decltype(nv_tag)::value;
        auto kernel = norm_forward_kernel<T, VEC, NV, kLayer, kAdd, Sink>;
        // Plain norms: one wave of blocks, each group looping over rows and prefetching the
        // next (measured 16384 x 4096 BF16: LayerNorm 55 -> 59%, RMSNorm 72 -> 84% of
        // cudaMemcpy). The fused add reads two rows and keeps both prefetched, which costs it
        // occupancy (~125 registers): measured slower that way (add_rmsnorm 94 -> 85%), so it
        // keeps one row group per block, as many blocks as row groups (each steps once).
        const int device = x.device().index;
        const int64_t resident = int64_t(device_query(nullptr, 0, device)) *
                                 device_query(reinterpret_cast<const void*>(kernel), cfg.tpr * cfg.rpb, device);
        const int64_t blocks = persistent ? std::min(ceil_div(rows, cfg.rpb), resident) : ceil_div(rows, cfg.rpb);
        TESSERA_CHECK(blocks <= 0x7fffffff, "norm forward on CUDA: ", rows, " rows exceed one grid");
        kernel<<<unsigned(blocks), dim3(cfg.tpr, cfg.rpb), 0, s>>>(x.data<T>(), residual_ptr, sum_ptr, g, b, sink,
                                                                 mean_ptr, rstd.data<float>(), rows, cols, eps);
      });
    };
    if (vectorized) launch(Int<kVec>{});
    else launch(Int<1>{});
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

// The plain ops: y in x's dtype.
template <bool kLayer, bool kAdd>
void norm_forward(void* stream, const Tensor& x, const Tensor* residual, Tensor* sum, const Tensor& gamma,
                  const Tensor& beta, double eps, Tensor& y, Tensor* mean, Tensor& rstd) {
  norm_forward_to<kLayer, kAdd>(
      stream, x, residual, sum, gamma, beta, eps,
      [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        return StoreY<T>{y.data<T>()};
      },
      mean, rstd);
}

// kAdd: d_residual is added to dx (null otherwise).
template <bool kLayer, bool kAdd>
void norm_backward(void* stream, const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor* mean,
                   const Tensor& rstd, const Tensor* d_residual, Tensor& dx, Tensor& dgamma, Tensor* dbeta) {
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  if (rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const int device = x.device().index;
  const Param g = param_of(gamma);
  const float* mean_ptr = mean ? mean->data<float>() : nullptr;
  const bool has_dbeta = dbeta && dbeta->defined();
  const int sms = device_query(nullptr, 0, device);
  int64_t workers = 0;
  Tensor partials;  // [workers, cols] for dgamma, then (if any) the same for dbeta
  auto make_partials = [&] {
    partials = Tensor::empty({(has_dbeta ? 2 : 1) * workers * cols}, DType::F32, x.device());
  };
  float* dbeta_part = nullptr;
  dispatch_storage(x.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int kVec = 16 / sizeof(T);
    const T* d_residual_ptr = kAdd ? d_residual->data<T>() : nullptr;
    const bool vectorized = cols % kVec == 0 && aligned(x.raw_data(), 16) && aligned(dy.raw_data(), 16) &&
                            aligned(dx.raw_data(), 16) && param_aligned(gamma, kVec) &&
                            (!kAdd || aligned(d_residual_ptr, 16));
    const NormTuning tuning = norm_tuning();
    if (vectorized && warp_rows_selected(tuning, /*forward=*/false)) {
      // x, dy and the dgamma/dbeta partials in registers: 4 vectors a lane at most (8
      // spilled 1.3 KB; 4 fits BF16 LayerNorm in 128 registers, but spills 132 bytes with
      // the add). The default, 8 words (2 vectors, C = 4096 BF16 on eight warps), is
      // spill-free in every form and loads the next row ahead; it is the same for the
      // plain and the add forms, so their dx agree to the bit.
      const WarpRowConfig wcfg = warp_row_config(cols / kVec, warp_words_or(tuning, 8), 4);
      if (wcfg.warps > 0) {
        const int groups_per_block = kWarpRowThreads / 32 / wcfg.warps;
        dispatch_nv16<4>(wcfg.nv, [&](auto nv_tag) {
          constexpr int NV = decltype(nv_tag)::value;
          auto kernel = warp_norm_backward_kernel<T, NV, kLayer, kAdd>;
          // One wave of workers (row groups), each over a contiguous chunk of rows; one
          // partial row per block (the groups of a block add theirs in shared memory).
          // Blocks of several groups take (1 or 2) x cols floats of shared memory, at most
          // 32 KB (groups of up to 4 warps of 4 vectors a lane: C <= 4096 BF16).
          const size_t smem = groups_per_block > 1 ? size_t(has_dbeta ? 2 : 1) * cols * sizeof(float) : 0;
          const int64_t resident =
              int64_t(sms) * device_query(reinterpret_cast<const void*>(kernel), kWarpRowThreads, device, smem);
          const int64_t logical = std::min<int64_t>(rows, resident * groups_per_block);
          const int64_t blocks = ceil_div(logical, groups_per_block);
          workers = blocks;  // partial rows, as column_finalize_kernel counts them
          make_partials();
          dbeta_part = has_dbeta ? partials.data<float>() + workers * cols : nullptr;
          kernel<<<unsigned(blocks), dim3(32 * wcfg.warps, groups_per_block), smem, s>>>(
              dy.data<T>(), x.data<T>(), g, mean_ptr, rstd.data<float>(), d_residual_ptr, dx.data<T>(),
              partials.data<float>(), dbeta_part, rows, cols, logical);
        });
        return;
      }
    }
    const int target_nv = tuning.backward_vectors > 0 ? tuning.backward_vectors : 2;
    const RowConfig cfg = row_config(ceil_div(cols, vectorized ? kVec : 1), target_nv, kMaxBackwardVectors);
    if (cfg.nv == 0) {
      TESSERA_CHECK(rows <= 0x7fffffff, "norm backward on CUDA: ", rows, " rows exceed one grid");
      const int64_t col_blocks = ceil_div(cols, 256);
      workers = std::min<int64_t>({rows, std::max<int64_t>(1, 8 * sms / col_blocks), 65535});
      make_partials();
      dbeta_part = has_dbeta ? partials.data<float>() + workers * cols : nullptr;
      norm_column_partials_kernel<T, kLayer><<<dim3(unsigned(col_blocks), unsigned(workers)), 256, 0, s>>>(
          dy.data<T>(), x.data<T>(), mean_ptr, rstd.data<float>(), partials.data<float>(), dbeta_part, rows, cols);
      TESSERA_CUDA_CHECK_LAUNCH();
      norm_backward_dx_wide_kernel<T, kLayer, kAdd><<<unsigned(rows), kWideThreads, 0, s>>>(
          dy.data<T>(), x.data<T>(), g, mean_ptr, rstd.data<float>(), d_residual_ptr, dx.data<T>(), cols);
      return;
    }
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      dispatch_nv<kMaxBackwardVectors>(cfg.nv, [&](auto nv_tag) {
        constexpr int NV = decltype(nv_tag)::value;
        auto kernel = norm_backward_kernel<T, VEC, NV, kLayer, kAdd>;
        const int threads = cfg.tpr * cfg.rpb;
        // The fused LayerNorm backward's dbeta partials (kDbetaShared: two or more vectors a
        // thread), VEC floats a vector of every thread, in shared memory
        // (norm_backward_kernels.cuh): at most 512 threads x 2 vectors x 8 x 4 B = 32 KB.
        const size_t smem = kLayer && kAdd && NV > 1 && has_dbeta ? size_t(threads) * NV * VEC * sizeof(float) : 0;
        // One wave of workers: each resident row group is a worker.
        const int64_t resident =
            int64_t(sms) * device_query(reinterpret_cast<const void*>(kernel), threads, device, smem);
        workers = std::min<int64_t>(rows, resident * cfg.rpb);
        make_partials();
        dbeta_part = has_dbeta ? partials.data<float>() + workers * cols : nullptr;
        kernel<<<unsigned(ceil_div(workers, cfg.rpb)), dim3(cfg.tpr, cfg.rpb), smem, s>>>(
            dy.data<T>(), x.data<T>(), g, mean_ptr, rstd.data<float>(), d_residual_ptr, dx.data<T>(),
            partials.data<float>(), dbeta_part, rows, cols, workers);
      });
    };
    if (vectorized) launch(Int<kVec>{});
    else launch(Int<1>{});
  });
  TESSERA_CUDA_CHECK_LAUNCH();
  // The partials go back to the caching allocator when this returns; reuse is ordered on the
  // stream, as for every temporary of the CUDA backend.
  // dgamma and dbeta in one launch (blockIdx.y); dbeta's partials follow dgamma's.
  // A programmatic dependent (unless NormTuning::finalize_pdl = 0): it is scheduled as the
  // blocks before it leave, and waits for their grid's end before reading the partials.
  launch_pdl_if(norm_tuning().finalize_pdl != 0, column_finalize_kernel,
                dim3(unsigned(ceil_div(cols, 32)), has_dbeta ? 2 : 1), dim3(32, kFinalizeLanes), s,
                partials.data<float>(), workers, cols, param_of(dgamma),
                has_dbeta ? param_of(*dbeta) : Param{nullptr, false});
}

}  // namespace

}  // namespace tessera::cuda
