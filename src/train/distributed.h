// The data-parallel side of `tessera train` (see docs/distributed.md), kept out of the
// training loop: the world and its groups, the config check between ranks, which
// micro-batches of a global batch this rank computes, gradient reduction, decisions all
// ranks take together, and the collective parts of checkpointing.
//
// A world of one (no launcher) makes every call here a no-op or the single-process
// behaviour, so the loop is the same code with and without data parallelism.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/data/loader.h"
#include "tessera/dist/data_parallel.h"
#include "tessera/dist/distributed_optimizer.h"
#include "tessera/dist/runtime.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/config.h"

namespace tessera::train::detail {

class DistributedRun {
 public:
  // Collective over the world (`world`, or dist::init_from_env() when null): checks that
  // every rank runs the same config (an error names the first rank and key that differ),
  // builds the groups of training.parallel and picks this rank's GPU when `device` is CUDA.
  // `invocation`: what else every rank must agree on (command-line options such as --resume),
  // compared with the config.
  DistributedRun(const RunConfig& config, const Context& device, dist::GroupPtr world,
                 const nlohmann::json& invocation = nullptr);

  Context device_context() const { return rt_.ctx; }
  nn::ParallelContext parallel_context() const { return rt_.grid->context(); }
  const dist::Runtime& runtime() const { return rt_; }
  bool is_main() const { return rt_.is_main(); }
  int size() const { return rt_.size(); }
  int rank() const { return rt_.rank(); }
  int data_size() const { return rt_.host->data_size(); }
  int data_rank() const { return rt_.host->data_rank(); }
  int tensor_size() const { return rt_.host->tensor_size(); }
  bool zero1() const { return zero1_; }

  // The config this rank runs: grad_accum derived from training.global_batch_size.
  RunConfig resolve(const RunConfig& config) const;

  // Rank 0 runs f first (e.g. writes a cache every rank reads), then the others.
  template <typename F>
  auto main_first(F&& f) -> decltype(f()) {
    if (size() == 1) return f();
    if (is_main()) {
      auto out = f();
      wait_for_all();
      return out;
    }
    wait_for_all();
    return f();
  }
  void barrier();
  // A barrier without the timeout, after file I/O that may take long on some rank (see
  // dist::ScopedTimeout).
  void wait_for_all();

  // The distributed optimizer when training.parallel.distributed_optimizer is on, else null;
  // under tensor parallelism its clipping norm is the single-device model's (over data x
  // tensor, replicated parameters counted once).
  std::unique_ptr<dist::DistributedOptimizer> make_zero1(Context& ctx, models::TransformerLM& model,
                                                         const OptimizerConfig& config);
  // After the weights are final (init, resume, init_from): rank 0's weights to every data
  // rank, and the gradient buckets when the plain optimizer runs on several data ranks.
  void setup_replicas(Context& ctx, models::TransformerLM& model);
  // Before each micro-batch's forward_backward: on several data ranks with
  // training.parallel.overlap_grad_reduce, `overlap` (the last micro-batch of the step)
  // makes the model's backward start each gradient bucket's reduction as soon as its
  // parameters are final (TransformerLM::set_grad_ready_hook -> DataParallel::mark_ready,
  // or DistributedOptimizer::mark_ready: a reduce-scatter per bucket); otherwise the hook is
  // off.
  void arm_overlap(models::TransformerLM& model, bool overlap);
  // Averages the gradients over the data ranks. The plain optimizer: waits for the buckets
  // the backward started and reduces the rest, or, when not armed, reduces every bucket now.
  // ZeRO-1: when armed, starts the rest and waits (otherwise its step reduce-scatters). The
  // same bits either way.
  void reduce_gradients(Context& ctx);
  // Over the data ranks, in double on the host.
  double average(double local);
  double sum(double local);

  // Every rank decides together: a detector that fired on one rank (`why`, with the reason
  // of the lowest such rank when this one did not fire) and time_up become every rank's.
  void agree(std::optional<std::string>& why, bool& time_up);

  // Advances the loader by n batches without reading them.
  static void skip_batches(data::DataLoader& loader, int64_t n);

  // Checkpoints: who writes, the collective begin of a save, and the newest verified
  // checkpoint as rank 0 finds it (every rank gets the same answer).
  CheckpointWriters writers() const;
  void begin_checkpoint(const std::string& out_dir, int64_t step);
  std::optional<std::string> latest_checkpoint(const std::string& out_dir, std::vector<std::string>* skipped);

  // training.fault_injection.rank_fault, when it names this rank and step.
  void inject_rank_fault(const FaultInjectionConfig& faults, int64_t step) const;

 private:
  dist::Runtime rt_;
  bool zero1_ = false;
  double timeout_s_ = 0;
  size_t bucket_bytes_ = 0;
  bool overlap_ = true, armed_ = false;
  std::unique_ptr<dist::DataParallel> dp_;
  dist::DistributedOptimizer* zero1_opt_ = nullptr;  // make_zero1's, owned by the caller
};

}  // namespace tessera::train::detail
