// Bandwidth benchmark of the memory-bound kernels on the GPU: norms (plain and with the
// residual add fused), elementwise ops, activations, casts, softmax, cross-entropy and FP8
// per-tensor quantization, each through its op front end with a CUDA Context, against the
// device-to-device cudaMemcpyAsync of the same shape measured in the same run (the ceiling)
// and tessera's own copy kernel.
//
// Shapes: rows x cols = 16384 x 4096 BF16 (a 4096-wide model's activations at 16K tokens)
// and 16384 x 768 (GPT-2's width; 25 MB per tensor, so part of it stays in the 50 MB L2 from
// one run to the next: those figures, the memcpy included, run above HBM bandwidth).
//
// Bytes: every tensor an op must read or write is counted once (activations, weights and
// biases, saved statistics, targets; a parameter gradient that accumulates counts as read
// and written). Scratch traffic a kernel chooses to have (the partial sums of the norm
// backward's parameter gradients, re-reads) is not counted: the figure is the bandwidth of
// the useful traffic. GB/s = bytes / median time; "% copy" divides by the cudaMemcpy
// figure of the same shape (which itself moves 2 x the tensor: read + write).
//
// Timing: CUDA events around one call, 5 warm-up calls, median of `runs` (default 30).
// Correctness in the same run: outputs are poisoned (all bits set: NaN), the op runs once
// more, and 96 sample rows (first, middle and last 32) are compared with the CPU reference
// run on the same sample rows (relative L2 error < 1e-2 for BF16 outputs, < 1e-5 for F32
// statistics, bytes equal for FP8 codes); parameter gradients, the loss and amax take the
// CPU reference over the whole tensor. NaN never passes.
//
// blockcast: the fused 1x128 FP8 cast with both copies against its two-pass path.
// castbias: the FP8 cast + transpose with the bias gradient (one read of dy) against the cast
// then bias_grad; gelufp8: GELU -> FP8 forward and backward (+ dbias) against gelu in BF16
// then the cast; both checked against their unfused pair in the same run. lm_head_loss: the
// LM head's loss and gradient (cross_entropy_forward_backward) at 2048 x 128256 and 2048 x
// 50257, one pass over the logits against the forward then the backward.
//
// Usage: bench_bandwidth [runs] [filter] [--sweep-norm]
//   filter: run only ops whose name contains it (for profiling one kernel with ncu, runs = 1);
//   --sweep-norm: repeat under every launch shape of the norm kernels (cuda::NormTuning),
//   the row-group and the warp-row families (--sweep-norm-warp: the warp-row family only)
//   --sweep-norm-backward: the backward kernels' variants (the finalize launched in stream
//   order instead of as a programmatic dependent, row-group at one or two vectors a thread,
//   warp-row at 8 and 16 words a lane)
//   --sweep-softmax: repeat under each softmax forward / cross-entropy kernel choice
//     (cuda::RowTuning: previous kernels, warp-row kernels with automatic and forced lanes
//     per row) at both shapes; the filter may list several names, comma-separated
//     (e.g. `bench_bandwidth 20 softmax,cross_entropy --sweep-softmax`)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gpu_timing.h"
#include "backend/cuda/copy.h"
#include "backend/cuda/norm.h"
#include "backend/cuda/softmax_tuning.h"
#include "tessera/core/allocator.h"
#include "tessera/core/random.h"
#include "tessera/fp8/block_quantized_tensor.h"
#include "tessera/fp8/device_scaling.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/ops/moe.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/activation.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/loss.h"
#include "tessera/ops/norm.h"
#include "tessera/ops/quantize.h"
#include "tessera/ops/softmax.h"

using namespace tessera;

namespace {


int g_runs = 30;
const char* g_filter = nullptr;
const Device kGpu = Device::cuda();
const Device kCpu = Device::cpu();
constexpr float kEps = 1e-5f;


// ---- Checks --------------------------------------------------------------------------------

struct Check {
  bool ok = true;
  std::string worst;  // the failing comparisons, or the largest error
  double max_err = 0;
  void expect(double err, double tol, const std::string& what) {
    if (!(err <= tol)) {
      ok = false;
      worst += (worst.empty() ? "" : "; ") + what + " err " + std::to_string(err);
    }
    if (std::isnan(err)) max_err = INFINITY;
    else max_err = std::max(max_err, err);
  }
  std::string text() const {
    if (!ok) return "FAIL (" + worst + ")";
    char buf[64];
    std::snprintf(buf, sizeof buf, "PASS (%.1e)", max_err);
    return buf;
  }
};

double rel_error(const Tensor& got_any, const Tensor& want_any) {
  const std::vector<double> g = got_any.to(kCpu).to_doubles(), w = want_any.to(kCpu).to_doubles();
  if (g.size() != w.size()) return INFINITY;
  double diff = 0, ref = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i]) || std::isnan(w[i])) return INFINITY;  // NaN never passes
    diff += (g[i] - w[i]) * (g[i] - w[i]);
    ref += w[i] * w[i];
  }
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

// Fraction of differing bytes (0 when identical).
double byte_mismatch(const Tensor& got_any, const Tensor& want_any) {
  const Tensor g = got_any.to(kCpu), w = want_any.to(kCpu);
  if (g.nbytes() != w.nbytes()) return 1;
  const auto* a = static_cast<const uint8_t*>(g.raw_data());
  const auto* b = static_cast<const uint8_t*>(w.raw_data());
  size_t bad = 0;
  for (size_t i = 0; i < g.nbytes(); ++i) bad += a[i] != b[i];
  return double(bad) / double(std::max<size_t>(1, g.nbytes()));
}

// The sampled rows: the first, middle and last 32 (fewer when rows is small).
std::vector<std::pair<int64_t, int64_t>> sample_ranges(int64_t rows) {
  const int64_t k = std::min<int64_t>(32, rows / 3);
  if (k == 0) return {{0, rows}};
  return {{0, k}, {rows / 2, rows / 2 + k}, {rows - k, rows}};
}

// The sample rows of a [rows, ...] tensor (any device), as one contiguous host tensor.
Tensor sample(const Tensor& t) {
  const auto ranges = sample_ranges(t.size(0));
  int64_t n = 0;
  for (auto [a, b] : ranges) n += b - a;
  Shape shape = t.shape();
  shape[0] = n;
  Tensor h = Tensor::empty(shape, t.dtype(), kCpu);
  int64_t o = 0;
  for (auto [a, b] : ranges) {
    Tensor dst = h.slice(0, o, o + (b - a));
    dst.copy_from(t.slice(0, a, b));
    o += b - a;
  }
  return h;
}

void poison(Tensor& t) { CHECK_CUDA(cudaMemsetAsync(t.raw_data(), 0xff, t.nbytes(), nullptr)); }

Tensor cpu_empty_like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), kCpu); }

// ---- Results -------------------------------------------------------------------------------

struct Result {
  std::string name;
  double bytes, ms;
  std::string check;
};

struct Table {
  int64_t rows, cols;
  double copy_gbs = 0;
  std::vector<Result> results;

  // The filter's comma-separated names: any one contained in `name`.
  bool wanted(const std::string& name) const {
    if (!g_filter) return true;
    const std::string f = g_filter;
    for (size_t a = 0; a <= f.size();) {
      const size_t b = std::min(f.find(',', a), f.size());
      if (b > a && name.find(f.substr(a, b - a)) != std::string::npos) return true;
      a = b + 1;
    }
    return false;
  }

  void add(const std::string& name, double bytes, double ms, const std::string& check) {
    const double gbs = bytes / (ms * 1e-3) * 1e-9;
    if (name == "cudaMemcpyAsync D2D") copy_gbs = gbs;
    results.push_back({name, bytes, ms, check});
    std::printf("  %-34s %9.1f MB %9.1f us %8.1f GB/s %6.1f%%  %s\n", name.c_str(), bytes * 1e-6, ms * 1e3, gbs,
                copy_gbs > 0 ? 100.0 * gbs / copy_gbs : 0.0, check.c_str());
    std::fflush(stdout);
  }

  void print() const {
    std::printf("\n### tessera, %lld x %lld BF16 (median of %d runs; %% of the cudaMemcpy D2D figure)\n\n",
                (long long)rows, (long long)cols, g_runs);
    std::printf("| op | MB moved | us | GB/s | %% of memcpy | check |\n| --- | ---: | ---: | ---: | ---: | --- |\n");
    for (const Result& r : results) {
      const double gbs = r.bytes / (r.ms * 1e-3) * 1e-9;
      std::printf("| %s | %.1f | %.1f | %.0f | %.1f%% | %s |\n", r.name.c_str(), r.bytes * 1e-6, r.ms * 1e3, gbs,
                  copy_gbs > 0 ? 100.0 * gbs / copy_gbs : 0.0, r.check.c_str());
    }
    std::fflush(stdout);
  }
};

Tensor randn(const Shape& shape, DType t, uint64_t seed, float std = 1.0f) {
  Context ctx = Context::cuda();
  Tensor x = Tensor::empty(shape, t, kGpu);
  fill_normal(ctx, x, 0.0f, std, seed);
  return x;
}

// ---- The benchmark of one shape --------------------------------------------------------------

void run_shape(int64_t R, int64_t C) {
  Context gpu = Context::cuda(), cpu = Context::cpu();
  Table table{R, C};
  const DType bf = DType::BF16, f32 = DType::F32;
  const double N = double(R) * double(C);  // elements of one activation
  const double A = 2 * N;                  // bytes of one BF16 activation
  const double stat = 4.0 * R;             // one F32 per row (mean, rstd, lse, I32 target)
  std::printf("\n== %lld x %lld BF16 ==\n", (long long)R, (long long)C);

  Tensor x = randn({R, C}, bf, 1), res = randn({R, C}, bf, 2), dy = randn({R, C}, bf, 3);
  Tensor gamma = randn({C}, bf, 4, 0.5f), beta = randn({C}, bf, 5, 0.5f);

  // Copies: the ceiling (always run, since every fraction divides by it) and tessera's kernel.
  {
    Tensor out = Tensor::empty({R, C}, bf, kGpu);
    const double ms = median_ms(
        [&] { CHECK_CUDA(cudaMemcpyAsync(out.raw_data(), x.raw_data(), x.nbytes(), cudaMemcpyDeviceToDevice, nullptr)); },
        g_runs);
    Check c;
    c.expect(byte_mismatch(sample(out), sample(x)), 0, "copy");
    table.add("cudaMemcpyAsync D2D", 2 * A, ms, c.text());
    if (table.wanted("copy")) {
      const int64_t strides[2] = {C, 1}, shape[2] = {R, C};
      auto fn = [&] { cuda::copy_strided(nullptr, out.raw_data(), strides, x.raw_data(), strides, shape, 2, 2); };
      const double ms2 = median_ms(fn, g_runs);
      poison(out);
      fn();
      Check c2;
      c2.expect(byte_mismatch(sample(out), sample(x)), 0, "copy");
      table.add("tessera copy_strided (copy kernel)", 2 * A, ms2, c2.text());
    }
  }

  // ---- LayerNorm / RMSNorm, plain and with the residual add ----
  // Forward bytes: x (+ residual) read, y (+ sum) written, gamma (+ beta) read, mean/rstd written.
  // Backward bytes: dy, x (+ d_residual) read, dx written, gamma and mean/rstd read, dgamma
  // (+ dbeta, F32) read and written (they accumulate).
  for (bool layer : {true, false}) {
    for (bool fused : {false, true}) {
      const std::string base = std::string(fused ? "add_" : "") + (layer ? "layernorm" : "rmsnorm");
      const std::string fwd_name = base + "_forward";
      const std::string bwd_name = layer ? (fused ? "layernorm_backward_add" : "layernorm_backward")
                                         : (fused ? "rmsnorm_backward_add" : "rmsnorm_backward");
      if (!table.wanted(fwd_name) && !table.wanted(bwd_name)) continue;
      Tensor y = Tensor::empty({R, C}, bf, kGpu), sum = Tensor::empty({R, C}, bf, kGpu);
      Tensor mean = Tensor::empty({R}, f32, kGpu), rstd = Tensor::empty({R}, f32, kGpu);
      const Tensor b = layer ? beta : Tensor();
      auto fwd = [&] {
        if (fused && layer) add_layernorm_forward(gpu, x, res, gamma, b, kEps, sum, y, mean, rstd);
        else if (fused) add_rmsnorm_forward(gpu, x, res, gamma, kEps, sum, y, rstd);
        else if (layer) layernorm_forward(gpu, x, gamma, b, kEps, y, mean, rstd);
        else rmsnorm_forward(gpu, x, gamma, kEps, y, rstd);
      };
      const Tensor& normed = fused ? sum : x;  // the tensor the norm saw (backward's x)
      {
        const double ms = table.wanted(fwd_name) ? median_ms(fwd, g_runs) : 0;
        poison(y);
        poison(sum);
        poison(mean);
        poison(rstd);
        fwd();
        Check c;
        Tensor sx = sample(x), sr = sample(res), sy = cpu_empty_like(sx), ss = cpu_empty_like(sx);
        Tensor sm = Tensor::empty({sx.size(0)}, f32, kCpu), sd = Tensor::empty({sx.size(0)}, f32, kCpu);
        const Tensor hg = gamma.to(kCpu), hb = b.defined() ? b.to(kCpu) : Tensor();
        if (fused && layer) add_layernorm_forward(cpu, sx, sr, hg, hb, kEps, ss, sy, sm, sd);
        else if (fused) add_rmsnorm_forward(cpu, sx, sr, hg, kEps, ss, sy, sd);
        else if (layer) layernorm_forward(cpu, sx, hg, hb, kEps, sy, sm, sd);
        else rmsnorm_forward(cpu, sx, hg, kEps, sy, sd);
        c.expect(rel_error(sample(y), sy), 1e-2, "y");
        if (fused) c.expect(byte_mismatch(sample(sum), ss), 0, "sum");
        if (layer) c.expect(rel_error(sample(mean), sm), 1e-5, "mean");
        c.expect(rel_error(sample(rstd), sd), 1e-5, "rstd");
        const double bytes = (fused ? 4 : 2) * A + 2.0 * C * (layer ? 2 : 1) + stat * (layer ? 2 : 1);
        if (table.wanted(fwd_name)) table.add(fwd_name, bytes, ms, c.text());
      }
      if (table.wanted(bwd_name)) {
        Tensor dx = Tensor::empty({R, C}, bf, kGpu);
        Tensor dgamma = Tensor::zeros({C}, f32, kGpu), dbeta = layer ? Tensor::zeros({C}, f32, kGpu) : Tensor();
        const Tensor& dres = res;  // any [R, C] tensor serves as the incoming residual gradient
        auto bwd = [&] {
          if (fused && layer) layernorm_backward_add(gpu, dy, normed, gamma, mean, rstd, dres, dx, dgamma, dbeta);
          else if (fused) rmsnorm_backward_add(gpu, dy, normed, gamma, rstd, dres, dx, dgamma);
          else if (layer) layernorm_backward(gpu, dy, normed, gamma, mean, rstd, dx, dgamma, dbeta);
          else rmsnorm_backward(gpu, dy, normed, gamma, rstd, dx, dgamma);
        };
        const double ms = median_ms(bwd, g_runs);
        poison(dx);
        dgamma = Tensor::zeros({C}, f32, kGpu);
        if (layer) dbeta = Tensor::zeros({C}, f32, kGpu);
        bwd();
        // The CPU reference over every row (the parameter gradients sum all of them).
        Check c;
        const Tensor hdy = dy.to(kCpu), hx = normed.to(kCpu), hg = gamma.to(kCpu), hm = mean.to(kCpu),
                     hr = rstd.to(kCpu), hres = dres.to(kCpu);
        Tensor hdx = cpu_empty_like(hdy), hdg = Tensor::zeros({C}, f32, kCpu),
               hdb = layer ? Tensor::zeros({C}, f32, kCpu) : Tensor();
        if (fused && layer) layernorm_backward_add(cpu, hdy, hx, hg, hm, hr, hres, hdx, hdg, hdb);
        else if (fused) rmsnorm_backward_add(cpu, hdy, hx, hg, hr, hres, hdx, hdg);
        else if (layer) layernorm_backward(cpu, hdy, hx, hg, hm, hr, hdx, hdg, hdb);
        else rmsnorm_backward(cpu, hdy, hx, hg, hr, hdx, hdg);
        c.expect(rel_error(sample(dx), sample(hdx)), 1e-2, "dx");
        c.expect(rel_error(dgamma, hdg), 1e-5, "dgamma");
        if (layer) c.expect(rel_error(dbeta, hdb), 1e-5, "dbeta");
        const double bytes =
            (fused ? 4 : 3) * A + 2.0 * C + stat * (layer ? 2 : 1) + 2 * 4.0 * C * (layer ? 2 : 1);
        table.add(bwd_name, bytes, ms, c.text());
      }
    }
  }

  // ---- Elementwise: add, scale, GELU, SwiGLU (x is [R, 2C]) ----
  if (table.wanted("add(")) {
    Tensor out = Tensor::empty({R, C}, bf, kGpu);
    auto fn = [&] { add(gpu, x, res, out); };
    const double ms = median_ms(fn, g_runs);
    poison(out);
    fn();
    Tensor sx = sample(x), want = cpu_empty_like(sx);
    add(cpu, sx, sample(res), want);
    Check c;
    c.expect(rel_error(sample(out), want), 1e-2, "out");
    table.add("add(a, b)", 3 * A, ms, c.text());
  }
  if (table.wanted("scale")) {
    Tensor out = Tensor::empty({R, C}, bf, kGpu);
    auto fn = [&] { scale(gpu, x, 0.37f, out); };
    const double ms = median_ms(fn, g_runs);
    poison(out);
    fn();
    Tensor sx = sample(x), want = cpu_empty_like(sx);
    scale(cpu, sx, 0.37f, want);
    Check c;
    c.expect(rel_error(sample(out), want), 1e-2, "out");
    table.add("scale", 2 * A, ms, c.text());
  }
  if (table.wanted("gelu")) {
    Tensor y = Tensor::empty({R, C}, bf, kGpu), dx = Tensor::empty({R, C}, bf, kGpu);
    auto fwd = [&] { gelu_forward(gpu, x, y); };
    auto bwd = [&] { gelu_backward(gpu, x, dy, dx); };
    const double ms_f = median_ms(fwd, g_runs), ms_b = median_ms(bwd, g_runs);
    poison(y);
    poison(dx);
    fwd();
    bwd();
    Tensor sx = sample(x), sdy = sample(dy), wy = cpu_empty_like(sx), wdx = cpu_empty_like(sx);
    gelu_forward(cpu, sx, wy);
    gelu_backward(cpu, sx, sdy, wdx);
    Check cf, cb;
    cf.expect(rel_error(sample(y), wy), 1e-2, "y");
    cb.expect(rel_error(sample(dx), wdx), 1e-2, "dx");
    table.add("gelu_forward", 2 * A, ms_f, cf.text());
    table.add("gelu_backward", 3 * A, ms_b, cb.text());
  }
  if (table.wanted("swiglu")) {
    Tensor x2 = randn({R, 2 * C}, bf, 6), y = Tensor::empty({R, C}, bf, kGpu), dx2 = Tensor::empty({R, 2 * C}, bf, kGpu);
    auto fwd = [&] { swiglu_forward(gpu, x2, y); };
    auto bwd = [&] { swiglu_backward(gpu, x2, dy, dx2); };
    const double ms_f = median_ms(fwd, g_runs), ms_b = median_ms(bwd, g_runs);
    poison(y);
    poison(dx2);
    fwd();
    bwd();
    Tensor sx = sample(x2), sdy = sample(dy), wy = cpu_empty_like(sdy), wdx = cpu_empty_like(sx);
    swiglu_forward(cpu, sx, wy);
    swiglu_backward(cpu, sx, sdy, wdx);
    Check cf, cb;
    cf.expect(rel_error(sample(y), wy), 1e-2, "y");
    cb.expect(rel_error(sample(dx2), wdx), 1e-2, "dx");
    table.add("swiglu_forward (x [R, 2C])", 3 * A, ms_f, cf.text());
    table.add("swiglu_backward", 5 * A, ms_b, cb.text());
  }
  // ---- MoE scaled SwiGLU (Mixtral: x [16384, 2 x 14336] BF16, h [16384, 14336]) ----
  // The vector kernels against the legacy scalar ones (set_moe_swiglu_legacy, i.e.
  // TESSERA_MOE_LEGACY=1), and the FP8 backward (d_scale + amax pass, then the cast pass, dx
  // never stored) against the unfused pair (BF16 backward with dx's amax, then
  // moe_fp8_quantize_rows), E5M2 over 8 experts (one without rows). Bytes per element of h:
  // forward 6 (x 4 read, h 2 written), backward 10 (x 4 + dy 2 read, dx 4 written), FP8
  // backward 16 (x and dy read twice, 2 codes written twice), unfused 18 (+ dx 4 written and
  // read, 4 codes). Checked in the same run: y and dx bit-identical to the legacy kernels',
  // the sample rows against the CPU reference, and the fused codes (data, data_t, scale_inv)
  // and d_scale byte for byte against the unfused pair's. At the first shape only.
  if (table.wanted("moe_swiglu") && C == 4096) {
    const int64_t M = 16384, F = 14336;
    const double NH = double(M) * double(F);
    const bool legacy_before = moe_swiglu_legacy();
    Tensor xm = randn({M, 2 * F}, bf, 31, 2.0f), dym = randn({M, F}, bf, 32);
    Tensor prob = Tensor::empty({M}, f32, kGpu);
    fill_uniform(gpu, prob, 0.0f, 1.0f, 33);
    Tensor y = Tensor::empty({M, F}, bf, kGpu), y_l = y.clone(), dxm = Tensor::empty({M, 2 * F}, bf, kGpu);
    Tensor dx_l = dxm.clone(), ds = Tensor::empty({M}, f32, kGpu), ds_l = ds.clone(), ds_f = ds.clone();
    Tensor am = Tensor::empty({1}, f32, kGpu), am_l = am.clone();
    auto with_legacy = [&](bool legacy, const std::function<void()>& fn) {
      set_moe_swiglu_legacy(legacy);
      fn();
      set_moe_swiglu_legacy(legacy_before);
    };
    auto fwd = [&] { with_legacy(false, [&] { moe_swiglu_scaled_forward(gpu, xm, prob, y); }); };
    auto fwd_l = [&] { with_legacy(true, [&] { moe_swiglu_scaled_forward(gpu, xm, prob, y_l); }); };
    auto bwd = [&] { with_legacy(false, [&] { moe_swiglu_scaled_backward(gpu, xm, prob, dym, dxm, ds, &am); }); };
    auto bwd_l = [&] { with_legacy(true, [&] { moe_swiglu_scaled_backward(gpu, xm, prob, dym, dx_l, ds_l, &am_l); }); };
    const std::vector<int64_t> splits = {2053, 0, 3000, 1999, 2500, 2100, 2400, 2332};
    MoEFp8Options o;
    auto fused = [&] { return moe_swiglu_scaled_backward_quantize(gpu, xm, prob, dym, splits, DType::E5M2, o, ds_f); };
    auto unfused = [&] {
      MoEFp8Rows q;
      with_legacy(false, [&] {
        moe_swiglu_scaled_backward(gpu, xm, prob, dym, dxm, ds, &am);
        q = moe_fp8_quantize_rows(gpu, dxm, am, splits, DType::E5M2, o);
      });
      return q;
    };
    const double ms_f = median_ms(fwd, g_runs), ms_fl = median_ms(fwd_l, g_runs);
    const double ms_b = median_ms(bwd, g_runs), ms_bl = median_ms(bwd_l, g_runs);
    const double ms_q = median_ms([&] { fused(); }, g_runs), ms_ql = median_ms([&] { unfused(); }, g_runs);
    for (Tensor* t : {&y, &y_l, &dxm, &dx_l, &ds, &ds_l, &am, &am_l}) poison(*t);
    fwd();
    fwd_l();
    bwd();
    bwd_l();
    Check cf, cb;
    cf.expect(byte_mismatch(y, y_l), 0, "y vs legacy");
    cb.expect(byte_mismatch(dxm, dx_l), 0, "dx vs legacy");
    cb.expect(byte_mismatch(am, am_l), 0, "amax vs legacy");
    cb.expect(rel_error(ds, ds_l), 1e-5, "d_scale vs legacy");
    {
      const Tensor sx = sample(xm), sp = sample(prob), sdy = sample(dym);
      Tensor wy = cpu_empty_like(sdy), wdx = cpu_empty_like(sx), wds = cpu_empty_like(sp);
      moe_swiglu_scaled_forward(cpu, sx, sp, wy);
      moe_swiglu_scaled_backward(cpu, sx, sp, sdy, wdx, wds);
      cf.expect(rel_error(sample(y), wy), 1e-2, "y vs cpu");
      cb.expect(rel_error(sample(dxm), wdx), 1e-2, "dx vs cpu");
      cb.expect(rel_error(sample(ds), wds), 1e-4, "d_scale vs cpu");
    }
    Check cq;
    {
      poison(ds_f);
      const MoEFp8Rows a = fused(), b = unfused();
      cq.expect(byte_mismatch(a.data, b.data), 0, "data");
      cq.expect(byte_mismatch(a.data_t, b.data_t), 0, "data_t");
      cq.expect(byte_mismatch(a.scale_inv, b.scale_inv), 0, "scale_inv");
      cq.expect(byte_mismatch(ds_f, ds), 0, "d_scale");
    }
    table.add("moe_swiglu_forward vector", 6 * NH, ms_f, cf.text());
    table.add("moe_swiglu_forward legacy", 6 * NH, ms_fl, cf.text());
    table.add("moe_swiglu_backward vector (+amax)", 10 * NH, ms_b, cb.text());
    table.add("moe_swiglu_backward legacy (+amax)", 10 * NH, ms_bl, cb.text());
    table.add("moe_swiglu_backward -> E5M2 (2 passes)", 16 * NH, ms_q, cq.text());
    table.add("moe_swiglu_backward, then cast rows", 18 * NH, ms_ql, cq.text());
    // Delayed scaling's one pass (moe_swiglu_scaled_backward_cast): the scale known before the
    // pass, here the one current scaling made from am, so its codes must be the two-pass
    // form's; d_scale from per-tile partial sums (another order: 1e-5), the amax folded in.
    // 10 B per element of h (x and dy read once, 2 codes written twice).
    {
      Tensor scale_1 = Tensor::empty({1}, f32, kGpu), am_1 = Tensor::zeros({1}, f32, kGpu), ds_1 = ds.clone();
      fp8::scale_from_amax(gpu, am, DType::E5M2, 0, false, scale_1);
      auto one = [&] { return moe_swiglu_scaled_backward_cast(gpu, xm, prob, dym, scale_1, splits, DType::E5M2, ds_1, &am_1); };
      const double ms_1 = median_ms([&] { one(); }, g_runs);
      poison(ds_1);
      const MoEFp8Rows a = one(), b = unfused();
      Check c1;
      c1.expect(byte_mismatch(a.data, b.data), 0, "data");
      c1.expect(byte_mismatch(a.data_t, b.data_t), 0, "data_t");
      c1.expect(rel_error(ds_1, ds), 1e-5, "d_scale");
      c1.expect(byte_mismatch(am_1, am), 0, "amax");
      table.add("moe_swiglu_backward -> E5M2, delayed (1 pass)", 10 * NH, ms_1, c1.text());
    }
    // The forward's SwiGLU -> E4M3 cast with the scale known (delayed scaling: one pass, x read
    // 4 B, 2 codes written = 6 B per element of h), its codes checked against current
    // scaling's two-pass cast, whose scale the given one is.
    {
      Tensor h_amax = Tensor::empty({1}, f32, kGpu), scale_h = Tensor::empty({1}, f32, kGpu);
      moe_swiglu_scaled_amax(gpu, xm, prob, h_amax);
      fp8::scale_from_amax(gpu, h_amax, DType::E4M3, 0, false, scale_h);
      auto cast = [&] { return moe_swiglu_scaled_cast(gpu, xm, prob, scale_h, splits, DType::E4M3); };
      const double ms_c = median_ms([&] { cast(); }, g_runs);
      const MoEFp8Rows a = cast(), b = moe_swiglu_scaled_quantize(gpu, xm, prob, splits, DType::E4M3, o);
      Check cc;
      cc.expect(byte_mismatch(a.data, b.data), 0, "data");
      cc.expect(byte_mismatch(a.data_t, b.data_t), 0, "data_t");
      table.add("moe_swiglu_forward -> E4M3, delayed (1 pass)", 6 * NH, ms_c, cc.text());
    }
  }

  // ---- Casts (the cast op; every dtype pair has a kernel) ----
  if (table.wanted("cast")) {
    Tensor xf = randn({R, C}, f32, 7), xb = Tensor::empty({R, C}, bf, kGpu), back = Tensor::empty({R, C}, f32, kGpu);
    auto to_bf = [&] { cast(gpu, xf, xb); };
    auto to_f = [&] { cast(gpu, xb, back); };
    const double ms1 = median_ms(to_bf, g_runs), ms2 = median_ms(to_f, g_runs);
    poison(xb);
    poison(back);
    to_bf();
    to_f();
    Tensor sf = sample(xf), wb = Tensor::empty(sf.shape(), bf, kCpu), wf = Tensor::empty(sf.shape(), f32, kCpu);
    cast(cpu, sf, wb);
    cast(cpu, wb, wf);
    Check c1, c2;
    c1.expect(byte_mismatch(sample(xb), wb), 0, "bf16");
    c2.expect(byte_mismatch(sample(back), wf), 0, "f32");
    table.add("cast F32 -> BF16", 6.0 * N, ms1, c1.text());
    table.add("cast BF16 -> F32", 6.0 * N, ms2, c2.text());
  }

  // ---- Softmax ----
  if (table.wanted("softmax")) {
    Tensor y = Tensor::empty({R, C}, bf, kGpu), dx = Tensor::empty({R, C}, bf, kGpu);
    auto fwd = [&] { softmax_forward(gpu, x, y); };
    auto bwd = [&] { softmax_backward(gpu, y, dy, dx); };
    const double ms_f = median_ms(fwd, g_runs);
    poison(y);
    fwd();
    const double ms_b = median_ms(bwd, g_runs);
    poison(dx);
    bwd();
    Tensor sx = sample(x), sy = sample(y), wy = cpu_empty_like(sx), wdx = cpu_empty_like(sx);
    softmax_forward(cpu, sx, wy);
    softmax_backward(cpu, sy, sample(dy), wdx);
    Check cf, cb;
    cf.expect(rel_error(sy, wy), 1e-2, "y");
    cb.expect(rel_error(sample(dx), wdx), 1e-2, "dx");
    table.add("softmax_forward", 2 * A, ms_f, cf.text());
    table.add("softmax_backward", 3 * A, ms_b, cb.text());
  }

  // ---- Cross-entropy on [R, C] logits (C is the vocabulary here) ----
  // Forward: logits, targets (I32) read, lse written, the loss (4 bytes). Backward: logits,
  // targets, lse read, d_logits written.
  if (table.wanted("cross_entropy")) {
    std::vector<int64_t> t(R);
    for (int64_t i = 0; i < R; ++i) t[i] = (i * 2654435761LL) % C;
    const Tensor targets = Tensor::from_ints(t, {R}, DType::I32).to(kGpu);
    Tensor loss = Tensor::empty({1}, f32, kGpu), lse = Tensor::empty({R}, f32, kGpu);
    Tensor dl = Tensor::empty({R, C}, bf, kGpu);
    auto fwd = [&] { cross_entropy_forward(gpu, x, targets, loss, lse); };
    auto bwd = [&] { cross_entropy_backward(gpu, x, targets, lse, 1.0f, dl); };
    const double ms_f = median_ms(fwd, g_runs);
    poison(loss);
    poison(lse);
    fwd();
    const double ms_b = median_ms(bwd, g_runs);
    poison(dl);
    bwd();
    Check cf, cb;
    {  // the loss over every row; lse and d_logits on the sample rows
      const Tensor hx = x.to(kCpu), ht = targets.to(kCpu);
      Tensor hl = Tensor::empty({1}, f32, kCpu), hlse = Tensor::empty({R}, f32, kCpu);
      cross_entropy_forward(cpu, hx, ht, hl, hlse);
      cf.expect(rel_error(loss, hl), 1e-5, "loss");
      cf.expect(rel_error(sample(lse), sample(hlse)), 1e-5, "lse");
      Tensor sx = sample(x), st = sample(targets), wdl = cpu_empty_like(sx);
      // d_loss / n_valid must equal the full run's 1 / R: scale d_loss by sample rows / R.
      cross_entropy_backward(cpu, sx, st, sample(hlse), float(double(sx.size(0)) / double(R)), wdl);
      cb.expect(rel_error(sample(dl), wdl), 1e-2, "d_logits");
    }
    table.add("cross_entropy_forward", A + 2 * stat + 4, ms_f, cf.text());
    table.add("cross_entropy_backward", 2 * A + 2 * stat, ms_b, cb.text());
  }

  // ---- The LM head's loss and gradient (cross_entropy_forward_backward) ----
  // At the head's own shapes (a 2048-row chunk of Llama-3's 128256 and of GPT-2's 50257 in
  // rows padded to 50264), not [R, C]; once, with the first shape. The gradient goes to its
  // own buffer (the logits stay for the next run). One pass moves the logits in and the
  // gradient out (2 x bytes); the forward then the backward read the logits twice (3 x).
  if (table.wanted("lm_head_loss") && C == 4096) {
    for (auto [rows, vocab] : {std::pair<int64_t, int64_t>{2048, 128256}, {2048, 50257}}) {
      const int64_t ld = (vocab + 7) / 8 * 8;
      Tensor buf = randn({rows, ld}, bf, 31), dbuf = Tensor::empty({rows, ld}, bf, kGpu);
      const Tensor x = buf.slice(1, 0, vocab);
      Tensor dl = dbuf.slice(1, 0, vocab);
      std::vector<int64_t> t(rows);
      for (int64_t i = 0; i < rows; ++i) t[i] = (i * 2654435761LL) % vocab;
      const Tensor targets = Tensor::from_ints(t, {rows}, DType::I32).to(kGpu);
      Tensor loss = Tensor::empty({1}, f32, kGpu), lse = Tensor::empty({rows}, f32, kGpu);
      auto with_fusion = [&](int off) {
        cuda::RowTuning tuning;
        tuning.cross_entropy_fused = off;
        cuda::set_row_tuning(tuning);
        cross_entropy_forward_backward(gpu, x, targets, loss, lse, 1.0f, dl);
        cuda::set_row_tuning({});
      };
      auto both = [&] { with_fusion(0); };
      auto separate = [&] { with_fusion(1); };
      const double ms_sep = median_ms(separate, g_runs), ms_one = median_ms(both, g_runs);
      poison(dl);
      poison(loss);
      both();
      Check c;
      {
        const Tensor hx = x.to(kCpu), ht = targets.to(kCpu);
        Tensor hl = Tensor::empty({1}, f32, kCpu), hlse = Tensor::empty({rows}, f32, kCpu);
        cross_entropy_forward(cpu, hx, ht, hl, hlse);
        c.expect(rel_error(loss, hl), 1e-5, "loss");
        c.expect(rel_error(sample(lse), sample(hlse)), 1e-5, "lse");
        Tensor sx = sample(x), wdl = cpu_empty_like(sx);
        cross_entropy_backward(cpu, sx, sample(targets), sample(hlse), float(double(sx.size(0)) / double(rows)), wdl);
        c.expect(rel_error(sample(dl), wdl), 1e-2, "d_logits");
      }
      const double bytes = 2.0 * double(rows) * double(vocab);
      const std::string shape = " " + std::to_string(rows) + "x" + std::to_string(vocab);
      table.add("lm_head_loss one pass" + shape, 2 * bytes, ms_one, c.text());
      table.add("lm_head_loss fwd+bwd" + shape, 3 * bytes, ms_sep, c.text());
    }
  }

  // ---- FP8: per-tensor quantization BF16 -> E4M3 (with amax, delayed scaling), amax ----
  if (table.wanted("quantize") || table.wanted("amax")) {
    Tensor am = Tensor::empty({1}, f32, kGpu), scale_t = Tensor::empty({1}, f32, kGpu);
    Tensor q = Tensor::empty({R, C}, DType::E4M3, kGpu);
    amax(gpu, x, am);
    const float a = am.to(kCpu).data<float>()[0];
    const float s = fp8_scale_from_amax(a, DType::E4M3);
    scale_t.copy_from(Tensor::from_floats({s}, {1}));
    auto quant = [&] { quantize_per_tensor(gpu, x, scale_t, q, am); };
    auto amx = [&] { amax(gpu, x, am); };
    const double ms_q = median_ms(quant, g_runs), ms_a = median_ms(amx, g_runs);
    poison(q);
    poison(am);
    quant();
    Check cq, ca;
    const Tensor hx = x.to(kCpu);
    Tensor ham = Tensor::empty({1}, f32, kCpu);
    amax(cpu, hx, ham);
    Tensor sx = sample(x), wq = Tensor::empty(sx.shape(), DType::E4M3, kCpu), dummy = Tensor::empty({1}, f32, kCpu);
    quantize_per_tensor(cpu, sx, scale_t.to(kCpu), wq, dummy);
    cq.expect(byte_mismatch(sample(q), wq), 0, "codes");
    cq.expect(byte_mismatch(am, ham), 0, "amax");
    poison(am);
    amx();
    ca.expect(byte_mismatch(am, ham), 0, "amax");
    // Every BF16 bit pattern, at several scales, both FP8 formats: bytes equal to the CPU's.
    {
      std::vector<uint16_t> bits(65536);
      for (int i = 0; i < 65536; ++i) bits[i] = static_cast<uint16_t>(i);
      Tensor all = Tensor::empty({256, 256}, bf, kCpu);
      std::memcpy(all.raw_data(), bits.data(), all.nbytes());
      const Tensor all_gpu = all.to(kGpu);
      for (DType fp8 : {DType::E4M3, DType::E5M2})
        for (float sc : {s, 1.0f, 1e4f, 0x1p-10f, 3.7f, 1e30f}) {
          Tensor want = Tensor::empty({256, 256}, fp8, kCpu), wam = Tensor::empty({1}, f32, kCpu);
          quantize_per_tensor(cpu, all, Tensor::from_floats({sc}, {1}), want, wam);
          Tensor got = Tensor::empty({256, 256}, fp8, kGpu), gam = Tensor::empty({1}, f32, kGpu);
          quantize_per_tensor(gpu, all_gpu, Tensor::from_floats({sc}, {1}).to(kGpu), got, gam);
          cq.expect(byte_mismatch(got, want), 0, std::string("every BF16 -> ") + dtype_name(fp8));
        }
    }
    table.add("quantize_per_tensor BF16->E4M3 +amax", A + N + 8, ms_q, cq.text());
    table.add("amax (BF16)", A + 4, ms_a, ca.text());
  }

  // ---- FP8 codes transposed (the transposed copy of a norm's FP8 output) ----
  // Checked against the CPU's transpose of the whole tensor.
  if (table.wanted("transpose")) {
    Tensor q = Tensor::empty({R, C}, DType::E4M3, kGpu), q_t = Tensor::empty({C, R}, DType::E4M3, kGpu);
    CHECK_CUDA(cudaMemcpy(q.raw_data(), x.raw_data(), q.nbytes(), cudaMemcpyDeviceToDevice));  // random bytes
    const double ms = median_ms([&] { transpose_2d(gpu, q, q_t); }, g_runs);
    poison(q_t);
    transpose_2d(gpu, q, q_t);
    Tensor want = Tensor::empty({C, R}, DType::E4M3, kCpu);
    transpose_2d(cpu, q.to(kCpu), want);
    Check c;
    c.expect(byte_mismatch(q_t, want), 0, "transpose");
    table.add("transpose_2d E4M3 codes", 2 * N, ms, c.text());
  }

  // ---- FP8 1x128 block cast, both copies (the "block" recipe's activations and gradients) ----
  // fp8::quantize_blockwise_with_transpose (fused kernel: x read once) against its two-pass
  // path (quantize, transpose x, quantize x^T, scale rearrangement), equality checked in the
  // same run (every byte of every output). Bytes: x read, both code copies written, and the
  // four scale grids (4 B per 128 elements each), the same count for both.
  if (table.wanted("blockcast")) {
    const BlockScaling blocks = BlockScaling::tile_1x128();
    auto fused = [&] { return fp8::quantize_blockwise_with_transpose(gpu, x, blocks, DType::E4M3); };
    auto two_pass = [&] { return fp8::quantize_blockwise_with_transpose_two_pass(gpu, x, blocks, DType::E4M3); };
    const double ms_f = median_ms([&] { fused(); }, g_runs), ms_t = median_ms([&] { two_pass(); }, g_runs);
    const fp8::BlockQuantizedTensor a = fused(), b = two_pass();
    Check c;
    c.expect(byte_mismatch(a.data, b.data), 0, "data");
    c.expect(byte_mismatch(a.data_t, b.data_t), 0, "data_t");
    c.expect(byte_mismatch(a.scale_inv, b.scale_inv), 0, "scale_inv");
    c.expect(byte_mismatch(a.scale_inv_t, b.scale_inv_t), 0, "scale_inv_t");
    c.expect(byte_mismatch(a.gemm_scale_inv, b.gemm_scale_inv), 0, "gemm_scale_inv");
    c.expect(byte_mismatch(a.gemm_scale_inv_t, b.gemm_scale_inv_t), 0, "gemm_scale_inv_t");
    {  // and the sample rows of data against the CPU reference
      Tensor sx = sample(x), wq = Tensor::empty(sx.shape(), DType::E4M3, kCpu);
      Tensor ws = Tensor::empty(block_scale_shape(sx.size(0), C, blocks), f32, kCpu);
      quantize_blockwise(cpu, sx, wq, ws, blocks);
      c.expect(byte_mismatch(sample(a.data), wq), 0, "data vs cpu");
      c.expect(byte_mismatch(sample(a.scale_inv), ws), 0, "scale_inv vs cpu");
    }
    const double bytes = A + 2 * N + 4 * 4.0 * (N / 128);
    table.add("blockcast 1x128 fused (both copies)", bytes, ms_f, c.text());
    table.add("blockcast 1x128 two-pass", bytes, ms_t, c.text());
  }

  // ---- FP8 cast + transpose with the bias gradient (a biased linear's dy; E5M2) ----
  // fp8::quantize_with_transpose_and_bias_grad (one read of dy) against the cast then
  // bias_grad (dy read twice): codes byte for byte, dbias (F32, accumulated) to 1e-6.
  // ---- MoE expert weights -> E4M3, one current scale per expert (Mixtral's fc and proj) ----
  // moe_fp8_quantize_weights' one-launch casts (every amax, every scale, every cast: three
  // launches), row-wise only (the forward without keep_weight_transpose) and with the
  // transposed codes, against the per-expert loop (set_moe_fp8_legacy_weight_cast, i.e.
  // TESSERA_MOE_LEGACY=1: amax, scale, cast + transpose per expert) and a per-expert loop of
  // the row-wise cast alone (amax, scale_from_amax, quantize_per_tensor). Every expert holds
  // rows. Bytes: w read twice (amax, cast), 1 B of codes written per element (2 B with the
  // transpose). Checked in the same run: every expert's codes, transposed codes, scale and
  // scale_inv equal the legacy loop's byte for byte. At the first shape only (the weights
  // do not depend on it).
  if (table.wanted("moe_weights") && C == 4096) {
    const bool legacy_before = moe_fp8_legacy_weight_cast();
    for (const Shape& ws : {Shape{8, 28672, 4096}, Shape{8, 4096, 14336}}) {
      const Tensor w = randn(ws, bf, 21, 0.02f);
      const std::vector<int64_t> splits(static_cast<size_t>(ws[0]), 1);
      const double n = double(ws[0]) * double(ws[1]) * double(ws[2]);
      auto cast = [&](bool legacy, bool keep) {
        set_moe_fp8_legacy_weight_cast(legacy);
        MoEFp8Options o;
        o.keep_weight_transpose = keep;
        MoEFp8Weights q = moe_fp8_quantize_weights(gpu, w, splits, o);
        set_moe_fp8_legacy_weight_cast(legacy_before);
        return q;
      };
      std::vector<Tensor> loop_codes(splits.size());
      for (Tensor& t : loop_codes) t = Tensor::empty({ws[1], ws[2]}, DType::E4M3, kGpu);
      auto rows_loop = [&] {
        for (size_t e = 0; e < splits.size(); ++e) {
          const Tensor we = w.select(0, static_cast<int64_t>(e));
          Tensor a = Tensor::empty({1}, f32, kGpu), s = Tensor::empty({1}, f32, kGpu);
          amax(gpu, we, a);
          fp8::scale_from_amax(gpu, a, DType::E4M3, 0.0f, false, s);
          quantize_per_tensor(gpu, we, s, loop_codes[e]);
        }
      };
      const double ms_rows = median_ms([&] { cast(false, false); }, g_runs);
      const double ms_both = median_ms([&] { cast(false, true); }, g_runs);
      const double ms_legacy = median_ms([&] { cast(true, true); }, g_runs);
      const double ms_loop = median_ms(rows_loop, g_runs);
      Check c_rows, c_both, c_loop;
      {
        const MoEFp8Weights want = cast(true, true), rows = cast(false, false), both = cast(false, true);
        rows_loop();
        for (size_t e = 0; e < splits.size(); ++e) {
          const std::string who = "expert " + std::to_string(e);
          for (const auto& [got, c] : {std::pair{&rows, &c_rows}, std::pair{&both, &c_both}}) {
            c->expect(byte_mismatch(got->experts[e].data, want.experts[e].data), 0, who + " data");
            c->expect(byte_mismatch(got->experts[e].scale_inv, want.experts[e].scale_inv), 0, who + " scale_inv");
            c->expect(byte_mismatch(got->scales[e], want.scales[e]), 0, who + " scale");
          }
          c_both.expect(byte_mismatch(both.experts[e].data_t, want.experts[e].data_t), 0, who + " data_t");
          c_loop.expect(byte_mismatch(loop_codes[e], want.experts[e].data), 0, who + " data");
        }
      }
      const std::string tag = "moe_weights " + shape_to_string(ws);
      table.add(tag + " one-launch rows", 5 * n, ms_rows, c_rows.text());
      table.add(tag + " one-launch rows+T", 6 * n, ms_both, c_both.text());
      table.add(tag + " per-expert loop rows+T", 6 * n, ms_legacy, c_both.text());
      table.add(tag + " per-expert loop rows", 5 * n, ms_loop, c_loop.text());
    }
  }

  if (table.wanted("castbias")) {
    Tensor sc = Tensor::from_floats({64.0f}, {1}).to(kGpu);
    Tensor db_f = Tensor::zeros({C}, f32, kGpu), db_u = Tensor::zeros({C}, f32, kGpu);
    auto fused = [&] { return fp8::quantize_with_transpose_and_bias_grad(gpu, dy, sc, DType::E5M2, db_f); };
    auto unfused = [&] {
      fp8::QuantizedTensor q = fp8::quantize_with_transpose(gpu, dy, sc, DType::E5M2);
      bias_grad(gpu, dy, db_u);
      return q;
    };
    const double ms_f = median_ms([&] { fused(); }, g_runs), ms_u = median_ms([&] { unfused(); }, g_runs);
    db_f.fill_zero();
    db_u.fill_zero();
    const fp8::QuantizedTensor a = fused(), b = unfused();
    Check c;
    c.expect(byte_mismatch(a.data, b.data), 0, "data");
    c.expect(byte_mismatch(a.data_t, b.data_t), 0, "data_t");
    c.expect(rel_error(db_f, db_u), 1e-6, "dbias");
    table.add("cast+transpose+dbias fused (E5M2)", A + 2 * N + 8.0 * C * std::ceil(double(R) / 64), ms_f, c.text());
    table.add("cast+transpose, then bias_grad", 2 * A + 2 * N, ms_u, c.text());
  }

  // ---- GELU -> FP8 (GPT-2's MLP): the fused kernels against gelu in BF16 then the cast ----
  // Delayed scaling's passes (the scale known); the backward with fc's bias gradient.
  if (table.wanted("gelufp8")) {
    Tensor sc = Tensor::from_floats({64.0f}, {1}).to(kGpu), h = Tensor::empty({R, C}, bf, kGpu);
    Tensor dh = Tensor::empty({R, C}, bf, kGpu), am_f = Tensor::empty({1}, f32, kGpu), am_u = am_f.clone();
    Tensor db_f = Tensor::zeros({C}, f32, kGpu), db_u = Tensor::zeros({C}, f32, kGpu);
    auto fwd_f = [&] { return gelu_forward_fp8(gpu, x, sc, DType::E4M3, &am_f); };
    auto fwd_u = [&] {
      gelu_forward(gpu, x, h);
      return fp8::quantize_with_transpose(gpu, h, sc, DType::E4M3, &am_u);
    };
    auto bwd_f = [&] { return gelu_backward_fp8(gpu, x, dy, sc, DType::E5M2, &am_f, &db_f); };
    auto bwd_u = [&] {
      gelu_backward(gpu, x, dy, dh);
      return fp8::quantize_with_transpose_and_bias_grad(gpu, dh, sc, DType::E5M2, db_u, &am_u);
    };
    const double ms_ff = median_ms([&] { fwd_f(); }, g_runs), ms_fu = median_ms([&] { fwd_u(); }, g_runs);
    const double ms_bf = median_ms([&] { bwd_f(); }, g_runs), ms_bu = median_ms([&] { bwd_u(); }, g_runs);
    Check cf, cb;
    {
      const fp8::QuantizedTensor a = fwd_f(), b = fwd_u();
      cf.expect(byte_mismatch(a.data, b.data), 0, "data");
      cf.expect(byte_mismatch(a.data_t, b.data_t), 0, "data_t");
      cf.expect(byte_mismatch(am_f, am_u), 0, "amax");
    }
    {
      db_f.fill_zero();
      db_u.fill_zero();
      const fp8::QuantizedTensor a = bwd_f(), b = bwd_u();
      cb.expect(byte_mismatch(a.data, b.data), 0, "data");
      cb.expect(byte_mismatch(a.data_t, b.data_t), 0, "data_t");
      cb.expect(byte_mismatch(am_f, am_u), 0, "amax");
      cb.expect(byte_mismatch(db_f, db_u), 0, "dbias");
    }
    table.add("gelu_forward_fp8 fused (E4M3 +amax)", A + 2 * N, ms_ff, cf.text());
    table.add("gelu_forward, then cast+transpose", 2 * A + A + 2 * N, ms_fu, cf.text());
    table.add("gelu_backward_fp8 fused (E5M2 +amax +dbias)", 2 * A + 2 * N, ms_bf, cb.text());
    table.add("gelu_backward, then cast+transpose+dbias", 3 * A + A + 2 * N, ms_bu, cb.text());
  }
  table.print();
}

}  // namespace

int main(int argc, char** argv) {
  if (!cuda_available()) {
    std::printf("bench_bandwidth: no GPU present, nothing to measure\n");
    return 0;
  }
  if (argc > 1) g_runs = std::max(1, std::atoi(argv[1]));
  if (argc > 2) g_filter = argv[2];
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("bench_bandwidth on %s (%d SMs, %.0f MB L2)\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize / 1e6);
  if (argc > 3 && std::strcmp(argv[3], "--sweep-softmax") == 0) {
    // The softmax forward and cross-entropy kernels under each choice (cuda::RowTuning), to
    // choose the defaults: the previous kernels, then the warp-row ones (automatic lanes per
    // row, then 8 / 16 / 32 forced where they hold the row) with the flat backward (4, then
    // 8 vectors a thread). Every row carries its result check.
    struct Choice {
      const char* what;
      cuda::RowTuning tuning;
    };
    const Choice choices[] = {
        {"previous kernels (1)", {1, 1, 1, 0, 0}},
        {"warp-row, automatic lanes; flat backward, 4 vectors", {0, 0, 0, 0, 4}},
        {"warp-row, 8 lanes a row; flat backward, 8 vectors", {0, 0, 0, 8, 8}},
        {"warp-row, 16 lanes a row", {0, 0, 0, 16, 4}},
        {"warp-row, 32 lanes a row", {0, 0, 0, 32, 4}},
    };
    for (const Choice& c : choices) {
      cuda::set_row_tuning(c.tuning);
      std::printf("\n#### softmax / cross-entropy kernels: %s\n", c.what);
      run_shape(16384, 4096);
      run_shape(16384, 768);
    }
    cuda::set_row_tuning({});
    return 0;
  }
  if (argc > 3 && std::strcmp(argv[3], "--sweep-norm-backward") == 0) {
    // The backward kernels' variants at the default shape (filter "backward" to time only them).
    struct Choice {
      const char* what;
      cuda::NormTuning tuning;
    };
    cuda::NormTuning in_order;
    in_order.finalize_pdl = 0;
    const Choice choices[] = {
        {"default", {}},
        {"finalize launched in stream order (no programmatic dependent launch)", in_order},
        {"row-group, 1 vector a thread", {0, -1, 1}},
        {"warp-row, 8 words a lane (eight warps a row)", {0, -1, 0, 2}},
        {"warp-row, 16 words a lane (four warps a row)", {0, -1, 0, 2, 16}},
    };
    for (const Choice& c : choices) {
      cuda::set_norm_tuning(c.tuning);
      std::printf("\n#### norm backward: %s\n", c.what);
      run_shape(16384, 4096);
      run_shape(16384, 768);
    }
    cuda::set_norm_tuning({});
    return 0;
  }
  const bool sweep_warp_only = argc > 3 && std::strcmp(argv[3], "--sweep-norm-warp") == 0;
  if (argc > 3 && (std::strcmp(argv[3], "--sweep-norm") == 0 || sweep_warp_only)) {
    // The norm kernels under each launch shape (cuda::NormTuning), to choose the defaults.
    for (int persistent : {1, 0})
      for (int nv : {2, 4, 8}) {
        if (sweep_warp_only) break;
        const int backward_nv = nv == 2 ? 1 : 2;
        cuda::set_norm_tuning({nv, persistent, backward_nv});
        std::printf("\n#### norm tuning: forward %d vectors a thread, %s; backward %d vectors a thread\n", nv,
                    persistent ? "persistent" : "one row per group", backward_nv);
        run_shape(16384, 4096);
      }
    // The warp-row kernels (NormTuning::kernel = 2, norm_warp.cuh) under their launch shapes:
    // words of a row per lane (forward default 32: C = 4096 BF16 on two warps; 64: one warp;
    // 16: four warps; backward default 8: eight warps; 16 or more: four), one row per group
    // or persistent (forward only).
    for (int persistent : {0, 1})
      for (int words : {0, 64, 16}) {
        cuda::NormTuning t;
        t.forward_persistent = persistent;
        t.kernel = 2;
        t.warp_words = words;
        cuda::set_norm_tuning(t);
        std::printf("\n#### norm tuning: warp-row kernels, %d words a lane (0 = default), %s\n", words,
                    persistent ? "persistent" : "one row per group");
        run_shape(16384, 4096);
      }
    cuda::set_norm_tuning({});
    return 0;
  }
  run_shape(16384, 4096);
  run_shape(16384, 768);
  return 0;
}
