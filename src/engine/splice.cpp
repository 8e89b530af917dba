#include "qkvshare/engine/splice.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "qkvshare/core/clock.hpp"
#include "qkvshare/core/error.hpp"

namespace qkvshare {

double guard_threshold(const KvFormat& format) {
  const int bits = std::min(format.k.bits(), format.v.bits());
  return bits >= 8 ? 0.2364 : 0.0;  // below 8 bits no estimate passes: recomputed up to text
}

int recompute_count(double fraction, int n) {
  return std::clamp(static_cast<int>(std::lround(fraction * static_cast<double>(n))), 0, n);
}

namespace {

PooledKvCache& pooled(Session& session) {
  auto* cache = dynamic_cast<PooledKvCache*>(&session.cache());
  if (cache == nullptr) fail(ErrorCode::invalid_argument, "splice: the session's KV is not in a KV pool");
  return *cache;
}

}  // namespace

double splice_probe(Engine& engine, const Session& session, const PooledKvCache& src,
                    std::span<const TokenId> src_tokens, int begin, int end, int probe_tokens) {
  const auto* cache = dynamic_cast<const PooledKvCache*>(&session.cache());
  if (cache == nullptr) fail(ErrorCode::invalid_argument, "splice probe: the session's KV is not in a KV pool");
  const int k = std::min(probe_tokens, end - begin);
  if (k <= 0) return 0.0;
  Session probe(cache->fork(), session.tokens());
  engine.forward(probe, src_tokens.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(k)));
  const auto& fresh = dynamic_cast<const PooledKvCache&>(probe.cache());
  const KvShape s = engine.kv_shape();
  std::vector<float> a(static_cast<std::size_t>(k) * s.head_dim), b(a.size());
  double num = 0, den = 0;
  // Layers whose rows the source left behind (a sliding window's) are not compared.
  const bool windowed_gone = begin < src.windowed_kept_from();
  for (int l = 0; l < s.n_layers; ++l)
    for (int h = 0; h < s.n_kv_heads && !(windowed_gone && s.window(l) > 0); ++h) {
      fresh.read_rows(l, 1, h, session.n_past(), k, a.data());
      src.read_rows(l, 1, h, begin, k, b.data());
      for (std::size_t i = 0; i < a.size(); ++i) {
        const double d = static_cast<double>(a[i]) - b[i];
        num += d * d;
        den += static_cast<double>(a[i]) * a[i];
      }
    }
  return den > 0 ? std::sqrt(num / den) : 0.0;
}

SpliceResult splice_tokens(Engine& engine, Session& session, const PooledKvCache& src,
                           std::span<const TokenId> src_tokens, int begin, int end, const SpliceOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  PooledKvCache& cache = pooled(session);
  if (static_cast<int>(src_tokens.size()) != src.size())
    fail(ErrorCode::invalid_argument, "splice: {} token ids for a source of {} tokens", src_tokens.size(), src.size());
  if (begin < 0 || end > src.size() || begin >= end)
    fail(ErrorCode::invalid_argument, "splice: token range [{}, {}) is not inside the source's {} tokens", begin, end,
         src.size());
  if (!(options.recompute >= 0.0 && options.recompute <= 1.0))
    fail(ErrorCode::invalid_argument, "splice: recompute fraction {} is not in [0, 1]", options.recompute);
  const int n = end - begin;
  SpliceResult r;
  r.tokens = n;
  r.fraction = options.recompute;
  int done = 0;  // head tokens recomputed so far
  const auto recompute_to = [&](double fraction) {
    const int want = recompute_count(fraction, n);
    if (want > done)
      engine.forward(session, src_tokens.subspan(static_cast<std::size_t>(begin + done), static_cast<std::size_t>(want - done)));
    done = std::max(done, want);
  };
  recompute_to(options.recompute);
  const double threshold = options.threshold >= 0 ? options.threshold : guard_threshold(cache.format());
  std::size_t level = 0;
  while (options.guard && done < n) {
    r.estimate = splice_probe(engine, session, src, src_tokens, begin + done, end, options.probe_tokens);
    r.estimates.push_back(r.estimate);
    r.probe_tokens += std::min(options.probe_tokens, n - done);
    if (r.estimate <= threshold) break;
    while (level < options.escalation.size() && options.escalation[level] <= r.fraction) ++level;
    if (level == options.escalation.size()) break;  // nothing higher to try
    r.fraction = options.escalation[level++];
    r.escalated = true;
    recompute_to(r.fraction);
  }
  r.text = done == n && options.recompute < 1.0;
  if (done < n) {
    cache.splice(src, begin + done, end, engine.rope());
    session.note_placed(src_tokens.subspan(static_cast<std::size_t>(begin + done), static_cast<std::size_t>(n - done)));
  }
  r.recomputed = done;
  r.reused = n - done;
  r.seconds = seconds_since(t0);
  return r;
}

}  // namespace qkvshare
