#pragma once
// Byte-by-byte little-endian stores and loads, the same on every host: the
// portable context format (context_file.cpp) and the Redis manifests
// (redis_tier.cpp). Private to the tiers layer.
#include <cstdint>
#include <vector>

namespace qkvshare::le {

inline void put(std::vector<std::uint8_t>& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
inline std::uint64_t get(const std::uint8_t* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace qkvshare::le
