// Philox4x32-10: a counter-based random number generator (Salmon et al., SC'11).
//
// The value drawn depends only on (seed, counter), never on the order of draws, so the
// CPU and CUDA backends produce the same stream for the same seed: element i of a tensor
// filled at `offset` takes word (i % 4) of philox(seed, counter = offset + i / 4).
#pragma once

#include <cstdint>

#include "tessera/core/numeric.h"

namespace tessera {

struct Philox4 {
  uint32_t x[4];
};

TESSERA_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
}

// 10 rounds over a 128-bit counter with a 64-bit key.
TESSERA_HD Philox4 philox4x32(uint64_t seed, uint64_t counter_lo, uint64_t counter_hi = 0) {
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(0xD2511F53u, c0, hi0, lo0);
    philox_mulhilo(0xCD9E8D57u, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The i-th 32-bit word of the stream starting at `offset`.
TESSERA_HD uint32_t philox_word(uint64_t seed, uint64_t offset, uint64_t i) {
  const Philox4 r = philox4x32(seed, offset + i / 4);
  return r.x[i % 4];
}

// A float in [0, 1) with 24 random bits (every value exactly representable).
TESSERA_HD float uniform_from_word(uint32_t w) { return static_cast<float>(w >> 8) * (1.0f / 16777216.0f); }

// A standard normal from two words (Box-Muller). The uniforms are bit-identical across
// backends; logf/cosf may differ in the last bit between host libm and CUDA.
TESSERA_HD float normal_from_words(uint32_t w0, uint32_t w1) {
  const float u0 = (static_cast<float>(w0 >> 8) + 1.0f) * (1.0f / 16777216.0f);  // (0, 1]
  const float u1 = uniform_from_word(w1);
  return sqrtf(-2.0f * logf(u0)) * cosf(6.283185307179586f * u1);
}

}  // namespace tessera
