// llm.c token shards (reader and atomic writer) and TokenFile, which opens any supported
// token file, or a glob of them, as one flat stream of int32 tokens.
//
// llm.c layout (dev/data/data_common.py): int32 header[256] = {magic, version, count, 0...},
// then `count` tokens, uint16 for GPT-2 shards and uint32 for LLaMA-3 shards.
#include <glob.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <optional>
#include <variant>

#include "data/file_util.h"
#include "tessera/data/token_file.h"

namespace tessera::data {
namespace {

struct LlmcLayout {
  int32_t magic, version;
  size_t token_bytes;
  const char* name;
};

LlmcLayout llmc_layout(LlmcFormat format) {
  return format == LlmcFormat::Gpt2 ? LlmcLayout{kLlmcGpt2Magic, 1, 2, "GPT-2"}
                                    : LlmcLayout{kLlmcLlama3Magic, 7, 4, "LLaMA-3"};
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The first four bytes of a file as an int32, or nothing for an unreadable or short file.
std::optional<int32_t> read_leading_int32(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return std::nullopt;
  int32_t value = 0;
  const bool ok = std::fread(&value, 4, 1, f) == 1;
  std::fclose(f);
  if (!ok) return std::nullopt;
  return value;
}

}  // namespace

// ---- llm.c shards ----------------------------------------------------------------------

void write_llmc_shard(const std::string& path, std::span<const int32_t> tokens, LlmcFormat format) {
  const LlmcLayout layout = llmc_layout(format);
  TESSERA_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()), "llm.c shard '", path,
                "': ", tokens.size(), " tokens do not fit the header's int32 count");
  const int64_t max_token = format == LlmcFormat::Gpt2 ? 65535 : std::numeric_limits<int32_t>::max();
  for (size_t i = 0; i < tokens.size(); ++i) {
    TESSERA_CHECK(tokens[i] >= 0 && tokens[i] <= max_token, "llm.c shard '", path, "': token ", tokens[i],
                  " at position ", i, " does not fit a ", layout.name, " shard (0..", max_token, ")");
  }
  int32_t header[kLlmcHeaderInts] = {};
  header[0] = layout.magic;
  header[1] = layout.version;
  header[2] = static_cast<int32_t>(tokens.size());

  AtomicFileWriter out(path);
  out.write(header, sizeof(header));
  constexpr size_t kChunk = 1 << 16;
  std::vector<uint8_t> chunk(kChunk * layout.token_bytes);
  for (size_t begin = 0; begin < tokens.size(); begin += kChunk) {
    const size_t n = std::min(kChunk, tokens.size() - begin);
    for (size_t i = 0; i < n; ++i) {
      if (format == LlmcFormat::Gpt2) {
        const uint16_t v = static_cast<uint16_t>(tokens[begin + i]);
        std::memcpy(chunk.data() + 2 * i, &v, 2);
      } else {
        const uint32_t v = static_cast<uint32_t>(tokens[begin + i]);
        std::memcpy(chunk.data() + 4 * i, &v, 4);
      }
    }
    out.write(chunk.data(), n * layout.token_bytes);
  }
  out.commit();
}

LlmcShard LlmcShard::open(const std::string& path) {
  LlmcShard shard;
  shard.path_ = path;
  shard.file_ = MappedFile::open(path, "llm.c shard");
  const size_t size = shard.file_->size();
  TESSERA_CHECK(size >= static_cast<size_t>(kLlmcHeaderBytes), "llm.c shard '", path, "': truncated: ", size,
                " bytes, the header alone has ", kLlmcHeaderBytes);
  const uint8_t* data = shard.file_->data();
  const int32_t magic = load_unaligned<int32_t>(data), version = load_unaligned<int32_t>(data + 4);
  const int32_t count = load_unaligned<int32_t>(data + 8);
  if (magic == kLlmcGpt2Magic) {
    shard.format_ = LlmcFormat::Gpt2;
  } else if (magic == kLlmcLlama3Magic) {
    shard.format_ = LlmcFormat::Llama3;
  } else {
    TESSERA_FAIL("llm.c shard '", path, "': bad magic ", magic, " (expected ", kLlmcGpt2Magic, " for GPT-2 or ",
                 kLlmcLlama3Magic, " for LLaMA-3 shards); not an llm.c token file");
  }
  const LlmcLayout layout = llmc_layout(shard.format_);
  TESSERA_CHECK(version == layout.version, "llm.c shard '", path, "': version ", version, ", a ", layout.name,
                " shard has version ", layout.version);
  TESSERA_CHECK(count >= 0, "llm.c shard '", path, "': negative token count ", count, " in the header");
  const uint64_t expected = static_cast<uint64_t>(kLlmcHeaderBytes) + static_cast<uint64_t>(count) * layout.token_bytes;
  TESSERA_CHECK(size == expected, "llm.c shard '", path, "': the header says ", count, " tokens (", expected,
                " bytes with the header) but the file has ", size, " bytes",
                size < expected ? ": truncated" : ": trailing bytes; corrupt");
  shard.num_tokens_ = count;
  return shard;
}

void LlmcShard::read_tokens(int64_t start, std::span<int32_t> out) const {
  const int64_t count = static_cast<int64_t>(out.size());
  TESSERA_CHECK(start >= 0 && start <= num_tokens_ && count <= num_tokens_ - start, "llm.c shard '", path_,
                "': tokens [", start, ", ", start + count, ") are outside its ", num_tokens_, " tokens");
  const uint8_t* base = file_->data() + kLlmcHeaderBytes;
  if (format_ == LlmcFormat::Gpt2) {
    for (int64_t i = 0; i < count; ++i) out[i] = load_unaligned<uint16_t>(base + 2 * (start + i));
  } else {
    for (int64_t i = 0; i < count; ++i) {
      out[i] = token_to_int32(load_unaligned<uint32_t>(base + 4 * (start + i)), "llm.c shard", path_, start + i);
    }
  }
}

std::vector<int32_t> LlmcShard::read_tokens(int64_t start, int64_t count) const {
  TESSERA_CHECK(count >= 0, "llm.c shard '", path_, "': negative read count ", count);
  std::vector<int32_t> tokens(static_cast<size_t>(count));
  read_tokens(start, tokens);
  return tokens;
}

// ---- TokenFile -------------------------------------------------------------------------

struct TokenFile::Impl {
  using Part = std::variant<LlmcShard, IndexedDataset>;
  std::string path;
  std::vector<Part> parts;
  std::vector<int64_t> starts;  // flat index of each part's first token; parts.size() + 1 entries

  static Part open_one(const std::string& path) {
    if (ends_with(path, ".idx")) return IndexedDataset::open(path.substr(0, path.size() - 4));
    if (file_exists(path)) {
      const std::optional<int32_t> magic = read_leading_int32(path);
      if (magic && (*magic == kLlmcGpt2Magic || *magic == kLlmcLlama3Magic)) return LlmcShard::open(path);
      if (ends_with(path, ".bin")) {
        const std::string prefix = path.substr(0, path.size() - 4);
        if (file_exists(prefix + ".idx")) return IndexedDataset::open(prefix);
      }
      TESSERA_FAIL("token file '", path, "' is neither an llm.c shard (its first int32 is ",
                   magic ? std::to_string(*magic) : std::string("missing"), ", not ", kLlmcGpt2Magic, " or ",
                   kLlmcLlama3Magic, ") nor a Megatron .bin with a matching .idx");
    }
    if (file_exists(path + ".idx")) return IndexedDataset::open(path);
    TESSERA_FAIL("token file '", path, "' does not exist (nor '", path, ".idx' for a Megatron dataset prefix)");
  }
};

TokenFile TokenFile::open(const std::string& path) {
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  std::vector<std::string> paths;
  if (path.find_first_of("*?[") != std::string::npos && !file_exists(path)) {
    glob_t matches{};
    const int status = ::glob(path.c_str(), 0, nullptr, &matches);
    for (size_t i = 0; status == 0 && i < matches.gl_pathc; ++i) paths.emplace_back(matches.gl_pathv[i]);
    ::globfree(&matches);
    TESSERA_CHECK(!paths.empty(), "token file pattern '", path, "' matches no file");
    std::sort(paths.begin(), paths.end());
    // A Megatron dataset matched as both .bin and .idx is one dataset.
    std::vector<std::string> kept;
    for (const std::string& p : paths) {
      if (ends_with(p, ".idx") && std::binary_search(paths.begin(), paths.end(), p.substr(0, p.size() - 4) + ".bin")) {
        continue;
      }
      kept.push_back(p);
    }
    paths.swap(kept);
  } else {
    paths.push_back(path);
  }
  impl->starts.push_back(0);
  for (const std::string& p : paths) {
    impl->parts.push_back(Impl::open_one(p));
    const int64_t n = std::visit([](const auto& part) { return part.num_tokens(); }, impl->parts.back());
    impl->starts.push_back(impl->starts.back() + n);
  }
  TokenFile file;
  file.impl_ = std::move(impl);
  return file;
}

int64_t TokenFile::num_tokens() const {
  TESSERA_CHECK(impl_ != nullptr, "TokenFile: not opened");
  return impl_->starts.back();
}

void TokenFile::read(int64_t start, std::span<int32_t> out) const {
  const int64_t total = num_tokens(), count = static_cast<int64_t>(out.size());
  TESSERA_CHECK(start >= 0 && start <= total && count <= total - start, "token file '", impl_->path, "': tokens [",
                start, ", ", start + count, ") are outside its ", total, " tokens");
  int64_t done = 0;
  // The part holding `start`: the last whose first token is <= start (skipping empty parts).
  size_t part = std::upper_bound(impl_->starts.begin(), impl_->starts.end(), start) - impl_->starts.begin() - 1;
  while (done < count) {
    const int64_t offset = start + done - impl_->starts[part];
    const int64_t take = std::min(impl_->starts[part + 1] - impl_->starts[part] - offset, count - done);
    const std::span<int32_t> dst = out.subspan(static_cast<size_t>(done), static_cast<size_t>(take));
    std::visit([&](const auto& p) { p.read_tokens(offset, dst); }, impl_->parts[part]);
    done += take;
    ++part;
  }
}

std::vector<int32_t> TokenFile::read(int64_t start, int64_t count) const {
  TESSERA_CHECK(count >= 0, "token file: negative read count ", count);
  std::vector<int32_t> tokens(static_cast<size_t>(count));
  read(start, tokens);
  return tokens;
}

const std::string& TokenFile::path() const {
  TESSERA_CHECK(impl_ != nullptr, "TokenFile: not opened");
  return impl_->path;
}

int64_t TokenFile::num_files() const { return impl_ ? static_cast<int64_t>(impl_->parts.size()) : 0; }

TokenFileFormat TokenFile::format(int64_t file) const {
  TESSERA_CHECK(file >= 0 && file < num_files(), "token file: file ", file, " out of range [0, ", num_files(), ")");
  return std::holds_alternative<LlmcShard>(impl_->parts[file]) ? TokenFileFormat::LlmcShard
                                                                : TokenFileFormat::MegatronIndexed;
}

std::string TokenFile::describe() const {
  if (!impl_) return "token file (not opened)";
  const auto describe_part = [](const Impl::Part& part) {
    if (const auto* shard = std::get_if<LlmcShard>(&part)) {
      return detail::concat("llm.c shard '", shard->path(), "' (", llmc_layout(shard->format()).name, ", ",
                            shard->num_tokens(), " tokens)");
    }
    const auto& ds = std::get<IndexedDataset>(part);
    return detail::concat("Megatron dataset '", ds.prefix(), "' (", indexed_dtype_name(ds.dtype()), ", ",
                          ds.num_sequences(), " sequences, ", ds.num_documents(), " documents, ", ds.num_tokens(),
                          " tokens)");
  };
  if (impl_->parts.size() == 1) return describe_part(impl_->parts[0]);
  return detail::concat("token files '", impl_->path, "' (", impl_->parts.size(), " files, ", num_tokens(),
                        " tokens, first: ", describe_part(impl_->parts[0]), ")");
}

}  // namespace tessera::data
