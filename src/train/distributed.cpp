// The data-parallel side of `tessera train` (see train/distributed.h).
#include "train/distributed.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <thread>

#include "tessera/dist/watchdog.h"

namespace tessera::train::detail {

namespace {

// "section.key" -> value, for the leaves of a config.
void flatten(const nlohmann::json& j, const std::string& prefix, std::map<std::string, std::string>& out) {
  if (j.is_object() && !j.empty()) {
    for (const auto& [key, value] : j.items()) flatten(value, prefix.empty() ? key : prefix + "." + key, out);
  } else {
    out[prefix] = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
}

// The keys whose values differ between two configs, as "key: a vs b" (at most a few).
std::string differences(const std::string& a_text, const std::string& b_text) {
  std::map<std::string, std::string> a, b;
  flatten(nlohmann::json::parse(a_text, nullptr, false), "", a);
  flatten(nlohmann::json::parse(b_text, nullptr, false), "", b);
  std::string out;
  int shown = 0, total = 0;
  auto note = [&](const std::string& key, const std::string& x, const std::string& y) {
    ++total;
    if (shown++ < 4) out += (out.empty() ? "" : "; ") + key + " = " + x + " vs " + y;
  };
  for (const auto& [key, value] : a) {
    auto it = b.find(key);
    if (it == b.end()) note(key, value, "(absent)");
    else if (it->second != value) note(key, value, it->second);
  }
  for (const auto& [key, value] : b)
    if (!a.count(key)) note(key, "(absent)", value);
  if (total > shown) out += "; and " + std::to_string(total - shown) + " more";
  return out;
}

void check_same_config(dist::ProcessGroup& world, const RunConfig& config, const nlohmann::json& invocation) {
  if (world.size() == 1) return;
  nlohmann::json all_settings = config.to_json();
  if (!invocation.is_null()) all_settings["invocation"] = invocation;
  const std::string mine = all_settings.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  // A hash first: the texts travel only when they differ.
  Context cpu = Context::cpu();
  Tensor hash = Tensor::from_ints({static_cast<int64_t>(dist::hash_string(mine))}, {1}, DType::I64);
  Tensor hashes = Tensor::empty({world.size()}, DType::I64);
  world.all_gather(cpu, hash, hashes);
  const std::vector<int64_t> h = hashes.to_ints();
  bool same = true;
  for (int64_t v : h) same = same && v == h[0];
  if (same) return;
  const std::vector<std::string> all = dist::all_gather_strings(world, mine);
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    TESSERA_FAIL("ranks disagree on the run config: rank ", world.world_ranks()[r], " differs from rank ",
                 world.world_ranks()[0], " in ", differences(all[r], all[0]), " (rank ", world.world_ranks()[r],
                 "'s value first). Every rank must run the same config file, --set overrides and options; every rank stops");
  }
}

}  // namespace

DistributedRun::DistributedRun(const RunConfig& config, const Context& device, dist::GroupPtr world,
                               const nlohmann::json& invocation) {
  const dist::ParallelConfig& p = config.training.parallel;
  dist::set_timeout(p.timeout_s);
  if (!world) world = dist::init_from_env();
  check_same_config(*world, config, invocation);
  TESSERA_CHECK(p.pipeline == 1, "config: training.parallel.pipeline must be 1 for now (pipeline schedules do not ",
                "exist yet); got ", p.pipeline);
  rt_ = dist::init_from_env(p, device, world);
  zero1_ = p.distributed_optimizer;
  timeout_s_ = p.timeout_s;
  bucket_bytes_ = p.bucket_mb << 20;
  overlap_ = p.overlap_grad_reduce;
  TESSERA_CHECK(!(config.model.is_moe() && config.model.expert_bias_rate > 0 && data_size() > 1),
                "config: model.expert_bias_rate > 0 with ", data_size(), " data-parallel ranks: each rank would move ",
                "its expert biases by its own loads and the replicas would drift apart (not supported yet; set ",
                "model.expert_bias_rate: 0 or run on one rank)");
}

RunConfig DistributedRun::resolve(const RunConfig& config) const {
  RunConfig c = config;
  TrainingConfig& t = c.training;
  if (t.global_batch_size > 0) {
    const int64_t per_pass = t.batch_size * data_size();
    TESSERA_CHECK(t.global_batch_size % per_pass == 0, "config: training.global_batch_size (", t.global_batch_size,
                  ") must be a multiple of training.batch_size x data-parallel ranks = ", t.batch_size, " x ",
                  data_size(), " = ", per_pass);
    const int64_t accum = t.global_batch_size / per_pass;
    TESSERA_CHECK(t.grad_accum == 1 || t.grad_accum == accum, "config: training.grad_accum (", t.grad_accum,
                  ") contradicts training.global_batch_size: ", t.global_batch_size, " / (batch_size ", t.batch_size,
                  " x ", data_size(), " data ranks) = ", accum, " micro-batches per rank; leave grad_accum out");
    t.grad_accum = accum;
  }
  return c;
}

void DistributedRun::barrier() {
  if (size() > 1) rt_.world->barrier();
}

void DistributedRun::wait_for_all() {
  if (size() == 1) return;
  dist::ScopedTimeout unbounded(0);
  rt_.world->barrier();
}

std::unique_ptr<dist::DistributedOptimizer> DistributedRun::make_zero1(Context& ctx, models::TransformerLM& model,
                                                                       const OptimizerConfig& config) {
  if (!zero1_) return nullptr;
  auto zero1 = std::make_unique<dist::DistributedOptimizer>(ctx, model.parameters(), rt_.grid->data, config,
                                                             dist::DistributedOptimizerOptions{.bucket_bytes = bucket_bytes_});
  if (model.tensor_parallel()) zero1->set_tensor_parallel(rt_.grid->tensor, model.shard_layouts());
  zero1_opt_ = zero1.get();
  return zero1;
}

void DistributedRun::setup_replicas(Context& ctx, models::TransformerLM& model) {
  if (data_size() == 1) return;
  dist::broadcast_parameters(ctx, model.parameters(), *rt_.grid->data, 0);
  if (!zero1_ && !dp_)
    dp_ = std::make_unique<dist::DataParallel>(ctx, model.parameters(), rt_.grid->data,
                                               dist::DataParallelOptions{.bucket_bytes = bucket_bytes_});
}

void DistributedRun::arm_overlap(models::TransformerLM& model, bool overlap) {
  // ZeRO-1: a new backward; forgets what a skipped step (a NaN loss) left reduced.
  if (zero1_opt_) zero1_opt_->begin_backward();
  const bool reduces = dp_ || (zero1_opt_ && data_size() > 1);
  armed_ = reduces && overlap_ && overlap;
  if (!armed_) {
    model.set_grad_ready_hook({});
    return;
  }
  if (dp_) {
    dist::DataParallel* dp = dp_.get();
    model.set_grad_ready_hook([dp](Context& ctx, nn::Parameter& p) { dp->mark_ready(ctx, p); });
  } else {
    dist::DistributedOptimizer* zero1 = zero1_opt_;
    model.set_grad_ready_hook([zero1](Context& ctx, nn::Parameter& p) { zero1->mark_ready(ctx, p); });
  }
}

void DistributedRun::reduce_gradients(Context& ctx) {
  if (zero1_opt_) {
    // The buckets the backward started are waited for here (the step itself reduces the
    // rest when not armed), so that none is left in flight when the step is skipped.
    if (armed_) zero1_opt_->reduce_gradients(ctx);
    armed_ = false;
    return;
  }
  if (!dp_) return;
  if (armed_) {
    dp_->finish(ctx);  // the buckets the backward started, and any it did not
    armed_ = false;
  } else {
    dp_->all_reduce_gradients(ctx);
  }
}

double DistributedRun::sum(double local) {
  if (data_size() == 1) return local;
  Context cpu = Context::cpu();
  Tensor t = Tensor::from_doubles({local}, {1});
  rt_.host->data->all_reduce(cpu, t, dist::ReduceOp::Sum);
  return t.item(0);
}

double DistributedRun::average(double local) { return data_size() == 1 ? local : sum(local) / data_size(); }

void DistributedRun::agree(std::optional<std::string>& why, bool& time_up) {
  if (size() == 1) return;
  Context cpu = Context::cpu();
  Tensor mine = Tensor::from_ints({why ? 1 : 0, time_up ? 1 : 0}, {2}, DType::I64);
  Tensor all = Tensor::empty({2 * size()}, DType::I64);
  rt_.world->all_gather(cpu, mine, all);
  const std::vector<int64_t> v = all.to_ints();
  for (int r = 0; r < size(); ++r) {
    if (v[static_cast<size_t>(2 * r)] && !why)
      why = "rank " + std::to_string(r) + "'s detectors fired (this rank's did not: the ranks saw different values)";
    if (v[static_cast<size_t>(2 * r + 1)]) time_up = true;
  }
}

void DistributedRun::skip_batches(data::DataLoader& loader, int64_t n) {
  if (n <= 0) return;
  data::LoaderPosition p = loader.position();
  const int64_t per_epoch = loader.batches_per_epoch();
  const int64_t index = p.index + n;
  p.epoch += index / per_epoch;
  p.index = index % per_epoch;
  loader.set_position(p);
}

CheckpointWriters DistributedRun::writers() const {
  return {.rank = rank(), .ranks = size(), .timeout_s = timeout_s_};
}

void DistributedRun::begin_checkpoint(const std::string& out_dir, int64_t step) {
  if (size() == 1) return;
  if (is_main()) train::begin_checkpoint(out_dir, step);
  wait_for_all();  // rank 0 may have waited long for its previous write
}

std::optional<std::string> DistributedRun::latest_checkpoint(const std::string& out_dir,
                                                             std::vector<std::string>* skipped) {
  if (size() == 1) return train::latest_checkpoint(out_dir, true, skipped);
  std::string found, problems;
  if (is_main()) {
    std::vector<std::string> mine;
    if (auto dir = train::latest_checkpoint(out_dir, true, &mine)) found = *dir;
    for (const std::string& p : mine) problems += p + "\n";
  }
  dist::ScopedTimeout unbounded(0);  // rank 0 verifies checkpoints meanwhile
  found = dist::broadcast_string(*rt_.world, found, 0);
  problems = dist::broadcast_string(*rt_.world, problems, 0);
  if (skipped) {
    size_t begin = 0;
    while (begin < problems.size()) {
      const size_t end = problems.find('\n', begin);
      skipped->push_back(problems.substr(begin, end - begin));
      begin = end + 1;
    }
  }
  if (found.empty()) return std::nullopt;
  return found;
}

void DistributedRun::inject_rank_fault(const FaultInjectionConfig& f, int64_t step) const {
  if (f.fault_rank != rank() || f.fault_step != step) return;
  std::fprintf(stderr, "tessera: fault injection: rank %d %s at step %lld\n", rank(),
               f.fault_kind == "hang" ? "hangs" : f.fault_kind == "kill" ? "is killed" : "exits",
               static_cast<long long>(step));
  std::fflush(stderr);
  if (f.fault_kind == "hang") {
    dist::set_timeout(0);  // this rank's own watchdog must not end it: it plays a stuck process
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(60));
  }
  if (f.fault_kind == "kill") ::kill(::getpid(), SIGKILL);
  std::_Exit(3);
}

}  // namespace tessera::train::detail
