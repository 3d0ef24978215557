#include "tessera/ops/attention.h"

#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include "backend/cpu/attention.h"
#include "dispatch.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/attention.h"
#endif

namespace tessera {

namespace {

// [B, T, H, D] with each token's H * D values packed and tokens at a common stride: a
// contiguous tensor, or heads sliced out of a fused [B, T, Hq + 2 Hkv, D] QKV buffer (so the
// projection's output is attended without first splitting it into three copies).
bool heads_packed(const Tensor& t) {
  return t.dim() == 4 && (t.is_contiguous() || (t.stride(3) == 1 && t.stride(2) == t.size(3) &&
                                                t.stride(1) >= t.size(2) * t.size(3) &&
                                                t.stride(0) == t.size(1) * t.stride(1)));
}

void check_heads_packed(const Tensor& t, const char* op, const char* name) {
  TESSERA_CHECK(heads_packed(t), op, ": ", name, " must be contiguous or a head slice of a contiguous [B, T, H, D] ",
                "buffer (tokens at a common stride), got ", t.describe());
}

// Checks q, k, v (and the lse shape) and returns the resolved softmax scale.
double check_attention_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse,
                              const AttentionOptions& options) {
  check_contiguous(lse, op, "lse");
  check_floating(q, op, "q");
  TESSERA_CHECK(q.dim() == 4, op, ": q must be 4-D [batch, queries, q_heads, head_dim], got ", q.describe());
  TESSERA_CHECK(k.dim() == 4, op, ": k must be 4-D [batch, keys, kv_heads, head_dim], got ", k.describe());
  check_heads_packed(q, op, "q");
  check_heads_packed(k, op, "k");
  check_heads_packed(v, op, "v");
  check_dtype(k, q.dtype(), op, "k");
  check_dtype(v, q.dtype(), op, "v");
  check_shape(v, k.shape(), op, "v");

  const int64_t batch = q.size(0), queries = q.size(1), q_heads = q.size(2), head_dim = q.size(3);
  const int64_t keys = k.size(1), kv_heads = k.size(2);
  TESSERA_CHECK(k.size(0) == batch, op, ": batch sizes differ: q ", q.describe(), ", k ", k.describe());
  TESSERA_CHECK(k.size(3) == head_dim, op, ": head_dim differs: q ", q.describe(), ", k ", k.describe());
  TESSERA_CHECK(head_dim >= 1, op, ": head_dim must be at least 1, got q ", q.describe());
  TESSERA_CHECK(keys >= 1, op, ": k has no keys (shape ", k.shape_string(), "), so the softmax is empty");
  TESSERA_CHECK(q_heads >= 1 && kv_heads >= 1, op, ": q and k need at least one head, got q ", q.describe(), ", k ",
                k.describe());
  TESSERA_CHECK(q_heads % kv_heads == 0, op, ": q_heads (", q_heads, ") must be a multiple of kv_heads (", kv_heads,
                ") for grouped-query attention; q ", q.describe(), ", k ", k.describe());
  TESSERA_CHECK(!options.causal || keys >= queries, op,
                ": causal attention needs at least as many keys as queries, got ", queries, " queries (q ",
                q.describe(), ") and ", keys, " keys (k ", k.describe(),
                "); with the bottom-right aligned mask the first ", queries - keys, " queries would see no key");
  TESSERA_CHECK(std::isfinite(options.scale), op, ": scale must be finite, got ", options.scale);

  TESSERA_CHECK(lse.dtype() == DType::F32 || lse.dtype() == DType::F64, op, ": lse must be f32 or f64, got ",
                lse.describe());
  check_shape(lse, {batch, q_heads, queries}, op, "lse");
  return options.scale != 0 ? static_cast<double>(options.scale) : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

// A tensor shaped and typed like `like` (q or k).
void check_like(const char* op, const Tensor& t, const char* name, const Tensor& like) {
  check_heads_packed(t, op, name);
  check_dtype(t, like.dtype(), op, name);
  check_shape(t, like.shape(), op, name);
}

// The process-wide backend setting; -1 until set or first read (from the environment).
std::atomic<int> g_attention_backend{-1};
// Deterministic attention backward (tessera's kernels): on unless switched off.
std::atomic<bool> g_attention_deterministic{true};

}  // namespace

AttentionBackend parse_attention_backend(const std::string& name) {
  std::string lower;
  for (char c : name) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "auto") return AttentionBackend::Auto;
  if (lower == "tessera") return AttentionBackend::Tessera;
  if (lower == "cudnn") return AttentionBackend::Cudnn;
  TESSERA_FAIL("unknown attention backend \"", name, "\": expected auto, tessera or cudnn");
}

const char* attention_backend_name(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::Auto: return "auto";
    case AttentionBackend::Tessera: return "tessera";
    case AttentionBackend::Cudnn: return "cudnn";
  }
  return "?";
}

void set_attention_backend(AttentionBackend backend) { g_attention_backend.store(static_cast<int>(backend)); }

AttentionBackend attention_backend() {
  int value = g_attention_backend.load();
  if (value < 0) {  // not set yet: TESSERA_ATTENTION_BACKEND, else Auto
    AttentionBackend initial = AttentionBackend::Auto;
    const char* env = std::getenv("TESSERA_ATTENTION_BACKEND");
    if (env && *env) {
      try {
        initial = parse_attention_backend(env);
      } catch (const Error& e) {
        TESSERA_FAIL("environment variable TESSERA_ATTENTION_BACKEND: ", e.what());
      }
    }
    g_attention_backend.compare_exchange_strong(value, static_cast<int>(initial));
    value = g_attention_backend.load();
  }
  return static_cast<AttentionBackend>(value);
}

void set_attention_deterministic(bool deterministic) { g_attention_deterministic.store(deterministic); }

bool attention_deterministic() { return g_attention_deterministic.load(); }

std::vector<std::string> attention_backend_choices() {
#if TESSERA_WITH_CUDA
  return cuda::attention_backend_choice_log();
#else
  return {};
#endif
}

void clear_attention_backend_choices() {
#if TESSERA_WITH_CUDA
  cuda::clear_attention_backend_choice_log();
#endif
}

void attention_forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       const AttentionOptions& options) {
  const char* op = "attention_forward";
  const double scale = check_attention_inputs(op, q, k, v, lse, options);
  check_like(op, out, "out", q);
  check_on_device(ctx, op, {&q, &k, &v, &out, &lse});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::attention_supported(q, lse)) {
      cuda::attention_forward(ctx.stream, q, k, v, out, lse, options.causal, static_cast<float>(scale));
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  // The reference wants packed tensors.
  Tensor packed_out = out.is_contiguous() ? out : Tensor::empty(out.shape(), out.dtype(), out.device());
  cpu::attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), packed_out, lse, options.causal, scale);
  if (!out.is_contiguous()) out.copy_from(packed_out);
}

void attention_backward(Context& ctx, const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                        const AttentionOptions& options) {
  const char* op = "attention_backward";
  const double scale = check_attention_inputs(op, q, k, v, lse, options);
  check_like(op, d_out, "d_out", q);
  check_like(op, out, "out", q);
  check_like(op, dq, "dq", q);
  check_like(op, dk, "dk", k);
  check_like(op, dv, "dv", k);
  check_on_device(ctx, op, {&d_out, &q, &k, &v, &out, &lse, &dq, &dk, &dv});
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    if (cuda::attention_supported(q, lse)) {
      cuda::attention_backward(ctx.stream, d_out, q, k, v, out, lse, dq, dk, dv, options.causal,
                               static_cast<float>(scale));
      return;
    }
#endif
    fail_no_kernel(op, ctx);
  }
  if (!ctx.device.is_cpu()) fail_no_kernel(op, ctx);
  // The reference wants packed tensors.
  const auto packed = [](Tensor& t) { return t.is_contiguous() ? t : Tensor::empty(t.shape(), t.dtype(), t.device()); };
  Tensor packed_dq = packed(dq), packed_dk = packed(dk), packed_dv = packed(dv);
  cpu::attention_backward(d_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse,
                          packed_dq, packed_dk, packed_dv, options.causal, scale);
  if (!dq.is_contiguous()) dq.copy_from(packed_dq);
  if (!dk.is_contiguous()) dk.copy_from(packed_dk);
  if (!dv.is_contiguous()) dv.copy_from(packed_dv);
}

}  // namespace tessera
