// CUDA residual add + LayerNorm/RMSNorm (add_layernorm_forward, add_rmsnorm_forward,
// layernorm_backward_add, rmsnorm_backward_add):
//   - against the GPU's own unfused ops (add, then the norm; the norm's backward, then add),
//     which they must equal to the bit (the parameter gradients up to the last bit: their
//     worker count follows each kernel's occupancy);
//   - against the CPU reference: the sum exactly, the rest within the DESIGN.md tolerances,
//     rows of width 1 exactly;
//   - in place (the sum over x or the residual, y over x or the residual, dx over the
//     residual gradient, dy or x), misaligned operands (the scalar path), NaN propagation,
//     run-to-run determinism, and the clear error for dtypes without a kernel.
// Shapes sweep C = 1, odd widths, narrow rows sharing a warp, 1 to 8 vectors per thread,
// rows of 8192 and the looping kernels' wide rows; F32 and BF16 activations with F32 and
// BF16 parameters mixed; outputs poisoned first; parameter gradients accumulate onto
// non-zero values. Skipped (saying so) where no GPU is present.
#include <cmath>
#include <cstring>

#include "tessera/core/allocator.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/norm.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

constexpr float kEps = 1e-5f;

enum class Kind { LayerNorm, LayerNormNoBeta, RmsNorm };
const Kind kKinds[] = {Kind::LayerNorm, Kind::LayerNormNoBeta, Kind::RmsNorm};
bool is_layer(Kind k) { return k != Kind::RmsNorm; }
const char* kind_name(Kind k) {
  return k == Kind::LayerNorm ? "layernorm" : k == Kind::LayerNormNoBeta ? "layernorm (no beta)" : "rmsnorm";
}

int64_t rows_of(const Shape& shape) { return shape_numel(shape) / shape.back(); }

Tensor host(const Tensor& t) { return t.defined() ? t.to(Device::cpu()) : Tensor(); }

// A private copy of t on d (Tensor::to returns t itself when it is already there).
Tensor copy_on(const Tensor& t, Device d) {
  if (!t.defined()) return Tensor();
  return d.is_cpu() ? t.clone() : t.to(d);
}

Tensor poisoned(const Shape& shape, DType t, Device d) {
  Tensor h = Tensor::empty(shape, t);
  poison(h);
  return h.to(d);
}

// The DESIGN.md tolerances: BF16 outputs carry a BF16 rounding, F32 ones agree to ~1e-7.
double tolerance(DType t) { return t == DType::BF16 ? 1e-2 : 1e-5; }

// Shapes: C = 1 (alone and several rows), tiny and odd widths, rows narrower than a warp
// with a partial last block, one to eight 16-byte vectors per thread, rows of 8192 (BF16
// backward at its register limit, F32 backward looping), and rows only the looping kernels
// take (odd 9001; 40000 BF16 in forward; 16384 and wider in backward).
const std::vector<Shape>& shapes() {
  static const std::vector<Shape> s = {{1, 1},     {7, 1},    {1, 2},      {5, 7},    {3, 257},
                                       {130, 33},  {300, 64}, {64, 1000},  {2, 3, 4099}, {16, 4096},
                                       {4, 8192},  {2, 16384}, {2, 32768}, {3, 9001}, {2, 40000}};
  return s;
}

struct Dtypes {
  DType x, gamma, beta, dgamma, dbeta;
};

// Parameter dtypes cycle with the shape index so every mix is met.
Dtypes dtypes_for(DType x, size_t index) {
  auto pick = [](size_t bit) { return bit ? DType::BF16 : DType::F32; };
  return {x, pick(index & 1), pick((index >> 1) & 1), pick((index >> 2) & 1), pick(((index >> 1) ^ index) & 1)};
}

// Host inputs of one case.
struct Inputs {
  Kind kind;
  Tensor x, residual, gamma, beta, dy, d_residual, dgamma0, dbeta0;
  std::string what;
};

Inputs make_inputs(Kind kind, const Shape& shape, const Dtypes& d, uint64_t& seed) {
  const int64_t cols = shape.back();
  Inputs in;
  in.kind = kind;
  in.x = random_tensor(shape, d.x, seed++, -1.0f, 3.0f);  // a mean well away from zero
  in.residual = random_tensor(shape, d.x, seed++, -1.0f, 1.0f);
  in.gamma = random_tensor({cols}, d.gamma, seed++, 0.5f, 1.5f);
  if (kind == Kind::LayerNorm) {
    in.beta = random_tensor({cols}, d.beta, seed++);
    in.dbeta0 = random_tensor({cols}, d.dbeta, seed++);
  }
  in.dy = random_tensor(shape, d.x, seed++);
  in.d_residual = random_tensor(shape, d.x, seed++);
  in.dgamma0 = random_tensor({cols}, d.dgamma, seed++);
  in.what = std::string(kind_name(kind)) + " x " + dtype_name(d.x) + shape_to_string(shape) + " gamma " +
            dtype_name(d.gamma) + " dgamma " + dtype_name(d.dgamma);
  return in;
}

// Everything one forward + backward produces, on the device it ran on.
struct Outputs {
  Tensor sum, y, mean, rstd, dx, dgamma, dbeta;
};

// Poisoned activations and statistics; parameter gradients start at the inputs' values.
Outputs fresh_outputs(const Inputs& in, Device d) {
  const Shape& shape = in.x.shape();
  const DType t = in.x.dtype();
  Outputs o;
  o.sum = poisoned(shape, t, d);
  o.y = poisoned(shape, t, d);
  if (is_layer(in.kind)) o.mean = poisoned({rows_of(shape)}, DType::F32, d);
  o.rstd = poisoned({rows_of(shape)}, DType::F32, d);
  o.dx = poisoned(shape, t, d);
  o.dgamma = copy_on(in.dgamma0, d);
  o.dbeta = copy_on(in.dbeta0, d);
  return o;
}

// The fused forward of x + residual into o.sum, o.y, o.mean, o.rstd (parameters from `in`).
void fused_forward(Context& ctx, const Inputs& in, const Tensor& x, const Tensor& residual, Outputs& o) {
  const Tensor gamma = copy_on(in.gamma, ctx.device), beta = copy_on(in.beta, ctx.device);
  if (is_layer(in.kind)) add_layernorm_forward(ctx, x, residual, gamma, beta, kEps, o.sum, o.y, o.mean, o.rstd);
  else add_rmsnorm_forward(ctx, x, residual, gamma, kEps, o.sum, o.y, o.rstd);
}

// The fused backward into o.dx, o.dgamma, o.dbeta.
void fused_backward(Context& ctx, const Inputs& in, const Tensor& dy, const Tensor& sum, const Tensor& mean,
                    const Tensor& rstd, const Tensor& d_residual, Outputs& o) {
  const Tensor gamma = copy_on(in.gamma, ctx.device);
  if (is_layer(in.kind))
    layernorm_backward_add(ctx, dy, sum, gamma, mean, rstd, d_residual, o.dx, o.dgamma, o.dbeta);
  else
    rmsnorm_backward_add(ctx, dy, sum, gamma, rstd, d_residual, o.dx, o.dgamma);
}

// Forward then backward with the fused ops, every operand a fresh copy on ctx's device.
Outputs run_fused(Context& ctx, const Inputs& in) {
  const Device d = ctx.device;
  Outputs o = fresh_outputs(in, d);
  fused_forward(ctx, in, copy_on(in.x, d), copy_on(in.residual, d), o);
  fused_backward(ctx, in, copy_on(in.dy, d), o.sum, o.mean, o.rstd, copy_on(in.d_residual, d), o);
  return o;
}

// The same with the unfused ops: add, the norm; the norm's backward, add.
Outputs run_unfused(Context& ctx, const Inputs& in) {
  const Device d = ctx.device;
  Outputs o = fresh_outputs(in, d);
  const Tensor gamma = copy_on(in.gamma, d), beta = copy_on(in.beta, d);
  add(ctx, copy_on(in.x, d), copy_on(in.residual, d), o.sum);
  Tensor through_norm = poisoned(in.x.shape(), in.x.dtype(), d);
  if (is_layer(in.kind)) {
    layernorm_forward(ctx, o.sum, gamma, beta, kEps, o.y, o.mean, o.rstd);
    layernorm_backward(ctx, copy_on(in.dy, d), o.sum, gamma, o.mean, o.rstd, through_norm, o.dgamma, o.dbeta);
  } else {
    rmsnorm_forward(ctx, o.sum, gamma, kEps, o.y, o.rstd);
    rmsnorm_backward(ctx, copy_on(in.dy, d), o.sum, gamma, o.rstd, through_norm, o.dgamma);
  }
  add(ctx, through_norm, copy_on(in.d_residual, d), o.dx);
  return o;
}

// Same dtype, shape and bytes (NaN bits included).
void expect_same_bits(const Tensor& got_any, const Tensor& want_any, const std::string& what) {
  ASSERT_EQ(got_any.defined(), want_any.defined()) << what;
  if (!got_any.defined()) return;
  const Tensor got = host(got_any), want = host(want_any);
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  int64_t differ = 0, first = -1;
  const size_t width = dtype_size(got.dtype());
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (std::memcmp(static_cast<const char*>(got.raw_data()) + i * width,
                    static_cast<const char*>(want.raw_data()) + i * width, width) != 0) {
      if (first < 0) first = i;
      ++differ;
    }
  }
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << got.numel() << " elements differ, the first at " << first
                       << " (" << (first >= 0 ? got.item(first) : 0.0) << " vs " << (first >= 0 ? want.item(first) : 0.0)
                       << ")";
}

// Elementwise: NaN exactly where the reference has NaN, and close elsewhere.
void expect_close(const Tensor& got_any, const Tensor& want_any, double tol, const std::string& what) {
  const std::vector<double> got = host(got_any).to_doubles(), ref = host(want_any).to_doubles();
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

void expect_same_outputs(const Outputs& got, const Outputs& want, const std::string& what) {
  expect_same_bits(got.sum, want.sum, what + ": sum");
  expect_same_bits(got.y, want.y, what + ": y");
  expect_same_bits(got.mean, want.mean, what + ": mean");
  expect_same_bits(got.rstd, want.rstd, what + ": rstd");
  expect_same_bits(got.dx, want.dx, what + ": dx");
  expect_same_bits(got.dgamma, want.dgamma, what + ": dgamma");
  expect_same_bits(got.dbeta, want.dbeta, what + ": dbeta");
}

}  // namespace

// The fused kernels compute what add() and the plain norm kernels compute, in the same float
// operations: every activation and statistic to the bit. The parameter gradients are summed
// by a number of workers that follows the kernel's occupancy, which may differ between the
// fused and the plain backward kernel, so they may differ in the last bit.
TEST(GpuAddNorm, EqualsTheUnfusedGpuOps) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  uint64_t seed = 7000;
  for (DType t : {DType::F32, DType::BF16}) {
    for (size_t i = 0; i < shapes().size(); ++i) {
      for (Kind kind : kKinds) {
        const Dtypes d = dtypes_for(t, i);
        const Inputs in = make_inputs(kind, shapes()[i], d, seed);
        SCOPED_TRACE(in.what);
        const Outputs fused = run_fused(gpu, in), unfused = run_unfused(gpu, in);
        expect_same_bits(fused.sum, unfused.sum, "sum");
        expect_same_bits(fused.y, unfused.y, "y");
        expect_same_bits(fused.mean, unfused.mean, "mean");
        expect_same_bits(fused.rstd, unfused.rstd, "rstd");
        expect_same_bits(fused.dx, unfused.dx, "dx");
        expect_close(fused.dgamma, unfused.dgamma, d.dgamma == DType::BF16 ? 1e-2 : 1e-6, "dgamma");
        if (kind == Kind::LayerNorm)
          expect_close(fused.dbeta, unfused.dbeta, d.dbeta == DType::BF16 ? 1e-2 : 1e-6, "dbeta");
      }
    }
  }
}

// Against the CPU reference. The sum is one float add rounded once on both: equal to the
// bit. Backward runs from the CPU's sum and statistics, so its error is its own.
TEST(GpuAddNorm, MatchesTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 8000;
  for (DType t : {DType::F32, DType::BF16}) {
    for (size_t i = 0; i < shapes().size(); ++i) {
      for (Kind kind : kKinds) {
        const Dtypes d = dtypes_for(t, i);
        const Inputs in = make_inputs(kind, shapes()[i], d, seed);
        SCOPED_TRACE(in.what);
        const Outputs ref = run_fused(cpu, in);

        Outputs g = fresh_outputs(in, kCuda);
        fused_forward(gpu, in, in.x.to(kCuda), in.residual.to(kCuda), g);
        expect_same_bits(g.sum, ref.sum, "sum");
        expect_close(g.y, ref.y, tolerance(t), "y");
        if (is_layer(kind)) expect_close(g.mean, ref.mean, 1e-5, "mean");
        expect_close(g.rstd, ref.rstd, 1e-5, "rstd");

        fused_backward(gpu, in, in.dy.to(kCuda), ref.sum.to(kCuda), is_layer(kind) ? ref.mean.to(kCuda) : Tensor(),
                       ref.rstd.to(kCuda), in.d_residual.to(kCuda), g);
        expect_close(g.dx, ref.dx, tolerance(t), "dx");
        expect_close(g.dgamma, ref.dgamma, tolerance(d.dgamma), "dgamma");
        if (kind == Kind::LayerNorm) expect_close(g.dbeta, ref.dbeta, tolerance(d.dbeta), "dbeta");
      }
    }
  }
}

// C = 1: RMSNorm's dx cancels catastrophically, and the plain GPU kernels match the CPU
// exactly there; so must the fused ones. LayerNorm's C = 1 rows give y = beta and a zero
// norm gradient, so dx is exactly the residual gradient.
TEST(GpuAddNorm, WidthOneRowsAgreeExactly) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 9000;
  for (DType t : {DType::F32, DType::BF16}) {
    for (int64_t rows : {1, 64}) {
      for (Kind kind : kKinds) {
        const Inputs in = make_inputs(kind, {rows, 1}, {t, DType::F32, DType::F32, DType::F32, DType::F32}, seed);
        SCOPED_TRACE(in.what);
        const Outputs ref = run_fused(cpu, in), got = run_fused(gpu, in);
        expect_same_bits(got.sum, ref.sum, "sum");
        expect_same_bits(got.y, ref.y, "y");
        expect_same_bits(got.mean, ref.mean, "mean");
        expect_same_bits(got.rstd, ref.rstd, "rstd");
        expect_same_bits(got.dx, ref.dx, "dx");
        if (is_layer(kind)) expect_same_bits(got.dx, in.d_residual, "dx = d_residual_in");
        expect_close(got.dgamma, ref.dgamma, 1e-6, "dgamma");
      }
    }
  }
}

// Outputs over inputs: the sum over x or the residual (the in-place residual stream), y over
// x or the residual, dx over the residual gradient, dy or x. Each must give exactly what the
// out-of-place GPU run gives, in every kernel shape (register rows vectorized and scalar,
// C = 1, the looping kernels).
TEST(GpuAddNorm, InPlaceOperands) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  uint64_t seed = 10000;
  for (Shape shape : {Shape{5, 1}, Shape{6, 256}, Shape{7, 37}, Shape{4, 8192}, Shape{3, 9001}, Shape{2, 40000}}) {
    for (DType t : {DType::F32, DType::BF16}) {
      for (Kind kind : {Kind::LayerNorm, Kind::RmsNorm}) {
        const Inputs in = make_inputs(kind, shape, {t, DType::F32, DType::F32, DType::F32, DType::F32}, seed);
        SCOPED_TRACE(in.what);
        const Outputs want = run_fused(gpu, in);
        const Tensor dy = in.dy.to(kCuda), d_residual = in.d_residual.to(kCuda);
        {
          Outputs o = fresh_outputs(in, kCuda);
          Tensor x = in.x.to(kCuda);
          o.sum = x;
          fused_forward(gpu, in, x, in.residual.to(kCuda), o);
          fused_backward(gpu, in, dy, o.sum, o.mean, o.rstd, d_residual, o);
          expect_same_outputs(o, want, "sum_out = x");
        }
        {
          Outputs o = fresh_outputs(in, kCuda);
          Tensor residual = in.residual.to(kCuda);
          o.sum = residual;
          fused_forward(gpu, in, in.x.to(kCuda), residual, o);
          fused_backward(gpu, in, dy, o.sum, o.mean, o.rstd, d_residual, o);
          expect_same_outputs(o, want, "sum_out = residual");
        }
        {
          Outputs o = fresh_outputs(in, kCuda);
          Tensor x = in.x.to(kCuda);
          o.y = x;
          fused_forward(gpu, in, x, in.residual.to(kCuda), o);
          fused_backward(gpu, in, dy, o.sum, o.mean, o.rstd, d_residual, o);
          expect_same_outputs(o, want, "y = x");
        }
        {
          Outputs o = fresh_outputs(in, kCuda);
          Tensor residual = in.residual.to(kCuda);
          o.y = residual;
          fused_forward(gpu, in, in.x.to(kCuda), residual, o);
          fused_backward(gpu, in, dy, o.sum, o.mean, o.rstd, d_residual, o);
          expect_same_outputs(o, want, "y = residual");
        }
        {
          Outputs o = fresh_outputs(in, kCuda);
          fused_forward(gpu, in, in.x.to(kCuda), in.residual.to(kCuda), o);
          o.dx = in.d_residual.to(kCuda);
          fused_backward(gpu, in, dy, o.sum, o.mean, o.rstd, o.dx, o);
          expect_same_outputs(o, want, "dx = d_residual_in");
        }
        {
          Outputs o = fresh_outputs(in, kCuda);
          fused_forward(gpu, in, in.x.to(kCuda), in.residual.to(kCuda), o);
          o.dx = in.dy.to(kCuda);
          fused_backward(gpu, in, o.dx, o.sum, o.mean, o.rstd, d_residual, o);
          expect_same_outputs(o, want, "dx = dy");
        }
        {
          Outputs o = fresh_outputs(in, kCuda);
          fused_forward(gpu, in, in.x.to(kCuda), in.residual.to(kCuda), o);
          expect_same_bits(o.sum, want.sum, "sum before dx = x");
          o.dx = o.sum;  // the backward's x is overwritten by its own dx
          fused_backward(gpu, in, dy, o.sum, o.mean, o.rstd, d_residual, o);
          expect_same_bits(o.dx, want.dx, "dx = x: dx");
          expect_same_bits(o.dgamma, want.dgamma, "dx = x: dgamma");
          expect_same_bits(o.dbeta, want.dbeta, "dx = x: dbeta");
        }
      }
    }
  }
}

// One operand one element off 16-byte alignment turns the whole launch to scalar loads, at
// widths that would otherwise be vectorized.
TEST(GpuAddNorm, MisalignedOperandsTakeTheScalarPath) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 11000;
  // A contiguous view of `t` that starts one element into a larger buffer.
  auto shifted = [](const Tensor& t) {
    Tensor buffer = Tensor::zeros({t.numel() + 1}, t.dtype(), kCuda);
    Tensor view = buffer.slice(0, 1, t.numel() + 1).reshape(t.shape());
    view.copy_from(t.to(kCuda));
    return view;
  };
  for (Shape shape : {Shape{6, 256}, Shape{3, 4096}, Shape{2, 16384}}) {
    for (DType t : {DType::F32, DType::BF16}) {
      for (Kind kind : {Kind::LayerNorm, Kind::RmsNorm}) {
        const Inputs in = make_inputs(kind, shape, {t, DType::F32, DType::F32, DType::F32, DType::F32}, seed);
        SCOPED_TRACE(in.what);
        const Outputs ref = run_fused(cpu, in);
        Outputs o = fresh_outputs(in, kCuda);
        fused_forward(gpu, in, in.x.to(kCuda), shifted(in.residual), o);  // residual misaligned
        expect_same_bits(o.sum, ref.sum, "sum");
        expect_close(o.y, ref.y, tolerance(t), "y");
        expect_close(o.rstd, ref.rstd, 1e-5, "rstd");
        Outputs s = fresh_outputs(in, kCuda);
        s.sum = shifted(in.x);  // the sum misaligned
        fused_forward(gpu, in, in.x.to(kCuda), in.residual.to(kCuda), s);
        expect_same_bits(s.sum, ref.sum, "misaligned sum");
        expect_close(s.y, ref.y, tolerance(t), "y with a misaligned sum");

        fused_backward(gpu, in, in.dy.to(kCuda), ref.sum.to(kCuda), is_layer(kind) ? ref.mean.to(kCuda) : Tensor(),
                       ref.rstd.to(kCuda), shifted(in.d_residual), o);  // residual gradient misaligned
        expect_close(o.dx, ref.dx, tolerance(t), "dx");
        expect_close(o.dgamma, ref.dgamma, 1e-5, "dgamma");
        if (is_layer(kind)) expect_close(o.dbeta, ref.dbeta, 1e-5, "dbeta");
      }
    }
  }
}

// A NaN in x or the residual makes its row NaN (sum element, y, statistics); a NaN in dy makes
// its row of dx NaN; a NaN in the residual gradient only its own element of dx. As the CPU.
TEST(GpuAddNorm, NanPropagatesLikeTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 12000;
  for (DType t : {DType::F32, DType::BF16}) {
    for (Shape shape : {Shape{5, 7}, Shape{5, 4096}, Shape{5, 9001}}) {
      for (Kind kind : {Kind::LayerNorm, Kind::RmsNorm}) {
        const int64_t cols = shape.back();
        Inputs in = make_inputs(kind, shape, {t, DType::F32, DType::F32, DType::F32, DType::F32}, seed);
        SCOPED_TRACE(in.what);
        in.x.set_item(cols + 3, NAN);             // row 1
        in.residual.set_item(2 * cols + 1, NAN);  // row 2
        in.dy.set_item(3 * cols + 5, NAN);        // row 3
        in.d_residual.set_item(4 * cols + 6, NAN);  // row 4, one element
        const Outputs ref = run_fused(cpu, in);
        Outputs g = fresh_outputs(in, kCuda);
        fused_forward(gpu, in, in.x.to(kCuda), in.residual.to(kCuda), g);
        expect_close(g.sum, ref.sum, 1e-12, "sum");  // exact but for the NaNs' payload bits
        expect_close(g.y, ref.y, tolerance(t), "y");
        expect_close(g.rstd, ref.rstd, 1e-5, "rstd");
        fused_backward(gpu, in, in.dy.to(kCuda), ref.sum.to(kCuda), is_layer(kind) ? ref.mean.to(kCuda) : Tensor(),
                       ref.rstd.to(kCuda), in.d_residual.to(kCuda), g);
        expect_close(g.dx, ref.dx, tolerance(t), "dx");
        expect_close(g.dgamma, ref.dgamma, 1e-5, "dgamma");
        const Tensor dx = host(g.dx);
        EXPECT_TRUE(std::isnan(host(g.y).item(2 * cols)));
        EXPECT_TRUE(std::isnan(dx.item(3 * cols)));
        EXPECT_TRUE(std::isnan(dx.item(4 * cols + 6)));
        EXPECT_FALSE(std::isnan(dx.item(4 * cols + 5)));
      }
    }
  }
}

// No atomics anywhere: two runs give the same bits, parameter gradients included.
TEST(GpuAddNorm, RunToRunDeterministic) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  uint64_t seed = 13000;
  for (Shape shape : {Shape{512, 4096}, Shape{333, 257}, Shape{4096, 8}, Shape{8, 40000}}) {
    for (DType t : {DType::BF16, DType::F32}) {
      for (Kind kind : {Kind::LayerNorm, Kind::RmsNorm}) {
        const Inputs in = make_inputs(kind, shape, {t, DType::F32, DType::F32, DType::F32, DType::F32}, seed);
        SCOPED_TRACE(in.what);
        expect_same_outputs(run_fused(gpu, in), run_fused(gpu, in), "second run");
      }
    }
  }
}

TEST(GpuAddNorm, UnsupportedDtypesAreAClearError) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  Tensor gamma = Tensor::zeros({8}, DType::F32, kCuda), rstd = Tensor::zeros({2}, DType::F32, kCuda);
  Tensor x = Tensor::zeros({2, 8}, DType::F16, kCuda), sum = Tensor::zeros({2, 8}, DType::F16, kCuda),
         y = Tensor::zeros({2, 8}, DType::F16, kCuda);
  EXPECT_THROW(add_rmsnorm_forward(gpu, x, x, gamma, kEps, sum, y, rstd), Error);
  // The CPU reads a residual of another dtype as add() does; the GPU kernels want one dtype.
  Tensor xf = Tensor::zeros({2, 8}, DType::F32, kCuda), rbf = Tensor::zeros({2, 8}, DType::BF16, kCuda);
  Tensor sumf = Tensor::zeros({2, 8}, DType::F32, kCuda), yf = Tensor::zeros({2, 8}, DType::F32, kCuda);
  EXPECT_THROW(add_rmsnorm_forward(gpu, xf, rbf, gamma, kEps, sumf, yf, rstd), Error);
  Tensor dgamma = Tensor::zeros({8}, DType::F32, kCuda);
  EXPECT_THROW(rmsnorm_backward_add(gpu, xf, xf, gamma, rstd, rbf, yf, dgamma), Error);
}
