// The one-launch FP8 casts of the MoE expert weights (backend/cuda/moe_weight_cast.cu, taken
// by moe_fp8_quantize_weights on CUDA) against the per-expert loop they replace (amax, scale,
// quantize_with_transpose per expert; set_moe_fp8_legacy_weight_cast): codes, transposed codes,
// scales and scale reciprocals byte for byte, with an expert without rows, an expert of all
// zeros and experts holding NaN / Inf; both FP8 formats (the kernels directly: the op casts
// weights to E4M3 only), power-of-two scales and a margin; the scale pointers 16-byte aligned
// (cuBLASLt's rule); and an FP8 GroupedLinear forward + backward equal to the legacy casts'
// bit for bit. Skipped where no GPU is present.
#include <cmath>

#include "gpu_testing.h"
#include "tessera/fp8/device_scaling.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/nn/moe.h"
#include "tessera/ops/moe.h"
#include "tessera/ops/quantize.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/moe_weight_cast.h"
#endif

using namespace tessera;
using namespace tessera::testing;

namespace {

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0; }

// Random BF16 experts [E, N, K] on the host: expert 3 all zeros, expert 4 with a NaN, expert 5
// with an Inf (when there are that many), expert 2 ten times wider than the rest.
Tensor weights(int64_t e, int64_t n, int64_t k, uint64_t seed) {
  Tensor w = random_tensor({e, n, k}, DType::BF16, seed, -0.5f, 0.5f);
  if (e > 2) w.select(0, 2).copy_from(random_tensor({n, k}, DType::BF16, seed + 1, -5.0f, 5.0f));
  if (e > 3) w.select(0, 3).fill_zero();
  if (e > 4) w.set_item(4 * n * k + 7, NAN);
  if (e > 5) w.set_item(5 * n * k + n * k / 2, INFINITY);
  return w;
}

// The per-expert loop and the one-launch casts of the same weights, entry by entry.
void expect_same_casts(const MoEFp8Weights& got, const MoEFp8Weights& want, bool keep, const std::string& what) {
  ASSERT_EQ(got.experts.size(), want.experts.size()) << what;
  for (size_t e = 0; e < want.experts.size(); ++e) {
    const std::string where = what + ", expert " + std::to_string(e);
    const fp8::QuantizedTensor &g = got.experts[e], &w = want.experts[e];
    ASSERT_EQ(g.data.defined(), w.data.defined()) << where;
    if (!w.data.defined()) {
      EXPECT_FALSE(got.scales[e].defined()) << where << ": an expert without rows is not cast";
      continue;
    }
    EXPECT_EQ(g.dtype, w.dtype) << where;
    EXPECT_EQ(g.data.shape(), w.data.shape()) << where;
    EXPECT_EQ(bytes_of(g.data), bytes_of(w.data)) << where << ": data";
    EXPECT_EQ(bytes_of(g.scale_inv), bytes_of(w.scale_inv)) << where << ": scale_inv";
    EXPECT_EQ(bytes_of(got.scales[e]), bytes_of(want.scales[e])) << where << ": scale";
    EXPECT_EQ(g.scale_inv.shape(), Shape{1}) << where;
    EXPECT_TRUE(aligned16(g.scale_inv) && aligned16(got.scales[e])) << where << ": cuBLASLt wants aligned scales";
    if (keep) {
      ASSERT_TRUE(g.data_t.defined()) << where;
      EXPECT_EQ(bytes_of(g.data_t), bytes_of(w.data_t)) << where << ": data_t";
    } else {
      EXPECT_FALSE(g.data_t.defined()) << where << ": the transpose is not computed unless kept";
    }
  }
}

MoEFp8Weights cast_weights(Context& ctx, const Tensor& w, const std::vector<int64_t>& splits, const MoEFp8Options& o,
                           bool legacy) {
  const bool before = moe_fp8_legacy_weight_cast();
  set_moe_fp8_legacy_weight_cast(legacy);
  MoEFp8Weights q = moe_fp8_quantize_weights(ctx, w, splits, o);
  set_moe_fp8_legacy_weight_cast(before);
  return q;
}

}  // namespace

TEST(GpuMoeWeightCast, OneLaunchCastsEqualThePerExpertLoop) {
  REQUIRE_GPU();
  Context gpu = Context::cuda(), cpu = Context::cpu();
  uint64_t seed = 3100;
  struct Case {
    int64_t e, n, k;
    std::vector<int64_t> splits;
  };
  // Partial tiles in both dimensions; one shape large enough for several grid-stride steps.
  const std::vector<Case> cases = {{6, 200, 136, {5, 0, 9, 3, 1, 2}},
                                   {6, 48, 80, {0, 7, 1, 1, 1, 1}},
                                   {1, 16, 8, {4}},
                                   {3, 1024, 2048, {1, 1, 0}},
                                   {4, 24, 64, {0, 0, 0, 0}}};
  for (const Case& c : cases) {
    const Tensor host = weights(c.e, c.n, c.k, seed++);
    const Tensor w = host.to(kCuda);
    for (bool keep : {false, true})
      for (bool p2 : {false, true})
        for (float margin : {0.0f, 1.5f}) {
          MoEFp8Options o;
          o.keep_weight_transpose = keep;
          o.power_of_two_scales = p2;
          o.margin = margin;
          const std::string what = "w " + shape_to_string(host.shape()) + (keep ? " keep" : "") +
                                   (p2 ? " pow2" : "") + " margin " + std::to_string(margin);
          const MoEFp8Weights want = cast_weights(gpu, w, c.splits, o, true);
          const MoEFp8Weights got = cast_weights(gpu, w, c.splits, o, false);
          expect_same_casts(got, want, keep, what);
          // And the CPU's codes (margin 0: no exp2f, whose last bit may differ host / device).
          if (margin == 0.0f && c.n * c.k <= 200 * 136) {
            const MoEFp8Weights ref = moe_fp8_quantize_weights(cpu, host, c.splits, o);
            for (size_t e = 0; e < ref.experts.size(); ++e) {
              if (!ref.experts[e].data.defined()) continue;
              EXPECT_EQ(bytes_of(got.experts[e].data), bytes_of(ref.experts[e].data)) << what << " vs CPU " << e;
              EXPECT_EQ(bytes_of(got.scales[e]), bytes_of(ref.scales[e])) << what << " vs CPU, expert " << e;
            }
          }
        }
  }
}

#if TESSERA_WITH_CUDA
// Both formats through the kernels themselves, against amax, scale_from_amax and
// quantize_with_transpose of each listed expert.
TEST(GpuMoeWeightCast, KernelsEqualThePerExpertOpsInBothFormats) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const int64_t e = 6, n = 136, k = 264;
  const Tensor w = weights(e, n, k, 3200).to(kCuda);
  ASSERT_TRUE(cuda::moe_weight_cast_supported(w, true));
  const std::vector<int64_t> experts = {0, 2, 3, 4, 5};
  const int64_t a = static_cast<int64_t>(experts.size());
  for (DType fp8 : {DType::E4M3, DType::E5M2})
    for (bool p2 : {false, true})
      for (bool transposed : {false, true}) {
        const std::string what = std::string(dtype_name(fp8)) + (p2 ? " pow2" : "") + (transposed ? " +T" : "");
        Tensor amax_t = poisoned_device({a}, DType::F32), scale = poisoned_device({4 * a}, DType::F32);
        Tensor scale_inv = poisoned_device({4 * a}, DType::F32), data = poisoned_device({a, n, k}, fp8);
        Tensor data_t = transposed ? poisoned_device({a, k, n}, fp8) : Tensor();
        cuda::moe_weight_amax(gpu.stream, w, experts, amax_t);
        cuda::moe_weight_scales(gpu.stream, amax_t, fp8_max(fp8), 0.5f, p2, scale, scale_inv);
        cuda::moe_weight_cast(gpu.stream, w, scale, experts, data, data_t);
        for (int64_t i = 0; i < a; ++i) {
          const std::string where = what + ", expert " + std::to_string(experts[i]);
          const Tensor we = w.select(0, experts[i]);
          Tensor am = Tensor::empty({1}, DType::F32, kCuda), sc = Tensor::empty({1}, DType::F32, kCuda);
          amax(gpu, we, am);
          fp8::scale_from_amax(gpu, am, fp8, 0.5f, p2, sc);
          const fp8::QuantizedTensor q = fp8::quantize_with_transpose(gpu, we, sc, fp8);
          EXPECT_EQ(bytes_of(amax_t.slice(0, i, i + 1)), bytes_of(am)) << where << ": amax";
          EXPECT_EQ(bytes_of(scale.slice(0, 4 * i, 4 * i + 1)), bytes_of(sc)) << where << ": scale";
          EXPECT_EQ(bytes_of(scale_inv.slice(0, 4 * i, 4 * i + 1)), bytes_of(q.scale_inv)) << where << ": scale_inv";
          EXPECT_EQ(bytes_of(data.select(0, i)), bytes_of(q.data)) << where << ": data";
          if (transposed) {
            EXPECT_EQ(bytes_of(data_t.select(0, i)), bytes_of(q.data_t)) << where << ": data_t";
          }
        }
      }
}
#endif

TEST(GpuMoeWeightCast, Fp8GroupedLinearEqualsTheLegacyCastsBitForBit) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  uint64_t seed = 3300;
  const int64_t e = 5, in = 96, out = 80, rows = 230;
  const std::vector<std::vector<int64_t>> split_sets = {{3, 0, 130, 0, 1}, {32, 48, 64, 48, 32}, {0, 0, 0, 0, 0}};
  for (const auto& splits : split_sets)
    for (bool keep : {false, true}) {
      const Tensor w = random_tensor({e * out, in}, DType::BF16, seed++, -0.5f, 0.5f);
      const Tensor g0 = random_tensor({e * out, in}, DType::F32, seed++);
      const Tensor x = random_tensor({rows, in}, DType::BF16, seed++).to(kCuda);
      const Tensor dy = random_tensor({rows, out}, DType::BF16, seed++).to(kCuda);
      struct Run {
        Tensor y, dx, dw;
      };
      auto run = [&](bool legacy) {
        nn::GroupedLinear l("g", e, in, out, DType::BF16);
        EXPECT_EQ(l.weight.value.shape(), w.shape());
        l.weight.value.copy_from(w);
        l.weight.grad.copy_from(g0);
        l.weight.to(kCuda);
        MoEFp8Options o;
        o.keep_weight_transpose = keep;
        l.use_fp8(o);
        const bool before = moe_fp8_legacy_weight_cast();
        set_moe_fp8_legacy_weight_cast(legacy);
        nn::GroupedLinear::Fp8Saved saved;
        Run r;
        r.y = l.forward_fp8(gpu, moe_fp8_quantize_rows(gpu, x, splits, DType::E4M3, o), saved);
        r.dx = l.backward_input_fp8(gpu, dy, saved);
        l.backward_weight_fp8(gpu, saved);
        set_moe_fp8_legacy_weight_cast(before);
        r.dw = l.weight.grad;
        return r;
      };
      Run legacy, now;
      legacy = run(true);
      now = run(false);
      const std::string what = std::string(keep ? "keep" : "re-cast") + ", rows in experts " +
                               std::to_string(splits[0]) + "," + std::to_string(splits[2]);
      EXPECT_EQ(bytes_of(now.y), bytes_of(legacy.y)) << what << ": y";
      EXPECT_EQ(bytes_of(now.dx), bytes_of(legacy.dx)) << what << ": dx";
      EXPECT_EQ(bytes_of(now.dw), bytes_of(legacy.dw)) << what << ": dw";
    }
}
