// Sharded safetensors checkpoints in the Hugging Face layout: model-0000k-of-0000n.safetensors
// shards plus model.safetensors.index.json ({"metadata": {"total_size": ...}, "weight_map":
// {tensor: shard}}), or a single model.safetensors. Each file is written atomically and the
// index last, so a reader that goes by the index never sees a shard set it does not describe.
#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "tessera/io/atomic_file.h"
#include "tessera/io/safetensors.h"

namespace tessera::io {

namespace fs = std::filesystem;

namespace {

std::string join(const std::string& dir, const std::string& name) { return (fs::path(dir) / name).string(); }

bool is_shard_name(const std::string& name) {
  static const std::regex pattern(R"(model-\d{5}-of-\d{5}\.safetensors)");
  return std::regex_match(name, pattern);
}

// Removes what an older checkpoint left in `dir` and the new one does not use, so that a
// reader cannot pick up a stale model.safetensors (which it prefers over an index).
void remove_stale_files(const std::string& dir, const std::set<std::string>& keep) {
  std::vector<fs::path> stale;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (keep.count(name)) continue;
    if (name == kSingleFileName || name == kIndexFileName || is_shard_name(name)) stale.push_back(entry.path());
  }
  for (const fs::path& p : stale) {
    std::error_code ec;
    fs::remove(p, ec);
    TESSERA_CHECK(!ec, "save_sharded: cannot remove stale checkpoint file ", p.string(), ": ", ec.message());
  }
}

}  // namespace

std::vector<std::string> ShardIndex::shard_files() const {
  std::set<std::string> files;
  for (const auto& [name, file] : weight_map) files.insert(file);
  return {files.begin(), files.end()};
}

std::string shard_file_name(int shard, int num_shards) {
  TESSERA_CHECK(num_shards >= 1 && num_shards <= 99999 && shard >= 0 && shard < num_shards,
                "shard_file_name: shard ", shard, " of ", num_shards, " is out of range");
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "model-%05d-of-%05d.safetensors", shard + 1, num_shards);
  return buffer;
}

ShardIndex load_index(const std::string& dir) {
  const std::string path = join(dir, kIndexFileName);
  TESSERA_CHECK(is_regular_file(path), "load_index: ", dir, " has no ", kIndexFileName);
  const std::string text = read_file(path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL("load_index: ", path, " is not valid JSON: ", e.what());
  }
  TESSERA_CHECK(j.is_object(), "load_index: ", path, " must hold a JSON object, got a ", j.type_name());
  TESSERA_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), "load_index: ", path,
                " has no object \"weight_map\"");
  ShardIndex index;
  if (j.contains("metadata")) {
    TESSERA_CHECK(j["metadata"].is_object(), "load_index: ", path, ": \"metadata\" must be an object, got ",
                  j["metadata"].dump());
    for (const auto& [key, value] : j["metadata"].items()) {
      index.metadata[key] = value.is_string() ? value.get<std::string>() : value.dump();
    }
  }
  for (const auto& [name, file] : j["weight_map"].items()) {
    TESSERA_CHECK(file.is_string(), "load_index: ", path, ": weight_map entry '", name,
                  "' must name a shard file, got ", file.dump());
    const std::string shard = file.get<std::string>();
    const fs::path p(shard);
    bool escapes = shard.empty() || p.is_absolute();
    for (const fs::path& part : p) escapes = escapes || part == "..";
    TESSERA_CHECK(!escapes, "load_index: ", path, ": weight_map entry '", name, "' names shard '", shard,
                  "', which is not a file inside ", dir);
    index.weight_map[name] = shard;
  }
  return index;
}

void save_sharded(const std::string& dir, const NamedTensors& tensors, uint64_t max_shard_bytes,
                  const std::map<std::string, std::string>& metadata) {
  TESSERA_CHECK(fs::is_directory(dir), "save_sharded: ", dir, " is not an existing directory");
  TESSERA_CHECK(max_shard_bytes > 0, "save_sharded: max_shard_bytes must be positive");
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    TESSERA_CHECK(seen.insert(name).second, "save_sharded: tensor name '", name, "' appears twice");
    TESSERA_CHECK(t.defined(), "save_sharded: tensor '", name, "' is an undefined tensor");
  }

  // Greedy in the given order, like transformers: a shard closes when the next tensor would
  // push it past the limit, and a tensor above the limit sits alone.
  std::vector<NamedTensors> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (const auto& named : tensors) {
    const uint64_t bytes = named.second.nbytes();
    if (!shards.back().empty() && shard_bytes + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(named);
    shard_bytes += bytes;
    total_bytes += bytes;
  }

  if (shards.size() == 1) {
    save_safetensors(join(dir, kSingleFileName), shards[0], metadata);
    remove_stale_files(dir, {kSingleFileName});
    return;
  }
  const int n = static_cast<int>(shards.size());
  nlohmann::json weight_map = nlohmann::json::object();
  std::set<std::string> written;
  for (int k = 0; k < n; ++k) {
    const std::string file = shard_file_name(k, n);
    save_safetensors(join(dir, file), shards[k], metadata);
    for (const auto& [name, t] : shards[k]) weight_map[name] = file;
    written.insert(file);
  }
  nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  write_file_atomically(join(dir, kIndexFileName), index.dump(2) + "\n");
  written.insert(kIndexFileName);
  remove_stale_files(dir, written);
}

// ---- CheckpointReader -------------------------------------------------------------------------

CheckpointReader::CheckpointReader(const std::string& path) : path_(path) {
  std::string single;
  if (is_regular_file(path)) {
    single = path;
  } else {
    TESSERA_CHECK(fs::is_directory(path), "CheckpointReader: ", path, " is neither a file nor a directory");
    if (is_regular_file(join(path, kSingleFileName))) {
      single = join(path, kSingleFileName);
    } else {
      TESSERA_CHECK(is_regular_file(join(path, kIndexFileName)), "CheckpointReader: ", path, " holds neither ",
                    kSingleFileName, " nor ", kIndexFileName);
    }
  }
  if (!single.empty()) {
    files_.emplace_back(single);
    for (const std::string& name : files_[0].names()) file_of_name_[name] = 0;
    metadata_ = files_[0].metadata();
    return;
  }

  sharded_ = true;
  const ShardIndex index = load_index(path);
  std::map<std::string, size_t> file_number;
  for (const std::string& shard : index.shard_files()) {
    const std::string shard_path = join(path, shard);
    TESSERA_CHECK(is_regular_file(shard_path), "CheckpointReader: ", join(path, kIndexFileName), " lists shard ",
                  shard, ", which does not exist");
    file_number[shard] = files_.size();
    files_.emplace_back(shard_path);
  }
  for (const auto& [name, shard] : index.weight_map) {
    const size_t k = file_number.at(shard);
    TESSERA_CHECK(files_[k].contains(name), "CheckpointReader: ", join(path, kIndexFileName), " maps tensor '",
                  name, "' to ", shard, ", which has no such tensor");
    file_of_name_[name] = k;
  }
  metadata_ = index.metadata;
}

std::vector<std::string> CheckpointReader::names() const {
  std::vector<std::string> out;
  for (const auto& [name, k] : file_of_name_) out.push_back(name);
  return out;
}

bool CheckpointReader::contains(const std::string& name) const { return file_of_name_.count(name) != 0; }

const SafetensorsFile& CheckpointReader::file_of(const std::string& name) const {
  auto it = file_of_name_.find(name);
  TESSERA_CHECK(it != file_of_name_.end(), "CheckpointReader: checkpoint ", path_, " has no tensor '", name, "' (it holds ",
                file_of_name_.size(), " tensors in ", files_.size(), " files)");
  return files_[it->second];
}

const TensorInfo& CheckpointReader::info(const std::string& name) const { return file_of(name).info(name); }

Tensor CheckpointReader::get(const std::string& name, Device device) const { return file_of(name).get(name, device); }

void CheckpointReader::read_into(const std::string& name, Tensor& dst) const { file_of(name).read_into(name, dst); }

}  // namespace tessera::io
