// tessera's own grouped GEMM for Hopper: for every expert e of a MoE layer,
//     y[offsets[e] : offsets[e+1], N] = x[offsets[e] : offsets[e+1], K] * w[e][N, K]^T
// BF16 in and out, FP32 accumulation, in ONE persistent launch (grid = number of SMs) whose
// CTAs walk a linear tile index over all experts' (M-tiles x N-tiles). The experts' row
// ranges come from a DEVICE offsets array: the host never reads them.
//
// Layout assumptions: x [rows, K] with contiguous rows (row stride a multiple of 8
// elements), w [E, N, K] contiguous, y [rows, N] with contiguous rows; K and N multiples of
// 64 (grouped_gemm_wgmma_supported; ops/moe.cpp falls back to the cuBLASLt loop otherwise).
// Both operands are K-major, the "TN" case wgmma reads natively from shared memory.
//
// Structure (sm_90a): CTA tile 128 x BN (BN = 256 or 128), K step 64. One producer
// warpgroup (one thread issues TMA loads of the x and w tiles, 128-byte swizzled, into a
// ring of kStages shared-memory stages guarded by "full"/"empty" mbarriers) and two consumer
// warpgroups issuing wgmma from shared-memory descriptors into FP32 registers, either both
// on one tile (cooperative, 64 rows each) or on alternate tiles (ping-pong), optionally on
// clusters of two CTAs sharing the w tile by TMA multicast; see Mode (in
// grouped_gemm_wgmma_device.cuh, with the tile walk, MMAs and epilogues) and
// GroupedGemmVariant (grouped_gemm_wgmma.h). The epilogue converts to BF16 and stores,
// masked to the expert's rows and to N. A tile that runs past its expert's last row loads
// the next expert's rows (or TMA's zero fill past the end of x) into the unused
// accumulator rows, which are never stored: no output row of another expert is written.
//
// The same kernel with kDgrad computes the input gradient dx = dy * w[e] (w [E, N, K] read
// N-major: 64 x 64 TMA boxes, wgmmas with the transpose bit).
//
// Floor: 2 * rows * N * K FLOPs at the H200's 989 TFLOP/s BF16 dense peak (Mixtral gate+up,
// 16384 x 28672 x 4096: 3.85 PFLOP -> 3.9 ms). Speed: round 1 (the Wait0 variants) 5-15 %
// slower than the cuBLASLt loop (6.13 vs 5.56 ms gate+up); the other variants not yet
// measured.
#include <cuda.h>  // the CUtensorMap types only: the entry point comes through the runtime
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/grouped_gemm_wgmma.h"
#include "backend/cuda/grouped_gemm_wgmma_device.cuh"
#include "backend/cuda/sm90_ptx.cuh"
#include "backend/cuda/tensor_map.h"

namespace tessera::cuda {
namespace {

using namespace sm90;
using namespace grouped_gemm_detail;

// kDgrad = false: y = x * w[e]^T, w [E, n, k] (forward). kDgrad = true: y = x * w[e], w
// [E, k, n] (the input gradient dx = dy * w[e]): B is then MN-major, loaded as BN / 64 boxes
// of 64 (k) x 64 (n). kPingPong needs BN = 128.
template <int BN, bool kDgrad, int kMode, bool kVecStore>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_fwd_kernel(const __grid_constant__ CUtensorMap tmap_x, const __grid_constant__ CUtensorMap tmap_w,
                            __nv_bfloat16* __restrict__ y, int64_t ldy, const int64_t* __restrict__ offsets,
                            int experts, int n, int k) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma / setmaxnreg exist only on sm_90a; the host side checks the device.
#else
  static_assert(kMode != kPingPong || BN == 128, "ping-pong tiles are 128 x 128");
  constexpr bool kMc = kMode == kPipeMc;
  constexpr int kMStep = kMc ? 2 : 1;
  using C = Config<BN>;
  constexpr int kStages = C::kStages;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kStages];
  __shared__ __align__(8) uint64_t empty_bar[kStages];
  __shared__ int64_t row_begin[kMaxExperts + 1];
  __shared__ int64_t tile_begin[kMaxExperts + 1];

  const uint32_t ring = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t a_stage0 = ring;                          // kStages x [128 rows x 128 B]
  const uint32_t b_stage0 = ring + kStages * C::kABytes;   // kStages x [BN rows x 128 B]
  const uint32_t staging = ring + kStages * (C::kABytes + C::kBBytes) + (threadIdx.x / 32) * 2048;  // consumers'
  const int n_tiles = (n + BN - 1) / BN;
  const int k_iters = k / kBlockK;

  if (threadIdx.x == 0) {
    int64_t tiles = 0;
    for (int e = 0; e < experts; ++e) {
      const int64_t r0 = offsets[e];
      const int64_t rows = max(offsets[e + 1] - r0, int64_t{0});
      row_begin[e] = r0;
      tile_begin[e] = tiles;
      tiles += (rows + kBlockM * kMStep - 1) / (kBlockM * kMStep) * n_tiles;
    }
    row_begin[experts] = offsets[experts];
    tile_begin[experts] = tiles;
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_addr(&full_bar[s]), 1);  // the producer's expect_tx arrival
      // One arrival per consumer warp that reads the stage: both warpgroups (cooperative) or
      // the one that owns the tile (ping-pong).
      mbar_init(smem_addr(&empty_bar[s]), kMode == kPingPong ? 4 : kConsumers * 4 * kMStep);
    }
    mbar_fence_init();
  }
  __syncthreads();
  // Clusters: the peer's barriers are initialised before anything arrives on them.
  // This CTA's (pair's) walk over the tiles; read from special registers where used (fewer
  // live registers next to 128 accumulators).
  if constexpr (kMc) cluster_sync();
  const auto walk0 = [] { return static_cast<int64_t>(kMc ? blockIdx.x / 2 : blockIdx.x); };
  const auto walk_stride = [] { return static_cast<int64_t>(kMc ? gridDim.x / 2 : gridDim.x); };
  const auto rank = [] { return kMc ? static_cast<int>(cluster_ctarank()) : 0; };
  const int64_t total_tiles = tile_begin[experts];
  const int wg = threadIdx.x / 128;

  if (wg == kConsumers) {
    // Producer warpgroup: one thread drives TMA; the registers go to the consumers. It runs
    // up to kStages k-blocks ahead, across tile boundaries: the next tile's first stages
    // load during the consumers' epilogue.
    regs_dealloc<40>();
    if (threadIdx.x == kConsumers * 128) {
      tma_prefetch_descriptor(&tmap_x);
      tma_prefetch_descriptor(&tmap_w);
      uint32_t it = 0;  // k-blocks issued by this CTA so far: stage and phase of the ring
      for (int64_t t = walk0(); t < total_tiles; t += walk_stride()) {
        const Tile tile = locate(t, tile_begin, row_begin, experts, BN, kMStep, rank());
        for (int kb = 0; kb < k_iters; ++kb, ++it) {
          const uint32_t s = it % kStages, phase = (it / kStages) & 1;
          const uint32_t full = smem_addr(&full_bar[s]);
          mbar_wait(smem_addr(&empty_bar[s]), phase ^ 1);  // first lap: passes at once
          if constexpr (kMc && !kDgrad) {
            // Own x rows; rows [BN / 2 rank, + BN / 2) of the w tile into both CTAs (the peer
            // sends the other half to the same barrier offset: the byte count is the whole).
            mbar_arrive_expect_tx(full, C::kABytes + C::kBBytes);
            tma_load_2d(a_stage0 + s * C::kABytes, &tmap_x, full, kb * kBlockK, static_cast<int>(tile.row0));
            tma_load_3d_multicast(b_stage0 + s * C::kBBytes + rank() * (C::kBBytes / 2), &tmap_w, full, kb * kBlockK,
                                  tile.col0 + rank() * (BN / 2), tile.expert, 0x3);
          } else if constexpr (kMc) {
            // Dgrad: 64-column boxes 2 rank .. of the (up to) BN / 64 inside n, into both.
            const int chunks = min(BN / 64, (n - tile.col0) / 64);
            mbar_arrive_expect_tx(full, C::kABytes + chunks * 64 * kBlockK * 2);
            tma_load_2d(a_stage0 + s * C::kABytes, &tmap_x, full, kb * kBlockK, static_cast<int>(tile.row0));
            for (int j = rank() * (BN / 128); j < min(chunks, (rank() + 1) * (BN / 128)); ++j)
              tma_load_3d_multicast(b_stage0 + s * C::kBBytes + j * 64 * kBlockK * 2, &tmap_w, full,
                                    tile.col0 + 64 * j, kb * kBlockK, tile.expert, 0x3);
          } else if constexpr (!kDgrad) {
            mbar_arrive_expect_tx(full, C::kABytes + C::kBBytes);
            tma_load_2d(a_stage0 + s * C::kABytes, &tmap_x, full, kb * kBlockK, static_cast<int>(tile.row0));
            tma_load_3d(b_stage0 + s * C::kBBytes, &tmap_w, full, kb * kBlockK, tile.col0, tile.expert);
          } else {
            // Only the 64-column chunks inside n (the consumers skip the others).
            const int chunks = min(BN / 64, (n - tile.col0) / 64);
            mbar_arrive_expect_tx(full, C::kABytes + chunks * 64 * kBlockK * 2);
            tma_load_2d(a_stage0 + s * C::kABytes, &tmap_x, full, kb * kBlockK, static_cast<int>(tile.row0));
            for (int j = 0; j < chunks; ++j)
              tma_load_3d(b_stage0 + s * C::kBBytes + j * 64 * kBlockK * 2, &tmap_w, full, tile.col0 + 64 * j,
                          kb * kBlockK, tile.expert);
          }
        }
      }
    }
    if constexpr (kMc) cluster_sync();  // the peer may still arrive on this CTA's barriers
    return;
  }

  regs_alloc<232>();
  if constexpr (kMode == kPingPong) {
    // Warpgroup wg takes the CTA's tiles wg, wg + 2, ... (ordinal i: the tile's k-blocks are
    // ring slots i k_iters ..). Before its main loop it waits on named barrier 1 + (1 - wg)
    // for the other warpgroup to have issued the previous tile's MMAs, and after its own it
    // signals barrier 1 + wg. Besides alternating the tensor cores, this keeps the ring's
    // parity waits sound: a warpgroup only waits on a slot once the slot's previous use
    // (kStages slots back, possibly the other warpgroup's) has been waited on.
    float acc0[BN / 2], acc1[BN / 2];  // rows 0-63 and 64-127 of the tile
#pragma unroll
    for (int j = 0; j < BN / 2; ++j) acc0[j] = acc1[j] = 0.0f;
    uint32_t i = wg;
    for (int64_t t = blockIdx.x + wg * gridDim.x; t < total_tiles; t += 2 * gridDim.x, i += 2) {
      const Tile tile = locate(t, tile_begin, row_begin, experts, BN);
      if (i >= 1) bar_sync(1 + (1 - wg), 256);
      fence_registers(acc0);
      fence_registers(acc1);
      uint32_t it = i * k_iters, prev = 0;
      for (int kb = 0; kb < k_iters; ++kb, ++it) {
        const uint32_t s = it % kStages, phase = (it / kStages) & 1;
        mbar_wait<true>(smem_addr(&full_bar[s]), phase);
        const uint32_t a = a_stage0 + s * C::kABytes;
        const uint32_t b = b_stage0 + s * C::kBBytes;
        wgmma_fence();
        mma_kblock<BN, kDgrad, kDgradWideB>(acc0, a, b, kb);
        mma_kblock<BN, kDgrad, kDgradWideB>(acc1, a + 64 * 128, b, kb);
        wgmma_commit();
        if (kb > 0) {
          wgmma_wait<1>();  // k-block kb - 1's MMAs are done: its stage may be refilled
          release(smem_addr(&empty_bar[prev]));
        }
        prev = s;
      }
      if (t + gridDim.x < total_tiles) bar_arrive(1 + wg, 256);
      wgmma_wait<0>();
      fence_registers(acc0);
      fence_registers(acc1);
      release(smem_addr(&empty_bar[prev]));
      if constexpr (kVecStore) {
        store_slab_vec(acc0, staging, y, ldy, tile.row0, tile.row_end, tile.col0, n);
        store_slab_vec(acc1, staging, y, ldy, tile.row0 + 64, tile.row_end, tile.col0, n);
      } else {
        store_slab(acc0, y, ldy, tile.row0, tile.row_end, tile.col0, n);
        store_slab(acc1, y, ldy, tile.row0 + 64, tile.row_end, tile.col0, n);
      }
    }
  } else {
    // Cooperative: rows [64 wg, 64 wg + 64) of each tile.
    float acc[BN / 2];
#pragma unroll
    for (int j = 0; j < BN / 2; ++j) acc[j] = 0.0f;
    uint32_t it = 0;
    // Releases a stage: this CTA's producer and, on clusters, the peer's (it writes here too).
    auto release_stage = [&](uint32_t s) {
      const uint32_t bar = smem_addr(&empty_bar[s]);
      if constexpr (kMc) {
        __syncwarp();
        if (threadIdx.x % 32 == 0) {
          mbar_arrive(bar);
          mbar_arrive_cluster(map_to_cta(bar, cluster_ctarank() ^ 1));
        }
      } else {
        release(bar);
      }
    };
    for (int64_t t = walk0(); t < total_tiles; t += walk_stride()) {
      const Tile tile = locate(t, tile_begin, row_begin, experts, BN, kMStep, rank());
      fence_registers(acc);  // the previous epilogue's reads stay before the first MMA
      uint32_t prev = 0;
      for (int kb = 0; kb < k_iters; ++kb, ++it) {
        const uint32_t s = it % kStages, phase = (it / kStages) & 1;
        mbar_wait<true>(smem_addr(&full_bar[s]), phase);
        const uint32_t a = a_stage0 + s * C::kABytes + wg * 64 * 128;  // this warpgroup's 64 rows
        const uint32_t b = b_stage0 + s * C::kBBytes;
        if constexpr (kMode == kWait0) fence_registers(acc);
        wgmma_fence();
        mma_kblock<BN, kDgrad, kMode != kWait0 && kDgradWideB>(acc, a, b, kb);
        wgmma_commit();
        if constexpr (kMode == kWait0) {
          // Round 1: all of this k-block's MMAs before the stage is freed.
          wgmma_wait<0>();
          fence_registers(acc);
          release(smem_addr(&empty_bar[s]));
        } else {
          if (kb > 0) {
            wgmma_wait<1>();  // k-block kb - 1's MMAs are done: its stage may be refilled
            release_stage(prev);
          }
          prev = s;
        }
      }
      if constexpr (kMode != kWait0) {
        wgmma_wait<0>();
        fence_registers(acc);
        release_stage(prev);
      }
      // The producer already loads the next tile meanwhile.
      if constexpr (kVecStore) {
        store_slab_vec(acc, staging, y, ldy, tile.row0 + wg * 64, tile.row_end, tile.col0, n);
      } else {
        store_slab(acc, y, ldy, tile.row0 + wg * 64, tile.row_end, tile.col0, n);
      }
    }
  }
  if constexpr (kMc) cluster_sync();  // matches the producer warpgroup's
#endif
}

// The BF16 tensor maps of x and w (tensor_map.h), named for error messages.
CUtensorMap make_tensor_map(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                            const cuuint32_t* box) {
  return make_bf16_tensor_map(base, rank, dims, strides, box, "grouped_gemm_wgmma");
}

template <int BN, bool kDgrad, int kMode, bool kVecStore>
void launch(cudaStream_t stream, const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& y) {
  // k: the reduction (x's columns), n: y's columns; w is [E, n, k] forward, [E, k, n] dgrad.
  const int64_t rows = x.size(0), k = x.size(1), experts = w.size(0), n = y.size(1);
  const cuuint64_t x_dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t x_strides[1] = {static_cast<cuuint64_t>(x.stride(0)) * 2};
  const cuuint32_t x_box[2] = {kBlockK, kBlockM};
  const CUtensorMap tmap_x = make_tensor_map(x.raw_data(), 2, x_dims, x_strides, x_box);
  // w as [E][N][K]: N past the end (a partial last N tile) is zero filled, never the next
  // expert's weights.
  // Dgrad: w [E][k][n] read as boxes of 64 n-columns x 64 k-rows.
  const cuuint64_t inner = static_cast<cuuint64_t>(kDgrad ? n : k), outer = static_cast<cuuint64_t>(kDgrad ? k : n);
  const cuuint64_t w_dims[3] = {inner, outer, static_cast<cuuint64_t>(experts)};
  const cuuint64_t w_strides[2] = {inner * 2, inner * outer * 2};
  // Clusters (kPipeMc) load half the forward w tile per CTA.
  constexpr cuuint32_t kWRows = kMode == kPipeMc ? BN / 2 : BN;
  const cuuint32_t w_box[3] = {kDgrad ? 64u : static_cast<cuuint32_t>(kBlockK), kDgrad ? 64u : kWRows, 1};
  const CUtensorMap tmap_w = make_tensor_map(w.raw_data(), 3, w_dims, w_strides, w_box);

  auto kernel = grouped_gemm_fwd_kernel<BN, kDgrad, kMode, kVecStore>;
  TESSERA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Config<BN>::kSmemBytes));
  const int sms = multiprocessor_count(x.device().index);
  auto* yp = static_cast<__nv_bfloat16*>(y.raw_data());
  const int64_t* op = offsets.data<int64_t>();
  if constexpr (kMode == kPipeMc) {
    cudaLaunchConfig_t config{};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.gridDim = dim3(static_cast<unsigned>(sms / 2 * 2));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = Config<BN>::kSmemBytes;
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = 1;
    // Persistent: as many pairs as fit at once (a GPC with an odd number of free SMs leaves
    // one idle), asked once per device.
    static int pairs[64] = {};
    const int dev = x.device().index;
    TESSERA_CHECK(dev >= 0 && dev < 64, "grouped_gemm_wgmma: device index ", dev);
    if (pairs[dev] == 0) {
      int fit = 0;
      TESSERA_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&fit, kernel, &config));
      pairs[dev] = std::max(1, std::min(fit, sms / 2));
    }
    config.gridDim = dim3(static_cast<unsigned>(2 * pairs[dev]));
    TESSERA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, tmap_x, tmap_w, yp, static_cast<int64_t>(y.stride(0)), op,
                                          static_cast<int>(experts), static_cast<int>(n), static_cast<int>(k)));
  } else {
    kernel<<<sms, kThreads, Config<BN>::kSmemBytes, stream>>>(tmap_x, tmap_w, yp, y.stride(0), op,
                                                             static_cast<int>(experts), static_cast<int>(n),
                                                             static_cast<int>(k));
  }
  TESSERA_CUDA_CHECK_LAUNCH();
}

GroupedGemmBackend g_backend = GroupedGemmBackend::Cublas;
GroupedGemmVariant g_variant = GroupedGemmVariant::Coop256;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void set_grouped_gemm_backend(GroupedGemmBackend backend) { g_backend = backend; }
GroupedGemmBackend grouped_gemm_backend() { return g_backend; }

void set_grouped_gemm_variant(GroupedGemmVariant variant) {
  TESSERA_CHECK(variant != GroupedGemmVariant::Default, "set_grouped_gemm_variant: name a variant");
  g_variant = variant;
}
GroupedGemmVariant grouped_gemm_variant() { return g_variant; }

const char* grouped_gemm_variant_name(GroupedGemmVariant variant) {
  switch (variant) {
    case GroupedGemmVariant::Default: return "default";
    case GroupedGemmVariant::Coop256Wait0: return "coop256 wait0";
    case GroupedGemmVariant::Coop128Wait0: return "coop128 wait0";
    case GroupedGemmVariant::Coop256Scalar: return "coop256 pipe st4";
    case GroupedGemmVariant::Coop256: return "coop256 pipe";
    case GroupedGemmVariant::Coop128: return "coop128 pipe";
    case GroupedGemmVariant::PingPong128: return "pingpong128";
    case GroupedGemmVariant::Coop256Mc2: return "coop256 mc2";
  }
  return "?";
}

namespace {

// x [rows, k], y [rows, n]; w [E, n, k] (forward) or [E, k, n] (dgrad).
bool operands_ok(const Tensor& x, const Tensor& w, const Tensor& y, bool dgrad) {
  if (!x.defined() || !w.defined() || !y.defined()) return false;
  if (x.dtype() != DType::BF16 || w.dtype() != DType::BF16 || y.dtype() != DType::BF16) return false;
  if (!x.device().is_cuda() || w.device() != x.device() || y.device() != x.device()) return false;
  if (x.dim() != 2 || w.dim() != 3 || y.dim() != 2 || !w.is_contiguous()) return false;
  const int64_t k = x.size(1), n = y.size(1), e = w.size(0);
  if (w.size(dgrad ? 1 : 2) != k || w.size(dgrad ? 2 : 1) != n || y.size(0) != x.size(0)) return false;
  if (k <= 0 || n <= 0 || k % 64 != 0 || n % 64 != 0 || e < 1 || e > kMaxExperts) return false;
  if (x.size(0) <= 0 || x.size(0) > (int64_t{1} << 31) - 1 || n * k > (int64_t{1} << 40)) return false;
  // 16-byte aligned rows of x (TMA) and of y (the 16-byte epilogue stores).
  if (x.stride(1) != 1 || y.stride(1) != 1 || x.stride(0) % 8 != 0 || y.stride(0) % 8 != 0) return false;
  if (!aligned16(x.raw_data()) || !aligned16(w.raw_data()) || !aligned16(y.raw_data())) return false;
  return device_is_hopper(x.device().index);
}

template <bool kDgrad>
void run(const char* op, void* stream, const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& y,
         GroupedGemmVariant variant) {
  TESSERA_CHECK(operands_ok(x, w, y, kDgrad), op, ": unsupported operands ", x.describe(), ", w ", w.describe(),
                ", out ", y.describe());
  TESSERA_CHECK(offsets.defined() && offsets.dtype() == DType::I64 && offsets.dim() == 1 &&
                    offsets.size(0) == w.size(0) + 1 && offsets.is_contiguous() && offsets.device() == x.device(),
                op, ": offsets must be a device I64 [E + 1] tensor");
  auto s = static_cast<cudaStream_t>(stream);
  if (variant == GroupedGemmVariant::Default) variant = g_variant;
  switch (variant) {
    case GroupedGemmVariant::Coop256Wait0: launch<256, kDgrad, kWait0, false>(s, x, w, offsets, y); return;
    case GroupedGemmVariant::Coop128Wait0: launch<128, kDgrad, kWait0, false>(s, x, w, offsets, y); return;
    case GroupedGemmVariant::Coop256Scalar: launch<256, kDgrad, kPipe, false>(s, x, w, offsets, y); return;
    case GroupedGemmVariant::Coop256: launch<256, kDgrad, kPipe, true>(s, x, w, offsets, y); return;
    case GroupedGemmVariant::Coop128: launch<128, kDgrad, kPipe, true>(s, x, w, offsets, y); return;
    case GroupedGemmVariant::PingPong128: launch<128, kDgrad, kPingPong, true>(s, x, w, offsets, y); return;
    case GroupedGemmVariant::Coop256Mc2: launch<256, kDgrad, kPipeMc, true>(s, x, w, offsets, y); return;
    default: break;
  }
  TESSERA_CHECK(false, op, ": unknown variant ", static_cast<int>(variant));
}

}  // namespace

bool grouped_gemm_wgmma_supported(const Tensor& x, const Tensor& w, const Tensor& y) {
  return operands_ok(x, w, y, false);
}

void grouped_gemm_wgmma_forward(void* stream, const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& y,
                                GroupedGemmVariant variant) {
  run<false>("grouped_gemm_wgmma_forward", stream, x, w, offsets, y, variant);
}

bool grouped_gemm_wgmma_backward_input_supported(const Tensor& dy, const Tensor& w, const Tensor& dx) {
  return operands_ok(dy, w, dx, true);
}

void grouped_gemm_wgmma_backward_input(void* stream, const Tensor& dy, const Tensor& w, const Tensor& offsets,
                                       Tensor& dx, GroupedGemmVariant variant) {
  run<true>("grouped_gemm_wgmma_backward_input", stream, dy, w, offsets, dx, variant);
}

namespace {

// Device offsets [E + 1] from host splits with one small host-to-device copy on `stream`.
Tensor offsets_from_splits(const char* op, void* stream, const Tensor& x, const Tensor& w,
                           const std::vector<int64_t>& splits) {
  TESSERA_CHECK(static_cast<int64_t>(splits.size()) == w.size(0), op, ": ", splits.size(), " splits for ", w.size(0),
                " experts");
  std::vector<int64_t> host(splits.size() + 1, 0);
  for (size_t e = 0; e < splits.size(); ++e) host[e + 1] = host[e] + splits[e];
  TESSERA_CHECK(host.back() <= x.size(0), op, ": the splits cover ", host.back(), " rows, x has ", x.size(0));
  Tensor offsets = Tensor::empty({static_cast<int64_t>(host.size())}, DType::I64, x.device());
  // Pageable source: the runtime stages it before returning, so `host` may go right after.
  memcpy_async(offsets.raw_data(), host.data(), host.size() * sizeof(int64_t), stream);
  return offsets;
}

}  // namespace

void grouped_gemm_wgmma_forward(void* stream, const Tensor& x, const Tensor& w, const std::vector<int64_t>& splits,
                                Tensor& y, GroupedGemmVariant variant) {
  const Tensor offsets = offsets_from_splits("grouped_gemm_wgmma_forward", stream, x, w, splits);
  grouped_gemm_wgmma_forward(stream, x, w, offsets, y, variant);
}

void grouped_gemm_wgmma_backward_input(void* stream, const Tensor& dy, const Tensor& w,
                                       const std::vector<int64_t>& splits, Tensor& dx, GroupedGemmVariant variant) {
  const Tensor offsets = offsets_from_splits("grouped_gemm_wgmma_backward_input", stream, dy, w, splits);
  grouped_gemm_wgmma_backward_input(stream, dy, w, offsets, dx, variant);
}

}  // namespace tessera::cuda
