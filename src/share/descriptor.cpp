#include "qkvshare/share/descriptor.hpp"

#include "qkvshare/kv/kv_codebook.hpp"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"
#include "qkvshare/share/hmac_sha256.hpp"

namespace qkvshare {

namespace {

// Byte offsets of the layout (docs/handoff.md). Integers are little endian.
constexpr char kMagic[8] = {'Q', 'K', 'V', 'D', 'E', 'S', 'C', '\0'};
enum Offset : std::size_t {
  kOffMagic = 0, kOffVersion = 8, kOffSize = 10, kOffFlags = 12,
  kOffPoolId = 16, kOffContextId = 24,
  kOffRecordSlot = 32, kOffRecordGen = 36, kOffGrantSlot = 40, kOffGrantGen = 44,
  kOffTokens = 48, kOffPosBegin = 52, kOffPosEnd = 56, kOffBlockTokens = 60, kOffBlockCount = 64,
  kOffKCodec = 68, kOffVCodec = 72, kOffWindow = 76, kOffSink = 80, kOffFormatFlags = 84,
  kOffModelFp = 88, kOffTokenizerFp = 104,
  kOffBlocksSum = 112, kOffTableSum = 120, kOffTokensSum = 128, kOffCreated = 136,
  kOffProducer = 144, kOffGrantee = 176, kOffCapability = 208,
  kOffLoKCodec = 224, kOffLoVCodec = 228, kOffTop = 232, kOffCodebook = 236, kOffReserved = 244, kOffSelfSum = 248,
};
static_assert(kOffCapability == kCapabilityOffset && kOffSelfSum + 8 == kDescriptorBytes);
constexpr std::uint32_t kMaxTokens = 1u << 24;

void put_u16(DescriptorBytes& b, std::size_t at, std::uint16_t v) {
  for (int i = 0; i < 2; ++i) b[at + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(v >> (8 * i));
}
void put_u32(DescriptorBytes& b, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(v >> (8 * i));
}
void put_u64(DescriptorBytes& b, std::size_t at, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) b[at + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(v >> (8 * i));
}
std::uint64_t get(std::span<const std::uint8_t> b, std::size_t at, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<std::uint64_t>(b[at + static_cast<std::size_t>(i)]) << (8 * i);
  return v;
}
std::uint32_t get_u32(std::span<const std::uint8_t> b, std::size_t at) { return static_cast<std::uint32_t>(get(b, at, 4)); }

void put_id(DescriptorBytes& b, std::size_t at, const std::string& id) {
  QKV_CHECK(id.size() <= kAgentIdBytes);
  std::memcpy(&b[at], id.data(), id.size());
}

bool id_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
         c == ':' || c == '@' || c == '-';
}

std::string get_id(std::span<const std::uint8_t> b, std::size_t at, std::string_view source, const char* what) {
  std::size_t n = 0;
  while (n < kAgentIdBytes && b[at + n] != 0) ++n;
  for (std::size_t i = n; i < kAgentIdBytes; ++i)
    if (b[at + i] != 0) fail(ErrorCode::bad_descriptor, "{}: {} id is not NUL-padded", source, what);
  std::string id(reinterpret_cast<const char*>(&b[at]), n);
  if (id.empty()) fail(ErrorCode::bad_descriptor, "{}: {} id is empty", source, what);
  for (char c : id)
    if (!id_char(c)) fail(ErrorCode::bad_descriptor, "{}: {} id has a character outside [A-Za-z0-9_.:@-]", source, what);
  return id;
}

std::string hex(std::span<const std::uint8_t> bytes) {
  std::string s;
  for (std::uint8_t b : bytes) s += fmt::format("{:02x}", b);
  return s;
}

}  // namespace

void validate_agent_id(std::string_view id, std::string_view what) {
  if (id.empty() || id.size() > kAgentIdBytes)
    fail(ErrorCode::invalid_argument, "{}: agent id '{}' must have 1 to {} characters", what, id, kAgentIdBytes);
  for (char c : id)
    if (!id_char(c))
      fail(ErrorCode::invalid_argument, "{}: agent id '{}' may only use letters, digits and _ . : @ -", what, id);
}

std::optional<KvFormat> Descriptor::format() const {
  // Bits 2-3 hold a KeyRope (0 to 2); bit 4 tail=cold.
  if ((format_flags & ~0x1fu) != 0 || ((format_flags >> 2) & 3u) == 3u) return std::nullopt;
  KvFormat f;
  try {
    f.k = KvCodec::unpack(k_codec);
    f.v = KvCodec::unpack(v_codec);
  } catch (const Error&) {
    return std::nullopt;
  }
  f.window = static_cast<int>(window);
  f.sink = static_cast<int>(sink);
  f.rotate_k = (format_flags & 1u) != 0;
  f.rotate_v = (format_flags & 2u) != 0;
  f.key_rope = static_cast<KeyRope>((format_flags >> 2) & 3u);
  f.cold_tail = (format_flags & 16u) != 0;
  if (f.key_rope != KeyRope::post && f.rotate_k) return std::nullopt;
  if (f.cold_tail && (f.window > 0 || (!f.k.quantized() && !f.v.quantized()))) return std::nullopt;
  if (top_millionths != 0) {
    try {
      f.lo_k = KvCodec::unpack(lo_k_codec);
      f.lo_v = KvCodec::unpack(lo_v_codec);
    } catch (const Error&) {
      return std::nullopt;
    }
    if (!f.lo_k.quantized() || !f.lo_v.quantized()) return std::nullopt;
    f.top = static_cast<double>(top_millionths) / 1e6;
  }
  if (f.uses_pq() != (codebook_id != 0)) return std::nullopt;
  if (f.uses_pq()) {
    f.book = KvCodebook::find(codebook_id);
    if (f.book) f.book_path = f.book->path();
  }
  return f;
}

void Descriptor::set_format(const KvFormat& f) {
  k_codec = f.k.pack();
  v_codec = f.v.pack();
  window = static_cast<std::uint32_t>(f.window);
  sink = static_cast<std::uint32_t>(f.sink);
  format_flags = (f.rotate_k ? 1u : 0u) | (f.rotate_v ? 2u : 0u) | (static_cast<std::uint32_t>(f.key_rope) << 2) |
                 (f.cold_tail ? 16u : 0u);
  lo_k_codec = f.mixed() ? f.lo_k.pack() : 0;
  lo_v_codec = f.mixed() ? f.lo_v.pack() : 0;
  top_millionths = f.mixed() ? static_cast<std::uint32_t>(std::clamp(std::lround(f.top * 1e6), 1L, 999999L)) : 0;
  codebook_id = f.uses_pq() && f.book ? f.book->id() : 0;
}

DescriptorBytes Descriptor::encode() const {
  DescriptorBytes b{};
  std::memcpy(&b[kOffMagic], kMagic, sizeof kMagic);
  put_u16(b, kOffVersion, kDescriptorVersion);
  put_u16(b, kOffSize, static_cast<std::uint16_t>(kDescriptorBytes));
  put_u64(b, kOffPoolId, pool_id);
  put_u64(b, kOffContextId, context_id);
  put_u32(b, kOffRecordSlot, record_slot);
  put_u32(b, kOffRecordGen, record_generation);
  put_u32(b, kOffGrantSlot, grant_slot);
  put_u32(b, kOffGrantGen, grant_generation);
  put_u32(b, kOffTokens, token_count);
  put_u32(b, kOffPosBegin, position_begin);
  put_u32(b, kOffPosEnd, position_end);
  put_u32(b, kOffBlockTokens, block_tokens);
  put_u32(b, kOffBlockCount, block_count);
  put_u32(b, kOffKCodec, k_codec);
  put_u32(b, kOffVCodec, v_codec);
  put_u32(b, kOffWindow, window);
  put_u32(b, kOffSink, sink);
  put_u32(b, kOffFormatFlags, format_flags);
  std::memcpy(&b[kOffModelFp], fingerprint.model.data(), fingerprint.model.size());
  put_u64(b, kOffTokenizerFp, fingerprint.tokenizer);
  put_u64(b, kOffBlocksSum, blocks_checksum);
  put_u64(b, kOffTableSum, table_checksum);
  put_u64(b, kOffTokensSum, tokens_checksum);
  put_u64(b, kOffCreated, created_unix_ns);
  put_id(b, kOffProducer, producer);
  put_id(b, kOffGrantee, grantee);
  std::memcpy(&b[kOffCapability], capability.data(), capability.size());
  put_u32(b, kOffLoKCodec, lo_k_codec);
  put_u32(b, kOffLoVCodec, lo_v_codec);
  put_u32(b, kOffTop, top_millionths);
  put_u64(b, kOffCodebook, codebook_id);
  put_u64(b, kOffSelfSum, XXH3_64bits(b.data(), kOffSelfSum));
  return b;
}

Descriptor Descriptor::decode(std::span<const std::uint8_t> b, std::string_view source) {
  if (b.size() < kDescriptorBytes)
    fail(ErrorCode::bad_descriptor, "{}: truncated: {} bytes, a descriptor has {}", source, b.size(), kDescriptorBytes);
  if (std::memcmp(b.data(), kMagic, sizeof kMagic) != 0)
    fail(ErrorCode::bad_descriptor, "{}: bad magic: not a QKVShare context descriptor", source);
  if (const auto version = get(b, kOffVersion, 2); version != kDescriptorVersion)
    fail(ErrorCode::bad_descriptor, "{}: descriptor version {} is not supported (this build reads version {})", source,
         version, kDescriptorVersion);
  if (const auto size = get(b, kOffSize, 2); size != kDescriptorBytes || b.size() != kDescriptorBytes)
    fail(ErrorCode::bad_descriptor, "{}: size field {} with {} bytes given; version 1 descriptors have exactly {}",
         source, size, b.size(), kDescriptorBytes);
  if (get(b, kOffSelfSum, 8) != XXH3_64bits(b.data(), kOffSelfSum))
    fail(ErrorCode::bad_descriptor, "{}: self checksum mismatch: the descriptor was corrupted or edited", source);
  if (get_u32(b, kOffFlags) != 0) fail(ErrorCode::bad_descriptor, "{}: unknown flags {:#x}", source, get_u32(b, kOffFlags));
  for (std::size_t i = kOffReserved; i < kOffSelfSum; ++i)
    if (b[i] != 0) fail(ErrorCode::bad_descriptor, "{}: reserved byte {} is not zero", source, i);

  Descriptor d;
  d.pool_id = get(b, kOffPoolId, 8);
  d.context_id = get(b, kOffContextId, 8);
  d.record_slot = get_u32(b, kOffRecordSlot);
  d.record_generation = get_u32(b, kOffRecordGen);
  d.grant_slot = get_u32(b, kOffGrantSlot);
  d.grant_generation = get_u32(b, kOffGrantGen);
  d.token_count = get_u32(b, kOffTokens);
  d.position_begin = get_u32(b, kOffPosBegin);
  d.position_end = get_u32(b, kOffPosEnd);
  d.block_tokens = get_u32(b, kOffBlockTokens);
  d.block_count = get_u32(b, kOffBlockCount);
  d.k_codec = get_u32(b, kOffKCodec);
  d.v_codec = get_u32(b, kOffVCodec);
  d.window = get_u32(b, kOffWindow);
  d.sink = get_u32(b, kOffSink);
  d.format_flags = get_u32(b, kOffFormatFlags);
  std::memcpy(d.fingerprint.model.data(), &b[kOffModelFp], d.fingerprint.model.size());
  d.fingerprint.tokenizer = get(b, kOffTokenizerFp, 8);
  d.blocks_checksum = get(b, kOffBlocksSum, 8);
  d.table_checksum = get(b, kOffTableSum, 8);
  d.tokens_checksum = get(b, kOffTokensSum, 8);
  d.created_unix_ns = get(b, kOffCreated, 8);
  d.producer = get_id(b, kOffProducer, source, "producer");
  d.grantee = get_id(b, kOffGrantee, source, "grantee");
  std::memcpy(d.capability.data(), &b[kOffCapability], d.capability.size());
  d.lo_k_codec = get_u32(b, kOffLoKCodec);
  d.lo_v_codec = get_u32(b, kOffLoVCodec);
  d.top_millionths = get_u32(b, kOffTop);
  d.codebook_id = get(b, kOffCodebook, 8);
  if (d.top_millionths > 999999 || (d.top_millionths == 0 && (d.lo_k_codec != 0 || d.lo_v_codec != 0)))
    fail(ErrorCode::bad_descriptor, "{}: mixed-precision share {} (millionths) with low codecs {:#x}/{:#x} is not valid",
         source, d.top_millionths, d.lo_k_codec, d.lo_v_codec);

  if (d.token_count == 0 || d.token_count > kMaxTokens)
    fail(ErrorCode::bad_descriptor, "{}: token count {} is outside [1, {}]", source, d.token_count, kMaxTokens);
  // More positions than tokens when tokens were dropped with their neighbours' positions kept.
  if (d.position_end < d.position_begin || d.position_end - d.position_begin < d.token_count ||
      d.position_end - d.position_begin > kMaxTokens)
    fail(ErrorCode::bad_descriptor, "{}: position range [{}, {}) cannot hold {} tokens", source, d.position_begin,
         d.position_end, d.token_count);
  if (d.block_tokens == 0 || d.block_tokens > 4096 || (d.block_tokens & (d.block_tokens - 1)) != 0)
    fail(ErrorCode::bad_descriptor, "{}: block size {} is not a power of two in [1, 4096]", source, d.block_tokens);
  // Whole blocks, plus up to two partly used ones per segment of a spliced context.
  const std::uint32_t least = (d.token_count + d.block_tokens - 1) / d.block_tokens;
  if (d.block_count < least || d.block_count > least + 2 * kMaxContextSegments)
    fail(ErrorCode::bad_descriptor, "{}: {} blocks cannot hold {} tokens of {} per block in at most {} segments", source,
         d.block_count, d.token_count, d.block_tokens, kMaxContextSegments);
  if (d.window > kMaxTokens || d.sink > kMaxTokens)
    fail(ErrorCode::bad_descriptor, "{}: window {} / sink {} out of range", source, d.window, d.sink);
  return d;
}

std::string Descriptor::json() const {
  nlohmann::json j;
  j["version"] = kDescriptorVersion;
  j["pool_id"] = fmt::format("{:016x}", pool_id);
  j["context_id"] = context_id;
  j["record"] = {{"slot", record_slot}, {"generation", record_generation}};
  j["grant"] = {{"slot", grant_slot}, {"generation", grant_generation}};
  j["token_count"] = token_count;
  j["positions"] = {position_begin, position_end};
  j["block_tokens"] = block_tokens;
  j["block_count"] = block_count;
  const auto f = format();
  j["kv_format"] = f ? nlohmann::json(f->to_string()) : nlohmann::json(nullptr);
  j["kv_codecs"] = {{"k", fmt::format("{:#010x}", k_codec)}, {"v", fmt::format("{:#010x}", v_codec)}};
  if (top_millionths != 0)
    j["mixed"] = {{"lo_k", fmt::format("{:#010x}", lo_k_codec)}, {"lo_v", fmt::format("{:#010x}", lo_v_codec)},
                  {"top", static_cast<double>(top_millionths) / 1e6}};
  if (codebook_id != 0) j["codebook"] = fmt::format("{:016x}", codebook_id);
  j["model_fingerprint"] = fingerprint.hex();
  j["tokenizer_fingerprint"] = fmt::format("{:016x}", fingerprint.tokenizer);
  j["checksums"] = {{"blocks", fmt::format("{:016x}", blocks_checksum)},
                    {"table", fmt::format("{:016x}", table_checksum)},
                    {"tokens", fmt::format("{:016x}", tokens_checksum)}};
  j["created_unix_ns"] = created_unix_ns;
  j["producer"] = producer;
  j["grantee"] = grantee;
  j["capability"] = hex(capability);
  return j.dump(2);
}

std::array<std::uint8_t, kCapabilityBytes> capability_tag(std::span<const std::uint8_t> secret,
                                                          const DescriptorBytes& encoded) {
  const auto mac = share_detail::hmac_sha256(secret, std::span<const std::uint8_t>(encoded.data(), kCapabilityOffset));
  std::array<std::uint8_t, kCapabilityBytes> tag;
  std::memcpy(tag.data(), mac.data(), tag.size());
  return tag;
}

Descriptor read_descriptor_file(const std::string& path) {
  check_input_file(path, "descriptor file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::io, "{}: cannot open descriptor file", path);
  // One byte more than a descriptor is enough to tell "too long" apart.
  std::vector<std::uint8_t> bytes(kDescriptorBytes + 1);
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  bytes.resize(static_cast<std::size_t>(in.gcount()));
  if (in.bad()) fail(ErrorCode::io, "{}: read error", path);
  return Descriptor::decode(bytes, path);
}

void write_descriptor_file(const std::string& path, const Descriptor& d) {
  const DescriptorBytes b = d.encode();
  write_file_atomic(path, std::span<const std::uint8_t>(b.data(), b.size()));  // a reader never sees half of one
}

}  // namespace qkvshare
