#include "qkvshare/kv/kv_codebook.hpp"

#include <xxhash.h>

#include <cstring>
#include <fstream>
#include <map>
#include <mutex>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"

namespace qkvshare {

namespace {

constexpr char kMagic[8] = {'Q', 'K', 'V', 'S', 'P', 'Q', 'C', 'B'};
// Version 1 ends its header after the model fingerprint and checksum;
// version 2 adds a u32 of flags (bits 0-1: the keys' KeyRope); version 3
// uses its bits 8-15 for keys=block: 1 + log2 of the block size the key rows
// are relative to.
constexpr std::size_t kHeaderBytesV1 = 8 + 4 * 8 + 16 + 8;
constexpr std::size_t kHeaderBytes = kHeaderBytesV1 + 4;
constexpr std::uint32_t kFlagKeyRope = 3u;
constexpr std::uint32_t kFlagBlockShift = 8, kFlagBlockMask = 0xffu << kFlagBlockShift;

std::uint32_t block_flag(int block_tokens) {
  int e = 0;
  while ((1 << e) < block_tokens) ++e;
  return static_cast<std::uint32_t>(e + 1) << kFlagBlockShift;
}

void put_u32(std::string& s, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) s += static_cast<char>((v >> (8 * i)) & 0xffu);
}
void put_u64(std::string& s, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) s += static_cast<char>((v >> (8 * i)) & 0xffu);
}
std::uint64_t get_le(const unsigned char* p, int n) {
  std::uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

// The payload in file order, explicitly little-endian.
std::string payload_bytes(const float* tables, std::size_t n) {
  std::string s;
  s.reserve(n * 4);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, &tables[i], 4);
    put_u32(s, u);
  }
  return s;
}

std::string header_bytes(const KvCodebook::Header& h, std::uint64_t payload_hash) {
  std::string s(kMagic, sizeof kMagic);
  put_u32(s, KvCodebook::kVersion);
  for (int v : {h.n_layers, h.n_kv_heads, h.head_dim, h.sub, KvCodebook::kCentroids, h.calibration_tokens})
    put_u32(s, static_cast<std::uint32_t>(v));
  put_u32(s, h.seed);
  s.append(reinterpret_cast<const char*>(h.model.data()), h.model.size());
  put_u64(s, payload_hash);
  put_u32(s, static_cast<std::uint32_t>(h.keys) | (h.keys == KeyRope::block ? block_flag(h.block_tokens) : 0u));
  return s;
}

}  // namespace

KvCodebook::KvCodebook(const Header& h) : h_(h) {
  if (h.sub != 2 && h.sub != 4 && h.sub != 8)
    fail(ErrorCode::invalid_argument, "PQ codebook: sub-vectors of {} channels (expected 2, 4 or 8)", h.sub);
  if (h.n_layers <= 0 || h.n_kv_heads <= 0 || h.head_dim <= 0 || h.head_dim % h.sub != 0 || h.head_dim > 4096 ||
      h.n_layers > 4096 || h.n_kv_heads > 4096)
    fail(ErrorCode::invalid_argument, "PQ codebook: shape {} layers x {} KV heads x head_dim {} does not fit sub {}",
         h.n_layers, h.n_kv_heads, h.head_dim, h.sub);
  tables_.assign(2 * table_floats(), 0.0f);
  finish();
}

std::size_t KvCodebook::table_floats() const noexcept {
  return 2 * static_cast<std::size_t>(h_.n_layers) * static_cast<std::size_t>(h_.n_kv_heads) *
         static_cast<std::size_t>(h_.head_dim) * kCentroids;
}

float* KvCodebook::data(int kind, int layer, int head, int transposed) const noexcept {
  const std::size_t per_head = static_cast<std::size_t>(h_.head_dim) * kCentroids;
  const std::size_t i = ((static_cast<std::size_t>(kind) * h_.n_layers + static_cast<std::size_t>(layer)) * h_.n_kv_heads +
                         static_cast<std::size_t>(head)) * per_head;
  return const_cast<float*>(tables_.data()) + static_cast<std::size_t>(transposed) * table_floats() + i;
}

void KvCodebook::finish() {
  const int S = spaces(), sub = h_.sub;
  for (int kind = 0; kind < 2; ++kind)
    for (int l = 0; l < h_.n_layers; ++l)
      for (int h = 0; h < h_.n_kv_heads; ++h) {
        const float* a = data(kind, l, h, 0);
        float* t = data(kind, l, h, 1);
        for (int s = 0; s < S; ++s)
          for (int c = 0; c < kCentroids; ++c)
            for (int e = 0; e < sub; ++e)
              t[(static_cast<std::size_t>(s) * sub + e) * kCentroids + c] = a[(static_cast<std::size_t>(s) * kCentroids + c) * sub + e];
      }
  const std::string payload = payload_bytes(tables_.data(), table_floats());
  const std::string header = header_bytes(h_, XXH3_64bits(payload.data(), payload.size()));
  id_ = XXH3_64bits(header.data(), header.size());
}

void KvCodebook::save(const std::string& path) const {
  const std::string payload = payload_bytes(tables_.data(), table_floats());
  const std::string header = header_bytes(h_, XXH3_64bits(payload.data(), payload.size()));
  try {
    write_file_atomic(path, [&](const ByteSink& sink) {
      sink(std::span(reinterpret_cast<const std::uint8_t*>(header.data()), header.size()));
      sink(std::span(reinterpret_cast<const std::uint8_t*>(payload.data()), payload.size()));
    });
  } catch (const Error& e) {
    fail(ErrorCode::io, "PQ codebook: {}", e.what());
  }
}

KvCodebook KvCodebook::load(const std::string& path) {
  check_input_file(path, "PQ codebook");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::io, "PQ codebook '{}': cannot open", path);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  KvCodebook book = parse(bytes, path);
  book.path_ = path;
  return book;
}

KvCodebook KvCodebook::parse(std::string_view bytes, const std::string& path) {
  const auto bad = [&](std::string_view why) -> void {
    fail(ErrorCode::invalid_argument, "PQ codebook '{}': {}", path, why);
  };
  if (bytes.size() < kHeaderBytesV1) bad(fmt::format("truncated header ({} bytes)", bytes.size()));
  if (std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) bad("not a codebook file (bad magic)");
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data()) + 8;
  const auto u32 = [&](int i) { return static_cast<std::uint32_t>(get_le(p + 4 * i, 4)); };
  if (u32(0) < 1 || u32(0) > kVersion) bad(fmt::format("version {} (this build reads 1 to {})", u32(0), kVersion));
  const std::size_t header_bytes = u32(0) == 1 ? kHeaderBytesV1 : kHeaderBytes;
  if (bytes.size() < header_bytes) bad(fmt::format("truncated header ({} bytes)", bytes.size()));
  const std::uint32_t flags = u32(0) == 1 ? 0u : static_cast<std::uint32_t>(get_le(p + 56, 4));
  const std::uint32_t known = kFlagKeyRope | (u32(0) >= 3 ? kFlagBlockMask : 0u);
  if ((flags & ~known) != 0 || (flags & kFlagKeyRope) == kFlagKeyRope) bad(fmt::format("unknown flags 0x{:x}", flags));
  const KeyRope keys = static_cast<KeyRope>(flags & kFlagKeyRope);
  const std::uint32_t block_exp = (flags & kFlagBlockMask) >> kFlagBlockShift;  // 0: not recorded
  if (block_exp > 13 || (block_exp != 0) != (keys == KeyRope::block && u32(0) >= 3))
    bad(fmt::format("flags 0x{:x}: a block size is recorded exactly for keys=block codebooks, 1 to 4096 tokens", flags));
  if (u32(5) != kCentroids) bad(fmt::format("{} centroids (expected {})", u32(5), kCentroids));
  Header h;
  h.n_layers = static_cast<int>(u32(1));
  h.n_kv_heads = static_cast<int>(u32(2));
  h.head_dim = static_cast<int>(u32(3));
  h.sub = static_cast<int>(u32(4));
  h.calibration_tokens = static_cast<int>(u32(6));
  h.seed = u32(7);
  h.keys = keys;
  h.block_tokens = block_exp == 0 ? 0 : 1 << (block_exp - 1);
  std::memcpy(h.model.data(), p + 32, 16);
  const std::uint64_t want = get_le(p + 48, 8);
  // The payload's size before anything is allocated for the tables.
  const std::uint64_t L = u32(1), H = u32(2), D = u32(3);
  if (L == 0 || H == 0 || D == 0 || L > 4096 || H > 4096 || D > 4096)
    bad(fmt::format("shape {} layers x {} KV heads x head_dim {} out of range", L, H, D));
  const std::uint64_t floats = 2 * L * H * D * kCentroids;
  if (bytes.size() - header_bytes != 4 * floats)
    bad(fmt::format("{} payload bytes where the header says {}", bytes.size() - header_bytes, 4 * floats));
  KvCodebook book = [&] {
    try {
      return KvCodebook(h);
    } catch (const Error& e) {
      fail(ErrorCode::invalid_argument, "PQ codebook '{}': {}", path, e.what());
    }
  }();
  const std::size_t n = book.table_floats();
  const char* payload = bytes.data() + header_bytes;
  if (XXH3_64bits(payload, 4 * n) != want) bad("checksum mismatch (the tables are corrupt)");
  for (std::size_t i = 0; i < n; ++i) {
    const auto u = static_cast<std::uint32_t>(get_le(reinterpret_cast<const unsigned char*>(payload) + 4 * i, 4));
    std::memcpy(&book.tables_[i], &u, 4);
  }
  book.finish();
  return book;
}

namespace {
struct Loaded {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<const KvCodebook>> by_path;
};
Loaded& loaded() {
  static Loaded l;
  return l;
}
}  // namespace

std::shared_ptr<const KvCodebook> KvCodebook::shared(const std::string& path) {
  Loaded& l = loaded();
  const std::lock_guard lock(l.mu);
  if (const auto it = l.by_path.find(path); it != l.by_path.end()) return it->second;
  auto book = std::make_shared<const KvCodebook>(load(path));  // a bad file throws before anything is kept
  l.by_path.emplace(path, book);
  return book;
}

std::shared_ptr<const KvCodebook> KvCodebook::find(std::uint64_t id) {
  Loaded& l = loaded();
  const std::lock_guard lock(l.mu);
  for (const auto& [path, book] : l.by_path)
    if (book->id() == id) return book;
  return nullptr;
}

}  // namespace qkvshare
