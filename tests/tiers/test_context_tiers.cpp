// ContextTiers on its own (no orchestrator): the victim is the context needed
// furthest ahead, the next step's input is prefetched on a background thread
// (run under ThreadSanitizer in CI), and a restored context opens exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <filesystem>
#include <thread>

#include "qkvshare/core/error.hpp"
#include "qkvshare/tiers/context_tiers.hpp"
#include "share/share_test_util.hpp"

namespace qkvshare {
namespace {

class Tiers : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::load_stories();
    fp_ = model_fingerprint(*model_);
    engine_ = std::make_unique<Engine>(*model_, EngineOptions{1});
    pool_ = SharePool::create_anonymous(testing::small_config());
    pool_->kv_pool(engine_->kv_shape());
  }

  // A context of `n` tokens sealed by `producer`, granted to `consumer`; returns the expected logits of 3 more tokens.
  std::vector<float> produce(const std::string& producer, const std::string& consumer, int n,
                             std::map<std::string, Descriptor>& grants, const char* format = "int4") {
    auto s = new_pooled_session(*pool_, *engine_, KvFormat::parse(format), 512);
    std::vector<TokenId> ids{model_->tokenizer().bos_id()};
    for (int i = 1; i < n; ++i) ids.push_back(static_cast<TokenId>(20 + (i * 37 + producer.size()) % 400));
    engine_->forward(*s, ids);
    const SealedContext sealed = seal_session(*pool_, *engine_, fp_, *s, producer);
    grants[consumer] = pool_->grant(sealed, producer, consumer);
    pool_->release(sealed);
    auto fork = std::make_unique<Session>(dynamic_cast<const PooledKvCache&>(s->cache()).fork(), s->tokens());
    s.reset();
    const auto l = engine_->forward(*fork, std::vector<TokenId>{5, 6, 7}, true);
    return {l.begin(), l.end()};
  }

  std::vector<float> open_and_continue(const Descriptor& d, const std::string& consumer) {
    HandoffResult h = open_session(*pool_, *engine_, fp_, d, consumer, {HandoffMode::kv, true});
    EXPECT_TRUE(h.kv);
    const auto l = engine_->forward(*h.session, std::vector<TokenId>{5, 6, 7}, true);
    std::vector<float> out(l.begin(), l.end());
    h.session.reset();
    pool_->release(d, consumer);
    return out;
  }

  std::unique_ptr<Model> model_;
  ModelFingerprint fp_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<SharePool> pool_;
};

TEST_F(Tiers, EvictsTheContextNeededLastAndPrefetchesItBeforeItsConsumer) {
  const std::map<std::string, int> position{{"c1", 2}, {"c2", 3}};
  std::map<std::string, Descriptor> g1, g2;
  const auto want1 = produce("p1", "c1", 200, g1);
  const auto want2 = produce("p2", "c2", 200, g2);
  const std::size_t both = pool_->stats().kv.bytes_used;
  TierOptions o;
  o.budget_bytes = both * 6 / 10;  // room for one of the two
  o.spill_dir = testing::temp_dir() + "/tiers";
  {
    ContextTiers tiers(*pool_, o);
    tiers.add("p1", g1, position);
    tiers.add("p2", g2, position);
    tiers.step_finished(1);  // p2's consumer runs later: p2 goes to disk
    TierStats st = tiers.stats();
    EXPECT_EQ(st.spills, 1);
    EXPECT_LE(pool_->stats().kv.bytes_used, o.budget_bytes);
    // c1 runs; p2 is needed next, and p1 is not needed after c1, so p2 fits
    // the budget after this step: it is prefetched while c1 runs.
    tiers.step_started(2);
    const Descriptor d1 = tiers.acquire("p1", "c1");
    const auto got1 = open_and_continue(d1, "c1");
    tiers.consumed("p1", "c1");
    tiers.step_finished(2);
    EXPECT_EQ(0, std::memcmp(want1.data(), got1.data(), want1.size() * sizeof(float)));
    tiers.step_started(3);
    const Descriptor d2 = tiers.acquire("p2", "c2");
    st = tiers.stats();
    EXPECT_EQ(st.prefetches, 1);
    EXPECT_EQ(st.restores_on_demand, 0);
    const auto got2 = open_and_continue(d2, "c2");
    EXPECT_EQ(0, std::memcmp(want2.data(), got2.data(), want2.size() * sizeof(float)));
    tiers.consumed("p2", "c2");
    EXPECT_TRUE(std::filesystem::is_empty(o.spill_dir));
  }
  EXPECT_EQ(pool_->stats().contexts, 0);
}

// Nothing fits at rest and nothing is prefetched: every context at rest goes to a fresh folder.
TierOptions tiers_spill_all() {
  TierOptions o;
  o.budget_bytes = 1;
  o.spill_dir = testing::temp_dir() + "/tiers";
  o.prefetch = false;
  return o;
}

TEST_F(Tiers, ContextOnDiskWhenItsConsumerStartsIsRestoredOnDemand) {
  const std::map<std::string, int> position{{"c1", 1}};
  std::map<std::string, Descriptor> g1;
  const auto want = produce("p1", "c1", 150, g1);
  TierOptions o = tiers_spill_all();
  ContextTiers tiers(*pool_, o);
  tiers.add("p1", g1, position);
  tiers.step_finished(0);
  EXPECT_EQ(pool_->stats().kv.bytes_used, 0u);
  tiers.step_started(1);
  const Descriptor d = tiers.acquire("p1", "c1");
  EXPECT_EQ(tiers.stats().restores_on_demand, 1);
  EXPECT_NE(d.context_id, g1.at("c1").context_id);  // a new record, the same context
  const auto got = open_and_continue(d, "c1");
  EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
  tiers.consumed("p1", "c1");
  EXPECT_THROW(tiers.acquire("p1", "c1"), Error);
}

// The largest logit difference relative to the largest logit.
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::abs(double(a[i]) - b[i]));
    m = std::max(m, std::abs(double(a[i])));
  }
  return d / m;
}

TEST_F(Tiers, DemotesContextsAtRestBeforeSpillingAny) {
  const std::map<std::string, int> position{{"c1", 2}, {"c2", 3}};
  std::map<std::string, Descriptor> g1, g2;
  const auto want1 = produce("p1", "c1", 200, g1, "int8");
  const auto want2 = produce("p2", "c2", 200, g2, "int8");
  const std::size_t both = pool_->stats().kv.bytes_used;
  // The same context made in int4 from the start: how far int4 moves the logits by itself.
  std::map<std::string, Descriptor> g3;
  const auto native4 = produce("p3", "c3", 200, g3, "int4");
  const std::size_t int4_bytes = pool_->stats().kv.bytes_used - both;
  pool_->revoke(g3.at("c3"), "p3");
  const double int4_diff = rel_diff(want1, native4);
  TierOptions o;
  o.budget_bytes = int4_bytes * 9 / 4;  // both fit in int4, not one of them in int8
  ASSERT_LT(o.budget_bytes, both / 2 + int4_bytes);
  o.spill_dir = testing::temp_dir() + "/tiers";
  o.demote = KvFormat::parse("int4");
  {
    ContextTiers tiers(*pool_, o);
    tiers.add("p1", g1, position);
    tiers.add("p2", g2, position);
    tiers.step_finished(1);
    const TierStats st = tiers.stats();
    EXPECT_EQ(st.spills, 0);
    EXPECT_TRUE(st.failures.empty());
    ASSERT_EQ(st.demotions.size(), 2u);
    EXPECT_EQ(st.demotions[0].producer, "p2");  // needed last: demoted first
    for (const TierDemotion& d : st.demotions) {
      EXPECT_EQ(d.from, "int8");
      EXPECT_EQ(d.to, "int4");
      EXPECT_LT(d.bytes_after, d.bytes_before);
      EXPECT_GT(d.k_rel_rms, 0.0);
      EXPECT_LT(d.k_rel_rms, 0.2);
      EXPECT_GT(d.v_rel_rms, 0.0);
      EXPECT_LT(d.v_rel_rms, 0.2);
    }
    EXPECT_LE(pool_->stats().kv.bytes_used, o.budget_bytes);
    // The consumers open the demoted contexts (new records, int4) and continue
  // about as near the int8 logits as an int4 context made so from the start.
    for (const auto& [producer, consumer, want] :
         {std::tuple{"p1", "c1", &want1}, std::tuple{"p2", "c2", &want2}}) {
      tiers.step_started(position.at(consumer));
      const Descriptor d = tiers.acquire(producer, consumer);
      EXPECT_EQ(d.format()->to_string(), "int4");
      const auto got = open_and_continue(d, consumer);
      const double diff = rel_diff(*want, got);
      EXPECT_GT(diff, 0.0) << producer;
      EXPECT_LE(diff, 1.25 * int4_diff) << producer;  // about what int4 does from the start
      tiers.consumed(producer, consumer);
      tiers.step_finished(position.at(consumer));
    }
  }
  EXPECT_EQ(pool_->stats().contexts, 0);
  EXPECT_EQ(pool_->stats().kv.bytes_used, 0u);
}

TEST_F(Tiers, DemotedContextIsSpilledWhenTheBudgetStillDoesNotHold) {
  const std::map<std::string, int> position{{"c1", 1}};
  std::map<std::string, Descriptor> g1;
  produce("p1", "c1", 150, g1, "int8");
  TierOptions o;
  o.budget_bytes = 1;
  o.spill_dir = testing::temp_dir() + "/tiers";
  o.prefetch = false;
  o.demote = KvFormat::parse("int4");
  ContextTiers tiers(*pool_, o);
  tiers.add("p1", g1, position);
  tiers.step_finished(0);
  EXPECT_EQ(pool_->stats().kv.bytes_used, 0u);
  const TierStats st = tiers.stats();
  EXPECT_EQ(st.demotions.size(), 1u);
  EXPECT_EQ(st.spills, 1);
  const Descriptor d = tiers.acquire("p1", "c1");  // restored from disk as it was demoted
  EXPECT_EQ(d.format()->to_string(), "int4");
  open_and_continue(d, "c1");
  tiers.consumed("p1", "c1");
}

TEST_F(Tiers, FailedDemotionLeavesTheContextAsItWasAndSaysWhy) {
  const std::map<std::string, int> position{{"c1", 1}};
  std::map<std::string, Descriptor> g1;
  const auto want = produce("p1", "c1", 150, g1, "int8");
  TierOptions o;
  o.budget_bytes = 1;
  o.spill_dir = testing::temp_dir() + "/tiers";
  o.prefetch = false;
  o.demote = KvFormat::parse("int4:rot=k");  // keys stored otherwise than the context's
  ContextTiers tiers(*pool_, o);
  tiers.add("p1", g1, position);
  tiers.step_finished(0);
  const TierStats st = tiers.stats();
  EXPECT_TRUE(st.demotions.empty());
  ASSERT_EQ(st.failures.size(), 1u);
  EXPECT_NE(st.failures[0].find("demotion of 'p1' to int4:rot=k failed"), std::string::npos) << st.failures[0];
  EXPECT_EQ(st.spills, 1);  // then spilled as without demotion, and restored exactly
  const Descriptor d = tiers.acquire("p1", "c1");
  const auto got = open_and_continue(d, "c1");
  EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
  tiers.consumed("p1", "c1");
}

// The state `pool` lists for the grant `d`, or "" when it is gone.
std::string tier_grant_state(SharePool& pool, const Descriptor& d) {
  for (const GrantInfo& g : pool.grants())
    if (g.slot == d.grant_slot && g.generation == d.grant_generation) return std::string(to_string(g.state));
  return "";
}

TEST_F(Tiers, ContextHeldByAnIdleHolderIsTheFirstVictimWhateverItsNextUse) {
  ShareConfig config = testing::small_config();
  config.lease_ms = 50;
  pool_ = SharePool::create_anonymous(config);
  pool_->kv_pool(engine_->kv_shape());
  const std::map<std::string, int> position{{"c1", 2}, {"c2", 5}};
  std::map<std::string, Descriptor> g1, g2;
  produce("p1", "c1", 200, g1);
  produce("p2", "c2", 200, g2);
  const std::size_t both = pool_->stats().kv.bytes_used;
  // c1's holder opened its context, then stopped using it without releasing the grant.
  {
    HandoffResult h = open_session(*pool_, *engine_, fp_, g1.at("c1"), "c1", {HandoffMode::kv});
    ASSERT_TRUE(h.kv);
  }
  for (int i = 0; i < 2000 && tier_grant_state(*pool_, g1.at("c1")) != "idle"; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(tier_grant_state(*pool_, g1.at("c1")), "idle");
  TierOptions o;
  o.budget_bytes = both * 6 / 10;  // room for one of the two
  o.spill_dir = testing::temp_dir() + "/tiers";
  o.prefetch = false;
  ContextTiers tiers(*pool_, o);
  tiers.add("p1", g1, position);
  tiers.add("p2", g2, position);
  tiers.step_finished(1);  // by next use p2 would go; p1's holder is idle, so p1 goes
  const TierStats st = tiers.stats();
  EXPECT_EQ(st.idle_victims, 1);
  EXPECT_EQ(st.evictions, 1);
  EXPECT_FALSE(pool_->check(g1.at("c1")).live);
  EXPECT_TRUE(pool_->check(g2.at("c2")).live);
  EXPECT_LE(pool_->stats().kv.bytes_used, o.budget_bytes);
  tiers.consumed("p1", "c1");
  tiers.consumed("p2", "c2");
  pool_->release(g2.at("c2"), "c2");
}

TEST_F(Tiers, ContextAHolderIsUsingIsNeverAVictim) {
  const std::map<std::string, int> position{{"c1", 9}, {"c2", 2}};
  std::map<std::string, Descriptor> g1, g2;
  produce("p1", "c1", 200, g1);
  produce("p2", "c2", 200, g2);
  // c1 holds its context (opened within the pool's 30 s lease), though its next use is the furthest.
  HandoffResult h = open_session(*pool_, *engine_, fp_, g1.at("c1"), "c1", {HandoffMode::kv});
  ASSERT_TRUE(h.kv);
  ASSERT_EQ(tier_grant_state(*pool_, g1.at("c1")), "held");
  TierOptions o = tiers_spill_all();
  ContextTiers tiers(*pool_, o);
  tiers.add("p1", g1, position);
  tiers.add("p2", g2, position);
  tiers.step_finished(1);
  const TierStats st = tiers.stats();
  EXPECT_EQ(st.idle_victims, 0);
  EXPECT_EQ(st.evictions, 1);  // p2 only
  EXPECT_TRUE(pool_->check(g1.at("c1")).live);
  EXPECT_FALSE(pool_->check(g2.at("c2")).live);
  h.session.reset();
  pool_->release(g1.at("c1"), "c1");
  tiers.consumed("p1", "c1");
  tiers.consumed("p2", "c2");
}

}  // namespace
}  // namespace qkvshare
