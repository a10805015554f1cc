#pragma once

// 64-bit FNV-1a: a small hash that is the same in every process, build and release (unlike
// std::hash), for choices that must agree across machines and restarts.

#include <cstdint>
#include <string_view>

namespace kiln {

inline constexpr uint64_t kFnv1aOffset = 1469598103934665603ULL;

// Hashes `s` on from `h` (the offset basis for a fresh hash; a previous result to go on).
inline uint64_t Fnv1a64(std::string_view s, uint64_t h = kFnv1aOffset) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

}  // namespace kiln
