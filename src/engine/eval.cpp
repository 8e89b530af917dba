#include "qkvshare/engine/eval.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "qkvshare/core/clock.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare {

namespace {

using Clock = std::chrono::steady_clock;


// log-softmax of one row into `out`; returns nothing, out[v] = x[v] - logsumexp(x).
void log_softmax(const float* x, float* out, std::size_t n) {
  const float m = *std::max_element(x, x + n);
  double sum = 0.0;
  for (std::size_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(x[i] - m));
  const auto lse = static_cast<float>(static_cast<double>(m) + std::log(sum));
  for (std::size_t i = 0; i < n; ++i) out[i] = x[i] - lse;
}

// Stored bits per element of a context as it is: every block's codes, scales
// and mins (whole blocks) over the elements of the `tokens` it stands for
// (its own, or more when evict() dropped some).
double stored_bits(const PooledKvCache& cache, int tokens) {
  const KvShape& s = cache.shape();
  const int T = cache.pool().block_tokens();
  double bytes = 0;
  for (const KvSegment& seg : cache.segments())
    for (const BlockRef b : seg.blocks) {
      const BlockInfo info = cache.pool().info(b);
      const TileLayout k = tile_layout(info.k, T, s.head_dim), v = tile_layout(info.v, T, s.head_dim);
      bytes += static_cast<double>(k.stored_bytes() + v.stored_bytes()) * s.n_layers * s.n_kv_heads;
    }
  return bytes * 8.0 / (static_cast<double>(tokens) * s.n_layers * s.kv_dim() * 2.0);
}

struct Accumulator {
  KvFormat format;
  std::shared_ptr<KvPool> pool;
  double nll = 0.0;
  double kl_sum = 0.0;
  std::vector<float> kls;
  long agree = 0;
  long scored = 0;
  double seconds = 0.0;
  long tokens_run = 0;
  std::size_t window_bytes = 0;
  double bits_sum = 0;          // mixed formats: the scored window as stored, summed over windows
  double handoff_bits_sum = 0;  // handoff protocol: the shipped context, summed over windows
};

}  // namespace

std::vector<KvFormat> all_eval_formats() {
  std::vector<KvFormat> out;
  // The noise floor (f16), the named formats, per-token keys for comparison,
  // K/V splits, and the f16 window + sinks that the low bit widths need.
  for (const char* f : {"f16", "int8", "int8:kaxis=token", "k8v4", "int4", "int4:window=128:sink=32", "int3",
                        "int3:window=128:sink=32", "k4v3:window=128:sink=32", "int2", "int2:window=128:sink=32:vgroup=16",
                        "k8v2:window=128:sink=32:vgroup=16"})
    out.push_back(KvFormat::parse(f));
  return out;
}

EvalReport evaluate_kv(Engine& engine, std::span<const TokenId> tokens, std::span<const KvFormat> formats,
                       const EvalOptions& o) {
  const Model& model = engine.model();
  const ModelConfig& c = model.config();
  const KvShape shape = engine.kv_shape();
  if (o.ctx < 4 || o.ctx > c.context_length)
    fail(ErrorCode::invalid_argument, "--ctx {} must be in [4, {}] (the model's context length)", o.ctx, c.context_length);
  if (tokens.size() < static_cast<std::size_t>(o.ctx))
    fail(ErrorCode::invalid_argument, "the text has {} tokens, fewer than one window of --ctx {}", tokens.size(), o.ctx);
  if (o.protocol == EvalProtocol::handoff && o.score_all)
    fail(ErrorCode::invalid_argument, "--protocol handoff scores the consumer's half: it needs --score half");
  if (o.chunk <= 0) fail(ErrorCode::invalid_argument, "--chunk {} must be positive", o.chunk);
  for (const KvFormat& f : formats)
    if (f.observes() && o.protocol != EvalProtocol::handoff)
      fail(ErrorCode::invalid_argument,
           "KV format {} demotes or drops blocks when a context is handed off: evaluate it with --protocol handoff",
           f.to_string());
    else if (f.cold_tail && o.protocol != EvalProtocol::handoff)
      fail(ErrorCode::invalid_argument,
           "KV format {} codes its last block when a context is handed off: evaluate it with --protocol handoff",
           f.to_string());
  if (o.decode_tokens < 0 || o.decode_tokens >= o.ctx - 1)
    fail(ErrorCode::invalid_argument, "decode tokens {} must be in [0, ctx - 1)", o.decode_tokens);
  const int first = o.score_all ? 1 : o.ctx / 2;  // first scored token of a window
  const int rows = o.ctx - first;
  long windows = static_cast<long>(tokens.size()) / o.ctx;
  if (o.max_scored > 0) windows = std::min(windows, (o.max_scored + rows - 1) / rows);
  if (o.max_scored < 0) windows = 0;  // speed only

  std::vector<Accumulator> acc;
  acc.push_back({KvFormat::parse("f32"), {}, 0, 0, {}, 0, 0, 0, 0, 0});
  for (const KvFormat& f : formats)
    if (!(f == acc[0].format)) acc.push_back({f, {}, 0, 0, {}, 0, 0, 0, 0, 0});
  for (Accumulator& a : acc) {
    a.format.validate(shape, o.block_tokens);
    a.pool = KvPool::create(
        PoolConfig{shape, o.block_tokens,
                   KvPool::arena_bytes_for(shape, o.block_tokens, a.format, o.ctx,
                                           o.protocol == EvalProtocol::handoff ? 2 : 1)});  // the shared tail's copy
  }

  const std::size_t vocab = static_cast<std::size_t>(c.vocab_size);
  std::vector<float> ref_lp(static_cast<std::size_t>(rows) * vocab), lp(vocab), consumer_logits;
  std::vector<std::size_t> ref_top(static_cast<std::size_t>(rows));
  std::vector<TokenId> win(static_cast<std::size_t>(o.ctx));
  const Tokenizer& tok = model.tokenizer();

  for (long w = 0; w < windows; ++w) {
    std::copy_n(tokens.begin() + w * o.ctx, o.ctx, win.begin());
    if (tok.add_bos() && tok.bos_id() >= 0) win[0] = tok.bos_id();  // as llama.cpp's perplexity does
    for (std::size_t fi = 0; fi < acc.size(); ++fi) {
      Accumulator& a = acc[fi];
      const auto t0 = Clock::now();
      Session session(std::make_unique<PooledKvCache>(a.pool, a.format, o.ctx));
      if (first > 1) engine.forward(session, std::span<const TokenId>(win.data(), static_cast<std::size_t>(first - 1)));
      std::span<const float> logits;
      std::unique_ptr<Session> consumer;
      if (o.protocol == EvalProtocol::prefill) {
        logits = engine.forward(session, std::span<const TokenId>(win.data() + first - 1, static_cast<std::size_t>(rows)),
                                true);
      } else {
        // The producer's context is sealed: its blocks stay as they are, shared;
        // the consumer holds them by reference (as adopt() does with a
        // descriptor) and writes its own tokens after them, a chunk per pass.
        auto& sealed = static_cast<PooledKvCache&>(session.cache());
        sealed.set_rope(engine.rope());
        std::vector<TokenId> ids(session.tokens().begin(), session.tokens().end());
        reduce_for_handoff(sealed, ids);  // the producer's re-precision and dropping at handoff
        a.handoff_bits_sum += stored_bits(sealed, first - 1);
        consumer = std::make_unique<Session>(sealed.fork());
        consumer->note_placed(ids);
        consumer_logits.resize(static_cast<std::size_t>(rows) * vocab);
        for (int r = 0; r < rows; r += o.chunk) {
          const int n = std::min(o.chunk, rows - r);
          const auto part = engine.forward(
              *consumer, std::span<const TokenId>(win.data() + first - 1 + r, static_cast<std::size_t>(n)), true);
          std::copy(part.begin(), part.end(), consumer_logits.begin() + static_cast<std::ptrdiff_t>(r) * static_cast<std::ptrdiff_t>(vocab));
        }
        logits = consumer_logits;
      }
      a.seconds += seconds_since(t0);
      a.tokens_run += o.ctx - 1;
      const auto& scored = static_cast<const PooledKvCache&>((consumer ? *consumer : session).cache());
      a.window_bytes = scored.kv_bytes();
      if (a.format.observes()) a.bits_sum += stored_bits(scored, o.ctx - 1);
      for (int r = 0; r < rows; ++r) {
        const float* x = logits.data() + static_cast<std::size_t>(r) * vocab;
        const auto target = static_cast<std::size_t>(win[static_cast<std::size_t>(first + r)]);
        const std::size_t top = static_cast<std::size_t>(std::max_element(x, x + vocab) - x);
        float* out = fi == 0 ? &ref_lp[static_cast<std::size_t>(r) * vocab] : lp.data();
        log_softmax(x, out, vocab);
        a.nll -= out[target];
        ++a.scored;
        if (fi == 0) {
          ref_top[static_cast<std::size_t>(r)] = top;
          ++a.agree;
          a.kls.push_back(0.0f);
          continue;
        }
        const float* ref = &ref_lp[static_cast<std::size_t>(r) * vocab];
        double kl = 0.0;
        for (std::size_t v = 0; v < vocab; ++v) kl += std::exp(static_cast<double>(ref[v])) * (ref[v] - out[v]);
        kl = std::max(kl, 0.0);  // rounding can give -1e-9
        a.kl_sum += kl;
        a.kls.push_back(static_cast<float>(kl));
        a.agree += top == ref_top[static_cast<std::size_t>(r)];
      }
      if (o.progress)
        o.progress(fmt::format("window {}/{} {:<26} ppl {:.4f}  mean KL {:.6f}  {:.0f} tokens/s", w + 1, windows,
                               a.format.to_string(), std::exp(a.nll / static_cast<double>(a.scored)),
                               a.kl_sum / static_cast<double>(a.scored),
                               static_cast<double>(a.tokens_run) / std::max(a.seconds, 1e-9)));
    }
    for (const Accumulator& a : acc)  // every session is gone: its blocks must all be back
      if (a.pool->counters().blocks_used != 0)
        fail(ErrorCode::internal, "KV pool of format {} leaked {} blocks", a.format.to_string(),
             a.pool->counters().blocks_used);
  }

  EvalReport report;
  report.ctx = o.ctx;
  report.windows = windows;
  report.scored = windows * rows;
  report.text_tokens = static_cast<long>(tokens.size());
  report.score_all = o.score_all;
  const double elems = static_cast<double>(o.ctx) * shape.n_layers * shape.kv_dim() * 2.0;
  for (Accumulator& a : acc) {
    EvalFormatResult r;
    r.format = a.format.to_string();
    r.bits_per_element = static_cast<double>(a.format.context_bytes(shape, o.block_tokens, o.ctx)) * 8.0 / elems;
    if (windows > 0 && o.protocol == EvalProtocol::handoff)
      r.handoff_bits_per_element = a.handoff_bits_sum / static_cast<double>(windows);
    if (a.format.observes() && windows > 0)  // as stored: the producer's half demoted or evicted, the consumer's own not
      r.bits_per_element = a.bits_sum / static_cast<double>(windows);
    r.cold_bits_per_element = a.format.cold_bits(o.block_tokens, shape.head_dim);
    r.kv_bytes_per_token = static_cast<double>(a.window_bytes) / (o.ctx - 1);
    r.scored = a.scored;
    r.ppl = std::exp(a.nll / static_cast<double>(std::max(a.scored, 1L)));
    r.mean_kl = a.kl_sum / static_cast<double>(std::max(a.scored, 1L));
    if (!a.kls.empty()) {
      const auto k = static_cast<std::size_t>(0.99 * static_cast<double>(a.kls.size() - 1));
      std::nth_element(a.kls.begin(), a.kls.begin() + static_cast<long>(k), a.kls.end());
      r.p99_kl = a.kls[k];
    }
    r.top1 = static_cast<double>(a.agree) / static_cast<double>(std::max(a.scored, 1L));
    r.prefill_tokens_per_s = static_cast<double>(a.tokens_run) / std::max(a.seconds, 1e-9);
    report.results.push_back(r);
  }
  for (EvalFormatResult& r : report.results) r.ppl_delta_pct = (r.ppl / report.results[0].ppl - 1.0) * 100.0;

  if (o.decode_tokens > 0) {
    // Decode speed at depth ctx: every format's session is prefilled with
    // ctx - 1 - decode_tokens tokens, then the formats take single-token
    // steps in turn, so that a busy machine slows them all alike; each
    // format's speed is its median step.
    std::copy_n(tokens.begin(), o.ctx, win.begin());
    const int pre = o.ctx - 1 - o.decode_tokens;
    std::vector<std::unique_ptr<Session>> sessions;
    for (Accumulator& a : acc) {
      sessions.push_back(std::make_unique<Session>(std::make_unique<PooledKvCache>(a.pool, a.format, o.ctx)));
      engine.forward(*sessions.back(), std::span<const TokenId>(win.data(), static_cast<std::size_t>(pre)));
    }
    std::vector<std::vector<double>> steps(acc.size());
    for (int i = 0; i < o.decode_tokens; ++i)
      for (std::size_t fi = 0; fi < acc.size(); ++fi) {
        const auto t0 = Clock::now();
        engine.forward(*sessions[fi], std::span<const TokenId>(&win[static_cast<std::size_t>(pre + i)], 1));
        steps[fi].push_back(seconds_since(t0));
      }
    for (std::size_t fi = 0; fi < acc.size(); ++fi) {
      std::vector<double>& d = steps[fi];
      std::nth_element(d.begin(), d.begin() + static_cast<long>(d.size() / 2), d.end());
      report.results[fi].decode_tokens_per_s = 1.0 / std::max(d[d.size() / 2], 1e-9);
      if (o.progress)
        o.progress(fmt::format("decode at depth {}: {:<26} {:.1f} tokens/s (median step)", o.ctx,
                               acc[fi].format.to_string(), report.results[fi].decode_tokens_per_s));
    }
  }
  return report;
}

}  // namespace qkvshare
