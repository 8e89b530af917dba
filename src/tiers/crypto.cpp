#include "qkvshare/tiers/crypto.hpp"

#include <fcntl.h>
#include <sodium.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"

namespace qkvshare {

namespace {

static_assert(crypto_aead_xchacha20poly1305_ietf_NPUBBYTES + crypto_aead_xchacha20poly1305_ietf_ABYTES ==
              kContextSealOverhead);
static_assert(crypto_aead_xchacha20poly1305_ietf_KEYBYTES == KeyCipher::kKeyBytes);

void init_sodium() {
  static const int rc = sodium_init();  // thread-safe, idempotent
  if (rc < 0) fail(ErrorCode::internal, "libsodium failed to initialise");
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

KeyCipher KeyCipher::from_file(const std::string& path) {
  check_input_file(path, "key file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::io, "{}: cannot open key file: {}", path, std::strerror(errno));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::array<std::uint8_t, kKeyBytes> key{};
  if (bytes.size() == kKeyBytes) {
    std::memcpy(key.data(), bytes.data(), kKeyBytes);
  } else {
    while (!bytes.empty() && (bytes.back() == '\n' || bytes.back() == '\r')) bytes.pop_back();
    if (bytes.size() != 2 * kKeyBytes)
      fail(ErrorCode::invalid_argument, "{}: a key file holds 32 raw bytes or 64 hex digits, not {} bytes", path,
           bytes.size());
    for (std::size_t i = 0; i < kKeyBytes; ++i) {
      const int hi = hex_value(bytes[2 * i]), lo = hex_value(bytes[2 * i + 1]);
      if (hi < 0 || lo < 0)
        fail(ErrorCode::invalid_argument, "{}: character {} of the key is not a hex digit", path,
             2 * i + (hi < 0 ? 1 : 2));
      key[i] = static_cast<std::uint8_t>(hi << 4 | lo);
    }
  }
  KeyCipher c(key);
  sodium_memzero(key.data(), key.size());
  return c;
}

void KeyCipher::generate_file(const std::string& path) {
  init_sodium();
  std::array<std::uint8_t, kKeyBytes> key{};
  randombytes_buf(key.data(), key.size());
  std::string hex;
  static constexpr char digits[] = "0123456789abcdef";
  for (std::uint8_t b : key) {
    hex += digits[b >> 4];
    hex += digits[b & 15];
  }
  hex += '\n';
  sodium_memzero(key.data(), key.size());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) fail(ErrorCode::io, "{}: cannot create key file: {}", path, std::strerror(errno));
  const ssize_t w = ::write(fd, hex.data(), hex.size());
  const int err = errno;
  ::close(fd);
  sodium_memzero(hex.data(), hex.size());
  if (w != static_cast<ssize_t>(hex.size())) fail(ErrorCode::io, "{}: cannot write key file: {}", path, std::strerror(err));
}

KeyCipher::KeyCipher(const std::array<std::uint8_t, kKeyBytes>& key) : key_(key) {
  init_sodium();
  // The id is a keyed hash of a constant: it names the key without revealing it.
  static constexpr char kLabel[] = "qkvshare key id v1";
  std::uint8_t id[8];
  crypto_generichash(id, sizeof id, reinterpret_cast<const std::uint8_t*>(kLabel), sizeof kLabel - 1, key_.data(),
                     key_.size());
  for (int i = 0; i < 8; ++i) key_id_ |= static_cast<std::uint64_t>(id[i]) << (8 * i);
  if (key_id_ == 0) key_id_ = 1;  // 0 means "not encrypted" in the format
}

KeyCipher::~KeyCipher() { sodium_memzero(key_.data(), key_.size()); }

void KeyCipher::seal(std::span<const std::uint8_t> plain, std::span<const std::uint8_t> aad,
                     std::span<std::uint8_t> out) const {
  constexpr std::size_t N = crypto_aead_xchacha20poly1305_ietf_NPUBBYTES;
  QKV_CHECK(out.size() == plain.size() + kContextSealOverhead);
  randombytes_buf(out.data(), N);
  unsigned long long len = 0;
  crypto_aead_xchacha20poly1305_ietf_encrypt(out.data() + N, &len, plain.data(), plain.size(), aad.data(), aad.size(),
                                             nullptr, out.data(), key_.data());
  QKV_CHECK(len + N == out.size());
}

void KeyCipher::open(std::span<const std::uint8_t> stored, std::span<const std::uint8_t> aad,
                     std::span<std::uint8_t> plain, std::string_view what) const {
  constexpr std::size_t N = crypto_aead_xchacha20poly1305_ietf_NPUBBYTES;
  QKV_CHECK(stored.size() == plain.size() + kContextSealOverhead);
  unsigned long long len = 0;
  if (crypto_aead_xchacha20poly1305_ietf_decrypt(plain.data(), &len, nullptr, stored.data() + N, stored.size() - N,
                                                 aad.data(), aad.size(), stored.data(), key_.data()) != 0) {
    sodium_memzero(plain.data(), plain.size());
    fail(ErrorCode::bad_descriptor, "{}: authentication failed: the block was tampered with or corrupted", what);
  }
  QKV_CHECK(len == plain.size());
}

}  // namespace qkvshare
