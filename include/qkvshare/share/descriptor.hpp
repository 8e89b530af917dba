#pragma once
// The descriptor: the small value a producer hands a consumer to name a
// sealed context (docs/design.md "Descriptor"). 256 bytes, fixed layout, little
// endian, versioned and self-validating; the byte layout is documented in
// docs/handoff.md and by the offsets in descriptor.cpp.
//
// It names the context by its record in the shared region (slot +
// generation) and the grant it was issued under (slot + generation), never by
// a pointer: opening it is O(1) in the context length, and a released or
// revoked context can never be opened again because its generation moved on,
// even when the slot and its blocks were reused.
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "qkvshare/kv/kv_format.hpp"
#include "qkvshare/share/fingerprint.hpp"

namespace qkvshare {

// Segments of one sealed context (share records, descriptors' block counts).
inline constexpr std::uint32_t kMaxContextSegments = 64;

inline constexpr std::size_t kDescriptorBytes = 256;
inline constexpr std::size_t kAgentIdBytes = 32;
inline constexpr std::uint16_t kDescriptorVersion = 1;
// The capability tag covers bytes [0, kCapabilityOffset): every field but
// the tag, the reserved bytes and the self checksum.
inline constexpr std::size_t kCapabilityOffset = 208;
inline constexpr std::size_t kCapabilityBytes = 16;

using DescriptorBytes = std::array<std::uint8_t, kDescriptorBytes>;

struct Descriptor {
  std::uint64_t pool_id = 0;
  std::uint64_t context_id = 0;
  std::uint32_t record_slot = 0, record_generation = 0;
  std::uint32_t grant_slot = 0, grant_generation = 0;
  std::uint32_t token_count = 0;
  std::uint32_t position_begin = 0, position_end = 0;  // [begin, end): where the keys were rotated
  std::uint32_t block_tokens = 0, block_count = 0;
  // KvCodec::pack() of K and V; may name a codec this build does not know
  // (a newer producer), which sends the consumer to the text fallback.
  std::uint32_t k_codec = 0, v_codec = 0;
  std::uint32_t window = 0, sink = 0;
  std::uint32_t format_flags = 0;  // bit 0: keys rotated, bit 1: values rotated, bits 2-3: KeyRope (1 keys=pre, 2 keys=block), bit 4: tail=cold
  ModelFingerprint fingerprint;
  std::uint64_t blocks_checksum = 0;  // XXH3-64 over the sealed blocks' XXH3-64 digests
  std::uint64_t table_checksum = 0;   // XXH3-64 of the block table (index, generation) pairs
  std::uint64_t tokens_checksum = 0;  // XXH3-64 of the token ids
  std::uint64_t created_unix_ns = 0;
  std::string producer, grantee;      // agent ids, 1..32 bytes of [A-Za-z0-9_.:@-]
  std::array<std::uint8_t, kCapabilityBytes> capability{};
  // Mixed-precision formats (KvFormat::lo_k/lo_v/top; all 0 otherwise), in
  // bytes 224..235 (once reserved), after the capability tag and so not
  // covered by it: they only name codecs, which adopt() checks against every
  // block's own header, so an edited value can make the open fail, not read
  // a block wrongly. A build that predates them rejects such a descriptor
  // (reserved bytes not zero) and its consumer falls back to text.
  std::uint32_t lo_k_codec = 0, lo_v_codec = 0;
  std::uint32_t top_millionths = 0;  // KvFormat::top * 1e6, in [1, 999999]
  // KvCodebook::id() of a pq format's codebook (0 otherwise), in bytes
  // 236..243 (once reserved), outside the capability tag like the fields
  // above: a consumer opens the KV only with the codebook of this id loaded
  // (KvCodebook::find), and an edited id sends it to the text fallback.
  std::uint64_t codebook_id = 0;

  // nullopt when a codec or flag is unknown to this build. A pq format comes
  // with the codebook of codebook_id when this process has loaded it, and
  // without (book null) when it has not.
  std::optional<KvFormat> format() const;
  void set_format(const KvFormat& format);

  // The 256 bytes, self checksum included (the capability as it is set).
  DescriptorBytes encode() const;
  // Validates size, magic, version, self checksum and every field's range;
  // throws Error(bad_descriptor) naming `source` and the problem. Does not
  // check the capability, the record or the model: that needs the pool.
  static Descriptor decode(std::span<const std::uint8_t> bytes, std::string_view source = "descriptor");

  std::string json() const;  // one JSON object with every field
};

// HMAC-SHA-256 of bytes [0, kCapabilityOffset) of `encoded`, keyed with the
// pool's secret, truncated to 128 bits.
std::array<std::uint8_t, kCapabilityBytes> capability_tag(std::span<const std::uint8_t> secret,
                                                          const DescriptorBytes& encoded);

// Throws Error(invalid_argument) naming `what` unless `id` is a valid agent id.
void validate_agent_id(std::string_view id, std::string_view what);

// Whole-file helpers; errors name the path (io for the OS, bad_descriptor for content).
Descriptor read_descriptor_file(const std::string& path);
void write_descriptor_file(const std::string& path, const Descriptor& descriptor);

}  // namespace qkvshare
