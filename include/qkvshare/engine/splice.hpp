#pragma once
// Splice at the engine level (docs/design.md handoff mode `splice`): another
// context's tokens go to the end of a session's context as a KV segment at a
// position offset (nothing copied, kv/pooled_kv_cache.hpp), after the first
// `recompute` fraction of them has been run again under this session's own
// prefix; the guard estimates, before anything is decoded, how far the
// result is from a text re-prefill, and recomputes more (up to all of it,
// which is the text handoff) while the estimate is above its threshold.
//
// Which tokens are recomputed: the first ones of the spliced range. Their KV
// deviates most (they are the nearest to the changed prefix, and every later
// token attends to them), and a recomputed head keeps the rest one contiguous
// segment, so attention pays for one extra segment, not one per token.
// CacheBlend's choice (the tokens that deviate most at check layers,
// splice_token_deviation + splice_marked_tokens below) measured no better at
// 15% on int8. The guard's probe measures the deviation right after the
// recomputed head; see docs/benchmarks.md "Splice" for the measurements.
#include <span>
#include <vector>

#include "qkvshare/engine/engine.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare {

struct SpliceOptions {
  double recompute = 0.15;  // fraction of the spliced tokens recomputed, 0..1
  bool guard = true;
  // Estimate (relative RMS deviation of K and V, see splice_probe) above which the
  // guard recomputes more; < 0: the value calibrated for the consumer's KV
  // format (guard_threshold()).
  double threshold = -1;
  int probe_tokens = 8;                    // tokens the probe runs (and drops)
  std::vector<double> escalation{0.5, 1.0};  // fractions tried in turn; 1.0 is the text handoff
};

// A probe's squared deviations per layer, summed over KV heads and probe
// tokens: num = ||src - fresh||^2, den = ||fresh||^2, for K and for V (K
// sums stay 0 where keys are not compared, probe_compares_keys). The estimate
// is sqrt(sum (k_num + v_num) / sum (k_den + v_den)); the parts are kept so
// that splice-eval can report K and V apart.
struct ProbeDeviation {
  std::vector<double> k_num, k_den, v_num, v_den;
  // The relative RMS deviation of K alone and of V alone (-1: not measured).
  double k() const;
  double v() const;
};

struct SpliceResult {
  int tokens = 0;      // spliced tokens
  int recomputed = 0;  // of them run through the model under this prefix
  int reused = 0;      // of them read from the source's blocks at an offset
  int probe_tokens = 0;           // tokens the guard ran and dropped
  double fraction = 0;            // recompute fraction finally used
  double estimate = -1;           // the guard's estimate at that fraction (-1: not measured)
  std::vector<double> estimates;  // every estimate taken, one per fraction tried
  ProbeDeviation deviation;       // the last probe's, per layer (empty: not measured)
  bool escalated = false;         // the guard raised the fraction
  bool text = false;              // ... up to every token (text handoff)
  double seconds = 0;
};

// The guard's thresholds calibrated per KV format by bench/splice_calibrate.py
// on 1,680 splices of SmolLM2-135M that reuse KV, of 64, 256 and 1,024 tokens
// (bench/results/splice_guard.md; one length's thresholds let through up to
// 13% of the other lengths' bad splices): of the estimates whose false-accept
// rate stays <= 5% on the calibration half, the smallest that lets the most
// good splices through, for "bad" = KL to the same-format text re-prefill >
// 0.02. Keyed by the smaller of the K and V bit widths (8, 4, below) and by
// whether the probe compares keys (a table for K+V estimates, one for V alone).
double guard_threshold(const KvFormat& format);

// Whether the probe compares keys: where they are stored before RoPE, or after
// it at their own positions (a RoPE rotation by the shift lines the source's up
// with the fresh ones), and not Hadamard-rotated (RoPE does not commute with
// it); keys rotated per block (KeyRope::block) are not compared either.
bool probe_compares_keys(const KvFormat& format);

// The number of tokens a fraction recomputes: round(fraction * n).
int recompute_count(double fraction, int n);

// Splices tokens [begin, end) of `src` (whose ids are `src_tokens`) into
// `session`, whose cache must be a PooledKvCache in the same pool.
// Error(invalid_argument) for a bad range, fraction or cache.
SpliceResult splice_tokens(Engine& engine, Session& session, const PooledKvCache& src,
                           std::span<const TokenId> src_tokens, int begin, int end, const SpliceOptions& options);

// The guard's estimate for reusing src's tokens [begin, end) right after the
// session's current tokens: runs the first `probe_tokens` of them on a fork
// of the session (dropped afterwards) and returns the relative RMS deviation
// ||KV_src - KV_fresh|| / ||KV_fresh|| over every layer and KV head, of K and V
// together (keys of the source rotated by the position shift), or of V alone
// where keys are not compared. K joined V after a sweep of 720 splices: it
// ranks bad splices above good ones more often (docs/benchmarks.md, "The guard").
double splice_probe(Engine& engine, const Session& session, const PooledKvCache& src,
                    std::span<const TokenId> src_tokens, int begin, int end, int probe_tokens);

// The same probe, returning its per-layer sums (empty vectors when there is
// nothing to probe); splice_probe() = probe_estimate(splice_probe_layers()).
ProbeDeviation splice_probe_layers(Engine& engine, const Session& session, const PooledKvCache& src,
                                   std::span<const TokenId> src_tokens, int begin, int end, int probe_tokens);
double probe_estimate(const ProbeDeviation& d);

// CacheBlend's choice of tokens to recompute, measured against the head
// (splice-eval --select deviation): the relative RMS deviation, per spliced
// token, of its K and V at `check_layers` (all KV heads; keys rotated by the
// shift where the probe compares keys) between src's rows and the same token
// recomputed under the session's prefix. Recomputes every token of [begin,
// end) on a fork (dropped): CacheBlend runs only the check layers for that, so
// this gives the choice's quality, not its cost.
std::vector<double> splice_token_deviation(Engine& engine, const Session& session, const PooledKvCache& src,
                                           std::span<const TokenId> src_tokens, int begin, int end,
                                           std::span<const int> check_layers);

// Splices [begin, end) of src recomputing exactly the tokens whose flag in
// `recompute` (one per token) is set: runs of recomputed and of reused tokens
// are placed in order, each reused run a segment of src's blocks, so every
// recomputed token attends to what precedes it as the text would place it
// (the reused tokens' KV from src). No guard. Error(invalid_argument) for a
// bad range or mask.
SpliceResult splice_marked_tokens(Engine& engine, Session& session, const PooledKvCache& src,
                                  std::span<const TokenId> src_tokens, int begin, int end,
                                  const std::vector<char>& recompute);

}  // namespace qkvshare
