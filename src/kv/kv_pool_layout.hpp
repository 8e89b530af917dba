#pragma once
// Internal: the byte layout of a KV pool arena (see kv_pool.hpp), shared by
// the code that formats or attaches an arena (kv_pool_format.cpp) and the
// code that allocates in it (kv_pool.cpp). Fixed-size fields only: the same
// bytes are read by every process that maps the arena.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/kv_pool.hpp"

namespace qkvshare {

static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "block refcounts must be lock-free to live in shared memory");
static_assert(sizeof(std::atomic<std::uint32_t>) == 4);

namespace kv_pool_detail {

inline constexpr char kMagic[8] = {'Q', 'K', 'V', 'P', 'O', 'O', 'L', '1'};
inline constexpr std::size_t kHeaderBytes = 4096;
inline constexpr std::uint32_t kNil = 0xffffffffu;
inline constexpr std::size_t kBlockHeaderBytes = 56;  // sizeof(KvPool::BlockHeader), before its page list

inline std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

// Geometry that follows from the model shape and block size alone.
struct Geometry {
  std::size_t page_bytes = 0;       // one f32 tile: the largest tile of any codec
  std::uint32_t max_pages = 0;      // pages of an f32 block
  std::uint32_t min_pages = 0;      // pages of the smallest block (2-bit codes, or pq1)
  std::size_t block_stride = 0;     // BlockHeader + page list, cache-line aligned
};

inline std::uint32_t kind_pages(const TileLayout& l, std::size_t page_bytes, std::uint32_t tiles) {
  const auto per_page = static_cast<std::uint32_t>(page_bytes / l.bytes);
  return (tiles + per_page - 1) / per_page;
}

// Layers a pool header can name windows for (KvShape::layer_window).
inline constexpr std::size_t kMaxWindowLayers = 512;

inline Geometry geometry_of(const KvShape& s, int block_tokens) {
  if (s.n_layers <= 0 || s.n_kv_heads <= 0 || s.n_heads <= 0 || s.head_dim <= 0 || s.n_heads % s.n_kv_heads != 0)
    fail(ErrorCode::invalid_argument, "KV pool: bad shape ({} layers, {} heads, {} KV heads, head_dim {})", s.n_layers,
         s.n_heads, s.n_kv_heads, s.head_dim);
  if (block_tokens <= 0 || block_tokens > 4096 || (block_tokens & (block_tokens - 1)) != 0)
    fail(ErrorCode::invalid_argument, "KV pool: block size {} is not a power of two in [1, 4096]", block_tokens);
  if (!s.layer_window.empty() && (s.layer_window.size() != static_cast<std::size_t>(s.n_layers) ||
                                  s.layer_window.size() > kMaxWindowLayers ||
                                  std::any_of(s.layer_window.begin(), s.layer_window.end(), [](int w) { return w < 0; })))
    fail(ErrorCode::invalid_argument, "KV pool: {} layer windows for {} layers (at most {}, none negative)",
         s.layer_window.size(), s.n_layers, kMaxWindowLayers);
  Geometry g;
  const TileLayout f32 = tile_layout(KvCodec::f32(), block_tokens, s.head_dim);
  g.page_bytes = round_up(f32.bytes, 64);
  const auto tiles = static_cast<std::uint32_t>(s.n_layers * s.n_kv_heads);
  g.max_pages = 2 * kind_pages(f32, g.page_bytes, tiles);
  // The smallest block: 2-bit codes or pq1, of the global layers alone when windowed layers can be freed.
  const auto least = static_cast<std::uint32_t>(s.stored_layers(s.frees_windowed()) * s.n_kv_heads);
  const KvCodec q2{KvType::q2, KvAxis::channel, 0}, pq1{KvType::pq, KvAxis::token, 8};
  g.min_pages = 2 * std::min(kind_pages(tile_layout(q2, block_tokens, s.head_dim), g.page_bytes, least),
                             kind_pages(tile_layout(pq1, block_tokens, s.head_dim), g.page_bytes, least));
  g.block_stride = round_up(kBlockHeaderBytes + 4 * static_cast<std::size_t>(g.max_pages), 64);
  return g;
}

struct Offsets {
  std::uint32_t n_blocks = 0;
  std::size_t blocks = kHeaderBytes, page_next = 0, pages = 0, total = 0;
};

inline Offsets offsets_for(const Geometry& g, std::uint32_t n_pages) {
  Offsets o;
  o.n_blocks = n_pages / g.min_pages + 1;
  o.page_next = o.blocks + static_cast<std::size_t>(o.n_blocks) * g.block_stride;
  o.pages = round_up(o.page_next + 4 * static_cast<std::size_t>(n_pages), 4096);
  o.total = o.pages + static_cast<std::size_t>(n_pages) * g.page_bytes;
  return o;
}

}  // namespace kv_pool_detail

struct KvPool::Header {
  char magic[8];
  std::uint32_t version, header_bytes;
  std::uint32_t n_layers, n_heads, n_kv_heads, head_dim, block_tokens;
  std::uint32_t page_bytes, n_pages, n_blocks, max_pages, block_stride;
  std::uint64_t arena_bytes, blocks_offset, page_next_offset, pages_offset;
  // Changed only under the lock.
  std::uint32_t free_page_head, free_pages, free_block_head, free_blocks;
  std::uint64_t allocations, frees;
  alignas(64) std::byte lock_area[kLockAreaBytes];
  // KvShape::layer_window (all zero: no windows).
  std::uint32_t layer_window[kv_pool_detail::kMaxWindowLayers];
};

struct KvPool::BlockHeader {
  std::atomic<std::uint32_t> refcount;
  std::atomic<std::uint32_t> generation;
  std::uint32_t k_codec, v_codec, flags, fill, n_pages, next_free;
  std::int32_t key_position;  // BlockInfo::key_position
  std::uint32_t reserved;
  // A full block's checksum, kept once computed (KvPool::checksum): valid
  // while checksum_tag == generation << 32 | 1 (a freed block's generation moves on).
  std::atomic<std::uint64_t> checksum_tag;
  std::atomic<std::uint64_t> checksum;
  std::uint32_t* pages() noexcept { return reinterpret_cast<std::uint32_t*>(this + 1); }
  const std::uint32_t* pages() const noexcept { return reinterpret_cast<const std::uint32_t*>(this + 1); }
};

}  // namespace qkvshare
