// The MoE scaled SwiGLU kernels (backend/cuda/moe_swiglu.cu) on the GPU: the vector kernels
// and the scalar fallback (F32, F % 8 != 0, misaligned rows) against the CPU reference; the
// vector kernels bit-identical to the legacy scalar ones in y and dx (TESSERA_MOE_LEGACY's
// switch); the FP8 backward (two passes, dx never stored) byte-identical to the unfused path
// (BF16 dx, then the cast), with random splits and experts without rows; and GroupedMLP's
// FP8 backward with the fused pair against the unfused one. Skipped where no GPU is present.
#include <cmath>

#include "gpu_testing.h"
#include "tessera/nn/moe.h"
#include "tessera/ops/moe.h"
#include "tessera/ops/quantize.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// Switches the legacy kernels on or off for a scope.
struct LegacyScope {
  bool before;
  explicit LegacyScope(bool on) : before(moe_swiglu_legacy()) { set_moe_swiglu_legacy(on); }
  ~LegacyScope() { set_moe_swiglu_legacy(before); }
};

struct Outputs {
  Tensor y, dx, d_scale, amax;
};

// Forward and backward (with the amax) of x [M, 2F] on ctx's device, outputs poisoned first.
Outputs run(Context& ctx, const Tensor& x, const Tensor& sc, const Tensor& dy, bool misaligned = false) {
  const int64_t m = x.size(0), f = x.size(1) / 2;
  const bool gpu = ctx.device.is_cuda();
  auto out = [&](const Shape& s, DType t) { return gpu ? poisoned_device(s, t, misaligned) : Tensor::empty(s, t); };
  auto in = [&](const Tensor& t) { return gpu ? to_device(t, misaligned) : t; };
  Outputs o{out({m, f}, x.dtype()), out({m, 2 * f}, x.dtype()), out({m}, sc.dtype()), out({1}, DType::F32)};
  const Tensor xd = in(x), sd = in(sc), dyd = in(dy);
  moe_swiglu_scaled_forward(ctx, xd, sd, o.y);
  moe_swiglu_scaled_backward(ctx, xd, sd, dyd, o.dx, o.d_scale, &o.amax);
  for (Tensor* t : {&o.y, &o.dx, &o.d_scale, &o.amax}) *t = t->to(Device::cpu());
  return o;
}

double tol_of(DType t) { return t == DType::BF16 ? 1e-2 : 1e-5; }

}  // namespace

TEST(GpuMoeSwiglu, KernelsMatchTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 5000;
  // F = 8, 48, 1000, 14336: the vector kernels for BF16 (14336: the row loop runs twice,
  // the second time partly); F = 7, 1004: the scalar fallback (F % 8 != 0); M = 0.
  const std::vector<Shape> shapes = {{1, 16}, {37, 96}, {300, 2000}, {5, 2 * 14336}, {9, 14}, {17, 2008}, {0, 96}};
  for (DType t : {DType::BF16, DType::F32})
    for (const Shape& s : shapes)
      for (bool misaligned : {false, true}) {
        Tensor x = random_tensor(s, t, seed++, -4, 4);
        const Tensor sc = random_tensor({s[0]}, DType::F32, seed++, 0, 1);
        const Tensor dy = random_tensor({s[0], s[1] / 2}, t, seed++);
        if (s[0] > 2) x.slice(0, 1, 2).fill_zero();  // a row of zeros: y, dx, d_scale 0 there
        const Outputs want = run(cpu, x, sc, dy), got = run(gpu, x, sc, dy, misaligned);
        const std::string what = std::string(dtype_name(t)) + " " + shape_to_string(s) + (misaligned ? " misaligned" : "");
        EXPECT_LT(relative_error(got.y, want.y), tol_of(t)) << what;
        EXPECT_LT(relative_error(got.dx, want.dx), tol_of(t)) << what;
        EXPECT_LT(relative_error(got.d_scale, want.d_scale), 1e-5) << what;
        EXPECT_NEAR(got.amax.item(0), want.amax.item(0), tol_of(t) * want.amax.item(0)) << what;
        if (s[0] > 2) {
          EXPECT_EQ(got.d_scale.item(1), 0.0) << what;
          EXPECT_EQ(got.y.slice(0, 1, 2).to_doubles(), std::vector<double>(s[1] / 2, 0.0)) << what;
        }
        // The amax is the one of the stored dx, exactly.
        Tensor a = Tensor::empty({1}, DType::F32);
        amax(cpu, got.dx, a);
        if (s[0] > 0) {
          EXPECT_EQ(got.amax.item(0), a.item(0)) << what;
        }
      }
}

TEST(GpuMoeSwiglu, VectorKernelsAreBitIdenticalToTheLegacyOnes) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  uint64_t seed = 5100;
  for (const Shape& s : {Shape{1, 16}, Shape{37, 96}, Shape{300, 2000}, Shape{5, 2 * 14336}}) {
    Tensor x = random_tensor(s, DType::BF16, seed++, -6, 6);
    x.set_item(3, NAN);  // row 0: NaN in y, dx and d_scale, the same bits either way
    x.set_item(s[1] / 2 - 1, INFINITY);
    const Tensor sc = random_tensor({s[0]}, DType::F32, seed++, 0, 1);
    const Tensor dy = random_tensor({s[0], s[1] / 2}, DType::BF16, seed++, -2, 2);
    Outputs fresh, legacy;
    {
      LegacyScope on(false);
      fresh = run(gpu, x, sc, dy);
    }
    {
      LegacyScope on(true);
      legacy = run(gpu, x, sc, dy);
    }
    EXPECT_EQ(bytes_of(fresh.y), bytes_of(legacy.y)) << shape_to_string(s);
    EXPECT_EQ(bytes_of(fresh.dx), bytes_of(legacy.dx)) << shape_to_string(s);
    EXPECT_EQ(bytes_of(fresh.amax), bytes_of(legacy.amax)) << shape_to_string(s);
    // d_scale: the same terms summed in another order (row 0 NaN in both).
    EXPECT_TRUE(std::isnan(fresh.d_scale.item(0)) && std::isnan(legacy.d_scale.item(0)));
    if (s[0] > 1) {
      EXPECT_LT(relative_error(fresh.d_scale.slice(0, 1, s[0]), legacy.d_scale.slice(0, 1, s[0])), 1e-5);
    }
    // And the same bits from one run to the next.
    LegacyScope off(false);
    const Outputs again = run(gpu, x, sc, dy);
    EXPECT_EQ(bytes_of(again.d_scale), bytes_of(fresh.d_scale)) << shape_to_string(s);
  }
}

namespace {

const std::vector<std::vector<int64_t>> kSplits = {
    {3, 0, 130, 0, 1}, {0, 0, 0, 0, 200}, {32, 48, 64, 48, 32}, {0, 0, 0, 0, 0}, {17, 33, 1, 15, 16}};

}  // namespace

TEST(GpuMoeSwiglu, Fp8BackwardIsTheUnfusedPathByteForByte) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 5200;
  MoEFp8Options o;
  o.margin = 1;  // any scale works: the two paths must agree on it
  // F = 16, 48, 1000: the fused pair; 12: the composition on the GPU (F % 8 != 0).
  for (const auto& splits : kSplits)
    for (int64_t f : {int64_t{16}, int64_t{48}, int64_t{1000}, int64_t{12}})
      for (DType fp8 : {DType::E5M2, DType::E4M3})
        for (DType prob_t : {DType::BF16, DType::F32}) {
          // Rows past the split sum are random too: the amax covers every row.
          const Tensor x = random_tensor({230, 2 * f}, DType::BF16, seed++, -4, 4);
          const Tensor prob = random_tensor({230}, prob_t, seed++, 0, 1);
          const Tensor dy = random_tensor({230, f}, DType::BF16, seed++, -3, 3);
          const Tensor xd = x.to(kCuda), pd = prob.to(kCuda), dyd = dy.to(kCuda);
          Tensor ds = poisoned_device({230}, prob_t);
          const MoEFp8Rows got = moe_swiglu_scaled_backward_quantize(gpu, xd, pd, dyd, splits, fp8, o, ds);
          Tensor dx = poisoned_device({230, 2 * f}, DType::BF16), ds2 = poisoned_device({230}, prob_t);
          Tensor a = poisoned_device({1}, DType::F32);
          moe_swiglu_scaled_backward(gpu, xd, pd, dyd, dx, ds2, &a);
          const MoEFp8Rows want = moe_fp8_quantize_rows(gpu, dx, a, splits, fp8, o);
          const std::string what = "F " + std::to_string(f) + " " + dtype_name(fp8) + " prob " + dtype_name(prob_t) +
                                   " splits " + std::to_string(splits[0]) + "," + std::to_string(splits[1]) + ",...";
          EXPECT_EQ(got.dtype, fp8) << what;
          EXPECT_EQ(got.padded_offsets, want.padded_offsets) << what;
          EXPECT_EQ(bytes_of(got.data), bytes_of(want.data)) << what;
          EXPECT_EQ(bytes_of(got.data_t), bytes_of(want.data_t)) << what;  // padding included
          EXPECT_EQ(bytes_of(got.scale_inv), bytes_of(want.scale_inv)) << what;
          // d_scale: the vector backward's reduction, so the same bits; and the CPU's value.
          EXPECT_EQ(bytes_of(ds), bytes_of(ds2)) << what;
          Tensor dxc = Tensor::empty({230, 2 * f}, DType::BF16), dsc = Tensor::empty({230}, prob_t);
          moe_swiglu_scaled_backward(cpu, x, prob, dy, dxc, dsc);
          EXPECT_LT(relative_error(ds.to(Device::cpu()), dsc), tol_of(prob_t)) << what;
        }
}

namespace {

void fill(nn::GroupedLinear& l, uint64_t seed) {
  l.weight.value.copy_from(random_tensor(l.weight.value.shape(), DType::BF16, seed, -0.3f, 0.3f));
  l.weight.to(kCuda);
}

}  // namespace

TEST(GpuMoeSwiglu, GroupedMlpFp8BackwardFusedEqualsUnfused) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  uint64_t seed = 5300;
  const int64_t e = 5, hidden = 64, ffn = 96, rows = 230;
  for (const auto& splits : kSplits) {
    const Tensor x = random_tensor({rows, hidden}, DType::BF16, seed++).to(kCuda);
    const Tensor prob = random_tensor({rows}, DType::BF16, seed++, 0, 1).to(kCuda);
    const Tensor dy = random_tensor({rows, hidden}, DType::BF16, seed++).to(kCuda);
    const uint64_t wseed = seed;
    seed += 2;
    struct Result {
      Tensor dx, d_scale, fc_grad, proj_grad;
    };
    auto step = [&](bool legacy) {
      LegacyScope scope(legacy);
      nn::GroupedMLP m("m", e, hidden, ffn, DType::BF16);
      fill(m.fc, wseed);
      fill(m.proj, wseed + 1);
      m.use_fp8(MoEFp8Options{});
      nn::GroupedMLP::Saved saved;
      m.forward(gpu, x, prob, splits, saved);
      EXPECT_TRUE(saved.fp8);
      Result r;
      r.dx = m.backward_input(gpu, dy, saved).to(Device::cpu());
      m.backward_weight(gpu, dy, saved);
      r.d_scale = saved.d_scale.to(Device::cpu());
      r.fc_grad = m.fc.weight.grad.to(Device::cpu());
      r.proj_grad = m.proj.weight.grad.to(Device::cpu());
      return r;
    };
    const Result fused = step(false), unfused = step(true);
    // fc's dy codes are the same bytes, so everything downstream of them is too; d_scale
    // sums the same terms in another order (and the legacy forward SwiGLU has the same bits).
    EXPECT_EQ(bytes_of(fused.dx), bytes_of(unfused.dx));
    EXPECT_EQ(bytes_of(fused.fc_grad), bytes_of(unfused.fc_grad));
    EXPECT_EQ(bytes_of(fused.proj_grad), bytes_of(unfused.proj_grad));
    EXPECT_LT(relative_error(fused.d_scale, unfused.d_scale), 1e-2);
  }
}
