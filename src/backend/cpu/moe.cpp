// CPU reference: the MoE router, routing map, token permute/unpermute and the scaled
// SwiGLU, forward and backward (see include/tessera/ops/moe.h for the definitions).
//
// Rows are processed one after another in token order, so every result (the capacity
// limit's choice, the permuted order, the sums) is a function of the inputs alone. The
// compute type is double for F64 inputs and float otherwise; loss sums accumulate in double.
#include "moe.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "float_buffer.h"

namespace tessera::cpu {
namespace {

template <typename T>
T sigmoid(T g) {
  return T(1) / (T(1) + std::exp(-g));
}

int64_t expert_of(int32_t index) { return index >= 0 ? index : -static_cast<int64_t>(index) - 1; }

// Picks the k best of `sel` (ties to the lower index), skipping entries with `masked`.
template <typename T>
void top_k(const T* sel, int64_t n, int64_t k, std::vector<char>& taken, int32_t* out) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < n; ++e) {
      if (taken[e]) continue;
      if (best < 0 || sel[e] > sel[best]) best = e;
    }
    taken[best] = 1;
    out[j] = static_cast<int32_t>(best);
  }
}

template <typename T>
T row_logsumexp(const T* x, int64_t n) {
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t e = 0; e < n; ++e) m = std::max(m, x[e]);
  double sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += std::exp(x[e] - m);
  return m + static_cast<T>(std::log(sum));
}

}  // namespace

void moe_router_forward(const Tensor& logits, const Tensor& expert_bias, const RouterOptions& o, Tensor& scores,
                        Tensor& probs, Tensor& indices, Tensor& counts, Tensor& losses) {
  dispatch_compute_type(logits.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n_tokens = logits.size(0), n_exp = logits.size(1), k = o.top_k;
    ReadBuffer<T> in(logits);
    ReadBuffer<float> bias(expert_bias);
    WriteBuffer<T> s_out(scores), p_out(probs);
    int32_t* idx = indices.data<int32_t>();
    int32_t* cnt = counts.data<int32_t>();
    std::vector<T> sel(static_cast<size_t>(n_exp));
    std::vector<char> taken(static_cast<size_t>(n_exp));
    std::vector<int64_t> routed(static_cast<size_t>(n_exp), 0), kept(static_cast<size_t>(n_exp), 0);
    std::vector<double> score_sum(static_cast<size_t>(n_exp), 0.0);
    double z_sum = 0;
    const int64_t groups = o.num_groups > 1 ? o.num_groups : 1, group_size = n_exp / groups;
    for (int64_t n = 0; n < n_tokens; ++n) {
      const T* x = in.data() + n * n_exp;
      T* s = s_out.data() + n * n_exp;
      if (o.score == RouterScore::Softmax) {
        T m = -std::numeric_limits<T>::infinity();
        for (int64_t e = 0; e < n_exp; ++e) m = std::max(m, x[e]);
        double sum = 0;
        for (int64_t e = 0; e < n_exp; ++e) sum += (s[e] = std::exp(x[e] - m));
        for (int64_t e = 0; e < n_exp; ++e) s[e] = static_cast<T>(static_cast<double>(s[e]) / sum);
      } else {
        for (int64_t e = 0; e < n_exp; ++e) s[e] = sigmoid(x[e]);
      }
      for (int64_t e = 0; e < n_exp; ++e) {
        sel[e] = s[e] + (expert_bias.defined() ? static_cast<T>(bias[e]) : T(0));
        score_sum[e] += s[e];
      }
      if (o.z_loss_coeff != 0) {
        const double lse = row_logsumexp(x, n_exp);
        z_sum += lse * lse;
      }
      std::fill(taken.begin(), taken.end(), 0);
      if (groups > 1) {
        // Group score: the sum of the group's two best selection scores.
        std::vector<T> group_score(static_cast<size_t>(groups));
        for (int64_t g = 0; g < groups; ++g) {
          const T* gs = sel.data() + g * group_size;
          int32_t best[2];
          std::vector<char> t(static_cast<size_t>(group_size), 0);
          const int64_t pick = std::min<int64_t>(2, group_size);
          top_k(gs, group_size, pick, t, best);
          group_score[g] = gs[best[0]] + (pick > 1 ? gs[best[1]] : T(0));
        }
        std::vector<char> gtaken(static_cast<size_t>(groups), 0);
        std::vector<int32_t> chosen(static_cast<size_t>(o.topk_groups));
        top_k(group_score.data(), groups, o.topk_groups, gtaken, chosen.data());
        for (int64_t g = 0; g < groups; ++g)
          if (!gtaken[g])
            for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) taken[e] = 1;  // excluded
      }
      int32_t* row_idx = idx + n * k;
      top_k(sel.data(), n_exp, k, taken, row_idx);
      T* p = p_out.data() + n * k;
      double total = 0;
      for (int64_t j = 0; j < k; ++j) total += s[row_idx[j]];
      for (int64_t j = 0; j < k; ++j) {
        T w = s[row_idx[j]];
        if (o.normalize && total > 0) w = static_cast<T>(static_cast<double>(w) / total);
        p[j] = w * static_cast<T>(o.scaling);
        ++routed[row_idx[j]];
      }
    }
    // The capacity limit walks the assignments in token order, so earlier tokens win.
    const int64_t capacity = o.capacity_factor > 0
                                 ? static_cast<int64_t>(std::ceil(double(o.capacity_factor) * double(n_tokens * k) / double(n_exp)))
                                 : std::numeric_limits<int64_t>::max();
    for (int64_t a = 0; a < n_tokens * k; ++a) {
      const int32_t e = idx[a];
      if (kept[e] >= capacity) {
        idx[a] = -e - 1;
        p_out.data()[a] = T(0);
      } else {
        ++kept[e];
      }
    }
    for (int64_t e = 0; e < n_exp; ++e) cnt[e] = static_cast<int32_t>(kept[e]);
    double aux = 0;
    if (o.aux_loss_coeff != 0 && n_tokens > 0) {
      for (int64_t e = 0; e < n_exp; ++e) aux += double(routed[e]) * (score_sum[e] / double(n_tokens));
      aux *= double(o.aux_loss_coeff) * double(n_exp) / double(n_tokens * k);
    }
    const double z = n_tokens > 0 ? double(o.z_loss_coeff) * z_sum / double(n_tokens) : 0.0;
    losses.set_item(0, aux);
    losses.set_item(1, z);
    s_out.commit();
    p_out.commit();
  });
}

void moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& indices, const Tensor& d_probs,
                         const RouterOptions& o, float loss_scale, Tensor& d_logits) {
  dispatch_compute_type(logits.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n_tokens = logits.size(0), n_exp = logits.size(1), k = o.top_k;
    ReadBuffer<T> in(logits), sc(scores), dp(d_probs);
    WriteBuffer<T> out(d_logits);
    const int32_t* idx = indices.data<int32_t>();
    std::vector<int64_t> routed(static_cast<size_t>(n_exp), 0);
    for (int64_t a = 0; a < n_tokens * k; ++a) ++routed[expert_of(idx[a])];
    // d(aux)/d s[n, e] is the same for every token.
    std::vector<T> aux_grad(static_cast<size_t>(n_exp), T(0));
    if (o.aux_loss_coeff != 0 && n_tokens > 0) {
      const double c = double(loss_scale) * o.aux_loss_coeff * double(n_exp) / (double(n_tokens * k) * double(n_tokens));
      for (int64_t e = 0; e < n_exp; ++e) aux_grad[e] = static_cast<T>(c * double(routed[e]));
    }
    const double z_coeff = n_tokens > 0 ? double(loss_scale) * o.z_loss_coeff * 2.0 / double(n_tokens) : 0.0;
    std::vector<T> ds(static_cast<size_t>(n_exp));
    for (int64_t n = 0; n < n_tokens; ++n) {
      const T* s = sc.data() + n * n_exp;
      const T* x = in.data() + n * n_exp;
      T* dl = out.data() + n * n_exp;
      for (int64_t e = 0; e < n_exp; ++e) ds[e] = aux_grad[e];
      const int32_t* row_idx = idx + n * k;
      const T* g = dp.data() + n * k;
      double total = 0, dot = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = expert_of(row_idx[j]);
        const double gj = row_idx[j] >= 0 ? double(g[j]) * o.scaling : 0.0;
        total += s[e];
        dot += gj * s[e];
      }
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = expert_of(row_idx[j]);
        const double gj = row_idx[j] >= 0 ? double(g[j]) * o.scaling : 0.0;
        if (o.normalize && total > 0) ds[e] += static_cast<T>(gj / total - dot / (total * total));
        else ds[e] += static_cast<T>(gj);
      }
      if (o.score == RouterScore::Softmax) {
        double sd = 0;
        for (int64_t e = 0; e < n_exp; ++e) sd += double(ds[e]) * s[e];
        for (int64_t e = 0; e < n_exp; ++e) dl[e] = s[e] * (ds[e] - static_cast<T>(sd));
      } else {
        for (int64_t e = 0; e < n_exp; ++e) dl[e] = ds[e] * s[e] * (T(1) - s[e]);
      }
      if (z_coeff != 0) {
        const T lse = row_logsumexp(x, n_exp);
        for (int64_t e = 0; e < n_exp; ++e) dl[e] += static_cast<T>(z_coeff * double(lse)) * std::exp(x[e] - lse);
      }
    }
    out.commit();
  });
}

void moe_update_expert_bias(const Tensor& load, float rate, Tensor& bias) {
  const int64_t n = load.numel();
  if (n == 0) return;
  double mean = 0;
  for (int64_t e = 0; e < n; ++e) mean += load.item(e);
  mean /= double(n);
  float* b = bias.data<float>();
  for (int64_t e = 0; e < n; ++e) {
    const double err = mean - load.item(e);
    b[e] += rate * static_cast<float>((err > 0) - (err < 0));
  }
}

void moe_routing_map(const Tensor& indices, int64_t num_experts, Tensor& row_map, Tensor& offsets) {
  const int64_t assignments = indices.numel();
  const int32_t* idx = indices.data<int32_t>();
  int32_t* map = row_map.data<int32_t>();
  int32_t* off = offsets.data<int32_t>();
  std::vector<int64_t> count(static_cast<size_t>(num_experts), 0);
  for (int64_t a = 0; a < assignments; ++a)
    if (idx[a] >= 0) ++count[idx[a]];
  off[0] = 0;
  for (int64_t e = 0; e < num_experts; ++e) off[e + 1] = off[e] + static_cast<int32_t>(count[e]);
  std::vector<int64_t> next(static_cast<size_t>(num_experts));
  for (int64_t e = 0; e < num_experts; ++e) next[e] = off[e];
  // Flat order is token order (a token picks an expert at most once), so each expert's rows
  // come in token order.
  for (int64_t a = 0; a < assignments; ++a) map[a] = idx[a] >= 0 ? static_cast<int32_t>(next[idx[a]]++) : -1;
}

void moe_permute_forward(const Tensor& x, const Tensor& row_map, const Tensor& probs, Tensor& permuted,
                         Tensor& permuted_probs) {
  dispatch_compute_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n_tokens = x.size(0), width = x.size(1), k = row_map.size(1), rows = permuted.size(0);
    ReadBuffer<T> in(x);
    WriteBuffer<T> out(permuted);
    std::fill(out.data(), out.data() + rows * width, T(0));
    const int32_t* map = row_map.data<int32_t>();
    for (int64_t a = 0; a < n_tokens * k; ++a) {
      if (map[a] < 0) continue;
      std::copy(in.data() + (a / k) * width, in.data() + (a / k + 1) * width, out.data() + int64_t(map[a]) * width);
    }
    out.commit();
    if (probs.defined() && permuted_probs.defined()) {
      ReadBuffer<T> p(probs);
      WriteBuffer<T> pp(permuted_probs);
      std::fill(pp.data(), pp.data() + rows, T(0));
      for (int64_t a = 0; a < n_tokens * k; ++a)
        if (map[a] >= 0) pp[map[a]] = p[a];
      pp.commit();
    }
  });
}

void moe_permute_backward(const Tensor& row_map, const Tensor& d_permuted, const Tensor& d_permuted_probs, Tensor& dx,
                          Tensor& d_probs) {
  dispatch_compute_type(d_permuted.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n_tokens = dx.size(0), width = dx.size(1), k = row_map.size(1);
    ReadBuffer<T> dp(d_permuted);
    WriteBuffer<T> out(dx);
    const int32_t* map = row_map.data<int32_t>();
    for (int64_t n = 0; n < n_tokens; ++n) {
      T* row = out.data() + n * width;
      std::fill(row, row + width, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const int32_t r = map[n * k + j];
        if (r < 0) continue;
        const T* src = dp.data() + int64_t(r) * width;
        for (int64_t c = 0; c < width; ++c) row[c] += src[c];
      }
    }
    out.commit();
    if (d_permuted_probs.defined() && d_probs.defined()) {
      ReadBuffer<T> dpp(d_permuted_probs);
      WriteBuffer<T> dpr(d_probs);
      for (int64_t a = 0; a < n_tokens * k; ++a) dpr[a] = map[a] >= 0 ? dpp[map[a]] : T(0);
      dpr.commit();
    }
  });
}

void moe_unpermute_forward(const Tensor& expert_out, const Tensor& row_map, const Tensor& probs, Tensor& y) {
  dispatch_compute_type(expert_out.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n_tokens = y.size(0), width = y.size(1), k = row_map.size(1);
    ReadBuffer<T> in(expert_out), p(probs);
    WriteBuffer<T> out(y);
    const int32_t* map = row_map.data<int32_t>();
    for (int64_t n = 0; n < n_tokens; ++n) {
      T* row = out.data() + n * width;
      std::fill(row, row + width, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const int32_t r = map[n * k + j];
        if (r < 0) continue;
        const T w = probs.defined() ? p[n * k + j] : T(1);
        const T* src = in.data() + int64_t(r) * width;
        for (int64_t c = 0; c < width; ++c) row[c] += w * src[c];
      }
    }
    out.commit();
  });
}

void moe_unpermute_backward(const Tensor& expert_out, const Tensor& row_map, const Tensor& probs, const Tensor& dy,
                            Tensor& d_expert_out, Tensor& d_probs) {
  dispatch_compute_type(expert_out.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t n_tokens = dy.size(0), width = dy.size(1), k = row_map.size(1), rows = expert_out.size(0);
    // expert_out is read for d_probs only (MoELayer frees it and passes another tensor).
    const bool want_dot = probs.defined() && d_probs.defined();
    ReadBuffer<T> in(want_dot ? expert_out : Tensor()), p(probs), g(dy);
    WriteBuffer<T> out(d_expert_out);
    std::fill(out.data(), out.data() + rows * width, T(0));
    const int32_t* map = row_map.data<int32_t>();
    std::vector<T> dprob(static_cast<size_t>(n_tokens * k), T(0));
    for (int64_t a = 0; a < n_tokens * k; ++a) {
      const int32_t r = map[a];
      if (r < 0) continue;
      const T w = probs.defined() ? p[a] : T(1);
      const T* gy = g.data() + (a / k) * width;
      T* dst = out.data() + int64_t(r) * width;
      for (int64_t c = 0; c < width; ++c) dst[c] = w * gy[c];
      if (!want_dot) continue;
      const T* src = in.data() + int64_t(r) * width;
      double dot = 0;
      for (int64_t c = 0; c < width; ++c) dot += double(gy[c]) * src[c];
      dprob[a] = static_cast<T>(dot);
    }
    out.commit();
    if (probs.defined() && d_probs.defined()) {
      WriteBuffer<T> dp(d_probs);
      std::copy(dprob.begin(), dprob.end(), dp.data());
      dp.commit();
    }
  });
}

void moe_swiglu_scaled_forward(const Tensor& x, const Tensor& scale, Tensor& y) {
  dispatch_compute_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t rows = x.size(0), width = x.size(1), half = width / 2;
    ReadBuffer<T> in(x), sc(scale);
    WriteBuffer<T> out(y);
    for (int64_t r = 0; r < rows; ++r) {
      const T* gate = in.data() + r * width;
      const T* up = gate + half;
      T* yr = out.data() + r * half;
      for (int64_t c = 0; c < half; ++c) yr[c] = gate[c] * sigmoid(gate[c]) * up[c] * sc[r];
    }
    out.commit();
  });
}

void moe_swiglu_scaled_backward(const Tensor& x, const Tensor& scale, const Tensor& dy, Tensor& dx, Tensor& d_scale) {
  dispatch_compute_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t rows = x.size(0), width = x.size(1), half = width / 2;
    ReadBuffer<T> in(x), sc(scale), g(dy);
    WriteBuffer<T> out(dx), ds(d_scale);
    for (int64_t r = 0; r < rows; ++r) {
      const T* gate = in.data() + r * width;
      const T* up = gate + half;
      const T* dyr = g.data() + r * half;
      T* dgate = out.data() + r * width;
      T* dup = dgate + half;
      double dot = 0;
      for (int64_t c = 0; c < half; ++c) {
        const T gv = gate[c], s = sigmoid(gv), u = up[c], d = dyr[c] * sc[r];
        dot += double(dyr[c]) * (gv * s * u);
        dgate[c] = d * u * s * (T(1) + gv * (T(1) - s));
        dup[c] = d * gv * s;
      }
      ds[r] = static_cast<T>(dot);
    }
    out.commit();
    ds.commit();
  });
}

void moe_fp8_transpose_padded(const Tensor& data, const std::vector<int64_t>& splits,
                              const std::vector<int64_t>& padded, Tensor& data_t) {
  const int64_t k = data.size(1), width = data_t.size(1);
  const uint8_t* in = data.data<uint8_t>();
  uint8_t* out = data_t.data<uint8_t>();
  std::fill(out, out + k * width, uint8_t{0});
  int64_t row = 0;
  for (size_t e = 0; e < splits.size(); ++e) {
    for (int64_t r = 0; r < splits[e]; ++r)
      for (int64_t c = 0; c < k; ++c) out[c * width + padded[e] + r] = in[(row + r) * k + c];
    row += splits[e];
  }
}

}  // namespace tessera::cpu
