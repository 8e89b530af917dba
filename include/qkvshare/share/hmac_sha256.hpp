#pragma once
// HMAC-SHA-256 (RFC 2104 / FIPS 180-4) for descriptor capability tags. A
// small local implementation: the tag is computed on every grant and open
// (one 200-byte message, four compressions, about a microsecond), and a real
// MAC keeps forging a descriptor as hard as guessing the pool's secret.
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace qkvshare::share_detail {

using Sha256Digest = std::array<std::uint8_t, 32>;

Sha256Digest sha256(std::span<const std::uint8_t> message) noexcept;
Sha256Digest hmac_sha256(std::span<const std::uint8_t> key, std::span<const std::uint8_t> message) noexcept;

}  // namespace qkvshare::share_detail
