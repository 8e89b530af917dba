// Handoff within one process on stories260K: exact continuation, zero copy,
// fork, lifetime (release, revoke, stale descriptors) and the text fallback.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/kv_codebook.hpp"
#include "share_test_util.hpp"
#include "synthetic_files.hpp"

namespace qkvshare {
namespace {

using testing::load_stories;

class Handoff : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = load_stories();
    fp_ = model_fingerprint(*model_);
    engine_ = std::make_unique<Engine>(*model_, EngineOptions{1});
    pool_ = SharePool::create_anonymous(testing::small_config());
    const Tokenizer& tok = model_->tokenizer();
    prompt_ = {tok.bos_id()};
    const auto body = tok.encode("Once upon a time there was a little dog named Max. He liked to run in the park");
    prompt_.insert(prompt_.end(), body.begin(), body.end());
    more_ = tok.encode(" with his friend, a small cat. One day");
  }

  std::unique_ptr<Session> produce(const std::string& format) {
    auto s = new_pooled_session(*pool_, *engine_, KvFormat::parse(format), 512);
    engine_->forward(*s, prompt_);
    return s;
  }
  std::vector<float> continue_with(Session& s, const std::vector<TokenId>& ids) {
    const auto l = engine_->forward(s, ids, true);
    std::vector<float> out(l.begin(), l.end());
    for (TokenId t : {7, 99}) {  // then decode token by token
      const auto d = engine_->forward(s, std::vector<TokenId>{t});
      out.insert(out.end(), d.begin(), d.end());
    }
    return out;
  }
  // The prompt, then more_ repeated, cut to n tokens.
  std::vector<TokenId> prompt_of(std::size_t n) const {
    std::vector<TokenId> ids = prompt_;
    while (ids.size() < n) ids.insert(ids.end(), more_.begin(), more_.end());
    ids.resize(n);
    return ids;
  }
  // Both continue with more_ and then the same decoded tokens: the same logits, bit for bit.
  void expect_same_continuation(Session& reference, Session& consumer) {
    const auto want = continue_with(reference, more_);
    const auto got = continue_with(consumer, more_);
    ASSERT_EQ(want.size(), got.size());
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
  }
  // Sealed by "A" and granted to "B" through the descriptor's bytes; the seal's own reference released.
  Descriptor granted_to_b(const Session& producer) {
    const SealedContext sealed = seal_session(*pool_, *engine_, fp_, producer, "A");
    const Descriptor d = Descriptor::decode(pool_->grant(sealed, "A", "B").encode());
    pool_->release(sealed);
    return d;
  }
  // The producer continuing itself: a fork of its own cache.
  std::unique_ptr<Session> producer_fork(const Session& s) {
    auto* c = dynamic_cast<const PooledKvCache*>(&s.cache());
    return std::make_unique<Session>(c->fork(), s.tokens());
  }
  std::uint32_t blocks_used() { return pool_->kv_pool_if_any()->counters().blocks_used; }
  void expect_nothing_held() {
    EXPECT_EQ(pool_->stats().contexts, 0);
    EXPECT_EQ(blocks_used(), 0u);
  }

  std::unique_ptr<Model> model_;
  ModelFingerprint fp_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<SharePool> pool_;
  std::vector<TokenId> prompt_, more_;
};

TEST_F(Handoff, ContinuingIsIdenticalToTheProducerContinuingForEveryFormat) {
  for (const char* format : {"f32", "f16", "int8", "int4", "k8v4", "int2:window=32:sink=4", "int4:rot=kv", "int4:keys=pre",
                             "int4:keys=block"}) {
    auto producer = produce(format);
    const Descriptor d = granted_to_b(*producer);
    HandoffResult r = open_session(*pool_, *engine_, fp_, d, "B", {HandoffMode::kv});
    ASSERT_TRUE(r.kv) << format;
    EXPECT_EQ(r.session->tokens(), producer->tokens());
    EXPECT_EQ(r.session->cache().size(), producer->cache().size());
    auto reference = producer_fork(*producer);
    const auto want = continue_with(*reference, more_);
    const auto got = continue_with(*r.session, more_);
    ASSERT_EQ(want.size(), got.size());
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float))) << format;
    pool_->release(d, "B");
  }
  EXPECT_EQ(pool_->stats().contexts, 0);
}

// A mixed format ships demoted (a fork's least attended cold blocks recoded),
// its consumer opens the KV, and the producer keeps its own blocks.
TEST_F(Handoff, AMixedFormatShipsDemotedAndTheProducerKeepsItsPrecision) {
  const KvFormat f = KvFormat::parse("int8:lo=int2:top=0.25");
  auto producer = new_pooled_session(*pool_, *engine_, f, 512);
  const std::vector<TokenId> ids = prompt_of(150);  // 4 full blocks of 32 and a tail
  engine_->forward(*producer, ids);
  const Descriptor d = granted_to_b(*producer);
  ASSERT_TRUE(d.format().has_value());
  EXPECT_EQ(*d.format(), f);
  HandoffResult r = open_session(*pool_, *engine_, fp_, d, "B", {HandoffMode::kv});
  ASSERT_TRUE(r.kv);
  const auto count = [&](const Session& s, const KvCodec& k) {
    int n = 0;
    for (const KvSegment& seg : dynamic_cast<const PooledKvCache&>(s.cache()).segments())
      for (const BlockRef b : seg.blocks) n += pool_->kv_pool_if_any()->info(b).k == k;
    return n;
  };
  EXPECT_EQ(count(*r.session, f.lo_k), 3);  // of 4 cold blocks, the top quarter stays int8
  EXPECT_EQ(count(*r.session, f.k), 1);
  EXPECT_EQ(count(*producer, f.k), 4);
  EXPECT_EQ(count(*producer, f.lo_k), 0);
  for (const float x : continue_with(*r.session, more_)) ASSERT_TRUE(std::isfinite(x));
  pool_->release(d, "B");
  r.session.reset();
  producer.reset();
  expect_nothing_held();
}

// tail=cold ships the partly filled block coded: the descriptor names the
// format, the record's last block is in the cold codecs (fewer bytes than the
// producer's hot tail), the producer keeps its hot tail, and the consumer
// continues exactly as the producer's own context with its tail coded would.
TEST_F(Handoff, AColdTailShipsTheLastBlockCoded) {
  const KvFormat f = KvFormat::parse("int4:tail=cold");
  auto producer = new_pooled_session(*pool_, *engine_, f, 512);
  const std::vector<TokenId> ids = prompt_of(150);  // 4 full blocks of 32 and 22 tokens
  engine_->forward(*producer, ids);
  const Descriptor d = granted_to_b(*producer);
  ASSERT_TRUE(d.format().has_value());
  EXPECT_EQ(*d.format(), f);
  HandoffResult r = open_session(*pool_, *engine_, fp_, d, "B", {HandoffMode::kv});
  ASSERT_TRUE(r.kv) << r.detail;
  const auto last = [&](const Session& s) {
    return pool_->kv_pool_if_any()->info(dynamic_cast<const PooledKvCache&>(s.cache()).segments().back().blocks.back());
  };
  EXPECT_EQ(last(*r.session).k, f.k);
  EXPECT_EQ(last(*r.session).fill, 22u);
  EXPECT_EQ(last(*producer).k, hot_codec(f.k));
  auto reference = producer_fork(*producer);
  ASSERT_TRUE(dynamic_cast<PooledKvCache&>(reference->cache()).code_tail());
  expect_same_continuation(*reference, *r.session);
  pool_->release(d, "B");
  r.session.reset();
  reference.reset();
  producer.reset();
  expect_nothing_held();
}

// A format with a budget ships evicted: the record holds the kept runs of
// blocks as moved segments and their token ids; the consumer continues
// exactly as the producer's own context evicted the same way would, and the
// producer keeps every token.
TEST_F(Handoff, ABudgetShipsTheKeptBlocksAsSegments) {
  const KvFormat f = KvFormat::parse("int8:sink=32:budget=0.5");
  auto producer = new_pooled_session(*pool_, *engine_, f, 512);
  const std::vector<TokenId> ids = prompt_of(300);  // 9 full blocks of 32 and a tail of 12
  engine_->forward(*producer, ids);
  const Descriptor d = granted_to_b(*producer);
  // What the producer's own context becomes when evicted here.
  auto local = dynamic_cast<const PooledKvCache&>(producer->cache()).fork();
  const auto kept = local->evict();
  ASSERT_GE(kept.size(), 2u);  // the sink's run, the last block's, and what the most attended make of them
  std::vector<TokenId> kept_ids;
  for (const auto& [b, e] : kept) kept_ids.insert(kept_ids.end(), ids.begin() + b, ids.begin() + e);
  EXPECT_EQ(kept_ids.size(), 4u * 32 + 12);  // 5 of 10 blocks: four full ones and the tail
  EXPECT_EQ(d.token_count, kept_ids.size());
  EXPECT_EQ(producer->cache().size(), 300);
  HandoffResult r = open_session(*pool_, *engine_, fp_, d, "B", {HandoffMode::kv, true, 0});
  ASSERT_TRUE(r.kv);
  EXPECT_EQ(r.session->tokens(), kept_ids);
  const auto& opened = dynamic_cast<const PooledKvCache&>(r.session->cache());
  // The kept blocks sit where they were computed: the next token comes at position 300.
  EXPECT_EQ(d.position_end - d.position_begin, 300u);
  EXPECT_EQ(opened.next_position(), 300);
  ASSERT_EQ(opened.segments().size(), local->segments().size());
  for (std::size_t i = 0; i < opened.segments().size(); ++i) {
    EXPECT_EQ(opened.segments()[i].position_offset, local->segments()[i].position_offset) << i;
    EXPECT_EQ(opened.segments()[i].blocks, local->segments()[i].blocks) << i;  // the same blocks, not copies
  }
  local->set_rope(engine_->rope());
  auto reference = std::make_unique<Session>(std::move(local), kept_ids);
  expect_same_continuation(*reference, *r.session);
  pool_->release(d, "B");
  r.session.reset();
  reference.reset();
  producer.reset();
  expect_nothing_held();
}

// A pq context ships its codes and names its codebook by id: a consumer
// with that codebook loaded continues exactly as the producer would, and a
// descriptor of a codebook this process has not loaded opens as text.
TEST_F(Handoff, APqContextNamesItsCodebookAndContinuesExactly) {
  const KvShape shape = engine_->kv_shape();
  KvCodebook::Header h = KvCodebook::Header::of(shape, 4, 256);
  h.model = fp_.model;
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> rows(static_cast<std::size_t>(shape.n_layers) * 256 * shape.kv_dim());
  for (float& x : rows) x = g(rng);
  const std::string path = testing::temp_dir() + "/handoff-pq2.kvc";
  CodebookTraining how;
  how.iterations = 2;
  train_codebook(h, rows, rows, 256, how).save(path);
  const KvFormat f = KvFormat::parse("k8vpq2:book=" + path);
  auto producer = new_pooled_session(*pool_, *engine_, f, 512);
  const std::vector<TokenId> ids = prompt_of(100);  // three cold blocks of pq values
  engine_->forward(*producer, ids);
  const Descriptor d = granted_to_b(*producer);
  EXPECT_EQ(d.codebook_id, f.book->id());
  ASSERT_TRUE(d.format());
  EXPECT_EQ(d.format()->book, f.book);
  HandoffResult r = open_session(*pool_, *engine_, fp_, d, "B", {HandoffMode::kv});
  ASSERT_TRUE(r.kv);
  auto reference = producer_fork(*producer);
  expect_same_continuation(*reference, *r.session);
  // Another codebook id: the format is known but has no codebook here; the
  // record does not match it either, so the pool refuses the descriptor.
  Descriptor other = d;
  other.codebook_id ^= 1;
  const Descriptor decoded = Descriptor::decode(other.encode());
  ASSERT_TRUE(decoded.format());
  EXPECT_EQ(decoded.format()->book, nullptr);
  EXPECT_THROW(open_session(*pool_, *engine_, fp_, decoded, "B"), Error);
  pool_->release(d, "B");
  r.session.reset();
  reference.reset();
  producer.reset();
  expect_nothing_held();
}

// A spliced context (segments that start and end inside blocks, at moved
// positions) is sealed as it is and continues identically after the handoff.
TEST_F(Handoff, ASplicedContextIsSealedWithItsSegments) {
  auto producer = produce("int8");
  std::vector<TokenId> more_ids = prompt_;
  more_ids.insert(more_ids.end(), more_.begin(), more_.end());
  engine_->forward(*producer, more_);  // a producer of prompt + more
  auto writer = new_pooled_session(*pool_, *engine_, KvFormat::parse("int8"), 512);
  engine_->forward(*writer, more_);  // the writer's own prefix
  auto& wc = dynamic_cast<PooledKvCache&>(writer->cache());
  const int a = 3, b = static_cast<int>(more_ids.size()) - 2;
  wc.splice(dynamic_cast<const PooledKvCache&>(producer->cache()), a, b, engine_->rope());
  writer->note_placed(std::vector<TokenId>(more_ids.begin() + a, more_ids.begin() + b));
  engine_->forward(*writer, prompt_);  // and its own tail after the splice
  ASSERT_GE(wc.segments().size(), 3u);
  const SealedContext sealed = seal_session(*pool_, *engine_, fp_, *writer, "W");
  const Descriptor d = pool_->grant(sealed, "W", "R");
  pool_->release(sealed);
  HandoffResult r = open_session(*pool_, *engine_, fp_, d, "R", {HandoffMode::kv, true, 0});
  ASSERT_TRUE(r.kv);
  EXPECT_EQ(r.session->tokens(), writer->tokens());
  auto reference = producer_fork(*writer);
  expect_same_continuation(*reference, *r.session);
  pool_->release(d, "R");
}

TEST_F(Handoff, ContextOutlivesItsProducerAndMatchesAFreshRun) {
  auto producer = produce("f32");
  const SealedContext sealed = seal_session(*pool_, *engine_, fp_, *producer, "A");
  const Descriptor d = pool_->grant(sealed, "A", "B");
  producer.reset();
  pool_->release(sealed);  // the grant alone keeps the context
  auto r = open_session(*pool_, *engine_, fp_, d, "B");
  ASSERT_TRUE(r.kv);
  auto fresh = produce("f32");
  const auto want = continue_with(*fresh, more_);
  const auto got = continue_with(*r.session, more_);
  EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
}

TEST_F(Handoff, OpenCopiesNoKvAndForkCopiesOnlyTheTail) {
  auto producer = produce("int8");
  ASSERT_NE(producer->cache().size() % 32, 0);  // a partly filled tail to share
  const SealedContext sealed = seal_session(*pool_, *engine_, fp_, *producer, "A");
  std::vector<Descriptor> ds;
  for (const char* who : {"B", "C", "D"}) ds.push_back(pool_->grant(sealed, "A", who));
  const auto kv = pool_->kv_pool_if_any();
  const std::uint64_t before = kv->counters().allocations;
  std::vector<HandoffResult> consumers;
  for (std::size_t i = 0; i < ds.size(); ++i) consumers.push_back(open_session(*pool_, *engine_, fp_, ds[i], ds[i].grantee));
  EXPECT_EQ(kv->counters().allocations, before);  // zero KV bytes copied on open
  int branch = 0;
  for (auto& c : consumers) {
    ASSERT_TRUE(c.kv);
    const std::uint64_t a0 = kv->counters().allocations;
    auto reference = producer_fork(*producer);
    const std::vector<TokenId> next{static_cast<TokenId>(10 + branch++)};
    const auto want = engine_->forward(*reference, next);
    const std::vector<float> w(want.begin(), want.end());
    const std::uint64_t a1 = kv->counters().allocations;
    const auto got = engine_->forward(*c.session, next);
    EXPECT_EQ(kv->counters().allocations - a1, 1u);  // the shared tail, copied on write
    EXPECT_EQ(a1 - a0, 1u);
    EXPECT_EQ(0, std::memcmp(w.data(), got.data(), w.size() * sizeof(float)));
  }
}

TEST_F(Handoff, ReleasedAndRevokedDescriptorsAreStaleForever) {
  const std::uint32_t start = pool_->kv_pool(engine_->kv_shape())->counters().blocks_used;
  auto producer = produce("int4");
  const SealedContext sealed = seal_session(*pool_, *engine_, fp_, *producer, "A");
  const Descriptor b = pool_->grant(sealed, "A", "B");
  const Descriptor c = pool_->grant(sealed, "A", "C");
  pool_->release(sealed);
  auto opened = open_session(*pool_, *engine_, fp_, b, "B");
  pool_->release(b, "B");
  const auto expect_stale = [&](const Descriptor& d, const char* who) {
    try {
      open_session(*pool_, *engine_, fp_, d, who);
      ADD_FAILURE() << "opened a stale descriptor";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::bad_descriptor);
      EXPECT_NE(std::string(e.what()).find("stale"), std::string::npos) << e.what();
    }
  };
  expect_stale(b, "B");
  EXPECT_NO_THROW(open_session(*pool_, *engine_, fp_, c, "C"));  // C's grant is its own
  pool_->revoke(c, "A");
  expect_stale(c, "C");
  // The session B opened keeps its blocks and carries on.
  EXPECT_NO_THROW(engine_->forward(*opened.session, more_));
  // Reusing the record slot does not revive old descriptors.
  auto again = produce("int4");
  const SealedContext s2 = seal_session(*pool_, *engine_, fp_, *again, "A");
  EXPECT_EQ(s2.slot, sealed.slot);
  EXPECT_NE(s2.generation, sealed.generation);
  expect_stale(b, "B");
  pool_->release(s2);
  EXPECT_THROW(pool_->release(s2), Error);
  opened.session.reset();
  producer.reset();
  again.reset();
  EXPECT_EQ(blocks_used(), start);
}

TEST_F(Handoff, RejectsWrongGranteeForgeryAndOtherPools) {
  auto producer = produce("f16");
  const SealedContext sealed = seal_session(*pool_, *engine_, fp_, *producer, "A");
  const Descriptor d = pool_->grant(sealed, "A", "B");
  const auto expect_bad = [&](const Descriptor& x, const char* who, const char* what) {
    try {
      pool_->open(x, who, true, 512);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::bad_descriptor);
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_bad(d, "C", "granted to 'B', not to 'C'");
  Descriptor forged = d;
  forged.grantee = "C";  // re-encoding fixes the self checksum, not the MAC
  expect_bad(Descriptor::decode(forged.encode()), "C", "capability tag does not verify");
  forged = d;
  forged.token_count = d.token_count - 1;
  forged.position_end = forged.token_count;
  expect_bad(forged, "B", "capability tag");
  forged = d;
  forged.record_generation += 1;
  expect_bad(forged, "B", "capability tag");
  auto other = SharePool::create_anonymous(testing::small_config());
  try {
    other->open(d, "B", false, 512);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("belongs to pool"), std::string::npos) << e.what();
  }
  EXPECT_GE(pool_->stats().counters.rejected, 4u);
}

TEST_F(Handoff, FallsBackToTextAndSaysWhy) {
  auto producer = produce("f32");
  const SealedContext sealed = seal_session(*pool_, *engine_, fp_, *producer, "A");
  const Descriptor d = pool_->grant(sealed, "A", "B");
  // Another model (a fingerprint that differs): automatic -> text.
  ModelFingerprint other = fp_;
  other.model[3] ^= 1;
  auto r = open_session(*pool_, *engine_, other, d, "B");
  EXPECT_FALSE(r.kv);
  EXPECT_EQ(r.fallback, FallbackReason::model);
  EXPECT_EQ(r.prefill_tokens, static_cast<int>(prompt_.size()));
  EXPECT_EQ(r.session->tokens(), producer->tokens());
  // ... and, with the same weights really, the same state as the KV handoff.
  auto kv = open_session(*pool_, *engine_, fp_, d, "B");
  const auto a = continue_with(*r.session, more_);
  const auto b = continue_with(*kv.session, more_);
  float worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  EXPECT_LT(worst, 1e-3f);
  // KV required: a clear error instead.
  try {
    open_session(*pool_, *engine_, other, d, "B", {HandoffMode::kv});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::bad_descriptor);
    EXPECT_NE(std::string(e.what()).find("model fingerprint differs"), std::string::npos) << e.what();
  }
  // Asked for text.
  auto t = open_session(*pool_, *engine_, fp_, d, "B", {HandoffMode::text});
  EXPECT_FALSE(t.kv);
  EXPECT_EQ(t.fallback, FallbackReason::requested);
  // A different tokenizer: the stored text is re-encoded.
  other.tokenizer ^= 1;
  auto x = open_session(*pool_, *engine_, other, d, "B");
  EXPECT_FALSE(x.kv);
  EXPECT_EQ(x.session->tokens(), producer->tokens());  // same text, same tokenizer really
  const ShareCounters c = pool_->stats().counters;
  EXPECT_EQ(c.fallback_model, 2u);
  EXPECT_EQ(c.text_requested, 1u);
  EXPECT_EQ(c.opens_text, 3u);
}

TEST_F(Handoff, CorruptedBlocksAreCaughtByVerifyAndFallBack) {
  auto producer = produce("int8");
  const SealedContext sealed = seal_session(*pool_, *engine_, fp_, *producer, "A");
  const Descriptor d = pool_->grant(sealed, "A", "B");
  EXPECT_TRUE(pool_->check(d, true).blocks_verified);
  auto* cache = dynamic_cast<PooledKvCache*>(&producer->cache());
  const auto kv = pool_->kv_pool_if_any();
  std::byte* tile = kv->tile(cache->segments()[0].blocks[0], 1, 2, 1);
  tile[3] ^= std::byte{0x40};
  const DescriptorStatus st = pool_->check(d, true);
  EXPECT_FALSE(st.blocks_verified);
  EXPECT_NE(st.problem.find("checksum"), std::string::npos) << st.problem;
  HandoffOptions verify;
  verify.verify = true;
  auto r = open_session(*pool_, *engine_, fp_, d, "B", verify);
  EXPECT_FALSE(r.kv);
  EXPECT_EQ(r.fallback, FallbackReason::checksum);
  EXPECT_EQ(pool_->stats().counters.fallback_checksum, 1u);
  // Without verify, open trusts the O(1) checks.
  EXPECT_TRUE(open_session(*pool_, *engine_, fp_, d, "B").kv);
}

TEST_F(Handoff, SealingAgainHashesOnlyNewBlocksAndKeepsTheirChecksums) {
  auto s = produce("int4");
  const SealedContext a = seal_session(*pool_, *engine_, fp_, *s, "A");
  engine_->forward(*s, more_);
  const SealedContext b = seal_session(*pool_, *engine_, fp_, *s, "A");
  const Descriptor db = pool_->grant(b, "A", "B");
  EXPECT_TRUE(pool_->check(db, true).blocks_verified);
  const Descriptor da = pool_->grant(a, "A", "B");
  EXPECT_TRUE(pool_->check(da, true).blocks_verified);
  EXPECT_NE(da.blocks_checksum, db.blocks_checksum);
}

TEST_F(Handoff, SealValidatesItsInputs) {
  auto dense = engine_->new_session(64);
  engine_->forward(*dense, prompt_);
  EXPECT_THROW(seal_session(*pool_, *engine_, fp_, *dense, "A"), Error);
  auto s = produce("f16");
  EXPECT_THROW(seal_session(*pool_, *engine_, fp_, *s, "bad id"), Error);
  auto foreign = SharePool::create_anonymous(testing::small_config());
  EXPECT_THROW(seal_session(*foreign, *engine_, fp_, *s, "A"), Error);
}

// Gemma 3's sliding-window layers (tiny-gemma3: an 8-token window in five
// layers of six): the producer's blocks that left the window were sealed with
// the global layer's tiles alone, and the consumer continues from them exactly
// as the producer does; a fork of the consumer too.
TEST(HandoffWindowed, AConsumerContinuesFromBlocksThatLeftTheWindow) {
  const auto model = Model::load(testing::synthetic_file("tiny-gemma3", GgmlType::Q8_0));
  const ModelFingerprint fp = model_fingerprint(*model);
  Engine engine(*model, EngineOptions{1});
  auto pool = SharePool::create_anonymous(testing::small_config());
  std::vector<TokenId> ids, more;
  for (int i = 0; i < 100; ++i) ids.push_back((i * 53 + 7) % 500);
  for (int i = 0; i < 12; ++i) more.push_back((i * 29 + 3) % 500);
  const auto continue_with = [&](Session& s) {
    const auto l = engine.forward(s, more, true);
    std::vector<float> out(l.begin(), l.end());
    for (TokenId t : {7, 99, 250}) {
      const auto d = engine.forward(s, std::vector<TokenId>{t});
      out.insert(out.end(), d.begin(), d.end());
    }
    return out;
  };
  for (const char* format : {"f16", "int8", "int4:window=16"}) {
    auto producer = new_pooled_session(*pool, engine, KvFormat::parse(format), 512);
    engine.forward(*producer, ids);
    const auto& pc = dynamic_cast<const PooledKvCache&>(producer->cache());
    ASSERT_EQ(pc.windowed_kept_from(), 64) << format;  // blocks of 32: two of four keep the global layer alone
    const SealedContext sealed = seal_session(*pool, engine, fp, *producer, "A");
    const Descriptor d = pool->grant(sealed, "A", "B");
    pool->release(sealed);
    HandoffResult r = open_session(*pool, engine, fp, d, "B", {HandoffMode::kv, true, 0});
    ASSERT_TRUE(r.kv) << format << ": " << r.detail;
    auto fork = std::make_unique<Session>(dynamic_cast<const PooledKvCache&>(r.session->cache()).fork(),
                                          r.session->tokens());
    const auto want = continue_with(*producer);
    const auto got = continue_with(*r.session);
    ASSERT_EQ(want.size(), got.size());
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float))) << format;
    const auto forked = continue_with(*fork);
    EXPECT_EQ(0, std::memcmp(want.data(), forked.data(), want.size() * sizeof(float))) << format;
    pool->release(d, "B");
  }
  EXPECT_EQ(pool->stats().contexts, 0);
}

}  // namespace
}  // namespace qkvshare
