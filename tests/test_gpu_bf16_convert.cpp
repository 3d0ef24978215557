// The GPU's float -> BF16 rounding (the hardware conversion with the portable NaN encoding,
// include/tessera/core/numeric.h) against the host's float_to_bf16_bits, bit for bit: every
// kernel that stores BF16 relies on the two agreeing. The F32 -> BF16 cast reaches both
// device forms: the 8-element vector store (floats_to_bf16_pairs, one NaN test for all 8)
// when the buffers are 16-byte aligned, the scalar conversion for the tail and for
// misaligned buffers. Skipped (saying so) where no GPU is present.
#include <cstring>

#include "tessera/core/numeric.h"
#include "tessera/ops/elementwise.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// Bit patterns around every rounding decision: each sign and exponent field (subnormals,
// the largest finite values, infinities and NaNs with payloads), upper mantissa bits with
// an even and an odd last kept bit, and lower halves below, at and above the tie; then
// pseudo-random words (every class again, NaN payloads included). NaNs are spread so that
// some 8-element vectors hold one and their neighbours none.
std::vector<uint32_t> interesting_bits() {
  std::vector<uint32_t> bits;
  for (uint32_t sign : {0u, 1u})
    for (uint32_t exponent = 0; exponent < 256; ++exponent)
      for (uint32_t upper : {0x00u, 0x01u, 0x3fu, 0x40u, 0x7eu, 0x7fu})
        for (uint32_t lower : {0x0000u, 0x0001u, 0x4000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu})
          bits.push_back(sign << 31 | exponent << 23 | upper << 16 | lower);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < (1 << 20); ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    bits.push_back(static_cast<uint32_t>(state >> 32));
  }
  return bits;
}

void expect_same_bits(const Tensor& got_device, const std::vector<uint32_t>& in, const char* path) {
  const std::vector<uint8_t> got = bytes_of(got_device);
  ASSERT_EQ(got.size(), 2 * in.size());
  int64_t mismatches = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    uint16_t g;
    std::memcpy(&g, got.data() + 2 * i, 2);
    const uint16_t want = float_to_bf16_bits(bits_float(in[i]));
    if (g != want && mismatches++ < 10)
      ADD_FAILURE() << path << ": float bits 0x" << std::hex << in[i] << " gave 0x" << g << ", want 0x" << want;
  }
  EXPECT_EQ(mismatches, 0) << path;
}

}  // namespace

TEST(GpuBf16Convert, MatchesTheHostRoundingBitForBit) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  std::vector<uint32_t> bits = interesting_bits();
  bits.resize(bits.size() / 8 * 8 + 5);  // a scalar tail after the vectors
  const int64_t n = static_cast<int64_t>(bits.size());
  Tensor host = Tensor::empty({n}, DType::F32);
  std::memcpy(host.raw_data(), bits.data(), 4 * bits.size());
  for (bool misaligned : {false, true}) {
    const Tensor in = to_device(host, misaligned);
    Tensor out = poisoned_device({n}, DType::BF16, misaligned);
    cast(gpu, in, out);
    expect_same_bits(out, bits, misaligned ? "scalar (misaligned)" : "vectors and tail");
  }
}

TEST(GpuBf16Convert, PortableFormIsTheHostForm) {
  // The host has no hardware path: both names give the same bits there.
  for (uint32_t u : {0x7fc00001u, 0xffbfffffu, 0x7f7f8000u, 0x00008000u, 0x3f808000u, 0x80000001u})
    EXPECT_EQ(float_to_bf16_bits(bits_float(u)), float_to_bf16_bits_portable(bits_float(u))) << std::hex << u;
}
