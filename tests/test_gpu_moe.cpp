// CUDA MoE ops against the CPU reference: the router (softmax/sigmoid, groups, capacity,
// expert bias, losses) forward and backward, the routing map (bit-exact), permute and
// unpermute forward and backward, the scaled SwiGLU, GroupedLinear (bit-identical to a loop
// of gemm calls on the GPU), and a MoELayer / tiny Mixtral step against the CPU. F32 and
// BF16, odd sizes, experts with no tokens and all tokens on one expert; outputs poisoned
// first. The FP8 path: the padded casts (bytes equal to the CPU's), the fused SwiGLU -> FP8
// cast, and FP8 GroupedLinear / GroupedMLP against the CPU emulation. Skipped where no GPU
// is present.
#include <cmath>

#include "gpu_testing.h"
#include "moe_testing.h"
#include "tessera/core/stream.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/nn/moe.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/moe.h"
#include "tessera/ops/quantize.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

double tol_of(DType t) { return t == DType::BF16 ? 1e-2 : 1e-5; }

Tensor poisoned(const Shape& shape, DType t) {
  Tensor h = Tensor::empty(shape, t);
  if (t == DType::I32) {
    for (int64_t i = 0; i < h.numel(); ++i) h.data<int32_t>()[i] = 0x7f7f7f7f;
  } else {
    poison(h);
  }
  return h.to(kCuda);
}

struct Routed {
  Tensor scores, probs, indices, counts, losses;
};

Routed route(Context& ctx, const Tensor& logits, const Tensor& bias, const RouterOptions& o, DType probs_dtype) {
  const int64_t n = logits.size(0), e = logits.size(1);
  const Device d = ctx.device;
  Routed r;
  r.scores = d.is_cuda() ? poisoned({n, e}, DType::F32) : Tensor::empty({n, e}, DType::F32);
  r.probs = d.is_cuda() ? poisoned({n, o.top_k}, probs_dtype) : Tensor::empty({n, o.top_k}, probs_dtype);
  r.indices = d.is_cuda() ? poisoned({n, o.top_k}, DType::I32) : Tensor::empty({n, o.top_k}, DType::I32);
  r.counts = d.is_cuda() ? poisoned({e}, DType::I32) : Tensor::empty({e}, DType::I32);
  r.losses = d.is_cuda() ? poisoned({2}, DType::F32) : Tensor::empty({2}, DType::F32);
  moe_router_forward(ctx, logits.to(d), bias.defined() ? bias.to(d) : Tensor(), o, r.scores, r.probs, r.indices,
                     r.counts, r.losses);
  return r;
}

}  // namespace

TEST(GpuMoe, RouterMatchesTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 700;
  struct Case {
    int64_t n, e;
    RouterOptions o;
    bool bias;
  };
  std::vector<Case> cases;
  RouterOptions base;
  base.aux_loss_coeff = 0.01f;
  base.z_loss_coeff = 0.001f;
  cases.push_back({1, 1, [&] { RouterOptions o = base; o.top_k = 1; return o; }(), false});
  cases.push_back({37, 8, base, false});
  cases.push_back({1000, 64, [&] { RouterOptions o = base; o.top_k = 6; o.normalize = false; o.scaling = 2.5f; return o; }(), true});
  cases.push_back({513, 256, [&] {
                     RouterOptions o = base;
                     o.top_k = 8;
                     o.score = RouterScore::Sigmoid;
                     o.num_groups = 8;
                     o.topk_groups = 4;
                     return o;
                   }(), true});
  cases.push_back({300, 16, [&] { RouterOptions o = base; o.capacity_factor = 0.7f; return o; }(), false});
  for (DType t : {DType::F32, DType::BF16}) {
    for (const Case& c : cases) {
      const std::string what = std::string(dtype_name(t)) + " n=" + std::to_string(c.n) + " e=" + std::to_string(c.e);
      const Tensor logits = random_tensor({c.n, c.e}, t, seed++, -4, 4);
      const Tensor bias = c.bias ? random_tensor({c.e}, DType::F32, seed++, -0.05f, 0.05f) : Tensor();
      const Routed want = route(cpu, logits, bias, c.o, t), got = route(gpu, logits, bias, c.o, t);
      // Selection: equal except where two scores are within rounding of each other.
      const std::vector<int64_t> wi = want.indices.to_ints(), gi = got.indices.to_ints();
      int64_t differ = 0;
      for (size_t i = 0; i < wi.size(); ++i) differ += wi[i] != gi[i];
      EXPECT_LE(differ, static_cast<int64_t>(wi.size() / 200)) << "indices " << what;
      if (differ == 0) {
        EXPECT_EQ(got.counts.to_ints(), want.counts.to_ints()) << what;
        EXPECT_LT(relative_error(got.probs.to(Device::cpu()), want.probs), tol_of(t)) << "probs " << what;
      }
      EXPECT_LT(relative_error(got.scores.to(Device::cpu()), want.scores), 1e-5) << "scores " << what;
      EXPECT_LT(relative_error(got.losses.to(Device::cpu()), want.losses), 1e-4) << "losses " << what;

      // Backward from the CPU's routing (identical inputs on both sides).
      const Tensor d_probs = random_tensor({c.n, c.o.top_k}, t, seed++);
      Tensor dwant = Tensor::empty({c.n, c.e}, t), dgot = poisoned({c.n, c.e}, t);
      moe_router_backward(cpu, logits, want.scores, want.indices, d_probs, c.o, 0.5f, dwant);
      moe_router_backward(gpu, logits.to(kCuda), want.scores.to(kCuda), want.indices.to(kCuda), d_probs.to(kCuda), c.o,
                          0.5f, dgot);
      EXPECT_LT(relative_error(dgot.to(Device::cpu()), dwant), tol_of(t)) << "backward " << what;
    }
  }
}

TEST(GpuMoe, RoutingMapPermuteUnpermuteMatchTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 800;
  struct Case {
    int64_t n, k, e, c;
    int mode;  // 0 random, 1 all tokens on expert e-1, 2 some dropped and some experts empty
  };
  for (DType t : {DType::F32, DType::BF16}) {
    for (const Case& cs : {Case{1, 1, 1, 1, 0}, Case{7, 2, 8, 5, 0}, Case{1000, 2, 8, 130, 0}, Case{333, 8, 64, 96, 2},
                           Case{257, 1, 4, 64, 1}, Case{4099, 2, 16, 257, 2}}) {
      const std::string what = std::string(dtype_name(t)) + " n=" + std::to_string(cs.n) + " k=" + std::to_string(cs.k) +
                               " e=" + std::to_string(cs.e) + " mode " + std::to_string(cs.mode);
      // k distinct experts per token from the allowed list (mode 2: every third expert gets
      // nothing and ~10% of the assignments are dropped).
      std::vector<int64_t> allowed;
      for (int64_t e = 0; e < cs.e; ++e)
        if (cs.mode != 2 || e % 3 != 0) allowed.push_back(e);
      const int64_t na = static_cast<int64_t>(allowed.size());
      std::vector<int64_t> idx(static_cast<size_t>(cs.n * cs.k));
      const Tensor r = random_tensor({cs.n * cs.k}, DType::F32, seed++, 0, 1);
      for (int64_t n = 0; n < cs.n; ++n) {
        const int64_t start = (n * 2654435761LL) % na;
        for (int64_t j = 0; j < cs.k; ++j) {
          int64_t e = cs.mode == 1 ? cs.e - 1 - j : allowed[(start + j) % na];
          if (cs.mode == 2 && r.item(n * cs.k + j) < 0.1) e = -e - 1;
          idx[n * cs.k + j] = e;
        }
      }
      const Tensor indices = Tensor::from_ints(idx, {cs.n, cs.k});
      Tensor map_w = Tensor::empty({cs.n, cs.k}, DType::I32), off_w = Tensor::empty({cs.e + 1}, DType::I32);
      Tensor map_g = poisoned({cs.n, cs.k}, DType::I32), off_g = poisoned({cs.e + 1}, DType::I32);
      moe_routing_map(cpu, indices, cs.e, map_w, off_w);
      moe_routing_map(gpu, indices.to(kCuda), cs.e, map_g, off_g);
      EXPECT_EQ(map_g.to_ints(), map_w.to_ints()) << "row_map " << what;
      EXPECT_EQ(off_g.to_ints(), off_w.to_ints()) << "offsets " << what;

      const int64_t rows = cs.n * cs.k;
      const Tensor x = random_tensor({cs.n, cs.c}, t, seed++), probs = random_tensor({cs.n, cs.k}, t, seed++, 0, 1);
      Tensor pw = Tensor::empty({rows, cs.c}, t), ppw = Tensor::empty({rows}, t);
      Tensor pg = poisoned({rows, cs.c}, t), ppg = poisoned({rows}, t);
      moe_permute_forward(cpu, x, map_w, probs, pw, ppw);
      moe_permute_forward(gpu, x.to(kCuda), map_g, probs.to(kCuda), pg, ppg);
      EXPECT_EQ(bytes_of(pg), bytes_of(pw)) << "permute " << what;
      EXPECT_EQ(bytes_of(ppg), bytes_of(ppw)) << "permuted probs " << what;

      const Tensor dperm = random_tensor({rows, cs.c}, t, seed++), dpp = random_tensor({rows}, t, seed++);
      Tensor dxw = Tensor::empty({cs.n, cs.c}, t), dpw = Tensor::empty({cs.n, cs.k}, t);
      Tensor dxg = poisoned({cs.n, cs.c}, t), dpg = poisoned({cs.n, cs.k}, t);
      moe_permute_backward(cpu, map_w, dperm, dpp, dxw, dpw);
      moe_permute_backward(gpu, map_g, dperm.to(kCuda), dpp.to(kCuda), dxg, dpg);
      EXPECT_LT(relative_error(dxg.to(Device::cpu()), dxw), tol_of(t)) << "permute backward " << what;
      EXPECT_EQ(bytes_of(dpg), bytes_of(dpw)) << "permute backward probs " << what;

      for (bool with_probs : {true, false}) {
        const Tensor p = with_probs ? probs : Tensor();
        const Tensor out = random_tensor({rows, cs.c}, t, seed++), dy = random_tensor({cs.n, cs.c}, t, seed++);
        Tensor yw = Tensor::empty({cs.n, cs.c}, t), yg = poisoned({cs.n, cs.c}, t);
        moe_unpermute_forward(cpu, out, map_w, p, yw);
        moe_unpermute_forward(gpu, out.to(kCuda), map_g, with_probs ? p.to(kCuda) : Tensor(), yg);
        EXPECT_LT(relative_error(yg.to(Device::cpu()), yw), tol_of(t)) << "unpermute " << what;
        Tensor dow = Tensor::empty({rows, cs.c}, t), dog = poisoned({rows, cs.c}, t);
        Tensor dprw = with_probs ? Tensor::empty({cs.n, cs.k}, t) : Tensor();
        Tensor dprg = with_probs ? poisoned({cs.n, cs.k}, t) : Tensor();
        moe_unpermute_backward(cpu, out, map_w, p, dy, dow, dprw);
        moe_unpermute_backward(gpu, out.to(kCuda), map_g, with_probs ? p.to(kCuda) : Tensor(), dy.to(kCuda), dog, dprg);
        EXPECT_LT(relative_error(dog.to(Device::cpu()), dow), tol_of(t)) << "unpermute backward " << what;
        if (with_probs)
          EXPECT_LT(relative_error(dprg.to(Device::cpu()), dprw), tol_of(t)) << "unpermute backward probs " << what;
      }
    }
  }
}

TEST(GpuMoe, ScaledSwigluMatchesTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 900;
  for (DType t : {DType::F32, DType::BF16})
    for (Shape s : {Shape{1, 2}, Shape{5, 14}, Shape{300, 2 * 1000}, Shape{17, 2 * 4097}}) {
      const Tensor x = random_tensor(s, t, seed++, -4, 4), sc = random_tensor({s[0]}, t, seed++, 0, 1);
      const Tensor dy = random_tensor({s[0], s[1] / 2}, t, seed++);
      Tensor yw = Tensor::empty({s[0], s[1] / 2}, t), yg = poisoned({s[0], s[1] / 2}, t);
      moe_swiglu_scaled_forward(cpu, x, sc, yw);
      moe_swiglu_scaled_forward(gpu, x.to(kCuda), sc.to(kCuda), yg);
      EXPECT_LT(relative_error(yg.to(Device::cpu()), yw), tol_of(t)) << shape_to_string(s);
      Tensor dxw = Tensor::empty(s, t), dxg = poisoned(s, t), dsw = Tensor::empty({s[0]}, t), dsg = poisoned({s[0]}, t);
      moe_swiglu_scaled_backward(cpu, x, sc, dy, dxw, dsw);
      moe_swiglu_scaled_backward(gpu, x.to(kCuda), sc.to(kCuda), dy.to(kCuda), dxg, dsg);
      EXPECT_LT(relative_error(dxg.to(Device::cpu()), dxw), tol_of(t)) << shape_to_string(s);
      EXPECT_LT(relative_error(dsg.to(Device::cpu()), dsw), tol_of(t)) << shape_to_string(s);
    }
  // NaN never passes.
  Tensor x = Tensor::from_floats({NAN, 1, 2, 3}, {2, 2}), sc = Tensor::from_floats({1, 1}, {2});
  Tensor y = poisoned({2, 1}, DType::F32);
  moe_swiglu_scaled_forward(gpu, x.to(kCuda), sc.to(kCuda), y);
  EXPECT_TRUE(std::isnan(y.to(Device::cpu()).item(0)));
}

TEST(GpuMoe, GroupedLinearIsBitIdenticalToALoopOfGemms) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 1000;
  for (DType t : {DType::F32, DType::BF16}) {
    for (const std::vector<int64_t>& splits :
         {std::vector<int64_t>{3, 0, 130, 0, 1}, std::vector<int64_t>{0, 0, 0, 0, 200}, std::vector<int64_t>{64, 64, 64, 64, 64}}) {
      const int64_t rows = 330, k_in = 96, n_out = 72, e = 5;
      const Tensor x = random_tensor({rows, k_in}, t, seed++), w = random_tensor({e, n_out, k_in}, t, seed++);
      const Tensor dy = random_tensor({rows, n_out}, t, seed++);
      Tensor y = poisoned({rows, n_out}, t);
      grouped_linear_forward(gpu, x.to(kCuda), w.to(kCuda), splits, y);
      // The loop, on the GPU.
      Tensor loop = Tensor::zeros({rows, n_out}, t, kCuda);
      int64_t row = 0;
      for (int64_t g = 0; g < e; ++g) {
        if (splits[g] == 0) continue;
        Tensor ye = loop.slice(0, row, row + splits[g]);
        gemm(gpu, x.to(kCuda).slice(0, row, row + splits[g]), w.to(kCuda).select(0, g), ye, {.transpose_b = true});
        row += splits[g];
      }
      EXPECT_EQ(bytes_of(y), bytes_of(loop));
      Tensor yw = Tensor::empty({rows, n_out}, t);
      grouped_linear_forward(cpu, x, w, splits, yw);
      EXPECT_LT(relative_error(y.to(Device::cpu()), yw), tol_of(t));
      Tensor dxg = poisoned({rows, k_in}, t), dxw = Tensor::empty({rows, k_in}, t);
      grouped_linear_backward_input(gpu, dy.to(kCuda), w.to(kCuda), splits, dxg);
      grouped_linear_backward_input(cpu, dy, w, splits, dxw);
      EXPECT_LT(relative_error(dxg.to(Device::cpu()), dxw), tol_of(t));
      // dW accumulates into F32.
      const Tensor dw0 = random_tensor({e, n_out, k_in}, DType::F32, seed++);
      Tensor dwg = dw0.to(kCuda), dww = dw0.clone();
      grouped_linear_backward_weight(gpu, dy.to(kCuda), x.to(kCuda), splits, dwg);
      grouped_linear_backward_weight(cpu, dy, x, splits, dww);
      EXPECT_LT(relative_error(dwg.to(Device::cpu()), dww), tol_of(t));
    }
  }
}

// The experts' GEMMs spread over side streams (the default) against all on one stream: the
// same bits for every op, on a non-blocking stream of the test's own (so no implicit
// ordering through the legacy stream can hide a missing join), with more experts than side
// streams and GEMMs large enough to run at the same time (a shared cuBLASLt workspace
// between them would show as wrong results).
TEST(GpuMoe, GroupedLinearOnSideStreamsEqualsOneStreamBitForBit) {
  REQUIRE_GPU();
  const int before = grouped_gemm_streams();
  const Stream stream = Stream::create(kCuda);
  Context gpu = stream.context();
  const StreamGuard guard(gpu);
  const std::vector<int64_t> splits = {700, 0, 1024, 333, 512, 1, 900, 611};
  const int64_t rows = 4200, k_in = 1024, n_out = 768, e = 8;
  const Tensor x = random_tensor({rows, k_in}, DType::BF16, 77).to(kCuda);
  const Tensor w = random_tensor({e, n_out, k_in}, DType::BF16, 78).to(kCuda);
  const Tensor dy = random_tensor({rows, n_out}, DType::BF16, 79).to(kCuda);
  const Tensor dw0 = random_tensor({e, n_out, k_in}, DType::F32, 80);
  struct Out {
    std::vector<uint8_t> y, dx, dw;
  };
  auto run = [&](int streams) {
    set_grouped_gemm_streams(streams);
    Tensor y = poisoned({rows, n_out}, DType::BF16), dx = poisoned({rows, k_in}, DType::BF16);
    Tensor dw = dw0.to(kCuda);
    grouped_linear_forward(gpu, x, w, splits, y);
    grouped_linear_backward_input(gpu, dy, w, splits, dx);
    grouped_linear_backward_weight(gpu, dy, x, splits, dw);
    return Out{bytes_of(y), bytes_of(dx), bytes_of(dw)};
  };
  const Out one = run(1), four = run(4), two = run(2);
  set_grouped_gemm_streams(before);
  EXPECT_TRUE(one.y == four.y && one.y == two.y) << "forward";
  EXPECT_TRUE(one.dx == four.dx && one.dx == two.dx) << "backward_input";
  EXPECT_TRUE(one.dw == four.dw && one.dw == two.dw) << "backward_weight";
  EXPECT_THROW(set_grouped_gemm_streams(0), Error);
}

TEST(GpuMoe, MixtralStepMatchesTheCpu) {
  REQUIRE_GPU();
  models::ModelConfig c;
  c.architecture = "mixtral";
  c.vocab_size = 67;
  c.hidden_size = 64;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.intermediate_size = 96;
  c.max_seq_len = 32;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.router_aux_loss_coef = 0.01f;
  c.router_z_loss_coef = 0.001f;
  c.tie_embeddings = false;
  Context cpu = Context::cpu(), gpu = Context::cuda();
  models::TransformerLM on_cpu(c, DType::F32), on_gpu(c, DType::F32);
  on_cpu.init(cpu, 3);
  on_gpu.init(cpu, 3);
  on_gpu.to(kCuda);
  std::vector<int64_t> ids(2 * 32), tg(2 * 32);
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int64_t>((i * 31 + 7) % 67);
    tg[i] = static_cast<int64_t>((i * 17 + 3) % 67);
  }
  const Tensor inputs = Tensor::from_ints(ids, {2, 32}), targets = Tensor::from_ints(tg, {2, 32});
  const double lc = on_cpu.forward_backward(cpu, inputs, targets), lg = on_gpu.forward_backward(gpu, inputs, targets);
  EXPECT_NEAR(lg, lc, 1e-4 * std::abs(lc));
  EXPECT_NEAR(on_gpu.last_aux_loss(), on_cpu.last_aux_loss(), 1e-4 * std::abs(on_cpu.last_aux_loss()) + 1e-7);
  const auto pc = on_cpu.parameters(), pg = on_gpu.parameters();
  for (size_t i = 0; i < pc.size(); ++i)
    EXPECT_LT(relative_error(pg[i]->grad.to(Device::cpu()), pc[i]->grad), 1e-3) << pc[i]->name;
  EXPECT_EQ(on_gpu.expert_loads(), on_cpu.expert_loads());
}

// ---- FP8 ----------------------------------------------------------------------------------

namespace {

const std::vector<std::vector<int64_t>> kFp8Splits = {
    {3, 0, 130, 0, 1}, {0, 0, 0, 0, 200}, {32, 48, 64, 48, 32}, {0, 0, 0, 0, 0}, {17, 33, 1, 15, 16}};

}  // namespace

TEST(GpuMoe, Fp8CastRowsIsBitExact) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 2000;
  MoEFp8Options o;
  for (DType t : {DType::F32, DType::BF16})
    for (DType fp8 : {DType::E4M3, DType::E5M2})
      for (const auto& splits : kFp8Splits)
        for (int64_t cols : {int64_t{16}, int64_t{96}, int64_t{40}}) {
          const Tensor x = zero_tail(random_tensor({230, cols}, t, seed++, -300, 300), splits);
          const MoEFp8Rows want = moe_fp8_quantize_rows(cpu, x, splits, fp8, o);
          const MoEFp8Rows got = moe_fp8_quantize_rows(gpu, x.to(kCuda), splits, fp8, o);
          const std::string what = std::string(dtype_name(t)) + " -> " + dtype_name(fp8) + ", cols " + std::to_string(cols);
          EXPECT_EQ(bytes_of(got.data), bytes_of(want.data)) << what;
          EXPECT_EQ(bytes_of(got.data_t), bytes_of(want.data_t)) << what;  // padding columns included
          EXPECT_EQ(got.scale_inv.to(Device::cpu()).item(0), want.scale_inv.item(0)) << what;
        }
  // NaN: the amax is NaN, the scale 1, the NaN stays NaN in the codes: the same bytes.
  Tensor x = random_tensor({32, 16}, DType::BF16, seed++);
  x.set_item(37, NAN);
  const MoEFp8Rows want = moe_fp8_quantize_rows(cpu, x, {20, 12}, DType::E4M3, o);
  const MoEFp8Rows got = moe_fp8_quantize_rows(gpu, x.to(kCuda), {20, 12}, DType::E4M3, o);
  EXPECT_EQ(bytes_of(got.data), bytes_of(want.data));
  EXPECT_EQ(bytes_of(got.data_t), bytes_of(want.data_t));
}

TEST(GpuMoe, Fp8SwigluCastMatchesTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 2100;
  for (DType t : {DType::F32, DType::BF16})
    for (const auto& splits : kFp8Splits)
      for (int64_t f : {int64_t{16}, int64_t{48}, int64_t{1000}}) {
        const Tensor x = zero_tail(random_tensor({230, 2 * f}, t, seed++, -4, 4), splits);
        const Tensor prob = random_tensor({230}, t, seed++, 0, 1);
        Tensor aw = Tensor::empty({1}, DType::F32), ag = Tensor::from_floats({NAN}, {1}).to(kCuda);
        moe_swiglu_scaled_amax(cpu, x, prob, aw);
        moe_swiglu_scaled_amax(gpu, x.to(kCuda), prob.to(kCuda), ag);
        // expf on the device and on the host may differ in the last bit.
        EXPECT_NEAR(ag.to(Device::cpu()).item(0), aw.item(0), 1e-6 * aw.item(0));
        // The cast with one given scale: codes equal but for rare rounding-step differences.
        const Tensor scale = Tensor::from_floats({fp8_scale_from_amax(float(aw.item(0)), DType::E4M3)}, {1});
        const MoEFp8Rows want = moe_swiglu_scaled_cast(cpu, x, prob, scale, splits, DType::E4M3);
        const MoEFp8Rows got = moe_swiglu_scaled_cast(gpu, x.to(kCuda), prob.to(kCuda), scale.to(kCuda), splits, DType::E4M3);
        for (const auto& [g, w] : {std::pair{got.data, want.data}, std::pair{got.data_t, want.data_t}}) {
          const auto [n, adjacent] = code_mismatches(bytes_of(g), bytes_of(w));
          EXPECT_LE(n, 1 + w.numel() / 10000) << dtype_name(t) << " F " << f;
          EXPECT_TRUE(adjacent) << dtype_name(t) << " F " << f;
        }
      }
}

TEST(GpuMoe, SwigluBackwardAmaxIsTheAmaxOfItsOutput) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  uint64_t seed = 2150;
  for (DType t : {DType::F32, DType::BF16})
    for (Shape s : {Shape{1, 2}, Shape{37, 2 * 48}, Shape{300, 2 * 1000}}) {
      const Tensor x = random_tensor(s, t, seed++, -4, 4).to(kCuda), sc = random_tensor({s[0]}, t, seed++, 0, 1).to(kCuda);
      const Tensor dy = random_tensor({s[0], s[1] / 2}, t, seed++).to(kCuda);
      Tensor dx = poisoned(s, t), ds = poisoned({s[0]}, t), a = poisoned({1}, DType::F32), want = poisoned({1}, DType::F32);
      moe_swiglu_scaled_backward(gpu, x, sc, dy, dx, ds, &a);
      amax(gpu, dx, want);
      EXPECT_EQ(a.to(Device::cpu()).item(0), want.to(Device::cpu()).item(0)) << shape_to_string(s);
    }
}

namespace {

void to_gpu(nn::GroupedLinear& l) { l.weight.to(kCuda); }

}  // namespace

TEST(GpuMoe, Fp8GroupedLinearMatchesTheCpuEmulation) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 2200;
  const int64_t e = 5, in = 96, out = 80, rows = 230;
  for (const auto& splits : kFp8Splits) {
    nn::GroupedLinear lc("g", e, in, out, DType::BF16), lg("g", e, in, out, DType::BF16);
    const Tensor w = random_tensor(lc.weight.value.shape(), DType::BF16, seed++, -0.5f, 0.5f);
    lc.weight.value.copy_from(w);
    lg.weight.value.copy_from(w);
    const Tensor g0 = random_tensor(lc.weight.grad.shape(), DType::F32, seed++);
    lc.weight.grad.copy_from(g0);
    lg.weight.grad.copy_from(g0);
    to_gpu(lg);
    lc.use_fp8(MoEFp8Options{});
    lg.use_fp8(MoEFp8Options{});
    const Tensor x = zero_tail(random_tensor({rows, in}, DType::BF16, seed++), splits);
    const Tensor dy = zero_tail(random_tensor({rows, out}, DType::BF16, seed++), splits);
    nn::GroupedLinear::Fp8Saved sc, sg;
    const Tensor yc = lc.forward_fp8(cpu, moe_fp8_quantize_rows(cpu, x, splits, DType::E4M3, {}), sc);
    const Tensor yg = lg.forward_fp8(gpu, moe_fp8_quantize_rows(gpu, x.to(kCuda), splits, DType::E4M3, {}), sg);
    const Tensor dxc = lc.backward_input_fp8(cpu, dy, sc);
    const Tensor dxg = lg.backward_input_fp8(gpu, dy.to(kCuda), sg);
    lc.backward_weight_fp8(cpu, sc);
    lg.backward_weight_fp8(gpu, sg);
    // The same FP8 operands; FP32 accumulation in another order (fast accumulation in the
    // forward), then one BF16 rounding.
    EXPECT_LT(relative_error(yg.to(Device::cpu()), yc), 1e-2);
    EXPECT_LT(relative_error(dxg.to(Device::cpu()), dxc), 1e-2);
    // As the dense FP8 Linear's GPU test: the FP32 sums over the tokens in another order.
    EXPECT_LT(relative_error(lg.weight.grad.to(Device::cpu()), lc.weight.grad), 1e-3);
  }
}

TEST(GpuMoe, Fp8GroupedMlpMatchesTheCpuEmulation) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 2300;
  const int64_t e = 5, hidden = 64, ffn = 96, rows = 230;
  for (const auto& splits : kFp8Splits) {
    nn::GroupedMLP mc("m", e, hidden, ffn, DType::BF16), mg("m", e, hidden, ffn, DType::BF16);
    for (nn::GroupedLinear* l : {&mc.fc, &mc.proj}) l->weight.value.copy_from(random_tensor(l->weight.value.shape(), DType::BF16, seed++, -0.3f, 0.3f));
    mg.fc.weight.value.copy_from(mc.fc.weight.value);
    mg.proj.weight.value.copy_from(mc.proj.weight.value);
    to_gpu(mg.fc);
    to_gpu(mg.proj);
    mc.use_fp8(MoEFp8Options{});
    mg.use_fp8(MoEFp8Options{});
    const Tensor x = zero_tail(random_tensor({rows, hidden}, DType::BF16, seed++), splits);
    const Tensor prob = random_tensor({rows}, DType::BF16, seed++, 0, 1);
    const Tensor dy = zero_tail(random_tensor({rows, hidden}, DType::BF16, seed++), splits);
    nn::GroupedMLP::Saved sc, sg;
    const Tensor yc = mc.forward(cpu, x, prob, splits, sc);
    const Tensor yg = mg.forward(gpu, x.to(kCuda), prob.to(kCuda), splits, sg);
    ASSERT_TRUE(sc.fp8 && sg.fp8);
    const Tensor dxc = mc.backward_input(cpu, dy, sc);
    const Tensor dxg = mg.backward_input(gpu, dy.to(kCuda), sg);
    mc.backward_weight(cpu, dy, sc);
    mg.backward_weight(gpu, dy.to(kCuda), sg);
    // Looser than one GEMM: h_pre (BF16) differs from the CPU's by rounding in some
    // elements, and a one-ulp change of a BF16 value moves its E4M3 code (8 times coarser)
    // in about 1 element of 32. A wrong index or scale gives errors of order 1.
    const double tol = 5e-2;
    EXPECT_LT(relative_error(yg.to(Device::cpu()), yc), tol);
    EXPECT_LT(relative_error(dxg.to(Device::cpu()), dxc), tol);
    EXPECT_LT(relative_error(sg.d_scale.to(Device::cpu()), sc.d_scale), tol);
    EXPECT_LT(relative_error(mg.fc.weight.grad.to(Device::cpu()), mc.fc.weight.grad), tol);
    EXPECT_LT(relative_error(mg.proj.weight.grad.to(Device::cpu()), mc.proj.weight.grad), tol);
  }
}
