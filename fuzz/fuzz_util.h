// Shared by the libFuzzer targets: the readers under test take paths, so each input is
// written to a per-process scratch file first.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace fuzz_util {

inline std::string scratch_path(const char* name) {
  // Never destroyed, so the exit handler that removes the directory can still read it.
  static const std::string& dir = *[] {
    const auto d = std::filesystem::temp_directory_path() / ("tessera_fuzz_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return new std::string(d.string());
  }();
  static const bool cleanup_registered = [] {
    return std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }) == 0;
  }();
  (void)cleanup_registered;
  return dir + "/" + name;
}

inline void write(const std::string& path, const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
}

}  // namespace fuzz_util
