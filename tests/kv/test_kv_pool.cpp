#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "kv_test_util.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/kv_pool.hpp"

namespace qkvshare {
namespace {

using testing::kStoriesKvShape;

std::shared_ptr<KvPool> make_pool(std::size_t bytes, int block_tokens = 32) {
  return KvPool::create(PoolConfig{kStoriesKvShape, block_tokens, bytes});
}

TEST(KvPool, AllocateReleaseAccounting) {
  auto pool = make_pool(1 << 20);
  const PoolCounters start = pool->counters();
  EXPECT_EQ(start.blocks_used, 0u);
  EXPECT_EQ(start.pages_used, 0u);
  EXPECT_GT(start.pages_total, 0u);
  const BlockRef a = pool->allocate(KvCodec::f16(), KvCodec::f16(), 0);
  const KvFormat q = KvFormat::parse("int2");
  const BlockRef b = pool->allocate(q.k, q.v, kBlockRotatedK);
  EXPECT_EQ(pool->counters().blocks_used, 2u);
  EXPECT_EQ(pool->counters().pages_used, pool->pages_for(KvCodec::f16(), KvCodec::f16()) + pool->pages_for(q.k, q.v));
  EXPECT_LT(pool->pages_for(q.k, q.v), pool->pages_for(KvCodec::f16(), KvCodec::f16()));
  const BlockInfo ib = pool->info(b);
  EXPECT_EQ(ib.k, q.k);
  EXPECT_EQ(ib.v, q.v);
  EXPECT_EQ(ib.flags, kBlockRotatedK);
  EXPECT_EQ(ib.refcount, 1u);
  pool->retain(b);
  pool->release(b);
  EXPECT_EQ(pool->counters().blocks_used, 2u);
  pool->release(b);
  pool->release(a);
  const PoolCounters end = pool->counters();
  EXPECT_EQ(end.blocks_used, 0u);
  EXPECT_EQ(end.pages_free, start.pages_free);
  EXPECT_EQ(end.allocations, 2u);
  EXPECT_EQ(end.frees, 2u);
}

TEST(KvPool, TilesOfABlockAreDisjointAndInsideItsPages) {
  auto pool = make_pool(1 << 20);
  const KvFormat f = KvFormat::parse("k8v4");
  const BlockRef a = pool->allocate(f.k, f.v, 0);
  const BlockRef b = pool->allocate(KvCodec::f32(), KvCodec::f32(), 0);
  // Fill every tile of a with its own byte, b with another, and check nothing overlaps.
  std::vector<std::pair<std::byte*, std::size_t>> tiles;
  for (const BlockRef r : {a, b}) {
    const BlockInfo info = pool->info(r);
    for (int kind = 0; kind < 2; ++kind)
      for (int l = 0; l < kStoriesKvShape.n_layers; ++l)
        for (int h = 0; h < kStoriesKvShape.n_kv_heads; ++h)
          tiles.emplace_back(pool->tile(r, kind, l, h), tile_layout(kind == 0 ? info.k : info.v, 32, 8).bytes);
  }
  for (std::size_t i = 0; i < tiles.size(); ++i) std::memset(tiles[i].first, static_cast<int>(i % 251), tiles[i].second);
  for (std::size_t i = 0; i < tiles.size(); ++i)
    for (std::size_t j = 0; j < tiles[i].second; ++j)
      ASSERT_EQ(tiles[i].first[j], static_cast<std::byte>(i % 251)) << "tile " << i << " overwritten";
  pool->release(a);
  pool->release(b);
}

TEST(KvPool, ExhaustionIsAClearErrorAndChangesNothing) {
  auto pool = make_pool(64 * 1024);
  std::vector<BlockRef> held;
  try {
    for (;;) held.push_back(pool->allocate(KvCodec::f16(), KvCodec::f16(), 0));
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::out_of_memory);
    EXPECT_NE(std::string(e.what()).find("KV pool exhausted"), std::string::npos) << e.what();
  }
  ASSERT_FALSE(held.empty());
  const PoolCounters full = pool->counters();
  EXPECT_THROW(pool->allocate(KvCodec::f16(), KvCodec::f16(), 0), Error);
  const PoolCounters after = pool->counters();
  EXPECT_EQ(after.pages_free, full.pages_free);
  EXPECT_EQ(after.blocks_used, full.blocks_used);
  for (const BlockRef r : held) EXPECT_EQ(pool->info(r).refcount, 1u);
  for (const BlockRef r : held) pool->release(r);
  EXPECT_EQ(pool->counters().blocks_used, 0u);
  EXPECT_EQ(pool->counters().pages_free, pool->counters().pages_total);
}

TEST(KvPool, StaleReferencesAreRefused) {
  auto pool = make_pool(1 << 20);
  const BlockRef a = pool->allocate(KvCodec::f16(), KvCodec::f16(), 0);
  pool->release(a);
  EXPECT_FALSE(pool->try_retain(a));  // freed
  const BlockRef b = pool->allocate(KvCodec::f16(), KvCodec::f16(), 0);
  EXPECT_EQ(b.index, a.index);  // the slot is reused ...
  EXPECT_NE(b.generation, a.generation);  // ... under a new generation
  EXPECT_FALSE(pool->try_retain(a));
  EXPECT_EQ(pool->info(b).refcount, 1u);
  EXPECT_TRUE(pool->try_retain(b));
  EXPECT_EQ(pool->info(b).refcount, 2u);
  EXPECT_FALSE(pool->try_retain(BlockRef{1u << 30, 0}));
  EXPECT_THROW(pool->release(a), Error);  // a stale release is a bug, caught
  pool->release(b);
  pool->release(b);
  EXPECT_EQ(pool->counters().blocks_used, 0u);
}

TEST(KvPool, ConcurrentRetainReleaseKeepsCountsExact) {
  auto pool = make_pool(4 << 20);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::vector<BlockRef> mine;
      for (int i = 0; i < 2000; ++i) {
        if (mine.empty() || rng() % 3 != 0) {
          try {
            mine.push_back(pool->allocate(KvCodec::f16(), KvCodec::f16(), 0));
            pool->retain(mine.back());
            pool->release(mine.back());
          } catch (const Error&) {
          }
        } else {
          pool->release(mine.back());
          mine.pop_back();
        }
      }
      for (const BlockRef r : mine) pool->release(r);
    });
  for (auto& t : threads) t.join();
  const PoolCounters c = pool->counters();
  EXPECT_EQ(c.blocks_used, 0u);
  EXPECT_EQ(c.pages_free, c.pages_total);
  EXPECT_EQ(c.allocations, c.frees);
}

// The arena carries everything: a second pool object attached to the same
// bytes sees the first one's blocks (as another process will).
class BorrowedArena final : public Arena {
 public:
  BorrowedArena(std::byte* p, std::size_t n) : p_(p), n_(n) {}
  std::byte* data() noexcept override { return p_; }
  std::size_t size() const noexcept override { return n_; }

 private:
  std::byte* p_;
  std::size_t n_;
};

TEST(KvPool, AttachValidatesAndSharesState) {
  HeapArena bytes(1 << 20);
  auto a = KvPool::create(PoolConfig{kStoriesKvShape, 32, 0}, std::make_unique<BorrowedArena>(bytes.data(), bytes.size()));
  const BlockRef r = a->allocate(KvCodec::f16(), KvCodec::f16(), 0);
  std::memset(a->tile(r, 1, 2, 3), 0x5a, 16);
  auto b = KvPool::attach(std::make_unique<BorrowedArena>(bytes.data(), bytes.size()));
  EXPECT_EQ(b->shape().n_layers, 5);
  EXPECT_EQ(b->counters().blocks_used, 1u);
  EXPECT_EQ(b->tile(r, 1, 2, 3), a->tile(r, 1, 2, 3));
  EXPECT_TRUE(b->try_retain(r));
  b->release(r);
  b->release(r);
  EXPECT_EQ(a->counters().blocks_used, 0u);
  // A truncated or scribbled arena is refused with a reason.
  EXPECT_THROW(KvPool::attach(std::make_unique<BorrowedArena>(bytes.data(), 5000)), Error);
  bytes.data()[0] = std::byte{'X'};
  EXPECT_THROW(KvPool::attach(std::make_unique<BorrowedArena>(bytes.data(), bytes.size())), Error);
}

// A block that left every sliding window keeps the global layers' tiles
// alone: fewer pages, the same bytes where they are kept, none where not; the
// arena names the windows, so another process maps the same tiles.
TEST(KvPool, ABlockWithoutItsWindowedLayersKeepsTheGlobalOnes) {
  const KvShape shape{5, 8, 4, 8, {4, 4, 0, 4, 0}};  // layers 2 and 4 global
  HeapArena bytes(1 << 20);
  auto pool = KvPool::create(PoolConfig{shape, 32, 0}, std::make_unique<BorrowedArena>(bytes.data(), bytes.size()));
  const BlockRef whole = pool->allocate(KvCodec::f16(), KvCodec::f16(), kBlockRotatedK, 96);
  const std::size_t tile_bytes = tile_layout(KvCodec::f16(), 32, 8).bytes;
  std::mt19937 rng(3);
  for (int kind = 0; kind < 2; ++kind)
    for (int l = 0; l < 5; ++l)
      for (int h = 0; h < 4; ++h)
        for (std::size_t i = 0; i < tile_bytes; ++i) pool->tile(whole, kind, l, h)[i] = static_cast<std::byte>(rng());
  EXPECT_THROW(pool->without_windowed_layers(whole), Error);  // not full yet
  pool->set_fill(whole, 32);
  const BlockRef lean = pool->without_windowed_layers(whole);
  const BlockInfo info = pool->info(lean);
  EXPECT_EQ(info.flags, kBlockRotatedK | kBlockWindowFreed);
  EXPECT_EQ(info.key_position, 96);
  EXPECT_EQ(info.fill, 32u);
  EXPECT_EQ(pool->pages_for(KvCodec::f16(), KvCodec::f16(), kBlockWindowFreed), 2u * 2 * 4 / 2);  // 2 tiles a page
  EXPECT_EQ(pool->block_bytes(lean) * 5, pool->block_bytes(whole) * 2);
  for (int kind = 0; kind < 2; ++kind)
    for (int l = 0; l < 5; ++l)
      for (int h = 0; h < 4; ++h) {
        const bool global = l == 2 || l == 4;
        EXPECT_EQ(pool->stores_layer(lean, l), global);
        if (global) {
          EXPECT_EQ(0, std::memcmp(pool->stored_tile(lean, kind, l, h), pool->tile(whole, kind, l, h), tile_bytes));
        } else {
          EXPECT_EQ(pool->stored_tile(lean, kind, l, h), nullptr);
          EXPECT_THROW(pool->tile(lean, kind, l, h), Error);
        }
      }
  EXPECT_NE(pool->checksum(lean), pool->checksum(whole));
  EXPECT_EQ(pool->checksum(lean), pool->compute_checksum(lean));
  auto other = KvPool::attach(std::make_unique<BorrowedArena>(bytes.data(), bytes.size()));
  EXPECT_EQ(other->shape(), shape);
  EXPECT_EQ(other->stored_tile(lean, 1, 4, 3), pool->stored_tile(lean, 1, 4, 3));
  EXPECT_EQ(other->stored_tile(lean, 1, 3, 3), nullptr);
  pool->release(whole);
  pool->release(lean);
  EXPECT_EQ(pool->counters().pages_used, 0u);
  // Only a shape with windowed and global layers both has such blocks.
  auto plain = make_pool(1 << 20);
  EXPECT_THROW(plain->allocate(KvCodec::f16(), KvCodec::f16(), kBlockWindowFreed), Error);
  EXPECT_THROW(KvPool::create(PoolConfig{KvShape{5, 8, 4, 8, {4, 4}}, 32, 1 << 20}), Error);  // 2 windows, 5 layers
}

TEST(KvPool, BadGeometryIsRejected) {
  EXPECT_THROW(make_pool(1 << 20, 24), Error);  // not a power of two
  EXPECT_THROW(make_pool(4096), Error);         // no room for a page
  EXPECT_THROW(KvPool::create(PoolConfig{KvShape{1, 2, 2, 12}, 32, 1 << 20}), Error);
}

}  // namespace
}  // namespace qkvshare

namespace qkvshare {
namespace {

struct CountingLedger final : RefLedger {
  std::vector<int> held = std::vector<int>(4096, 0);
  void taken(std::uint32_t b) noexcept override { ++held[b]; }
  void dropping(std::uint32_t b) noexcept override { --held[b]; }
};

TEST(KvPool, LedgerSeesEveryReferenceTakenAndDropped) {
  auto pool = make_pool(1 << 20);
  CountingLedger ledger;
  pool->set_ledger(&ledger);
  const BlockRef a = pool->allocate(KvCodec::f16(), KvCodec::f16(), 0);
  pool->retain(a);
  EXPECT_TRUE(pool->try_retain(a));
  EXPECT_EQ(ledger.held[a.index], 3);
  pool->release(a);
  pool->release(a);
  EXPECT_EQ(ledger.held[a.index], 1);
  pool->release(a);
  EXPECT_FALSE(pool->try_retain(a));  // a refused retain is not a reference
  for (int h : ledger.held) EXPECT_EQ(h, 0);
  EXPECT_FALSE(pool->live_ref(a.index).valid());
  const BlockRef b = pool->allocate(KvCodec::f16(), KvCodec::f16(), 0);
  EXPECT_EQ(pool->live_ref(b.index), b);
  pool->release(b);
  pool->set_ledger(nullptr);
}

TEST(KvPool, RebuildingTheFreeListsKeepsLiveBlocks) {
  auto pool = make_pool(1 << 20);
  std::vector<BlockRef> live;
  for (int i = 0; i < 10; ++i) live.push_back(pool->allocate(KvCodec::f16(), KvCodec::f16(), 0));
  for (int i = 0; i < 10; i += 2) pool->release(live[static_cast<std::size_t>(i)]);
  const PoolCounters before = pool->counters();
  pool->rebuild_free_lists();
  const PoolCounters after = pool->counters();
  EXPECT_EQ(after.blocks_used, before.blocks_used);
  EXPECT_EQ(after.pages_free, before.pages_free);
  // Allocating everything left never hands out a page a live block holds.
  std::memset(pool->tile(live[1], 0, 0, 0), 0x77, 64);
  std::vector<BlockRef> more;
  try {
    for (;;) more.push_back(pool->allocate(KvCodec::f16(), KvCodec::f16(), 0));
  } catch (const Error&) {
  }
  for (const BlockRef r : more) std::memset(pool->tile(r, 0, 0, 0), 0, 64);
  EXPECT_EQ(pool->tile(live[1], 0, 0, 0)[63], std::byte{0x77});
  for (const BlockRef r : more) pool->release(r);
  for (int i = 1; i < 10; i += 2) pool->release(live[static_cast<std::size_t>(i)]);
  EXPECT_EQ(pool->counters().pages_free, pool->counters().pages_total);
}

}  // namespace
}  // namespace qkvshare
