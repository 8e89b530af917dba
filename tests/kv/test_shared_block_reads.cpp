// SharedBlockReads: sessions forked from one context read their common prefix
// blocks once per layer for all of their queries, and each session's attention
// output keeps its bits (the pieces are those its own plan computes, merged in
// its own order), on every format and ISA; plans that share nothing, or that
// cannot share (keys stored before RoPE, prefill chunks), are left alone.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kv_test_util.hpp"
#include "qkvshare/kernels/isa.hpp"
#include "qkvshare/kv/kv_pool.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "qkvshare/kv/shared_block_reads.hpp"

namespace qkvshare {
namespace {

using testing::Pass;
using testing::random_pass;

constexpr int kSharedTestBlock = 4;  // 16 blocks (a split-K partition) = 64 tokens

// keys=pre caches rotate keys when they read them: the frequencies for a pass.
void give_rope(KvCache& cache) {
  if (!cache.keys_before_rope()) return;
  KvRope rope;
  const int D = cache.shape().head_dim;
  for (int i = 0; i < D / 2; ++i) rope.inv_freq.push_back(std::pow(10000.0f, -2.0f * static_cast<float>(i) / static_cast<float>(D)));
  cache.set_rope(rope);
}

// Fills `cache` with `n` tokens in passes of 37 (partly filled blocks in between).
void fill_forked(PooledKvCache& cache, int n, unsigned seed, ThreadPool& pool) {
  for (int done = 0; done < n;) {
    give_rope(cache);
    const int m = std::min(37, n - done);
    const Pass p = random_pass(cache.shape(), m, seed + static_cast<unsigned>(done));
    testing::run_pass(cache, p, m, pool);
    done += m;
  }
}

struct Outcome {
  std::vector<std::vector<float>> alone, shared;  // per cache: every layer's outputs
  std::vector<int> groups;                         // per layer
};

// One pass of `rows[i]` tokens for every cache: each layer is planned and run
// for each cache alone, then planned again for all, shared and run together.
Outcome step_both_ways(std::vector<PooledKvCache*> caches, const std::vector<int>& rows, ThreadPool& pool) {
  const KvShape& s = caches.front()->shape();
  std::vector<Pass> passes;
  for (std::size_t i = 0; i < caches.size(); ++i) passes.push_back(random_pass(s, rows[i], 900 + static_cast<unsigned>(i)));
  Outcome o;
  o.alone.resize(caches.size());
  o.shared.resize(caches.size());
  kv::SharedBlockReads sharing;
  for (int l = 0; l < s.n_layers; ++l) {
    std::vector<std::vector<float>> out(caches.size());
    for (std::size_t i = 0; i < caches.size(); ++i) {
      const Pass& p = passes[i];
      if (l == 0) give_rope(*caches[i]);
      caches[i]->write(l, rows[i], p.k[static_cast<std::size_t>(l)].data(), p.v[static_cast<std::size_t>(l)].data());
      out[i].assign(static_cast<std::size_t>(rows[i]) * s.q_dim(), 0.0f);
      caches[i]->attend(l, rows[i], p.q[static_cast<std::size_t>(l)].data(), out[i].data(), pool);
      o.alone[i].insert(o.alone[i].end(), out[i].begin(), out[i].end());
    }
    std::vector<AttendWork*> works;
    for (std::size_t i = 0; i < caches.size(); ++i) {
      std::fill(out[i].begin(), out[i].end(), -1.0f);
      works.push_back(&caches[i]->plan_attend(l, rows[i], passes[i].q[static_cast<std::size_t>(l)].data(), out[i].data()));
    }
    o.groups.push_back(sharing.share(works));
    run_attend_works(works, pool);
    for (std::size_t i = 0; i < caches.size(); ++i) o.shared[i].insert(o.shared[i].end(), out[i].begin(), out[i].end());
  }
  for (std::size_t i = 0; i < caches.size(); ++i) caches[i]->commit(rows[i]);
  return o;
}

void expect_same_bits(const Outcome& o, const std::string& what) {
  for (std::size_t i = 0; i < o.alone.size(); ++i) {
    ASSERT_EQ(o.alone[i].size(), o.shared[i].size());
    EXPECT_EQ(0, std::memcmp(o.alone[i].data(), o.shared[i].data(), o.alone[i].size() * sizeof(float)))
        << what << ", cache " << i;
  }
}

class SharedBlockReadsTest : public ::testing::TestWithParam<const char*> {
 protected:
  KvShape shape_{3, 6, 2, 64};  // GQA groups of 3, head_dim 64 (SmolLM2's)
  std::shared_ptr<KvPool> pool_ = KvPool::create(PoolConfig{shape_, kSharedTestBlock, 64 << 20});
  ThreadPool threads_{2};
};

TEST_P(SharedBlockReadsTest, ForksDecodingTogetherKeepEveryBitOnEveryIsa) {
  testing::IsaGuard guard;
  for (const kernels::Isa isa : kernels::kAllIsas) {
    if (!kernels::isa_available(isa)) continue;
    kernels::set_active_isa(isa);
    const KvFormat f = KvFormat::parse(GetParam());
    PooledKvCache parent(pool_, f, 512);
    fill_forked(parent, 150, 1, threads_);  // 37 full blocks: 2 whole partitions, a third begun
    auto a = parent.fork(), b = parent.fork(), c = parent.fork();
    fill_forked(*c, 70, 50, threads_);      // c moves on: its third partition is its own
    PooledKvCache stranger(pool_, f, 512);  // as deep, other blocks
    fill_forked(stranger, 150, 77, threads_);
    for (int step = 0; step < 3; ++step) {
      const Outcome o = step_both_ways({a.get(), &stranger, b.get(), c.get()}, {1, 1, 1, 1}, threads_);
      const std::string what = std::string(GetParam()) + " " + std::string(kernels::isa_name(isa)) + " step " +
                               std::to_string(step);
      expect_same_bits(o, what);
      for (const int g : o.groups) EXPECT_EQ(g, 1) << what;  // a, b and c; not the stranger
    }
  }
  EXPECT_EQ(pool_->counters().blocks_used, 0u);
}

INSTANTIATE_TEST_SUITE_P(Formats, SharedBlockReadsTest,
                         ::testing::Values("f32", "f16", "int8", "int4", "int3", "int2", "k8v4:rot=kv", "int4:window=16"));

class SharedBlockReadsCases : public SharedBlockReadsTest {};

TEST_F(SharedBlockReadsCases, PrefillChunksAndPreRopeKeysReadAlone) {
  PooledKvCache parent(pool_, KvFormat::parse("int8"), 512);
  fill_forked(parent, 150, 1, threads_);
  auto a = parent.fork(), b = parent.fork();
  // b prefills 6 tokens: a plan with more than a decode step's queries does not split its keys.
  Outcome o = step_both_ways({a.get(), b.get()}, {1, 6}, threads_);
  expect_same_bits(o, "decode + prefill");
  for (const int g : o.groups) EXPECT_EQ(g, 0);

  KvShape s = shape_;
  auto pre_pool = KvPool::create(PoolConfig{s, kSharedTestBlock, 64 << 20});
  PooledKvCache pre(pre_pool, KvFormat::parse("int8:keys=pre"), 512);
  fill_forked(pre, 150, 1, threads_);
  auto p1 = pre.fork(), p2 = pre.fork();
  o = step_both_ways({p1.get(), p2.get()}, {1, 1}, threads_);
  expect_same_bits(o, "keys=pre");
  for (const int g : o.groups) EXPECT_EQ(g, 0);
}

TEST_F(SharedBlockReadsCases, SwitchedOffNothingIsShared) {
  PooledKvCache parent(pool_, KvFormat::parse("int4"), 512);
  fill_forked(parent, 150, 1, threads_);
  auto a = parent.fork(), b = parent.fork();
  kv::set_shared_block_reads(false);
  const Outcome o = step_both_ways({a.get(), b.get()}, {1, 1}, threads_);
  kv::set_shared_block_reads(true);
  expect_same_bits(o, "off");
  for (const int g : o.groups) EXPECT_EQ(g, 0);
}

TEST_F(SharedBlockReadsCases, ShallowForksShareNothing) {
  PooledKvCache parent(pool_, KvFormat::parse("f16"), 512);
  fill_forked(parent, 60, 1, threads_);  // under one partition before the queries
  auto a = parent.fork(), b = parent.fork();
  const Outcome o = step_both_ways({a.get(), b.get()}, {1, 1}, threads_);
  expect_same_bits(o, "shallow");
  for (const int g : o.groups) EXPECT_EQ(g, 0);
}

}  // namespace
}  // namespace qkvshare
