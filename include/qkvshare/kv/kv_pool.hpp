#pragma once
// The KV pool: the only owner of KV memory (docs/design.md "KV pool").
//
// A *block* is `block_tokens` tokens (a power of two, default 32) of K and V
// for every layer. Its bytes are a list of fixed-size *pages* holding its
// tiles (one tile = one layer, one KV head, K or V; see kv_format.hpp), so
// blocks of different formats (f32, f16, 2..8-bit) share one arena without
// fragmentation: a 4-bit block simply takes fewer pages. Everything lives in
// one arena, addressed by indices only:
//
//   [PoolHeader, 4 KiB: magic, version, geometry, free-list heads, counters, lock area]
//   [BlockHeader x n_blocks: refcount (atomic), generation (atomic), K/V codec,
//    flags, fill, page count, free link, key position, kept checksum, page indices]
//   [page free links: u32 x n_pages]
//   [pages: n_pages x page_bytes]
//
// Reference counts are lock-free atomics (address-free, so they work across
// processes); the free lists are changed only under the PoolLock. A block is
// named by BlockRef {index, generation}: the generation changes when a block
// is freed, so a stale reference can be detected (try_retain).
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "qkvshare/kv/kv_arena.hpp"
#include "qkvshare/kv/kv_cache.hpp"
#include "qkvshare/kv/kv_format.hpp"

namespace qkvshare {

struct BlockRef {
  static constexpr std::uint32_t kNone = 0xffffffffu;
  std::uint32_t index = kNone;
  std::uint32_t generation = 0;
  bool valid() const noexcept { return index != kNone; }
  bool operator==(const BlockRef&) const = default;
};

// Block flag bits.
inline constexpr std::uint32_t kBlockRotatedK = 1u;
inline constexpr std::uint32_t kBlockRotatedV = 2u;
// Keys stored before RoPE (keys=pre), or rotated by their offset r in the
// block only (keys=block); row r was computed at position
// BlockInfo::key_position + r. The flag bits are KeyRope << 2.
inline constexpr std::uint32_t kBlockPreRopeK = 4u;
inline constexpr std::uint32_t kBlockRelativeK = 8u;
// The block stores the global layers' tiles alone: its tokens have left the
// sliding window of every windowed layer (KvShape::layer_window), which never
// read them again (PooledKvCache frees them at commit).
inline constexpr std::uint32_t kBlockWindowFreed = 16u;

// Told about every block reference this process takes or drops through a
// pool (allocate/retain/try_retain, release), so that a shared pool can give
// back the references of a process that died (the handoff layer's per-process
// ledger). Called outside the pool lock; must not throw.
class RefLedger {
 public:
  virtual ~RefLedger() = default;
  virtual void taken(std::uint32_t block) noexcept = 0;
  virtual void dropping(std::uint32_t block) noexcept = 0;
};

struct PoolConfig {
  KvShape shape;
  int block_tokens = 32;
  std::size_t capacity_bytes = 0;  // the whole arena, headers included
};

struct PoolCounters {
  std::uint32_t blocks_total = 0, blocks_used = 0, blocks_free = 0;
  std::uint32_t pages_total = 0, pages_used = 0, pages_free = 0;
  std::size_t page_bytes = 0;
  std::size_t arena_bytes = 0;
  std::size_t bytes_used = 0;  // pages_used * page_bytes
  std::uint64_t allocations = 0, frees = 0;
};

struct BlockInfo {
  KvCodec k, v;
  std::uint32_t flags = 0;
  std::uint32_t fill = 0;
  std::uint32_t refcount = 0;
  int key_position = 0;  // the position row 0 was computed at (kept by copies of the block)
};

class KvPool {
 public:
  // 2: block headers carry key_position; 3: and a kept checksum; 4: the header names the layers' windows
  static constexpr std::uint32_t kVersion = 4;
  static constexpr std::size_t kLockAreaBytes = 256;

  // Formats `arena` as an empty pool. Throws Error(invalid_argument) when the
  // geometry is invalid or the arena cannot hold a single page.
  static std::shared_ptr<KvPool> create(const PoolConfig& config, std::unique_ptr<Arena> arena,
                                        std::unique_ptr<PoolLock> lock = nullptr);
  // Same, in a zeroed heap arena of config.capacity_bytes.
  static std::shared_ptr<KvPool> create(const PoolConfig& config);
  // Opens an arena that create() formatted (possibly in another process),
  // validating every header field against the arena's size.
  static std::shared_ptr<KvPool> attach(std::unique_ptr<Arena> arena, std::unique_ptr<PoolLock> lock = nullptr);
  // Arena bytes for `contexts` contexts of `tokens` tokens in `format`,
  // including the hot blocks and the blocks a forward pass holds while it
  // converts hot blocks to cold ones.
  static std::size_t arena_bytes_for(const KvShape& shape, int block_tokens, const KvFormat& format, int tokens,
                                     int contexts = 1);

  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  const KvShape& shape() const noexcept { return shape_; }
  // KvShape::frees_windowed() of the pool's shape.
  bool frees_windowed() const noexcept { return frees_windowed_; }
  int block_tokens() const noexcept { return block_tokens_; }

  // A block with refcount 1 and fill 0. Throws Error(out_of_memory) when the
  // pool lacks the pages or a free block header; nothing changes then.
  BlockRef allocate(const KvCodec& k, const KvCodec& v, std::uint32_t flags, int key_position = 0);
  void retain(BlockRef ref);
  // Takes a reference only if `ref` still names a live block (index in range,
  // same generation, refcount > 0); false otherwise.
  bool try_retain(BlockRef ref) noexcept;
  // Drops a reference; the block's pages return to the pool at zero.
  void release(BlockRef ref);

  // The live reference of block `index` (its current generation), or an
  // invalid one when the block is free or out of range.
  BlockRef live_ref(std::uint32_t index) const noexcept;
  // Not owned; must outlive the pool (nullptr: no ledger).
  void set_ledger(RefLedger* ledger) noexcept { ledger_ = ledger; }
  // Rebuilds both free lists from the block headers, for a lock whose holder
  // died mid-change: blocks with refcount 0 are free (a half-freed one gets a
  // new generation), pages not listed by a live block are free. Call with the
  // lock held.
  void rebuild_free_lists() noexcept;

  BlockInfo info(BlockRef ref) const;
  void set_fill(BlockRef ref, int fill);

  // A block's checksum: XXH3-64 of its codecs and tiles, what a sealed
  // context's blocks checksum is made of. A full block (fill ==
  // block_tokens) never changes again, so its checksum is computed once and
  // kept in its header, where every process that maps the pool finds it;
  // a partly filled block's is computed each time. PooledKvCache has each
  // block it fills checksummed in the background (kv/block_checksums.hpp),
  // so sealing a context finds its checksums kept: O(1) per block.
  std::uint64_t checksum(BlockRef ref) const;
  // Always from the bytes, never the kept value (what verifying a handoff reads).
  std::uint64_t compute_checksum(BlockRef ref) const;
  bool checksum_kept(BlockRef ref) const;
  // The background thread's call: keeps ref's checksum if the block is still
  // live and full, without taking a reference (which others would see in the
  // counts); this process's last release of the block waits for the hash to end.
  void keep_checksum_if_live(BlockRef ref) noexcept;
  // Tile of `kind` (0 = K, 1 = V) for one layer and KV head of a block; the
  // layer must be stored (stores_layer).
  std::byte* tile(BlockRef ref, int kind, int layer, int head) const;
  // The same, or nullptr for a windowed layer that the block left behind.
  const std::byte* stored_tile(BlockRef ref, int kind, int layer, int head) const;
  // stored_tile of every KV head at once (k[h], v[h] for h < n_kv_heads):
  // the block's layouts are worked out once, not per tile (a decode step
  // asks for every tile of the context in every layer).
  void stored_tiles(BlockRef ref, int layer, const std::byte** k, const std::byte** v) const;
  bool stores_layer(BlockRef ref, int layer) const;
  // Bytes of a block's pages.
  std::size_t block_bytes(BlockRef ref) const;
  // Pages a block of these codecs and flags (kBlockWindowFreed) takes.
  std::uint32_t pages_for(const KvCodec& k, const KvCodec& v, std::uint32_t flags = 0) const;
  // A copy of `ref` (a full block: fill == block_tokens) that keeps only the
  // global layers' tiles (kBlockWindowFreed), one reference held by the
  // caller; same codecs, flags otherwise and key position. Error(out_of_memory)
  // when the pool lacks the pages; Error(invalid_argument) when the shape has
  // no windowed and global layers both.
  BlockRef without_windowed_layers(BlockRef ref);

  PoolCounters counters() const;
  std::byte* lock_area() noexcept;

 private:
  struct Header;
  struct BlockHeader;
  KvPool(std::unique_ptr<Arena> arena, std::unique_ptr<PoolLock> lock);
  void bind();  // reads geometry from the header into members
  static KvShape shape_of(const Header& h);
  int stored_index(int layer, bool window_freed) const noexcept;  // KvShape::stored_index, from the table
  Header& header() const noexcept;
  BlockHeader& block(std::uint32_t index) const noexcept;
  BlockHeader& checked(BlockRef ref) const;  // live block or Error(internal)
  // Tile i (stored layer x n_kv_heads + head) of `kind` in block b, whose K
  // tiles have layout lk and V tiles v_bytes each, `tiles` tiles per kind.
  std::byte* tile_at(const BlockHeader& b, const TileLayout& lk, std::size_t v_bytes, std::uint32_t tiles,
                     std::uint32_t i, int kind) const;
  std::uint32_t* page_next() const noexcept;
  void drop(BlockRef ref);  // release without the ledger

  std::unique_ptr<Arena> arena_;
  std::unique_ptr<PoolLock> lock_;
  RefLedger* ledger_ = nullptr;
  std::byte* base_ = nullptr;
  KvShape shape_;
  bool frees_windowed_ = false;
  int n_global_ = 0;              // KvShape::global_layers()
  std::vector<int> global_rank_;  // per layer: KvShape::stored_index(layer, true)
  int block_tokens_ = 0;
  std::size_t page_bytes_ = 0;
  std::uint32_t n_pages_ = 0, n_blocks_ = 0, max_pages_ = 0;
  std::size_t block_stride_ = 0, blocks_offset_ = 0, page_next_offset_ = 0, pages_offset_ = 0;
  std::atomic<std::uint32_t> hashing_{0xffffffffu};  // the block keep_checksum_if_live() is reading
  std::uint64_t hash_tiles(const BlockHeader& b, BlockRef ref) const;
};

}  // namespace qkvshare
