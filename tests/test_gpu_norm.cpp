// CUDA LayerNorm and RMSNorm against the CPU reference: rows of width 1 (RMSNorm's dx
// cancels there), odd widths, narrow rows sharing a warp, widths that take every kernel
// shape (register rows of 1 to 8 vectors per thread, the looping path for rows too wide for
// registers); F32 and BF16 activations with F32 and BF16 parameters mixed; outputs poisoned
// first; parameter gradients accumulating onto non-zero values; BF16 outputs agreeing with
// the CPU run on the same BF16 input to the bit (up to a rare last-bit step); run-to-run
// determinism; NaN propagation. Skipped (saying so) where no GPU is present.
#include <cmath>
#include <cstdlib>

#include "tessera/core/allocator.h"
#include "tessera/ops/norm.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

constexpr float kEps = 1e-5f;

Tensor poisoned(const Shape& shape, DType t, Device d) {
  Tensor host = Tensor::empty(shape, t);
  poison(host);
  return host.to(d);
}

Tensor host(const Tensor& t) { return t.to(Device::cpu()); }
Tensor gpu_copy(const Tensor& t) { return t.defined() ? t.to(kCuda) : Tensor(); }

// The DESIGN.md tolerances: BF16 outputs carry a BF16 rounding, F32 ones agree to ~1e-7.
double tolerance(DType t) { return t == DType::BF16 ? 1e-2 : 1e-5; }

int64_t rows_of(const Shape& shape) { return shape_numel(shape) / shape.back(); }
Shape leading(const Shape& shape) { return Shape(shape.begin(), shape.end() - 1); }

// The shapes every test sweeps: C = 1 (alone and several rows), tiny and odd widths, rows
// narrower than a warp with a partial last block, one to eight 16-byte vectors per thread,
// and rows that only the looping kernels take (odd 9001, 40000 BF16 in forward; 16384 and
// wider in backward).
const std::vector<Shape>& norm_shapes() {
  static const std::vector<Shape> shapes = {{1, 1},    {7, 1},     {1, 2},     {5, 7},       {3, 257},
                                            {130, 33}, {300, 64},  {64, 1000}, {2, 3, 4099}, {16, 4096},
                                            {4, 8192}, {2, 16384}, {2, 32768}, {3, 9001},    {2, 40000}};
  return shapes;
}

// Elementwise: NaN exactly where the reference has NaN, and close elsewhere.
void expect_close(const Tensor& got_any, const Tensor& want, double tol, const std::string& what) {
  const std::vector<double> got = host(got_any).to_doubles(), ref = want.to_doubles();
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::vector<double> g, r;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(ref[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << what << ": element " << i << " should be NaN";
      continue;
    }
    g.push_back(got[i]);
    r.push_back(ref[i]);
  }
  EXPECT_LT(relative_error(g, r), tol) << what;
}

// Distance in BF16 steps between two BF16 bit patterns (same-sign ordering).
int bf16_steps(uint16_t a, uint16_t b) {
  auto ordered = [](uint16_t v) { return (v & 0x8000) ? -int(v & 0x7fff) : int(v); };
  return std::abs(ordered(a) - ordered(b));
}

// The GPU's BF16 output against the CPU's on the same BF16 input: the CPU computes in float
// and rounds once at the end; the GPU does the same float operations in the same order, so
// an element may differ only where a statistic rounded to the other neighbouring float.
void expect_bf16_bitwise_agreement(const Tensor& got_any, const Tensor& want, const std::string& what) {
  const Tensor got = host(got_any);
  ASSERT_EQ(got.dtype(), DType::BF16);
  ASSERT_EQ(want.dtype(), DType::BF16);
  const uint16_t* g = got.data<uint16_t>();
  const uint16_t* w = want.data<uint16_t>();
  int64_t identical = 0, worst = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const int steps = bf16_steps(g[i], w[i]);
    identical += steps == 0;
    worst = std::max<int64_t>(worst, steps);
  }
  EXPECT_LE(worst, 1) << what << ": a BF16 output is more than one step from the CPU's";
  EXPECT_GE(double(identical), 0.99 * double(got.numel()))
      << what << ": only " << identical << " of " << got.numel() << " BF16 outputs equal the CPU's bits";
}

struct Dtypes {
  DType x, gamma, beta, dgamma, dbeta;
};

// Parameter dtypes cycle with the shape index so every mix (F32 or BF16 gamma, beta and
// their gradients, same as x or not) is met.
Dtypes dtypes_for(DType x, size_t index) {
  auto pick = [](size_t bit) { return bit ? DType::BF16 : DType::F32; };
  return {x, pick(index & 1), pick((index >> 1) & 1), pick((index >> 2) & 1), pick(((index >> 1) ^ index) & 1)};
}

void check_layernorm(const Shape& shape, const Dtypes& d, bool with_beta, uint64_t& seed) {
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const int64_t cols = shape.back(), rows = rows_of(shape);
  const std::string what = std::string("layernorm x ") + dtype_name(d.x) + shape_to_string(shape) + " gamma " +
                           dtype_name(d.gamma) + (with_beta ? std::string(" beta ") + dtype_name(d.beta) : " no beta");
  SCOPED_TRACE(what);
  const Tensor x = random_tensor(shape, d.x, seed++, -1.0f, 3.0f);  // a mean well away from zero
  const Tensor gamma = random_tensor({cols}, d.gamma, seed++, 0.5f, 1.5f);
  const Tensor beta = with_beta ? random_tensor({cols}, d.beta, seed++) : Tensor();
  // Statistics as [rows] on the CPU and, on the GPU, shaped like x without its last dim.
  Tensor y = Tensor::empty(shape, d.x), mean = Tensor::empty({rows}, DType::F32),
         rstd = Tensor::empty({rows}, DType::F32);
  layernorm_forward(cpu, x, gamma, beta, kEps, y, mean, rstd);
  Tensor gy = poisoned(shape, d.x, kCuda), gmean = poisoned(leading(shape), DType::F32, kCuda),
         grstd = poisoned(leading(shape), DType::F32, kCuda);
  layernorm_forward(gpu, gpu_copy(x), gpu_copy(gamma), gpu_copy(beta), kEps, gy, gmean, grstd);
  expect_close(gy, y, tolerance(d.x), "y");
  expect_close(gmean.reshape({rows}), mean, 1e-5, "mean");
  expect_close(grstd.reshape({rows}), rstd, 1e-5, "rstd");

  // Backward from the CPU's statistics; parameter gradients start non-zero (they accumulate),
  // dx starts as NaN (it is overwritten).
  const Tensor dy = random_tensor(shape, d.x, seed++);
  const Tensor dgamma0 = random_tensor({cols}, d.dgamma, seed++), dbeta0 = random_tensor({cols}, d.dbeta, seed++);
  Tensor dx = Tensor::empty(shape, d.x), dgamma = dgamma0.clone(), dbeta = with_beta ? dbeta0.clone() : Tensor();
  layernorm_backward(cpu, dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
  Tensor gdx = poisoned(shape, d.x, kCuda), gdgamma = gpu_copy(dgamma0),
         gdbeta = with_beta ? gpu_copy(dbeta0) : Tensor();
  layernorm_backward(gpu, gpu_copy(dy), gpu_copy(x), gpu_copy(gamma), gpu_copy(mean), gpu_copy(rstd), gdx, gdgamma,
                     gdbeta);
  expect_close(gdx, dx, tolerance(d.x), "dx");
  expect_close(gdgamma, dgamma, tolerance(d.dgamma), "dgamma");
  if (with_beta) expect_close(gdbeta, dbeta, tolerance(d.dbeta), "dbeta");
}

void check_rmsnorm(const Shape& shape, const Dtypes& d, uint64_t& seed) {
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const int64_t cols = shape.back(), rows = rows_of(shape);
  const std::string what = std::string("rmsnorm x ") + dtype_name(d.x) + shape_to_string(shape) + " gamma " +
                           dtype_name(d.gamma) + " dgamma " + dtype_name(d.dgamma);
  SCOPED_TRACE(what);
  const Tensor x = random_tensor(shape, d.x, seed++, -2.0f, 2.0f);
  const Tensor gamma = random_tensor({cols}, d.gamma, seed++, 0.5f, 1.5f);
  Tensor y = Tensor::empty(shape, d.x), rstd = Tensor::empty({rows}, DType::F32);
  rmsnorm_forward(cpu, x, gamma, kEps, y, rstd);
  Tensor gy = poisoned(shape, d.x, kCuda), grstd = poisoned({rows}, DType::F32, kCuda);
  rmsnorm_forward(gpu, gpu_copy(x), gpu_copy(gamma), kEps, gy, grstd);
  expect_close(gy, y, tolerance(d.x), "y");
  expect_close(grstd, rstd, 1e-5, "rstd");

  const Tensor dy = random_tensor(shape, d.x, seed++);
  const Tensor dgamma0 = random_tensor({cols}, d.dgamma, seed++);
  Tensor dx = Tensor::empty(shape, d.x), dgamma = dgamma0.clone();
  rmsnorm_backward(cpu, dy, x, gamma, rstd, dx, dgamma);
  Tensor gdx = poisoned(shape, d.x, kCuda), gdgamma = gpu_copy(dgamma0);
  rmsnorm_backward(gpu, gpu_copy(dy), gpu_copy(x), gpu_copy(gamma), gpu_copy(rstd), gdx, gdgamma);
  expect_close(gdx, dx, tolerance(d.x), "dx");
  expect_close(gdgamma, dgamma, tolerance(d.dgamma), "dgamma");
}

}  // namespace

TEST(GpuNorm, LayerNormMatchesTheCpuReference) {
  REQUIRE_GPU();
  uint64_t seed = 700;
  for (DType t : {DType::F32, DType::BF16})
    for (size_t i = 0; i < norm_shapes().size(); ++i)
      check_layernorm(norm_shapes()[i], dtypes_for(t, i), i % 3 != 2, seed);
}

TEST(GpuNorm, RmsNormMatchesTheCpuReference) {
  REQUIRE_GPU();
  uint64_t seed = 900;
  for (DType t : {DType::F32, DType::BF16})
    for (size_t i = 0; i < norm_shapes().size(); ++i) check_rmsnorm(norm_shapes()[i], dtypes_for(t, i), seed);
}

// C = 1: RMSNorm's dx = rstd * g * (1 - xhat^2) is a catastrophic cancellation, so any
// difference in rstd or in the order of the float operations shows up at the 1e-5 level.
// The GPU takes the row sums in double like the reference, so it must agree to the bit.
// LayerNorm's C = 1 rows are exact: y = beta, dx = 0.
TEST(GpuNorm, WidthOneRowsAgreeExactly) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (DType t : {DType::F32, DType::BF16}) {
    for (int64_t rows : {1, 64}) {
      const Shape shape{rows, 1};
      const Tensor x = random_tensor(shape, t, 31 + rows, -2.0f, 2.0f), dy = random_tensor(shape, t, 32 + rows);
      const Tensor gamma = random_tensor({1}, DType::F32, 33, 0.5f, 1.5f);
      Tensor y = Tensor::empty(shape, t), rstd = Tensor::empty({rows}, DType::F32);
      rmsnorm_forward(cpu, x, gamma, kEps, y, rstd);
      Tensor dx = Tensor::empty(shape, t), dgamma = Tensor::zeros({1}, DType::F32);
      rmsnorm_backward(cpu, dy, x, gamma, rstd, dx, dgamma);

      Tensor gy = poisoned(shape, t, kCuda), grstd = poisoned({rows}, DType::F32, kCuda);
      rmsnorm_forward(gpu, x.to(kCuda), gamma.to(kCuda), kEps, gy, grstd);
      Tensor gdx = poisoned(shape, t, kCuda), gdgamma = Tensor::zeros({1}, DType::F32, kCuda);
      rmsnorm_backward(gpu, dy.to(kCuda), x.to(kCuda), gamma.to(kCuda), grstd, gdx, gdgamma);
      const std::string what = std::string(dtype_name(t)) + shape_to_string(shape);
      EXPECT_EQ(host(grstd).to_doubles(), rstd.to_doubles()) << "rmsnorm rstd " << what;
      EXPECT_EQ(host(gy).to_doubles(), y.to_doubles()) << "rmsnorm y " << what;
      EXPECT_EQ(host(gdx).to_doubles(), dx.to_doubles()) << "rmsnorm dx " << what;
      EXPECT_LT(relative_error(host(gdgamma), dgamma), 1e-6) << "rmsnorm dgamma " << what;

      // LayerNorm: every value is its own mean, so y = beta and dx = dgamma = 0 exactly.
      const Tensor beta = random_tensor({1}, DType::F32, 34);
      Tensor ln_y = Tensor::empty(shape, t), mean = Tensor::empty({rows}, DType::F32);
      layernorm_forward(cpu, x, gamma, beta, kEps, ln_y, mean, rstd);
      Tensor gln_y = poisoned(shape, t, kCuda), gmean = poisoned({rows}, DType::F32, kCuda);
      layernorm_forward(gpu, x.to(kCuda), gamma.to(kCuda), beta.to(kCuda), kEps, gln_y, gmean, grstd);
      EXPECT_EQ(host(gln_y).to_doubles(), ln_y.to_doubles()) << "layernorm y " << what;
      EXPECT_EQ(host(gmean).to_doubles(), mean.to_doubles()) << "layernorm mean " << what;
      Tensor gln_dx = poisoned(shape, t, kCuda), gln_dgamma = Tensor::zeros({1}, DType::F32, kCuda),
             gln_dbeta = Tensor::zeros({1}, DType::F32, kCuda);
      layernorm_backward(gpu, dy.to(kCuda), x.to(kCuda), gamma.to(kCuda), gmean, grstd, gln_dx, gln_dgamma, gln_dbeta);
      for (double v : host(gln_dx).to_doubles()) EXPECT_EQ(v, 0.0) << "layernorm dx " << what;
      EXPECT_EQ(host(gln_dgamma).item(0), 0.0) << "layernorm dgamma " << what;
    }
  }
}

// Same BF16 input on both backends: the GPU's BF16 y (and dx, from the same statistics)
// equals the CPU's bits, up to a rare one-step difference.
TEST(GpuNorm, Bf16OutputsAgreeWithTheCpuOnTheSameInput) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 1100;
  for (Shape shape : {Shape{5, 7}, Shape{3, 257}, Shape{64, 1000}, Shape{16, 4096}, Shape{2, 40000}}) {
    for (DType gamma_dtype : {DType::BF16, DType::F32}) {
      const int64_t cols = shape.back(), rows = rows_of(shape);
      const std::string what = shape_to_string(shape) + " gamma " + dtype_name(gamma_dtype);
      const Tensor x = random_tensor(shape, DType::BF16, seed++, -1.0f, 3.0f);
      const Tensor gamma = random_tensor({cols}, gamma_dtype, seed++, 0.5f, 1.5f);
      const Tensor beta = random_tensor({cols}, gamma_dtype, seed++);
      Tensor y = Tensor::empty(shape, DType::BF16), mean = Tensor::empty({rows}, DType::F32),
             rstd = Tensor::empty({rows}, DType::F32);
      layernorm_forward(cpu, x, gamma, beta, kEps, y, mean, rstd);
      Tensor gy = poisoned(shape, DType::BF16, kCuda), gmean = poisoned({rows}, DType::F32, kCuda),
             grstd = poisoned({rows}, DType::F32, kCuda);
      layernorm_forward(gpu, x.to(kCuda), gamma.to(kCuda), beta.to(kCuda), kEps, gy, gmean, grstd);
      expect_bf16_bitwise_agreement(gy, y, "layernorm y " + what);

      rmsnorm_forward(cpu, x, gamma, kEps, y, rstd);
      rmsnorm_forward(gpu, x.to(kCuda), gamma.to(kCuda), kEps, gy, grstd);
      expect_bf16_bitwise_agreement(gy, y, "rmsnorm y " + what);
      EXPECT_LT(relative_error(host(gy), y), 1e-2) << what;
    }
  }
}

// The parameter gradients are summed without atomics in a fixed order: two runs give the
// same bits, and so do the activations.
TEST(GpuNorm, RunToRunDeterministic) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  uint64_t seed = 1300;
  for (Shape shape : {Shape{512, 4096}, Shape{333, 257}, Shape{4096, 8}, Shape{8, 40000}}) {
    for (DType t : {DType::BF16, DType::F32}) {
      const int64_t cols = shape.back(), rows = rows_of(shape);
      const Tensor x = random_tensor(shape, t, seed++, -1.0f, 3.0f).to(kCuda),
                   dy = random_tensor(shape, t, seed++).to(kCuda);
      const Tensor gamma = random_tensor({cols}, DType::F32, seed++, 0.5f, 1.5f).to(kCuda);
      const Tensor beta = random_tensor({cols}, DType::F32, seed++).to(kCuda);
      std::vector<std::vector<double>> runs[2];
      for (auto& run : runs) {
        Tensor y = Tensor::zeros(shape, t, kCuda), mean = Tensor::zeros({rows}, DType::F32, kCuda),
               rstd = Tensor::zeros({rows}, DType::F32, kCuda), dx = Tensor::zeros(shape, t, kCuda),
               dgamma = Tensor::zeros({cols}, DType::F32, kCuda), dbeta = Tensor::zeros({cols}, DType::F32, kCuda);
        layernorm_forward(gpu, x, gamma, beta, kEps, y, mean, rstd);
        layernorm_backward(gpu, dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
        run = {host(y).to_doubles(), host(dx).to_doubles(), host(dgamma).to_doubles(), host(dbeta).to_doubles()};
        rmsnorm_forward(gpu, x, gamma, kEps, y, rstd);
        rmsnorm_backward(gpu, dy, x, gamma, rstd, dx, dgamma);
        run.push_back(host(dx).to_doubles());
        run.push_back(host(dgamma).to_doubles());
      }
      for (size_t k = 0; k < runs[0].size(); ++k)
        EXPECT_TRUE(runs[0][k] == runs[1][k])
            << dtype_name(t) << shape_to_string(shape) << " output " << k << " differs between two runs";
    }
  }
}

// A NaN in x makes its row NaN (y, mean, rstd) and, through xhat, every dgamma; a NaN in dy
// makes its row of dx and its column of dgamma/dbeta NaN. Exactly as the CPU does.
TEST(GpuNorm, NanPropagatesLikeTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (DType t : {DType::F32, DType::BF16}) {
    for (Shape shape : {Shape{4, 7}, Shape{4, 4096}}) {
      const int64_t cols = shape.back();
      Tensor x = random_tensor(shape, t, 41), dy = random_tensor(shape, t, 42);
      const Tensor gamma = random_tensor({cols}, DType::F32, 43), beta = random_tensor({cols}, DType::F32, 44);
      x.set_item(cols + 3, NAN);       // row 1
      dy.set_item(2 * cols + 5, NAN);  // row 2, column 5
      Tensor y = Tensor::empty(shape, t), mean = Tensor::empty({4}, DType::F32), rstd = Tensor::empty({4}, DType::F32);
      Tensor dx = Tensor::empty(shape, t), dgamma = Tensor::zeros({cols}, DType::F32),
             dbeta = Tensor::zeros({cols}, DType::F32);
      layernorm_forward(cpu, x, gamma, beta, kEps, y, mean, rstd);
      layernorm_backward(cpu, dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
      Tensor gy = poisoned(shape, t, kCuda), gmean = poisoned({4}, DType::F32, kCuda),
             grstd = poisoned({4}, DType::F32, kCuda);
      Tensor gdx = poisoned(shape, t, kCuda), gdgamma = Tensor::zeros({cols}, DType::F32, kCuda),
             gdbeta = Tensor::zeros({cols}, DType::F32, kCuda);
      layernorm_forward(gpu, x.to(kCuda), gamma.to(kCuda), beta.to(kCuda), kEps, gy, gmean, grstd);
      layernorm_backward(gpu, dy.to(kCuda), x.to(kCuda), gamma.to(kCuda), gmean, grstd, gdx, gdgamma, gdbeta);
      const std::string what = std::string(dtype_name(t)) + shape_to_string(shape);
      expect_close(gy, y, tolerance(t), "layernorm y " + what);
      expect_close(grstd, rstd, 1e-5, "layernorm rstd " + what);
      expect_close(gdx, dx, tolerance(t), "layernorm dx " + what);
      expect_close(gdgamma, dgamma, 1e-5, "layernorm dgamma " + what);
      expect_close(gdbeta, dbeta, 1e-5, "layernorm dbeta " + what);
      EXPECT_TRUE(std::isnan(host(gy).item(cols))) << what;
      EXPECT_TRUE(std::isnan(host(gdbeta).item(5))) << what;

      rmsnorm_forward(cpu, x, gamma, kEps, y, rstd);
      dgamma.fill_zero();
      rmsnorm_backward(cpu, dy, x, gamma, rstd, dx, dgamma);
      gdgamma.fill_zero();
      rmsnorm_forward(gpu, x.to(kCuda), gamma.to(kCuda), kEps, gy, grstd);
      rmsnorm_backward(gpu, dy.to(kCuda), x.to(kCuda), gamma.to(kCuda), grstd, gdx, gdgamma);
      expect_close(gy, y, tolerance(t), "rmsnorm y " + what);
      expect_close(gdx, dx, tolerance(t), "rmsnorm dx " + what);
      expect_close(gdgamma, dgamma, 1e-5, "rmsnorm dgamma " + what);
    }
  }
}

// y may be x itself, and dx may be dy itself (the wide path computes the parameter gradients
// before it overwrites dy).
TEST(GpuNorm, InPlaceOutputs) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (Shape shape : {Shape{6, 256}, Shape{3, 9001}}) {
    const int64_t cols = shape.back(), rows = rows_of(shape);
    const Tensor x = random_tensor(shape, DType::F32, 51), dy = random_tensor(shape, DType::F32, 52);
    const Tensor gamma = random_tensor({cols}, DType::F32, 53, 0.5f, 1.5f);
    Tensor y = Tensor::empty(shape, DType::F32), rstd = Tensor::empty({rows}, DType::F32);
    Tensor dx = Tensor::empty(shape, DType::F32), dgamma = Tensor::zeros({cols}, DType::F32);
    rmsnorm_forward(cpu, x, gamma, kEps, y, rstd);
    rmsnorm_backward(cpu, dy, x, gamma, rstd, dx, dgamma);

    Tensor gx = x.clone().to(kCuda), grstd = poisoned({rows}, DType::F32, kCuda);
    rmsnorm_forward(gpu, gx, gamma.to(kCuda), kEps, gx, grstd);
    expect_close(gx, y, 1e-5, "in-place y " + shape_to_string(shape));
    Tensor gdy = dy.clone().to(kCuda), gdgamma = Tensor::zeros({cols}, DType::F32, kCuda);
    rmsnorm_backward(gpu, gdy, x.to(kCuda), gamma.to(kCuda), grstd, gdy, gdgamma);
    expect_close(gdy, dx, 1e-5, "in-place dx " + shape_to_string(shape));
    expect_close(gdgamma, dgamma, 1e-5, "dgamma with in-place dx " + shape_to_string(shape));
  }
}

TEST(GpuNorm, UnsupportedDtypesAreAClearError) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  Tensor x = Tensor::zeros({2, 8}, DType::F16, kCuda), y = Tensor::zeros({2, 8}, DType::F16, kCuda);
  Tensor gamma = Tensor::zeros({8}, DType::F32, kCuda), rstd = Tensor::zeros({2}, DType::F32, kCuda);
  EXPECT_THROW(rmsnorm_forward(gpu, x, gamma, kEps, y, rstd), Error);
  Tensor xf = Tensor::zeros({2, 8}, DType::F32, kCuda), ybf = Tensor::zeros({2, 8}, DType::BF16, kCuda);
  EXPECT_THROW(rmsnorm_forward(gpu, xf, gamma, kEps, ybf, rstd), Error);  // x and y must share a dtype
}
