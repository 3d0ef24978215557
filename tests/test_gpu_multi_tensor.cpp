// CUDA multi-tensor optimizer ops against the CPU reference: global_grad_norm within 1e-6
// relative (and reproducible bit for bit from run to run), adamw_step_multi bit for bit
// (parameters, moments, BF16 values). Hundreds of tensors of odd sizes including empty
// ones, aligned and misaligned (scalar path), F32 and BF16 gradients, clipping on and
// off, F32 and F64 norms, NaN and Inf gradients, the device table reused and rebuilt, and
// the training optimizer end to end. Skipped (saying so) where no GPU is present.
#include <cmath>
#include <cstring>
#include <string>

#include "tessera/core/allocator.h"
#include "tessera/nn/parameter.h"
#include "tessera/ops/optimizer.h"
#include "tessera/train/optimizer.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

Tensor nan_tensor(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  poison(t);
  return t;
}

struct TensorList {
  std::vector<Tensor> params, grads, exp_avgs, exp_avg_sqs, values;
  std::vector<float> weight_decays;
};

// Degenerate sizes, sizes around the 8-element vector and the 8192-element chunk, a few
// large ones, then small odd ones up to `count` tensors.
std::vector<int64_t> odd_sizes(size_t count, uint64_t seed) {
  std::vector<int64_t> sizes = {0, 1, 7, 8, 9, 17, 8191, 8192, 8193, 16385, 100000, 300001, 0, 3};
  Tensor r = random_tensor({static_cast<int64_t>(count)}, DType::F64, seed, 0.0f, 3000.0f);
  for (size_t i = 0; sizes.size() < count; ++i) sizes.push_back(static_cast<int64_t>(r.item(i)));
  return sizes;
}

// CPU tensors: F32 parameters and moments, gradients of grad_dtype, a poisoned BF16 value
// on two tensors of three, decays 0 / 0.1 / 0.01 in turn.
TensorList make_host_list(const std::vector<int64_t>& sizes, DType grad_dtype, uint64_t seed, bool with_values) {
  TensorList l;
  for (size_t k = 0; k < sizes.size(); ++k) {
    const Shape shape = {sizes[k]};
    l.params.push_back(random_tensor(shape, DType::F32, seed++, -2.0f, 2.0f));
    l.grads.push_back(Tensor::zeros(shape, grad_dtype));
    l.exp_avgs.push_back(random_tensor(shape, DType::F32, seed++, -0.1f, 0.1f));
    l.exp_avg_sqs.push_back(random_tensor(shape, DType::F32, seed++, 0.0f, 0.01f));
    l.values.push_back(with_values && k % 3 != 1 ? nan_tensor(shape, DType::BF16) : Tensor());
    l.weight_decays.push_back(k % 3 == 0 ? 0.0f : k % 3 == 1 ? 0.1f : 0.01f);
  }
  return l;
}

// Device copies; with `misalign`, every fourth tensor's operands sit off the 16-byte grid.
TensorList to_device_list(const TensorList& h, bool misalign) {
  TensorList d;
  for (size_t k = 0; k < h.params.size(); ++k) {
    const bool off = misalign && k % 4 == 3;
    d.params.push_back(to_device(h.params[k], off));
    d.grads.push_back(to_device(h.grads[k], off));
    d.exp_avgs.push_back(to_device(h.exp_avgs[k], off));
    d.exp_avg_sqs.push_back(to_device(h.exp_avg_sqs[k], off));
    d.values.push_back(to_device(h.values[k], off));
  }
  d.weight_decays = h.weight_decays;
  return d;
}

// New gradients for both lists (the same values), a few tiny so that eps matters.
void fill_grads(TensorList& host, TensorList& device, uint64_t seed, float scale) {
  for (size_t k = 0; k < host.grads.size(); ++k) {
    Tensor g = random_tensor(host.grads[k].shape(), host.grads[k].dtype(), seed++, -scale, scale);
    for (int64_t i = 0; i < g.numel(); i += 7) g.set_item(i, g.item(i) * 1e-6);
    host.grads[k].copy_from(g);
    device.grads[k].copy_from(g);
  }
}

// Element-wise: the same bits, or NaN on both sides (NaN payloads differ between the CPU's
// and the GPU's arithmetic and are not part of the contract).
void expect_same(const Tensor& got_device, const Tensor& want, const std::string& what, bool nan_aware = false) {
  ASSERT_EQ(got_device.defined(), want.defined()) << what;
  if (!want.defined()) return;
  if (!nan_aware) {
    EXPECT_EQ(bytes_of(got_device), bytes_of(want)) << what;
    return;
  }
  const Tensor got = got_device.to(Device::cpu()).contiguous();
  const std::vector<double> a = got.to_doubles(), b = want.to_doubles();
  const size_t es = dtype_size(want.dtype());
  const auto* ga = static_cast<const unsigned char*>(got.raw_data());
  const auto* wa = static_cast<const unsigned char*>(want.raw_data());
  int64_t bad = 0;
  for (int64_t i = 0; i < want.numel(); ++i)
    if (!(std::isnan(a[i]) && std::isnan(b[i])) && std::memcmp(ga + i * es, wa + i * es, es) != 0) ++bad;
  EXPECT_EQ(bad, 0) << what;
}

void expect_same_lists(const TensorList& device, const TensorList& host, const std::string& what,
                       bool nan_aware = false) {
  for (size_t k = 0; k < host.params.size(); ++k) {
    const std::string w = what + " tensor " + std::to_string(k) + " [" + std::to_string(host.params[k].numel()) + "]";
    expect_same(device.params[k], host.params[k], w + " param", nan_aware);
    expect_same(device.exp_avgs[k], host.exp_avgs[k], w + " exp_avg", nan_aware);
    expect_same(device.exp_avg_sqs[k], host.exp_avg_sqs[k], w + " exp_avg_sq", nan_aware);
    expect_same(device.values[k], host.values[k], w + " bf16 value", nan_aware);
  }
}

double relative(double got, double want) {
  if (std::isnan(got) || std::isnan(want)) return INFINITY;
  return want == 0 ? std::abs(got) : std::abs(got - want) / std::abs(want);
}

void run_multi(Context& ctx, TensorList& l, const AdamWOptions& o, const Tensor& norm, double max_norm,
               MultiTensorCache* cache) {
  adamw_step_multi(ctx, l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, l.values, o, l.weight_decays, norm, max_norm,
                   cache);
}

}  // namespace

TEST(GpuGlobalGradNorm, MatchesTheCpuAndIsReproducible) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 100;
  for (DType gt : {DType::F32, DType::BF16}) {
    for (bool misaligned : {false, true}) {
      const std::vector<int64_t> sizes = odd_sizes(300, seed++);
      std::vector<Tensor> host, device;
      for (size_t k = 0; k < sizes.size(); ++k) {
        host.push_back(random_tensor({sizes[k]}, gt, seed++, -1.0f, 1.0f));
        device.push_back(to_device(host.back(), misaligned && k % 3 == 1));
      }
      for (DType out : {DType::F32, DType::F64}) {
        const std::string what = std::string("grads ") + dtype_name(gt) + (misaligned ? " misaligned" : "") +
                                 " norm " + dtype_name(out);
        Tensor want = Tensor::empty({1}, out);
        global_grad_norm(cpu, host, want);
        MultiTensorCache cache;
        Tensor got = nan_tensor({1}, out).to(kCuda);
        global_grad_norm(gpu, device, got, &cache);
        const double w = want.item(0), g = got.to(Device::cpu()).item(0);
        EXPECT_LT(relative(g, w), 1e-6) << what << ": " << g << " vs " << w;
        // Again with the cached table, and without a cache: the same bits.
        Tensor again = nan_tensor({1}, out).to(kCuda), uncached = nan_tensor({1}, out).to(kCuda);
        global_grad_norm(gpu, device, again, &cache);
        global_grad_norm(gpu, device, uncached);
        EXPECT_EQ(bytes_of(again), bytes_of(got)) << what << ": cached table";
        EXPECT_EQ(bytes_of(uncached), bytes_of(got)) << what << ": no cache";
      }
    }
  }
}

TEST(GpuGlobalGradNorm, EmptyListsNanInfAndUnsupportedDtypes) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  Tensor norm = nan_tensor({1}, DType::F32).to(kCuda);
  std::vector<Tensor> none;
  global_grad_norm(gpu, none, norm);
  EXPECT_EQ(norm.to(Device::cpu()).item(0), 0.0) << "an empty list";
  std::vector<Tensor> empties = {Tensor::zeros({0}, DType::F32, kCuda), Tensor::zeros({0, 4}, DType::F32, kCuda)};
  norm.copy_from(nan_tensor({1}, DType::F32));
  global_grad_norm(gpu, empties, norm);
  EXPECT_EQ(norm.to(Device::cpu()).item(0), 0.0) << "only empty tensors";
  std::vector<Tensor> exact = {Tensor::from_floats({3, 4}, {2}).to(kCuda), Tensor::zeros({0}, DType::F32, kCuda),
                               Tensor::from_floats({12}, {1}).to(kCuda)};
  global_grad_norm(gpu, exact, norm);
  EXPECT_EQ(norm.to(Device::cpu()).item(0), 13.0);
  for (float bad : {NAN, INFINITY}) {
    Tensor g = random_tensor({10000}, DType::F32, 5, -1.0f, 1.0f);
    g.set_item(9999, bad);
    std::vector<Tensor> grads = {Tensor::zeros({3}, DType::F32, kCuda), g.to(kCuda)};
    global_grad_norm(gpu, grads, norm);
    const double got = norm.to(Device::cpu()).item(0);
    if (std::isnan(bad)) EXPECT_TRUE(std::isnan(got));
    else EXPECT_EQ(got, INFINITY);
  }
  // F64 gradients and a mixed F32/BF16 list have no kernel: a clear error.
  std::vector<Tensor> f64 = {Tensor::zeros({4}, DType::F64, kCuda)};
  EXPECT_THROW(global_grad_norm(gpu, f64, norm), Error);
  std::vector<Tensor> mixed = {Tensor::zeros({4}, DType::F32, kCuda), Tensor::zeros({4}, DType::BF16, kCuda)};
  EXPECT_THROW(global_grad_norm(gpu, mixed, norm), Error);
}

TEST(GpuAdamWMulti, MatchesTheCpuBitForBit) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 5000;
  for (DType gt : {DType::F32, DType::BF16}) {
    for (bool misaligned : {false, true}) {
      for (double max_norm : {0.0, 0.5}) {
        for (DType norm_dtype : {DType::F64, DType::F32}) {
          const std::string base = std::string("grads ") + dtype_name(gt) + (misaligned ? " misaligned" : "") +
                                   " max_norm " + std::to_string(max_norm) + " norm " + dtype_name(norm_dtype);
          TensorList host = make_host_list(odd_sizes(300, seed++), gt, seed, true);
          seed += 1000;
          TensorList device = to_device_list(host, misaligned);
          MultiTensorCache cache;  // one table for every step
          AdamWOptions o;
          o.beta1 = 0.9f;
          o.beta2 = 0.95f;
          o.eps = 1e-8f;
          o.weight_decay = 7.0f;  // not used: the per-tensor decays are
          const std::vector<std::pair<int64_t, float>> steps = {{1, 1e-3f}, {2, 3e-4f}, {1000, 1e-4f}};
          for (auto [step, lr] : steps) {
            fill_grads(host, device, seed, 0.05f);
            seed += 1000;
            o.step = step;
            o.lr = lr;
            // The same norm on both sides (the CPU's), so the clip factors must agree exactly.
            Tensor norm = Tensor::empty({1}, norm_dtype);
            global_grad_norm(cpu, host.grads, norm);
            if (max_norm > 0) ASSERT_GT(norm.item(0), 2 * max_norm) << base << ": the test must clip";
            for (Tensor& v : device.values)
              if (v.defined()) v.copy_from(nan_tensor(v.shape(), DType::BF16));
            run_multi(cpu, host, o, norm, max_norm, nullptr);
            run_multi(gpu, device, o, norm.to(kCuda), max_norm, &cache);
            expect_same_lists(device, host, base + " step " + std::to_string(step));
          }
        }
      }
    }
  }
}

TEST(GpuAdamWMulti, WithTheNormComputedOnTheDevice) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  TensorList host = make_host_list(odd_sizes(200, 31), DType::F32, 32, true);
  TensorList device = to_device_list(host, true);
  MultiTensorCache norm_cache, cache;
  for (int64_t step = 1; step <= 3; ++step) {
    fill_grads(host, device, 1000 + 1000 * step, 0.05f);
    AdamWOptions o;
    o.step = step;
    Tensor want = Tensor::empty({1}, DType::F64), got = nan_tensor({1}, DType::F64).to(kCuda);
    global_grad_norm(cpu, host.grads, want);
    global_grad_norm(gpu, device.grads, got, &norm_cache);
    run_multi(cpu, host, o, want, 1.0, nullptr);
    run_multi(gpu, device, o, got, 1.0, &cache);
    const double w = want.item(0), g = got.to(Device::cpu()).item(0);
    ASSERT_GT(w, 1.0) << "the test must clip";
    EXPECT_LT(relative(g, w), 1e-6) << "step " << step;
    if (g == w) {
      // The per-tensor sums round to the same floats (all but certain): the same clip.
      expect_same_lists(device, host, "device norm, step " + std::to_string(step));
    } else {
      for (size_t k = 0; k < host.params.size(); ++k)
        EXPECT_LT(relative_error(device.params[k].to(Device::cpu()), host.params[k]), 1e-6) << "tensor " << k;
    }
  }
}

// NaN norm: no clipping, the NaN stays in its element; Inf norm: clip 0, finite gradients
// count as zero and the Inf element turns NaN. As on the CPU.
TEST(GpuAdamWMulti, NanAndInfGradientsAsOnTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (float bad : {NAN, INFINITY}) {
    TensorList host = make_host_list({9, 4, 20000, 1}, DType::F32, 77, true);
    TensorList device = to_device_list(host, false);
    fill_grads(host, device, 78, 1.0f);
    host.grads[2].set_item(5, bad);
    device.grads[2].copy_from(host.grads[2]);
    Tensor want = Tensor::empty({1}, DType::F64), got = nan_tensor({1}, DType::F64).to(kCuda);
    global_grad_norm(cpu, host.grads, want);
    global_grad_norm(gpu, device.grads, got);
    const double g = got.to(Device::cpu()).item(0);
    if (std::isnan(bad)) EXPECT_TRUE(std::isnan(g));
    else EXPECT_EQ(g, INFINITY);
    AdamWOptions o;
    run_multi(cpu, host, o, want, 1.0, nullptr);
    run_multi(gpu, device, o, got, 1.0, nullptr);
    expect_same_lists(device, host, std::isnan(bad) ? "NaN gradient" : "Inf gradient", true);
    const std::vector<float> p = device.params[2].to_floats();
    EXPECT_TRUE(std::isnan(p[5]));
    EXPECT_FALSE(std::isnan(p[4]));
  }
}

// A cache built for one list and then handed another (new allocations, other sizes, other
// length) must rebuild its table rather than step stale pointers.
TEST(GpuAdamWMulti, CacheFollowsChangedLists) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  MultiTensorCache cache, norm_cache;
  uint64_t seed = 900;
  for (const std::vector<int64_t>& sizes :
       {std::vector<int64_t>{5, 8192, 9}, std::vector<int64_t>{5, 8192, 9}, std::vector<int64_t>{70000, 3},
        std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}}) {
    TensorList host = make_host_list(sizes, DType::F32, seed, true);
    seed += 100;
    TensorList device = to_device_list(host, false);
    fill_grads(host, device, seed++, 1.0f);
    Tensor norm = Tensor::empty({1}, DType::F64), dnorm = nan_tensor({1}, DType::F64).to(kCuda);
    global_grad_norm(cpu, host.grads, norm);
    global_grad_norm(gpu, device.grads, dnorm, &norm_cache);
    EXPECT_LT(relative(dnorm.to(Device::cpu()).item(0), norm.item(0)), 1e-6) << sizes.size() << " tensors";
    AdamWOptions o;
    run_multi(cpu, host, o, norm, 0.25, nullptr);
    run_multi(gpu, device, o, norm.to(kCuda), 0.25, &cache);
    expect_same_lists(device, host, std::to_string(sizes.size()) + " tensors");
  }
}

TEST(GpuAdamWMulti, UnsupportedDtypesAreAClearError) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  std::vector<Tensor> p = {Tensor::zeros({4}, DType::F64, kCuda)}, g = {Tensor::zeros({4}, DType::F64, kCuda)},
                      m = {Tensor::zeros({4}, DType::F64, kCuda)}, v = {Tensor::zeros({4}, DType::F64, kCuda)}, values;
  EXPECT_THROW(adamw_step_multi(gpu, p, g, m, v, values, {}, {0.0f}, Tensor(), 0.0), Error);
}

// The training optimizer on GPU parameters against the same optimizer on CPU parameters:
// BF16 (FP32 master) and F32 parameters, clipping active, four steps.
TEST(GpuTrainOptimizer, MatchesTheCpu) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const std::vector<std::pair<Shape, DType>> specs = {{{33, 17}, DType::BF16}, {{17}, DType::BF16},
                                                      {{1}, DType::F32},       {{128, 130}, DType::BF16},
                                                      {{9}, DType::F32},       {{0}, DType::BF16},
                                                      {{8, 8}, DType::F32},    {{50257, 8}, DType::BF16}};
  std::vector<nn::Parameter> host, device;
  uint64_t seed = 4000;
  for (size_t k = 0; k < specs.size(); ++k) {
    host.emplace_back("p" + std::to_string(k), specs[k].first, specs[k].second, k % 2 == 0);
    device.emplace_back("p" + std::to_string(k), specs[k].first, specs[k].second, k % 2 == 0, kCuda);
    host[k].weights().copy_from(random_tensor(specs[k].first, DType::F32, seed++, -1.0f, 1.0f));
    host[k].refresh_value(cpu);
    device[k].weights().copy_from(host[k].weights());
    device[k].value.copy_from(host[k].value);
  }
  nn::ParameterList host_list, device_list;
  for (size_t k = 0; k < specs.size(); ++k) {
    host_list.push_back(&host[k]);
    device_list.push_back(&device[k]);
  }
  train::OptimizerConfig config;
  config.grad_clip = 1.0;
  train::Optimizer host_opt(host_list, config), device_opt(device_list, config);
  for (int step = 1; step <= 4; ++step) {
    for (size_t k = 0; k < specs.size(); ++k) {
      Tensor g = random_tensor(specs[k].first, DType::F32, seed++, -0.1f, 0.1f);
      host[k].grad.copy_from(g);
      device[k].grad.copy_from(g);
    }
    const double lr = 1e-3 / step;
    const double want = host_opt.step(cpu, lr), got = device_opt.step(gpu, lr);
    ASSERT_GT(want, config.grad_clip) << "the test must clip";
    EXPECT_LT(relative(got, want), 1e-6) << "step " << step;
    for (size_t k = 0; k < specs.size(); ++k) {
      const std::string what = "step " + std::to_string(step) + " " + host[k].name;
      if (got == want) {
        expect_same(device[k].weights(), host[k].weights(), what + " weights");
        expect_same(device[k].value, host[k].value, what + " value");
      } else {
        EXPECT_LT(relative_error(device[k].weights().to(Device::cpu()), host[k].weights()), 1e-6) << what;
      }
    }
  }
  EXPECT_EQ(device_opt.steps_taken(), 4);
}
