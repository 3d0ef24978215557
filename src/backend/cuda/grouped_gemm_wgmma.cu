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
// warpgroups, each owning 64 rows of the tile and issuing wgmma.m64nBNk16 from shared-memory
// descriptors into FP32 registers; the epilogue converts to BF16 and stores straight from
// registers, masked to the expert's rows and to N. A tile that runs past its expert's last
// row loads the next expert's rows (or TMA's zero fill past the end of x) into the unused
// accumulator rows, which are never stored: no output row of another expert is written.
//
// The same kernel with kDgrad computes the input gradient dx = dy * w[e] (w [E, N, K] read
// N-major: 64 x 64 TMA boxes, m64n64k16 wgmmas with the transpose bit).
//
// Floor: 2 * rows * N * K FLOPs at the H200's 989 TFLOP/s BF16 dense peak (Mixtral gate+up,
// 16384 x 28672 x 4096: 3.85 PFLOP -> 3.9 ms). Speed: not yet measured.
#include <cuda.h>  // the CUtensorMap types only: the entry point comes through the runtime
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/grouped_gemm_wgmma.h"
#include "backend/cuda/sm90_ptx.cuh"

namespace tessera::cuda {
namespace {

using namespace sm90;

constexpr int kBlockM = 128;      // two consumer warpgroups x 64 rows (wgmma's M)
constexpr int kBlockK = 64;       // 64 BF16 = 128 bytes: one swizzle row
constexpr int kConsumers = 2;     // consumer warpgroups
constexpr int kThreads = (kConsumers + 1) * 128;
constexpr int kMaxExperts = 256;  // the per-CTA tile table lives in static shared memory

template <int BN>
struct Config {
  // 4 x 48 KiB or 6 x 32 KiB: 192 KiB of the 227 KiB a CTA may have.
  static constexpr int kStages = BN == 256 ? 4 : 6;
  static constexpr int kABytes = kBlockM * kBlockK * 2;
  static constexpr int kBBytes = BN * kBlockK * 2;
  // + 1 KiB so the ring can start on a 1024-byte boundary (the swizzle atom).
  static constexpr int kSmemBytes = kStages * (kABytes + kBBytes) + 1024;
};

struct Tile {
  int expert;
  int64_t row0;     // first row of the tile in x / y
  int64_t row_end;  // the expert's end row: rows at or past it are not stored
  int col0;         // first column (row of w[e])
};

// The tile of linear index t. tile_begin[e] = tiles of the experts before e; the expert of t
// is the last e with tile_begin[e] <= t (an empty expert shares its start with the next one,
// so the last such e always has tiles).
__device__ __forceinline__ Tile locate(int64_t t, const int64_t* tile_begin, const int64_t* row_begin, int experts,
                                       int block_n) {
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_begin[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int64_t local = t - tile_begin[lo];
  const int64_t rows = row_begin[lo + 1] - row_begin[lo];
  const int64_t m_tiles = (rows + kBlockM - 1) / kBlockM;
  // M fastest: the CTAs in flight at once share a few w tiles and sweep the expert's rows,
  // which stay in L2.
  Tile tile;
  tile.expert = lo;
  tile.row0 = row_begin[lo] + (local % m_tiles) * kBlockM;
  tile.row_end = row_begin[lo + 1];
  tile.col0 = static_cast<int>(local / m_tiles) * block_n;
  return tile;
}

// kDgrad = false: y = x * w[e]^T, w [E, n, k] (forward). kDgrad = true: y = x * w[e], w
// [E, k, n] (the input gradient dx = dy * w[e]): B is then MN-major, loaded as BN / 64 boxes
// of 64 (k) x 64 (n) and multiplied by m64n64k16 instructions with the transpose bit.
template <int BN, bool kDgrad>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_fwd_kernel(const __grid_constant__ CUtensorMap tmap_x, const __grid_constant__ CUtensorMap tmap_w,
                            __nv_bfloat16* __restrict__ y, int64_t ldy, const int64_t* __restrict__ offsets,
                            int experts, int n, int k) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma / setmaxnreg exist only on sm_90a; the host side checks the device.
#else
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
  const int n_tiles = (n + BN - 1) / BN;
  const int k_iters = k / kBlockK;

  if (threadIdx.x == 0) {
    int64_t tiles = 0;
    for (int e = 0; e < experts; ++e) {
      const int64_t r0 = offsets[e];
      const int64_t rows = max(offsets[e + 1] - r0, int64_t{0});
      row_begin[e] = r0;
      tile_begin[e] = tiles;
      tiles += (rows + kBlockM - 1) / kBlockM * n_tiles;
    }
    row_begin[experts] = offsets[experts];
    tile_begin[experts] = tiles;
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_addr(&full_bar[s]), 1);                    // the producer's expect_tx arrival
      mbar_init(smem_addr(&empty_bar[s]), kConsumers * 4);      // one arrival per consumer warp
    }
    mbar_fence_init();
  }
  __syncthreads();
  const int64_t total_tiles = tile_begin[experts];
  const int wg = threadIdx.x / 128;

  if (wg == kConsumers) {
    // Producer warpgroup: one thread drives TMA; the registers go to the consumers.
    regs_dealloc<40>();
    if (threadIdx.x == kConsumers * 128) {
      tma_prefetch_descriptor(&tmap_x);
      tma_prefetch_descriptor(&tmap_w);
      uint32_t it = 0;  // k-blocks issued by this CTA so far: stage and phase of the ring
      for (int64_t t = blockIdx.x; t < total_tiles; t += gridDim.x) {
        const Tile tile = locate(t, tile_begin, row_begin, experts, BN);
        for (int kb = 0; kb < k_iters; ++kb, ++it) {
          const uint32_t s = it % kStages, phase = (it / kStages) & 1;
          const uint32_t full = smem_addr(&full_bar[s]);
          mbar_wait(smem_addr(&empty_bar[s]), phase ^ 1);  // first lap: passes at once
          if constexpr (!kDgrad) {
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
    return;
  }

  // Consumer warpgroups: rows [64 wg, 64 wg + 64) of each tile.
  regs_alloc<232>();
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
  uint32_t it = 0;
  for (int64_t t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    const Tile tile = locate(t, tile_begin, row_begin, experts, BN);
    for (int kb = 0; kb < k_iters; ++kb, ++it) {
      const uint32_t s = it % kStages, phase = (it / kStages) & 1;
      mbar_wait(smem_addr(&full_bar[s]), phase);
      const uint32_t a = a_stage0 + s * C::kABytes + wg * 64 * 128;  // this warpgroup's 64 rows
      const uint32_t b = b_stage0 + s * C::kBBytes;
      fence_registers(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        // +32 bytes = 16 BF16 further along K inside the swizzled 128-byte rows.
        const uint64_t da = make_desc_sw128(a + kk * 32);
        if constexpr (kDgrad) {
          // Chunk j (columns 64 j ..) is 64 K-rows of 128 bytes at b + 8 KiB j; 16 K-rows
          // further = +2048 bytes. Its accumulators are acc[32 j ..] (same layout as above).
          // Chunks past n (last tile only) were not loaded: they multiply stale shared memory
          // into accumulator columns the epilogue never stores. No branch here: a branch
          // between wgmmas makes ptxas fence each one.
#pragma unroll
          for (int j = 0; j < BN / 64; ++j)
            wgmma_m64n64k16_bf16_tb(acc + 32 * j, da, make_desc_sw128_mn64(b + j * 64 * kBlockK * 2 + kk * 2048),
                                    (kb | kk) != 0);
        } else if constexpr (BN == 256) {
          wgmma_m64n256k16_bf16(acc, da, make_desc_sw128(b + kk * 32), (kb | kk) != 0);
        } else {
          wgmma_m64n128k16_bf16(acc, da, make_desc_sw128(b + kk * 32), (kb | kk) != 0);
        }
      }
      wgmma_commit();
      // Waiting for all of this k-block's MMAs before freeing the stage keeps the ring simple;
      // the other consumer warpgroup's MMAs fill the tensor cores meanwhile.
      wgmma_wait<0>();
      fence_registers(acc);
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&empty_bar[s]));
    }

    // Epilogue: d[4j], d[4j+1] are row r, columns 8j + 2 (lane % 4) + {0, 1}; d[4j+2], d[4j+3]
    // the same columns of row r + 8 (sm90_ptx.cuh). The producer already loads the next tile.
    const int64_t r = tile.row0 + wg * 64 + warp * 16 + lane / 4;
    const bool row_a = r < tile.row_end, row_b = r + 8 < tile.row_end;
    __nv_bfloat16* y_a = y + r * ldy;
    __nv_bfloat16* y_b = y_a + 8 * ldy;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int col = tile.col0 + 8 * j + 2 * (lane % 4);
      if (col < n) {
        if (row_a) *reinterpret_cast<__nv_bfloat162*>(y_a + col) = __floats2bfloat162_rn(acc[4 * j], acc[4 * j + 1]);
        if (row_b)
          *reinterpret_cast<__nv_bfloat162*>(y_b + col) = __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
      }
    }
  }
#endif
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no -lcuda link).
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    TESSERA_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status));
    TESSERA_CHECK(status == cudaDriverEntryPointSuccess && p != nullptr,
                  "grouped_gemm_wgmma: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

// A BF16 tensor map whose boxes land in shared memory with the 128-byte swizzle the wgmma
// descriptors expect. dims / strides innermost first; strides in bytes, rank - 1 of them.
CUtensorMap make_tensor_map(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                            const cuuint32_t* box) {
  CUtensorMap map{};
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUresult r = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, static_cast<cuuint32_t>(rank),
                                    const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                    CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TESSERA_CHECK(r == CUDA_SUCCESS, "grouped_gemm_wgmma: cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(r),
                ")");
  return map;
}

template <int BN, bool kDgrad>
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
  const cuuint32_t w_box[3] = {kDgrad ? 64u : static_cast<cuuint32_t>(kBlockK), kDgrad ? 64u : static_cast<cuuint32_t>(BN),
                               1};
  const CUtensorMap tmap_w = make_tensor_map(w.raw_data(), 3, w_dims, w_strides, w_box);

  auto kernel = grouped_gemm_fwd_kernel<BN, kDgrad>;
  TESSERA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Config<BN>::kSmemBytes));
  const int grid = multiprocessor_count(x.device().index);
  kernel<<<grid, kThreads, Config<BN>::kSmemBytes, stream>>>(
      tmap_x, tmap_w, static_cast<__nv_bfloat16*>(y.raw_data()), y.stride(0), offsets.data<int64_t>(),
      static_cast<int>(experts), static_cast<int>(n), static_cast<int>(k));
  TESSERA_CUDA_CHECK_LAUNCH();
}

GroupedGemmBackend g_backend = GroupedGemmBackend::Cublas;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void set_grouped_gemm_backend(GroupedGemmBackend backend) { g_backend = backend; }
GroupedGemmBackend grouped_gemm_backend() { return g_backend; }

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
  if (x.stride(1) != 1 || y.stride(1) != 1 || x.stride(0) % 8 != 0 || y.stride(0) % 2 != 0) return false;
  if (!aligned16(x.raw_data()) || !aligned16(w.raw_data()) || reinterpret_cast<uintptr_t>(y.raw_data()) % 4 != 0)
    return false;
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, x.device().index) != cudaSuccess) return false;
  return major == 9;
}

template <bool kDgrad>
void run(const char* op, void* stream, const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& y,
         int block_n) {
  TESSERA_CHECK(operands_ok(x, w, y, kDgrad), op, ": unsupported operands ", x.describe(), ", w ", w.describe(),
                ", out ", y.describe());
  TESSERA_CHECK(offsets.defined() && offsets.dtype() == DType::I64 && offsets.dim() == 1 &&
                    offsets.size(0) == w.size(0) + 1 && offsets.is_contiguous() && offsets.device() == x.device(),
                op, ": offsets must be a device I64 [E + 1] tensor");
  TESSERA_CHECK(block_n == 256 || block_n == 128, op, ": block_n must be 128 or 256");
  auto s = static_cast<cudaStream_t>(stream);
  if (block_n == 256) {
    launch<256, kDgrad>(s, x, w, offsets, y);
  } else {
    launch<128, kDgrad>(s, x, w, offsets, y);
  }
}

}  // namespace

bool grouped_gemm_wgmma_supported(const Tensor& x, const Tensor& w, const Tensor& y) {
  return operands_ok(x, w, y, false);
}

void grouped_gemm_wgmma_forward(void* stream, const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& y,
                                int block_n) {
  run<false>("grouped_gemm_wgmma_forward", stream, x, w, offsets, y, block_n);
}

bool grouped_gemm_wgmma_backward_input_supported(const Tensor& dy, const Tensor& w, const Tensor& dx) {
  return operands_ok(dy, w, dx, true);
}

void grouped_gemm_wgmma_backward_input(void* stream, const Tensor& dy, const Tensor& w, const Tensor& offsets,
                                       Tensor& dx, int block_n) {
  run<true>("grouped_gemm_wgmma_backward_input", stream, dy, w, offsets, dx, block_n);
}

void grouped_gemm_wgmma_forward(void* stream, const Tensor& x, const Tensor& w, const std::vector<int64_t>& splits,
                                Tensor& y, int block_n) {
  TESSERA_CHECK(static_cast<int64_t>(splits.size()) == w.size(0), "grouped_gemm_wgmma_forward: ", splits.size(),
                " splits for ", w.size(0), " experts");
  std::vector<int64_t> host(splits.size() + 1, 0);
  for (size_t e = 0; e < splits.size(); ++e) host[e + 1] = host[e] + splits[e];
  TESSERA_CHECK(host.back() <= x.size(0), "grouped_gemm_wgmma_forward: the splits cover ", host.back(),
                " rows, x has ", x.size(0));
  Tensor offsets = Tensor::empty({static_cast<int64_t>(host.size())}, DType::I64, x.device());
  // Pageable source: the runtime stages it before returning, so `host` may go right after.
  memcpy_async(offsets.raw_data(), host.data(), host.size() * sizeof(int64_t), stream);
  grouped_gemm_wgmma_forward(stream, x, w, offsets, y, block_n);
}

}  // namespace tessera::cuda
