// The dK/dV kernel of the attention backward with its shared-memory fragment loads issued
// one mma step ahead, included by attention_bwd.cu inside its anonymous namespace (it uses
// BwdParams, the kKV* tile constants and dq_step_atomic from there). attention_dkdv_kernel
// (the legacy kernel) stays beside it so both can be timed in one run.
//
// Why: Nsight Compute on the legacy kernel (D = 128, 1 block of 8 warps per SM) puts half
// of the stall samples on HMMAs waiting (short scoreboard) for the ldmatrix just before
// them: with 2 warps per scheduler nothing else hides its latency. Here each k-step's
// fragments are loaded before the previous step's mma.sync are issued. Registers for that:
// P^T and dS^T are packed to BF16 right after the exponential (32 registers instead of 64
// FP32 during the dV/dK products), which pays for the second fragment buffer there.
//
// Integer work cut against the legacy kernel:
//  - lane addresses: a tile row is 2D bytes and the swizzle XORs the 16-byte chunk index
//    with (row % 8), so stepping 16 columns (two chunks) is an XOR of the lane's address
//    with kc << 5 (one LOP3, no multiply), and stepping 16 rows an immediate offset. This
//    needs the tiles 2D-byte aligned in the shared window: every tile is a multiple of 2D
//    bytes from the dynamic shared memory base, which sm_90 places right after the 1 KB
//    the system reserves; the kernel checks the base once and traps otherwise;
//  - the step's head and query tile advance by counters (no division by a runtime count);
//  - lse and Delta come with one 4-byte cp.async per thread of the first 128 (no loop);
//  - tiles that need no mask (not on the causal diagonal, not at the sequence end) take a
//    branch without per-element compares and selects.
// The floating-point operations are the legacy kernel's, in the same order (each
// accumulator sees the same sequence of mma.sync; the softmax terms are spelled with
// __fmul_rn / __fmaf_rn / __fsub_rn so the contraction cannot differ): dK, dV (and the
// atomic variant's dQ partials) are bitwise those of attention_dkdv_kernel.
#pragma once

template <bool kMasked>
struct MaskTag {
  static constexpr bool value = kMasked;
};

template <int D, bool kAtomicDq>
__global__ void __launch_bounds__(kBwdThreads, 1) attention_dkdv_kernel_v2(const BwdParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kKC = D / 16;       // 16-column steps of the head dimension
  constexpr int kNP = kKVRows / 16; // 16-query blocks of a tile
  constexpr int kNT = kKVRows / 8;
  constexpr int kDT = D / 8;
  constexpr uint32_t kRow = D * 2;  // bytes of a tile row
  constexpr uint32_t kRowTile = kKVRows * D * 2;
  constexpr uint32_t kVOff = kKVKeys * D * 2;  // V after K
  constexpr uint32_t kDoOff = 2 * kRowTile;    // dO[buf] after Q[buf]
  static_assert(2 * kKVRows <= kBwdThreads, "one thread per lse / Delta entry");

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int bkv = blockIdx.x, b = bkv / p.Hkv, kvh = bkv % p.Hkv;
  const int k0 = blockIdx.y * kKVKeys;
  const int T = p.T, S = p.S, diag = S - T;
  const int64_t q_stride = static_cast<int64_t>(p.Hq) * D, kv_stride = static_cast<int64_t>(p.Hkv) * D;
  const int64_t kv_offset = (static_cast<int64_t>(b) * S + k0) * kv_stride + static_cast<int64_t>(kvh) * D;

  const uint32_t s_k = smem_u32(smem);
  if ((s_k & (kRow - 1)) != 0) __trap();  // the XOR addressing below needs it (see the top)
  const uint32_t s_v = s_k + kVOff;
  const uint32_t s_q = s_v + kVOff;
  const uint32_t s_do = s_q + 2 * kRowTile;
  const uint32_t s_stat = s_do + 2 * kRowTile;  // lse[2][rows], then Delta[2][rows]
  const float* stat = reinterpret_cast<const float*>(smem + (s_stat - s_k));
  const uint32_t s_ds = s_stat + 4 * kKVRows * 4;

  const int first_q = p.causal ? max(0, k0 - diag) : 0;
  const int q_tiles = (T + kKVRows - 1) / kKVRows;
  const int tile0 = first_q < T ? first_q / kKVRows : q_tiles;
  const int per_head = q_tiles - tile0;
  const int steps = per_head * p.group;

  // Step (head hl of the group, tile ti from tile0) into buffer buf.
  auto load_step = [&](int hl, int ti, int buf) {
    const int h = kvh * p.group + hl;
    const int q0 = (tile0 + ti) * kKVRows;
    const int64_t row_offset = (static_cast<int64_t>(b) * T + q0) * q_stride + static_cast<int64_t>(h) * D;
    load_tile<D, kKVRows, kBwdThreads>(s_q + buf * kRowTile, p.q + row_offset, q_stride, T - q0, tid);
    load_tile<D, kKVRows, kBwdThreads>(s_do + buf * kRowTile, p.d_out + row_offset, q_stride, T - q0, tid);
    if (tid < 2 * kKVRows) {
      const int which = tid / kKVRows, i = tid % kKVRows;  // 0: lse, 1: Delta
      const float* src = (which ? p.delta : p.lse) + (static_cast<int64_t>(b) * p.Hq + h) * T + q0;
      const bool valid = i < T - q0;
      cp_async_4(s_stat + ((2 * which + buf) * kKVRows + i) * 4, valid ? src + i : src, valid);
    }
  };

  load_tile<D, kKVKeys, kBwdThreads>(s_k, p.k + kv_offset, kv_stride, S - k0, tid);
  load_tile<D, kKVKeys, kBwdThreads>(s_v, p.v + kv_offset, kv_stride, S - k0, tid);
  if (steps > 0) load_step(0, 0, 0);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  const int w_key0 = k0 + warp * 16;
  const int key_a = w_key0 + (lane >> 2), key_b = key_a + 8;
  // Lane addresses at column block 0 (a_addr, b_addr, bt_addr of attention_common.cuh).
  const uint32_t a_lane = s_k + tile_offset<D>(warp * 16 + (lane & 15), lane >> 4);
  const uint32_t b_lane0 = s_q + tile_offset<D>((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
  const uint32_t t_lane0 = s_q + tile_offset<D>((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);

  float dk[kDT][4], dv[kDT][4];
#pragma unroll
  for (int i = 0; i < kDT; ++i) {
    dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.0f;
    dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.0f;
  }

  int hl = 0, ti = 0;  // this step's head in the group and query tile
  for (int step = 0; step < steps; ++step) {
    const int buf = step & 1;
    int next_hl = hl, next_ti = ti + 1;
    if (next_ti == per_head) {
      next_ti = 0;
      ++next_hl;
    }
    if (step + 1 < steps) {
      load_step(next_hl, next_ti, buf ^ 1);
      cp_async_commit();
    }
    const int q0 = (tile0 + ti) * kKVRows;
    const int q_last = min(q0 + kKVRows, T) - 1;
    const bool active = w_key0 < S && (!p.causal || q_last + diag >= w_key0);
    if (active) {
      const uint32_t b_lane = b_lane0 + buf * kRowTile, t_lane = t_lane0 + buf * kRowTile;
      float st[kNT][4], dpt[kNT][4];
#pragma unroll
      for (int i = 0; i < kNT; ++i) {
        st[i][0] = st[i][1] = st[i][2] = st[i][3] = 0.0f;
        dpt[i][0] = dpt[i][1] = dpt[i][2] = dpt[i][3] = 0.0f;
      }
      // S^T = K Q^T, dP^T = V dO^T over kKC x kNP steps; step j + 1's fragments are in
      // flight while step j's four mma.sync issue (K, V fragments change every kNP steps).
      {
        uint32_t ka[2][4], va[2][4], bq[2][4], bo[2][4];
        ldmatrix_x4(ka[0], a_lane);
        ldmatrix_x4(va[0], a_lane + kVOff);
        ldmatrix_x4(bq[0], b_lane);
        ldmatrix_x4(bo[0], b_lane + kDoOff);
#pragma unroll
        for (int j = 0; j < kKC * kNP; ++j) {
          const int kc = j / kNP, np = j % kNP, cur = j & 1, ac = kc & 1;
          if (j + 1 < kKC * kNP) {
            const int kn = (j + 1) / kNP, nn = (j + 1) % kNP;
            const uint32_t bx = (b_lane ^ (kn << 5)) + nn * 16 * kRow;
            ldmatrix_x4(bq[cur ^ 1], bx);
            ldmatrix_x4(bo[cur ^ 1], bx + kDoOff);
            if (nn == 0) {
              const uint32_t ax = a_lane ^ (kn << 5);
              ldmatrix_x4(ka[ac ^ 1], ax);
              ldmatrix_x4(va[ac ^ 1], ax + kVOff);
            }
          }
          mma_bf16(st[2 * np], ka[ac], bq[cur][0], bq[cur][1]);
          mma_bf16(st[2 * np + 1], ka[ac], bq[cur][2], bq[cur][3]);
          mma_bf16(dpt[2 * np], va[ac], bo[cur][0], bo[cur][1]);
          mma_bf16(dpt[2 * np + 1], va[ac], bo[cur][2], bo[cur][3]);
        }
      }
      const float* lse_s = stat + buf * kKVRows + 2 * (lane & 3);
      const float* delta_s = stat + (2 + buf) * kKVRows + 2 * (lane & 3);
      const bool need_mask = q0 + kKVRows > T || (p.causal && w_key0 + 15 > q0 + diag) ||
                             (kAtomicDq && w_key0 + 15 >= S);
      // P^T and dS^T; the branch keeps the compares off the tiles that need no mask.
      auto softmax_grad = [&](auto masked) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const float2 l2 = *reinterpret_cast<const float2*>(lse_s + nt * 8);
          const float2 d2 = *reinterpret_cast<const float2*>(delta_s + nt * 8);
          const float lt[2] = {__fmul_rn(l2.x, kLog2e), __fmul_rn(l2.y, kLog2e)};
          const float dl[2] = {d2.x, d2.y};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float pv = exp2_approx(__fmaf_rn(st[nt][e], p.scale_log2, -lt[e & 1]));
            if constexpr (decltype(masked)::value) {
              const int i = q0 + nt * 8 + 2 * (lane & 3) + (e & 1), key = e < 2 ? key_a : key_b;
              if (i >= T || (p.causal && key > i + diag) || (kAtomicDq && key >= S)) pv = 0.0f;
            }
            st[nt][e] = pv;
            dpt[nt][e] = __fmul_rn(pv, __fsub_rn(dpt[nt][e], dl[e & 1]));
          }
        }
      };
      if (need_mask) softmax_grad(MaskTag<true>{});
      else softmax_grad(MaskTag<false>{});
      uint32_t pa[kNP][4], da[kNP][4];
#pragma unroll
      for (int kc = 0; kc < kNP; ++kc) {
        scores_to_a(pa[kc], st[2 * kc], st[2 * kc + 1]);
        scores_to_a(da[kc], dpt[2 * kc], dpt[2 * kc + 1]);
        if constexpr (kAtomicDq) {
          const int row = warp * 16 + (lane >> 2);
          const uint32_t word = 4 * (lane & 3);
          st_shared_u32(s_ds + tile_offset<kKVRows>(row, 2 * kc) + word, da[kc][0]);
          st_shared_u32(s_ds + tile_offset<kKVRows>(row + 8, 2 * kc) + word, da[kc][1]);
          st_shared_u32(s_ds + tile_offset<kKVRows>(row, 2 * kc + 1) + word, da[kc][2]);
          st_shared_u32(s_ds + tile_offset<kKVRows>(row + 8, 2 * kc + 1) + word, da[kc][3]);
        }
      }
      // dV += P^T dO, dK += dS^T Q over kNP x kKC steps, fragments one step ahead.
      {
        uint32_t bd[2][4], bqt[2][4];
        ldmatrix_x4_trans(bd[0], t_lane + kDoOff);
        ldmatrix_x4_trans(bqt[0], t_lane);
#pragma unroll
        for (int j = 0; j < kNP * kKC; ++j) {
          const int kc = j / kKC, dp = j % kKC, cur = j & 1;
          if (j + 1 < kNP * kKC) {
            const int kn = (j + 1) / kKC, dn = (j + 1) % kKC;
            const uint32_t tx = (t_lane ^ (dn << 5)) + kn * 16 * kRow;
            ldmatrix_x4_trans(bd[cur ^ 1], tx + kDoOff);
            ldmatrix_x4_trans(bqt[cur ^ 1], tx);
          }
          mma_bf16(dv[2 * dp], pa[kc], bd[cur][0], bd[cur][1]);
          mma_bf16(dv[2 * dp + 1], pa[kc], bd[cur][2], bd[cur][3]);
          mma_bf16(dk[2 * dp], da[kc], bqt[cur][0], bqt[cur][1]);
          mma_bf16(dk[2 * dp + 1], da[kc], bqt[cur][2], bqt[cur][3]);
        }
      }
    }
    if constexpr (kAtomicDq) {
      __syncthreads();  // every active warp's dS^T is in shared memory
      dq_step_atomic<D>(p, s_ds, s_k, b, kvh * p.group + hl, q0, k0, warp, lane);
    }
    hl = next_hl;
    ti = next_ti;
    cp_async_wait_all();
    __syncthreads();
  }

  store_dk_dv<D>(p, dk, dv, b, kvh, key_a, key_b, lane);
}
