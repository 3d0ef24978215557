// The safetensors file format (Hugging Face), single files and sharded checkpoints.
//
// Layout of a file:
//   [8 bytes]  N, unsigned little-endian: the header length
//   [N bytes]  UTF-8 JSON object: tensor name -> {"dtype": "BF16", "shape": [4, 8],
//              "data_offsets": [begin, end]}, plus an optional "__metadata__" object of
//              string -> string. Offsets are byte offsets into the data buffer.
//   [rest]     the data buffer: every tensor packed, row-major, little-endian.
//
// Reading maps the file into memory (mmap) and validates the whole header when the file is
// opened, so a file that opens is well formed; get() copies one tensor into an owned tensor,
// which therefore outlives the SafetensorsFile. Writing goes through write_file_atomically():
// a crash or a full disk never leaves a torn file behind.
//
//   io::save_safetensors("model.safetensors", {{"wte", wte}, {"lm_head", head}}, {{"format", "pt"}});
//   io::SafetensorsFile f("model.safetensors");
//   Tensor wte = f.get("wte");
//
// Sharded checkpoints follow the Hugging Face convention: model-00001-of-00003.safetensors,
// ... plus model.safetensors.index.json mapping each tensor to its shard; CheckpointReader
// reads either form. Every malformed input raises tessera::Error naming the file and the
// problem. See docs/safetensors.md.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::io {

// ---- dtypes ---------------------------------------------------------------------------

// The safetensors code of a tessera dtype: F64 F32 F16 BF16 F8_E4M3 F8_E5M2 F8_E8M0 I64 I32 U8.
const char* safetensors_dtype_code(DType dtype);

// The tessera dtype of a safetensors code; nullopt for codes of the format that tessera has
// no type for (BOOL, I8, I16, U16, U32, U64, F8_E4M3FNUZ, F8_E5M2FNUZ, F4, F6_E2M3, F6_E3M2,
// C64). Error for a code the format does not define.
std::optional<DType> dtype_from_safetensors_code(const std::string& code);

// ---- One file -------------------------------------------------------------------------

// What the header says about one tensor.
struct TensorInfo {
  std::string name;
  std::string dtype_code;      // as written in the file, e.g. "BF16"
  std::optional<DType> dtype;  // nullopt when tessera cannot hold dtype_code
  Shape shape;
  uint64_t data_begin = 0;     // [data_begin, data_end): bytes within the data buffer
  uint64_t data_end = 0;

  int64_t numel() const { return shape_numel(shape); }
  uint64_t nbytes() const { return data_end - data_begin; }
};

// A safetensors file opened for reading. Cheap to copy (copies share the mapping); the file
// stays mapped while any copy lives. Tensors returned by get() own their memory.
//
// Accepted beyond the strict format: unused gaps between tensors and bytes after the last one
// (the Hugging Face reader rejects both; tessera's writer produces neither). Rejected, each
// with an Error naming the file: a file shorter than 8 bytes; a header length beyond the file
// or above 100 MB; a header that is not a JSON object or repeats a key; an entry without a
// string "dtype", an integer array "shape" or a two-integer "data_offsets"; an unknown dtype;
// a negative dimension; offsets with end < begin or end beyond the data buffer; a byte size
// other than numel * element size; tensors whose bytes overlap; a "__metadata__" that is not
// an object of strings.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const;
  size_t size() const;                         // number of tensors
  std::vector<std::string> names() const;      // in data-buffer order (file order)
  std::vector<std::string> sorted_names() const;
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;  // Error for a missing name
  const std::vector<TensorInfo>& infos() const;           // in data-buffer order
  const std::map<std::string, std::string>& metadata() const;
  uint64_t header_bytes() const;               // N: the JSON header length, padding included
  uint64_t data_bytes() const;                 // bytes of the data buffer

  // The tensor `name` as an owned, contiguous tensor on `device` (read on the CPU first).
  // Error when the name is missing or tessera has no dtype for it.
  Tensor get(const std::string& name, Device device = Device::cpu()) const;

  // Copies tensor `name` into the caller's tensor `dst` (any device, any strides), which must
  // have exactly the stored shape and dtype: loading weights into allocated parameters.
  void read_into(const std::string& name, Tensor& dst) const;

  // The raw bytes of tensor `name` as stored (little-endian), valid while this object lives.
  const uint8_t* raw_bytes(const std::string& name) const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// Reads every tensor of a file into a map (convenience for small files and tests).
std::map<std::string, Tensor> load_safetensors(const std::string& path, Device device = Device::cpu());

// A list of named tensors; the order is kept where the format allows it.
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Writes `tensors` to `path` atomically. Tensors may live on any device and have any
// strides (each is copied to the CPU and packed while being written, one at a time).
// The data buffer is laid out like the Hugging Face writer does: by element size, largest
// first, then in the given order, so every tensor is aligned to its element size (the header
// is padded with spaces to make the buffer start 8-byte aligned). Error for an undefined
// tensor, an empty or duplicate name, the reserved name "__metadata__", or names and
// metadata that are not valid UTF-8. Note that Hugging Face transformers refuses files
// whose metadata lacks {"format": "pt"}.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// The bytes save_safetensors() writes, handed to `sink` in order (the 8-byte header length,
// the header, then each tensor's data, one tensor at a time), for writers that stream them
// (checkpoints: written and checksummed without a copy of the whole file in memory). `where`
// names the destination in error messages.
void write_safetensors(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata,
                       const std::string& where, const std::function<void(const void*, size_t)>& sink);

// The bytes save_safetensors() writes, in memory.
std::string serialize_safetensors(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata = {});

// ---- Sharded checkpoints ----------------------------------------------------------------

inline constexpr const char* kSingleFileName = "model.safetensors";
inline constexpr const char* kIndexFileName = "model.safetensors.index.json";

// model.safetensors.index.json: {"metadata": {...}, "weight_map": {tensor: shard file}}.
// Metadata values that are not JSON strings (Hugging Face writes "total_size" as a number)
// are kept as their JSON text, e.g. "16060522496".
struct ShardIndex {
  std::map<std::string, std::string> metadata;
  std::map<std::string, std::string> weight_map;
  std::vector<std::string> shard_files() const;  // distinct shard names, sorted
};

// Reads and validates <dir>/model.safetensors.index.json. Error when it is missing, not
// JSON, lacks an object "weight_map" of strings, or names a shard by an absolute path or one
// containing "..".
ShardIndex load_index(const std::string& dir);

// The Hugging Face shard name: shard_file_name(0, 3) == "model-00001-of-00003.safetensors".
std::string shard_file_name(int shard, int num_shards);

// Writes a checkpoint into the existing directory `dir`, splitting tensors (in the given
// order) into shards of at most `max_shard_bytes` of tensor data; a tensor larger than that
// gets a shard of its own. With one shard the result is a plain model.safetensors and no
// index; otherwise model-0000k-of-0000n.safetensors plus model.safetensors.index.json
// (metadata {"total_size": bytes}). Each file is written atomically and the index last, then
// files of an older checkpoint in `dir` that the new one does not use (model.safetensors, the
// index, model-*-of-*.safetensors) are removed. `metadata` goes into every shard's header.
void save_sharded(const std::string& dir, const NamedTensors& tensors, uint64_t max_shard_bytes = 5'000'000'000ull,
                  const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// Reads a checkpoint directory written by save_sharded() or by Hugging Face: model.safetensors
// when present (as transformers prefers it), otherwise the index and its shards. A path to a
// .safetensors file is read as a one-file checkpoint. All shards are opened and validated up
// front, and every tensor of the weight map must exist in its shard.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& path);

  bool sharded() const { return sharded_; }
  size_t num_files() const { return files_.size(); }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;
  // The index's metadata for a sharded checkpoint, the file's "__metadata__" otherwise.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The file that holds `name`.
  const SafetensorsFile& file_of(const std::string& name) const;
  Tensor get(const std::string& name, Device device = Device::cpu()) const;
  void read_into(const std::string& name, Tensor& dst) const;

 private:
  std::string path_;
  bool sharded_ = false;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> file_of_name_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace tessera::io
