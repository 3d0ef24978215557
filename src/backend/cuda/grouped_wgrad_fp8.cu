// tessera's own grouped FP8 weight-gradient GEMM for Hopper: for every expert e of a MoE layer
// that has rows,
//     dw[e][out, in] (+)= alpha * dy_t[out, cols_e] x_t[in, cols_e]^T,   alpha = s_dy^-1 s_x^-1
// in ONE persistent launch, where cols_e is expert e's block of the padded transposed codes
// (ops/moe.h: the FP8 casts write dy^T and x^T once, expert blocks side by side, each padded
// with zero codes to a multiple of 16 columns).
//
// Why a kernel of our own: the weight gradient contracts over an expert's tokens, a short K
// (2048 at the Mixtral shape) against long M and N, and writes FP32. Per 128 x 256 tile that
// is 16 k-blocks of MMAs against a 128 KiB FP32 store, and cuBLASLt's kernels store each tile
// before they start the next: the wgrads ran at 1200 TFLOP/s where the forward GEMMs of the
// same layer reach 1450-1540, and no cuBLASLt configuration did better (bench/RESULTS.md,
// twenty-second session: every algorithm, tile, stage count, cluster shape and option timed).
// Here the store is asynchronous: each consumer warp stages its rows in shared memory and
// hands them to the TMA unit as 1 KiB bulk copies (bulk reduce-adds when accumulating), then
// goes straight on to the next tile's MMAs while the copies drain.
//
// Layout assumptions: dy_t [out, P] and x_t [in, P] E4M3/E5M2 codes, rows contiguous (K-major:
// the only FP8 layout wgmma reads); dw F32 [E, out, in] contiguous, out % 128 == 0, in % 256
// == 0 (grouped_wgrad_fp8_supported; ops/moe_fp8.cpp keeps cuBLASLt otherwise).
//
// Structure (sm_90a): CTA tile 128 (out) x 256 (in), K step 128 codes (one 128-byte swizzle
// row). One producer thread issues TMA loads into a ring of 3 stages (48 KiB each) guarded by
// full / empty mbarriers and runs ahead across tiles; two consumer warpgroups take 64 rows
// each and issue m64n256k32 wgmmas, keeping one k-block of MMAs in flight. Each expert has
// its own pair of tensor maps whose K extent ends at the expert's block end, so the last
// k-block reads zeros past it (TMA's out-of-bounds fill), never the next expert's codes.
// Tiles walk expert by expert, N fastest: the CTAs in flight share a few dy^T row blocks and
// sweep x^T, which stays in L2.
//
// Epilogue: a warp owns 16 rows x 256 columns of accumulators; it writes 8 rows at a time,
// scaled by alpha, into its 8.25 KiB staging buffer (rows 1056 bytes apart, so a warp's 8-byte
// stores take the minimum two shared-memory wavefronts), fences them for the async proxy, and
// its lane 0 issues one 1 KiB bulk copy per row. The buffer is reused once the TMA unit has
// read it (bulk_wait_read), not once the global writes land.
//
// Floor: 2 out in K FLOPs per expert at the H200's dense FP8 peak (~1979 TFLOP/s); the FP32
// dw write (4 out in bytes per expert) at 4.8 TB/s runs underneath it. Speed: bench/RESULTS.md,
// twenty-second session.
#include "backend/cuda/grouped_wgrad_fp8.h"

#include <cuda.h>  // the CUtensorMap types only
#include <cuda_runtime.h>

#include <algorithm>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/sm90_ptx.cuh"
#include "backend/cuda/tensor_map.h"

namespace tessera::cuda {
namespace {

using namespace sm90;

constexpr int kTileM = 128;  // rows of dw (out): two consumer warpgroups x 64
constexpr int kTileN = 256;  // columns of dw (in)
constexpr int kTileK = 128;  // FP8 codes per k-block: one 128-byte swizzle row
constexpr int kStages = 3;
constexpr int kABytes = kTileM * kTileK;  // 16 KiB
constexpr int kBBytes = kTileN * kTileK;  // 32 KiB
constexpr int kConsumers = 2;
constexpr int kThreads = (kConsumers + 1) * 128;
constexpr int kRowPitch = kTileN * 4 + 32;                        // a staged FP32 row + 32 bytes
constexpr int kWarpStagingBytes = 8 * kRowPitch;                  // 8 rows a warp at a time
constexpr int kStagingBytes = kConsumers * 4 * kWarpStagingBytes;  // 66 KiB
constexpr int kSmemBytes = kStages * (kABytes + kBBytes) + kStagingBytes + 1024;
constexpr int kMaxSlots = static_cast<int>(kGroupedWgradFp8MaxExperts);
static_assert(kSmemBytes <= 227 * 1024, "shared memory budget");

// Slot s is the s-th expert with rows.
struct WgradParams {
  CUtensorMap a[kMaxSlots];  // dy_t columns [0, end of the slot's block), box 128 codes x 128 rows
  CUtensorMap b[kMaxSlots];  // x_t likewise, box 128 codes x 256 rows
  int k_begin[kMaxSlots];    // first column of the slot's block
  int k_blocks[kMaxSlots];   // its width in 128-column k-blocks, rounded up
  int expert[kMaxSlots];     // the slot's index into dw
  int slots;
  int m_tiles, n_tiles;
  int64_t out, in;
  float* dw;
  const float* scale_inv_a;
  const float* scale_inv_b;
  int accumulate;
};

__device__ __forceinline__ void release_stage(uint32_t empty_bar) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) mbar_arrive(empty_bar);
}

// One bulk copy of `bytes` FP32 values from shared to global memory by this thread when
// `issue`: a plain store, or an element-wise add into dst when `add` (sm90_ptx.cuh's
// bulk_store / bulk_reduce_add_f32). Predicated inside the asm, so no branch.
__device__ __forceinline__ void bulk_copy_rows(float* dst, uint32_t src, uint32_t bytes, bool issue, int add) {
  asm volatile(
      "{\n"
      ".reg .pred pi, pa, ps;\n"
      "setp.ne.b32 pi, %3, 0;\n"
      "setp.ne.and.b32 pa, %4, 0, pi;\n"
      "setp.eq.and.b32 ps, %4, 0, pi;\n"
      "@pa cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
      "@ps cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
      "}\n" ::"l"(reinterpret_cast<uint64_t>(dst)),
      "r"(src), "r"(bytes), "r"(issue ? 1 : 0), "r"(add)
      : "memory");
}

template <bool kAE5M2, bool kBE5M2>
__global__ void __launch_bounds__(kThreads, 1) grouped_wgrad_fp8_kernel(const __grid_constant__ WgradParams p) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma / setmaxnreg exist only on sm_90a; the host side checks the device.
#else
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kStages];
  __shared__ __align__(8) uint64_t empty_bar[kStages];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t ring = (raw + 1023u) & ~1023u;
  const uint32_t a_stage0 = ring;
  const uint32_t b_stage0 = ring + kStages * kABytes;
  const uint32_t staging0 = ring + kStages * (kABytes + kBBytes);
  const int tiles_per_slot = p.m_tiles * p.n_tiles;
  const int64_t total_tiles = static_cast<int64_t>(p.slots) * tiles_per_slot;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_addr(&full_bar[s]), 1);                // the producer's expect_tx arrival
      mbar_init(smem_addr(&empty_bar[s]), kConsumers * 4);  // every consumer warp
    }
    mbar_fence_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;

  if (wg == kConsumers) {
    // Producer: one thread drives TMA, up to kStages k-blocks ahead, across tile boundaries
    // (the next tile's first stages load during the consumers' epilogue).
    regs_dealloc<40>();
    if (threadIdx.x == kConsumers * 128) {
      uint32_t it = 0;
      for (int64_t t = blockIdx.x; t < total_tiles; t += gridDim.x) {
        const int slot = static_cast<int>(t / tiles_per_slot), local = static_cast<int>(t % tiles_per_slot);
        const int m0 = (local / p.n_tiles) * kTileM, n0 = (local % p.n_tiles) * kTileN;
        const int k_blocks = p.k_blocks[slot], k_begin = p.k_begin[slot];
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const uint32_t s = it % kStages, phase = (it / kStages) & 1;
          const uint32_t full = smem_addr(&full_bar[s]);
          mbar_wait(smem_addr(&empty_bar[s]), phase ^ 1);  // first lap: passes at once
          mbar_arrive_expect_tx(full, kABytes + kBBytes);
          tma_load_2d(a_stage0 + s * kABytes, &p.a[slot], full, k_begin + kb * kTileK, m0);
          tma_load_2d(b_stage0 + s * kBBytes, &p.b[slot], full, k_begin + kb * kTileK, n0);
        }
      }
    }
    return;
  }

  regs_alloc<232>();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;  // warp 0..7 over both consumers
  const float alpha = p.scale_inv_a[0] * p.scale_inv_b[0];
  // This warp's staging buffer: generic pointer for the stores, shared address for the copies.
  const uint32_t stage_s = staging0 + warp * kWarpStagingBytes;
  float* stage_f = reinterpret_cast<float*>(smem_raw + (stage_s - raw));
  float acc[128];
#pragma unroll
  for (int j = 0; j < 128; ++j) acc[j] = 0.0f;
  uint32_t it = 0;
  for (int64_t t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    const int slot = static_cast<int>(t / tiles_per_slot), local = static_cast<int>(t % tiles_per_slot);
    const int m0 = (local / p.n_tiles) * kTileM, n0 = (local % p.n_tiles) * kTileN;
    const int k_blocks = p.k_blocks[slot];
    fence_registers(acc);  // the previous epilogue's reads stay before the first MMA
    uint32_t prev = 0;
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      const uint32_t s = it % kStages, phase = (it / kStages) & 1;
      mbar_wait(smem_addr(&full_bar[s]), phase);  // (the kNoTrap form makes ptxas serialise the wgmmas here)
      const uint32_t a = a_stage0 + s * kABytes + wg * 64 * kTileK;  // this warpgroup's 64 rows
      const uint32_t b = b_stage0 + s * kBBytes;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kTileK / 32; ++kk)
        wgmma_m64n256k32_fp8<kAE5M2, kBE5M2>(acc, make_desc_sw128(a + kk * 32), make_desc_sw128(b + kk * 32),
                                             (kb | kk) != 0);
      wgmma_commit();
      if (kb > 0) {
        wgmma_wait<1>();  // k-block kb - 1's MMAs are done: its stage may be refilled
        release_stage(smem_addr(&empty_bar[prev]));
      }
      prev = s;
    }
    wgmma_wait<0>();
    fence_registers(acc);
    release_stage(smem_addr(&empty_bar[prev]));

    // Epilogue: rows [row0, row0 + 16) of the tile, 8 at a time (acc[4j + 2h], acc[4j + 2h + 1]
    // are row lane / 4 + 8 h, columns 8 j + 2 (lane % 4) + {0, 1}).
    const int64_t row0 = m0 + wg * 64 + (warp % 4) * 16;
    float* dw_tile = p.dw + static_cast<int64_t>(p.expert[slot]) * p.out * p.in + n0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // No branches on the lane here: ptxas serialises every wgmma of a kernel whose
      // accumulators are live across a divergent path. Every lane waits and commits (a lane
      // without copies has nothing to wait for); only lane 0's copies are issued (predicated).
      bulk_wait_read<0>();  // the TMA unit has read this buffer's previous rows
      __syncwarp();
      float* row = stage_f + (lane / 4) * (kRowPitch / 4) + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<float2*>(row + 8 * j) = make_float2(acc[4 * j + 2 * h] * alpha, acc[4 * j + 2 * h + 1] * alpha);
      fence_proxy_async_shared();  // the stores above, visible to the bulk copies
      __syncwarp();
#pragma unroll
      for (int r = 0; r < 8; ++r)
        bulk_copy_rows(dw_tile + (row0 + 8 * h + r) * p.in, stage_s + r * kRowPitch, kTileN * 4, lane == 0,
                       p.accumulate);
      bulk_commit();
    }
  }
  bulk_wait<0>();  // every copy has landed before the CTA's shared memory goes
#endif
}

bool rows_ok(const Tensor& t) {
  return t.defined() && t.dim() == 2 && is_fp8(t.dtype()) && t.stride(1) == 1 && t.stride(0) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0;
}

template <bool kAE5M2, bool kBE5M2>
void launch(cudaStream_t stream, const WgradParams& params, int grid, int device) {
  auto kernel = grouped_wgrad_fp8_kernel<kAE5M2, kBE5M2>;
  static bool attribute_set[64] = {};
  if (device < 0 || device >= 64 || !attribute_set[device]) {
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    if (device >= 0 && device < 64) attribute_set[device] = true;
  }
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(params);
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool grouped_wgrad_fp8_supported(const Tensor& dy_t, const Tensor& x_t, const Tensor& dw, int64_t experts_with_rows) {
  if (!rows_ok(dy_t) || !rows_ok(x_t) || !dw.defined() || dw.dtype() != DType::F32 || dw.dim() != 3 ||
      !dw.is_contiguous() || reinterpret_cast<uintptr_t>(dw.raw_data()) % 16 != 0)
    return false;
  if (!dy_t.device().is_cuda() || dy_t.device() != x_t.device() || dy_t.device() != dw.device() ||
      !device_is_hopper(dy_t.device().index))
    return false;
  const int64_t out = dw.size(1), in = dw.size(2);
  return dy_t.size(0) == out && x_t.size(0) == in && dy_t.size(1) == x_t.size(1) && out % kTileM == 0 &&
         in % kTileN == 0 && experts_with_rows > 0 && experts_with_rows <= kGroupedWgradFp8MaxExperts &&
         dy_t.size(1) < (int64_t{1} << 31);
}

void grouped_wgrad_fp8(void* stream, const Tensor& dy_t, const Tensor& x_t, const std::vector<int64_t>& splits,
                       const std::vector<int64_t>& padded_offsets, const Tensor& scale_inv_dy,
                       const Tensor& scale_inv_x, Tensor& dw, bool accumulate) {
  TESSERA_CHECK(padded_offsets.size() == splits.size() + 1 && static_cast<int64_t>(splits.size()) == dw.size(0),
                "grouped_wgrad_fp8: ", splits.size(), " split sizes and ", padded_offsets.size(),
                " offsets for dw with ", dw.size(0), " experts");
  WgradParams params{};
  const int64_t out = dw.size(1), in = dw.size(2);
  const cuuint64_t a_stride[1] = {static_cast<cuuint64_t>(dy_t.stride(0))};
  const cuuint64_t b_stride[1] = {static_cast<cuuint64_t>(x_t.stride(0))};
  const cuuint32_t a_box[2] = {kTileK, kTileM}, b_box[2] = {kTileK, kTileN};
  int slots = 0;
  for (size_t e = 0; e < splits.size(); ++e) {
    if (splits[e] == 0) continue;
    TESSERA_CHECK(slots < kMaxSlots, "grouped_wgrad_fp8: more than ", kMaxSlots, " experts with rows");
    const int64_t begin = padded_offsets[e], end = padded_offsets[e + 1];
    TESSERA_CHECK(begin >= 0 && end > begin && end <= dy_t.size(1), "grouped_wgrad_fp8: expert ", e, "'s columns [",
                  begin, ", ", end, ") are outside the ", dy_t.size(1), " columns of the codes");
    // K extent ends with the expert's block: the last k-block reads zeros past it.
    const cuuint64_t a_dims[2] = {static_cast<cuuint64_t>(end), static_cast<cuuint64_t>(out)};
    const cuuint64_t b_dims[2] = {static_cast<cuuint64_t>(end), static_cast<cuuint64_t>(in)};
    params.a[slots] = make_u8_tensor_map(dy_t.raw_data(), 2, a_dims, a_stride, a_box, "grouped_wgrad_fp8");
    params.b[slots] = make_u8_tensor_map(x_t.raw_data(), 2, b_dims, b_stride, b_box, "grouped_wgrad_fp8");
    params.k_begin[slots] = static_cast<int>(begin);
    params.k_blocks[slots] = static_cast<int>((end - begin + kTileK - 1) / kTileK);
    params.expert[slots] = static_cast<int>(e);
    ++slots;
  }
  if (slots == 0) return;
  params.slots = slots;
  params.m_tiles = static_cast<int>(out / kTileM);
  params.n_tiles = static_cast<int>(in / kTileN);
  params.out = out;
  params.in = in;
  params.dw = dw.data<float>();
  params.scale_inv_a = scale_inv_dy.data<float>();
  params.scale_inv_b = scale_inv_x.data<float>();
  params.accumulate = accumulate ? 1 : 0;
  const int device = dw.device().index;
  const int64_t tiles = static_cast<int64_t>(slots) * params.m_tiles * params.n_tiles;
  const int grid = static_cast<int>(std::min<int64_t>(multiprocessor_count(device), tiles));
  auto s = static_cast<cudaStream_t>(stream);
  const bool a5 = dy_t.dtype() == DType::E5M2, b5 = x_t.dtype() == DType::E5M2;
  if (!a5 && !b5) launch<false, false>(s, params, grid, device);
  else if (!a5 && b5) launch<false, true>(s, params, grid, device);
  else if (a5 && !b5) launch<true, false>(s, params, grid, device);
  else launch<true, true>(s, params, grid, device);
}

}  // namespace tessera::cuda
