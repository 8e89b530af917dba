// Block checksums kept in the pool and computed in the background (issue 16
// item 2): a full block's checksum is kept once computed, never a partly
// filled one's; a cache hands each block it fills to the background thread;
// after fork() the parent's thread goes on and the child, which may not start
// threads, leaves its checksums to the seal.
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kv_test_util.hpp"
#include "qkvshare/kv/block_checksums.hpp"
#include "qkvshare/kv/kv_pool.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare {
namespace {

using testing::kStoriesKvShape;

std::shared_ptr<KvPool> make_pool() { return KvPool::create(PoolConfig{kStoriesKvShape, 32, 4u << 20}); }

// Writes n tokens of random K/V in passes of `chunk` tokens.
void fill(PooledKvCache& cache, int n, int chunk, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  std::vector<float> k(static_cast<std::size_t>(chunk) * kStoriesKvShape.kv_dim()), v(k.size());
  for (int done = 0; done < n; done += chunk) {
    const int m = std::min(chunk, n - done);
    for (int l = 0; l < kStoriesKvShape.n_layers; ++l) {
      for (auto& x : k) x = g(rng);
      for (auto& x : v) x = g(rng);
      cache.write(l, m, k.data(), v.data());
    }
    cache.commit(m);
  }
}

// Restores the process-wide switch whatever a test does.
struct BackgroundChecksums {
  explicit BackgroundChecksums(bool on) { kv::set_background_checksums(on); }
  ~BackgroundChecksums() { kv::set_background_checksums(true); }
};

TEST(KvPool, ChecksumIsKeptOnlyOnceTheBlockIsFull) {
  auto pool = make_pool();
  const BlockRef b = pool->allocate(KvCodec::f16(), KvCodec::f16(), 0);
  pool->tile(b, 0, 0, 0)[0] = std::byte{7};
  pool->set_fill(b, 5);
  const std::uint64_t partial = pool->checksum(b);
  EXPECT_FALSE(pool->checksum_kept(b)) << "a partly filled block can still change";
  pool->tile(b, 1, 4, 3)[1] = std::byte{9};  // a row appended in place
  EXPECT_NE(pool->checksum(b), partial) << "the checksum must follow the bytes";
  pool->set_fill(b, 32);
  const std::uint64_t full = pool->checksum(b);
  EXPECT_TRUE(pool->checksum_kept(b));
  EXPECT_EQ(full, pool->compute_checksum(b));
  EXPECT_EQ(pool->checksum(b), full);
  // Codecs are part of what is hashed: same zero bytes, another codec.
  const BlockRef c = pool->allocate(KvCodec::f32(), KvCodec::f16(), 0);
  pool->set_fill(c, 32);
  EXPECT_NE(pool->checksum(c), pool->compute_checksum(b));
  // A freed block's index comes back with a new generation and no kept checksum.
  pool->release(b);
  const BlockRef again = pool->allocate(KvCodec::f16(), KvCodec::f16(), 0);
  ASSERT_EQ(again.index, b.index);
  EXPECT_NE(again.generation, b.generation);
  EXPECT_FALSE(pool->checksum_kept(again));
  pool->release(again);
  pool->release(c);
}

TEST(KvPool, ChecksumsOfFilledBlocksAreKeptInTheBackground) {
  for (const char* format : {"f16", "int4", "int8:window=64"}) {
    SCOPED_TRACE(format);
    BackgroundChecksums on(true);
    auto pool = make_pool();
    PooledKvCache cache(pool, KvFormat::parse(format), 256);
    fill(cache, 100, 7, 1);  // three full blocks and a tail of four tokens, in passes that straddle blocks
    kv::wait_for_checksums();
    const std::vector<BlockRef>& blocks = cache.segments().back().blocks;
    ASSERT_EQ(blocks.size(), 4u);
    for (int b = 0; b < 3; ++b) {
      EXPECT_TRUE(pool->checksum_kept(blocks[b])) << "block " << b;
      EXPECT_EQ(pool->checksum(blocks[b]), pool->compute_checksum(blocks[b])) << "block " << b;
    }
    EXPECT_FALSE(pool->checksum_kept(blocks[3]));
  }
}

TEST(KvPool, ChecksumsAreLeftToTheSealWhenTheBackgroundIsOff) {
  BackgroundChecksums off(false);
  auto pool = make_pool();
  PooledKvCache cache(pool, KvFormat::parse("int4"), 256);
  fill(cache, 96, 32, 2);
  kv::wait_for_checksums();
  for (const BlockRef b : cache.segments().back().blocks) EXPECT_FALSE(pool->checksum_kept(b));
}

TEST(KvPool, ChecksumsOfBlocksFreedBeforeTheirTurnAreSkipped) {
  BackgroundChecksums on(true);
  auto pool = make_pool();
  {
    PooledKvCache cache(pool, KvFormat::parse("f16"), 512);
    fill(cache, 320, 32, 3);
  }  // freed, maybe before the thread reached them
  kv::wait_for_checksums();
  EXPECT_EQ(pool->counters().blocks_used, 0u);
  std::weak_ptr<KvPool> gone = pool;
  {
    PooledKvCache cache(pool, KvFormat::parse("f16"), 512);
    pool.reset();  // the cache holds the last reference; jobs hold it weakly
    fill(cache, 320, 32, 4);
  }
  kv::wait_for_checksums();
  EXPECT_TRUE(gone.expired()) << "a queued checksum must not keep a pool alive";
}

TEST(KvPool, AfterForkTheParentKeepsItsThreadAndTheChildStartsNone) {
  BackgroundChecksums on(true);
  auto pool = make_pool();
  PooledKvCache cache(pool, KvFormat::parse("f16"), 512);
  fill(cache, 64, 32, 5);  // the thread exists now
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // No thread here: nothing is kept in the background, and checksum() computes
    // (and keeps) what a seal needs. The exit code says how it went.
    int rc = 0;
    auto own = make_pool();
    PooledKvCache c(own, KvFormat::parse("int8"), 256);
    fill(c, 64, 16, 6);
    kv::wait_for_checksums();  // returns at once
    for (const BlockRef b : c.segments().back().blocks) {
      if (own->checksum_kept(b)) rc = 1;
      if (own->checksum(b) != own->compute_checksum(b) || !own->checksum_kept(b)) rc = 2;
    }
    ::_exit(rc);
  }
  fill(cache, 64, 32, 7);
  kv::wait_for_checksums();
  for (const BlockRef b : cache.segments().back().blocks) EXPECT_TRUE(pool->checksum_kept(b));
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: the child kept checksums in the background; 2: checksum() was wrong";
}

}  // namespace
}  // namespace qkvshare
