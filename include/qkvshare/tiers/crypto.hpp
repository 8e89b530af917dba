#pragma once
// Encryption of blocks that leave the pool (disk spill, remote tier):
// XChaCha20-Poly1305-IETF from libsodium, one 256-bit key per pool or tenant,
// read from a key file. A random 192-bit nonce per block makes nonce reuse
// negligible without any counter state shared between processes; the tag
// also authenticates the block's table entry (codecs, fill, checksum), so a
// tampered byte, a moved block and a wrong key are all refused before a
// single value is decoded.
#include <array>
#include <cstdint>
#include <string>

#include "qkvshare/tiers/context_file.hpp"

namespace qkvshare {

class KeyCipher final : public BlockCipher {
 public:
  static constexpr std::size_t kKeyBytes = 32;
  // A key file holds the 32 key bytes raw, or as 64 hex digits (an optional
  // trailing newline allowed). Error(invalid_argument) naming the file otherwise.
  static KeyCipher from_file(const std::string& path);
  // Writes a fresh random key (hex, mode 0600); refuses to overwrite.
  static void generate_file(const std::string& path);
  explicit KeyCipher(const std::array<std::uint8_t, kKeyBytes>& key);
  ~KeyCipher() override;
  KeyCipher(const KeyCipher&) = default;
  KeyCipher& operator=(const KeyCipher&) = default;

  std::uint64_t key_id() const noexcept override { return key_id_; }
  std::size_t overhead() const noexcept override { return kContextSealOverhead; }
  void seal(std::span<const std::uint8_t> plain, std::span<const std::uint8_t> aad,
            std::span<std::uint8_t> out) const override;
  void open(std::span<const std::uint8_t> stored, std::span<const std::uint8_t> aad, std::span<std::uint8_t> plain,
            std::string_view what) const override;

 private:
  std::array<std::uint8_t, kKeyBytes> key_{};
  std::uint64_t key_id_ = 0;
};

}  // namespace qkvshare
