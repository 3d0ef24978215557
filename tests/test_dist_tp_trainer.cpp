// `tessera train` with tensor parallelism (training.parallel.tensor > 1), in-process on world
// sub-groups, and the gradient reduction that overlaps backward. Run alone and under
// mpirun -np 2 / -np 4 (and over TCP) like the other test_dist_* binaries; each case runs
// at the sizes the world allows:
//   - TP = 2 and 4 (with and without sequence parallelism) give the curve of TP = 1 (losses
//     and validation losses to 1e-5, F32), with global-norm clipping active;
//   - DP x TP = 2 x 2 likewise, with the plain optimizer and with ZeRO-1 (whose clipping norm
//     then runs over data x tensor); ZeRO-1 at TP = 2 too;
//   - a checkpoint saved at DP=2,TP=2 (TP=2 on two ranks) holds the single-device layout and
//     resumes at DP=1,TP=1 and at TP=4, the losses continuing as the uninterrupted run's;
//   - the overlapped reduction (buckets started by the backward's gradient-ready hook) gives
//     bitwise the after-backward reduction's gradients and training curve; the hook names
//     every parameter once, the last layer's first;
//   - a NaN gradient makes all tensor ranks rewind together (snapshot or checkpoint).
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "dist_trainer_testing.h"
#include "tessera/dist/data_parallel.h"
#include "tessera/dist/parallel_grid.h"
#include "tessera/io/atomic_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/trainer.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;
namespace fs = std::filesystem;

namespace {

std::string shared_dir(dist::ProcessGroup& world, const std::string& name) {
  return tessera::testing::shared_dir(world, "tessera_tp_trainer", name);
}
std::string corpus(dist::ProcessGroup& world, const std::string& dir) { return shared_corpus(world, dir); }

// The tiny Llama of dist_trainer_testing.h: K/V split at TP 2, replicated at TP 4; its
// vocabulary of 257 padded at TP 2 and 4. grad_clip 1 with lr 0.01: the early steps clip.
nlohmann::json config(const std::string& out_dir, const std::string& text, int tensor = 1, bool sp = false,
                      bool zero1 = false) {
  nlohmann::json j = tiny_llama_run(out_dir, text);
  j["optimizer"]["grad_clip"] = 1.0;
  j["training"]["parallel"] = {{"tensor", tensor},
                               {"sequence_parallel", sp},
                               {"distributed_optimizer", zero1},
                               {"timeout_s", 120}};
  return j;
}

// The first n ranks of the world, when it has that many (null on the others and when it
// does not), and whether it has.
dist::GroupPtr first(dist::GroupPtr world, int n) {
  if (n > world->size()) return nullptr;
  if (n == world->size()) return world;
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(r);
  return world->new_group(ranks);
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double tolerance,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tolerance * std::abs(want[i])) << what << ", entry " << i;
}

// Tensor parallelism splits the matrix products and sums the partial results over the ranks:
// F32 rounding differs from TP 1; over 10 AdamW steps the losses stay well within this.
constexpr double kAcrossLayouts = 1e-5;

}  // namespace

TEST(DistTensorParallelTrainer, TensorParallelGivesTheCurveOfOneRank) {
  auto world = test_world();
  const std::string dir = shared_dir(*world, "curve");
  const std::string text = corpus(*world, dir);
  const Curve reference = run(*world, first(world, 1), config(dir + "/tp1", text));
  ASSERT_EQ(reference.loss.size(), 10u);
  ASSERT_EQ(reference.val_loss.size(), 2u);
  EXPECT_LT(reference.loss.back(), reference.loss.front());
  EXPECT_GT(reference.grad_norm.front(), 1.0) << "the first steps clip (the test covers the clipping norm)";
  for (int tp : {2, 4}) {
    dist::GroupPtr group = first(world, tp);
    if (tp > world->size()) break;
    for (bool sp : {false, true}) {
      const std::string what = "TP=" + std::to_string(tp) + (sp ? " with SP" : "");
      const Curve c = run(*world, group, config(dir + "/tp" + std::to_string(tp) + (sp ? "_sp" : ""), text, tp, sp));
      expect_close(c.loss, reference.loss, kAcrossLayouts, what + ": loss");
      expect_close(c.val_loss, reference.val_loss, kAcrossLayouts, what + ": validation loss");
      expect_close(c.grad_norm, reference.grad_norm, 1e-4, what + ": gradient norm");
    }
  }
}

TEST(DistTensorParallelTrainer, DataTimesTensorAndZeroOneGiveTheSameCurve) {
  auto world = test_world();
  if (world->size() < 2) GTEST_SKIP() << "needs 2 ranks (runs under mpirun -np 2 and -np 4)";
  const std::string dir = shared_dir(*world, "dxt");
  const std::string text = corpus(*world, dir);
  const Curve reference = run(*world, first(world, 1), config(dir + "/tp1", text));
  struct Case {
    const char* name;
    int ranks, tensor;
    bool sp, zero1;
  };
  std::vector<Case> cases = {{"TP=2 ZeRO-1", 2, 2, false, true}};
  if (world->size() >= 4) {
    cases.push_back({"DPxTP=2x2", 4, 2, false, false});
    cases.push_back({"DPxTP=2x2 SP", 4, 2, true, false});
    cases.push_back({"DPxTP=2x2 ZeRO-1", 4, 2, false, true});
  }
  for (const Case& k : cases) {
    const std::string out = dir + "/" + std::to_string(k.ranks) + "_" + std::to_string(k.tensor) + (k.sp ? "_sp" : "") +
                            (k.zero1 ? "_zero1" : "");
    const Curve c = run(*world, first(world, k.ranks), config(out, text, k.tensor, k.sp, k.zero1));
    expect_close(c.loss, reference.loss, kAcrossLayouts, std::string(k.name) + ": loss");
    expect_close(c.val_loss, reference.val_loss, kAcrossLayouts, std::string(k.name) + ": validation loss");
    expect_close(c.grad_norm, reference.grad_norm, 1e-4, std::string(k.name) + ": gradient norm");
  }
}

TEST(DistTensorParallelTrainer, CheckpointOfDataTimesTensorResumesAtOtherLayouts) {
  auto world = test_world();
  if (world->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const std::string dir = shared_dir(*world, "reshard");
  const std::string text = corpus(*world, dir);
  // DP=2,TP=2 on 4 ranks; TP=2 alone on 2.
  const int ranks = world->size() >= 4 ? 4 : 2;
  dist::GroupPtr saver = first(world, ranks);
  for (bool zero1 : {false, true}) {
    const std::string tag = zero1 ? "zero1" : "plain";
    const Curve straight = run(*world, saver, config(dir + "/straight_" + tag, text, 2, false, zero1));
    const std::string saved = dir + "/saved_" + tag;
    run(*world, saver, config(saved, text, 2, false, zero1), {.stop_after = 5});
    if (world->rank() == 0) {
      // The single-device layout: full shapes, per-parameter moments, written by rank 0.
      // (Errors are caught: rank 0 must reach the barrier below whatever happens.)
      try {
        const auto ckpt = train::latest_checkpoint(saved, false);
        EXPECT_TRUE(ckpt.has_value());
        if (ckpt) {
          const nlohmann::json manifest = nlohmann::json::parse(io::read_file(*ckpt + "/manifest.json"));
          EXPECT_EQ(manifest.value("ranks", 1), ranks);
          EXPECT_TRUE(manifest["files"].contains("optimizer.safetensors"));
          const io::SafetensorsFile model(*ckpt + "/model.safetensors");
          EXPECT_EQ(model.info("embed.weight").shape, (Shape{257, 32}));   // vocabulary padding dropped
          EXPECT_EQ(model.info("layers.0.attn.qkv.weight").shape, (Shape{64, 32}));
          EXPECT_EQ(model.info("layers.0.mlp.proj.weight").shape, (Shape{32, 48}));
          const io::SafetensorsFile opt(*ckpt + "/optimizer.safetensors");
          EXPECT_EQ(opt.info("embed.weight.exp_avg").shape, (Shape{257, 32}));
          EXPECT_EQ(opt.info("layers.1.mlp.fc.weight.exp_avg_sq").shape, (Shape{96, 32}));
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    }
    world->barrier();
    struct Case {
      const char* name;
      int ranks, tensor;
      bool zero1;
    };
    std::vector<Case> cases = {{"dp1_tp1", 1, 1, false}, {"dp1_tp1_zero1", 1, 1, true}, {"same", ranks, 2, zero1}};
    if (world->size() >= 4) {
      cases.push_back({"tp4", 4, 4, false});
      cases.push_back({"tp4_zero1", 4, 4, true});
    }
    for (const Case& k : cases) {
      const std::string out = dir + "/" + tag + "_" + k.name;
      if (world->rank() == 0) fs::copy(saved, out, fs::copy_options::recursive);
      world->barrier();
      const Curve resumed = run(*world, first(world, k.ranks), config(out, text, k.tensor, false, k.zero1), {.resume = true});
      const std::string what = "saved at " + std::to_string(ranks / 2) + "x2 (" + tag + "), resumed " + k.name;
      ASSERT_EQ(resumed.loss.size(), 10u) << what;
      for (size_t i = 0; i < 5; ++i) EXPECT_EQ(resumed.loss[i], straight.loss[i]) << what << ": the saved steps";
      expect_close(std::vector<double>(resumed.loss.begin() + 5, resumed.loss.end()),
                   std::vector<double>(straight.loss.begin() + 5, straight.loss.end()), kAcrossLayouts,
                   what + ": the steps after the resume");
    }
  }
}

TEST(DistTensorParallelTrainer, OverlappedReductionEqualsTheAfterBackwardOneBitwise) {
  auto world = test_world();
  const std::string dir = shared_dir(*world, "overlap");
  const std::string text = corpus(*world, dir);
  // The trainer: grad_accum 4 / world (only the last micro-batch's backward reduces), TP 1;
  // with 4 ranks also DP 2 x TP 2 with sequence parallelism.
  std::vector<std::pair<int, bool>> layouts = {{1, false}};
  if (world->size() >= 4) layouts.push_back({2, true});
  // Both optimizers: ZeRO-1 reduce-scatters its buckets where the plain one all-reduces.
  for (bool zero1 : {false, true})
  for (const auto& [tensor, sp] : layouts) {
    const std::string tag = std::to_string(tensor) + (zero1 ? "_zero1" : "");
    nlohmann::json on = config(dir + "/on_" + tag, text, tensor, sp, zero1);
    nlohmann::json off = config(dir + "/off_" + tag, text, tensor, sp, zero1);
    off["training"]["parallel"]["overlap_grad_reduce"] = false;
    on["training"]["parallel"]["bucket_mb"] = 0;  // 0 MiB: a bucket per parameter, many reductions in flight
    off["training"]["parallel"]["bucket_mb"] = 0;
    const Curve a = run(*world, world, on), b = run(*world, world, off);
    ASSERT_EQ(a.loss.size(), 10u);
    for (size_t i = 0; i < a.loss.size(); ++i) EXPECT_EQ(a.loss[i], b.loss[i]) << "TP " << tag << " step " << i + 1;
    EXPECT_EQ(a.val_loss, b.val_loss);
    EXPECT_EQ(a.grad_norm, b.grad_norm) << tag;
    if (world->rank() == 0) {
      try {
        const auto da = train::latest_checkpoint(dir + "/on_" + tag, false);
        const auto db = train::latest_checkpoint(dir + "/off_" + tag, false);
        EXPECT_TRUE(da && db);
        if (da && db) {
          const io::SafetensorsFile other(*db + "/model.safetensors");
          for (const auto& [name, t] : io::load_safetensors(*da + "/model.safetensors"))
            EXPECT_EQ(t.to_doubles(), other.get(name).to_doubles()) << name << ": final weights";
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    }
    world->barrier();
  }

  // The library: the hook's order, and DataParallel's gradients with it against without.
  Context ctx = Context::cpu();
  const int tensor = world->size() >= 4 ? 2 : 1;
  dist::ParallelGrid grid(ctx, world, {.data = 0, .tensor = tensor, .pipeline = 1, .sequence_parallel = tensor > 1});
  models::ModelConfig mc = models::ModelConfig::from_json(config("", "")["model"]);
  models::TransformerLM model(mc, DType::F32, grid.context());
  model.init(ctx, 7);
  dist::DataParallel dp(ctx, model.parameters(), grid.data, {.bucket_bytes = 4096});
  std::vector<int64_t> ids(2 * 16), tg(2 * 16);
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int64_t>((i * 7 + 3 * grid.data_rank()) % 257);
    tg[i] = static_cast<int64_t>((i * 11 + 5 * grid.data_rank()) % 257);
  }
  const Tensor inputs = Tensor::from_ints(ids, {2, 16}, DType::I32), targets = Tensor::from_ints(tg, {2, 16}, DType::I32);
  // After the whole backward.
  model.zero_grad();
  model.forward_backward(ctx, inputs, targets, 0.5f);
  model.forward_backward(ctx, inputs, targets, 0.5f);
  dp.all_reduce_gradients(ctx);
  std::vector<std::vector<double>> after;
  for (nn::Parameter* p : model.parameters()) after.push_back(doubles_of(p->grad));
  // Overlapped: the second (last) micro-batch's backward marks the parameters.
  std::vector<std::string> order;
  model.zero_grad();
  model.forward_backward(ctx, inputs, targets, 0.5f);
  model.set_grad_ready_hook([&](Context& c, nn::Parameter& p) {
    order.push_back(p.name);
    dp.mark_ready(c, p);
  });
  model.forward_backward(ctx, inputs, targets, 0.5f);
  model.set_grad_ready_hook({});
  dp.finish(ctx);
  const nn::ParameterList params = model.parameters();
  ASSERT_EQ(order.size(), params.size()) << "every parameter once";
  EXPECT_EQ(order.front().rfind("layers.1.", 0), 0u) << "the last layer finishes first: " << order.front();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(std::count(order.begin(), order.end(), params[i]->name), 1) << params[i]->name;
    EXPECT_EQ(doubles_of(params[i]->grad), after[i]) << params[i]->name << ": overlapped vs after backward";
  }
  world->barrier();
}

// A NaN gradient on rank 0 makes the norm NaN on every tensor rank; all ranks rewind
// together, from the per-rank in-memory snapshot (a checkpoint's full-layout snapshot when
// the save is the last good state) or from the last checkpoint, and the curve is TP 1's.
TEST(DistTensorParallelTrainer, TensorParallelRanksRewindTogether) {
  auto world = test_world();
  if (world->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const std::string dir = shared_dir(*world, "rewind");
  const std::string text = corpus(*world, dir);
  for (int snapshot_interval : {2, 0}) {
    auto faulty = [&](const std::string& out, int tensor, bool zero1) {
      nlohmann::json j = config(out, text, tensor, false, zero1);
      j["training"]["checkpoint_interval"] = 2;
      j["training"]["rewind"] = {{"snapshot_interval", snapshot_interval}};
      j["training"]["fault_injection"] = {{"nan_grad_at_step", {5}}};
      return j;
    };
    const std::string tag = "snap" + std::to_string(snapshot_interval);
    const Curve one = run(*world, first(world, 1), faulty(dir + "/one_" + tag, 1, false));
    ASSERT_EQ(one.loss.size(), 10u);
    for (bool zero1 : {false, true}) {
      const std::string out = dir + "/tp2_" + tag + (zero1 ? "_zero1" : "");
      const Curve tp = run(*world, first(world, 2), faulty(out, 2, zero1));
      expect_close(tp.loss, one.loss, kAcrossLayouts, "rewound TP 2 run, " + tag + (zero1 ? ", ZeRO-1" : ""));
      if (world->rank() == 0) {
        const std::string events = io::read_file(out + "/events.jsonl");
        EXPECT_EQ(std::count(events.begin(), events.end(), '\n'), 1) << events;
        EXPECT_NE(events.find("\"back_to_step\":4"), std::string::npos) << events;
      }
      world->barrier();
    }
  }
}
