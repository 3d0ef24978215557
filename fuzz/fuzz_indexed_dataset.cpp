// libFuzzer target: the Megatron indexed-dataset reader (.idx + .bin) and the llm.c shard
// reader. Input layout: 4 bytes little-endian n, then n bytes of .idx, the rest is the .bin
// (and, on its own, an llm.c shard). A dataset that opens must read every sequence.
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_util.h"
#include "tessera/core/error.h"
#include "tessera/data/token_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  uint32_t n = 0;
  std::memcpy(&n, data, 4);
  n = static_cast<uint32_t>(std::min<size_t>(n, size - 4));
  static const std::string prefix = fuzz_util::scratch_path("data");
  fuzz_util::write(prefix + ".idx", data + 4, n);
  fuzz_util::write(prefix + ".bin", data + 4 + n, size - 4 - n);
  try {
    const auto ds = tessera::data::IndexedDataset::open(prefix);
    int64_t total = 0;
    for (int64_t i = 0; i < ds.num_sequences() && total < (1 << 20); ++i) {
      const int64_t len = ds.sequence_length(i);
      if (len < 0) __builtin_trap();
      total += len;
      try {
        if (ds.sequence(i).size() != static_cast<size_t>(len)) __builtin_trap();
      } catch (const tessera::Error&) {  // a float token that is no integer
      }
    }
    if (ds.num_tokens() > 0 && ds.num_tokens() < (1 << 20)) {
      std::vector<int32_t> all(static_cast<size_t>(ds.num_tokens()));
      try {
        ds.read_tokens(0, all);
      } catch (const tessera::Error&) {
      }
    }
  } catch (const tessera::Error&) {
  }
  try {
    const auto shard = tessera::data::LlmcShard::open(prefix + ".bin");
    if (shard.num_tokens() < 0) __builtin_trap();
    if (shard.num_tokens() < (1 << 20)) (void)shard.read_tokens(0, shard.num_tokens());
  } catch (const tessera::Error&) {
  }
  return 0;
}
