// Token files: the on-disk formats training reads, and one type that opens any of them.
//
//   llm.c shard        one .bin: a header of 256 int32 (magic, version, token count, zeros),
//                      then the tokens. GPT-2 shards: magic 20240520, version 1, uint16
//                      tokens. LLaMA-3 shards: magic 20240801, version 7, uint32 tokens.
//   Megatron-LM        prefix.idx + prefix.bin (the MMIDIDX indexed dataset): the .idx holds
//   indexed dataset    the token dtype, the length and byte offset of every sequence and the
//                      document boundaries; the .bin holds the tokens.
//   TokenFile          opens either (or a glob of shards) as one flat stream of tokens.
//
// Files are memory-mapped and never loaded whole; every read converts to int32. Opening
// validates the whole structure (magic, version, sizes, offsets) and throws tessera::Error
// saying which file is wrong and how. All formats are little-endian, as their writers
// (numpy on x86/ARM) produce. Writers are atomic: they write a temporary file in the same
// directory, fsync it and rename it into place, so a crash never leaves a half-written file
// under the final name.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace tessera::data {

class MappedFile;  // a read-only memory mapping (src/data/file_util.h)

// ---- llm.c shards ------------------------------------------------------------------------

enum class LlmcFormat : uint8_t {
  Gpt2,    // magic 20240520, version 1, uint16 tokens
  Llama3,  // magic 20240801, version 7, uint32 tokens
};

inline constexpr int32_t kLlmcGpt2Magic = 20240520;
inline constexpr int32_t kLlmcLlama3Magic = 20240801;
inline constexpr int64_t kLlmcHeaderInts = 256;
inline constexpr int64_t kLlmcHeaderBytes = kLlmcHeaderInts * 4;

// Throws Error when a token does not fit the format (GPT-2: 0..65535) or there are 2^31
// tokens or more (the header stores the count as int32).
void write_llmc_shard(const std::string& path, std::span<const int32_t> tokens, LlmcFormat format = LlmcFormat::Gpt2);

class LlmcShard {
 public:
  // Throws Error for a missing file, a bad magic or version, or a size that does not
  // match the header's token count.
  static LlmcShard open(const std::string& path);

  int64_t num_tokens() const { return num_tokens_; }
  LlmcFormat format() const { return format_; }
  const std::string& path() const { return path_; }
  // Tokens [start, start + out.size()). Throws Error when the range is outside the file.
  void read_tokens(int64_t start, std::span<int32_t> out) const;
  std::vector<int32_t> read_tokens(int64_t start, int64_t count) const;

 private:
  std::shared_ptr<const MappedFile> file_;
  std::string path_;
  LlmcFormat format_ = LlmcFormat::Gpt2;
  int64_t num_tokens_ = 0;
};

// ---- Megatron-LM indexed datasets ----------------------------------------------------------

// The .idx dtype codes of megatron/core/datasets/indexed_dataset.py.
enum class IndexedDType : uint8_t { U8 = 1, I8 = 2, I16 = 3, I32 = 4, I64 = 5, F64 = 6, F32 = 7, U16 = 8 };
size_t indexed_dtype_size(IndexedDType dtype);
const char* indexed_dtype_name(IndexedDType dtype);

// .idx layout (little-endian, packed):
//   9 bytes "MMIDIDX\0\0" | uint64 version = 1 | uint8 dtype code | uint64 sequence count S
//   | uint64 document index count D | int32 lengths[S] | int64 byte pointers[S]
//   | int64 document indices[D]
// The document indices are sequence indices: document k is sequences [doc[k], doc[k+1]),
// and doc[0] = 0, so D = documents + 1. Bytes after them (Megatron's multimodal sequence
// modes) are ignored.
class IndexedDataset {
 public:
  // `prefix` names prefix.idx and prefix.bin. Throws Error for a missing file, a bad magic,
  // version or dtype code, a truncated .idx, a sequence that extends past the end of the
  // .bin, or document indices that are not a non-decreasing list within [0, S].
  static IndexedDataset open(const std::string& prefix);

  const std::string& prefix() const { return prefix_; }
  IndexedDType dtype() const { return dtype_; }
  int64_t num_sequences() const { return num_sequences_; }
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }
  int64_t num_tokens() const { return num_tokens_; }
  const std::vector<int64_t>& document_indices() const { return document_indices_; }
  int64_t sequence_length(int64_t i) const;
  int64_t sequence_pointer(int64_t i) const;  // byte offset in the .bin

  // Sequence i as int32 (throws Error for a value that is not an integer in int32 range,
  // e.g. a float dtype holding 0.5).
  std::vector<int32_t> sequence(int64_t i) const;
  // Tokens [offset, offset + out.size()) of sequence i.
  void read_sequence(int64_t i, int64_t offset, std::span<int32_t> out) const;
  // The sequences concatenated in index order, as one stream: tokens [start, start + out.size()).
  void read_tokens(int64_t start, std::span<int32_t> out) const;

 private:
  std::shared_ptr<const MappedFile> index_, data_;
  std::string prefix_;
  IndexedDType dtype_ = IndexedDType::U16;
  int64_t num_sequences_ = 0, num_tokens_ = 0;
  size_t lengths_offset_ = 0, pointers_offset_ = 0;  // byte offsets of the arrays in the .idx
  std::vector<int64_t> document_indices_;
  // The usual layout has sequence i + 1 right after sequence i in the .bin, so the flat
  // stream is one byte range; otherwise sequence_starts_ holds the flat index of each
  // sequence's first token (S + 1 entries) for a binary search.
  bool packed_ = true;
  std::vector<int64_t> sequence_starts_;
};

// Writes prefix.bin and prefix.idx. Sequences are appended with add_sequence; end_document
// closes the current document (its sequences since the previous end_document). finalize()
// ends an open document, writes the .idx and moves both files into place; a writer
// destroyed before finalize() removes its temporary files and leaves no dataset.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(const std::string& prefix, IndexedDType dtype = IndexedDType::U16);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // Throws Error when a token does not fit the dtype.
  void add_sequence(std::span<const int32_t> tokens);
  void end_document();
  void add_document(std::span<const int32_t> tokens) {
    add_sequence(tokens);
    end_document();
  }
  void finalize();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- Any token file ------------------------------------------------------------------------

enum class TokenFileFormat : uint8_t { LlmcShard, MegatronIndexed };

class TokenFile {
 public:
  // `path` is one of:
  //   an llm.c shard (a file that starts with an llm.c magic number),
  //   a Megatron dataset: its prefix, its .idx or its .bin,
  //   a glob pattern (with * ? or [) matching several of those: opened in sorted order
  //   and read as their concatenation (llm.c's "fineweb_train_*.bin" shards).
  // Throws Error when nothing matches or a file fails validation.
  static TokenFile open(const std::string& path);

  int64_t num_tokens() const;
  // Tokens [start, start + out.size()) of the whole stream, across file boundaries.
  void read(int64_t start, std::span<int32_t> out) const;
  std::vector<int32_t> read(int64_t start, int64_t count) const;

  const std::string& path() const;  // as given to open()
  int64_t num_files() const;
  TokenFileFormat format(int64_t file) const;
  std::string describe() const;  // "llm.c shard 'x.bin' (GPT-2, 1000 tokens)", or a summary of several

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

}  // namespace tessera::data
