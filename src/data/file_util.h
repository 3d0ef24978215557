// File plumbing shared by the token-file readers and writers: read-only memory mappings,
// atomic writes, and the conversion of stored token values to int32.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>

#include "tessera/core/error.h"

namespace tessera::data {

// A whole file mapped read-only. An empty file maps to no memory (data() is null).
class MappedFile {
 public:
  // Throws Error naming `what` ("llm.c shard", "Megatron .idx") when the file cannot be opened.
  static std::shared_ptr<const MappedFile> open(const std::string& path, const char* what);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

// Writes `path` through a temporary file in the same directory; commit() flushes, fsyncs,
// renames it over `path` and fsyncs the directory. Destroyed uncommitted, it removes the
// temporary file.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(const std::string& path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* bytes, size_t count);
  // Everything written reaches the disk under the temporary name; commit_rename() then
  // makes it visible. Two steps so a writer of several files can sync all before renaming any.
  void sync();
  void commit_rename();
  void commit() {
    sync();
    commit_rename();
  }
  int64_t bytes_written() const { return bytes_written_; }

 private:
  void flush_buffer();
  void write_all(const char* bytes, size_t count);
  std::string path_, temp_path_;
  int fd_ = -1;
  bool synced_ = false, committed_ = false;
  std::string buffer_;
  int64_t bytes_written_ = 0;
};

// Reads a little-endian value from possibly unaligned memory.
template <typename T>
T load_unaligned(const uint8_t* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

// Stored token -> int32, throwing when the value is not an integer in int32 range.
template <typename T>
int32_t token_to_int32(T value, const char* file_kind, const std::string& path, int64_t position) {
  if constexpr (std::is_floating_point_v<T>) {
    TESSERA_CHECK(std::isfinite(value) && value == std::floor(value) && value >= -2147483648.0 && value <= 2147483647.0,
                  file_kind, " '", path, "': token ", position, " is ", value, ", not an int32 token id");
  } else if constexpr (std::is_unsigned_v<T> && sizeof(T) >= 4) {
    TESSERA_CHECK(value <= static_cast<T>(INT32_MAX), file_kind, " '", path, "': token ", position, " is ", value,
                  ", outside the int32 range");
  } else if constexpr (std::is_signed_v<T> && sizeof(T) > 4) {
    TESSERA_CHECK(value >= INT32_MIN && value <= INT32_MAX, file_kind, " '", path, "': token ", position, " is ",
                  value, ", outside the int32 range");
  }
  return static_cast<int32_t>(value);
}

// A path's directory, for fsync after a rename ("." for a bare file name).
std::string parent_directory(const std::string& path);
bool file_exists(const std::string& path);

}  // namespace tessera::data
