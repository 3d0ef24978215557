// CUDA attention (forward and backward) against the CPU reference: the tensor-core path
// (BF16, head dim 64 / 128) and the generic path (F32, F16, FP8, other head dims, F64 lse,
// unaligned views), with odd lengths (T = 1, 17, 130, 257), more keys than queries under
// the bottom-right causal mask, fewer keys than queries without it, GQA and MQA, custom
// and negative scales. Outputs are poisoned first (NaN), so an element a kernel forgets to
// write fails; dq, dk and dv must be overwritten. lse is compared too. Skipped (saying so)
// where no GPU is present. The tensor-core backward runs in both of its variants:
// deterministic (the default) and atomic (set_attention_deterministic(false), on Hopper the
// wgmma kernel and also the mma.sync one: dQ summed
// with FP32 atomics inside the dK/dV pass). Every tile shape of the tensor-core forward
// (attention_forward_fast's variants 1 .. kLastAttentionForwardVariant) is checked on each
// tensor-core case as well. The attention backend is forced to tessera here; cuDNN's path
// and the choice between the two are tested in tests/test_gpu_attention_cudnn.cpp.
#include <cmath>
#include <string>
#include <vector>

#include "tessera/core/allocator.h"
#include "tessera/ops/attention.h"
#include "tessera/train/config.h"
#include "gpu_testing.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/attention.h"
#include "backend/cuda/attention_bwd_variant.h"
#endif

using namespace tessera;
using namespace tessera::testing;

namespace {

// These tests are about tessera's own kernels: keep cuDNN (tests/test_gpu_attention_cudnn.cpp)
// out of the dispatch whatever TESSERA_ATTENTION_BACKEND says.
[[maybe_unused]] const bool kTesseraKernels = (set_attention_backend(AttentionBackend::Tessera), true);

struct Case {
  const char* name;
  int64_t batch, queries, keys, q_heads, kv_heads, head_dim;
  bool causal;
  float scale = 0;
  DType lse_dtype = DType::F32;

  Shape q_shape() const { return {batch, queries, q_heads, head_dim}; }
  Shape kv_shape() const { return {batch, keys, kv_heads, head_dim}; }
  Shape lse_shape() const { return {batch, q_heads, queries}; }
  AttentionOptions options() const { return AttentionOptions{causal, scale}; }
};

// The tensor-core path: BF16, D = 64 or 128.
const std::vector<Case> kFastCases = {
    {"mha_causal_T17", 2, 17, 17, 4, 4, 64, true},
    {"decode_T1_gqa", 2, 1, 300, 8, 2, 128, true},
    {"decode_T1_noncausal", 1, 1, 77, 4, 4, 64, false},
    {"kv_cache_T130_S257_gqa", 1, 130, 257, 8, 2, 128, true},
    {"mqa_causal_T257", 2, 257, 257, 4, 1, 64, true},
    {"fewer_keys_than_queries", 1, 257, 130, 2, 2, 128, false},
    {"noncausal_gqa_T200", 1, 200, 200, 4, 2, 128, false},
    {"custom_scale_T128", 2, 128, 128, 2, 2, 64, true, 0.3f},
    {"negative_scale_S300", 1, 64, 300, 2, 1, 64, true, -0.5f},
    {"multi_block_T512", 1, 512, 512, 4, 2, 128, true},
    {"multi_block_T513_S1000", 1, 513, 1000, 2, 2, 64, true},
    // Many key tiles per block (the 3-stage pipelines wrap around several times), D = 128.
    {"long_gqa_T700_S1100", 1, 700, 1100, 4, 2, 128, true},
    {"long_noncausal_T333_S901", 1, 333, 901, 2, 1, 128, false, -0.2f},
};

// The generic path: every other dtype and head dim.
const std::vector<Case> kGenericCases = {
    {"f32_causal_gqa_T17", 2, 17, 17, 4, 2, 64, true},
    {"f32_mqa_D40_S70", 1, 33, 70, 3, 1, 40, true},
    {"f32_decode_D5", 3, 1, 9, 2, 2, 5, false},
    {"f32_head_dim_200", 1, 9, 140, 2, 1, 200, true},
    {"f32_fewer_keys", 1, 12, 5, 2, 2, 16, false},
    {"f32_lse_f64", 1, 20, 31, 2, 2, 24, true, 0, DType::F64},
    {"bf16_D40", 1, 130, 130, 4, 2, 40, true},
    {"bf16_D128_lse_f64", 1, 17, 40, 2, 1, 128, true, 0, DType::F64},
};

double tolerance(DType t) {
  switch (t) {
    case DType::F32: return 1e-5;
    case DType::BF16:
    case DType::F16: return 1e-2;
    default: return 6e-2;  // FP8
  }
}

Tensor poisoned_on_gpu(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  poison(t);
  return t.to(Device::cuda());
}

Tensor cpu(const Tensor& t) { return t.to(Device::cpu()); }

// Forward and backward of one case in one dtype, GPU against CPU.
void check_case(const Case& c, DType dtype, uint64_t seed) {
  SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dtype));
  Context host = Context::cpu(), gpu = Context::cuda();
  const Device cuda = Device::cuda();
  const double tol = tolerance(dtype);
  const double lse_tol = dtype == DType::F32 ? 1e-5 : 1e-4;

  // q and k in [-2, 2] so that the softmax is far from flat.
  const Tensor q = random_tensor(c.q_shape(), dtype, seed, -2.0f, 2.0f);
  const Tensor k = random_tensor(c.kv_shape(), dtype, seed + 1, -2.0f, 2.0f);
  const Tensor v = random_tensor(c.kv_shape(), dtype, seed + 2);
  const Tensor d_out = random_tensor(c.q_shape(), dtype, seed + 3);

  Tensor out = Tensor::empty(c.q_shape(), dtype), lse = Tensor::empty(c.lse_shape(), c.lse_dtype);
  attention_forward(host, q, k, v, out, lse, c.options());

  Tensor g_out = poisoned_on_gpu(c.q_shape(), dtype), g_lse = poisoned_on_gpu(c.lse_shape(), c.lse_dtype);
  attention_forward(gpu, q.to(cuda), k.to(cuda), v.to(cuda), g_out, g_lse, c.options());
  EXPECT_LT(relative_error(cpu(g_out), out), tol) << "out";
  EXPECT_LT(relative_error(cpu(g_lse), lse), lse_tol) << "lse";
#if TESSERA_WITH_CUDA
  // Every tile shape of the tensor-core forward, not only the default one.
  if (cuda::attention_fast_path(g_out, g_out, g_lse, {})) {
    const float scale = c.scale != 0 ? c.scale : 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    for (int variant = 1; variant <= cuda::kLastAttentionForwardVariant; ++variant) {
      Tensor v_out = poisoned_on_gpu(c.q_shape(), dtype), v_lse = poisoned_on_gpu(c.lse_shape(), c.lse_dtype);
      cuda::attention_forward_fast(gpu.stream, q.to(cuda), k.to(cuda), v.to(cuda), v_out, v_lse, c.causal, scale,
                                   variant);
      EXPECT_LT(relative_error(cpu(v_out), out), tol) << "out, forward variant " << variant;
      EXPECT_LT(relative_error(cpu(v_lse), lse), lse_tol) << "lse, forward variant " << variant;
    }
  }
#endif

  // Backward from the CPU's out and lse on both sides, so only the backward is compared.
  Tensor dq = Tensor::empty(c.q_shape(), dtype), dk = Tensor::empty(c.kv_shape(), dtype),
         dv = Tensor::empty(c.kv_shape(), dtype);
  attention_backward(host, d_out, q, k, v, out, lse, dq, dk, dv, c.options());
  Tensor g_dq = poisoned_on_gpu(c.q_shape(), dtype), g_dk = poisoned_on_gpu(c.kv_shape(), dtype),
         g_dv = poisoned_on_gpu(c.kv_shape(), dtype);
  attention_backward(gpu, d_out.to(cuda), q.to(cuda), k.to(cuda), v.to(cuda), out.to(cuda), lse.to(cuda), g_dq, g_dk,
                     g_dv, c.options());
  EXPECT_LT(relative_error(cpu(g_dq), dq), tol) << "dq";
  EXPECT_LT(relative_error(cpu(g_dk), dk), tol) << "dk";
  EXPECT_LT(relative_error(cpu(g_dv), dv), tol) << "dv";
}

}  // namespace

// Deterministic (the default): on Hopper at D = 128 the dK/dV pass is the wgmma kernel; the
// second round runs the mma.sync dK/dV kernel that other GPUs (and D = 64) run.
TEST(GpuAttention, TensorCorePathMatchesTheCpuReference) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  for (const bool wgmma : {true, false}) {
    SCOPED_TRACE(wgmma ? "wgmma dK/dV (where the GPU has it)" : "mma.sync dK/dV");
    cuda::set_attention_backward_wgmma(wgmma);
    uint64_t seed = 700;
    for (const Case& c : kFastCases) check_case(c, DType::BF16, seed += 10);
  }
  cuda::set_attention_backward_wgmma(true);
#endif
}

// The Hopper forward's schedules alone (variants kWgmmaForwardVariant ..): on other GPUs they
// run variant 9. Small enough to run under compute-sanitizer (TMA, mbarriers, wgmma). Several
// key tiles per block (the two-stage ring wraps), partial tiles at both ends, GQA, a
// negative scale, both head dims.
TEST(GpuAttention, WgmmaForwardMatchesTheCpuReference) {
  REQUIRE_GPU();
#if TESSERA_WITH_CUDA
  const std::vector<Case> cases = {
      {"wgmma_causal_T300_gqa", 2, 300, 300, 4, 2, 128, true},
      {"wgmma_noncausal_T129_S600_neg", 1, 129, 600, 2, 1, 128, false, -0.3f},
      {"wgmma_causal_T70_S400", 1, 70, 400, 2, 2, 128, true},
      {"wgmma_causal_T257_d64", 1, 257, 257, 4, 4, 64, true},
  };
  Context host = Context::cpu(), gpu = Context::cuda();
  const Device cuda = Device::cuda();
  uint64_t seed = 5100;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Tensor q = random_tensor(c.q_shape(), DType::BF16, seed += 10, -2.0f, 2.0f);
    const Tensor k = random_tensor(c.kv_shape(), DType::BF16, seed + 1, -2.0f, 2.0f);
    const Tensor v = random_tensor(c.kv_shape(), DType::BF16, seed + 2);
    Tensor out = Tensor::empty(c.q_shape(), DType::BF16), lse = Tensor::empty(c.lse_shape(), DType::F32);
    attention_forward(host, q, k, v, out, lse, c.options());
    const float scale = c.scale != 0 ? c.scale : 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    for (int variant = cuda::kWgmmaForwardVariant; variant <= cuda::kLastAttentionForwardVariant; ++variant) {
      Tensor g_out = poisoned_on_gpu(c.q_shape(), DType::BF16), g_lse = poisoned_on_gpu(c.lse_shape(), DType::F32);
      cuda::attention_forward_fast(gpu.stream, q.to(cuda), k.to(cuda), v.to(cuda), g_out, g_lse, c.causal, scale,
                                   variant);
      EXPECT_LT(relative_error(cpu(g_out), out), 1e-2) << "out, variant " << variant;
      EXPECT_LT(relative_error(cpu(g_lse), lse), 1e-4) << "lse, variant " << variant;
    }
  }
#endif
}

// Sets attention_deterministic() for a scope and restores it afterwards (failing assertions too).
struct DeterministicScope {
  bool saved = attention_deterministic();
  explicit DeterministicScope(bool value) { set_attention_deterministic(value); }
  ~DeterministicScope() { set_attention_deterministic(saved); }
};

// More shapes for the atomic variant: a dQ row block summed over several key blocks (S >
// 128), several query tiles per key block, odd lengths on both sides, partial key blocks.
const std::vector<Case> kAtomicExtraCases = {
    {"atomic_causal_T1000_gqa", 1, 1000, 1000, 8, 2, 128, true},
    {"atomic_noncausal_T333_S517", 1, 333, 517, 4, 4, 64, false},
    {"atomic_causal_T77_S901_mqa", 2, 77, 901, 4, 1, 128, true},
    {"atomic_noncausal_T129_S129_gqa", 2, 129, 129, 6, 3, 64, false},
    {"atomic_causal_T385_S385", 1, 385, 385, 2, 2, 64, true},
    {"atomic_noncausal_T500_S64", 1, 500, 64, 2, 1, 128, false},
};

// Both atomic kernels: the Hopper wgmma one (attention_bwd_wgmma.cu, the default where the
// GPU has it; elsewhere this runs the mma.sync one twice) and the mma.sync one.
TEST(GpuAttention, AtomicDqBackwardMatchesTheCpuReference) {
  REQUIRE_GPU();
  const DeterministicScope atomic(false);
#if TESSERA_WITH_CUDA
  for (const bool wgmma : {true, false}) {
    SCOPED_TRACE(wgmma ? "wgmma backward (where the GPU has it)" : "mma.sync backward");
    cuda::set_attention_backward_wgmma(wgmma);
    uint64_t seed = 1700;
    for (const Case& c : kFastCases) check_case(c, DType::BF16, seed += 10);
    for (const Case& c : kAtomicExtraCases) check_case(c, DType::BF16, seed += 10);
  }
  cuda::set_attention_backward_wgmma(true);
#endif
}

// The setting only concerns the tensor-core kernel: the generic path is right either way.
TEST(GpuAttention, AtomicSettingLeavesTheGenericPathRight) {
  REQUIRE_GPU();
  const DeterministicScope atomic(false);
  check_case({"f32_causal_gqa_T17", 2, 17, 17, 4, 2, 64, true}, DType::F32, 1800);
  check_case({"bf16_D40", 1, 130, 130, 4, 2, 40, true}, DType::BF16, 1810);
}

// No GPU needed: the setting's default and the training config key that sets it.
TEST(GpuAttention, DeterministicIsTheDefaultAndAConfigKey) {
  EXPECT_TRUE(attention_deterministic());
  {
    const DeterministicScope atomic(false);
    EXPECT_FALSE(attention_deterministic());
  }
  EXPECT_TRUE(attention_deterministic());
  EXPECT_TRUE(train::RunConfig::from_json(nlohmann::json::object()).training.deterministic_attention);
  nlohmann::json j;
  j["training"]["deterministic_attention"] = false;
  const train::RunConfig c = train::RunConfig::from_json(j);
  EXPECT_FALSE(c.training.deterministic_attention);
  EXPECT_FALSE(c.to_json()["training"]["deterministic_attention"].get<bool>());
  j["training"]["deterministic_attention"] = "sometimes";
  EXPECT_THROW(train::RunConfig::from_json(j), Error);
}

TEST(GpuAttention, GenericPathMatchesTheCpuReference) {
  REQUIRE_GPU();
  uint64_t seed = 900;
  for (const Case& c : kGenericCases) {
    const DType dtype = std::string(c.name).rfind("bf16", 0) == 0 ? DType::BF16 : DType::F32;
    check_case(c, dtype, seed += 10);
  }
}

TEST(GpuAttention, HalfAndFp8RunOnTheGenericPath) {
  REQUIRE_GPU();
  const Case c{"small_gqa_causal", 1, 13, 21, 4, 2, 32, true};
  uint64_t seed = 1100;
  for (DType t : {DType::F16, DType::E4M3, DType::E5M2}) check_case(c, t, seed += 10);
}

// A view 2 bytes past an allocation's start is not 16-byte aligned: it must take the
// generic path and still be right.
TEST(GpuAttention, UnalignedBf16ViewsTakeTheGenericPath) {
  REQUIRE_GPU();
  Context host = Context::cpu(), gpu = Context::cuda();
  const Case c{"unaligned", 1, 20, 20, 2, 2, 64, true};
  const Tensor q = random_tensor(c.q_shape(), DType::BF16, 1200, -2.0f, 2.0f);
  const Tensor k = random_tensor(c.kv_shape(), DType::BF16, 1201, -2.0f, 2.0f);
  const Tensor v = random_tensor(c.kv_shape(), DType::BF16, 1202);
  Tensor out = Tensor::empty(c.q_shape(), DType::BF16), lse = Tensor::empty(c.lse_shape(), DType::F32);
  attention_forward(host, q, k, v, out, lse, c.options());

  Tensor big = Tensor::zeros({q.numel() + 1}, DType::BF16, Device::cuda());
  Tensor q_view = big.slice(0, 1, q.numel() + 1).reshape(c.q_shape());
  q_view.copy_from(q.to(Device::cuda()));
  Tensor g_out = poisoned_on_gpu(c.q_shape(), DType::BF16), g_lse = poisoned_on_gpu(c.lse_shape(), DType::F32);
  attention_forward(gpu, q_view, k.to(Device::cuda()), v.to(Device::cuda()), g_out, g_lse, c.options());
  EXPECT_LT(relative_error(cpu(g_out), out), 1e-2);
  EXPECT_LT(relative_error(cpu(g_lse), lse), 1e-4);
}

// No queries: dk and dv must still be overwritten (with zeros).
TEST(GpuAttention, NoQueriesGivesZeroKeyGradients) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  for (DType t : {DType::BF16, DType::F32}) {
    const Shape q_shape{2, 0, 4, 64}, kv_shape{2, 9, 2, 64};
    Tensor q = Tensor::zeros(q_shape, t, Device::cuda()), d_out = q, out = q, dq = q;
    Tensor k = random_tensor(kv_shape, t, 1300).to(Device::cuda()), v = k;
    Tensor lse = Tensor::zeros({2, 4, 0}, DType::F32, Device::cuda());
    Tensor dk = poisoned_on_gpu(kv_shape, t), dv = poisoned_on_gpu(kv_shape, t);
    attention_backward(gpu, d_out, q, k, v, out, lse, dq, dk, dv, AttentionOptions{true, 0});
    for (double x : cpu(dk).to_doubles()) ASSERT_EQ(x, 0.0) << dtype_name(t);
    for (double x : cpu(dv).to_doubles()) ASSERT_EQ(x, 0.0) << dtype_name(t);
  }
}

// A NaN in one query row makes that row's output and lse NaN, and no other row's.
TEST(GpuAttention, NanQueryRowStaysNan) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  for (DType t : {DType::BF16, DType::F32}) {
    const Case c{"nan", 1, 5, 5, 2, 2, 64, true};
    Tensor q = random_tensor(c.q_shape(), t, 1400);
    q.set_item(0, NAN);  // (b 0, t 0, h 0)
    const Tensor k = random_tensor(c.kv_shape(), t, 1401), v = random_tensor(c.kv_shape(), t, 1402);
    Tensor out = poisoned_on_gpu(c.q_shape(), t), lse = poisoned_on_gpu(c.lse_shape(), DType::F32);
    attention_forward(gpu, q.to(Device::cuda()), k.to(Device::cuda()), v.to(Device::cuda()), out, lse,
                      c.options());
    const std::vector<double> o = cpu(out).to_doubles(), l = cpu(lse).to_doubles();
    EXPECT_TRUE(std::isnan(o[0])) << dtype_name(t);
    EXPECT_TRUE(std::isnan(l[0])) << dtype_name(t);
    for (size_t i = 64; i < o.size(); ++i) ASSERT_FALSE(std::isnan(o[i])) << dtype_name(t) << " element " << i;
    for (size_t i = 1; i < l.size(); ++i) ASSERT_FALSE(std::isnan(l[i])) << dtype_name(t) << " lse " << i;
#if TESSERA_WITH_CUDA
    // The same in every tile shape of the tensor-core forward (the online max ignores NaN;
    // the row's exponentials and sum must not).
    if (t != DType::BF16) continue;
    for (int variant = 1; variant <= cuda::kLastAttentionForwardVariant; ++variant) {
      Tensor v_out = poisoned_on_gpu(c.q_shape(), t), v_lse = poisoned_on_gpu(c.lse_shape(), DType::F32);
      cuda::attention_forward_fast(gpu.stream, q.to(Device::cuda()), k.to(Device::cuda()), v.to(Device::cuda()),
                                   v_out, v_lse, c.causal, 0.125f, variant);
      const std::vector<double> vo = cpu(v_out).to_doubles(), vl = cpu(v_lse).to_doubles();
      EXPECT_TRUE(std::isnan(vo[0])) << "variant " << variant;
      EXPECT_TRUE(std::isnan(vl[0])) << "variant " << variant;
      for (size_t i = 64; i < vo.size(); ++i)
        ASSERT_FALSE(std::isnan(vo[i])) << "variant " << variant << " element " << i;
      for (size_t i = 1; i < vl.size(); ++i) ASSERT_FALSE(std::isnan(vl[i])) << "variant " << variant << " lse " << i;
    }
#endif
  }
}

// Every gradient element has one writer, so the backward is bitwise repeatable.
TEST(GpuAttention, BackwardIsDeterministic) {
  REQUIRE_GPU();
  const DeterministicScope deterministic(true);
  Context gpu = Context::cuda();
  const Case c{"det", 1, 300, 300, 8, 2, 128, true};
  const Device cuda = Device::cuda();
  const Tensor q = random_tensor(c.q_shape(), DType::BF16, 1500).to(cuda);
  const Tensor k = random_tensor(c.kv_shape(), DType::BF16, 1501).to(cuda);
  const Tensor v = random_tensor(c.kv_shape(), DType::BF16, 1502).to(cuda);
  const Tensor d_out = random_tensor(c.q_shape(), DType::BF16, 1503).to(cuda);
  Tensor out = Tensor::empty(c.q_shape(), DType::BF16, cuda), lse = Tensor::empty(c.lse_shape(), DType::F32, cuda);
  attention_forward(gpu, q, k, v, out, lse, c.options());
  std::vector<std::vector<double>> first;
  for (int run = 0; run < 2; ++run) {
    Tensor dq = poisoned_on_gpu(c.q_shape(), DType::BF16), dk = poisoned_on_gpu(c.kv_shape(), DType::BF16),
           dv = poisoned_on_gpu(c.kv_shape(), DType::BF16);
    attention_backward(gpu, d_out, q, k, v, out, lse, dq, dk, dv, c.options());
    const std::vector<std::vector<double>> got = {cpu(dq).to_doubles(), cpu(dk).to_doubles(), cpu(dv).to_doubles()};
    if (run == 0) first = got;
    else
      for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i] == first[i]) << "gradient " << i << " differs";
  }
}

// The atomic variant: dK and dV still have one writer each (bitwise repeatable); dQ may
// differ in its last bits between runs but stays close to the deterministic variant's.
TEST(GpuAttention, AtomicBackwardAgreesWithTheDeterministicOne) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const Case c{"atomic_vs_det", 2, 700, 700, 8, 2, 128, true};
  const Device cuda = Device::cuda();
  const Tensor q = random_tensor(c.q_shape(), DType::BF16, 1600, -2.0f, 2.0f).to(cuda);
  const Tensor k = random_tensor(c.kv_shape(), DType::BF16, 1601, -2.0f, 2.0f).to(cuda);
  const Tensor v = random_tensor(c.kv_shape(), DType::BF16, 1602).to(cuda);
  const Tensor d_out = random_tensor(c.q_shape(), DType::BF16, 1603).to(cuda);
  Tensor out = Tensor::empty(c.q_shape(), DType::BF16, cuda), lse = Tensor::empty(c.lse_shape(), DType::F32, cuda);
  attention_forward(gpu, q, k, v, out, lse, c.options());
  std::vector<Tensor> runs;  // dq, dk, dv of: deterministic, atomic, atomic
  for (const bool deterministic : {true, false, false}) {
    const DeterministicScope scope(deterministic);
    Tensor dq = poisoned_on_gpu(c.q_shape(), DType::BF16), dk = poisoned_on_gpu(c.kv_shape(), DType::BF16),
           dv = poisoned_on_gpu(c.kv_shape(), DType::BF16);
    attention_backward(gpu, d_out, q, k, v, out, lse, dq, dk, dv, c.options());
    runs.insert(runs.end(), {cpu(dq), cpu(dk), cpu(dv)});
  }
  EXPECT_LT(relative_error(runs[3], runs[0]), 1e-2) << "dq, atomic against deterministic";
  EXPECT_LT(relative_error(runs[6], runs[0]), 1e-2) << "dq, second atomic run against deterministic";
  // dK and dV come from the same per-warp register sums in both variants (one writer each).
  EXPECT_LT(relative_error(runs[4], runs[1]), 1e-2) << "dk, atomic against deterministic";
  EXPECT_LT(relative_error(runs[5], runs[2]), 1e-2) << "dv, atomic against deterministic";
  EXPECT_TRUE(runs[7].to_doubles() == runs[4].to_doubles()) << "dk differs between atomic runs";
  EXPECT_TRUE(runs[8].to_doubles() == runs[5].to_doubles()) << "dv differs between atomic runs";
}

TEST(GpuAttention, F64HasNoCudaKernel) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const Device cuda = Device::cuda();
  Tensor q = Tensor::zeros({1, 2, 1, 4}, DType::F64, cuda), k = q, v = q;
  Tensor out = Tensor::empty({1, 2, 1, 4}, DType::F64, cuda), lse = Tensor::empty({1, 1, 2}, DType::F64, cuda);
  EXPECT_THROW(attention_forward(gpu, q, k, v, out, lse), Error);
}

// Head slices of one fused QKV buffer through the op front end, with gradients written into
// slices of a fused gradient, on each backend: the same results as the CPU reference.
TEST(GpuAttention, FusedQkvViewsMatchTheCpuReference) {
  REQUIRE_GPU();
  Context gpu = Context::cuda(), host = Context::cpu();
  const int64_t B = 2, T = 130, hq = 8, hkv = 2, D = 64;
  const Tensor fused = random_tensor({B, T, hq + 2 * hkv, D}, DType::BF16, 77, -2, 2);
  const Tensor d_out = random_tensor({B, T, hq, D}, DType::BF16, 78);
  const auto slices = [&](const Tensor& f) {
    return std::vector<Tensor>{f.slice(2, 0, hq), f.slice(2, hq, hq + hkv), f.slice(2, hq + hkv, hq + 2 * hkv)};
  };
  const AttentionOptions options{.causal = true};
  const std::vector<Tensor> qkv_cpu = slices(fused);
  Tensor out_cpu = Tensor::empty({B, T, hq, D}, DType::BF16), lse_cpu = Tensor::empty({B, hq, T}, DType::F32);
  attention_forward(host, qkv_cpu[0], qkv_cpu[1], qkv_cpu[2], out_cpu, lse_cpu, options);
  Tensor d_fused_cpu = Tensor::zeros({B, T, hq + 2 * hkv, D}, DType::BF16);
  std::vector<Tensor> d_cpu = slices(d_fused_cpu);
  attention_backward(host, d_out, qkv_cpu[0], qkv_cpu[1], qkv_cpu[2], out_cpu, lse_cpu, d_cpu[0], d_cpu[1], d_cpu[2],
                     options);
  for (const AttentionBackend backend : {AttentionBackend::Tessera, AttentionBackend::Cudnn}) {
    set_attention_backend(backend);
    const Tensor fused_gpu = fused.to(kCuda);
    const std::vector<Tensor> qkv = slices(fused_gpu);
    Tensor out = poisoned_on_gpu({B, T, hq, D}, DType::BF16), lse = poisoned_on_gpu({B, hq, T}, DType::F32);
    attention_forward(gpu, qkv[0], qkv[1], qkv[2], out, lse, options);
    Tensor d_fused = poisoned_on_gpu({B, T, hq + 2 * hkv, D}, DType::BF16);
    std::vector<Tensor> d = slices(d_fused);
    attention_backward(gpu, d_out.to(kCuda), qkv[0], qkv[1], qkv[2], out, lse, d[0], d[1], d[2], options);
    const std::string what = attention_backend_name(backend);
    EXPECT_LT(relative_error(cpu(out), out_cpu), tolerance(DType::BF16)) << what;
    EXPECT_LT(relative_error(cpu(d_fused), d_fused_cpu), tolerance(DType::BF16)) << what;
  }
  set_attention_backend(AttentionBackend::Tessera);
}
