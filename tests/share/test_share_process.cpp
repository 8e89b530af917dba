// Across processes (fork without exec, each child attaching the named pool
// like an independent program would): handoff, a producer killed with
// SIGKILL while holding references, and 10,000 random operations.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <optional>
#include <thread>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/generate.hpp"
#include "share_test_util.hpp"

namespace qkvshare {
namespace {

using testing::PoolName;
using testing::spawn;
using testing::wait_exit;

std::vector<TokenId> read_ids(const std::string& path) {
  std::ifstream in(path);
  std::vector<TokenId> ids;
  for (TokenId t; in >> t;) ids.push_back(t);
  return ids;
}
void write_ids(const std::string& path, const std::vector<TokenId>& ids) {
  std::ofstream out(path);
  for (TokenId t : ids) out << t << ' ';
}

GenerateOptions greedy(int n) {
  GenerateOptions o;
  o.max_new_tokens = n;
  o.sampling.temperature = 0;
  o.stop_at_end_of_generation = false;
  return o;
}

// Producer: prompt, generate, feed the last token, seal and grant to B.
Descriptor produce(SharePool& pool, Engine& engine, const ModelFingerprint& fp, const std::string& format,
                   std::unique_ptr<Session>& session) {
  const Tokenizer& tok = engine.model().tokenizer();
  std::vector<TokenId> prompt{tok.bos_id()};
  const auto body = tok.encode("Lily had a red ball");
  prompt.insert(prompt.end(), body.begin(), body.end());
  session = new_pooled_session(pool, engine, KvFormat::parse(format), 512);
  const GenerateResult r = generate(engine, *session, prompt, greedy(12));
  engine.forward(*session, std::vector<TokenId>{r.tokens.back()});
  const SealedContext sealed = seal_session(pool, engine, fp, *session, "A");
  const Descriptor d = pool.grant(sealed, "A", "B");
  pool.release(sealed);
  return d;
}

// Consumer: open, continue with more text, return the generated ids.
std::vector<TokenId> consume(SharePool& pool, Engine& engine, const ModelFingerprint& fp, const Descriptor& d) {
  HandoffResult h = open_session(pool, engine, fp, d, "B", {HandoffMode::kv});
  const auto more = engine.model().tokenizer().encode(" and a big dog");
  return generate(engine, *h.session, more, greedy(12)).tokens;
}

TEST(ShareProcess, TwoProcessHandoffMatchesOneProcess) {
  auto model = testing::load_stories();
  const ModelFingerprint fp = model_fingerprint(*model);
  for (const char* format : {"f32", "k8v4"}) {
    std::vector<TokenId> want;
    {
      auto pool = SharePool::create_anonymous(testing::small_config());
      Engine engine(*model, EngineOptions{1});
      std::unique_ptr<Session> s;
      const Descriptor d = produce(*pool, engine, fp, format, s);
      want = consume(*pool, engine, fp, d);
    }
    PoolName name("twoproc");
    auto pool = SharePool::create(name.name, testing::small_config());
    const std::string dir = testing::temp_dir();
    const pid_t a = spawn([&] {
      auto p = SharePool::attach(name.name);
      Engine engine(*model, EngineOptions{1});
      std::unique_ptr<Session> s;
      write_descriptor_file(dir + "/a.desc", produce(*p, engine, fp, format, s));
      return 0;
    });
    ASSERT_EQ(wait_exit(a), 0);
    const pid_t b = spawn([&] {
      auto p = SharePool::attach(name.name);
      Engine engine(*model, EngineOptions{1});
      const Descriptor d = read_descriptor_file(dir + "/a.desc");
      write_ids(dir + "/b.ids", consume(*p, engine, fp, d));
      p->release(d, "B");
      return 0;
    });
    ASSERT_EQ(wait_exit(b), 0);
    EXPECT_EQ(read_ids(dir + "/b.ids"), want) << format;
    const ShareStats st = pool->stats();
    EXPECT_EQ(st.kv.blocks_used, 0u) << format;
    EXPECT_EQ(st.contexts, 0);
    EXPECT_EQ(st.processes, 1);  // only this one is left
  }
}

// Waits until `fd` gives one byte (a child saying "ready").
void wait_ready(int fd) {
  char c = 0;
  ASSERT_EQ(::read(fd, &c, 1), 1);
}

// A named pool with stories260K, as every test here starts.
struct ProcessWorld {
  std::unique_ptr<Model> model = testing::load_stories();
  ModelFingerprint fp = model_fingerprint(*model);
  PoolName name;
  std::shared_ptr<SharePool> pool;
  Engine engine{*model, EngineOptions{1}};
  std::shared_ptr<KvPool> kv;
  std::uint32_t free_start = 0;

  explicit ProcessWorld(const char* what, ShareConfig config = testing::small_config())
      : name(what), pool(SharePool::create(name.name, config)), kv(pool->kv_pool(engine.kv_shape())),
        free_start(kv->counters().blocks_free) {}
};

// Reaps `pid` after a SIGKILL: once the kernel has torn it down (a zombie
// holds nothing), before it is waited for. Returns the processes reaped.
int kill_and_reap(SharePool& pool, pid_t pid) {
  EXPECT_EQ(::kill(pid, SIGKILL), 0);
  int reaped = 0;
  for (int i = 0; i < 1000 && reaped == 0; ++i) {
    reaped = pool.reap();
    if (reaped == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return reaped;
}

TEST(ShareProcess, KilledProducerIsReclaimedAndOtherContextsStayIntact) {
  ProcessWorld w("crash");
  auto& [model, fp, name, pool, engine, kv, free_start] = w;

  // B (this process) has its own context before A starts.
  std::unique_ptr<Session> mine;
  const Descriptor own = produce(*pool, engine, fp, "int8", mine);
  auto b_session = std::make_unique<Session>(dynamic_cast<PooledKvCache&>(mine->cache()).fork(), mine->tokens());
  const std::uint32_t free_with_b = kv->counters().blocks_free;

  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const std::string dir = testing::temp_dir();
  const pid_t a = spawn([&] {
    auto p = SharePool::attach(name.name);
    Engine e(*model, EngineOptions{1});
    // Holds: its own sessions, a sealed context (producer's claim), and B's
    // context opened as a copy reader (references on B's blocks, not the
    // grant's custody: a holding open and its crash are the next test's).
    std::unique_ptr<Session> s1, s2;
    write_descriptor_file(dir + "/a.desc", produce(*p, e, fp, "int4", s1));
    const SealedContext claim = seal_session(*p, e, fp, *s1, "A");
    (void)claim;
    HandoffResult opened = open_session(*p, e, fp, own, "B", {HandoffMode::automatic, false, 0, GrantUse::copy});
    e.forward(*opened.session, std::vector<TokenId>{5, 6, 7});
    s2 = new_pooled_session(*p, e, KvFormat::parse("f16"), 512);
    e.forward(*s2, std::vector<TokenId>(40, 9));
    const char c = 'r';
    if (::write(ready[1], &c, 1) != 1) return 2;
    for (;;) ::pause();  // killed here
  });
  wait_ready(ready[0]);
  EXPECT_LT(kv->counters().blocks_free, free_with_b);
  EXPECT_EQ(kill_and_reap(*pool, a), 1);
  EXPECT_EQ(wait_exit(a), 128 + SIGKILL);
  // A's grant to B (from produce) was never opened, so it was still in A's
  // custody: A's crash voids it (the pool cannot tell whether it was passed
  // on) and B falls back to text. Everything A held is back.
  ShareStats st = pool->stats();
  EXPECT_EQ(st.processes, 1);
  EXPECT_GE(st.counters.references_reaped, 1u);
  EXPECT_EQ(st.contexts, 1);  // B's own context
  // B's context is intact: continuing gives what it gave before A existed.
  auto again = open_session(*pool, engine, fp, own, "B", {HandoffMode::kv, true});
  ASSERT_TRUE(again.kv);
  const auto x = engine.forward(*again.session, std::vector<TokenId>{11});
  const std::vector<float> xv(x.begin(), x.end());
  const auto y = engine.forward(*b_session, std::vector<TokenId>{11});
  EXPECT_EQ(0, std::memcmp(xv.data(), y.data(), xv.size() * sizeof(float)));
  // Release everything: the pool is back to where it started.
  again.session.reset();
  b_session.reset();
  mine.reset();
  pool->release(own, "B");
  try {
    pool->release(read_descriptor_file(dir + "/a.desc"), "B");
    ADD_FAILURE() << "a grant in a crashed producer's custody outlived it";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::bad_descriptor) << e.what();
  }
  ::close(ready[0]);
  ::close(ready[1]);
  st = pool->stats();
  EXPECT_EQ(st.contexts, 0);
  EXPECT_EQ(st.grants, 0);
  EXPECT_EQ(kv->counters().blocks_free, free_start);
}

// The grant (if any) whose context is `d`'s, as pool ls lists it.
std::optional<GrantInfo> grant_of(SharePool& pool, const Descriptor& d) {
  for (const GrantInfo& g : pool.grants())
    if (g.slot == d.grant_slot && g.generation == d.grant_generation) return g;
  return std::nullopt;
}

TEST(ShareProcess, KilledHolderVoidsTheGrantItOpenedAndTheContextIsFreed) {
  ProcessWorld w("holder");
  auto& [model, fp, name, pool, engine, kv, free_start] = w;
  std::unique_ptr<Session> producer;
  const Descriptor d = produce(*pool, engine, fp, "int8", producer);  // A's claim is released: the grant keeps it
  producer.reset();
  ASSERT_EQ(grant_of(*pool, d)->state, GrantStatus::issued);

  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t b = spawn([&] {
    auto p = SharePool::attach(name.name);
    Engine e(*model, EngineOptions{1});
    HandoffResult h = open_session(*p, e, fp, d, "B", {HandoffMode::kv});  // GrantUse::hold: B has custody
    if (!h.kv) return 3;
    e.forward(*h.session, std::vector<TokenId>{5, 6, 7});
    const char c = 'r';
    if (::write(ready[1], &c, 1) != 1) return 2;
    for (;;) ::pause();  // killed here, without releasing the grant
  });
  wait_ready(ready[0]);
  const std::optional<GrantInfo> held = grant_of(*pool, d);
  ASSERT_TRUE(held.has_value());
  EXPECT_EQ(held->state, GrantStatus::held);
  EXPECT_EQ(held->holder_pid, b);
  EXPECT_EQ(held->grantee, "B");
  EXPECT_LT(kv->counters().blocks_free, free_start);
  EXPECT_EQ(kill_and_reap(*pool, b), 1);
  EXPECT_EQ(wait_exit(b), 128 + SIGKILL);
  // Nobody else could release the grant B held: the reaper voided it, and
  // with it the context (no producer claim, no other grant) and its blocks.
  const ShareStats st = pool->stats();
  EXPECT_EQ(st.counters.grants_reaped, 1u);
  EXPECT_EQ(st.grants, 0);
  EXPECT_EQ(st.contexts, 0);
  EXPECT_FALSE(grant_of(*pool, d).has_value());
  EXPECT_EQ(kv->counters().blocks_free, free_start);
  try {
    pool->release(d, "B");
    ADD_FAILURE() << "a grant whose holder crashed outlived it";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::bad_descriptor) << e.what();
  }
  ::close(ready[0]);
  ::close(ready[1]);
}

TEST(ShareProcess, AHolderThatExitsCleanlyLeavesItsGrantDelivered) {
  ProcessWorld w("deliver");
  auto& [model, fp, name, pool, engine, kv, free_start] = w;
  std::unique_ptr<Session> producer;
  const Descriptor d = produce(*pool, engine, fp, "int4", producer);
  producer.reset();
  const pid_t b = spawn([&] {
    auto p = SharePool::attach(name.name);
    Engine e(*model, EngineOptions{1});
    HandoffResult h = open_session(*p, e, fp, d, "B", {HandoffMode::kv});
    return h.kv ? 0 : 3;  // exits without releasing: the grant outlives the opener
  });
  EXPECT_EQ(wait_exit(b), 0);
  pool->reap();
  const std::optional<GrantInfo> left = grant_of(*pool, d);
  ASSERT_TRUE(left.has_value());
  EXPECT_EQ(left->state, GrantStatus::delivered);
  EXPECT_EQ(left->holder_pid, 0);
  EXPECT_EQ(pool->stats().counters.grants_reaped, 0u);
  // The grantee (or a later process acting for it) still releases it.
  pool->release(d, "B");
  EXPECT_EQ(pool->stats().contexts, 0);
  EXPECT_EQ(kv->counters().blocks_free, free_start);
}

TEST(ShareLease, AHolderIsIdleAfterTheLeaseAndCommitsOrTouchRenewIt) {
  ShareConfig config = testing::small_config();
  config.lease_ms = 300;  // long enough that a loaded (or sanitized) run checks within it
  ProcessWorld w("lease", config);
  auto& [model, fp, name, pool, engine, kv, free_start] = w;
  EXPECT_EQ(pool->lease_ms(), 300);
  std::unique_ptr<Session> producer;
  const Descriptor d = produce(*pool, engine, fp, "int8", producer);
  HandoffResult h = open_session(*pool, engine, fp, d, "B", {HandoffMode::kv});
  ASSERT_TRUE(h.kv);
  EXPECT_EQ(grant_of(*pool, d)->state, GrantStatus::held);
  EXPECT_EQ(grant_of(*pool, d)->holder_pid, ::getpid());
  EXPECT_EQ(pool->stats().grants_held, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_EQ(grant_of(*pool, d)->state, GrantStatus::idle);
  EXPECT_GE(grant_of(*pool, d)->idle_ms, 350u);
  EXPECT_EQ(pool->stats().grants_idle, 1);
  // Decoding on the opened context renews the lease (its cache's commits).
  engine.forward(*h.session, std::vector<TokenId>{5, 6, 7});
  EXPECT_EQ(grant_of(*pool, d)->state, GrantStatus::held);
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_EQ(grant_of(*pool, d)->state, GrantStatus::idle);
  pool->touch(d);  // a holder working on it without committing
  EXPECT_EQ(grant_of(*pool, d)->state, GrantStatus::held);
  // A copy reader takes neither custody nor the lease: the grant stays the issuer's.
  const Descriptor d2 = pool->grant(seal_session(*pool, engine, fp, *producer, "A"), "A", "C");
  HandoffResult copy = open_session(*pool, engine, fp, d2, "C", {HandoffMode::kv, false, 0, GrantUse::copy});
  ASSERT_TRUE(copy.kv);
  EXPECT_EQ(grant_of(*pool, d2)->state, GrantStatus::issued);
  EXPECT_EQ(grant_of(*pool, d2)->holder_pid, ::getpid());
}

}  // namespace
}  // namespace qkvshare
