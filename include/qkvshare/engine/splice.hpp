#pragma once
// Splice at the engine level (DESIGN.md handoff mode `splice`): another
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
// segment, so attention pays for one extra segment, not one per token. The
// guard's probe measures the deviation right after the recomputed head; see
// docs/benchmarks.md "Splice" for the measurements behind both choices.
#include <span>
#include <vector>

#include "qkvshare/engine/engine.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare {

struct SpliceOptions {
  double recompute = 0.15;  // fraction of the spliced tokens recomputed, 0..1
  bool guard = true;
  // Estimate (relative RMS deviation of V, see splice_probe) above which the
  // guard recomputes more; < 0: the value calibrated for the consumer's KV
  // format (guard_threshold()).
  double threshold = -1;
  int probe_tokens = 8;                    // tokens the probe runs (and drops)
  std::vector<double> escalation{0.5, 1.0};  // fractions tried in turn; 1.0 is the text handoff
};

struct SpliceResult {
  int tokens = 0;      // spliced tokens
  int recomputed = 0;  // of them run through the model under this prefix
  int reused = 0;      // of them read from the source's blocks at an offset
  int probe_tokens = 0;           // tokens the guard ran and dropped
  double fraction = 0;            // recompute fraction finally used
  double estimate = -1;           // the guard's estimate at that fraction (-1: not measured)
  std::vector<double> estimates;  // every estimate taken, one per fraction tried
  bool escalated = false;         // the guard raised the fraction
  bool text = false;              // ... up to every token (text handoff)
  double seconds = 0;
};

// The guard's thresholds calibrated per KV format by bench/splice_calibrate.py
// on 216 splices of SmolLM2-135M (bench/results/splice_guard.md): of the
// estimates whose false-accept rate stays <= 5% on the calibration half, the
// smallest that lets the most good splices through, for "bad" = KL to the
// same-format text re-prefill > 0.02. Keyed by the smaller of the K and V bit
// widths: >= 8 bits 0.2364; below, 0 (no int4 splice of the calibration half
// was good and none of int2's at all: a threshold above 0 would only let bad
// ones through, so the guard recomputes those splices up to a text handoff).
double guard_threshold(const KvFormat& format);

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
// ||V_src - V_fresh|| / ||V_fresh|| over every layer and KV head.
double splice_probe(Engine& engine, const Session& session, const PooledKvCache& src,
                    std::span<const TokenId> src_tokens, int begin, int end, int probe_tokens);

}  // namespace qkvshare
