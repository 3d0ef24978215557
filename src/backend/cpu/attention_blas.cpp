// CPU attention through BLAS: the F32 fast path behind cpu::attention_forward/backward.
//
// Same maths and layout as attention.cpp (q, out [B, T, Hq, D]; k, v [B, S, Hkv, D];
// lse [B, Hq, T]; bottom-right causal mask), but each head works on blocks of kBlock
// query rows with SGEMMs that read Q, K, V in place (a head's rows are a matrix with
// leading dimension H * D), as PyTorch's CPU attention does. Memory per thread is one
// kBlock x S score block plus one for dP. Tasks: (batch, head) in forward; (batch, kv head)
// in backward, so the GQA sums into dk/dv have a single writer. Measured on 2 cores
// (B=8 H=6 T=256 D=64): see bench/RESULTS.md.
#include "attention.h"

#if TESSERA_WITH_BLAS
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace tessera::cpu {

namespace {
constexpr int64_t kBlock = 64;

struct Shape4 {
  int64_t B, T, S, Hq, Hkv, D, group;
  bool causal;
  int64_t visible(int64_t t) const { return causal ? std::min(S, t + (S - T) + 1) : S; }
  const float* q_head(const float* q, int64_t b, int64_t t, int64_t h) const { return q + ((b * T + t) * Hq + h) * D; }
  const float* kv_head(const float* k, int64_t b, int64_t kvh) const { return k + (b * S * Hkv + kvh) * D; }
};

// With OpenBLAS's OpenMP build, an SGEMM called inside a parallel region runs on its
// caller's thread, so tasks go to OpenMP threads. Its pthread build would start its own
// threads inside every task (cores x cores threads), so there the tasks run one after
// another and each SGEMM uses the BLAS threads.
bool parallel_tasks() {
  static const bool openmp_blas = openblas_get_parallel() != 1;
  return openmp_blas;
}

Shape4 shape_of(const Tensor& q, const Tensor& k, bool causal) {
  return {q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), q.size(2) / k.size(2), causal};
}

// scores[r, j] = scale * q_r . k_j for the block's rows, masked entries set to -inf;
// returns the number of key columns any row of the block can see.
int64_t block_scores(const Shape4& s, const float* q, const float* k, int64_t b, int64_t h, int64_t t0, int64_t rows,
                     float scale, float* scores) {
  const int64_t cols = s.visible(t0 + rows - 1);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, s.D, scale, s.q_head(q, b, t0, h), s.Hq * s.D,
              s.kv_head(k, b, h / s.group), s.Hkv * s.D, 0.0f, scores, cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = s.visible(t0 + r); j < cols; ++j) scores[r * cols + j] = -std::numeric_limits<float>::infinity();
  return cols;
}
}  // namespace

void attention_forward_blas(const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, Tensor& out_t, Tensor& lse_t,
                            bool causal, float scale) {
  const Shape4 s = shape_of(q_t, k_t, causal);
  const float *q = q_t.data<float>(), *k = k_t.data<float>(), *v = v_t.data<float>();
  float *out = out_t.data<float>(), *lse = lse_t.data<float>();
  const int64_t blocks = (s.T + kBlock - 1) / kBlock;
#pragma omp parallel if (parallel_tasks())
  {
    std::vector<float> scores(static_cast<size_t>(kBlock * std::max<int64_t>(s.S, 1)));
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < s.B * s.Hq * blocks; ++task) {
      const int64_t b = task / (s.Hq * blocks), h = (task / blocks) % s.Hq, t0 = (task % blocks) * kBlock;
      const int64_t rows = std::min(kBlock, s.T - t0);
      const int64_t cols = block_scores(s, q, k, b, h, t0, rows, scale, scores.data());
      for (int64_t r = 0; r < rows; ++r) {
        float* row = scores.data() + r * cols;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < cols; ++j) m = std::max(m, row[j]);
        double sum = 0;
        for (int64_t j = 0; j < cols; ++j) sum += row[j] = std::exp(row[j] - m);
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t j = 0; j < cols; ++j) row[j] *= inv;
        lse[(b * s.Hq + h) * s.T + t0 + r] = m + static_cast<float>(std::log(sum));
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, s.D, cols, 1.0f, scores.data(), cols,
                  s.kv_head(v, b, h / s.group), s.Hkv * s.D, 0.0f, out + ((b * s.T + t0) * s.Hq + h) * s.D, s.Hq * s.D);
    }
  }
}

void attention_backward_blas(const Tensor& d_out_t, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t,
                             const Tensor& out_t, const Tensor& lse_t, Tensor& dq_t, Tensor& dk_t, Tensor& dv_t,
                             bool causal, float scale) {
  const Shape4 s = shape_of(q_t, k_t, causal);
  const float *q = q_t.data<float>(), *k = k_t.data<float>(), *v = v_t.data<float>(), *out = out_t.data<float>();
  const float *d_out = d_out_t.data<float>(), *lse = lse_t.data<float>();
  float *dq = dq_t.data<float>(), *dk = dk_t.data<float>(), *dv = dv_t.data<float>();
  const int64_t ld_q = s.Hq * s.D, ld_kv = s.Hkv * s.D;
#pragma omp parallel if (parallel_tasks())
  {
    std::vector<float> p(static_cast<size_t>(kBlock * std::max<int64_t>(s.S, 1))), dp(p.size()), delta(kBlock);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < s.B * s.Hkv; ++task) {
      const int64_t b = task / s.Hkv, kvh = task % s.Hkv;
      float* dk_head = dk + (b * s.S * s.Hkv + kvh) * s.D;
      float* dv_head = dv + (b * s.S * s.Hkv + kvh) * s.D;
      for (int64_t j = 0; j < s.S; ++j) {
        std::fill(dk_head + j * ld_kv, dk_head + j * ld_kv + s.D, 0.0f);
        std::fill(dv_head + j * ld_kv, dv_head + j * ld_kv + s.D, 0.0f);
      }
      for (int64_t h = kvh * s.group; h < (kvh + 1) * s.group; ++h) {
        for (int64_t t0 = 0; t0 < s.T; t0 += kBlock) {
          const int64_t rows = std::min(kBlock, s.T - t0);
          const int64_t cols = block_scores(s, q, k, b, h, t0, rows, scale, p.data());
          const float* d_out_blk = s.q_head(d_out, b, t0, h);
          for (int64_t r = 0; r < rows; ++r) {
            const float l = lse[(b * s.Hq + h) * s.T + t0 + r];
            for (int64_t j = 0; j < cols; ++j) p[r * cols + j] = std::exp(p[r * cols + j] - l);
            const float* o_row = s.q_head(out, b, t0 + r, h);
            const float* g_row = d_out_blk + r * ld_q;
            double d = 0;
            for (int64_t i = 0; i < s.D; ++i) d += double(o_row[i]) * g_row[i];
            delta[r] = static_cast<float>(d);
          }
          // dV += P^T dO;  dP = dO V^T;  dS = P * (dP - delta);  dQ = scale dS K;  dK += scale dS^T Q
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, s.D, rows, 1.0f, p.data(), cols, d_out_blk, ld_q,
                      1.0f, dv_head, ld_kv);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, s.D, 1.0f, d_out_blk, ld_q,
                      s.kv_head(v, b, kvh), ld_kv, 0.0f, dp.data(), cols);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < cols; ++j) dp[r * cols + j] = p[r * cols + j] * (dp[r * cols + j] - delta[r]);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, s.D, cols, scale, dp.data(), cols,
                      s.kv_head(k, b, kvh), ld_kv, 0.0f, dq + ((b * s.T + t0) * s.Hq + h) * s.D, ld_q);
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, s.D, rows, scale, dp.data(), cols,
                      s.q_head(q, b, t0, h), ld_q, 1.0f, dk_head, ld_kv);
        }
      }
    }
  }
}

}  // namespace tessera::cpu
#endif  // TESSERA_WITH_BLAS
