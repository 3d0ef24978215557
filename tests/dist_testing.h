// Helpers for the multi-process tests (tests/test_dist_*.cpp). The same binaries run alone
// (a world of one, the local group) and under mpirun with 2 and 4 ranks (CMakeLists.txt
// registers all three); every test is written for any world size.
#pragma once

#include <gtest/gtest.h>

#include "tessera/dist/process_group.h"

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

}  // namespace tessera::testing
