// The operation graphs of cuDNN's fused flash attention, in the shape its runtime-fusion SDPA
// engines recognise (the pattern of cudnn-frontend's SDPA nodes, read, not copied), built
// with the cuDNN backend API for tessera's [B, T, H, D] tensors. Plans, execution and the
// public entry points are in attention_cudnn.cu, which says what the graphs compute.
//
// No kernels here: descriptor construction on the host, once per shape (plans are cached).
#include "attention_cudnn_graph.h"

#if TESSERA_WITH_CUDNN
#include <cstdlib>
#include <cstring>

#include "tessera/core/error.h"

namespace tessera::cuda::cudnn_graph {

[[noreturn]] void fail_cudnn(const std::string& call, cudnnStatus_t status) {
  char message[2048] = {0};
  cudnnGetLastErrorString(message, sizeof(message));
  TESSERA_FAIL("cuDNN error in ", call, ": ", cudnnGetErrorString(status),
               message[0] ? std::string(" (") + message + ")" : std::string());
}

std::string status_text(cudnnStatus_t s) {
  char message[1024] = {0};
  cudnnGetLastErrorString(message, sizeof(message));
  return std::string(cudnnGetErrorString(s)) + (message[0] ? std::string(" (") + message + ")" : std::string());
}

bool verbose() {
  static const bool on = [] {
    const char* e = std::getenv("TESSERA_CUDNN_VERBOSE");
    return e && *e && std::strcmp(e, "0") != 0;
  }();
  return on;
}

void set_attr(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
              int64_t count, const void* value, const char* what) {
  const cudnnStatus_t s = cudnnBackendSetAttribute(d, name, type, count, value);
  if (s != CUDNN_STATUS_SUCCESS) fail_cudnn(std::string("cudnnBackendSetAttribute(") + what + ")", s);
}

void finalize(cudnnBackendDescriptor_t d, const char* what) {
  const cudnnStatus_t s = cudnnBackendFinalize(d);
  if (s != CUDNN_STATUS_SUCCESS) fail_cudnn(std::string("cudnnBackendFinalize(") + what + ")", s);
}

namespace {

// A [B, S, H, D] tensor as cuDNN's [b, h, s, d], and transposed, [b, h, d, s].
void as_bhsd(const Tensor& t, Dims& dims, Dims& strides) {
  dims = {t.size(0), t.size(2), t.size(1), t.size(3)};
  strides = {t.stride(0), t.stride(2), t.stride(1), t.stride(3)};
}
void as_bhds(const Tensor& t, Dims& dims, Dims& strides) {
  dims = {t.size(0), t.size(2), t.size(3), t.size(1)};
  strides = {t.stride(0), t.stride(2), t.stride(3), t.stride(1)};
}
// lse [B, Hq, T] as cuDNN's stats [b, h, s_q, 1].
void as_stats(const Tensor& lse, Dims& dims, Dims& strides) {
  dims = {lse.size(0), lse.size(1), lse.size(2), 1};
  strides = {lse.stride(0), lse.stride(1), lse.stride(2), 1};
}

cudnnDataType_t io_type(DType t) { return t == DType::F16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16; }

// Bottom-right causal mask on `scores` ([b, hq, T, S]): keeps key j for query i when
// i + (S - T) >= j, else -inf.
Raw causal_mask(GraphBuilder& g, Raw scores, const Dims& sd, const Dims& ss, bool shifted) {
  Raw row = g.virt(CUDNN_DATA_INT32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
  Raw col = g.virt(CUDNN_DATA_INT32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
  if (shifted) {
    Raw plus_s = g.virt(CUDNN_DATA_INT32, sd, ss);
    g.pointwise(CUDNN_POINTWISE_ADD, row, g.scalar(kSeqKV, CUDNN_DATA_INT32), nullptr, plus_s, CUDNN_DATA_INT32);
    Raw shifted_row = g.virt(CUDNN_DATA_INT32, sd, ss);
    g.pointwise(CUDNN_POINTWISE_SUB, plus_s, g.scalar(kSeqQ, CUDNN_DATA_INT32), nullptr, shifted_row,
                CUDNN_DATA_INT32);
    row = shifted_row;
  }
  Raw keep = g.virt(CUDNN_DATA_BOOLEAN, sd, ss);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep, CUDNN_DATA_BOOLEAN);
  Raw masked = g.virt(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, scores, g.scalar(kNegInf, CUDNN_DATA_FLOAT), keep, masked);
  return masked;
}

}  // namespace

// out = softmax(scale * Q K^T (masked)) V, stats = logsumexp of the same scores.
void build_forward(GraphBuilder& g, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                   const Tensor& lse, bool causal) {
  const cudnnDataType_t io = io_type(q.dtype()), f32 = CUDNN_DATA_FLOAT;
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), S = k.size(1);
  Dims d, s;
  as_bhsd(q, d, s);
  Raw Q = g.tensor(kQ, io, d, s, false);
  as_bhds(k, d, s);
  Raw KT = g.tensor(kK, io, d, s, false);
  as_bhsd(v, d, s);
  Raw V = g.tensor(kV, io, d, s, false);
  as_bhsd(out, d, s);
  Raw O = g.tensor(kO, io, d, s, false);
  as_stats(lse, d, s);
  Raw stats = g.tensor(kStats, f32, d, s, false);

  const Dims sd{B, Hq, T, S}, ss{Hq * T * S, T * S, S, 1};  // scores
  const Dims rd{B, Hq, T, 1}, rs{Hq * T, T, 1, 1};          // per-row values
  Raw scores = g.virt(f32, sd, ss);
  g.matmul(Q, KT, scores);
  Raw scaled = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, scores, g.scalar(kScale, f32), nullptr, scaled);
  if (causal) scaled = causal_mask(g, scaled, sd, ss, T != S);
  Raw row_max = g.virt(f32, rd, rs);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, scaled, row_max);
  Raw centred = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, scaled, row_max, nullptr, centred);
  Raw e = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_EXP, centred, nullptr, nullptr, e);
  Raw row_sum = g.virt(f32, rd, rs);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, row_sum);
  Raw log_sum = g.virt(f32, rd, rs);
  g.pointwise(CUDNN_POINTWISE_LOG, row_sum, nullptr, nullptr, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, row_max, log_sum, nullptr, stats);
  Raw p = g.virt(io, sd, ss);  // P enters the second matmul in the I/O type
  g.pointwise(CUDNN_POINTWISE_DIV, e, row_sum, nullptr, p);
  g.matmul(p, V, O);
}

// dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)) * scale, dK = dS^T Q, dQ = dS K, with P
// rebuilt from the stats; dK and dV reduced over each GQA group.
void build_backward(GraphBuilder& g, const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& out, const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                    bool causal) {
  const cudnnDataType_t io = io_type(q.dtype()), f32 = CUDNN_DATA_FLOAT;
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), S = k.size(1), Hkv = k.size(2);
  Dims d, s, kt_d, kt_s;
  as_bhsd(q, d, s);
  Raw Q = g.tensor(kQ, io, d, s, false);
  as_bhds(k, kt_d, kt_s);
  Raw KT = g.tensor(kK, io, kt_d, kt_s, false);
  as_bhds(v, d, s);
  Raw VT = g.tensor(kV, io, d, s, false);
  as_bhsd(out, d, s);
  Raw O = g.tensor(kO, io, d, s, false);
  as_stats(lse, d, s);
  Raw stats = g.tensor(kStats, f32, d, s, false);
  as_bhsd(d_out, d, s);
  Raw dO = g.tensor(kDO, io, d, s, false);
  as_bhsd(dq, d, s);
  Raw dQ = g.tensor(kDQ, io, d, s, false);
  as_bhsd(dk, d, s);
  Raw dK = g.tensor(kDK, io, d, s, false);
  as_bhsd(dv, d, s);
  Raw dV = g.tensor(kDV, io, d, s, false);
  Raw scale = g.scalar(kScale, f32);

  const Dims sd{B, Hq, T, S}, ss{Hq * T * S, T * S, S, 1};   // scores [b, hq, T, S]
  const Dims td{B, Hq, S, T}, ts{Hq * T * S, T * S, 1, S};   // the same, transposed
  const Dims rd{B, Hq, T, 1}, rs{Hq * T, T, 1, 1};
  const Dims qd{B, Hq, T, D}, qs{Hq * T * D, T * D, D, 1};   // F32 [b, hq, T, d]
  const Dims fd{B, Hq, S, D}, fs{Hq * S * D, S * D, D, 1};   // per-query-head dK / dV

  // Delta = rowsum(dO * O), into a real buffer (the "softmax sum").
  Raw prod = g.virt(f32, qd, qs);
  g.pointwise(CUDNN_POINTWISE_MUL, dO, O, nullptr, prod);
  Raw delta_v = g.virt(f32, rd, rs);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, prod, delta_v);
  Raw delta = g.tensor(kSoftmaxSum, f32, rd, rs, false);
  g.pointwise(CUDNN_POINTWISE_MUL, delta_v, g.scalar(kOne, f32), nullptr, delta);

  // P = exp(scale * Q K^T - stats), masked.
  Raw scores = g.virt(f32, sd, ss);
  g.matmul(Q, KT, scores);
  Raw scaled = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, scores, scale, nullptr, scaled);
  Raw centred = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, scaled, stats, nullptr, centred);
  if (causal) centred = causal_mask(g, centred, sd, ss, T != S);
  Raw p = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_EXP, centred, nullptr, nullptr, p);

  // dV = P^T dO (summed over the group).
  Raw pt = g.virt(io, td, ts);
  g.reshape(p, pt);
  if (Hq == Hkv) {
    g.matmul(pt, dO, dV);
  } else {
    Raw dv_full = g.virt(io, fd, fs);
    g.matmul(pt, dO, dv_full);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dv_full, dV);
  }

  // dS = P * (dO V^T - Delta) * scale.
  Raw dp = g.virt(f32, sd, ss);
  g.matmul(dO, VT, dp);
  Raw dp_centred = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, dp, delta, nullptr, dp_centred);
  Raw ds_unscaled = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, dp_centred, p, nullptr, ds_unscaled);
  Raw ds = g.virt(f32, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, scale, nullptr, ds);

  // dK = dS^T Q (summed over the group).
  Raw dst = g.virt(io, td, ts);
  g.reshape(ds, dst);
  if (Hq == Hkv) {
    g.matmul(dst, Q, dK);
  } else {
    Raw dk_full = g.virt(io, fd, fs);
    g.matmul(dst, Q, dk_full);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dk_full, dK);
  }

  // dQ = dS K, accumulated in F32 and then converted.
  Raw k_view = g.virt(io, {kt_d[0], kt_d[1], kt_d[3], kt_d[2]}, {kt_s[0], kt_s[1], kt_s[3], kt_s[2]});
  g.reshape(KT, k_view);
  Raw dq_accum = g.tensor(kDQAccum, f32, qd, qs, false);
  g.matmul(ds, k_view, dq_accum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, nullptr, dQ);
}

}  // namespace tessera::cuda::cudnn_graph

#endif  // TESSERA_WITH_CUDNN
