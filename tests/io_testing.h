// Helpers shared by the file-format tests: a scratch directory removed at the end, tensors
// whose every byte is set (so round trips are checked bit for bit), hand-built safetensors
// files, and an expectation that a malformed file is rejected with a clear message.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/io/safetensors.h"

namespace tessera::testing {

inline constexpr DType kAllDTypes[] = {DType::F64,  DType::F32,  DType::F16, DType::BF16, DType::E4M3,
                                       DType::E5M2, DType::E8M0, DType::I64, DType::I32,  DType::U8};

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() /
           ("tessera_io_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
  std::vector<std::string> entries() const {  // sorted
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
};

// Every byte set from (index, seed): NaN and subnormal patterns included for float dtypes.
inline Tensor pattern_tensor(const Shape& shape, DType dtype, int seed) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* p = static_cast<uint8_t*>(t.raw_data());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<uint8_t>(i * 131 + seed * 17 + 1);
  return t;
}

// The packed bytes of a CPU tensor.
inline std::string bytes_of(const Tensor& t) {
  const Tensor c = t.contiguous();
  return c.nbytes() ? std::string(static_cast<const char*>(c.raw_data()), c.nbytes()) : std::string();
}

inline void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

inline std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s;
}

// A file as any writer produces it: length, header padded with spaces, data.
inline std::string build_file(std::string header, const std::string& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  return le64(header.size()) + header + data;
}

inline std::string f32_bytes(std::initializer_list<float> values) {
  std::string s;
  for (float v : values) s.append(reinterpret_cast<const char*>(&v), 4);
  return s;
}

// Opening `bytes` (written to dir/bad.safetensors) must raise an Error that names the file
// and contains `expected_words`.
inline void expect_rejected(const TempDir& dir, const std::string& bytes, const std::string& expected_words) {
  const std::string path = dir.file("bad.safetensors");
  write_raw(path, bytes);
  try {
    io::SafetensorsFile file(path);
    ADD_FAILURE() << "accepted a malformed file (expected an error saying '" << expected_words << "')";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(expected_words), std::string::npos) << message;
    EXPECT_NE(message.find(path), std::string::npos) << "the error does not name the file: " << message;
  }
}

}  // namespace tessera::testing
