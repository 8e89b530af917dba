// Splice under the real forward pass (stories260K): 100% recompute is a text
// re-prefill, a splice at offset 0 under the producer's own prefix is a
// continue, the guard measures and escalates, and every block comes back.
#include <gtest/gtest.h>

#include <cmath>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/splice.hpp"
#include "test_paths.hpp"

namespace qkvshare {
namespace {

class SpliceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = Model::load(testing::shared_path("models/stories260K.bin"), testing::shared_path("models/tok512.bin"));
    engine_ = std::make_unique<Engine>(*model_, EngineOptions{2});
    pool_ = KvPool::create(PoolConfig{engine_->kv_shape(), 16, 32 << 20});
    const Tokenizer& tok = model_->tokenizer();
    a_ = {tok.bos_id()};
    const auto a = tok.encode("Lily had a red kite. She took it to the hill on a windy day.");
    a_.insert(a_.end(), a.begin(), a.end());
    reply_ = tok.encode(" The kite flew high over the trees and the birds came to look at it. Lily laughed and ran"
                        " after it, and her little brother Tom ran with her.");
    b_ = {tok.bos_id()};
    const auto b = tok.encode("Once upon a time, a boy named Sam lived near the sea.");
    b_.insert(b_.end(), b.begin(), b.end());
    turn_ = tok.encode(" Then they all went home to eat soup.");
  }
  std::unique_ptr<Session> session(const char* format) {
    return std::make_unique<Session>(std::make_unique<PooledKvCache>(pool_, KvFormat::parse(format), 512));
  }
  // The producer: a_ then reply_.
  std::unique_ptr<Session> producer(const char* format) {
    auto p = session(format);
    std::vector<TokenId> all = a_;
    all.insert(all.end(), reply_.begin(), reply_.end());
    engine_->forward(*p, all);
    return p;
  }
  std::vector<float> logits(Session& s, const std::vector<TokenId>& ids) {
    const auto l = engine_->forward(s, ids);
    return {l.begin(), l.end()};
  }
  // KL(p || q) of two logit rows.
  static double kl(const std::vector<float>& p, const std::vector<float>& q) {
    const auto lse = [](const std::vector<float>& x) {
      double m = -1e300, s = 0;
      for (float v : x) m = std::max(m, static_cast<double>(v));
      for (float v : x) s += std::exp(v - m);
      return m + std::log(s);
    };
    const double lp = lse(p), lq = lse(q);
    double d = 0;
    for (std::size_t i = 0; i < p.size(); ++i) d += std::exp(p[i] - lp) * ((p[i] - lp) - (q[i] - lq));
    return d;
  }
  SpliceResult splice(Session& into, Session& from, double fraction, bool guard = false, double threshold = 1.0) {
    SpliceOptions o;
    o.recompute = fraction;
    o.guard = guard;
    o.threshold = threshold;
    const int begin = static_cast<int>(a_.size());
    return splice_tokens(*engine_, into, dynamic_cast<PooledKvCache&>(from.cache()), from.tokens(), begin,
                         begin + static_cast<int>(reply_.size()), o);
  }
  // Text re-prefill: b_ + reply_ + turn_ read as text.
  std::vector<float> text_logits(const char* format) {
    auto t = session(format);
    std::vector<TokenId> all = b_;
    all.insert(all.end(), reply_.begin(), reply_.end());
    all.insert(all.end(), turn_.begin(), turn_.end());
    return logits(*t, all);
  }
  std::unique_ptr<Model> model_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<KvPool> pool_;
  std::vector<TokenId> a_, reply_, b_, turn_;
};

TEST_F(SpliceTest, FullRecomputeEqualsTextReprefill) {
  for (const char* format : {"f32", "int8"}) {
    auto p = producer(format);
    auto c = session(format);
    engine_->forward(*c, b_);
    const SpliceResult r = splice(*c, *p, 1.0);
    EXPECT_EQ(r.recomputed, static_cast<int>(reply_.size()));
    EXPECT_EQ(r.reused, 0);
    const auto got = logits(*c, turn_);
    const auto want = text_logits(format);
    float diff = 0;
    for (std::size_t i = 0; i < got.size(); ++i) diff = std::max(diff, std::abs(got[i] - want[i]));
    // Same tokens, same positions, only the pass boundaries differ (f32: summation order; int8: a block
    // filled across two passes is quantized from its f16 rows).
    if (std::string(format) == "f32") {
      EXPECT_LE(diff, 1e-4f);
    } else {
      EXPECT_LE(kl(want, got), 1e-4) << format << " max logit diff " << diff;
    }
    EXPECT_EQ(c->n_past(), static_cast<int>(b_.size() + reply_.size() + turn_.size()));
  }
}

TEST_F(SpliceTest, SpliceUnderTheProducersOwnPrefixIsAContinue) {
  auto p = producer("f32");
  auto c = session("f32");
  engine_->forward(*c, a_);  // the same prefix: offset 0, the KV is exact
  const SpliceResult r = splice(*c, *p, 0.0);
  EXPECT_EQ(r.reused, static_cast<int>(reply_.size()));
  const auto got = logits(*c, turn_);
  const auto want = logits(*p, turn_);
  float diff = 0;
  for (std::size_t i = 0; i < got.size(); ++i) diff = std::max(diff, std::abs(got[i] - want[i]));
  EXPECT_LE(diff, 1e-4f);
}

TEST_F(SpliceTest, RecomputeMovesTowardsTheTextReprefillAndTheGuardMeasuresIt) {
  auto p = producer("f32");
  const auto want = text_logits("f32");
  std::vector<double> kls, estimates;
  for (double fraction : {0.0, 0.5, 1.0}) {
    auto c = session("f32");
    engine_->forward(*c, b_);
    const double est = splice_probe(*engine_, *c, dynamic_cast<PooledKvCache&>(p->cache()), p->tokens(),
                                    static_cast<int>(a_.size()) + recompute_count(fraction, static_cast<int>(reply_.size())),
                                    static_cast<int>(a_.size() + reply_.size()), 8);
    splice(*c, *p, fraction);
    kls.push_back(kl(want, logits(*c, turn_)));
    estimates.push_back(est);
  }
  EXPECT_GT(kls[0], 1e-4);  // another prefix changes the reply's KV
  EXPECT_LT(kls[2], 1e-6);
  EXPECT_LT(kls[2], kls[0]);
  EXPECT_GT(estimates[0], 1e-3);
  EXPECT_EQ(estimates[2], 0.0);  // nothing left to reuse
  // Under the producer's own prefix the probe sees no deviation.
  auto same = session("f32");
  engine_->forward(*same, a_);
  EXPECT_LT(splice_probe(*engine_, *same, dynamic_cast<PooledKvCache&>(p->cache()), p->tokens(),
                         static_cast<int>(a_.size()), static_cast<int>(a_.size() + reply_.size()), 8),
            1e-3);
}

TEST_F(SpliceTest, TheProbeLinesUpKeysOfAnotherPositionByTheirShift) {
  // Layer 0's keys depend on the token and its position only: rotated by the
  // shift, the source's equal the fresh ones whatever the prefix, while V and
  // the deeper layers' keys carry the other prefix.
  ASSERT_NE(a_.size(), b_.size());  // the reply sits at another position
  auto p = producer("f32");
  auto c = session("f32");
  engine_->forward(*c, b_);
  const int begin = static_cast<int>(a_.size()), end = begin + static_cast<int>(reply_.size());
  const ProbeDeviation d =
      splice_probe_layers(*engine_, *c, dynamic_cast<PooledKvCache&>(p->cache()), p->tokens(), begin, end, 8);
  ASSERT_EQ(d.k_num.size(), static_cast<std::size_t>(engine_->kv_shape().n_layers));
  ASSERT_GT(d.k_den[0], 0.0);
  EXPECT_LT(d.k_num[0] / d.k_den[0], 1e-10);
  double k = 0, v = 0;
  for (std::size_t l = 1; l < d.k_num.size(); ++l) k += d.k_num[l];
  for (double x : d.v_num) v += x;
  EXPECT_GT(k, 0.0);
  EXPECT_GT(v, 0.0);
  EXPECT_DOUBLE_EQ(probe_estimate(d), splice_probe(*engine_, *c, dynamic_cast<PooledKvCache&>(p->cache()),
                                                   p->tokens(), begin, end, 8));
  // Formats whose keys are Hadamard-rotated or rotated per block compare V alone.
  EXPECT_TRUE(probe_compares_keys(KvFormat::parse("int4")));
  EXPECT_TRUE(probe_compares_keys(KvFormat::parse("int4:keys=pre")));
  EXPECT_FALSE(probe_compares_keys(KvFormat::parse("int4:rot=k")));
  EXPECT_FALSE(probe_compares_keys(KvFormat::parse("int4:keys=block")));
}

TEST_F(SpliceTest, GuardEscalatesToTextAboveItsThreshold) {
  auto p = producer("int4");
  {
    auto c = session("int4");
    engine_->forward(*c, b_);
    const SpliceResult r = splice(*c, *p, 0.15, true, 0.0);  // every estimate is too high
    EXPECT_TRUE(r.escalated);
    EXPECT_TRUE(r.text);
    EXPECT_EQ(r.recomputed, static_cast<int>(reply_.size()));
    EXPECT_EQ(r.fraction, 1.0);
    EXPECT_EQ(r.estimates.size(), 2u);  // at 0.15 and at 0.5
  }
  {
    auto c = session("int4");
    engine_->forward(*c, b_);
    const SpliceResult r = splice(*c, *p, 0.15, true, 1e9);
    EXPECT_FALSE(r.escalated);
    EXPECT_EQ(r.recomputed, recompute_count(0.15, static_cast<int>(reply_.size())));
    EXPECT_GT(r.estimate, 0.0);
    EXPECT_EQ(r.probe_tokens, 8);
  }
}

// The marked splice (CacheBlend's scattered choice, measured by splice-eval):
// a head mask is the engine's splice at that fraction, bit for bit; every token
// marked is the text re-prefill; a scattered mask places every token at its
// position (the producer's own prefix then reproduces the producer exactly).
TEST_F(SpliceTest, MarkedSpliceIsTheHeadSpliceOrTheTextAtItsEnds) {
  const int begin = static_cast<int>(a_.size()), n = static_cast<int>(reply_.size());
  auto p = producer("int8");
  const auto& src = dynamic_cast<PooledKvCache&>(p->cache());
  const auto marked = [&](const std::vector<TokenId>& prefix, const std::vector<char>& mark) {
    auto c = session("int8");
    engine_->forward(*c, prefix);
    const SpliceResult r = splice_marked_tokens(*engine_, *c, src, p->tokens(), begin, begin + n, mark);
    EXPECT_EQ(r.recomputed + r.reused, n);
    EXPECT_EQ(c->n_past(), static_cast<int>(prefix.size()) + n);
    return logits(*c, turn_);
  };
  std::vector<char> head(static_cast<std::size_t>(n), 0);
  const int k = recompute_count(0.3, n);
  for (int i = 0; i < k; ++i) head[static_cast<std::size_t>(i)] = 1;
  auto c = session("int8");
  engine_->forward(*c, b_);
  splice(*c, *p, 0.3);
  EXPECT_EQ(marked(b_, head), logits(*c, turn_));
  EXPECT_LT(kl(text_logits("int8"), marked(b_, std::vector<char>(static_cast<std::size_t>(n), 1))), 1e-4);
  std::vector<char> every_third(static_cast<std::size_t>(n), 0);
  for (int i = 0; i < n; i += 3) every_third[static_cast<std::size_t>(i)] = 1;
  auto same = session("int8");
  engine_->forward(*same, a_);
  splice(*same, *p, 0.0);  // offset 0 under the producer's prefix: a continue
  EXPECT_LT(kl(logits(*same, turn_), marked(a_, every_third)), 1e-4);
  auto beyond = session("int8");
  EXPECT_THROW(splice_marked_tokens(*engine_, *beyond, src, p->tokens(), begin + 1, begin + n + 1, head), Error);
  auto short_mask = session("int8");
  EXPECT_THROW(splice_marked_tokens(*engine_, *short_mask, src, p->tokens(), begin, begin + n, {1, 0}), Error);
}

// Per-token deviation at check layers: layer 0 (keys rotated by the shift)
// is zero, deeper layers are not, and under the producer's own prefix nothing
// deviates.
TEST_F(SpliceTest, TokenDeviationRanksTokensAtTheCheckLayers) {
  const int begin = static_cast<int>(a_.size()), n = static_cast<int>(reply_.size());
  auto p = producer("f32");
  const auto& src = dynamic_cast<PooledKvCache&>(p->cache());
  auto c = session("f32");
  engine_->forward(*c, b_);
  const int layer0[] = {0}, layer12[] = {1, 2};
  const auto first = splice_token_deviation(*engine_, *c, src, p->tokens(), begin, begin + n, layer0);
  ASSERT_EQ(first.size(), static_cast<std::size_t>(n));
  for (double d : first) EXPECT_LT(d, 1e-4);  // K and V of layer 0: token and position alone
  const auto deeper = splice_token_deviation(*engine_, *c, src, p->tokens(), begin, begin + n, layer12);
  double total = 0;
  for (double d : deeper) total += d;
  EXPECT_GT(total / n, 1e-3);
  EXPECT_EQ(c->n_past(), static_cast<int>(b_.size()));  // the ranking pass ran on a fork
  auto own = session("f32");
  engine_->forward(*own, a_);
  for (double d : splice_token_deviation(*engine_, *own, src, p->tokens(), begin, begin + n, layer12)) EXPECT_LT(d, 1e-3);
  const int bad[] = {99};
  EXPECT_THROW(splice_token_deviation(*engine_, *c, src, p->tokens(), begin, begin + n, bad), Error);
}

TEST_F(SpliceTest, SplicedContextsReleaseEveryBlockAndBadArgumentsAreRefused) {
  {
    auto p = producer("int8");
    auto c = session("int8");
    engine_->forward(*c, b_);
    splice(*c, *p, 0.15, true);
    logits(*c, turn_);
    p.reset();  // the consumer still holds the spliced blocks
    EXPECT_GT(pool_->counters().blocks_used, 0u);
    logits(*c, turn_);
    const auto code = [&](double fraction, int begin, int end) {
      SpliceOptions o;
      o.recompute = fraction;
      auto q = producer("int8");
      try {
        splice_tokens(*engine_, *c, dynamic_cast<PooledKvCache&>(q->cache()), q->tokens(), begin, end, o);
      } catch (const Error& e) {
        return e.code();
      }
      return ErrorCode::internal;
    };
    EXPECT_EQ(code(1.5, 3, 9), ErrorCode::invalid_argument);
    EXPECT_EQ(code(-0.1, 3, 9), ErrorCode::invalid_argument);
    EXPECT_EQ(code(0.1, 9, 3), ErrorCode::invalid_argument);
    EXPECT_EQ(code(0.1, 0, 100000), ErrorCode::invalid_argument);
    auto dense = engine_->new_session(64);
    auto q = producer("int8");
    EXPECT_THROW(splice_tokens(*engine_, *dense, dynamic_cast<PooledKvCache&>(q->cache()), q->tokens(), 1, 5, {}), Error);
  }
  EXPECT_EQ(pool_->counters().blocks_used, 0u);
}

}  // namespace
}  // namespace qkvshare
