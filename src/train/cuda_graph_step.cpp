#include "train/cuda_graph_step.h"

#include <cmath>
#include <cstring>

#include "tessera/core/stream.h"
#include "tessera/models/fp8_model.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/graph.h"
#include "backend/cuda/index_error.h"
#endif

namespace tessera::train {

std::optional<std::string> cuda_graph_blocker(const RunConfig& config, Device device, bool distributed) {
  if (!device.is_cuda()) return std::string("the run trains on the CPU (CUDA graphs need a GPU)");
  if (!TESSERA_WITH_CUDA) return std::string("this build has no CUDA backend");
  if (config.model.is_moe())
    return std::string("mixture-of-experts models read their per-expert token counts on the host every step");
  // Every FP8 recipe captures: per-tensor scales and delayed scaling's ring position live on
  // the device; block and mxfp8 keep no state and their casts, scale rearrangement and GEMMs
  // read nothing on the host.
  if (config.optimizer.overlap_backward)
    return std::string("optimizer.overlap_backward updates the parameters on a second stream during the backward, "
                       "which the captured step does not do");
  if (distributed)
    return std::string("runs over several ranks (data or tensor parallel) reduce across ranks and read the global "
                       "gradient norm on the host between backward and the optimizer");
  return std::nullopt;
}

CudaGraphChoice choose_cuda_graph(const RunConfig& config, Device device, bool distributed) {
  if (config.training.cuda_graph == "off") return {false, ""};
  if (auto why = cuda_graph_blocker(config, device, distributed)) return {false, *why};
  return {true, ""};
}

#if TESSERA_WITH_CUDA

// Pinned host memory the step's copies read from and write to, and the graph itself.
struct CudaGraphStep::Impl {
  cuda::CapturedGraph graph;
  Tensor inputs, targets;  // I32 [grad_accum, batch, seq] on the device, refilled before each step
  Tensor scalars;          // F64 [4]: the optimizer's lr and step (adamw_step_scalars)
  Tensor loss;             // F64 [1]: the step's mean loss
  void* staging = nullptr; // pinned: scalars, then inputs, then targets
  void* results = nullptr; // pinned: loss, gradient norm
  std::vector<Tensor> keep;  // buffers of other objects the graph reads, kept alive with it

  ~Impl() {
    graph.abandon();  // waits for the last replay before the memory below goes
    cuda::pinned_host_free(staging);
    cuda::pinned_host_free(results);
  }
};

namespace {
constexpr size_t kScalarBytes = kAdamWStepScalars * sizeof(double);

// ids (any integer dtype, CPU) written as int32 at out.
void write_ids(const Tensor& ids, int32_t* out) {
  const Tensor c = ids.contiguous();
  if (c.dtype() == DType::I32) {
    std::memcpy(out, c.raw_data(), c.nbytes());
    return;
  }
  const int64_t n = c.numel();
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(c.data<int64_t>()[i]);
}

bool has_ignored_target(const Tensor& targets) {
  const Tensor c = targets.contiguous();
  const int64_t n = c.numel();
  constexpr int64_t kIgnore = models::TransformerLM::kIgnoreIndex;
  if (c.dtype() == DType::I32) {
    const int32_t* p = c.data<int32_t>();
    for (int64_t i = 0; i < n; ++i)
      if (p[i] == kIgnore) return true;
    return false;
  }
  const int64_t* p = c.data<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (p[i] == kIgnore) return true;
  return false;
}
}  // namespace

CudaGraphStep::CudaGraphStep(const Context& ctx, models::TransformerLM& model, Optimizer& optimizer,
                             const Options& options)
    : ctx_(ctx), model_(model), optimizer_(optimizer), options_(options) {
  TESSERA_CHECK(ctx.device.is_cuda(), "CudaGraphStep: needs a CUDA device, got ", ctx.device.to_string());
  TESSERA_CHECK(ctx.stream != nullptr, "CudaGraphStep: the context must have a stream of its own ",
                "(the default stream cannot be captured)");
  TESSERA_CHECK(!model.config().is_moe(), "CudaGraphStep: mixture-of-experts models cannot be captured");
  fp8_ = models::fp8_scaling_of(model);
  TESSERA_CHECK(options.batch_size > 0 && options.seq_len > 0 && options.grad_accum > 0 && options.warmup_steps >= 1,
                "CudaGraphStep: batch_size, seq_len and grad_accum must be positive and warmup_steps at least 1");
  StreamGuard guard(ctx_);
  impl_ = std::make_unique<Impl>();
  const Shape ids = {options.grad_accum, options.batch_size, options.seq_len};
  impl_->inputs = Tensor::zeros(ids, DType::I32, ctx.device);
  impl_->targets = Tensor::zeros(ids, DType::I32, ctx.device);
  impl_->scalars = Tensor::zeros({kAdamWStepScalars}, DType::F64, ctx.device);
  impl_->loss = Tensor::zeros({1}, DType::F64, ctx.device);
  impl_->staging = cuda::pinned_host_alloc(kScalarBytes + 2 * impl_->inputs.nbytes());
  impl_->results = cuda::pinned_host_alloc(2 * sizeof(double));
}

CudaGraphStep::~CudaGraphStep() = default;

bool CudaGraphStep::captured() const { return impl_->graph.ready(); }

bool CudaGraphStep::accepts(const std::vector<data::Batch>& batches) const {
  if (static_cast<int64_t>(batches.size()) != options_.grad_accum) return false;
  const Shape shape = {options_.batch_size, options_.seq_len};
  for (const data::Batch& b : batches) {
    for (const Tensor* t : {&b.inputs, &b.targets}) {
      if (!t->defined() || t->shape() != shape || !t->device().is_cpu() ||
          (t->dtype() != DType::I32 && t->dtype() != DType::I64))
        return false;
    }
    if (has_ignored_target(b.targets)) return false;
  }
  return true;
}

void CudaGraphStep::stage(const std::vector<data::Batch>& batches, double lr) {
  // The previous step's finish() synchronised the stream, so no copy still reads staging.
  const auto scalars = optimizer_.step_scalars_for(lr);
  auto* base = static_cast<unsigned char*>(impl_->staging);
  std::memcpy(base, scalars.data(), kScalarBytes);
  const size_t ids_bytes = impl_->inputs.nbytes(), micro = ids_bytes / batches.size();
  for (size_t m = 0; m < batches.size(); ++m) {
    write_ids(batches[m].inputs, reinterpret_cast<int32_t*>(base + kScalarBytes + m * micro));
    write_ids(batches[m].targets, reinterpret_cast<int32_t*>(base + kScalarBytes + ids_bytes + m * micro));
  }
  cuda::memcpy_async(impl_->scalars.raw_data(), base, kScalarBytes, ctx_.stream);
  cuda::memcpy_async(impl_->inputs.raw_data(), base + kScalarBytes, ids_bytes, ctx_.stream);
  cuda::memcpy_async(impl_->targets.raw_data(), base + kScalarBytes + ids_bytes, ids_bytes, ctx_.stream);
}

void CudaGraphStep::queue_step() {
  impl_->loss.fill_zero();
  model_.zero_grad();
  // The eager loop's expressions: scale 1.0f / grad_accum, loss += value / grad_accum.
  const float scale = 1.0f / options_.grad_accum;
  const double divisor = static_cast<double>(options_.grad_accum);
  for (int64_t m = 0; m < options_.grad_accum; ++m) {
    model_.forward_backward_into(ctx_, impl_->inputs.select(0, m), impl_->targets.select(0, m), scale, impl_->loss,
                                 divisor);
    if (fp8_) fp8_->end_micro_batch(ctx_);
  }
  optimizer_.queue_step(ctx_, impl_->scalars);
  // Delayed scaling's next scales, from history and ring position on the device (no-op for
  // current scaling): replays read and advance the position there.
  if (fp8_) fp8_->end_step(ctx_);
}

void CudaGraphStep::capture() {
  try {
    impl_->graph.begin(ctx_.device.index, ctx_.stream);
    queue_step();
    impl_->graph.end();
    impl_->keep = model_.step_buffers();
    for (Tensor& t : optimizer_.step_buffers()) impl_->keep.push_back(t);
  } catch (const std::exception& e) {
    impl_->graph.abandon();
    // A table upload queued during the capture never ran: have the next step upload again.
    optimizer_.reset_device_tables();
    failure_ = e.what();
    if (failure_.empty()) failure_ = "the capture failed";
  }
}

CudaGraphStep::Result CudaGraphStep::step(const std::vector<data::Batch>& batches, double lr) {
  TESSERA_CHECK(accepts(batches), "CudaGraphStep::step: takes ", options_.grad_accum, " host batches of [",
                options_.batch_size, ", ", options_.seq_len, "] ids with every target valid (check accepts() first)");
  StreamGuard guard(ctx_);
  // This step changes the weights without the FP8 casts an eager cast_in_optimizer update
  // primed, and its forward reads the BF16 weights as they are: drop the one, renew the
  // other where that update left it stale.
  if (fp8_) fp8_->weight_cache()->drop_primed();
  for (nn::Parameter* p : model_.parameters()) p->refresh_value_if_stale(ctx_);
  stage(batches, lr);
  if (steps_ >= options_.warmup_steps && !captured() && failure_.empty()) capture();
  steps_ += 1;
  if (captured()) {
    impl_->graph.replay();
    return finish(true);
  }
  queue_step();
  return finish(false);
}

CudaGraphStep::Result CudaGraphStep::finish(bool replayed) {
  auto* results = static_cast<double*>(impl_->results);
  cuda::memcpy_async(results, impl_->loss.raw_data(), sizeof(double), ctx_.stream);
  cuda::memcpy_async(results + 1, optimizer_.grad_norm().raw_data(), sizeof(double), ctx_.stream);
  cuda::synchronize(ctx_.stream);
  optimizer_.count_step();
  // An out-of-range token id met by the embedding or loss kernels, reported as the eager
  // ops report it (at their next call).
  cuda::raise_pending_index_error(ctx_.device.index, ctx_.stream, "training step");
  Result r;
  r.loss = results[0];
  r.grad_norm = std::isfinite(r.loss) ? results[1] : NAN;
  r.replayed = replayed;
  return r;
}

#else  // no CUDA backend: the class exists, but nothing can construct it

struct CudaGraphStep::Impl {};

CudaGraphStep::CudaGraphStep(const Context& ctx, models::TransformerLM& model, Optimizer& optimizer,
                             const Options& options)
    : ctx_(ctx), model_(model), optimizer_(optimizer), options_(options) {
  TESSERA_FAIL("CudaGraphStep: this build has no CUDA backend (configure with -DTESSERA_CUDA=ON)");
}
CudaGraphStep::~CudaGraphStep() = default;
bool CudaGraphStep::captured() const { return false; }
bool CudaGraphStep::accepts(const std::vector<data::Batch>&) const { return false; }
CudaGraphStep::Result CudaGraphStep::step(const std::vector<data::Batch>&, double) {
  TESSERA_FAIL("CudaGraphStep: this build has no CUDA backend");
}
void CudaGraphStep::stage(const std::vector<data::Batch>&, double) {}
void CudaGraphStep::queue_step() {}
void CudaGraphStep::capture() {}
CudaGraphStep::Result CudaGraphStep::finish(bool) { return {}; }

#endif

}  // namespace tessera::train
