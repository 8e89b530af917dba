#pragma once
// The portable context format (docs/tiers.md has the byte layout): a sealed
// context as bytes that read back bit-exactly on any machine. It is what the
// disk tier spills, what the remote tier (Redis) stores, and what
// `qkvshare context export/import` write and read.
//
// Every integer and every element inside a block is little endian, whatever
// the host: tiles are converted between the pool's native layout and the
// file's canonical one (tile_to_canonical / tile_from_canonical; a memcpy on
// little-endian hosts). Blocks keep their pool tile layout (kv_format.hpp),
// so exporting and importing neither requantizes nor changes a single code.
//
// Layout: [header 128 B][tokens][text][segment table][block table][meta
// checksum] then, 64-byte aligned, one payload per block. Each block carries
// the XXH3-64 of its canonical plaintext; with a cipher the payloads are
// AEAD-sealed (nonce || ciphertext || tag) and the header names the key id.
// This file depends on core and kv only (no OS, no crypto library), so the
// big-endian test can cross-compile it for s390x and run it under qemu.
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "qkvshare/core/file_io.hpp"
#include "qkvshare/kv/kv_cache.hpp"
#include "qkvshare/kv/kv_format.hpp"

namespace qkvshare {

// 2: block entries carry the position of a keys=pre/block block's first key; 3: a table of the layers'
// sliding windows follows the block table, and blocks may hold the global layers alone (written for models
// with windows; others still write 2). Every earlier version is read too.
inline constexpr std::uint16_t kContextFileVersion = 3;
inline constexpr std::size_t kContextHeaderBytes = 128;
inline constexpr std::size_t kContextPayloadAlign = 64;
// A sealed payload: 24-byte nonce || ciphertext || 16-byte tag (XChaCha20-Poly1305-IETF).
inline constexpr std::size_t kContextSealOverhead = 40;

// Seals and opens block payloads (tiers/crypto.hpp implements it with
// libsodium). `aad` is authenticated, not encrypted.
class BlockCipher {
 public:
  virtual ~BlockCipher() = default;
  virtual std::uint64_t key_id() const noexcept = 0;  // names the key, never reveals it
  virtual std::size_t overhead() const noexcept = 0;  // stored bytes - plaintext bytes
  virtual void seal(std::span<const std::uint8_t> plain, std::span<const std::uint8_t> aad,
                    std::span<std::uint8_t> out) const = 0;
  // Error(bad_descriptor) naming `what` when the tag does not verify.
  virtual void open(std::span<const std::uint8_t> stored, std::span<const std::uint8_t> aad,
                    std::span<std::uint8_t> plain, std::string_view what) const = 0;
};

struct ContextSegment {
  std::int32_t position_offset = 0;
  std::uint32_t blocks = 0;
};

struct ContextBlock {
  KvCodec k, v;
  std::uint32_t flags = 0;  // kBlockRotatedK / kBlockRotatedV / kBlockPreRopeK / kBlockRelativeK / kBlockWindowFreed
  std::int32_t key_position = 0;  // keys=pre/block blocks: where row 0's key was computed (BlockInfo); else 0
  std::uint32_t fill = 0;   // tokens stored in the block
  std::uint64_t checksum = 0;        // XXH3-64 of the canonical plaintext (filled by the writer)
  std::uint64_t payload_offset = 0;  // from the start of the bytes (filled by the writer)
};

// Everything but the block payloads.
struct ContextMeta {
  std::array<std::uint8_t, 16> model_fingerprint{};
  std::uint64_t tokenizer_fingerprint = 0;
  KvShape shape;
  int block_tokens = 0;
  KvFormat format;
  std::vector<std::int32_t> tokens;
  std::string text;
  std::vector<ContextSegment> segments;
  std::vector<ContextBlock> blocks;
  std::uint64_t key_id = 0;  // 0: payloads are plaintext
};

// Bytes of one block's canonical plaintext: every tile it stores, K first,
// layer-major (with flags bit 16, kBlockWindowFreed, the global layers alone).
std::size_t block_plain_bytes(const KvShape& shape, int block_tokens, const KvCodec& k, const KvCodec& v,
                              std::uint32_t flags = 0);
// Offset of tile (kind, layer, head) inside that plaintext; the layer must be stored.
std::size_t tile_offset(const KvShape& shape, int block_tokens, const KvCodec& k, const KvCodec& v, int kind,
                        int layer, int head, std::uint32_t flags = 0);

// Converts one tile between the pool's native byte order and the canonical
// (little-endian) one. Padding and rows past `fill` (float codecs) become
// zero, so the same context always exports to the same bytes.
void tile_to_canonical(const KvCodec& codec, int block_tokens, int head_dim, int fill, const std::byte* native,
                       std::uint8_t* canonical);
void tile_from_canonical(const KvCodec& codec, int block_tokens, int head_dim, const std::uint8_t* canonical,
                         std::byte* native);

// Writes `meta` and its blocks to `sink` in consecutive chunks. `block(i,
// out)` fills block i's canonical plaintext; it is called twice per block
// (checksums first, so the table can precede the payloads). With `cipher`,
// payloads are sealed. Returns the total bytes written.
using BlockSource = std::function<void(std::size_t index, std::span<std::uint8_t> plain)>;
std::uint64_t write_context(const ContextMeta& meta, const BlockSource& block, const ByteSink& sink,
                            const BlockCipher* cipher = nullptr);
// Convenience: the whole encoding in memory.
std::vector<std::uint8_t> encode_context(const ContextMeta& meta, const BlockSource& block,
                                         const BlockCipher* cipher = nullptr);

// A decoded context over bytes it does not own (a mapped file, a buffer).
// Construction validates the header and tables against the bytes' length
// (Error(bad_descriptor) naming `name` and the field); read_block verifies one
// block (authentication tag, then checksum) as it copies it out.
class ContextReader {
 public:
  ContextReader(std::span<const std::uint8_t> bytes, std::string name);
  const ContextMeta& meta() const noexcept { return meta_; }
  bool encrypted() const noexcept { return meta_.key_id != 0; }
  std::size_t plain_bytes(std::size_t block) const;
  // `cipher` must be given for an encrypted context (its key id must match).
  void read_block(std::size_t block, std::span<std::uint8_t> plain, const BlockCipher* cipher) const;
  // The stored (possibly sealed) bytes of a block, for the remote tier.
  std::span<const std::uint8_t> stored_block(std::size_t block) const;

 private:
  std::span<const std::uint8_t> bytes_;
  std::string name_;
  ContextMeta meta_;
};

}  // namespace qkvshare
