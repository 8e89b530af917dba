#include "qkvshare/engine/splice_eval.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "qkvshare/core/clock.hpp"
#include "qkvshare/core/error.hpp"

namespace qkvshare {

namespace {

using Clock = std::chrono::steady_clock;

std::vector<double> log_softmax(std::span<const float> x) {
  double m = -1e300, s = 0;
  for (float v : x) m = std::max(m, static_cast<double>(v));
  for (float v : x) s += std::exp(v - m);
  const double lse = m + std::log(s);
  std::vector<double> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = x[i] - lse;
  return out;
}

std::size_t argmax(const std::vector<double>& x) {
  return static_cast<std::size_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

std::unique_ptr<Session> pooled(const std::shared_ptr<KvPool>& pool, const std::string& format, int capacity) {
  return std::make_unique<Session>(std::make_unique<PooledKvCache>(pool, KvFormat::parse(format), capacity));
}

std::vector<TokenId> join(std::initializer_list<const std::vector<TokenId>*> parts) {
  std::vector<TokenId> out;
  for (const auto* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

}  // namespace

std::vector<SpliceSample> evaluate_splices(Engine& engine, const std::shared_ptr<KvPool>& pool, const SpliceCase& c,
                                           const std::vector<std::string>& formats,
                                           const std::vector<double>& fractions, int forced, int probe_tokens,
                                           const SpliceSelection& selection) {
  if (c.chunk.empty() || c.suffix.empty() || c.consumer_prefix.empty() || c.producer_prefix.empty())
    fail(ErrorCode::invalid_argument, "splice eval: every part of a case needs tokens");
  if (forced < 1) fail(ErrorCode::invalid_argument, "splice eval: forced tokens must be >= 1, got {}", forced);
  const std::size_t vocab = static_cast<std::size_t>(engine.model().config().vocab_size);
  const std::vector<TokenId> text = join({&c.consumer_prefix, &c.chunk, &c.suffix});
  const int capacity = static_cast<int>(text.size()) + forced + probe_tokens + 8;
  // The reference: text re-prefill, f32 KV, greedy.
  std::vector<std::vector<double>> ref;
  std::vector<TokenId> tokens;
  {
    auto s = pooled(pool, "f32", capacity);
    auto row = log_softmax(engine.forward(*s, text));
    for (int i = 0; i < forced; ++i) {
      tokens.push_back(static_cast<TokenId>(argmax(row)));
      ref.push_back(std::move(row));
      if (i + 1 < forced) row = log_softmax(engine.forward(*s, std::span<const TokenId>(&tokens.back(), 1)));
    }
  }
  std::vector<std::vector<double>> text_rows;      // the same-format text re-prefill's rows
  std::vector<std::vector<double>> fallback_rows;  // the guard's fallback's rows
  // Scores a session standing right before the suffix: feeds suffix + forced
  // tokens; with `keep`, stores its rows (a reference), else compares them with
  // both references'.
  const auto score = [&](Session& s, SpliceSample& out, std::vector<std::vector<double>>* keep) {
    std::vector<TokenId> feed = c.suffix;
    feed.insert(feed.end(), tokens.begin(), tokens.end() - 1);
    const auto logits = engine.forward(s, feed, true);
    const std::size_t first = c.suffix.size() - 1;
    double kl = 0, kl_text = 0, kl_fallback = 0, nll = 0;
    int same = 0;
    for (int i = 0; i < forced; ++i) {
      auto q = log_softmax(logits.subspan((first + static_cast<std::size_t>(i)) * vocab, vocab));
      const auto& p = ref[static_cast<std::size_t>(i)];
      for (std::size_t v = 0; v < vocab; ++v) kl += std::exp(p[v]) * (p[v] - q[v]);
      if (keep == nullptr) {
        const auto& pt = text_rows[static_cast<std::size_t>(i)];
        for (std::size_t v = 0; v < vocab; ++v) kl_text += std::exp(pt[v]) * (pt[v] - q[v]);
        const auto& pf = fallback_rows[static_cast<std::size_t>(i)];
        for (std::size_t v = 0; v < vocab; ++v) kl_fallback += std::exp(pf[v]) * (pf[v] - q[v]);
      }
      nll -= q[static_cast<std::size_t>(tokens[static_cast<std::size_t>(i)])];
      same += argmax(q) == argmax(p) ? 1 : 0;
      if (keep != nullptr) keep->push_back(std::move(q));
    }
    out.kl = kl / forced;
    out.kl_text = kl_text / forced;
    out.kl_fallback = kl_fallback / forced;
    out.nll = nll / forced;
    out.top1 = static_cast<double>(same) / forced;
  };
  std::vector<SpliceSample> samples;
  const int begin = static_cast<int>(c.producer_prefix.size()), end = begin + static_cast<int>(c.chunk.size());
  for (const std::string& format : formats) {
    auto producer = pooled(pool, format, capacity);
    engine.forward(*producer, join({&c.producer_prefix, &c.chunk}));
    const auto& src = dynamic_cast<const PooledKvCache&>(producer->cache());
    double ttft_text = 0, text_kl = 0;
    {
      auto s = pooled(pool, format, capacity);
      const auto t0 = Clock::now();
      engine.forward(*s, join({&c.consumer_prefix, &c.chunk}));
      auto timing = std::make_unique<Session>(dynamic_cast<PooledKvCache&>(s->cache()).fork(), s->tokens());
      engine.forward(*timing, c.suffix);
      ttft_text = seconds_since(t0);
      timing.reset();
      SpliceSample t;
      text_rows.clear();
      score(*s, t, &text_rows);
      text_kl = t.kl;
    }
    double fallback_kl = 0;
    {
      auto s = pooled(pool, format, capacity);
      engine.forward(*s, c.consumer_prefix);
      engine.forward(*s, c.chunk);
      SpliceSample t;
      fallback_rows.clear();
      score(*s, t, &fallback_rows);
      fallback_kl = t.kl;
    }
    // One measured splice: `place` splices into a session standing right after
    // the consumer's prefix (and may fill more of the sample); timed up to the
    // consumer's first token, then scored.
    const auto measure = [&](const char* select, double fraction, const auto& place) {
      SpliceSample out;
      out.format = format;
      out.select = select;
      out.fraction = fraction;
      out.ttft_text = ttft_text;
      out.text_kl = text_kl;
      out.fallback_kl = fallback_kl;
      auto s = pooled(pool, format, capacity);
      const auto t0 = Clock::now();
      engine.forward(*s, c.consumer_prefix);
      const SpliceResult r = place(*s, out);
      const double splice_s = seconds_since(t0);
      out.recomputed = r.recomputed;
      out.reused = r.reused;
      // TTFT: the splice, then the suffix pass (run alone so that it is timed like the text side).
      auto timing = std::make_unique<Session>(dynamic_cast<PooledKvCache&>(s->cache()).fork(), s->tokens());
      const auto t1 = Clock::now();
      engine.forward(*timing, c.suffix);
      out.ttft_splice = splice_s + seconds_since(t1);
      timing.reset();
      score(*s, out, nullptr);
      samples.push_back(out);
    };
    for (const double fraction : fractions) {
      if (!selection.head) break;
      measure("head", fraction, [&](Session& s, SpliceSample& out) {
        SpliceOptions o;
        o.recompute = fraction;
        o.guard = true;
        o.threshold = 1e30;  // measure, never escalate
        o.probe_tokens = probe_tokens;
        const SpliceResult r = splice_tokens(engine, s, src, producer->tokens(), begin, end, o);
        out.estimate = std::max(0.0, r.estimate);
        out.v_dev = std::max(0.0, r.deviation.v());
        out.k_dev = r.deviation.k();
        return r;
      });
    }
    if (!selection.deviation) continue;
    std::vector<double> deviation;
    {
      auto s = pooled(pool, format, capacity);
      engine.forward(*s, c.consumer_prefix);
      deviation = splice_token_deviation(engine, *s, src, producer->tokens(), begin, end, selection.check_layers);
    }
    // Tokens by deviation, largest first (the earlier token on a tie).
    std::vector<int> order(deviation.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
      return deviation[static_cast<std::size_t>(x)] > deviation[static_cast<std::size_t>(y)];
    });
    for (const double fraction : fractions) {
      std::vector<char> mark(deviation.size(), 0);
      const int k = recompute_count(fraction, static_cast<int>(deviation.size()));
      for (int i = 0; i < k; ++i) mark[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] = 1;
      measure("deviation", fraction, [&](Session& s, SpliceSample& out) {
        out.estimate = -1;  // no probe
        return splice_marked_tokens(engine, s, src, producer->tokens(), begin, end, mark);
      });
    }
  }
  return samples;
}

}  // namespace qkvshare
