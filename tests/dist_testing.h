// Helpers for the multi-process tests (tests/test_dist_*.cpp). The same binaries run alone
// (a world of one, the local group) and under mpirun with 2 and 4 ranks (CMakeLists.txt
// registers all three); every test is written for any world size.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>

#include "tessera/dist/process_group.h"
#include "tessera/io/atomic_file.h"

namespace tessera::testing {

// Finalizes MPI after the last test, inside RUN_ALL_TESTS, so that mpirun sees every rank
// end cleanly.
class DistEnvironment : public ::testing::Environment {
 public:
  void TearDown() override { dist::finalize(); }
};
inline ::testing::Environment* const dist_environment = ::testing::AddGlobalTestEnvironment(new DistEnvironment);

inline dist::GroupPtr test_world() { return dist::world(); }

// Values of a tensor as doubles (CPU copy), for comparisons.
inline std::vector<double> doubles_of(const Tensor& t) { return t.to(Device::cpu()).contiguous().to_doubles(); }

// A fresh directory every rank agrees on: rank 0 names it after `prefix`, `name` and its
// process id, and creates it.
inline std::string shared_dir(dist::ProcessGroup& world, const std::string& prefix, const std::string& name) {
  namespace fs = std::filesystem;
  std::string dir;
  if (world.rank() == 0) {
    dir = (fs::temp_directory_path() / (prefix + "_" + name + "_" + std::to_string(::getpid()))).string();
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  dir = dist::broadcast_string(world, dir, 0);
  world.barrier();
  return dir;
}

// A small repetitive text corpus in `dir` (written by rank 0), for trainer runs.
inline std::string shared_corpus(dist::ProcessGroup& world, const std::string& dir) {
  const std::string path = dir + "/corpus.txt";
  if (world.rank() == 0) {
    std::string text;
    for (int i = 0; i < 300; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + ". ";
    io::write_file_atomically(path, text);
  }
  world.barrier();
  return path;
}

}  // namespace tessera::testing
