// Times a data-parallel training step (forward, backward, gradient reduction, AdamW) on
// random tokens, one process per rank:
//
//   mpirun -np 2 bench_dist_train_step --model llama3.2-1b --device cuda --precision bf16 --batch 4 --seq 2048
//   mpirun -np 4 --oversubscribe bench_dist_train_step --model '{"architecture":"gpt2",...}' --device cpu
//
// CPU ranks reduce over MPI; CUDA ranks over NCCL (bootstrapped by MPI), rank r on GPU
// (local rank % GPUs). --batch is per rank (weak scaling). --zero1 uses the distributed
// optimizer instead of DataParallel + AdamW (reduce-scatter per bucket, all-gather after
// the update); --no-reduce skips the gradient reduction (the compute-only baseline: tokens/s
// per GPU with it, against without, is the weak-scaling efficiency; not with --zero1).
// --overlap starts each bucket's reduction (all-reduce, or reduce-scatter with --zero1)
// during the backward, as the trainer does, on NCCL's communication stream beside the
// compute stream. Rank 0 prints one JSON line with the median step time and tokens/s per
// rank and in all; the loss is averaged over the ranks.
//
// Tensor parallelism: --tp N builds the model as `tessera train` does with parallel.tensor N
// (models/parallel_lm: column/row-parallel layers, vocab-parallel embedding and head), the
// world split into world/N data-parallel ranks x N tensor-parallel ones (neighbouring ranks
// share a tensor group, so one host's GPUs); --batch is then per data-parallel rank (every
// rank of a tensor group sees the same sequences), gradients are reduced over the data group
// (DataParallel; --overlap and --no-reduce as above) and clipped by the model's global norm.
// --sequence-parallel splits the activations between the parallel regions along the tokens;
// --tp-overlap is parallel.tp_comm_overlap (the column-parallel layers' dx reductions beside
// their weight-gradient GEMMs). Two H200s, Llama-3.2-1B:
//
//   mpirun -np 2 bench_dist_train_step --model llama3.2-1b --device cuda --precision bf16 --batch 4 --seq 2048 \
//       --tp 2 [--sequence-parallel] [--tp-overlap]
//
// mode: "tp2", "tp2-sp", "tp2-overlap", "tp2-sp-overlap" (prefixed "dp<D>-" when D > 1).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "bench_models.h"
#include "tessera/core/allocator.h"
#include "tessera/core/philox.h"
#include "tessera/core/stream.h"
#include "tessera/dist/data_parallel.h"
#include "tessera/dist/distributed_optimizer.h"
#include "tessera/dist/nccl_group.h"
#include "tessera/dist/runtime.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/train/optimizer.h"

#if TESSERA_WITH_CUDA
#include <cuda_runtime.h>

#include "backend/cuda/cuda_backend.h"
#endif

using namespace tessera;
using tessera::bench::named_or_json;

namespace {

int local_rank(int world_rank) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK"})
    if (const char* v = std::getenv(name)) return std::atoi(v);
  return world_rank;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Time a data-parallel training step on random tokens (run under mpirun)"};
  std::string model_json, device = "cpu", precision = "fp32";
  int64_t batch = 4, seq = 256, steps = 10, warmup = 2, vocab = 0;
  size_t bucket_mb = 25;
  bool zero1 = false, no_reduce = false, overlap = false, sequence_parallel = false, tp_overlap = false;
  int tp = 1;
  app.add_option("--model", model_json, "gpt2-124m, llama3.2-1b, or a model config as JSON")->required();
  app.add_option("--vocab", vocab, "Override the model's vocabulary size");
  app.add_option("--device", device)->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--precision", precision)->capture_default_str()->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--batch", batch, "Sequences per rank")->capture_default_str();
  app.add_option("--seq", seq)->capture_default_str();
  app.add_option("--steps", steps)->capture_default_str();
  app.add_option("--warmup", warmup)->capture_default_str();
  app.add_option("--bucket-mb", bucket_mb, "Gradient bucket size (DataParallel's, or ZeRO-1's)")->capture_default_str();
  app.add_flag("--zero1", zero1, "Shard the optimizer state (dist::DistributedOptimizer)");
  app.add_flag("--no-reduce", no_reduce, "Skip the gradient reduction (compute-only baseline)");
  app.add_flag("--overlap", overlap,
               "Start each bucket's reduction during the backward, as soon as its gradients are final "
               "(on CUDA on NCCL's own stream, beside the rest of the backward), as the trainer does");
  app.add_option("--tp", tp, "Tensor-parallel size (the data-parallel size is world / tp)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag("--sequence-parallel", sequence_parallel, "With --tp: split the activations along the tokens");
  app.add_flag("--tp-overlap", tp_overlap,
               "With --tp: overlap the tensor-parallel backward collectives with the weight-gradient GEMMs "
               "(parallel.tp_comm_overlap)");
  CLI11_PARSE(app, argc, argv);
  try {
    dist::GroupPtr world = dist::init_from_env();
    dist::GroupPtr group = world;
    const bool tensor_parallel = tp > 1;
    if ((sequence_parallel || tp_overlap) && !tensor_parallel)
      throw std::runtime_error("--sequence-parallel and --tp-overlap need --tp 2 or more");
    if (tensor_parallel && zero1)
      throw std::runtime_error("--zero1 with --tp: not built into this benchmark (tessera train runs it)");
    if (world->size() % tp != 0)
      throw std::runtime_error("--tp " + std::to_string(tp) + " does not divide the " + std::to_string(world->size()) +
                               " ranks");
    std::optional<dist::Runtime> rt;  // the data x tensor grid (--tp)
    Context ctx = Context::cpu();
    Stream compute;  // CUDA: a non-blocking stream, as the trainer runs on
    std::optional<StreamGuard> guard;
    if (device == "cuda") {
#if TESSERA_WITH_CUDA
      int count = 0;
      cudaGetDeviceCount(&count);
      if (count == 0) throw std::runtime_error("--device cuda: no GPU present");
      const int index = local_rank(world->rank()) % count;
      cudaSetDevice(index);
      compute = Stream::create(Device::cuda(index));
      ctx = compute.context();
      guard.emplace(ctx);
      if (!tensor_parallel) group = dist::nccl_group(ctx, *world, index);
#else
      throw std::runtime_error("--device cuda: this build has no CUDA backend");
#endif
    }
    models::ModelConfig config = named_or_json(model_json);
    if (vocab > 0) config.vocab_size = vocab;
    nn::ParallelContext parallel;
    if (tensor_parallel) {
      // As `tessera train` builds its groups (dist/runtime.h): NCCL on CUDA, the host world on the CPU.
      dist::ParallelConfig pc;
      pc.tensor = tp;
      pc.sequence_parallel = sequence_parallel;
      pc.tp_comm_overlap = tp_overlap;
      pc.bucket_mb = bucket_mb;
      rt.emplace(dist::init_from_env(pc, ctx, world));
      ctx = rt->ctx;
      parallel = rt->grid->context();
      group = rt->grid->data;  // the gradient reduction's group
      if (sequence_parallel && (batch * seq) % tp != 0)
        throw std::runtime_error("--sequence-parallel needs batch x seq divisible by --tp");
    }
    const int data_size = tensor_parallel ? parallel.data_size : world->size();
    const int data_rank = tensor_parallel ? parallel.data_rank : world->rank();
    models::TransformerLM model(config, precision == "bf16" ? DType::BF16 : DType::F32, parallel);
    model.to(ctx.device);
    model.init(ctx, 1);
    std::unique_ptr<dist::DataParallel> dp;
    std::unique_ptr<train::Optimizer> optimizer;
    std::unique_ptr<dist::DistributedOptimizer> sharded;
    if (zero1) {
      if (no_reduce) throw std::runtime_error("--no-reduce: ZeRO-1 cannot skip its reduce-scatter; drop --zero1");
      sharded = std::make_unique<dist::DistributedOptimizer>(
          ctx, model.parameters(), group, train::OptimizerConfig{},
          dist::DistributedOptimizerOptions{.bucket_bytes = bucket_mb << 20});
      if (overlap)
        model.set_grad_ready_hook([z = sharded.get()](Context& c, nn::Parameter& p) { z->mark_ready(c, p); });
    } else {
      // As the trainer: no data-parallel reduction when the data group is one rank (--tp = world).
      if (data_size > 1 || !tensor_parallel)
        dp = std::make_unique<dist::DataParallel>(ctx, model.parameters(), group,
                                                  dist::DataParallelOptions{.bucket_bytes = bucket_mb << 20});
      // Tensor parallelism: the optimizer's own norm would be this rank's shards'; clip by the
      // model's global norm instead, after the reduction, as the trainer does.
      train::OptimizerConfig oc;
      if (tensor_parallel) oc.grad_clip = 0;
      optimizer = std::make_unique<train::Optimizer>(model.parameters(), oc);
      if (dp && overlap && !no_reduce)
        model.set_grad_ready_hook([d = dp.get()](Context& c, nn::Parameter& p) { d->mark_ready(c, p); });
    }
    Tensor inputs = Tensor::empty({batch, seq}, DType::I32), targets = Tensor::empty({batch, seq}, DType::I32);
    const uint64_t stream = static_cast<uint64_t>(data_rank);  // the same tokens across a tensor group
    for (int64_t i = 0; i < batch * seq; ++i) {
      inputs.data<int32_t>()[i] = static_cast<int32_t>(philox_word(7, stream, 2 * i) % config.vocab_size);
      targets.data<int32_t>()[i] = static_cast<int32_t>(philox_word(7, stream, 2 * i + 1) % config.vocab_size);
    }
    std::vector<double> times;
    double loss = 0;
    for (int64_t s = 0; s < warmup + steps; ++s) {
      world->barrier();
      const auto start = std::chrono::steady_clock::now();
      model.zero_grad();
      if (sharded) sharded->begin_backward();
      loss = model.forward_backward(ctx, inputs, targets);
      if (sharded) {
        sharded->step(ctx, 1e-4);
      } else {
        if (dp && overlap && !no_reduce) dp->finish(ctx);
        else if (dp && !no_reduce) dp->all_reduce_gradients(ctx);
        if (tensor_parallel) model.clip_grad_norm(ctx, train::OptimizerConfig{}.grad_clip);
        optimizer->step(ctx, 1e-4);
      }
      synchronize(ctx);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (s >= warmup) times.push_back(seconds);
    }
    // The slowest rank sets the pace: the median over steps of the maximum over ranks.
    Tensor step_times = Tensor::from_doubles(times, {static_cast<int64_t>(times.size())});
    Tensor losses = Tensor::from_doubles({loss}, {1});
    Context cpu = Context::cpu();
    if (world->size() > 1) {  // the host transport: MPI, or TCP under tessera-style RANK/WORLD_SIZE launches
      world->all_reduce(cpu, step_times, dist::ReduceOp::Max);
      world->all_reduce(cpu, losses, dist::ReduceOp::Avg);
    }
    std::vector<double> slowest = step_times.to_doubles();
    std::sort(slowest.begin(), slowest.end());
    const double median = slowest[slowest.size() / 2];
    if (world->rank() == 0) {
      std::string mode = zero1 ? (overlap ? "dp-zero1-overlap" : "dp-zero1")
                               : (no_reduce ? "dp-no-reduce" : (overlap ? "dp-overlap" : "dp"));
      if (tensor_parallel) {
        mode = (data_size > 1 ? "dp" + std::to_string(data_size) + "-" : std::string()) + "tp" + std::to_string(tp) +
               (sequence_parallel ? "-sp" : "") + (tp_overlap ? "-overlap" : "");
        if (data_size > 1 && no_reduce) mode += "-no-reduce";
        if (data_size > 1 && overlap && !no_reduce) mode += "-dp-overlap";
      }
      nlohmann::json out = {{"impl", "tessera"},
                            {"mode", mode},
                            {"ranks", world->size()},
                            {"backend", tensor_parallel ? rt->grid->tensor->backend() : group->backend()},
                            {"data_parallel", data_size},
                            {"tensor_parallel", tp},
                            {"device", device},
                            {"precision", precision},
                            {"params", model.num_parameters()},
                            {"batch_per_rank", batch},
                            {"seq", seq},
                            {"median_step_s", median},
                            // per GPU: the distinct tokens of a step over all ranks (a tensor
                            // group shares its sequences)
                            {"tokens_per_s_per_rank", double(batch * seq * data_size) / median / world->size()},
                            {"tokens_per_s", double(batch * seq * data_size) / median},
                            {"loss", losses.item(0)}};
      if (dp) out["buckets"] = dp->buckets().size();
      if (tensor_parallel) {  // this rank's shards (with its vocabulary padding rows)
        out.erase("params");
        out["params_per_rank"] = model.num_parameters();
      }
      if (sharded) out["buckets"] = sharded->bucket_parameters().size();
#if TESSERA_WITH_CUDA
      if (ctx.device.is_cuda())
        out["peak_memory_gib"] = double(cuda::allocator_stats(ctx.device.index).peak_bytes_reserved) / (1ull << 30);
#endif
      std::printf("%s\n", out.dump().c_str());
    }
    dp.reset();
    group.reset();
    rt.reset();
    world.reset();
    dist::finalize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_dist_train_step: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
