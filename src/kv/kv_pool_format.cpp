// Formatting and attaching pool arenas: geometry, header, free lists.
#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

#include "kv_pool_layout.hpp"

namespace qkvshare {

using namespace kv_pool_detail;

HeapArena::HeapArena(std::size_t bytes) : size_(bytes) {
  if (bytes == 0) fail(ErrorCode::invalid_argument, "KV arena of 0 bytes");
  // Anonymous pages are zero and page-aligned, and cost memory only once
  // touched: a pool sized for many contexts holds (and a process's RSS
  // shows) only the blocks in use, as with the shared-memory arena.
  const std::size_t mapped = round_up(bytes, 4096);
  void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    fail(ErrorCode::out_of_memory, "cannot map a KV arena of {} bytes: {}", bytes, std::strerror(errno));
  data_ = std::unique_ptr<std::byte, Free>(static_cast<std::byte*>(p), Free{mapped});
}
void HeapArena::Free::operator()(std::byte* p) const noexcept { ::munmap(p, bytes); }

// The shape a header names, windows included (none when every entry is 0).
KvShape KvPool::shape_of(const Header& h) {
  KvShape s{static_cast<int>(h.n_layers), static_cast<int>(h.n_heads), static_cast<int>(h.n_kv_heads),
            static_cast<int>(h.head_dim)};
  const std::size_t layers = std::min<std::size_t>(h.n_layers, kMaxWindowLayers);
  if (std::any_of(h.layer_window, h.layer_window + layers, [](std::uint32_t w) { return w != 0; })) {
    s.layer_window.resize(layers);
    for (std::size_t l = 0; l < layers; ++l)
      s.layer_window[l] = static_cast<int>(std::min<std::uint32_t>(h.layer_window[l], 1u << 30));
  }
  return s;
}

KvPool::KvPool(std::unique_ptr<Arena> arena, std::unique_ptr<PoolLock> lock)
    : arena_(std::move(arena)), lock_(lock ? std::move(lock) : std::make_unique<LocalPoolLock>()) {
  if (!arena_) fail(ErrorCode::invalid_argument, "KV pool: no arena");
  base_ = arena_->data();
  if (reinterpret_cast<std::uintptr_t>(base_) % 64 != 0)
    fail(ErrorCode::invalid_argument, "KV pool: arena is not 64-byte aligned");
}

KvPool::~KvPool() = default;

std::shared_ptr<KvPool> KvPool::create(const PoolConfig& config) {
  return create(config, std::make_unique<HeapArena>(config.capacity_bytes));
}

std::shared_ptr<KvPool> KvPool::create(const PoolConfig& config, std::unique_ptr<Arena> arena,
                                       std::unique_ptr<PoolLock> lock) {
  const Geometry g = geometry_of(config.shape, config.block_tokens);
  std::shared_ptr<KvPool> pool(new KvPool(std::move(arena), std::move(lock)));
  const std::size_t size = pool->arena_->size();
  // The largest page count whose layout fits the arena.
  std::uint32_t lo = 0, hi = static_cast<std::uint32_t>(std::min<std::size_t>(size / g.page_bytes + 1, kNil - 1));
  while (lo < hi) {
    const std::uint32_t mid = lo + (hi - lo + 1) / 2;
    if (offsets_for(g, mid).total <= size) lo = mid; else hi = mid - 1;
  }
  if (lo == 0)
    fail(ErrorCode::invalid_argument, "KV pool: an arena of {} bytes cannot hold one {}-byte page plus headers", size,
         g.page_bytes);
  const Offsets o = offsets_for(g, lo);
  auto* h = new (pool->base_) Header{};
  std::memcpy(h->magic, kMagic, sizeof kMagic);
  h->version = kVersion;
  h->header_bytes = kHeaderBytes;
  h->n_layers = static_cast<std::uint32_t>(config.shape.n_layers);
  h->n_heads = static_cast<std::uint32_t>(config.shape.n_heads);
  h->n_kv_heads = static_cast<std::uint32_t>(config.shape.n_kv_heads);
  h->head_dim = static_cast<std::uint32_t>(config.shape.head_dim);
  h->block_tokens = static_cast<std::uint32_t>(config.block_tokens);
  h->page_bytes = static_cast<std::uint32_t>(g.page_bytes);
  h->n_pages = lo;
  h->n_blocks = o.n_blocks;
  h->max_pages = g.max_pages;
  h->block_stride = static_cast<std::uint32_t>(g.block_stride);
  h->arena_bytes = o.total;
  h->blocks_offset = o.blocks;
  h->page_next_offset = o.page_next;
  h->pages_offset = o.pages;
  for (std::size_t l = 0; l < config.shape.layer_window.size(); ++l)
    h->layer_window[l] = static_cast<std::uint32_t>(config.shape.layer_window[l]);
  pool->bind();
  // Free lists in index order, so the first allocations take low addresses.
  for (std::uint32_t i = 0; i < o.n_blocks; ++i) {
    auto* b = new (pool->base_ + o.blocks + static_cast<std::size_t>(i) * g.block_stride) BlockHeader{};
    b->next_free = i + 1 < o.n_blocks ? i + 1 : kNil;
  }
  std::uint32_t* next = pool->page_next();
  for (std::uint32_t i = 0; i < lo; ++i) next[i] = i + 1 < lo ? i + 1 : kNil;
  h->free_page_head = 0;
  h->free_pages = lo;
  h->free_block_head = 0;
  h->free_blocks = o.n_blocks;
  return pool;
}

std::shared_ptr<KvPool> KvPool::attach(std::unique_ptr<Arena> arena, std::unique_ptr<PoolLock> lock) {
  std::shared_ptr<KvPool> pool(new KvPool(std::move(arena), std::move(lock)));
  const std::size_t size = pool->arena_->size();
  if (size < kHeaderBytes) fail(ErrorCode::invalid_argument, "KV pool arena of {} bytes has no header", size);
  const Header& h = pool->header();
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0)
    fail(ErrorCode::invalid_argument, "KV pool arena: bad magic (not a formatted pool)");
  if (h.version != kVersion || h.header_bytes != kHeaderBytes)
    fail(ErrorCode::invalid_argument, "KV pool arena: version {} / header {} bytes, expected {} / {}", h.version,
         h.header_bytes, kVersion, kHeaderBytes);
  if (h.n_layers > 4096 || h.n_heads > 4096 || h.head_dim > 4096)
    fail(ErrorCode::invalid_argument, "KV pool arena: implausible shape");
  const KvShape shape = shape_of(h);
  const Geometry g = geometry_of(shape, static_cast<int>(h.block_tokens));
  const Offsets o = offsets_for(g, h.n_pages);
  if (h.page_bytes != g.page_bytes || h.max_pages != g.max_pages || h.block_stride != g.block_stride ||
      h.n_blocks != o.n_blocks || h.blocks_offset != o.blocks || h.page_next_offset != o.page_next ||
      h.pages_offset != o.pages || h.arena_bytes != o.total || o.total > size || h.n_pages == 0)
    fail(ErrorCode::invalid_argument, "KV pool arena: header geometry is inconsistent with its shape or the {}-byte arena",
         size);
  if (h.free_pages > h.n_pages || h.free_blocks > h.n_blocks ||
      (h.free_page_head != kNil && h.free_page_head >= h.n_pages) ||
      (h.free_block_head != kNil && h.free_block_head >= h.n_blocks))
    fail(ErrorCode::invalid_argument, "KV pool arena: free lists out of range");
  pool->bind();
  return pool;
}

void KvPool::bind() {
  static_assert(sizeof(Header) <= kHeaderBytes);
  static_assert(sizeof(BlockHeader) == kBlockHeaderBytes);  // the stride in kv_pool_layout.hpp
  const Header& h = header();
  shape_ = shape_of(h);
  // Where a block of the global layers alone keeps each layer, once (tile() asks on every read).
  frees_windowed_ = shape_.frees_windowed();
  n_global_ = shape_.global_layers();
  global_rank_.resize(static_cast<std::size_t>(shape_.n_layers));
  for (int l = 0; l < shape_.n_layers; ++l) global_rank_[static_cast<std::size_t>(l)] = shape_.stored_index(l, true);
  block_tokens_ = static_cast<int>(h.block_tokens);
  page_bytes_ = h.page_bytes;
  n_pages_ = h.n_pages;
  n_blocks_ = h.n_blocks;
  max_pages_ = h.max_pages;
  block_stride_ = h.block_stride;
  blocks_offset_ = h.blocks_offset;
  page_next_offset_ = h.page_next_offset;
  pages_offset_ = h.pages_offset;
}

std::size_t KvPool::arena_bytes_for(const KvShape& shape, int block_tokens, const KvFormat& format, int tokens,
                                    int contexts) {
  format.validate(shape, block_tokens);
  const Geometry g = geometry_of(shape, block_tokens);
  const auto tiles = static_cast<std::uint32_t>(shape.n_layers * shape.n_kv_heads);
  const auto pages = [&](const KvCodec& k, const KvCodec& v) {
    return kind_pages(tile_layout(k, block_tokens, shape.head_dim), g.page_bytes, tiles) +
           kind_pages(tile_layout(v, block_tokens, shape.head_dim), g.page_bytes, tiles);
  };
  const std::uint32_t hot = pages(hot_codec(format.k), hot_codec(format.v)), cold = pages(format.k, format.v);
  const int blocks = (tokens + block_tokens - 1) / block_tokens;
  std::size_t per_context = 0;
  for (int b = 0; b < blocks; ++b) per_context += format.block_is_hot(b, tokens, block_tokens) ? hot : cold;
  // A forward pass holds the cold copies of blocks leaving the window (and a
  // copied tail) until it commits.
  per_context += static_cast<std::size_t>(format.window / block_tokens + 2) * std::max(hot, cold);
  const auto n_pages = static_cast<std::uint32_t>(per_context * static_cast<std::size_t>(std::max(contexts, 1)));
  return offsets_for(g, n_pages).total;
}

}  // namespace qkvshare
