#include "qkvshare/kv/kv_pool.hpp"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>

#include "qkvshare/core/error.hpp"

namespace qkvshare {

static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "block refcounts must be lock-free to live in shared memory");
static_assert(sizeof(std::atomic<std::uint32_t>) == 4);

namespace {

constexpr char kMagic[8] = {'Q', 'K', 'V', 'P', 'O', 'O', 'L', '1'};
constexpr std::size_t kHeaderBytes = 4096;
constexpr std::uint32_t kNil = 0xffffffffu;

std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

// Geometry that follows from the model shape and block size alone.
struct Geometry {
  std::size_t page_bytes = 0;       // one f32 tile: the largest tile of any codec
  std::uint32_t max_pages = 0;      // pages of an f32 block
  std::uint32_t min_pages = 0;      // pages of a 2-bit block
  std::size_t block_stride = 0;     // BlockHeader + page list, cache-line aligned
};

std::uint32_t kind_pages(const TileLayout& l, std::size_t page_bytes, std::uint32_t tiles) {
  const auto per_page = static_cast<std::uint32_t>(page_bytes / l.bytes);
  return (tiles + per_page - 1) / per_page;
}

Geometry geometry_of(const KvShape& s, int block_tokens) {
  if (s.n_layers <= 0 || s.n_kv_heads <= 0 || s.n_heads <= 0 || s.head_dim <= 0 || s.n_heads % s.n_kv_heads != 0)
    fail(ErrorCode::invalid_argument, "KV pool: bad shape ({} layers, {} heads, {} KV heads, head_dim {})", s.n_layers,
         s.n_heads, s.n_kv_heads, s.head_dim);
  if (block_tokens <= 0 || block_tokens > 4096 || (block_tokens & (block_tokens - 1)) != 0)
    fail(ErrorCode::invalid_argument, "KV pool: block size {} is not a power of two in [1, 4096]", block_tokens);
  Geometry g;
  const TileLayout f32 = tile_layout(KvCodec::f32(), block_tokens, s.head_dim);
  g.page_bytes = round_up(f32.bytes, 64);
  const auto tiles = static_cast<std::uint32_t>(s.n_layers * s.n_kv_heads);
  g.max_pages = 2 * kind_pages(f32, g.page_bytes, tiles);
  const KvCodec q2{KvType::q2, KvAxis::channel, 0};
  g.min_pages = 2 * kind_pages(tile_layout(q2, block_tokens, s.head_dim), g.page_bytes, tiles);
  g.block_stride = round_up(32 + 4 * static_cast<std::size_t>(g.max_pages), 64);
  return g;
}

struct Offsets {
  std::uint32_t n_blocks = 0;
  std::size_t blocks = kHeaderBytes, page_next = 0, pages = 0, total = 0;
};

Offsets offsets_for(const Geometry& g, std::uint32_t n_pages) {
  Offsets o;
  o.n_blocks = n_pages / g.min_pages + 1;
  o.page_next = o.blocks + static_cast<std::size_t>(o.n_blocks) * g.block_stride;
  o.pages = round_up(o.page_next + 4 * static_cast<std::size_t>(n_pages), 4096);
  o.total = o.pages + static_cast<std::size_t>(n_pages) * g.page_bytes;
  return o;
}

}  // namespace

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
};

struct KvPool::BlockHeader {
  std::atomic<std::uint32_t> refcount;
  std::atomic<std::uint32_t> generation;
  std::uint32_t k_codec, v_codec, flags, fill, n_pages, next_free;
  std::uint32_t* pages() noexcept { return reinterpret_cast<std::uint32_t*>(this + 1); }
};

HeapArena::HeapArena(std::size_t bytes) : size_(bytes) {
  if (bytes == 0) fail(ErrorCode::invalid_argument, "KV arena of 0 bytes");
  void* p = std::aligned_alloc(4096, round_up(bytes, 4096));
  if (p == nullptr) fail(ErrorCode::out_of_memory, "cannot allocate a KV arena of {} bytes", bytes);
  std::memset(p, 0, round_up(bytes, 4096));
  data_.reset(static_cast<std::byte*>(p));
}
void HeapArena::Free::operator()(std::byte* p) const noexcept { std::free(p); }

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
  const KvShape shape{static_cast<int>(h.n_layers), static_cast<int>(h.n_heads), static_cast<int>(h.n_kv_heads),
                      static_cast<int>(h.head_dim)};
  if (h.n_layers > 4096 || h.n_heads > 4096 || h.head_dim > 4096)
    fail(ErrorCode::invalid_argument, "KV pool arena: implausible shape");
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
  static_assert(sizeof(BlockHeader) == 32);
  const Header& h = header();
  shape_ = KvShape{static_cast<int>(h.n_layers), static_cast<int>(h.n_heads), static_cast<int>(h.n_kv_heads),
                   static_cast<int>(h.head_dim)};
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

KvPool::Header& KvPool::header() const noexcept { return *reinterpret_cast<Header*>(base_); }
KvPool::BlockHeader& KvPool::block(std::uint32_t index) const noexcept {
  return *reinterpret_cast<BlockHeader*>(base_ + blocks_offset_ + static_cast<std::size_t>(index) * block_stride_);
}
std::uint32_t* KvPool::page_next() const noexcept { return reinterpret_cast<std::uint32_t*>(base_ + page_next_offset_); }
std::byte* KvPool::lock_area() noexcept { return header().lock_area; }

KvPool::BlockHeader& KvPool::checked(BlockRef ref) const {
  QKV_CHECK(ref.index < n_blocks_);
  BlockHeader& b = block(ref.index);
  QKV_CHECK(b.generation.load(std::memory_order_acquire) == ref.generation);
  QKV_CHECK(b.refcount.load(std::memory_order_acquire) > 0);
  return b;
}

std::uint32_t KvPool::pages_for(const KvCodec& k, const KvCodec& v) const {
  const auto tiles = static_cast<std::uint32_t>(shape_.n_layers * shape_.n_kv_heads);
  return kind_pages(tile_layout(k, block_tokens_, shape_.head_dim), page_bytes_, tiles) +
         kind_pages(tile_layout(v, block_tokens_, shape_.head_dim), page_bytes_, tiles);
}

BlockRef KvPool::allocate(const KvCodec& k, const KvCodec& v, std::uint32_t flags) {
  const std::uint32_t need = pages_for(k, v);  // validates the codecs against the head
  QKV_CHECK(need <= max_pages_);
  std::lock_guard lock(*lock_);
  Header& h = header();
  if (h.free_pages < need || h.free_blocks == 0)
    fail(ErrorCode::out_of_memory,
         "KV pool exhausted: a block needs {} pages of {} bytes, {} of {} pages and {} of {} block headers are free; "
         "release contexts or give the pool more memory",
         need, page_bytes_, h.free_pages, n_pages_, h.free_blocks, n_blocks_);
  const std::uint32_t index = h.free_block_head;
  BlockHeader& b = block(index);
  h.free_block_head = b.next_free;
  --h.free_blocks;
  std::uint32_t* next = page_next();
  std::uint32_t* pages = b.pages();
  for (std::uint32_t i = 0; i < need; ++i) {
    const std::uint32_t p = h.free_page_head;
    QKV_CHECK(p < n_pages_);
    h.free_page_head = next[p];
    pages[i] = p;
  }
  h.free_pages -= need;
  ++h.allocations;
  b.k_codec = k.pack();
  b.v_codec = v.pack();
  b.flags = flags;
  b.fill = 0;
  b.n_pages = need;
  b.next_free = kNil;
  b.refcount.store(1, std::memory_order_release);
  if (ledger_ != nullptr) ledger_->taken(index);
  return BlockRef{index, b.generation.load(std::memory_order_relaxed)};
}

void KvPool::retain(BlockRef ref) {
  checked(ref).refcount.fetch_add(1, std::memory_order_relaxed);
  if (ledger_ != nullptr) ledger_->taken(ref.index);
}

bool KvPool::try_retain(BlockRef ref) noexcept {
  if (ref.index >= n_blocks_) return false;
  BlockHeader& b = block(ref.index);
  std::uint32_t r = b.refcount.load(std::memory_order_acquire);
  do {
    if (r == 0) return false;
  } while (!b.refcount.compare_exchange_weak(r, r + 1, std::memory_order_acq_rel));
  if (b.generation.load(std::memory_order_acquire) == ref.generation) {
    if (ledger_ != nullptr) ledger_->taken(ref.index);
    return true;
  }
  // The index was reused by another block: give back the reference we took on it.
  try {
    drop(BlockRef{ref.index, b.generation.load(std::memory_order_acquire)});
  } catch (...) {
  }
  return false;
}

void KvPool::release(BlockRef ref) {
  checked(ref);
  if (ledger_ != nullptr) ledger_->dropping(ref.index);
  drop(ref);
}

void KvPool::drop(BlockRef ref) {
  BlockHeader& b = checked(ref);
  // All but the last reference drop without the lock; the last one drops
  // under it. So, outside the lock, a zero count always means "on the free
  // list", which rebuild_free_lists() relies on: a live process can never be
  // between its final decrement and the free-list push while a repair runs.
  std::uint32_t r = b.refcount.load(std::memory_order_acquire);
  while (r > 1)
    if (b.refcount.compare_exchange_weak(r, r - 1, std::memory_order_acq_rel)) return;
  std::lock_guard lock(*lock_);
  if (b.refcount.fetch_sub(1, std::memory_order_acq_rel) != 1) return;  // a try_retain() came in between
  Header& h = header();
  std::uint32_t* next = page_next();
  const std::uint32_t* pages = b.pages();
  for (std::uint32_t i = b.n_pages; i-- > 0;) {
    next[pages[i]] = h.free_page_head;
    h.free_page_head = pages[i];
  }
  h.free_pages += b.n_pages;
  b.n_pages = 0;
  b.fill = 0;
  b.generation.fetch_add(1, std::memory_order_acq_rel);
  b.next_free = h.free_block_head;
  h.free_block_head = ref.index;
  ++h.free_blocks;
  ++h.frees;
}

BlockRef KvPool::live_ref(std::uint32_t index) const noexcept {
  if (index >= n_blocks_) return {};
  const BlockHeader& b = block(index);
  if (b.refcount.load(std::memory_order_acquire) == 0) return {};
  return BlockRef{index, b.generation.load(std::memory_order_acquire)};
}

void KvPool::rebuild_free_lists() noexcept {
  Header& h = header();
  std::uint32_t* next = page_next();
  constexpr std::uint32_t kUsed = kNil - 1;
  for (std::uint32_t p = 0; p < n_pages_; ++p) next[p] = kNil;
  h.free_block_head = kNil;
  h.free_blocks = 0;
  for (std::uint32_t i = n_blocks_; i-- > 0;) {
    BlockHeader& b = block(i);
    if (b.refcount.load(std::memory_order_acquire) > 0 && b.n_pages <= max_pages_) {
      for (std::uint32_t k = 0; k < b.n_pages; ++k)
        if (b.pages()[k] < n_pages_) next[b.pages()[k]] = kUsed;
      continue;
    }
    if (b.n_pages != 0) {  // freed half-way: its old references must not match again
      b.generation.fetch_add(1, std::memory_order_acq_rel);
      b.n_pages = 0;
    }
    b.refcount.store(0, std::memory_order_release);
    b.next_free = h.free_block_head;
    h.free_block_head = i;
    ++h.free_blocks;
  }
  h.free_page_head = kNil;
  h.free_pages = 0;
  for (std::uint32_t p = n_pages_; p-- > 0;) {
    if (next[p] == kUsed) continue;
    next[p] = h.free_page_head;
    h.free_page_head = p;
    ++h.free_pages;
  }
}

BlockInfo KvPool::info(BlockRef ref) const {
  const BlockHeader& b = checked(ref);
  return BlockInfo{KvCodec::unpack(b.k_codec), KvCodec::unpack(b.v_codec), b.flags, b.fill,
                   b.refcount.load(std::memory_order_acquire)};
}

void KvPool::set_fill(BlockRef ref, int fill) {
  QKV_CHECK(fill >= 0 && fill <= block_tokens_);
  checked(ref).fill = static_cast<std::uint32_t>(fill);
}

std::byte* KvPool::tile(BlockRef ref, int kind, int layer, int head) const {
  BlockHeader& b = block(ref.index);
  const KvCodec kc = KvCodec::unpack(b.k_codec);
  const TileLayout lk = tile_layout(kc, block_tokens_, shape_.head_dim);
  const auto tiles = static_cast<std::uint32_t>(shape_.n_layers * shape_.n_kv_heads);
  const auto i = static_cast<std::uint32_t>(layer * shape_.n_kv_heads + head);
  std::uint32_t slot = 0;
  std::size_t offset = 0;
  if (kind == 0) {
    const auto per_page = static_cast<std::uint32_t>(page_bytes_ / lk.bytes);
    slot = i / per_page;
    offset = (i % per_page) * lk.bytes;
  } else {
    const TileLayout lv = tile_layout(KvCodec::unpack(b.v_codec), block_tokens_, shape_.head_dim);
    const auto per_page = static_cast<std::uint32_t>(page_bytes_ / lv.bytes);
    slot = kind_pages(lk, page_bytes_, tiles) + i / per_page;
    offset = (i % per_page) * lv.bytes;
  }
  QKV_CHECK(slot < b.n_pages);
  return base_ + pages_offset_ + static_cast<std::size_t>(b.pages()[slot]) * page_bytes_ + offset;
}

std::size_t KvPool::block_bytes(BlockRef ref) const { return static_cast<std::size_t>(checked(ref).n_pages) * page_bytes_; }

PoolCounters KvPool::counters() const {
  std::lock_guard lock(*lock_);
  const Header& h = header();
  PoolCounters c;
  c.blocks_total = n_blocks_;
  c.blocks_free = h.free_blocks;
  c.blocks_used = n_blocks_ - h.free_blocks;
  c.pages_total = n_pages_;
  c.pages_free = h.free_pages;
  c.pages_used = n_pages_ - h.free_pages;
  c.page_bytes = page_bytes_;
  c.arena_bytes = arena_->size();
  c.bytes_used = static_cast<std::size_t>(c.pages_used) * page_bytes_;
  c.allocations = h.allocations;
  c.frees = h.frees;
  return c;
}

}  // namespace qkvshare
