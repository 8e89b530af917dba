// The portable context format: explicit little-endian writer and a reader
// that validates every field against the bytes it was given. docs/tiers.md
// has the layout table; the offsets below are the same.
#include "qkvshare/tiers/context_file.hpp"

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"
#include "le_bytes.hpp"

namespace qkvshare {

namespace {

constexpr char kMagic[8] = {'Q', 'K', 'V', 'C', 'T', 'X', '\0', '\0'};
constexpr std::uint32_t kFlagEncrypted = 1u;
constexpr std::size_t kSegmentEntry = 8, kBlockEntryV1 = 32, kBlockEntry = 40;
// Keys not stored as rotated (KeyRope << 2): bits 2-3 of the format flags and of a block's flags
// alike (kBlockPreRopeK, kBlockRelativeK in kv_pool.hpp, which this reader does not depend on).
constexpr std::uint32_t kFormatKeyRope = 12u;
// A block of the global layers' tiles alone (kBlockWindowFreed in kv_pool.hpp; version 3 files).
constexpr std::uint32_t kBlockGlobalLayersOnly = 16u;
constexpr std::uint32_t kMaxTokens = 1u << 24, kMaxLayers = 1024, kMaxHeads = 1024, kMaxHeadDim = 4096;
constexpr bool kLittleHost = std::endian::native == std::endian::little;

std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

std::uint32_t get32(const std::uint8_t* p) { return static_cast<std::uint32_t>(le::get(p, 4)); }
std::uint64_t get64(const std::uint8_t* p) { return le::get(p, 8); }

template <typename T>
T byteswap_if_big(T v) {
  if constexpr (kLittleHost) return v;
  T r{};
  auto* s = reinterpret_cast<const std::uint8_t*>(&v);
  auto* d = reinterpret_cast<std::uint8_t*>(&r);
  for (std::size_t i = 0; i < sizeof(T); ++i) d[i] = s[sizeof(T) - 1 - i];
  return r;
}

// Copies `count` elements of sizeof(T) between native and little-endian order.
template <typename T>
void copy_elements(const void* src, void* dst, std::size_t count) {
  if constexpr (kLittleHost) {
    std::memcpy(dst, src, count * sizeof(T));
  } else {
    for (std::size_t i = 0; i < count; ++i) {
      T v;
      std::memcpy(&v, static_cast<const std::uint8_t*>(src) + i * sizeof(T), sizeof(T));
      v = byteswap_if_big(v);
      std::memcpy(static_cast<std::uint8_t*>(dst) + i * sizeof(T), &v, sizeof(T));
    }
  }
}

// Moves one tile: rows (f32 / f16 elements, or byte codes), then the
// (scale, min) parameters (f16, or a grid and bytes) and the outliers' u16 indices and f16 residuals;
// everything else is zero.
void convert_tile(const KvCodec& c, int block_tokens, int head_dim, int rows, const void* src, void* dst) {
  const TileLayout l = tile_layout(c, block_tokens, head_dim);
  std::memset(dst, 0, l.bytes);
  const auto r = static_cast<std::size_t>(rows);
  switch (c.type) {
    case KvType::f32: copy_elements<std::uint32_t>(src, dst, r * l.row_bytes / 4); break;
    case KvType::f16: copy_elements<std::uint16_t>(src, dst, r * l.row_bytes / 2); break;
    default: std::memcpy(dst, src, l.code_bytes); break;  // codes are stored byte by byte (kv_kernels.cpp)
  }
  if (c.quantized()) {
    const auto* s = static_cast<const std::uint8_t*>(src) + l.param_offset;
    auto* d = static_cast<std::uint8_t*>(dst) + l.param_offset;
    if (l.byte_params) {  // the grid (f32 min_lo, f32 min_step, i16 exponent), then byte scales and mins
      copy_elements<std::uint32_t>(s, d, 2);
      copy_elements<std::uint16_t>(s + 8, d + 8, 1);
      std::memcpy(d + kernels::kByteParamHeader, s + kernels::kByteParamHeader, l.n_params);
      std::memcpy(d + kernels::kByteParamHeader + l.param_stride, s + kernels::kByteParamHeader + l.param_stride,
                  l.n_params);
    } else {
      copy_elements<std::uint16_t>(s, d, l.n_params);                                         // scales
      copy_elements<std::uint16_t>(s + l.param_stride * 2, d + l.param_stride * 2, l.n_params);  // mins
    }
    copy_elements<std::uint16_t>(static_cast<const std::uint8_t*>(src) + l.outlier_offset,
                                 static_cast<std::uint8_t*>(dst) + l.outlier_offset, 2 * l.n_outliers);  // outliers
  }
}

std::size_t tile_bytes(const KvCodec& c, int block_tokens, int head_dim) {
  return tile_layout(c, block_tokens, head_dim).bytes;
}

std::uint32_t format_flags(const KvFormat& f) {
  return (f.rotate_k ? 1u : 0u) | (f.rotate_v ? 2u : 0u) | (static_cast<std::uint32_t>(f.key_rope) << 2);
}

// The bytes a block's tag also authenticates: its table entry, so a sealed
// payload cannot be moved to another block of other codecs or fill. The same
// block content has the same aad in every context (content addressing); a
// block of keys stored before RoPE also names where they were computed.
std::vector<std::uint8_t> block_aad(const ContextBlock& b) {
  std::vector<std::uint8_t> v;
  le::put(v, b.k.pack(), 4);
  le::put(v, b.v.pack(), 4);
  le::put(v, b.flags, 4);
  le::put(v, b.fill, 4);
  le::put(v, b.checksum, 8);
  if ((b.flags & kFormatKeyRope) != 0) le::put(v, static_cast<std::uint32_t>(b.key_position), 4);
  return v;
}

struct Sections {
  std::size_t tokens = kContextHeaderBytes, text = 0, segments = 0, blocks = 0, windows = 0, meta_sum = 0, payload = 0;
};

// `windows`: layers in the windows table (version 3), else 0.
Sections sections_for(std::size_t tokens, std::size_t text, std::size_t segments, std::size_t blocks,
                      std::size_t windows, std::size_t block_entry = kBlockEntry) {
  Sections s;
  s.text = s.tokens + 4 * tokens;
  s.segments = round_up(s.text + text, 8);
  s.blocks = s.segments + kSegmentEntry * segments;
  s.windows = s.blocks + block_entry * blocks;
  s.meta_sum = s.windows + 4 * windows;
  s.payload = round_up(s.meta_sum + 8, kContextPayloadAlign);
  return s;
}

bool global_only(std::uint32_t flags) { return (flags & kBlockGlobalLayersOnly) != 0; }

}  // namespace

std::size_t block_plain_bytes(const KvShape& s, int block_tokens, const KvCodec& k, const KvCodec& v,
                              std::uint32_t flags) {
  const auto tiles = static_cast<std::size_t>(s.stored_layers(global_only(flags))) * static_cast<std::size_t>(s.n_kv_heads);
  return tiles * (tile_bytes(k, block_tokens, s.head_dim) + tile_bytes(v, block_tokens, s.head_dim));
}

std::size_t tile_offset(const KvShape& s, int block_tokens, const KvCodec& k, const KvCodec& v, int kind, int layer,
                        int head, std::uint32_t flags) {
  const int stored = s.stored_index(layer, global_only(flags));
  QKV_CHECK(stored >= 0);
  const auto tiles = static_cast<std::size_t>(s.stored_layers(global_only(flags))) * static_cast<std::size_t>(s.n_kv_heads);
  const std::size_t kb = tile_bytes(k, block_tokens, s.head_dim), vb = tile_bytes(v, block_tokens, s.head_dim);
  const std::size_t i = static_cast<std::size_t>(stored) * static_cast<std::size_t>(s.n_kv_heads) +
                        static_cast<std::size_t>(head);
  return kind == 0 ? i * kb : tiles * kb + i * vb;
}

void tile_to_canonical(const KvCodec& codec, int block_tokens, int head_dim, int fill, const std::byte* native,
                       std::uint8_t* canonical) {
  const int rows = codec.quantized() ? block_tokens : (fill < 0 ? 0 : fill > block_tokens ? block_tokens : fill);
  convert_tile(codec, block_tokens, head_dim, rows, native, canonical);
}

void tile_from_canonical(const KvCodec& codec, int block_tokens, int head_dim, const std::uint8_t* canonical,
                         std::byte* native) {
  convert_tile(codec, block_tokens, head_dim, block_tokens, canonical, native);
}

std::uint64_t write_context(const ContextMeta& m, const BlockSource& block, const ByteSink& sink,
                            const BlockCipher* cipher) {
  std::size_t seg_blocks = 0;
  for (const ContextSegment& s : m.segments) seg_blocks += s.blocks;
  QKV_CHECK(seg_blocks == m.blocks.size());
  if (m.format.uses_pq())
    fail(ErrorCode::unsupported, "export: KV format {}: context files do not name pq codebooks yet; export an integer "
         "format", m.format.to_string());
  const std::size_t n = m.blocks.size();
  // Version 3 names the layers' sliding windows (and may hold blocks of the global layers alone); a
  // model without windows still writes version 2, byte for byte as before.
  const std::size_t windows = m.shape.layer_window.empty() ? 0 : m.shape.layer_window.size();
  QKV_CHECK(windows == 0 || static_cast<int>(windows) == m.shape.n_layers);
  for (const ContextBlock& b : m.blocks) QKV_CHECK(!global_only(b.flags) || windows > 0);
  const Sections sec = sections_for(m.tokens.size(), m.text.size(), m.segments.size(), n, windows);

  // Pass 1: checksums and payload offsets.
  std::vector<ContextBlock> table = m.blocks;
  std::vector<std::uint8_t> plain;
  std::uint64_t offset = sec.payload;
  if (cipher != nullptr && cipher->overhead() != kContextSealOverhead)
    fail(ErrorCode::internal, "export: a cipher adding {} bytes per block, the format fixes {}", cipher->overhead(),
         kContextSealOverhead);
  for (std::size_t i = 0; i < n; ++i) {
    plain.assign(block_plain_bytes(m.shape, m.block_tokens, table[i].k, table[i].v, table[i].flags), 0);
    block(i, plain);
    table[i].checksum = XXH3_64bits(plain.data(), plain.size());
    table[i].payload_offset = offset;
    offset = round_up(offset + plain.size() + (cipher ? cipher->overhead() : 0), kContextPayloadAlign);
  }
  const std::uint64_t total = offset;

  std::vector<std::uint8_t> h;
  h.insert(h.end(), kMagic, kMagic + 8);
  le::put(h, windows > 0 ? kContextFileVersion : std::uint16_t{2}, 2);
  le::put(h, kContextHeaderBytes, 2);
  le::put(h, cipher ? kFlagEncrypted : 0u, 4);
  h.insert(h.end(), m.model_fingerprint.begin(), m.model_fingerprint.end());
  le::put(h, m.tokenizer_fingerprint, 8);
  le::put(h, static_cast<std::uint32_t>(m.shape.n_layers), 4);
  le::put(h, static_cast<std::uint32_t>(m.shape.n_heads), 4);
  le::put(h, static_cast<std::uint32_t>(m.shape.n_kv_heads), 4);
  le::put(h, static_cast<std::uint32_t>(m.shape.head_dim), 4);
  le::put(h, static_cast<std::uint32_t>(m.block_tokens), 4);
  le::put(h, m.format.k.pack(), 4);
  le::put(h, m.format.v.pack(), 4);
  le::put(h, static_cast<std::uint32_t>(m.format.window), 4);
  le::put(h, static_cast<std::uint32_t>(m.format.sink), 4);
  le::put(h, format_flags(m.format), 4);
  le::put(h, m.tokens.size(), 4);
  le::put(h, m.text.size(), 4);
  le::put(h, m.segments.size(), 4);
  le::put(h, n, 4);
  le::put(h, cipher ? cipher->key_id() : 0u, 8);
  le::put(h, sec.payload, 8);
  le::put(h, total, 8);
  QKV_CHECK(h.size() == kContextHeaderBytes - 8);
  le::put(h, XXH3_64bits(h.data(), h.size()), 8);

  std::vector<std::uint8_t> meta;
  for (std::int32_t t : m.tokens) le::put(meta, static_cast<std::uint32_t>(t), 4);
  meta.insert(meta.end(), m.text.begin(), m.text.end());
  meta.resize(sec.segments - kContextHeaderBytes, 0);
  for (const ContextSegment& s : m.segments) {
    le::put(meta, static_cast<std::uint32_t>(s.position_offset), 4);
    le::put(meta, s.blocks, 4);
  }
  for (const ContextBlock& b : table) {
    le::put(meta, b.k.pack(), 4);
    le::put(meta, b.v.pack(), 4);
    le::put(meta, b.flags, 4);
    le::put(meta, b.fill, 4);
    le::put(meta, b.payload_offset, 8);
    le::put(meta, b.checksum, 8);
    le::put(meta, static_cast<std::uint32_t>((b.flags & kFormatKeyRope) != 0 ? b.key_position : 0), 4);
    le::put(meta, 0u, 4);
  }
  for (std::size_t l = 0; l < windows; ++l) le::put(meta, static_cast<std::uint32_t>(m.shape.layer_window[l]), 4);
  le::put(meta, XXH3_64bits(meta.data(), meta.size()), 8);
  meta.resize(sec.payload - kContextHeaderBytes, 0);
  sink(h);
  sink(meta);

  // Pass 2: payloads.
  std::vector<std::uint8_t> stored;
  std::uint64_t at = sec.payload;
  for (std::size_t i = 0; i < n; ++i) {
    plain.assign(block_plain_bytes(m.shape, m.block_tokens, table[i].k, table[i].v, table[i].flags), 0);
    block(i, plain);
    if (XXH3_64bits(plain.data(), plain.size()) != table[i].checksum)
      fail(ErrorCode::internal, "export: block {} changed while it was written", i);
    const std::size_t len = plain.size() + (cipher ? cipher->overhead() : 0);
    stored.assign(round_up(len, kContextPayloadAlign), 0);
    if (cipher) {
      const auto aad = block_aad(table[i]);
      cipher->seal(plain, aad, std::span(stored).first(len));
    } else {
      std::memcpy(stored.data(), plain.data(), plain.size());
    }
    sink(stored);
    at += stored.size();
  }
  QKV_CHECK(at == total || n == 0);
  return total;
}

std::vector<std::uint8_t> encode_context(const ContextMeta& meta, const BlockSource& block, const BlockCipher* cipher) {
  std::vector<std::uint8_t> out;
  write_context(meta, block, [&](std::span<const std::uint8_t> b) { out.insert(out.end(), b.begin(), b.end()); },
                cipher);
  return out;
}

ContextReader::ContextReader(std::span<const std::uint8_t> bytes, std::string name)
    : bytes_(bytes), name_(std::move(name)) {
  const auto bad = [&](std::string_view what) { fail(ErrorCode::bad_descriptor, "{}: {}", name_, what); };
  if (bytes.size() < kContextHeaderBytes)
    fail(ErrorCode::bad_descriptor, "{}: {} bytes, shorter than the {}-byte header of a context file", name_,
         bytes.size(), kContextHeaderBytes);
  const std::uint8_t* p = bytes.data();
  if (std::memcmp(p, kMagic, 8) != 0) bad("not a QKVShare context file (magic)");
  const auto version = static_cast<std::uint16_t>(le::get(p + 8, 2));
  if (version < 1 || version > kContextFileVersion)
    fail(ErrorCode::bad_descriptor, "{}: format version {}, this build reads versions 1 to {}", name_, version,
         kContextFileVersion);
  const std::size_t block_entry = version == 1 ? kBlockEntryV1 : kBlockEntry;
  const std::uint32_t known_fflags = version == 1 ? 3u : 11u;
  if (le::get(p + 10, 2) != kContextHeaderBytes) bad("header size field is not 128");
  if (XXH3_64bits(p, kContextHeaderBytes - 8) != get64(p + kContextHeaderBytes - 8))
    bad("header checksum does not match (corrupted or edited header)");
  const std::uint32_t flags = get32(p + 12);
  if ((flags & ~kFlagEncrypted) != 0) fail(ErrorCode::bad_descriptor, "{}: unknown flags 0x{:x}", name_, flags);
  std::memcpy(meta_.model_fingerprint.data(), p + 16, 16);
  meta_.tokenizer_fingerprint = get64(p + 32);
  const std::uint32_t L = get32(p + 40), H = get32(p + 44), KVH = get32(p + 48), D = get32(p + 52);
  if (L == 0 || L > kMaxLayers || H == 0 || H > kMaxHeads || KVH == 0 || KVH > H || H % KVH != 0 || D == 0 ||
      D > kMaxHeadDim || D % 8 != 0)
    fail(ErrorCode::bad_descriptor, "{}: KV shape {} layers, {} heads, {} KV heads, head_dim {} is not valid", name_, L,
         H, KVH, D);
  meta_.shape = KvShape{static_cast<int>(L), static_cast<int>(H), static_cast<int>(KVH), static_cast<int>(D)};
  const std::uint32_t T = get32(p + 56);
  if (T == 0 || T > 4096 || (T & (T - 1)) != 0)
    fail(ErrorCode::bad_descriptor, "{}: block size {} is not a power of two in [1, 4096]", name_, T);
  meta_.block_tokens = static_cast<int>(T);
  try {
    meta_.format.k = KvCodec::unpack(get32(p + 60));
    meta_.format.v = KvCodec::unpack(get32(p + 64));
    if (meta_.format.k.pq() || meta_.format.v.pq())
      fail(ErrorCode::unsupported, "pq codecs need a codebook, which context files do not name");
    tile_layout(meta_.format.k, meta_.block_tokens, meta_.shape.head_dim);
    tile_layout(meta_.format.v, meta_.block_tokens, meta_.shape.head_dim);
  } catch (const Error& e) {
    fail(ErrorCode::bad_descriptor, "{}: context format: {}", name_, e.what());
  }
  const std::uint32_t window = get32(p + 68), sink = get32(p + 72), fflags = get32(p + 76);
  if (window > kMaxTokens || sink > kMaxTokens || fflags > known_fflags || ((fflags & kFormatKeyRope) != 0 && (fflags & 1u) != 0))
    fail(ErrorCode::bad_descriptor, "{}: window {}, sink {} or format flags {} out of range", name_, window, sink, fflags);
  meta_.format.window = static_cast<int>(window);
  meta_.format.sink = static_cast<int>(sink);
  meta_.format.rotate_k = (fflags & 1u) != 0;
  meta_.format.rotate_v = (fflags & 2u) != 0;
  meta_.format.key_rope = static_cast<KeyRope>((fflags & kFormatKeyRope) >> 2);
  const std::uint32_t n_tokens = get32(p + 80), n_text = get32(p + 84), n_seg = get32(p + 88), n_blocks = get32(p + 92);
  if (n_tokens == 0 || n_tokens > kMaxTokens)
    fail(ErrorCode::bad_descriptor, "{}: token count {} is not in [1, 2^24]", name_, n_tokens);
  if (n_blocks != (n_tokens + T - 1) / T)
    fail(ErrorCode::bad_descriptor, "{}: {} blocks of {} tokens cannot hold {} tokens", name_, n_blocks, T, n_tokens);
  if (n_seg == 0 || n_seg > n_blocks)
    fail(ErrorCode::bad_descriptor, "{}: {} segments for {} blocks", name_, n_seg, n_blocks);
  meta_.key_id = get64(p + 96);
  if (((flags & kFlagEncrypted) != 0) != (meta_.key_id != 0)) bad("encryption flag and key id disagree");
  const std::uint64_t payload = get64(p + 104), total = get64(p + 112);
  if (total != bytes.size())
    fail(ErrorCode::bad_descriptor, "{}: {} bytes, the header says {} (truncated or extended)", name_, bytes.size(),
         total);
  if (n_text > bytes.size()) bad("text length runs past the end of the file");
  const std::size_t n_windows = version >= 3 ? L : 0;
  const Sections sec = sections_for(n_tokens, n_text, n_seg, n_blocks, n_windows, block_entry);
  if (sec.payload != payload || payload > total) bad("payload offset does not follow the tables");

  const std::uint8_t* meta_begin = p + kContextHeaderBytes;
  if (XXH3_64bits(meta_begin, sec.meta_sum - kContextHeaderBytes) != get64(p + sec.meta_sum))
    bad("tables checksum does not match (tokens, text, segment or block table corrupted)");
  for (std::size_t i = sec.meta_sum + 8; i < sec.payload; ++i)
    if (p[i] != 0) bad("padding before the payloads is not zero");
  meta_.tokens.resize(n_tokens);
  for (std::uint32_t i = 0; i < n_tokens; ++i)
    meta_.tokens[i] = static_cast<std::int32_t>(get32(p + sec.tokens + 4 * std::size_t{i}));
  meta_.text.assign(reinterpret_cast<const char*>(p + sec.text), n_text);
  if (n_windows > 0) {
    std::vector<int> windows(n_windows);
    for (std::size_t l = 0; l < n_windows; ++l) {
      const std::uint32_t w = get32(p + sec.windows + 4 * l);
      if (w > kMaxTokens) fail(ErrorCode::bad_descriptor, "{}: layer {} has a window of {} tokens", name_, l, w);
      windows[l] = static_cast<int>(w);
    }
    if (std::any_of(windows.begin(), windows.end(), [](int w) { return w > 0; })) meta_.shape.layer_window = windows;
  }
  std::uint64_t seg_total = 0;
  meta_.segments.resize(n_seg);
  for (std::uint32_t i = 0; i < n_seg; ++i) {
    const std::uint8_t* e = p + sec.segments + kSegmentEntry * i;
    meta_.segments[i] = ContextSegment{static_cast<std::int32_t>(get32(e)), get32(e + 4)};
    if (meta_.segments[i].blocks == 0) fail(ErrorCode::bad_descriptor, "{}: segment {} has no blocks", name_, i);
    seg_total += meta_.segments[i].blocks;
  }
  if (seg_total != n_blocks)
    fail(ErrorCode::bad_descriptor, "{}: segments hold {} blocks, the header says {}", name_, seg_total, n_blocks);
  meta_.blocks.resize(n_blocks);
  const std::size_t overhead = (flags & kFlagEncrypted) != 0 ? kContextSealOverhead : 0;
  std::uint64_t expect = payload;
  for (std::uint32_t i = 0; i < n_blocks; ++i) {
    const std::uint8_t* e = p + sec.blocks + block_entry * i;
    ContextBlock& b = meta_.blocks[i];
    try {
      b.k = KvCodec::unpack(get32(e));
      b.v = KvCodec::unpack(get32(e + 4));
    } catch (const Error& err) {
      fail(ErrorCode::bad_descriptor, "{}: block {}: {}", name_, i, err.what());
    }
    const KvCodec hk = hot_codec(meta_.format.k), hv = hot_codec(meta_.format.v);
    if ((b.k != meta_.format.k && b.k != hk) || (b.v != meta_.format.v && b.v != hv))
      fail(ErrorCode::bad_descriptor, "{}: block {} codecs {:#x}/{:#x} are not those of format {}", name_, i, b.k.pack(),
           b.v.pack(), meta_.format.to_string());
    b.flags = get32(e + 8);
    b.fill = get32(e + 12);
    const std::uint32_t want_fill = i + 1 < n_blocks ? T : n_tokens - T * (n_blocks - 1);
    // Blocks of the global layers alone: full ones, of a shape with windowed and global layers.
    const bool lean_ok = b.flags == (fflags | kBlockGlobalLayersOnly) && meta_.shape.frees_windowed() && b.fill == T;
    if ((b.flags != fflags && !lean_ok) || b.fill != want_fill)
      fail(ErrorCode::bad_descriptor, "{}: block {} has flags {} and fill {}, expected {} and {}", name_, i, b.flags,
           b.fill, fflags, want_fill);
    b.payload_offset = get64(e + 16);
    b.checksum = get64(e + 24);
    if (version >= 2) {
      const std::uint32_t pos = get32(e + 32);
      if (get32(e + 36) != 0) fail(ErrorCode::bad_descriptor, "{}: block {}: reserved field is not zero", name_, i);
      if ((b.flags & kFormatKeyRope) == 0 ? pos != 0 : pos > kMaxTokens)
        fail(ErrorCode::bad_descriptor, "{}: block {}: key position {} out of range", name_, i, pos);
      b.key_position = static_cast<std::int32_t>(pos);
    }
    if (b.payload_offset != expect)
      fail(ErrorCode::bad_descriptor, "{}: block {} payload at {}, expected {}", name_, i, b.payload_offset, expect);
    const std::size_t stored = block_plain_bytes(meta_.shape, meta_.block_tokens, b.k, b.v, b.flags) + overhead;
    if (stored > total - b.payload_offset)
      fail(ErrorCode::bad_descriptor, "{}: block {} payload [{}, +{}) runs past the end ({} bytes)", name_, i,
           b.payload_offset, stored, total);
    expect = round_up(b.payload_offset + stored, kContextPayloadAlign);
  }
  if (expect != total)
    fail(ErrorCode::bad_descriptor, "{}: payloads end at {}, the file at {}", name_, expect, total);
}

std::size_t ContextReader::plain_bytes(std::size_t block) const {
  QKV_CHECK(block < meta_.blocks.size());
  const ContextBlock& b = meta_.blocks[block];
  return block_plain_bytes(meta_.shape, meta_.block_tokens, b.k, b.v, b.flags);
}

std::span<const std::uint8_t> ContextReader::stored_block(std::size_t block) const {
  QKV_CHECK(block < meta_.blocks.size());
  const std::uint64_t begin = meta_.blocks[block].payload_offset;
  const std::uint64_t end = block + 1 < meta_.blocks.size() ? meta_.blocks[block + 1].payload_offset : bytes_.size();
  return bytes_.subspan(begin, end - begin);
}

void ContextReader::read_block(std::size_t block, std::span<std::uint8_t> plain, const BlockCipher* cipher) const {
  const std::size_t n = plain_bytes(block);
  QKV_CHECK(plain.size() == n);
  const ContextBlock& b = meta_.blocks[block];
  const std::span<const std::uint8_t> stored = stored_block(block);
  if (encrypted()) {
    if (cipher == nullptr)
      fail(ErrorCode::bad_descriptor, "{}: blocks are encrypted (key id {:016x}); give the key file (--key)", name_,
           meta_.key_id);
    if (cipher->key_id() != meta_.key_id)
      fail(ErrorCode::bad_descriptor, "{}: blocks are encrypted with key {:016x}, not with the given key {:016x} (wrong key)",
           name_, meta_.key_id, cipher->key_id());
    const std::size_t len = n + cipher->overhead();
    if (stored.size() < len)
      fail(ErrorCode::bad_descriptor, "{}: block {}: {} stored bytes, {} needed", name_, block, stored.size(), len);
    const auto aad = block_aad(b);
    cipher->open(stored.first(len), aad, plain, fmt::format("{}: block {}", name_, block));
  } else {
    std::memcpy(plain.data(), stored.data(), n);
  }
  if (XXH3_64bits(plain.data(), n) != b.checksum)
    fail(ErrorCode::bad_descriptor, "{}: block {}: checksum does not match (corrupted)", name_, block);
}

}  // namespace qkvshare
