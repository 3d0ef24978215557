// FP8 weight casts made once per optimizer step instead of once per micro-batch
// (fp8.cache_weights; Transformer Engine's `is_first_microbatch`).
//
// Under gradient accumulation a step runs several forwards with the same weights: the
// optimizer only changes them after the last backward. Casting each weight to FP8 again in
// every micro-batch reads the BF16 weight and writes its codes every time (1.75 ms of a
// Mixtral expert MLP's 19 ms). A WeightCache keeps the first micro-batch's casts, both
// orientations, and hands them to the step's later micro-batches.
//
// Why it cannot go stale: entries exist only while the cache is OPEN, and the owner opens it
// before a step's first micro-batch and closes it after the last one's backward, before the
// optimizer (nn::Fp8Scaling::begin_step / end_micro_batch, which the trainer calls around
// each micro-batch). Open and close both drop every entry. So the optimizer, checkpoint loads,
// imports and evaluations, which all run outside that window, never see a cast of an older
// weight, and code that never opens the cache (tests, inference, a captured CUDA-graph step)
// casts every time as before.
//
// The reuse gives exactly the bits of casting again: inside a step the weight is unchanged,
// and so is its scale (delayed scaling changes scales in end_step; current scaling's scale
// is a function of the weight). Delayed scaling records a weight's amax when it is cast, in
// the first micro-batch; later micro-batches leave its pending amax at 0, and the history
// folds micro-batches with max, so the recorded history is the same too.
//
// Cost: each cached weight keeps its row-wise and transposed codes (2 bytes per parameter)
// from the first forward until the step ends, where the uncached path holds at most one
// layer's. Not thread-safe: one cache per model, used by the thread that trains it.
//
// fp8.cast_in_optimizer: the optimizer's update of an MoE expert weight also writes its casts
// for the next step (nn::GroupedLinear::optimizer_update) and PRIMES the cache with them.
// Primed entries outlive close(); the next open() starts from them, and with nothing but
// primed entries to serve (one micro-batch a step) it keeps no new casts. With one forward
// to serve (serve_once) each entry leaves the cache as it is handed out, so that its
// row-wise codes go after that forward's GEMM and its transposed codes after the backward's,
// as an uncached cast's do, rather than at the step's end (about 2 bytes per expert
// parameter of the layers already run, at the backward's peak). They are the next step's
// casts only if the weights do not change before that open: whoever changes them in between
// (a rewind, a step run without the cache) calls drop_primed().
//
// The same window carries work deferred to the step's last micro-batch (defer / flush): the
// MoE experts' weight gradients under fp8.defer_expert_wgrad (nn::GroupedLinear), which are
// computed once per step over every micro-batch's rows instead of once per micro-batch.
#pragma once

#include <any>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tessera/core/context.h"
#include "tessera/core/error.h"

namespace tessera::fp8 {

class WeightCache {
 public:
  // Start of a step's micro-batches: entries made from now on serve the rest of the step.
  // keep_new false: serve the primed entries only, casting anything else every time.
  // serve_once: an entry leaves the cache when it is served (the step has one forward).
  void open(bool keep_new = true, bool serve_once = false) {
    TESSERA_CHECK(deferred_.empty(), "fp8::WeightCache: opened with deferred work not flushed");
    entries_ = std::move(primed_);
    primed_.clear();
    open_ = true;
    keep_new_ = keep_new;
    serve_once_ = serve_once;
  }
  // End of the step (before the weights change): every entry goes, nothing is cached.
  // Deferred work must have been flushed.
  void close() {
    TESSERA_CHECK(deferred_.empty(), "fp8::WeightCache: closed with deferred work not flushed");
    entries_.clear();
    open_ = false;
  }
  // Work for the end of the window (while open), run by flush in the order deferred.
  void defer(std::function<void(Context&)> work) { deferred_.push_back(std::move(work)); }
  bool has_deferred() const { return !deferred_.empty(); }
  // Runs the deferred work on ctx, then forgets it (also when a piece throws).
  void flush(Context& ctx) {
    std::vector<std::function<void(Context&)>> work;
    work.swap(deferred_);
    for (auto& w : work) w(ctx);
  }
  bool is_open() const { return open_; }
  // Whether casts made now are kept for the rest of the step (open, and opened to keep them).
  bool keeps_new() const { return open_ && keep_new_; }
  // A cast of the weight `key` made for the next open() (see above).
  template <typename T>
  void prime(const void* key, T value) {
    primed_[key] = std::move(value);
  }
  bool has_primed() const { return !primed_.empty(); }
  void drop_primed() { primed_.clear(); }
  int64_t size() const { return static_cast<int64_t>(entries_.size()); }
  // How many casts were served from the cache since construction (for tests and logs).
  int64_t hits() const { return hits_; }

  // The cast of the weight `key` (its Parameter's address): the cached one while the cache
  // is open and holds it, else make()'s result, kept when the cache is open.
  template <typename T, typename Make>
  T get_or_make(const void* key, Make&& make) {
    if (!open_) return make();
    if (auto it = entries_.find(key); it != entries_.end()) {
      if (T* cached = std::any_cast<T>(&it->second)) {
        ++hits_;
        if (!serve_once_) return *cached;
        T served = std::move(*cached);
        entries_.erase(it);
        return served;
      }
    }
    T made = make();
    if (keep_new_) entries_[key] = made;
    return made;
  }

 private:
  bool open_ = false, keep_new_ = true, serve_once_ = false;
  int64_t hits_ = 0;
  std::unordered_map<const void*, std::any> entries_, primed_;
  std::vector<std::function<void(Context&)>> deferred_;
};

}  // namespace tessera::fp8
