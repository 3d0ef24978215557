// Attention benchmark on the GPU: tessera's tensor-core attention (BF16) and cuDNN's fused
// flash attention (src/backend/cuda/attention_cudnn.cu, when the build has cuDNN), forward,
// backward and forward+backward, timed with CUDA events (warm-up, then the median of 30
// runs), at the shapes bench/attention_torch.py times PyTorch's SDPA backends with:
//   B=4  H=32 T=4096 D=128 causal
//   B=16 H=12 T=1024 D=64  causal
// plus a GQA shape (B=4 T=2048 Hq=32 Hkv=8 D=64 causal). Each shape also shows what Auto
// (tessera::AttentionBackend::Auto) picks and why, as it prints on first sight of a shape.
// FLOPs follow FlashAttention's count: forward 4 * B * H * T * S * D, halved when causal;
// backward 2.5x the forward (so forward+backward is 3.5x). Our backward executes more than
// that (dQ's pass recomputes two products); the count is the same for every implementation
// so the figures compare.
//
// tessera's backward runs four times: deterministic (the default: a dK/dV pass and a dQ pass,
// bitwise repeatable; on Hopper at D=128 the dK/dV pass is the wgmma kernel, attention_bwd_wgmma.cu),
// atomic (tessera::set_attention_deterministic(false): dQ summed with FP32 atomics inside the
// dK/dV pass, as FlashAttention-2 does; on Hopper the wgmma kernel), and both again on the
// mma.sync dK/dV kernel ("atom-mma", "det-mma"), one row each.
// Then both again with the legacy dK/dV kernel (rows "legacy" and "leg-atom",
// cuda::set_attention_backward_legacy), with a bitwise comparison of its gradients against
// the default kernel's.
//
// Correctness in the same run: batch 0 of each backend's timed outputs (out, lse, dq, dk,
// dv) against the generic CUDA path (FP32 arithmetic, no tensor cores) on batch 0 of the
// same inputs.
//
// After each shape, every tile shape of the tensor-core forward (attention_forward_fast's
// variants 0 .. cuda::kLastAttentionForwardVariant) is timed and checked the same way, with
// the registers, spills, shared memory and resident blocks per SM of variants 3 and up.
//
// Usage: bench_attention [runs]     (needs a GPU)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "gpu_timing.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/attention_bwd_variant.h"
#include "backend/cuda/attention_cudnn.h"
#include "backend/cuda/attention_fwd_variants.h"
#include "tessera/core/allocator.h"
#include "tessera/core/random.h"
#include "tessera/ops/attention.h"

using namespace tessera;

namespace {

struct Problem {
  int64_t B, H, Hkv, T, D;
  bool causal;
};

// One summary row per shape: TFLOP/s of each backend and Auto's choice.
struct Summary {
  std::string shape;
  double tessera_fwd = 0, tessera_all = 0, atomic_all = 0, cudnn_fwd = 0, cudnn_all = 0;
  std::string choice;
};
std::vector<Summary> summaries;



double rel_error(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = got.to(Device::cpu()).to_doubles(), w = want.to(Device::cpu()).to_doubles();
  double diff = 0, ref = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i]) || std::isnan(w[i])) return INFINITY;
    diff += (g[i] - w[i]) * (g[i] - w[i]);
    ref += w[i] * w[i];
  }
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

Tensor batch0(const Tensor& t) { return t.slice(0, 0, 1); }

struct Errors {
  double out, lse, dq, dk, dv;
  bool ok() const { return out < 1e-2 && lse < 1e-4 && dq < 1e-2 && dk < 1e-2 && dv < 1e-2; }
};

void run(const Problem& pb, int runs) {
  Context ctx = Context::cuda();
  const Device dev = Device::cuda();
  const Shape qs{pb.B, pb.T, pb.H, pb.D}, ks{pb.B, pb.T, pb.Hkv, pb.D}, ls{pb.B, pb.H, pb.T};
  Tensor q = Tensor::empty(qs, DType::BF16, dev), k = Tensor::empty(ks, DType::BF16, dev),
         v = Tensor::empty(ks, DType::BF16, dev), d_out = Tensor::empty(qs, DType::BF16, dev);
  fill_normal(ctx, q, 0, 1, 1);
  fill_normal(ctx, k, 0, 1, 2);
  fill_normal(ctx, v, 0, 1, 3);
  fill_normal(ctx, d_out, 0, 1, 4);
  Tensor out = Tensor::empty(qs, DType::BF16, dev), lse = Tensor::empty(ls, DType::F32, dev);
  Tensor dq = Tensor::empty(qs, DType::BF16, dev), dk = Tensor::empty(ks, DType::BF16, dev),
         dv = Tensor::empty(ks, DType::BF16, dev);
  AttentionOptions opts;
  opts.causal = pb.causal;
  const float scale = 1.0f / std::sqrt(static_cast<float>(pb.D));
  const bool fast = cuda::attention_fast_path(q, k, lse, {&v, &out, &d_out, &dq, &dk, &dv});
  char shape[96];
  std::snprintf(shape, sizeof(shape), "B=%lld H=%lld/%lld T=%lld D=%lld %s", (long long)pb.B, (long long)pb.H,
                (long long)pb.Hkv, (long long)pb.T, (long long)pb.D, pb.causal ? "causal" : "full");
  Summary sum;
  sum.shape = shape;

  // The reference for the checks: batch 0 through the generic path.
  const Shape q1{1, pb.T, pb.H, pb.D}, k1{1, pb.T, pb.Hkv, pb.D}, l1{1, pb.H, pb.T};
  Tensor r_out = Tensor::empty(q1, DType::BF16, dev), r_lse = Tensor::empty(l1, DType::F32, dev);
  Tensor r_dq = Tensor::empty(q1, DType::BF16, dev), r_dk = Tensor::empty(k1, DType::BF16, dev),
         r_dv = Tensor::empty(k1, DType::BF16, dev);
  const Tensor q0 = batch0(q), k0 = batch0(k), v0 = batch0(v), do0 = batch0(d_out);
  cuda::attention_forward_generic(ctx.stream, q0, k0, v0, r_out, r_lse, pb.causal, scale);
  cuda::attention_backward_generic(ctx.stream, do0, q0, k0, v0, r_out, r_lse, r_dq, r_dk, r_dv, pb.causal, scale);
  auto check = [&] {
    CHECK_CUDA(cudaDeviceSynchronize());
    return Errors{rel_error(batch0(out), r_out), rel_error(batch0(lse), r_lse), rel_error(batch0(dq), r_dq),
                  rel_error(batch0(dk), r_dk), rel_error(batch0(dv), r_dv)};
  };

  const double fwd_flop = 4.0 * pb.B * pb.H * pb.T * pb.T * pb.D * (pb.causal ? 0.5 : 1.0);
  // One table row per backend, then its check against the generic path.
  auto time_backend = [&](const char* name, const std::function<void()>& fwd, const std::function<void()>& bwd,
                          double* fwd_tflops, double* all_tflops) {
    const double fwd_ms = median_ms(fwd, runs);
    const double bwd_ms = median_ms(bwd, runs);
    const double all_ms = median_ms([&] { fwd(); bwd(); }, runs);
    *fwd_tflops = fwd_flop / fwd_ms * 1e-9;
    *all_tflops = 3.5 * fwd_flop / all_ms * 1e-9;
    fwd();
    bwd();
    const Errors e = check();
    std::printf("| %-30s | %-9s | %8.3f | %7.1f | %8.3f | %7.1f | %8.3f | %7.1f | %-8s |\n", shape, name, fwd_ms,
                *fwd_tflops, bwd_ms, 2.5 * fwd_flop / bwd_ms * 1e-9, all_ms, *all_tflops,
                e.ok() ? "ok" : "MISMATCH");
    std::printf("|   batch-0 relative error vs generic path: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e |\n", e.out,
                e.lse, e.dq, e.dk, e.dv);
    std::fflush(stdout);
  };

  set_attention_backend(AttentionBackend::Tessera);
  time_backend(fast ? "tessera" : "generic", [&] { attention_forward(ctx, q, k, v, out, lse, opts); },
               [&] { attention_backward(ctx, d_out, q, k, v, out, lse, dq, dk, dv, opts); }, &sum.tessera_fwd,
               &sum.tessera_all);
  if (fast) {
    double unused = 0;
    set_attention_deterministic(false);
    time_backend("tess-atom", [&] { attention_forward(ctx, q, k, v, out, lse, opts); },
                 [&] { attention_backward(ctx, d_out, q, k, v, out, lse, dq, dk, dv, opts); }, &unused,
                 &sum.atomic_all);
    // The same without the Hopper wgmma backward (the mma.sync dK/dV kernel with atomic dQ).
    cuda::set_attention_backward_wgmma(false);
    double unused_all = 0;
    time_backend("atom-mma", [&] { attention_forward(ctx, q, k, v, out, lse, opts); },
                 [&] { attention_backward(ctx, d_out, q, k, v, out, lse, dq, dk, dv, opts); }, &unused, &unused_all);
    set_attention_deterministic(true);
    time_backend("det-mma", [&] { attention_forward(ctx, q, k, v, out, lse, opts); },
                 [&] { attention_backward(ctx, d_out, q, k, v, out, lse, dq, dk, dv, opts); }, &unused, &unused_all);

    // The legacy dK/dV kernel (attention_bwd_variant.h) against the default in the same run:
    // timed and checked like the rows above, and its dq, dk, dv compared bit for bit with
    // the default's (the two kernels differ only in load scheduling and addressing).
    for (const bool deterministic : {true, false}) {
      set_attention_deterministic(deterministic);
      cuda::set_attention_backward_legacy(false);
      attention_backward(ctx, d_out, q, k, v, out, lse, dq, dk, dv, opts);
      const Tensor new_dq = dq.to(Device::cpu()), new_dk = dk.to(Device::cpu()), new_dv = dv.to(Device::cpu());
      cuda::set_attention_backward_legacy(true);
      double legacy_all = 0;
      time_backend(deterministic ? "legacy" : "leg-atom", [&] { attention_forward(ctx, q, k, v, out, lse, opts); },
                   [&] { attention_backward(ctx, d_out, q, k, v, out, lse, dq, dk, dv, opts); }, &unused,
                   &legacy_all);
      cuda::set_attention_backward_legacy(false);
      const auto same = [](const Tensor& a, const Tensor& b) {
        const Tensor c = b.to(Device::cpu());
        return std::memcmp(a.raw_data(), c.raw_data(), a.nbytes()) == 0;
      };
      // dq of the atomic variant depends on the order of its atomic adds: not compared.
      const bool dq_same = !deterministic || same(new_dq, dq);
      std::printf("|   legacy vs default dK/dV kernel, bitwise: dk %s dv %s dq %s |\n",
                  same(new_dk, dk) ? "same" : "DIFFERENT", same(new_dv, dv) ? "same" : "DIFFERENT",
                  deterministic ? (dq_same ? "same" : "DIFFERENT") : "(atomic)");
    }
    set_attention_deterministic(true);
    cuda::set_attention_backward_wgmma(true);
  }

  std::string why;
  if (cuda::cudnn_attention_forward_ready(q, k, v, out, lse, pb.causal, &why) &&
      cuda::cudnn_attention_backward_ready(d_out, q, k, v, out, lse, dq, dk, dv, pb.causal, &why)) {
    time_backend("cudnn", [&] { cuda::cudnn_attention_forward(ctx.stream, q, k, v, out, lse, pb.causal, scale); },
                 [&] {
                   cuda::cudnn_attention_backward(ctx.stream, d_out, q, k, v, out, lse, dq, dk, dv, pb.causal, scale);
                 },
                 &sum.cudnn_fwd, &sum.cudnn_all);
  } else {
    std::printf("| %-30s | cudnn     | not available: %s\n", shape, why.c_str());
  }

  // What Auto picks for this shape (it times both once and prints one line on stderr).
  set_attention_backend(AttentionBackend::Auto);
  clear_attention_backend_choices();
  attention_forward(ctx, q, k, v, out, lse, opts);
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<std::string> choices = attention_backend_choices();
  sum.choice = choices.empty() ? "(no choice made: cuDNN cannot run it)" : choices.back();
  const size_t arrow = sum.choice.find("-> ");
  if (arrow != std::string::npos) sum.choice = sum.choice.substr(arrow + 3);
  summaries.push_back(sum);

  // The forward's tile shapes side by side (attention_fwd.cu, attention_fwd_variants.cu),
  // each checked against the generic path in the same run (out and lse of batch 0, poisoned
  // first so that a row a variant forgets to write shows).
  if (!fast) return;
  const char* names[] = {"MT=2 4 warps, 64 keys, 2 stages, Q in smem at D=128",
                         "MT=1 8 warps, 64 keys, 2 stages, Q in regs",
                         "MT=2 4 warps, 32 keys, 2 stages, Q in smem at D=128"};
  std::printf("\nforward variants, %s (registers, spill bytes, blocks per SM: the compiled kernel; for variants\n"
              "0-2 see attention_fwd.cu):\n\n", shape);
  std::printf("| variant                                                           | regs | spill B | smem KiB "
              "| blocks/SM | ms     | TFLOP/s | out err  | lse err  | check    |\n");
  std::printf("|-------------------------------------------------------------------|------|---------|----------"
              "|-----------|--------|---------|----------|----------|----------|\n");
  for (int variant = 0; variant <= cuda::kLastAttentionForwardVariant; ++variant) {
    cuda::attn::FwdVariantInfo info{};
    std::string desc;
    if (variant < 3) {
      desc = names[variant];
    } else {
      cuda::attn::forward_variant_info(static_cast<int>(pb.D), variant, &info);
      desc = info.shape;
    }
    if (variant == cuda::default_attention_forward_variant(pb.D)) desc += " (default)";
    CHECK_CUDA(cudaMemset(out.raw_data(), 0xff, out.nbytes()));
    CHECK_CUDA(cudaMemset(lse.raw_data(), 0xff, lse.nbytes()));
    auto f = [&] { cuda::attention_forward_fast(ctx.stream, q, k, v, out, lse, pb.causal, scale, variant); };
    f();
    CHECK_CUDA(cudaDeviceSynchronize());
    const double e_out = rel_error(batch0(out), r_out), e_lse = rel_error(batch0(lse), r_lse);
    const double ms = median_ms(f, runs);
    const char* verdict = e_out < 1e-2 && e_lse < 1e-4 ? "ok" : "MISMATCH";
    if (variant < 3)
      std::printf("| %2d %-62s |    - |       - |        - |         - | %6.3f | %7.1f | %.2e | %.2e | %-8s |\n",
                  variant, desc.c_str(), ms, fwd_flop / ms * 1e-9, e_out, e_lse, verdict);
    else
      std::printf("| %2d %-62s | %4d | %7d | %8.1f | %9d | %6.3f | %7.1f | %.2e | %.2e | %-8s |\n", variant,
                  desc.c_str(), info.registers, info.local_bytes, info.smem_bytes / 1024.0, info.blocks_per_sm, ms,
                  fwd_flop / ms * 1e-9, e_out, e_lse, verdict);
    std::fflush(stdout);
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (!cuda_available()) {
    std::printf("bench_attention: no GPU present\n");
    return 0;
  }
  const int runs = argc > 1 ? std::max(20, std::atoi(argv[1])) : 30;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("tessera attention, BF16, %s, cuDNN %d, median of %d runs (TFLOP/s: causal counted as half)\n\n",
              prop.name, cuda::cudnn_version(), runs);
  std::printf("| shape (H = q heads/kv heads)   | path      | fwd ms   | TFLOP/s | bwd ms   | TFLOP/s | f+b ms   | TFLOP/s | check    |\n");
  std::printf("|--------------------------------|-----------|----------|---------|----------|---------|----------|---------|----------|\n");
  run({4, 32, 32, 4096, 128, true}, runs);
  run({16, 12, 12, 1024, 64, true}, runs);
  run({4, 32, 8, 2048, 64, true}, runs);
  set_attention_backend(AttentionBackend::Auto);

  std::printf("\nTFLOP/s by backend, and what Auto picks (forward+backward timed once per shape):\n\n");
  std::printf("| shape                          | tessera fwd | tessera f+b | atomic f+b | cudnn fwd | cudnn f+b | auto |\n");
  std::printf("|--------------------------------|-------------|-------------|------------|-----------|-----------|------|\n");
  for (const Summary& s : summaries)
    std::printf("| %-30s | %11.1f | %11.1f | %10.1f | %9.1f | %9.1f | %s |\n", s.shape.c_str(), s.tessera_fwd,
                s.tessera_all, s.atomic_all, s.cudnn_fwd, s.cudnn_all, s.choice.c_str());
  return 0;
}
