// CPU reference: scaled dot-product attention, forward and backward, causal or not, with
// grouped-query heads.
//
// Layout (all row-major, contiguous, last dim contiguous):
//   q, out, d_out, dq [B, T, Hq, D];  k, v, dk, dv [B, S, Hkv, D];  lse [B, Hq, T].
// One "query row" is (b, h, t), numbered in lse order; one "key row" is (b, j, kvh),
// numbered in k order. Query head h reads kv head h / (Hq / Hkv).
//
// Forward keeps one row of scores in a per-thread scratch buffer and does a stable
// softmax (subtract the row max). Backward never holds the T x S matrix either: it
// recomputes P = exp(scale * q.k - lse) from the saved lse, in two passes that mirror
// FlashAttention-2's backward:
//   pass 1, over query rows: D = rowsum(dO * O) and dq (each row owned by one thread);
//   pass 2, over key rows:   dk and dv, summing over the query heads of the kv group
//                            and every query that sees the key.
// Each output element is written by exactly one thread, so GQA's sums need no atomics and
// stay parallel even with a single kv head.
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "float_buffer.h"

namespace tessera::cpu {

namespace {

struct Dims {
  int64_t batch, queries, keys, q_heads, kv_heads, head_dim, group;
  bool causal;

  explicit Dims(const Tensor& q, const Tensor& k, bool causal_mask)
      : batch(q.size(0)),
        queries(q.size(1)),
        keys(k.size(1)),
        q_heads(q.size(2)),
        kv_heads(k.size(2)),
        head_dim(q.size(3)),
        group(q.size(2) / k.size(2)),
        causal(causal_mask) {}

  // Keys 0 .. visible_keys(t) - 1 are seen by query t (bottom-right aligned mask).
  int64_t visible_keys(int64_t t) const { return causal ? t + (keys - queries) + 1 : keys; }
  // Queries first_query(j) .. T - 1 see key j.
  int64_t first_query(int64_t j) const { return causal ? std::max<int64_t>(0, j - (keys - queries)) : 0; }

  int64_t q_offset(int64_t b, int64_t t, int64_t h) const { return ((b * queries + t) * q_heads + h) * head_dim; }
  int64_t kv_offset(int64_t b, int64_t j, int64_t kvh) const { return ((b * keys + j) * kv_heads + kvh) * head_dim; }
  int64_t lse_index(int64_t b, int64_t h, int64_t t) const { return (b * q_heads + h) * queries + t; }
};

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += alpha * x
template <typename T>
void axpy(T alpha, const T* x, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

template <typename T>
void forward_impl(const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, Tensor& out_t, Tensor& lse_t, bool causal,
                  double scale_d) {
  const Dims dims(q_t, k_t, causal);
  const int64_t D = dims.head_dim;
  const T scale = static_cast<T>(scale_d);
  ReadBuffer<T> q(q_t), k(k_t), v(v_t);
  WriteBuffer<T> out(out_t), lse(lse_t);
  const int64_t rows = dims.batch * dims.q_heads * dims.queries;

#pragma omp parallel
  {
    std::vector<T> p(static_cast<size_t>(dims.keys));
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t t = row % dims.queries;
      const int64_t h = (row / dims.queries) % dims.q_heads;
      const int64_t b = row / (dims.queries * dims.q_heads);
      const int64_t kvh = h / dims.group;
      const int64_t visible = dims.visible_keys(t);
      const T* q_row = q.data() + dims.q_offset(b, t, h);

      T row_max = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < visible; ++j) {
        p[j] = scale * dot(q_row, k.data() + dims.kv_offset(b, j, kvh), D);
        row_max = std::max(row_max, p[j]);
      }
      T sum = 0;
      for (int64_t j = 0; j < visible; ++j) {
        p[j] = std::exp(p[j] - row_max);
        sum += p[j];
      }

      T* out_row = out.data() + dims.q_offset(b, t, h);
      std::fill(out_row, out_row + D, T(0));
      for (int64_t j = 0; j < visible; ++j) axpy(p[j], v.data() + dims.kv_offset(b, j, kvh), out_row, D);
      const T inv_sum = T(1) / sum;
      for (int64_t d = 0; d < D; ++d) out_row[d] *= inv_sum;
      lse[row] = row_max + std::log(sum);
    }
  }
  out.commit();
  lse.commit();
}

template <typename T>
void backward_impl(const Tensor& d_out_t, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, const Tensor& out_t,
                   const Tensor& lse_t, Tensor& dq_t, Tensor& dk_t, Tensor& dv_t, bool causal, double scale_d) {
  const Dims dims(q_t, k_t, causal);
  const int64_t D = dims.head_dim;
  const T scale = static_cast<T>(scale_d);
  ReadBuffer<T> d_out(d_out_t), q(q_t), k(k_t), v(v_t), out(out_t), lse(lse_t);
  WriteBuffer<T> dq(dq_t), dk(dk_t), dv(dv_t);

  // D_i = rowsum(dO * O) = sum_j P_ij dP_ij: the softmax Jacobian's correction term,
  // shared by every key of the row, so pass 1 saves it for pass 2.
  const int64_t query_rows = dims.batch * dims.q_heads * dims.queries;
  std::vector<T> delta(static_cast<size_t>(query_rows));

#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < query_rows; ++row) {
    const int64_t t = row % dims.queries;
    const int64_t h = (row / dims.queries) % dims.q_heads;
    const int64_t b = row / (dims.queries * dims.q_heads);
    const int64_t kvh = h / dims.group;
    const int64_t offset = dims.q_offset(b, t, h);
    const T* q_row = q.data() + offset;
    const T* d_out_row = d_out.data() + offset;
    const T row_delta = dot(d_out_row, out.data() + offset, D);
    const T row_lse = lse[row];
    delta[row] = row_delta;

    T* dq_row = dq.data() + offset;
    std::fill(dq_row, dq_row + D, T(0));
    const int64_t visible = dims.visible_keys(t);
    for (int64_t j = 0; j < visible; ++j) {
      const int64_t kv = dims.kv_offset(b, j, kvh);
      const T p = std::exp(scale * dot(q_row, k.data() + kv, D) - row_lse);
      const T dp = dot(d_out_row, v.data() + kv, D);
      axpy(p * (dp - row_delta), k.data() + kv, dq_row, D);
    }
    for (int64_t d = 0; d < D; ++d) dq_row[d] *= scale;
  }

  const int64_t key_rows = dims.batch * dims.keys * dims.kv_heads;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < key_rows; ++row) {
    const int64_t kvh = row % dims.kv_heads;
    const int64_t j = (row / dims.kv_heads) % dims.keys;
    const int64_t b = row / (dims.kv_heads * dims.keys);
    const int64_t kv = dims.kv_offset(b, j, kvh);
    const T* k_row = k.data() + kv;
    const T* v_row = v.data() + kv;
    T* dk_row = dk.data() + kv;
    T* dv_row = dv.data() + kv;
    std::fill(dk_row, dk_row + D, T(0));
    std::fill(dv_row, dv_row + D, T(0));
    for (int64_t h = kvh * dims.group; h < (kvh + 1) * dims.group; ++h) {
      for (int64_t t = dims.first_query(j); t < dims.queries; ++t) {
        const int64_t offset = dims.q_offset(b, t, h);
        const int64_t stat = dims.lse_index(b, h, t);
        const T* q_row = q.data() + offset;
        const T* d_out_row = d_out.data() + offset;
        const T p = std::exp(scale * dot(q_row, k_row, D) - lse[stat]);
        const T dp = dot(d_out_row, v_row, D);
        axpy(p, d_out_row, dv_row, D);
        axpy(p * (dp - delta[stat]), q_row, dk_row, D);
      }
    }
    for (int64_t d = 0; d < D; ++d) dk_row[d] *= scale;
  }
  dq.commit();
  dk.commit();
  dv.commit();
}

}  // namespace

// The BLAS path (attention_blas.cpp) serves the common training case: every tensor F32.
static bool all_f32(std::initializer_list<const Tensor*> tensors) {
#if TESSERA_WITH_BLAS
  for (const Tensor* t : tensors)
    if (t->dtype() != DType::F32) return false;
  return true;
#else
  (void)tensors;
  return false;
#endif
}

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, bool causal,
                       double scale) {
#if TESSERA_WITH_BLAS
  if (all_f32({&q, &k, &v, &out, &lse}) && q.numel() > 0 && k.size(1) > 0) {
    attention_forward_blas(q, k, v, out, lse, causal, static_cast<float>(scale));
    return;
  }
#endif
  dispatch_compute_type(q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    forward_impl<T>(q, k, v, out, lse, causal, scale);
  });
}

void attention_backward(const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, bool causal, double scale) {
#if TESSERA_WITH_BLAS
  if (all_f32({&d_out, &q, &k, &v, &out, &lse, &dq, &dk, &dv}) && q.numel() > 0 && k.size(1) > 0) {
    attention_backward_blas(d_out, q, k, v, out, lse, dq, dk, dv, causal, static_cast<float>(scale));
    return;
  }
#endif
  dispatch_compute_type(q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    backward_impl<T>(d_out, q, k, v, out, lse, dq, dk, dv, causal, scale);
  });
}

}  // namespace tessera::cpu
