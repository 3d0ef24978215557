#include "tessera/train/checkpoint.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "tessera/core/stream.h"
#include "tessera/dist/distributed_optimizer.h"
#include "tessera/io/atomic_file.h"
#include "tessera/ops/elementwise.h"
#if TESSERA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fs = std::filesystem;

namespace tessera::train {

namespace {

constexpr const char* kManifest = "manifest.json";
constexpr const char* kManifestFormat = "tessera-checkpoint";
constexpr int kManifestVersion = 1;

std::string step_name(int64_t step) { return checkpoint_dir_name(step); }

// The step of a directory named step-NNNNNN (digits only), or -1.
int64_t step_of(const std::string& name) {
  if (name.size() < 6 || name.compare(0, 5, "step-") != 0) return -1;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || step > (INT64_MAX - 9) / 10) return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

std::string hex32(uint32_t v) {
  char out[16];
  std::snprintf(out, sizeof(out), "%08x", v);
  return out;
}

// A host copy that owns its memory: to() returns the tensor itself when it already is on the CPU.
Tensor host_copy(const Tensor& t) { return t.device().is_cpu() ? t.clone() : t.to(Device::cpu()); }

#if TESSERA_WITH_CUDA
// Page-locked host buffers for snapshots of GPU state: device-to-host copies into pinned
// memory run at full PCIe/NVLink-C2C speed, pageable ones at a fraction of it. Pinning is
// slow (it touches every page), so buffers are recycled: a snapshot's buffer returns to the
// pool when the last reference to the snapshot goes, and the next snapshot of the same
// model (same size) takes it again.
class PinnedPool {
 public:
  static std::shared_ptr<void> get(size_t bytes) {
    static PinnedPool* pool = new PinnedPool;  // never destroyed: buffers may outlive statics
    void* p = nullptr;
    {
      std::lock_guard lock(pool->mutex_);
      auto it = pool->free_.find(bytes);
      if (it != pool->free_.end()) {
        p = it->second;
        pool->free_.erase(it);
      }
    }
    if (!p && cudaMallocHost(&p, bytes) != cudaSuccess) {
      (void)cudaGetLastError();  // clear it: the caller falls back to pageable memory
      return nullptr;
    }
    return std::shared_ptr<void>(p, [bytes](void* q) {
      std::lock_guard lock(pool->mutex_);
      pool->free_.emplace(bytes, q);
    });
  }

 private:
  std::mutex mutex_;
  std::multimap<size_t, void*> free_;
};

// The bytes of the one pinned buffer copy_to_host takes for `tensors`' GPU tensors.
constexpr size_t kPinnedAlign = 256;
size_t pinned_bytes(const std::vector<std::pair<std::string, const Tensor*>>& tensors) {
  size_t total = 0;
  for (const auto& [name, t] : tensors)
    if (t->device().is_cuda()) total += (t->nbytes() + kPinnedAlign - 1) / kPinnedAlign * kPinnedAlign;
  return total;
}

// Copies the GPU tensors of `tensors` into one pinned buffer (kept alive by `keep`); CPU
// tensors and everything when pinning fails are copied as host_copy() does.
void copy_to_host(const std::vector<std::pair<std::string, const Tensor*>>& tensors, io::NamedTensors& out,
                  std::vector<std::shared_ptr<void>>& keep) {
  const size_t total = pinned_bytes(tensors);
  std::shared_ptr<void> buffer = total > 0 ? PinnedPool::get(total) : nullptr;
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (!buffer || !t->device().is_cuda()) {
      out.emplace_back(name, host_copy(*t));
      continue;
    }
    Tensor host = Tensor::wrap(static_cast<char*>(buffer.get()) + offset, t->shape(), t->dtype(), Device::cpu());
    host.copy_from(*t);
    out.emplace_back(name, host);
    offset += (t->nbytes() + kPinnedAlign - 1) / kPinnedAlign * kPinnedAlign;
  }
  if (buffer) keep.push_back(std::move(buffer));
}
#else
void copy_to_host(const std::vector<std::pair<std::string, const Tensor*>>& tensors, io::NamedTensors& out,
                  std::vector<std::shared_ptr<void>>&) {
  for (const auto& [name, t] : tensors) out.emplace_back(name, host_copy(*t));
}
#endif

}  // namespace

std::string checkpoint_dir_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step-%06lld", static_cast<long long>(step));
  return name;
}

namespace {

uint32_t crc32_serial(const Bytef* p, size_t size, uLong c) {
  while (size > 0) {  // zlib takes uInt lengths
    const uInt n = static_cast<uInt>(std::min<size_t>(size, 1u << 30));
    c = ::crc32(c, p, n);
    p += n;
    size -= n;
  }
  return static_cast<uint32_t>(c);
}

}  // namespace

uint32_t crc32_bytes(const void* data, size_t size, uint32_t crc) {
  // zlib's CRC runs at 1-2 GB/s on one core, which made it the largest part of writing a
  // 14 GB checkpoint. Large buffers are split into chunks summed on several threads and
  // joined with crc32_combine: the same value as one pass.
  const auto* p = static_cast<const Bytef*>(data);
  constexpr size_t kMinChunk = size_t(32) << 20;
  const size_t threads = std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()), size / kMinChunk);
  if (threads < 2) return crc32_serial(p, size, crc);
  const size_t chunk = (size + threads - 1) / threads;
  std::vector<uint32_t> parts(threads);
  std::vector<std::thread> workers;
  for (size_t t = 1; t < threads; ++t)
    workers.emplace_back([&, t] {
      const size_t begin = t * chunk;
      parts[t] = crc32_serial(p + begin, std::min(chunk, size - begin), 0);
    });
  uLong c = crc32_serial(p, chunk, crc);
  for (auto& w : workers) w.join();
  for (size_t t = 1; t < threads; ++t) {
    const size_t begin = t * chunk;
    c = ::crc32_combine(c, parts[t], static_cast<z_off_t>(std::min(chunk, size - begin)));
  }
  return static_cast<uint32_t>(c);
}

uint32_t crc32_file(const std::string& path, uint64_t* size) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  TESSERA_CHECK(f != nullptr, "checkpoint: cannot open ", path, ": ", std::strerror(errno));
  std::vector<char> buffer(4 << 20);
  uint32_t crc = 0;
  uint64_t total = 0;
  size_t n = 0;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), f.get())) > 0) {
    crc = crc32_bytes(buffer.data(), n, crc);
    total += n;
  }
  TESSERA_CHECK(!std::ferror(f.get()), "checkpoint: reading ", path, " failed: ", std::strerror(errno));
  if (size) *size = total;
  return crc;
}

size_t CheckpointSnapshot::bytes() const {
  size_t total = 0;
  for (const auto& [name, t] : params) total += t.nbytes();
  for (const auto& [name, t] : optimizer) total += t.nbytes();
  return total;
}

// What snapshot_training_state copies, as (name, tensor) lists: the full-precision weights
// (FP32 masters of a BF16 model), then the optimizer state.
namespace {
using TensorList = std::vector<std::pair<std::string, const Tensor*>>;
TensorList snapshot_params(models::TransformerLM& model) {
  TensorList params;
  for (nn::Parameter* p : model.parameters()) params.emplace_back(p->name, &p->weights());
  return params;
}
}  // namespace

std::vector<size_t> snapshot_buffer_bytes(models::TransformerLM& model, const OptimizerBase* optimizer) {
  std::vector<size_t> out;
#if TESSERA_WITH_CUDA
  if (const size_t bytes = pinned_bytes(snapshot_params(model)); bytes > 0) out.push_back(bytes);
  if (optimizer) {
    const auto state = optimizer->state();
    TensorList moments;
    for (const auto& [name, t] : state) moments.emplace_back(name, &t);
    if (const size_t bytes = pinned_bytes(moments); bytes > 0) out.push_back(bytes);
  }
#else
  (void)model;
  (void)optimizer;
#endif
  return out;
}

void reserve_pinned_host(const std::vector<size_t>& buffer_bytes, int copies) {
#if TESSERA_WITH_CUDA
  std::vector<std::shared_ptr<void>> held;  // all at once, so that `copies` distinct buffers exist
  for (int i = 0; i < copies; ++i)
    for (size_t bytes : buffer_bytes) held.push_back(PinnedPool::get(bytes));
#else
  (void)buffer_bytes;
  (void)copies;
#endif
}

CheckpointSnapshot snapshot_training_state(models::TransformerLM& model, const OptimizerBase* optimizer,
                                           const CheckpointState& state, const CheckpointWriters& writers,
                                           SnapshotLayout layout) {
  CheckpointSnapshot s;
  s.writers = writers;
  s.step = state.step;
  s.data_position = state.data_position;
  s.config = state.config;
  s.extra = state.extra;
  s.model_config = model.config().to_json();
  if (model.tensor_parallel() && layout == SnapshotLayout::Full) {
    // Gathered into the single-device layout on every tensor rank (collective); the
    // optimizer's moments per parameter whatever its own layout (ZeRO-1 gathers its shards
    // over the data group first).
    Context ctx = context_on(model.parameters().front()->weights().device());
    s.full_layout = true;
    s.params = model.full_state_dict(ctx);
    if (optimizer) {
      s.has_optimizer = true;
      s.optimizer_step = optimizer->steps_taken();
      s.optimizer = model.gather_full(ctx, optimizer->per_parameter_state(ctx));
    }
    return s;
  }
  s.tensor_shards = model.tensor_parallel();
  copy_to_host(snapshot_params(model), s.params, s.host_buffers);
  if (optimizer) {
    s.has_optimizer = true;
    s.optimizer_step = optimizer->steps_taken();
    s.optimizer_layout = optimizer->state_layout();
    const auto state = optimizer->state();  // handles sharing the optimizer's tensors
    std::vector<std::pair<std::string, const Tensor*>> moments;
    for (const auto& [name, t] : state) moments.emplace_back(name, &t);
    copy_to_host(moments, s.optimizer, s.host_buffers);
  }
  return s;
}

void restore_snapshot(const CheckpointSnapshot& s, models::TransformerLM& model, OptimizerBase* optimizer) {
  if (s.full_layout) {
    Context ctx = context_on(model.parameters().front()->weights().device());
    model.load_full_state(ctx, s.params);
    if (optimizer) {
      TESSERA_CHECK(s.has_optimizer, "restore_snapshot: the snapshot has no optimizer state");
      optimizer->load_per_parameter_state(model.shard_full(s.optimizer), s.optimizer_step);
    }
    return;
  }
  const auto params = model.parameters();
  TESSERA_CHECK(params.size() == s.params.size(), "restore_snapshot: the snapshot has ", s.params.size(),
                " parameters, the model ", params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    nn::Parameter* p = params[i];
    TESSERA_CHECK(p->name == s.params[i].first, "restore_snapshot: parameter ", i, " is '", p->name,
                  "' in the model, '", s.params[i].first, "' in the snapshot");
    p->weights().copy_from(s.params[i].second);
    Context ctx = context_on(p->weights().device());  // the thread's current stream there
    p->refresh_value(ctx);
  }
  if (optimizer) {
    TESSERA_CHECK(s.has_optimizer, "restore_snapshot: the snapshot has no optimizer state");
    TESSERA_CHECK(s.optimizer_layout == optimizer->state_layout(), "restore_snapshot: the snapshot's optimizer state ",
                  "is laid out for another optimizer (", s.optimizer_layout.dump(), " vs ",
                  optimizer->state_layout().dump(), ")");
    optimizer->load_state(s.optimizer, s.optimizer_step);
  }
}

std::vector<std::string> list_checkpoints(const std::string& out_dir) {
  const fs::path root = fs::path(out_dir) / "checkpoints";
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return {};
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const int64_t step = step_of(entry.path().filename().string());
    if (step >= 0 && entry.is_directory(ec)) found.emplace_back(step, entry.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [step, dir] : found) out.push_back(std::move(dir));
  return out;
}

namespace {

// Deletes checkpoints the retention policy does not keep, and leftovers of interrupted
// saves (.tmp / .old directories). Never the one just written.
void apply_retention(const fs::path& root, int64_t written_step, const Retention& r) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    const bool leftover = name.rfind("step-", 0) == 0 &&
                          (name.size() > 4 && (name.ends_with(".tmp") || name.ends_with(".old")));
    if (leftover) fs::remove_all(entry.path(), ec);
  }
  if (r.keep_last <= 0 && r.keep_every <= 0) return;
  const std::vector<std::string> all = list_checkpoints(root.parent_path().string());
  const int64_t n = static_cast<int64_t>(all.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t step = step_of(fs::path(all[i]).filename().string());
    const bool recent = r.keep_last > 0 && i >= n - r.keep_last;
    const bool milestone = r.keep_every > 0 && step % r.keep_every == 0;
    if (step == written_step || recent || milestone) continue;
    if (r.keep_last <= 0 && !milestone && r.keep_every > 0) {
      // keep_every alone: keep the milestones and the newest.
      if (i == n - 1) continue;
    }
    fs::remove_all(all[i], ec);
  }
}

}  // namespace

namespace {

// The file a data-parallel rank's ZeRO-1 shard goes to.
std::string zero1_file_name(int64_t rank, int64_t size) {
  char name[80];
  std::snprintf(name, sizeof(name), "optimizer-zero1-%05lld-of-%05lld.safetensors", static_cast<long long>(rank),
                static_cast<long long>(size));
  return name;
}

std::string part_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "part-%05d.json", rank);
  return name;
}

// What state.json records of a shard layout: the layout of all shards, not this rank's range.
nlohmann::json all_shards(const nlohmann::json& layout) {
  if (layout.is_null()) return nullptr;
  nlohmann::json out = layout;
  for (const char* key : {"rank", "begin", "end"}) out.erase(key);
  return out;
}

// Rank 0 of a multi-rank save: the other ranks' file lists, once every part-RRRRR.json is
// there (the ranks write them last, atomically). Removes the part files.
nlohmann::json collect_parts(const fs::path& dir, int ranks, double timeout_s, int64_t step) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<bool> seen(static_cast<size_t>(ranks), false);
  seen[0] = true;
  nlohmann::json files = nlohmann::json::object();
  auto sleep_ms = 5;
  for (;;) {
    std::string missing;
    for (int r = 1; r < ranks; ++r) {
      if (seen[static_cast<size_t>(r)]) continue;
      const fs::path part = dir / part_file_name(r);
      std::error_code ec;
      if (!fs::exists(part, ec)) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        continue;
      }
      const nlohmann::json j = nlohmann::json::parse(io::read_file(part.string()), nullptr, false);
      TESSERA_CHECK(j.is_object() && j.contains("files") && j["files"].is_object(), "checkpoint: ", part.string(),
                    " is not a rank's file list");
      for (const auto& [name, entry] : j["files"].items()) {
        TESSERA_CHECK(!files.contains(name), "checkpoint: two ranks wrote ", name, " into ", dir.string());
        files[name] = entry;
      }
      seen[static_cast<size_t>(r)] = true;
    }
    if (missing.empty()) break;
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    TESSERA_CHECK(timeout_s <= 0 || waited < timeout_s, "checkpoint: step ", step, ": rank(s) ", missing,
                  " did not finish writing their part of ", dir.string(), " within ", timeout_s,
                  " s (training.parallel.timeout_s); the checkpoint is incomplete and was not published");
    std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
    sleep_ms = std::min(sleep_ms * 2, 200);
  }
  std::error_code ec;
  for (int r = 1; r < ranks; ++r) fs::remove(dir / part_file_name(r), ec);
  return files;
}

}  // namespace

void begin_checkpoint(const std::string& out_dir, int64_t step) {
  const fs::path tmp_dir = fs::path(out_dir) / "checkpoints" / (step_name(step) + ".tmp");
  std::error_code ec;
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir);
}

std::string write_checkpoint(const std::string& out_dir, const CheckpointSnapshot& s, const Retention& retention) {
  const fs::path root = fs::path(out_dir) / "checkpoints";
  const fs::path final_dir = root / step_name(s.step);
  const fs::path tmp_dir = root / (step_name(s.step) + ".tmp");
  const bool several = s.writers.ranks > 1, lead = s.writers.rank == 0;
  TESSERA_CHECK(!s.tensor_shards, "checkpoint: a snapshot of tensor-parallel shards (SnapshotLayout::Local) cannot be ",
                "written; checkpoints hold the full layout");
  std::error_code ec;
  if (several) {
    TESSERA_CHECK(fs::is_directory(tmp_dir, ec), "checkpoint: ", tmp_dir.string(), " does not exist (rank 0 prepares it ",
                  "with begin_checkpoint before the ranks write)");
  } else {
    fs::remove_all(tmp_dir, ec);
    fs::create_directories(tmp_dir);
  }

  nlohmann::json files = nlohmann::json::object();
  auto put = [&](const std::string& name, const std::string& bytes) {
    io::write_file_atomically((tmp_dir / name).string(), bytes);
    files[name] = {{"bytes", bytes.size()}, {"crc32", hex32(crc32_bytes(bytes.data(), bytes.size()))}};
  };
  // Tensor files are streamed to disk tensor by tensor, checksummed on the way: a copy of the
  // whole file in memory (14 GB for a 1B model's optimizer state) cost a host copy, its page
  // faults and that much RAM on top of the snapshot.
  auto put_tensors = [&](const std::string& name, const io::NamedTensors& tensors,
                         const std::map<std::string, std::string>& metadata) {
    const std::string path = (tmp_dir / name).string();
    uint32_t crc = 0;
    uint64_t bytes = 0;
    io::write_file_atomically(path, [&](std::FILE* f) {
      io::write_safetensors(tensors, metadata, path, [&](const void* data, size_t n) {
        io::write_bytes(f, data, n, path);
        crc = crc32_bytes(data, n, crc);
        bytes += n;
      });
    });
    files[name] = {{"bytes", bytes}, {"crc32", hex32(crc)}};
  };
  if (lead)
    put_tensors("model.safetensors", s.params, {{"format", "tessera"}, {"model_config", s.model_config.dump()}});
  if (s.has_optimizer && s.optimizer_layout.is_null()) {
    if (lead) put_tensors("optimizer.safetensors", s.optimizer, {});  // the same on every rank
  } else if (s.has_optimizer) {
    const nlohmann::json& l = s.optimizer_layout;
    put_tensors(zero1_file_name(l.at("rank").get<int64_t>(), l.at("size").get<int64_t>()), s.optimizer,
                {{"format", "tessera-optimizer-shard"}, {"layout", l.dump()}});
  }
  if (several && !lead) {
    // Last: rank 0 takes a part file as the sign that this rank's files are complete.
    io::write_file_atomically((tmp_dir / part_file_name(s.writers.rank)).string(),
                              nlohmann::json{{"rank", s.writers.rank}, {"files", files}}.dump());
    return final_dir.string();
  }
  nlohmann::json state = {{"step", s.step},
                          {"optimizer_step", s.optimizer_step},
                          {"data_position", s.data_position},
                          {"config", s.config},
                          {"model_config", s.model_config}};
  if (!s.extra.is_null()) state["trainer"] = s.extra;
  if (!s.optimizer_layout.is_null()) state["optimizer_layout"] = all_shards(s.optimizer_layout);
  put("state.json", state.dump(2));
  if (several) {
    const nlohmann::json others = collect_parts(tmp_dir, s.writers.ranks, s.writers.timeout_s, s.step);
    for (const auto& [name, entry] : others.items()) {
      TESSERA_CHECK(!files.contains(name), "checkpoint: two ranks wrote ", name, " into ", tmp_dir.string());
      files[name] = entry;
    }
  }
  const std::string config_text = s.config.dump();
  nlohmann::json manifest = {{"format", kManifestFormat},
                             {"version", kManifestVersion},
                             {"step", s.step},
                             {"config_hash", "crc32:" + hex32(crc32_bytes(config_text.data(), config_text.size()))},
                             {"files", files}};
  if (several) manifest["ranks"] = s.writers.ranks;
  // Last: a directory with a manifest is complete.
  io::write_file_atomically((tmp_dir / kManifest).string(), manifest.dump(2));

  // Replacing an older save of the same step (a rerun after a rewind) keeps an older
  // checkpoint loadable throughout.
  if (fs::exists(final_dir)) {
    const fs::path old = root / (step_name(s.step) + ".old");
    fs::remove_all(old, ec);
    fs::rename(final_dir, old);
    fs::rename(tmp_dir, final_dir);
    fs::remove_all(old, ec);
  } else {
    fs::rename(tmp_dir, final_dir);
  }
  // Also fsyncs `root`, which makes the directory rename durable.
  io::write_file_atomically((root / "latest").string(), step_name(s.step) + "\n");
  apply_retention(root, s.step, retention);
  return final_dir.string();
}

std::string save_checkpoint(const std::string& out_dir, models::TransformerLM& model, const OptimizerBase* optimizer,
                            const CheckpointState& state, const Retention& retention) {
  return write_checkpoint(out_dir, snapshot_training_state(model, optimizer, state), retention);
}

std::optional<std::string> checkpoint_problem(const std::string& dir) {
  const fs::path manifest_path = fs::path(dir) / kManifest;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return "checkpoint: '" + dir + "' is not a directory";
  if (!fs::exists(manifest_path, ec))
    return "checkpoint: " + manifest_path.string() +
           " is missing (an interrupted save, or a checkpoint written before tessera kept manifests)";
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(io::read_file(manifest_path.string()));
  } catch (const std::exception& e) {
    return "checkpoint: " + manifest_path.string() + " cannot be read or is not valid JSON: " + e.what();
  }
  if (!m.is_object() || m.value("format", "") != kManifestFormat || !m.contains("files") || !m["files"].is_object())
    return "checkpoint: " + manifest_path.string() + " is not a tessera checkpoint manifest";
  for (const char* required : {"model.safetensors", "state.json"})
    if (!m["files"].contains(required))
      return "checkpoint: " + manifest_path.string() + " does not list " + required;
  for (auto it = m["files"].begin(); it != m["files"].end(); ++it) {
    const std::string& name = it.key();
    const fs::path file = fs::path(dir) / name;
    if (name.empty() || name.find('/') != std::string::npos || name == "..")
      return "checkpoint: " + manifest_path.string() + " lists a bad file name '" + name + "'";
    const nlohmann::json& entry = it.value();
    if (!entry.is_object() || !entry.contains("bytes") || !entry["bytes"].is_number_unsigned() ||
        !entry.contains("crc32") || !entry["crc32"].is_string())
      return "checkpoint: " + manifest_path.string() + ": malformed entry for " + name;
    if (!io::is_regular_file(file.string())) return "checkpoint: " + file.string() + " is missing";
    uint64_t size = 0;
    uint32_t crc = 0;
    try {
      crc = crc32_file(file.string(), &size);
    } catch (const std::exception& e) {
      return e.what();
    }
    const uint64_t expected = entry["bytes"].get<uint64_t>();
    if (size != expected)
      return "checkpoint: " + file.string() + " has " + std::to_string(size) + " bytes, the manifest says " +
             std::to_string(expected) + (size < expected ? " (truncated)" : "");
    if (hex32(crc) != entry["crc32"].get<std::string>())
      return "checkpoint: " + file.string() + " is corrupt: CRC-32 " + hex32(crc) + ", the manifest says " +
             entry["crc32"].get<std::string>();
  }
  return std::nullopt;
}

void verify_checkpoint(const std::string& dir) {
  if (auto problem = checkpoint_problem(dir)) TESSERA_FAIL(*problem);
}

std::optional<std::string> latest_checkpoint(const std::string& out_dir, bool warn, std::vector<std::string>* skipped) {
  const std::vector<std::string> all = list_checkpoints(out_dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    const auto problem = checkpoint_problem(*it);
    if (!problem) return *it;
    if (warn) std::fprintf(stderr, "tessera: warning: skipping checkpoint %s: %s\n", it->c_str(), problem->c_str());
    if (skipped) skipped->push_back(*problem);
  }
  return std::nullopt;
}

static nlohmann::json read_state(const std::string& dir) {
  const std::string path = (fs::path(dir) / "state.json").string();
  try {
    return nlohmann::json::parse(io::read_file(path));
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL("checkpoint: '", path, "' is not valid JSON: ", e.what());
  }
}

models::ModelConfig checkpoint_model_config(const std::string& dir) {
  const nlohmann::json state = read_state(dir);
  TESSERA_CHECK(state.contains("model_config"), "checkpoint: ", dir, "/state.json has no model_config");
  return models::ModelConfig::from_json(state.at("model_config"));
}

namespace {

// The moments of the flat range [begin, end) of `params` laid end to end (list order), from
// whatever layout the checkpoint holds them in: per parameter (optimizer.safetensors) or
// ZeRO-1 shards of any data-parallel size. Into exp_avg / exp_avg_sq ([end - begin]).
using ParameterSizes = std::vector<std::pair<std::string, int64_t>>;  // name, elements

ParameterSizes sizes_of(const nn::ParameterList& params) {
  ParameterSizes out;
  for (const nn::Parameter* p : params) out.emplace_back(p->name, p->numel());
  return out;
}

// A run of the flat parameter-order index space (every parameter end to end in list order):
// [begin, begin + length).
struct FlatRun {
  int64_t begin, length;
};

// The runs of the flat space a ZeRO-1 layout gives rank `rank`, in the order its state()
// tensors hold them: "zero1" (one contiguous range of the flat space, padded to a multiple
// of the size) or "zero1-buckets" (the rank's chunk of every bucket, dist::zero1_pieces).
std::vector<FlatRun> zero1_runs(const nlohmann::json& layout, const ParameterSizes& params, int64_t rank) {
  int64_t total = 0;
  std::vector<int64_t> offsets, numels;
  for (const auto& p : params) {
    offsets.push_back(total);
    numels.push_back(p.second);
    total += p.second;
  }
  const std::string kind = layout.value("kind", "");
  const int64_t size = layout.at("size").get<int64_t>();
  if (kind == "zero1") {
    const int64_t shard = (total + size - 1) / size;
    const int64_t first = rank * shard, last = std::min(total, (rank + 1) * shard);
    if (first >= last) return {};
    return {{first, last - first}};
  }
  TESSERA_CHECK(kind == "zero1-buckets", "checkpoint: optimizer state of an unknown layout ", layout.dump());
  const auto buckets = layout.at("buckets").get<std::vector<std::vector<size_t>>>();
  std::vector<FlatRun> out;
  for (const dist::Zero1Piece& p : dist::zero1_pieces(numels, buckets, static_cast<int>(size), static_cast<int>(rank)))
    out.push_back({offsets[p.parameter] + p.param_offset, p.length});
  return out;
}

// Reads the moments of the flat runs `want` (concatenated in that order into exp_avg and
// exp_avg_sq) from a checkpoint of any optimizer layout: per parameter (null), or ZeRO-1
// shards of any data-parallel size and bucketing.
void read_moments(const std::string& dir, const nlohmann::json& saved_layout, const ParameterSizes& params,
                  const std::vector<FlatRun>& want, Tensor& exp_avg, Tensor& exp_avg_sq) {
  Context cpu = Context::cpu();
  // Copies src (1-D, any float dtype) [src_begin, src_begin + n) into dst [dst_begin, ...).
  auto copy_part = [&](const Tensor& src, int64_t src_begin, Tensor& dst, int64_t dst_begin, int64_t n) {
    Tensor part = src.contiguous().reshape({src.numel()}).slice(0, src_begin, src_begin + n).contiguous();
    Tensor slot = dst.slice(0, dst_begin, dst_begin + n);
    if (part.dtype() == slot.dtype()) {
      slot.copy_from(part);
    } else {
      Tensor converted = Tensor::empty({n}, slot.dtype());
      cast(cpu, part, converted);
      slot.copy_from(converted);
    }
  };
  // Calls f(src_offset, dst_offset, n) for each overlap of the source runs (held end to end
  // in one source tensor) with the wanted runs.
  auto overlaps = [&](const std::vector<FlatRun>& source, auto&& f) {
    int64_t src_at = 0;
    for (const FlatRun& s : source) {
      int64_t dst_at = 0;
      for (const FlatRun& w : want) {
        const int64_t lo = std::max(s.begin, w.begin), hi = std::min(s.begin + s.length, w.begin + w.length);
        if (lo < hi) f(src_at + (lo - s.begin), dst_at + (lo - w.begin), hi - lo);
        dst_at += w.length;
      }
      src_at += s.length;
    }
  };
  auto touches = [&](const std::vector<FlatRun>& source) {
    bool any = false;
    overlaps(source, [&](int64_t, int64_t, int64_t) { any = true; });
    return any;
  };
  int64_t total = 0;
  for (const auto& p : params) total += p.second;
  if (saved_layout.is_null()) {
    const std::string path = (fs::path(dir) / "optimizer.safetensors").string();
    TESSERA_CHECK(fs::exists(path), "checkpoint: ", dir, " has no optimizer state (optimizer.safetensors)");
    const io::SafetensorsFile file(path);
    int64_t offset = 0;
    for (const auto& [p_name, p_numel] : params) {
      const std::vector<FlatRun> source = {{offset, p_numel}};
      offset += p_numel;
      if (!touches(source)) continue;
      for (auto [suffix, target] : {std::pair<const char*, Tensor*>{".exp_avg", &exp_avg}, {".exp_avg_sq", &exp_avg_sq}}) {
        Tensor* out = target;  // a plain variable: clang before 16 cannot capture a structured binding
        const std::string name = p_name + suffix;
        TESSERA_CHECK(file.contains(name), "optimizer state: missing tensor '", name, "'");
        const Tensor t = file.get(name);
        TESSERA_CHECK(t.numel() == p_numel, "optimizer state: '", name, "' has ", t.numel(), " elements, the model's ",
                      p_name, " ", p_numel);
        overlaps(source, [&](int64_t src, int64_t dst, int64_t n) { copy_part(t, src, *out, dst, n); });
      }
    }
    return;
  }
  const std::string kind = saved_layout.value("kind", "");
  TESSERA_CHECK(kind == "zero1" || kind == "zero1-buckets", "checkpoint: ", dir,
                " has optimizer state of an unknown layout ", saved_layout.dump());
  const int64_t saved_total = saved_layout.at("total").get<int64_t>(), size = saved_layout.at("size").get<int64_t>();
  TESSERA_CHECK(saved_total == total, "checkpoint: the optimizer shards in ", dir, " cover ", saved_total,
                " elements, the model has ", total);
  nlohmann::json names = nlohmann::json::array();
  for (const auto& [p_name, p_numel] : params) names.push_back({p_name, p_numel});
  TESSERA_CHECK(saved_layout.at("parameters") == names, "checkpoint: the optimizer shards in ", dir,
                " were laid out for another parameter list (names or sizes differ from the model's)");
  TESSERA_CHECK(size >= 1, "checkpoint: bad shard count in ", dir);
  for (int64_t r = 0; r < size; ++r) {
    const std::vector<FlatRun> source = zero1_runs(saved_layout, params, r);
    if (!touches(source)) continue;
    int64_t held = 0;
    for (const FlatRun& s : source) held += s.length;
    const std::string path = (fs::path(dir) / zero1_file_name(r, size)).string();
    TESSERA_CHECK(fs::exists(path), "checkpoint: ", dir, " lacks the optimizer shard of data rank ", r, " (",
                  zero1_file_name(r, size), ")");
    const io::SafetensorsFile file(path);
    for (auto [name, target] : {std::pair<const char*, Tensor*>{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}}) {
      Tensor* out = target;  // see above
      TESSERA_CHECK(file.contains(name), "checkpoint: ", path, " has no tensor '", name, "'");
      const Tensor t = file.get(name);
      TESSERA_CHECK(t.numel() == held, "checkpoint: ", path, ": '", name, "' has ", t.numel(),
                    " elements, data rank ", r, "'s part of the layout holds ", held);
      overlaps(source, [&](int64_t src, int64_t dst, int64_t n) { copy_part(t, src, *out, dst, n); });
    }
  }
}

// Loads the checkpoint's optimizer state into `optimizer`, re-split for its layout.
void load_optimizer_state(const std::string& dir, const nlohmann::json& state, models::TransformerLM& model,
                          OptimizerBase& optimizer) {
  const int64_t step = state.value("optimizer_step", int64_t(0));
  const nlohmann::json saved = state.value("optimizer_layout", nlohmann::json());
  const nlohmann::json want = optimizer.state_layout();
  if (saved.is_null() && want.is_null()) {
    const std::string opt_path = (fs::path(dir) / "optimizer.safetensors").string();
    TESSERA_CHECK(fs::exists(opt_path), "checkpoint: ", dir, " has no optimizer state (optimizer.safetensors)");
    const io::SafetensorsFile opt(opt_path);
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const std::string& name : opt.names()) tensors.emplace_back(name, opt.get(name));
    optimizer.load_state(tensors, step);
    return;
  }
  const nn::ParameterList params = model.parameters();
  const ParameterSizes sizes = sizes_of(params);
  int64_t total = 0;
  for (const nn::Parameter* p : params) total += p->numel();
  const std::vector<FlatRun> runs =
      want.is_null() ? std::vector<FlatRun>{{0, total}} : zero1_runs(want, sizes, want.at("rank").get<int64_t>());
  int64_t held = 0;
  for (const FlatRun& r : runs) held += r.length;
  const DType dtype = params.empty() ? DType::F32 : params[0]->weights().dtype();
  Tensor exp_avg = Tensor::zeros({held}, dtype), exp_avg_sq = Tensor::zeros({held}, dtype);
  read_moments(dir, saved, sizes, runs, exp_avg, exp_avg_sq);
  if (!want.is_null()) {
    optimizer.load_state({{"exp_avg", exp_avg}, {"exp_avg_sq", exp_avg_sq}}, step);
    return;
  }
  std::vector<std::pair<std::string, Tensor>> tensors;
  int64_t offset = 0;
  for (const nn::Parameter* p : params) {
    const Shape& shape = p->weights().shape();
    tensors.emplace_back(p->name + ".exp_avg", exp_avg.slice(0, offset, offset + p->numel()).reshape(shape));
    tensors.emplace_back(p->name + ".exp_avg_sq", exp_avg_sq.slice(0, offset, offset + p->numel()).reshape(shape));
    offset += p->numel();
  }
  optimizer.load_state(tensors, step);
}

// A tensor-parallel model from a checkpoint of any layout (all hold the single-device
// layout: per-parameter tensors, or ZeRO-1 shards of the full flat state): the full
// weights and moments, each rank cutting out its shards.
void load_tensor_parallel(const std::string& dir, const nlohmann::json& state, const io::SafetensorsFile& file,
                          models::TransformerLM& model, OptimizerBase* optimizer) {
  const nn::ParameterList params = model.parameters();
  const std::vector<nn::ShardLayout> layouts = model.shard_layouts();
  Context ctx = context_on(params.front()->weights().device());
  models::TransformerLM::NamedTensors full;
  ParameterSizes sizes;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i]->name;
    TESSERA_CHECK(file.contains(name), "checkpoint: ", file.path(), " has no tensor '", name, "'");
    TESSERA_CHECK(file.info(name).shape == layouts[i].full, "checkpoint: '", name, "' has shape ",
                  shape_to_string(file.info(name).shape), ", the model's full tensor is ",
                  shape_to_string(layouts[i].full));
    full.emplace_back(name, file.get(name));
    int64_t numel = 1;
    for (int64_t d : layouts[i].full) numel *= d;
    sizes.emplace_back(name, numel);
  }
  model.load_full_state(ctx, full);
  if (!optimizer) return;
  full.clear();
  int64_t total = 0;
  for (const auto& [name, numel] : sizes) total += numel;
  const DType dtype = params.front()->weights().dtype();
  Tensor exp_avg = Tensor::zeros({total}, dtype), exp_avg_sq = Tensor::zeros({total}, dtype);
  read_moments(dir, state.value("optimizer_layout", nlohmann::json()), sizes, {{0, total}}, exp_avg, exp_avg_sq);
  models::TransformerLM::NamedTensors moments;
  int64_t offset = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = sizes[i].second;
    moments.emplace_back(params[i]->name + ".exp_avg", exp_avg.slice(0, offset, offset + n).reshape(layouts[i].full));
    moments.emplace_back(params[i]->name + ".exp_avg_sq", exp_avg_sq.slice(0, offset, offset + n).reshape(layouts[i].full));
    offset += n;
  }
  optimizer->load_per_parameter_state(model.shard_full(moments), state.value("optimizer_step", int64_t(0)));
}

}  // namespace

CheckpointState load_checkpoint(const std::string& dir, models::TransformerLM& model, OptimizerBase* optimizer,
                                bool verify) {
  if (fs::exists(fs::path(dir) / kManifest) || !fs::exists(fs::path(dir) / "state.json")) {
    if (verify) verify_checkpoint(dir);
  } else {
    // Named explicitly and written before checkpoints had manifests: the safetensors reader
    // still validates the structure, but nothing can check the bytes.
    std::fprintf(stderr, "tessera: warning: %s has no manifest.json; loading it unverified\n", dir.c_str());
  }
  const nlohmann::json state = read_state(dir);
  const models::ModelConfig saved = checkpoint_model_config(dir);
  TESSERA_CHECK(saved.to_json() == model.config().to_json(), "checkpoint: ", dir, " holds a different model (",
                saved.to_json().dump(), ") than the one configured (", model.config().to_json().dump(), ")");
  const io::SafetensorsFile file((fs::path(dir) / "model.safetensors").string());
  if (model.tensor_parallel()) {
    load_tensor_parallel(dir, state, file, model, optimizer);
  } else {
  for (nn::Parameter* p : model.parameters()) {
    TESSERA_CHECK(file.contains(p->name), "checkpoint: ", file.path(), " has no tensor '", p->name, "'");
    const io::TensorInfo& info = file.info(p->name);
    Tensor& weights = p->weights();
    TESSERA_CHECK(info.shape == weights.shape(), "checkpoint: '", p->name, "' has shape ", shape_to_string(info.shape),
                  ", the model needs ", weights.shape_string());
    Tensor loaded = file.get(p->name);
    if (loaded.dtype() != weights.dtype()) {
      Tensor converted = Tensor::empty(loaded.shape(), weights.dtype());
      Context cpu = Context::cpu();
      cast(cpu, loaded, converted);
      loaded = converted;
    }
    weights.copy_from(loaded.to(weights.device()));
    Context ctx = context_on(weights.device());  // the thread's current stream there
    p->refresh_value(ctx);
  }
  if (optimizer) load_optimizer_state(dir, state, model, *optimizer);
  }
  CheckpointState out;
  out.step = state.value("step", int64_t(0));
  out.data_position = state.value("data_position", nlohmann::json());
  out.config = state.value("config", nlohmann::json());
  out.extra = state.value("trainer", nlohmann::json());
  return out;
}

}  // namespace tessera::train
