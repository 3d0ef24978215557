// The warp-row LayerNorm/RMSNorm kernels (cuda::NormTuning::kernel = 2, norm_warp.cuh),
// selected explicitly, against the CPU reference: plain and residual-add forms, forward and
// backward, at the widths they take (768, 1024, 2048, 4096, 8192 and 256, one vector a lane)
// and at widths that fall back to the row-group kernels (7, 4099, 40000); under the default
// launch, a persistent grid with 64 words a lane (C = 4096 BF16 in one warp) and 8 words a
// lane (up to eight warps per row: the shared-memory reduction); F32 and BF16 activations,
// F32 and BF16 parameters; outputs poisoned first; parameter gradients accumulating onto
// non-zero values; more rows than one wave (persistent loops, several rows per worker).
// Also: the fused forms equal add() and the plain ops on the GPU to the bit, in-place
// outputs, NaN propagation, run-to-run determinism, LayerNorm statistics of rows far from
// zero (the forward's one-reduction mean and variance). Skipped (saying so) without a GPU.
#include <algorithm>
#include <cmath>
#include <cstring>

#if TESSERA_WITH_CUDA
#include "gpu_norm_testing.h"
#endif
#include "tessera/core/allocator.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/norm.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

// Everything below calls the CUDA backend directly: a build without it has nothing to test.
#if TESSERA_WITH_CUDA

namespace {

constexpr float kEps = 1e-5f;

struct Variant {
  const char* name;
  cuda::NormTuning tuning;
};
const Variant kVariants[] = {
    {"warp rows", {.kernel = 2}},
    {"warp rows, persistent, 64 words", {.forward_persistent = 1, .kernel = 2, .warp_words = 64}},
    {"warp rows, 8 words (many warps a row)", {.kernel = 2, .warp_words = 8}},
};

int64_t rows_of(const Shape& s) { return shape_numel(s) / s.back(); }
Tensor poisoned(const Shape& shape, DType t, Device d) {
  Tensor h = Tensor::empty(shape, t);
  poison(h);
  return h.to(d);
}

// One case's inputs and everything forward + backward produce.
struct Case {
  bool layer, beta, fused;
  Tensor x, residual, gamma, b, dy, d_residual, dgamma0, dbeta0;
};
struct Outputs {
  Tensor sum, y, mean, rstd, dx, dgamma, dbeta;
};

Case make_case(bool layer, bool with_beta, bool fused, const Shape& shape, DType t, DType param, uint64_t& seed) {
  const int64_t cols = shape.back();
  Case c{layer, layer && with_beta, fused};
  c.x = random_tensor(shape, t, seed++, -1.0f, 3.0f);
  c.residual = random_tensor(shape, t, seed++);
  c.gamma = random_tensor({cols}, param, seed++, 0.5f, 1.5f);
  if (c.beta) c.b = random_tensor({cols}, param, seed++);
  c.dy = random_tensor(shape, t, seed++);
  c.d_residual = random_tensor(shape, t, seed++);
  c.dgamma0 = random_tensor({cols}, param, seed++);
  if (c.beta) c.dbeta0 = random_tensor({cols}, param == DType::F32 ? DType::BF16 : DType::F32, seed++);
  return c;
}

Tensor copy_to(const Tensor& t, Device d) { return !t.defined() ? Tensor() : d.is_cpu() ? t.clone() : t.to(d); }

// Forward then backward (from this run's own statistics) on ctx's device.
Outputs run(Context& ctx, const Case& c) {
  const Device d = ctx.device;
  const Shape& shape = c.x.shape();
  const DType t = c.x.dtype();
  Outputs o;
  o.sum = poisoned(shape, t, d);
  o.y = poisoned(shape, t, d);
  if (c.layer) o.mean = poisoned({rows_of(shape)}, DType::F32, d);
  o.rstd = poisoned({rows_of(shape)}, DType::F32, d);
  o.dx = poisoned(shape, t, d);
  o.dgamma = copy_to(c.dgamma0, d);
  if (c.beta) o.dbeta = copy_to(c.dbeta0, d);
  const Tensor x = copy_to(c.x, d), r = copy_to(c.residual, d), g = copy_to(c.gamma, d), b = copy_to(c.b, d),
               dy = copy_to(c.dy, d), dr = copy_to(c.d_residual, d);
  if (c.fused) {
    if (c.layer) add_layernorm_forward(ctx, x, r, g, b, kEps, o.sum, o.y, o.mean, o.rstd);
    else add_rmsnorm_forward(ctx, x, r, g, kEps, o.sum, o.y, o.rstd);
    if (c.layer) layernorm_backward_add(ctx, dy, o.sum, g, o.mean, o.rstd, dr, o.dx, o.dgamma, o.dbeta);
    else rmsnorm_backward_add(ctx, dy, o.sum, g, o.rstd, dr, o.dx, o.dgamma);
  } else {
    if (c.layer) layernorm_forward(ctx, x, g, b, kEps, o.y, o.mean, o.rstd);
    else rmsnorm_forward(ctx, x, g, kEps, o.y, o.rstd);
    if (c.layer) layernorm_backward(ctx, dy, x, g, o.mean, o.rstd, o.dx, o.dgamma, o.dbeta);
    else rmsnorm_backward(ctx, dy, x, g, o.rstd, o.dx, o.dgamma);
  }
  return o;
}

// The residual sum bit for bit, except that a NaN may come out with another payload: the GPU's
// adds return the canonical NaN, the CPU's keep the input's.
void expect_same_bits_or_both_nan(const Tensor& got_any, const Tensor& want_any) {
  const std::vector<double> got = got_any.to(Device::cpu()).to_doubles();
  const std::vector<double> want = want_any.to(Device::cpu()).to_doubles();
  ASSERT_EQ(got.size(), want.size());
  const std::vector<uint8_t> got_bytes = bytes_of(got_any), want_bytes = bytes_of(want_any);
  const size_t width = got_bytes.size() / std::max<size_t>(got.size(), 1);
  int64_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      differ += !std::isnan(got[i]);
    } else {
      differ += std::memcmp(got_bytes.data() + i * width, want_bytes.data() + i * width, width) != 0;
    }
  }
  EXPECT_EQ(differ, 0) << "sum: elements that differ";
}

// The GPU against the CPU reference. Backward runs from each side's own statistics, which
// agree to ~1e-7: well inside the BF16 tolerance of dx (and the F32 one: dx moves by the
// same relative amount as rstd).
void check_against_cpu(const Case& c, const std::string& what) {
  SCOPED_TRACE(what);
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const Outputs want = run(cpu, c), got = run(gpu, c);
  const DType t = c.x.dtype();
  if (c.fused) expect_same_bits_or_both_nan(got.sum, want.sum);
  expect_close(got.y, want.y, tolerance(t), "y");
  if (c.layer) expect_close(got.mean, want.mean, 1e-5, "mean");
  expect_close(got.rstd, want.rstd, 1e-5, "rstd");
  expect_close(got.dx, want.dx, tolerance(t), "dx");
  expect_close(got.dgamma, want.dgamma, tolerance(c.dgamma0.dtype()), "dgamma");
  if (c.beta) expect_close(got.dbeta, want.dbeta, tolerance(c.dbeta0.dtype()), "dbeta");
}

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> s = {{37, 768}, {37, 1024}, {2, 19, 2048}, {37, 4096}, {13, 8192},
                                       {9, 256},  {5, 7},     {3, 4099},     {2, 40000}, {2500, 1024}};
  return s;
}

}  // namespace

TEST(GpuNormWarp, MatchesTheCpuReference) {
  REQUIRE_GPU();
  uint64_t seed = 5000;
  for (const Variant& v : kVariants) {
    TuningScope scope(v.tuning);
    for (DType t : {DType::BF16, DType::F32})
      for (size_t i = 0; i < shapes().size(); ++i) {
        const DType param = i % 2 ? DType::BF16 : DType::F32;
        for (bool fused : {false, true})
          for (int kind = 0; kind < 3; ++kind) {
            const bool layer = kind < 2, beta = kind == 0;
            const Case c = make_case(layer, beta, fused, shapes()[i], t, param, seed);
            check_against_cpu(c, std::string(v.name) + ": " + (fused ? "add+" : "") +
                                      (layer ? (beta ? "layernorm" : "layernorm (no beta)") : "rmsnorm") + " x " +
                                      dtype_name(t) + shape_to_string(shapes()[i]) + " params " + dtype_name(param));
          }
      }
  }
}

// The fused forms equal add() followed by the plain ops on the GPU: the sum, y and the
// statistics to the bit (the plain and fused forward take the same warps per row, so the
// same reduction order), dx to the bit, the parameter gradients to rounding.
TEST(GpuNormWarp, FusedEqualsTheUnfusedGpuOps) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  uint64_t seed = 6000;
  for (const Variant& v : kVariants) {
    TuningScope scope(v.tuning);
    for (DType t : {DType::BF16, DType::F32})
      for (const Shape& shape : {Shape{37, 4096}, Shape{37, 768}, Shape{13, 8192}})
        for (bool layer : {true, false}) {
          const std::string what = std::string(v.name) + (layer ? " layernorm " : " rmsnorm ") + dtype_name(t) +
                                   shape_to_string(shape);
          SCOPED_TRACE(what);
          Case c = make_case(layer, true, true, shape, t, DType::F32, seed);
          const Outputs fused = run(gpu, c);
          Case plain = c;
          plain.fused = false;
          Tensor s = Tensor::empty(shape, t, kCuda);
          add(gpu, dev(c.x), dev(c.residual), s);
          plain.x = host(s);
          const Outputs unfused = run(gpu, plain);
          EXPECT_EQ(bytes_of(fused.sum), bytes_of(s));
          EXPECT_EQ(bytes_of(fused.y), bytes_of(unfused.y));
          if (layer) EXPECT_EQ(bytes_of(fused.mean), bytes_of(unfused.mean));
          EXPECT_EQ(bytes_of(fused.rstd), bytes_of(unfused.rstd));
          Tensor dx = Tensor::empty(shape, t, kCuda);
          add(gpu, unfused.dx, dev(c.d_residual), dx);
          EXPECT_EQ(bytes_of(fused.dx), bytes_of(dx));
          expect_close(fused.dgamma, unfused.dgamma, 1e-6, "dgamma");
        }
  }
}

// y over x, dx over dy, the sum over x: every thread reads its elements before writing them.
TEST(GpuNormWarp, InPlaceOutputs) {
  REQUIRE_GPU();
  TuningScope scope({.kernel = 2});
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (DType t : {DType::BF16, DType::F32}) {
    const Shape shape{21, 4096};
    const std::string what = dtype_name(t);
    const Tensor x = random_tensor(shape, t, 71, -1.0f, 3.0f), dy = random_tensor(shape, t, 72),
                 r = random_tensor(shape, t, 73), gamma = random_tensor({4096}, DType::F32, 74, 0.5f, 1.5f);
    Tensor y = Tensor::empty(shape, t), mean = Tensor::empty({21}, DType::F32), rstd = Tensor::empty({21}, DType::F32);
    Tensor dx = Tensor::empty(shape, t), dgamma = Tensor::zeros({4096}, DType::F32), no_dbeta;
    layernorm_forward(cpu, x, gamma, Tensor(), kEps, y, mean, rstd);
    layernorm_backward(cpu, dy, x, gamma, mean, rstd, dx, dgamma, no_dbeta);
    Tensor gx = x.clone().to(kCuda), gmean = poisoned({21}, DType::F32, kCuda), grstd = poisoned({21}, DType::F32, kCuda);
    layernorm_forward(gpu, gx, dev(gamma), Tensor(), kEps, gx, gmean, grstd);
    expect_close(gx, y, tolerance(t), "in-place y " + what);
    Tensor gdy = dy.clone().to(kCuda), gdgamma = Tensor::zeros({4096}, DType::F32, kCuda);
    layernorm_backward(gpu, gdy, dev(x), dev(gamma), gmean, grstd, gdy, gdgamma, no_dbeta);
    expect_close(gdy, dx, tolerance(t), "in-place dx " + what);
    expect_close(gdgamma, dgamma, 1e-5, "dgamma " + what);

    Tensor sum = Tensor::empty(shape, t);
    add_rmsnorm_forward(cpu, x, r, gamma, kEps, sum, y, rstd);
    Tensor gs = x.clone().to(kCuda), gy = poisoned(shape, t, kCuda);
    add_rmsnorm_forward(gpu, gs, dev(r), dev(gamma), kEps, gs, gy, grstd);
    EXPECT_EQ(bytes_of(gs), bytes_of(sum)) << "in-place sum " << what;
    expect_close(gy, y, tolerance(t), "y after in-place sum " + what);
  }
}

// A NaN in x makes its row NaN (y, mean, rstd) and every dgamma; a NaN in dy makes its row of
// dx and its column of dgamma/dbeta NaN, as on the CPU.
TEST(GpuNormWarp, NanPropagatesLikeTheCpu) {
  REQUIRE_GPU();
  for (const Variant& v : kVariants) {
    TuningScope scope(v.tuning);
    uint64_t seed = 7000;
    for (DType t : {DType::BF16, DType::F32})
      for (bool fused : {false, true}) {
        Case c = make_case(true, true, fused, Shape{4, 2048}, t, DType::F32, seed);
        c.x.set_item(2048 + 3, NAN);
        c.dy.set_item(2 * 2048 + 5, NAN);
        check_against_cpu(c, std::string(v.name) + (fused ? " add+layernorm NaN " : " layernorm NaN ") + dtype_name(t));
        Case rms = make_case(false, false, fused, Shape{4, 2048}, t, DType::F32, seed);
        rms.x.set_item(2048 + 3, NAN);
        rms.dy.set_item(2 * 2048 + 5, NAN);
        check_against_cpu(rms, std::string(v.name) + (fused ? " add+rmsnorm NaN " : " rmsnorm NaN ") + dtype_name(t));
      }
  }
}

// No atomics: two runs give the same bits, parameter gradients included.
TEST(GpuNormWarp, RunToRunDeterministic) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  for (const Variant& v : kVariants) {
    TuningScope scope(v.tuning);
    uint64_t seed = 8000;
    for (DType t : {DType::BF16, DType::F32})
      for (const Shape& shape : {Shape{2500, 1024}, Shape{64, 4096}})
        for (bool fused : {false, true}) {
          const Case c = make_case(true, true, fused, shape, t, DType::F32, seed);
          const Outputs a = run(gpu, c), b = run(gpu, c);
          const std::string what = std::string(v.name) + " " + dtype_name(t) + shape_to_string(shape);
          const std::vector<std::pair<const Tensor*, const Tensor*>> pairs = {
              {&a.y, &b.y}, {&a.mean, &b.mean}, {&a.rstd, &b.rstd}, {&a.dx, &b.dx}, {&a.dgamma, &b.dgamma},
              {&a.dbeta, &b.dbeta}};
          for (const auto& [p, q] : pairs) EXPECT_EQ(bytes_of(*p), bytes_of(*q)) << what;
        }
  }
}

// Rows far from zero (x in [980, 1020]: mean ~1000, standard deviation ~12): the forward's
// merged (count, mean, M2) statistics keep the variance; E[x^2] - E[x]^2 in float would not
// (emulated in float32 at these shapes: rstd off by 2e-3 to 4e-2 that way, by under 3e-7
// with the merge; 1e-5 is allowed). Widths where every lane holds as many values (4096),
// where lanes hold different counts (2056, 1000), where whole lanes or a whole warp hold
// none (320 with 4 words a lane), and one the row-group kernels take (4099); the fused add
// too (the offset in x, a small residual).
TEST(GpuNormWarp, LargeRowOffsetKeepsTheVariance) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const Variant variants[] = {
      {"default launch", {}},
      kVariants[0],
      kVariants[1],
      kVariants[2],
      {"warp rows, 4 words (lanes past the row's end)", {.kernel = 2, .warp_words = 4}},
  };
  uint64_t seed = 9000;
  for (const Variant& v : variants) {
    TuningScope scope(v.tuning);
    for (DType t : {DType::BF16, DType::F32})
      for (int64_t cols : {4096, 2056, 1000, 320, 4099})
        for (bool fused : {false, true}) {
          const std::string what = std::string(v.name) + (fused ? " add+layernorm " : " layernorm ") +
                                   dtype_name(t) + " C=" + std::to_string(cols);
          SCOPED_TRACE(what);
          const Shape shape{7, cols};
          const Tensor x = random_tensor(shape, t, seed++, 980.0f, 1020.0f), r = random_tensor(shape, t, seed++),
                       gamma = random_tensor({cols}, DType::F32, seed++, 0.5f, 1.5f),
                       beta = random_tensor({cols}, DType::F32, seed++);
          Tensor y = Tensor::empty(shape, t), sum = Tensor::empty(shape, t), mean = Tensor::empty({7}, DType::F32),
                 rstd = Tensor::empty({7}, DType::F32);
          Tensor gy = poisoned(shape, t, kCuda), gsum = poisoned(shape, t, kCuda),
                 gmean = poisoned({7}, DType::F32, kCuda), grstd = poisoned({7}, DType::F32, kCuda);
          if (fused) {
            add_layernorm_forward(cpu, x, r, gamma, beta, kEps, sum, y, mean, rstd);
            add_layernorm_forward(gpu, dev(x), dev(r), dev(gamma), dev(beta), kEps, gsum, gy, gmean, grstd);
            expect_same_bits_or_both_nan(gsum, sum);
          } else {
            layernorm_forward(cpu, x, gamma, beta, kEps, y, mean, rstd);
            layernorm_forward(gpu, dev(x), dev(gamma), dev(beta), kEps, gy, gmean, grstd);
          }
          expect_close(gmean, mean, 1e-5, "mean");
          expect_close(grstd, rstd, 1e-5, "rstd");
          expect_close(gy, y, tolerance(t), "y");
        }
  }
}

#else

TEST(GpuNormWarp, NeedsTheCudaBackend) { GTEST_SKIP() << "tessera was built without CUDA"; }

#endif  // TESSERA_WITH_CUDA
