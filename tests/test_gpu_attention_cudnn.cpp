// cuDNN's fused attention (src/backend/cuda/attention_cudnn.cu) against the CPU reference,
// and the choice between it and tessera's kernels (attention_select.cu):
//  - forward and backward, causal and not, T == S and T != S (bottom-right mask), GQA and
//    MQA, head dims 64, 96 and 128 (256 where cuDNN plans it), odd lengths (1, 17, 65, 130,
//    257), B = 2, custom scale, F16;
//    outputs poisoned (NaN) first, dq/dk/dv must be overwritten;
//  - lse crosses backends: tessera's backward on cuDNN's forward (and the reverse) gives the
//    reference gradients, and the two forwards' lse agree;
//  - q, k, v as strided slices of one fused [B, T, Hq + 2 Hkv, D] buffer (and dq, dk, dv as
//    slices of one gradient buffer);
//  - forced tessera, forced cuDNN and Auto give the same results through the public ops;
//    Auto takes cuDNN untimed where tessera has only its generic kernel; forced cuDNN on a
//    shape it cannot run falls back (noted once); bad backend names are errors.
// Skipped (saying so) without a GPU or in a build without cuDNN.
#include <cmath>
#include <string>
#include <vector>

#include "gpu_testing.h"
#include "tessera/ops/attention.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/attention.h"
#include "backend/cuda/attention_cudnn.h"
#endif

using namespace tessera;
using namespace tessera::testing;

#if TESSERA_WITH_CUDA && TESSERA_WITH_CUDNN

#define REQUIRE_CUDNN() REQUIRE_GPU()

namespace {

struct Case {
  const char* name;
  int64_t batch, queries, keys, q_heads, kv_heads, head_dim;
  bool causal;
  float scale = 0;

  Shape q_shape() const { return {batch, queries, q_heads, head_dim}; }
  Shape kv_shape() const { return {batch, keys, kv_heads, head_dim}; }
  Shape lse_shape() const { return {batch, q_heads, queries}; }
  AttentionOptions options() const { return AttentionOptions{causal, scale}; }
  float resolved_scale() const { return scale != 0 ? scale : 1.0f / std::sqrt(static_cast<float>(head_dim)); }
};

const std::vector<Case> kCases = {
    {"mha_causal_T17", 2, 17, 17, 4, 4, 64, true},
    {"mha_full_T257_D128", 2, 257, 257, 4, 4, 128, false},
    {"gqa_causal_T257", 2, 257, 257, 8, 2, 64, true},
    {"gqa_full_T17_D128", 2, 17, 17, 8, 2, 128, false},
    {"kv_cache_T130_S257_gqa_causal", 1, 130, 257, 8, 2, 128, true},
    {"full_T64_S300_gqa", 1, 64, 300, 4, 2, 64, false},
    {"decode_T1_S77_causal", 2, 1, 77, 8, 2, 64, true},
    {"fewer_keys_than_queries", 1, 257, 130, 2, 2, 128, false},
    {"custom_scale_T128", 2, 128, 128, 2, 2, 64, true, 0.3f},
    {"mqa_causal_T200", 1, 200, 200, 4, 1, 128, true},
    {"gqa_causal_D96_T65", 1, 65, 65, 4, 2, 96, true},  // a head dim tessera's tensor cores lack
};

constexpr double kTol = 1e-2;     // BF16 / F16 outputs, as tests/test_gpu_attention.cpp
constexpr double kLseTol = 1e-4;  // lse is F32

Tensor cpu(const Tensor& t) { return t.to(Device::cpu()); }

// Restores Auto (and forgets the choices) when a test ends.
struct BackendGuard {
  ~BackendGuard() {
    set_attention_backend(AttentionBackend::Auto);
    clear_attention_backend_choices();
  }
};

struct Reference {
  Tensor q, k, v, d_out, out, lse, dq, dk, dv;  // CPU
};

Reference reference(const Case& c, DType dtype, uint64_t seed) {
  Context host = Context::cpu();
  Reference r;
  r.q = random_tensor(c.q_shape(), dtype, seed, -2.0f, 2.0f);  // [-2, 2]: a softmax far from flat
  r.k = random_tensor(c.kv_shape(), dtype, seed + 1, -2.0f, 2.0f);
  r.v = random_tensor(c.kv_shape(), dtype, seed + 2);
  r.d_out = random_tensor(c.q_shape(), dtype, seed + 3);
  r.out = Tensor::empty(c.q_shape(), dtype);
  r.lse = Tensor::empty(c.lse_shape(), DType::F32);
  attention_forward(host, r.q, r.k, r.v, r.out, r.lse, c.options());
  r.dq = Tensor::empty(c.q_shape(), dtype);
  r.dk = Tensor::empty(c.kv_shape(), dtype);
  r.dv = Tensor::empty(c.kv_shape(), dtype);
  attention_backward(host, r.d_out, r.q, r.k, r.v, r.out, r.lse, r.dq, r.dk, r.dv, c.options());
  return r;
}

void expect_grads(const Reference& r, const Tensor& dq, const Tensor& dk, const Tensor& dv, const std::string& what) {
  EXPECT_LT(relative_error(cpu(dq), r.dq), kTol) << "dq, " << what;
  EXPECT_LT(relative_error(cpu(dk), r.dk), kTol) << "dk, " << what;
  EXPECT_LT(relative_error(cpu(dv), r.dv), kTol) << "dv, " << what;
}

void check_case(const Case& c, DType dtype, uint64_t seed) {
  SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype));
  const Reference r = reference(c, dtype, seed);
  const Tensor q = r.q.to(kCuda), k = r.k.to(kCuda), v = r.v.to(kCuda), d_out = r.d_out.to(kCuda);
  const float scale = c.resolved_scale();
  void* stream = nullptr;
  Tensor out = poisoned_device(c.q_shape(), dtype), lse = poisoned_device(c.lse_shape(), DType::F32);
  ASSERT_TRUE(cuda::cudnn_attention_supported(q, k, lse, c.causal, {&v, &out}))
      << cuda::cudnn_attention_unsupported_reason(q, k, lse, c.causal, {&v, &out});
  std::string why;
  ASSERT_TRUE(cuda::cudnn_attention_forward_ready(q, k, v, out, lse, c.causal, &why)) << why;
  cuda::cudnn_attention_forward(stream, q, k, v, out, lse, c.causal, scale);
  EXPECT_LT(relative_error(cpu(out), r.out), kTol) << "out";
  EXPECT_LT(relative_error(cpu(lse), r.lse), kLseTol) << "lse";

  // Backward from the CPU's out and lse (only the backward compared), then from cuDNN's own.
  const Tensor ref_out = r.out.to(kCuda), ref_lse = r.lse.to(kCuda);
  for (int own = 0; own < 2; ++own) {
    Tensor dq = poisoned_device(c.q_shape(), dtype), dk = poisoned_device(c.kv_shape(), dtype),
           dv = poisoned_device(c.kv_shape(), dtype);
    const Tensor& o = own ? out : ref_out;
    const Tensor& l = own ? lse : ref_lse;
    ASSERT_TRUE(cuda::cudnn_attention_backward_ready(d_out, q, k, v, o, l, dq, dk, dv, c.causal, &why)) << why;
    cuda::cudnn_attention_backward(stream, d_out, q, k, v, o, l, dq, dk, dv, c.causal, scale);
    expect_grads(r, dq, dk, dv, own ? "backward on cuDNN's forward" : "backward on the reference forward");
  }
}

}  // namespace

TEST(GpuAttentionCudnn, ForwardAndBackwardMatchTheCpuReference) {
  REQUIRE_CUDNN();
  std::printf("cuDNN %d\n", cuda::cudnn_version());
  uint64_t seed = 3000;
  for (const Case& c : kCases) check_case(c, DType::BF16, seed += 10);
}

TEST(GpuAttentionCudnn, HalfPrecisionMatchesTheCpuReference) {
  REQUIRE_CUDNN();
  check_case({"f16_gqa_causal_T130", 2, 130, 130, 4, 2, 64, true}, DType::F16, 3500);
  check_case({"f16_full_T33_S70_D128", 1, 33, 70, 4, 4, 128, false}, DType::F16, 3510);
}

// cuDNN's stats and tessera's lse are the same quantity in the same layout, so each
// backend's backward takes the other's forward.
TEST(GpuAttentionCudnn, LseIsInterchangeableWithTesserasKernels) {
  REQUIRE_CUDNN();
  for (const Case& c : {Case{"gqa_causal_T257", 2, 257, 257, 8, 2, 128, true},
                        Case{"kv_cache_T130_S257", 1, 130, 257, 4, 2, 64, true},
                        Case{"full_T100", 2, 100, 100, 4, 4, 64, false}}) {
    SCOPED_TRACE(c.name);
    const Reference r = reference(c, DType::BF16, 4000);
    const Tensor q = r.q.to(kCuda), k = r.k.to(kCuda), v = r.v.to(kCuda), d_out = r.d_out.to(kCuda);
    const float scale = c.resolved_scale();
    Tensor c_out = poisoned_device(c.q_shape(), DType::BF16), c_lse = poisoned_device(c.lse_shape(), DType::F32);
    cuda::cudnn_attention_forward(nullptr, q, k, v, c_out, c_lse, c.causal, scale);
    Tensor t_out = poisoned_device(c.q_shape(), DType::BF16), t_lse = poisoned_device(c.lse_shape(), DType::F32);
    ASSERT_TRUE(cuda::attention_fast_path(q, k, t_lse, {&v, &t_out}));
    cuda::attention_forward_fast(nullptr, q, k, v, t_out, t_lse, c.causal, scale);
    EXPECT_LT(relative_error(cpu(c_lse), cpu(t_lse)), kLseTol) << "the two forwards' lse";
    EXPECT_LT(relative_error(cpu(c_out), cpu(t_out)), kTol) << "the two forwards' out";

    Tensor dq = poisoned_device(c.q_shape(), DType::BF16), dk = poisoned_device(c.kv_shape(), DType::BF16),
           dv = poisoned_device(c.kv_shape(), DType::BF16);
    cuda::attention_backward_fast(nullptr, d_out, q, k, v, c_out, c_lse, dq, dk, dv, c.causal, scale);
    expect_grads(r, dq, dk, dv, "tessera's backward on cuDNN's out and lse");
    Tensor dq2 = poisoned_device(c.q_shape(), DType::BF16), dk2 = poisoned_device(c.kv_shape(), DType::BF16),
           dv2 = poisoned_device(c.kv_shape(), DType::BF16);
    cuda::cudnn_attention_backward(nullptr, d_out, q, k, v, t_out, t_lse, dq2, dk2, dv2, c.causal, scale);
    expect_grads(r, dq2, dk2, dv2, "cuDNN's backward on tessera's out and lse");
  }
}

// q, k, v as views into one fused QKV projection output [B, T, Hq + 2 Hkv, D] (row stride
// (Hq + 2 Hkv) * D per token), and the gradients written into one such buffer.
TEST(GpuAttentionCudnn, StridedViewsOfAFusedQkvBuffer) {
  REQUIRE_CUDNN();
  for (const Case& c : {Case{"gqa_causal_T130", 2, 130, 130, 8, 2, 64, true},
                        Case{"mha_full_T17_D128", 2, 17, 17, 4, 4, 128, false}}) {
    SCOPED_TRACE(c.name);
    const int64_t Hq = c.q_heads, Hkv = c.kv_heads, W = Hq + 2 * Hkv;
    const Reference r = reference(c, DType::BF16, 4100);
    const Shape fused{c.batch, c.queries, W, c.head_dim};
    Tensor qkv = Tensor::zeros(fused, DType::BF16, kCuda);
    Tensor q = qkv.slice(2, 0, Hq), k = qkv.slice(2, Hq, Hq + Hkv), v = qkv.slice(2, Hq + Hkv, W);
    q.copy_from(r.q);
    k.copy_from(r.k);
    v.copy_from(r.v);
    ASSERT_FALSE(q.is_contiguous());
    const float scale = c.resolved_scale();
    Tensor out = poisoned_device(c.q_shape(), DType::BF16), lse = poisoned_device(c.lse_shape(), DType::F32);
    std::string why;
    ASSERT_TRUE(cuda::cudnn_attention_forward_ready(q, k, v, out, lse, c.causal, &why)) << why;
    cuda::cudnn_attention_forward(nullptr, q, k, v, out, lse, c.causal, scale);
    EXPECT_LT(relative_error(cpu(out), r.out), kTol) << "out";
    EXPECT_LT(relative_error(cpu(lse), r.lse), kLseTol) << "lse";

    Tensor d_qkv = poisoned_device(fused, DType::BF16);
    Tensor dq = d_qkv.slice(2, 0, Hq), dk = d_qkv.slice(2, Hq, Hq + Hkv), dv = d_qkv.slice(2, Hq + Hkv, W);
    const Tensor d_out = r.d_out.to(kCuda);
    ASSERT_TRUE(cuda::cudnn_attention_backward_ready(d_out, q, k, v, out, lse, dq, dk, dv, c.causal, &why)) << why;
    cuda::cudnn_attention_backward(nullptr, d_out, q, k, v, out, lse, dq, dk, dv, c.causal, scale);
    expect_grads(r, dq, dk, dv, "strided gradient views");
    for (double x : cpu(d_qkv).to_doubles()) ASSERT_FALSE(std::isnan(x)) << "a gradient element was not written";
  }
}

TEST(GpuAttentionCudnn, TellsWhatItCannotRun) {
  REQUIRE_CUDNN();
  const Tensor lse = Tensor::zeros({1, 2, 16}, DType::F32, kCuda);
  const Tensor q32 = Tensor::zeros({1, 16, 2, 64}, DType::F32, kCuda);
  EXPECT_NE(cuda::cudnn_attention_unsupported_reason(q32, q32, lse, true), "");
  const Tensor q36 = Tensor::zeros({1, 16, 2, 36}, DType::BF16, kCuda);  // head dim not a multiple of 8
  EXPECT_NE(cuda::cudnn_attention_unsupported_reason(q36, q36, lse, true), "");
  Tensor big = Tensor::zeros({16 * 2 * 64 + 1}, DType::BF16, kCuda);
  const Tensor unaligned = big.slice(0, 1, 16 * 2 * 64 + 1).reshape({1, 16, 2, 64});
  EXPECT_NE(cuda::cudnn_attention_unsupported_reason(unaligned, unaligned, lse, true), "");
  Tensor out = Tensor::empty({1, 16, 2, 36}, DType::BF16, kCuda), l = lse;
  EXPECT_THROW(cuda::cudnn_attention_forward(nullptr, q36, q36, q36, out, l, true, 0.1f), Error);
}

// A NaN in one query row makes that row's output and lse NaN, and no other row's.
TEST(GpuAttentionCudnn, NanQueryRowStaysInItsRow) {
  REQUIRE_CUDNN();
  const Case c{"nan", 1, 20, 20, 2, 2, 64, true};
  Tensor q = random_tensor(c.q_shape(), DType::BF16, 4200);
  q.set_item(0, NAN);  // (b 0, t 0, h 0)
  const Tensor k = random_tensor(c.kv_shape(), DType::BF16, 4201), v = random_tensor(c.kv_shape(), DType::BF16, 4202);
  Tensor out = poisoned_device(c.q_shape(), DType::BF16), lse = poisoned_device(c.lse_shape(), DType::F32);
  cuda::cudnn_attention_forward(nullptr, q.to(kCuda), k.to(kCuda), v.to(kCuda), out, lse, true, c.resolved_scale());
  const std::vector<double> o = cpu(out).to_doubles(), l = cpu(lse).to_doubles();
  EXPECT_TRUE(std::isnan(o[0]));
  for (size_t i = 64; i < o.size(); ++i) ASSERT_FALSE(std::isnan(o[i])) << "element " << i;
  for (size_t i = 1; i < l.size(); ++i) ASSERT_FALSE(std::isnan(l[i])) << "lse " << i;
}

// Hopper's cuDNN advertises head dims up to 256; checked when cuDNN plans it here.
TEST(GpuAttentionCudnn, HeadDim256WhenCudnnPlansIt) {
  REQUIRE_CUDNN();
  const Case c{"gqa_causal_D256_T70", 1, 70, 70, 4, 2, 256, true};
  const Tensor q = Tensor::zeros(c.q_shape(), DType::BF16, kCuda), k = Tensor::zeros(c.kv_shape(), DType::BF16, kCuda);
  Tensor out = Tensor::zeros(c.q_shape(), DType::BF16, kCuda), lse = Tensor::zeros(c.lse_shape(), DType::F32, kCuda);
  std::string why;
  if (!cuda::cudnn_attention_forward_ready(q, k, k, out, lse, c.causal, &why) ||
      !cuda::cudnn_attention_backward_ready(out, q, k, k, out, lse, out, k, k, c.causal, &why))
    GTEST_SKIP() << "cuDNN has no plan for head dim 256 here: " << why;
  check_case(c, DType::BF16, 3600);
}

// Auto takes cuDNN without timing where tessera has only its generic kernel (head dim 96).
TEST(GpuAttentionCudnn, AutoTakesCudnnWhereTesseraHasOnlyItsGenericKernel) {
  REQUIRE_CUDNN();
  BackendGuard guard;
  clear_attention_backend_choices();
  set_attention_backend(AttentionBackend::Auto);
  Context gpu = Context::cuda();
  const Case c{"gqa_full_D96_T50", 2, 50, 50, 4, 2, 96, false};
  const Reference r = reference(c, DType::BF16, 3700);
  Tensor out = poisoned_device(c.q_shape(), DType::BF16), lse = poisoned_device(c.lse_shape(), DType::F32);
  attention_forward(gpu, r.q.to(kCuda), r.k.to(kCuda), r.v.to(kCuda), out, lse, c.options());
  EXPECT_LT(relative_error(cpu(out), r.out), kTol);
  Tensor dq = poisoned_device(c.q_shape(), DType::BF16), dk = poisoned_device(c.kv_shape(), DType::BF16),
         dv = poisoned_device(c.kv_shape(), DType::BF16);
  attention_backward(gpu, r.d_out.to(kCuda), r.q.to(kCuda), r.k.to(kCuda), r.v.to(kCuda), out, lse, dq, dk, dv,
                     c.options());
  expect_grads(r, dq, dk, dv, "Auto, head dim 96");
  const std::vector<std::string> log = attention_backend_choices();
  ASSERT_EQ(log.size(), 1u);
  EXPECT_NE(log[0].find("-> cudnn (tessera has only its generic"), std::string::npos) << log[0];
}

// Through the public ops: forced tessera, forced cuDNN and Auto agree with the reference.
TEST(GpuAttentionCudnn, EveryBackendChoiceGivesTheSameResults) {
  REQUIRE_CUDNN();
  BackendGuard guard;
  Context gpu = Context::cuda();
  const Case c{"gqa_causal_T257", 2, 257, 257, 8, 2, 64, true};
  const Reference r = reference(c, DType::BF16, 4300);
  const Tensor q = r.q.to(kCuda), k = r.k.to(kCuda), v = r.v.to(kCuda), d_out = r.d_out.to(kCuda);
  std::vector<std::vector<double>> outs;
  for (AttentionBackend b : {AttentionBackend::Tessera, AttentionBackend::Cudnn, AttentionBackend::Auto}) {
    SCOPED_TRACE(attention_backend_name(b));
    clear_attention_backend_choices();
    set_attention_backend(b);
    EXPECT_EQ(attention_backend(), b);
    Tensor out = poisoned_device(c.q_shape(), DType::BF16), lse = poisoned_device(c.lse_shape(), DType::F32);
    attention_forward(gpu, q, k, v, out, lse, c.options());
    EXPECT_LT(relative_error(cpu(out), r.out), kTol) << "out";
    EXPECT_LT(relative_error(cpu(lse), r.lse), kLseTol) << "lse";
    Tensor dq = poisoned_device(c.q_shape(), DType::BF16), dk = poisoned_device(c.kv_shape(), DType::BF16),
           dv = poisoned_device(c.kv_shape(), DType::BF16);
    attention_backward(gpu, d_out, q, k, v, out, lse, dq, dk, dv, c.options());
    expect_grads(r, dq, dk, dv, attention_backend_name(b));
    outs.push_back(cpu(out).to_doubles());
    const std::vector<std::string> log = attention_backend_choices();
    if (b == AttentionBackend::Auto) {
      ASSERT_EQ(log.size(), 1u) << "Auto decides once per shape and says so";
      EXPECT_NE(log[0].find("->"), std::string::npos) << log[0];
      std::printf("auto: %s\n", log[0].c_str());
    } else {
      EXPECT_TRUE(log.empty()) << "forced backends that can run the shape print nothing";
    }
  }
  EXPECT_LT(relative_error(outs[1], outs[0]), kTol) << "cuDNN vs tessera";
  EXPECT_LT(relative_error(outs[2], outs[0]), kTol) << "Auto vs tessera";

  // Forced cuDNN on shapes it cannot run: tessera runs them, with one note per shape.
  clear_attention_backend_choices();
  set_attention_backend(AttentionBackend::Cudnn);
  const Case odd{"bf16_D36", 1, 33, 33, 2, 2, 36, true};
  const Reference ro = reference(odd, DType::BF16, 4400);
  for (int call = 0; call < 2; ++call) {
    Tensor out = poisoned_device(odd.q_shape(), DType::BF16), lse = poisoned_device(odd.lse_shape(), DType::F32);
    attention_forward(gpu, ro.q.to(kCuda), ro.k.to(kCuda), ro.v.to(kCuda), out, lse, odd.options());
    EXPECT_LT(relative_error(cpu(out), ro.out), kTol);
  }
  const std::vector<std::string> log = attention_backend_choices();
  ASSERT_EQ(log.size(), 1u);
  EXPECT_NE(log[0].find("cannot run"), std::string::npos) << log[0];
}

#else

TEST(GpuAttentionCudnn, NeedsCudnn) {
  REQUIRE_GPU();
  GTEST_SKIP() << "this build has no cuDNN (TESSERA_WITH_CUDNN=0): skipping the cuDNN attention tests";
}

#endif  // TESSERA_WITH_CUDA && TESSERA_WITH_CUDNN

TEST(GpuAttentionCudnn, BackendNamesParse) {
  EXPECT_EQ(parse_attention_backend("auto"), AttentionBackend::Auto);
  EXPECT_EQ(parse_attention_backend("Tessera"), AttentionBackend::Tessera);
  EXPECT_EQ(parse_attention_backend("CUDNN"), AttentionBackend::Cudnn);
  EXPECT_STREQ(attention_backend_name(AttentionBackend::Cudnn), "cudnn");
  try {
    parse_attention_backend("flash");
    FAIL() << "a bad name must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected auto, tessera or cudnn"), std::string::npos) << e.what();
  }
}
