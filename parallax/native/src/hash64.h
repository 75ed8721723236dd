// splitmix64 (parallax.protocol.routing.mix64): the one 64-bit hash of parallax, shared by the
// worker's routing of keyed tables and the server's initial rows.
#pragma once

#include <cstdint>

namespace parallax_hash {

// splitmix64's step: the increment, then the finaliser (wrapping arithmetic).
inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace parallax_hash
