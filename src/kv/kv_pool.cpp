// Allocation, reference counting and addressing in a formatted pool arena.
#include <cstring>
#include <mutex>
#include <thread>

#include <xxhash.h>

#include "kv_pool_layout.hpp"

namespace qkvshare {

using namespace kv_pool_detail;

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

namespace {
bool window_freed(std::uint32_t flags) noexcept { return (flags & kBlockWindowFreed) != 0; }
}  // namespace

int KvPool::stored_index(int layer, bool freed) const noexcept {
  return freed ? global_rank_[static_cast<std::size_t>(layer)] : layer;
}

std::uint32_t KvPool::pages_for(const KvCodec& k, const KvCodec& v, std::uint32_t flags) const {
  const auto tiles = static_cast<std::uint32_t>((window_freed(flags) ? n_global_ : shape_.n_layers) * shape_.n_kv_heads);
  return kind_pages(tile_layout(k, block_tokens_, shape_.head_dim), page_bytes_, tiles) +
         kind_pages(tile_layout(v, block_tokens_, shape_.head_dim), page_bytes_, tiles);
}

BlockRef KvPool::allocate(const KvCodec& k, const KvCodec& v, std::uint32_t flags, int key_position) {
  if (window_freed(flags) && !frees_windowed_)
    fail(ErrorCode::invalid_argument, "KV pool: a block without its windowed layers, in a pool whose layers are "
                                      "not both windowed and global");
  const std::uint32_t need = pages_for(k, v, flags);  // validates the codecs against the head
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
  b.key_position = key_position;
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
  // This process's background checksum may be reading the block: its pages
  // stay until it is done (one block's hash at most).
  while (hashing_.load(std::memory_order_acquire) == ref.index) std::this_thread::yield();
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
                   b.refcount.load(std::memory_order_acquire), b.key_position};
}

void KvPool::set_fill(BlockRef ref, int fill) {
  QKV_CHECK(fill >= 0 && fill <= block_tokens_);
  checked(ref).fill = static_cast<std::uint32_t>(fill);
}

namespace {
std::uint64_t checksum_tag(BlockRef ref) noexcept { return std::uint64_t{ref.generation} << 32 | 1u; }
// The value first, then the tag that makes it valid (readers load the tag with acquire).
template <class Header>
void keep(Header& b, std::uint64_t tag, std::uint64_t checksum) noexcept {
  b.checksum.store(checksum, std::memory_order_relaxed);
  b.checksum_tag.store(tag, std::memory_order_release);
}
}  // namespace

std::uint64_t KvPool::hash_tiles(const BlockHeader& b, BlockRef ref) const {
  const std::uint32_t codecs[2] = {b.k_codec, b.v_codec};
  XXH3_state_t* st = XXH3_createState();
  if (st == nullptr) fail(ErrorCode::out_of_memory, "cannot allocate a hash state");
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, codecs, sizeof codecs);
  // A block of the global layers alone says so (a full block's hash is unchanged by this).
  const bool freed = window_freed(b.flags);
  if (freed) XXH3_64bits_update(st, &kBlockWindowFreed, sizeof kBlockWindowFreed);
  for (int kind = 0; kind < 2; ++kind) {
    const std::size_t bytes = tile_layout(KvCodec::unpack(codecs[kind]), block_tokens_, shape_.head_dim).bytes;
    for (int l = 0; l < shape_.n_layers; ++l)
      if (stored_index(l, freed) >= 0)
        for (int h = 0; h < shape_.n_kv_heads; ++h) XXH3_64bits_update(st, tile(ref, kind, l, h), bytes);
  }
  const std::uint64_t d = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return d;
}

std::uint64_t KvPool::compute_checksum(BlockRef ref) const { return hash_tiles(checked(ref), ref); }

void KvPool::keep_checksum_if_live(BlockRef ref) noexcept {
  if (ref.index >= n_blocks_) return;
  BlockHeader& b = block(ref.index);
  const std::uint64_t tag = checksum_tag(ref);
  try {
    {
      // Under the lock, so that a last release either came first (the block
      // is gone) or will see hashing_ and wait for the hash to end.
      std::lock_guard lock(*lock_);
      if (b.refcount.load(std::memory_order_acquire) == 0 ||
          b.generation.load(std::memory_order_acquire) != ref.generation ||
          static_cast<int>(b.fill) != block_tokens_ || b.checksum_tag.load(std::memory_order_acquire) == tag)
        return;
      hashing_.store(ref.index, std::memory_order_release);
    }
    keep(b, tag, hash_tiles(b, ref));
  } catch (...) {
    // Left to the seal that needs it.
  }
  hashing_.store(kNil, std::memory_order_release);
}

std::uint64_t KvPool::checksum(BlockRef ref) const {
  BlockHeader& b = checked(ref);
  const std::uint64_t tag = checksum_tag(ref);
  if (b.checksum_tag.load(std::memory_order_acquire) == tag) return b.checksum.load(std::memory_order_relaxed);
  const std::uint64_t d = hash_tiles(b, ref);
  if (static_cast<int>(b.fill) == block_tokens_) keep(b, tag, d);  // full: its bytes are final
  return d;
}

bool KvPool::checksum_kept(BlockRef ref) const {
  return checked(ref).checksum_tag.load(std::memory_order_acquire) == checksum_tag(ref);
}

bool KvPool::stores_layer(BlockRef ref, int layer) const {
  return stored_index(layer, window_freed(checked(ref).flags)) >= 0;
}

const std::byte* KvPool::stored_tile(BlockRef ref, int kind, int layer, int head) const {
  const BlockHeader& b = block(ref.index);
  return stored_index(layer, window_freed(b.flags)) < 0 ? nullptr : tile(ref, kind, layer, head);
}

std::byte* KvPool::tile(BlockRef ref, int kind, int layer, int head) const {
  BlockHeader& b = block(ref.index);
  const TileLayout lk = tile_layout(KvCodec::unpack(b.k_codec), block_tokens_, shape_.head_dim);
  const bool freed = window_freed(b.flags);
  const int stored = stored_index(layer, freed);
  QKV_CHECK(stored >= 0);  // a windowed layer's tile that the block left behind
  const auto tiles = static_cast<std::uint32_t>((freed ? n_global_ : shape_.n_layers) * shape_.n_kv_heads);
  const std::size_t v_bytes = kind == 0 ? 0 : tile_layout(KvCodec::unpack(b.v_codec), block_tokens_, shape_.head_dim).bytes;
  return tile_at(b, lk, v_bytes, tiles, static_cast<std::uint32_t>(stored * shape_.n_kv_heads + head), kind);
}

void KvPool::stored_tiles(BlockRef ref, int layer, const std::byte** k, const std::byte** v) const {
  const BlockHeader& b = block(ref.index);
  const bool freed = window_freed(b.flags);
  const int stored = stored_index(layer, freed), H = shape_.n_kv_heads;
  if (stored < 0) {
    std::fill(k, k + H, nullptr);
    std::fill(v, v + H, nullptr);
    return;
  }
  const TileLayout lk = tile_layout(KvCodec::unpack(b.k_codec), block_tokens_, shape_.head_dim);
  const std::size_t v_bytes = tile_layout(KvCodec::unpack(b.v_codec), block_tokens_, shape_.head_dim).bytes;
  const auto tiles = static_cast<std::uint32_t>((freed ? n_global_ : shape_.n_layers) * H);
  for (int h = 0; h < H; ++h) {
    const auto i = static_cast<std::uint32_t>(stored * H + h);
    k[h] = tile_at(b, lk, v_bytes, tiles, i, 0);
    v[h] = tile_at(b, lk, v_bytes, tiles, i, 1);
  }
}

std::byte* KvPool::tile_at(const BlockHeader& b, const TileLayout& lk, std::size_t v_bytes, std::uint32_t tiles,
                           std::uint32_t i, int kind) const {
  const std::size_t bytes = kind == 0 ? lk.bytes : v_bytes;
  const auto per_page = static_cast<std::uint32_t>(page_bytes_ / bytes);
  const std::uint32_t slot = (kind == 0 ? 0 : kind_pages(lk, page_bytes_, tiles)) + i / per_page;
  QKV_CHECK(slot < b.n_pages);
  return base_ + pages_offset_ + static_cast<std::size_t>(b.pages()[slot]) * page_bytes_ + (i % per_page) * bytes;
}

BlockRef KvPool::without_windowed_layers(BlockRef ref) {
  const BlockInfo from = info(ref);
  QKV_CHECK(static_cast<int>(from.fill) == block_tokens_ && !window_freed(from.flags));
  const BlockRef to = allocate(from.k, from.v, from.flags | kBlockWindowFreed, from.key_position);
  const std::size_t kb = tile_layout(from.k, block_tokens_, shape_.head_dim).bytes,
                    vb = tile_layout(from.v, block_tokens_, shape_.head_dim).bytes;
  for (int l = 0; l < shape_.n_layers; ++l)
    if (shape_.window(l) == 0)
      for (int h = 0; h < shape_.n_kv_heads; ++h) {
        std::memcpy(tile(to, 0, l, h), tile(ref, 0, l, h), kb);
        std::memcpy(tile(to, 1, l, h), tile(ref, 1, l, h), vb);
      }
  set_fill(to, block_tokens_);
  return to;
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
