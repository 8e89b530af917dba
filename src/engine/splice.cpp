#include "qkvshare/engine/splice.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <type_traits>

#include "qkvshare/core/clock.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/ops.hpp"

namespace qkvshare {

bool probe_compares_keys(const KvFormat& format) {
  return format.key_rope != KeyRope::block && !format.rotate_k;
}

double guard_threshold(const KvFormat& format) {
  // bench/results/splice_guard.md: estimates of K and V together, and of V alone.
  const int bits = std::min(format.k.bits(), format.v.bits());
  const bool keys = probe_compares_keys(format);
  if (bits >= 8) return keys ? 0.0730 : 0.1285;
  if (bits >= 4) return keys ? 0.0626 : 0.1104;
  return 0.0;  // no threshold above 0 keeps 2-bit false accepts <= 5%: recomputed up to text
}

int recompute_count(double fraction, int n) {
  return std::clamp(static_cast<int>(std::lround(fraction * static_cast<double>(n))), 0, n);
}

namespace {

double sum(const std::vector<double>& x) { return std::accumulate(x.begin(), x.end(), 0.0); }

double relative(double num, double den) { return den > 0 ? std::sqrt(num / den) : -1.0; }

// The session's cache as a pooled one (splice and probe read and write blocks),
// const or not as the session is; `what` names the caller in the error.
template <class S>
auto& pooled(S& session, const char* what) {
  using Cache = std::conditional_t<std::is_const_v<S>, const PooledKvCache, PooledKvCache>;
  auto* cache = dynamic_cast<Cache*>(&session.cache());
  if (cache == nullptr) fail(ErrorCode::invalid_argument, "{}: the session's KV is not in a KV pool", what);
  return *cache;
}

// Error(invalid_argument) unless src_tokens are src's ids and [begin, end) a nonempty range of them.
void check_source(const PooledKvCache& src, std::span<const TokenId> src_tokens, int begin, int end) {
  if (static_cast<int>(src_tokens.size()) != src.size())
    fail(ErrorCode::invalid_argument, "splice: {} token ids for a source of {} tokens", src_tokens.size(), src.size());
  if (begin < 0 || end > src.size() || begin >= end)
    fail(ErrorCode::invalid_argument, "splice: token range [{}, {}) is not inside the source's {} tokens", begin, end,
         src.size());
}

// Lines up `fresh`'s rows [fresh_first, +k) with src's rows [src_first, +k)
// at each of `layers`, for V and (where they can be compared) K, and calls
// visit(layer, kind, token, fresh value, src value) for every element, in
// layer, kind, KV head, token, channel order.
template <class Visit>
void visit_row_pairs(const Engine& engine, const PooledKvCache& fresh, int fresh_first, const PooledKvCache& src,
                     int src_first, int k, std::span<const int> layers, Visit visit) {
  const KvShape s = engine.kv_shape();
  std::vector<float> a(static_cast<std::size_t>(k) * s.head_dim), b(a.size());
  // Layers whose rows the source left behind (a sliding window's) are not compared.
  const bool windowed_gone = src_first < src.windowed_kept_from();
  // Keys stored after RoPE sit at other positions in the source: rotated by the
  // shift before they are compared (keys stored before RoPE compare as they are).
  const bool rotate = fresh.format().key_rope == KeyRope::post;
  const bool keys = probe_compares_keys(fresh.format()) && src.format() == fresh.format();
  const KvRope rope = engine.rope();
  const float shift = static_cast<float>(fresh_first - src_first);
  for (int l : layers)
    for (int kind = keys ? 0 : 1; kind < 2; ++kind)
      for (int h = 0; h < s.n_kv_heads && !(windowed_gone && s.window(l) > 0); ++h) {
        fresh.read_rows(l, kind, h, fresh_first, k, a.data());
        src.read_rows(l, kind, h, src_first, k, b.data());
        if (kind == 0 && rotate)
          for (int t = 0; t < k; ++t)
            kernels::rope(b.data() + static_cast<std::size_t>(t) * s.head_dim, 1, s.head_dim, shift,
                          rope.freq(l).data(), rope.style);
        for (int t = 0; t < k; ++t)
          for (int c = 0; c < s.head_dim; ++c) {
            const std::size_t i = static_cast<std::size_t>(t) * s.head_dim + c;
            visit(l, kind, t, a[i], b[i]);
          }
      }
}

// Sums the squared deviation of `fresh`'s rows [fresh_first, +k) from src's
// rows [src_first, +k), per layer, for V and (where they can be compared) K.
ProbeDeviation compare_rows(const Engine& engine, const PooledKvCache& fresh, int fresh_first, const PooledKvCache& src,
                            int src_first, int k) {
  ProbeDeviation d;
  const int n_layers = engine.kv_shape().n_layers;
  for (auto* v : {&d.k_num, &d.k_den, &d.v_num, &d.v_den}) v->assign(static_cast<std::size_t>(n_layers), 0.0);
  std::vector<int> layers(static_cast<std::size_t>(n_layers));
  std::iota(layers.begin(), layers.end(), 0);
  visit_row_pairs(engine, fresh, fresh_first, src, src_first, k, layers, [&](int l, int kind, int, float a, float b) {
    const double diff = static_cast<double>(a) - b;
    (kind == 0 ? d.k_num : d.v_num)[static_cast<std::size_t>(l)] += diff * diff;
    (kind == 0 ? d.k_den : d.v_den)[static_cast<std::size_t>(l)] += static_cast<double>(a) * a;
  });
  return d;
}

}  // namespace

ProbeDeviation splice_probe_layers(Engine& engine, const Session& session, const PooledKvCache& src,
                                   std::span<const TokenId> src_tokens, int begin, int end, int probe_tokens) {
  const PooledKvCache& cache = pooled(session, "splice probe");
  const int k = std::min(probe_tokens, end - begin);
  if (k <= 0) return {};
  Session probe(cache.fork(), session.tokens());
  engine.forward(probe, src_tokens.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(k)));
  return compare_rows(engine, dynamic_cast<const PooledKvCache&>(probe.cache()), session.n_past(), src, begin, k);
}

double ProbeDeviation::k() const { return relative(sum(k_num), sum(k_den)); }
double ProbeDeviation::v() const { return relative(sum(v_num), sum(v_den)); }

double probe_estimate(const ProbeDeviation& d) {
  return std::max(0.0, relative(sum(d.k_num) + sum(d.v_num), sum(d.k_den) + sum(d.v_den)));
}

double splice_probe(Engine& engine, const Session& session, const PooledKvCache& src,
                    std::span<const TokenId> src_tokens, int begin, int end, int probe_tokens) {
  return probe_estimate(splice_probe_layers(engine, session, src, src_tokens, begin, end, probe_tokens));
}

std::vector<double> splice_token_deviation(Engine& engine, const Session& session, const PooledKvCache& src,
                                           std::span<const TokenId> src_tokens, int begin, int end,
                                           std::span<const int> check_layers) {
  const PooledKvCache& cache = pooled(session, "splice token deviation");
  check_source(src, src_tokens, begin, end);
  const int n = end - begin;
  const KvShape s = engine.kv_shape();
  for (int l : check_layers)
    if (l < 0 || l >= s.n_layers)
      fail(ErrorCode::invalid_argument, "splice token deviation: check layer {} is not in [0, {})", l, s.n_layers);
  Session fresh_session(cache.fork(), session.tokens());
  engine.forward(fresh_session, src_tokens.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(n)));
  std::vector<double> num(static_cast<std::size_t>(n), 0.0), den(num.size(), 0.0);
  visit_row_pairs(engine, dynamic_cast<const PooledKvCache&>(fresh_session.cache()), session.n_past(), src, begin, n,
                  check_layers, [&](int, int, int t, float a, float b) {
                    const double diff = static_cast<double>(a) - b;
                    num[static_cast<std::size_t>(t)] += diff * diff;
                    den[static_cast<std::size_t>(t)] += static_cast<double>(a) * a;
                  });
  std::vector<double> out(num.size());
  for (std::size_t t = 0; t < out.size(); ++t) out[t] = std::max(0.0, relative(num[t], den[t]));
  return out;
}

SpliceResult splice_marked_tokens(Engine& engine, Session& session, const PooledKvCache& src,
                                  std::span<const TokenId> src_tokens, int begin, int end,
                                  const std::vector<char>& recompute) {
  const auto t0 = std::chrono::steady_clock::now();
  PooledKvCache& cache = pooled(session, "splice");
  check_source(src, src_tokens, begin, end);
  const int n = end - begin;
  if (static_cast<int>(recompute.size()) != n)
    fail(ErrorCode::invalid_argument, "splice: {} recompute flags for {} spliced tokens", recompute.size(), n);
  SpliceResult r;
  r.tokens = n;
  for (int i = 0; i < n;) {
    int j = i;
    while (j < n && (recompute[static_cast<std::size_t>(j)] != 0) == (recompute[static_cast<std::size_t>(i)] != 0)) ++j;
    const auto run = src_tokens.subspan(static_cast<std::size_t>(begin + i), static_cast<std::size_t>(j - i));
    if (recompute[static_cast<std::size_t>(i)] != 0) {
      engine.forward(session, run);
      r.recomputed += j - i;
    } else {
      cache.splice(src, begin + i, begin + j, engine.rope());
      session.note_placed(run);
      r.reused += j - i;
    }
    i = j;
  }
  r.fraction = static_cast<double>(r.recomputed) / n;
  r.text = r.recomputed == n;
  r.seconds = seconds_since(t0);
  return r;
}

SpliceResult splice_tokens(Engine& engine, Session& session, const PooledKvCache& src,
                           std::span<const TokenId> src_tokens, int begin, int end, const SpliceOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  PooledKvCache& cache = pooled(session, "splice");
  check_source(src, src_tokens, begin, end);
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
    r.deviation = splice_probe_layers(engine, session, src, src_tokens, begin + done, end, options.probe_tokens);
    r.estimate = probe_estimate(r.deviation);
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
