#pragma once
// Measures splices against the text re-prefill they approximate: one
// producer context per KV format, then for each recompute fraction a consumer
// that splices the producer's chunk under its own prefix, teacher-forced
// along the reference's greedy continuation. The reference is the text
// re-prefill with f32 KV. What the guard is calibrated on
// (bench/splice_calibrate.py) and what the KL-vs-recompute plot shows.
#include <string>
#include <vector>

#include "qkvshare/engine/splice.hpp"
#include "qkvshare/kv/kv_pool.hpp"

namespace qkvshare {

struct SpliceCase {
  std::vector<TokenId> producer_prefix;  // what the chunk was computed under
  std::vector<TokenId> chunk;            // the spliced tokens
  std::vector<TokenId> consumer_prefix;  // what it is spliced under
  std::vector<TokenId> suffix;           // the consumer's own turn after it
};

// Which tokens a sample's splice recomputes: the head (what splice_tokens
// does), and/or CacheBlend's choice, the tokens of largest K+V deviation at
// `check_layers` (splice_token_deviation; its ranking pass is not timed).
struct SpliceSelection {
  bool head = true;
  bool deviation = false;
  std::vector<int> check_layers{1};
};

struct SpliceSample {
  std::string format;
  std::string select = "head";  // "head" or "deviation" (SpliceSelection)
  double fraction = 0;
  double estimate = 0;   // the guard's estimate (splice_probe) at this fraction (-1: not probed)
  double kl = 0;         // mean KL(p_reference || p_splice) over the forced positions
  double kl_text = 0;    // mean KL(p_text || p_splice), p_text the text re-prefill in the same format:
                         // what the splice adds over the fallback the guard would choose
  double text_kl = 0;    // mean KL(p_reference || p_text): the format's own floor
  // mean KL(p_fallback || p_splice), p_fallback what the guard's fallback
  // computes: the consumer's prefix in its own pass (a cached system prompt),
  // then every spliced token recomputed under it in one pass (recompute 1.0).
  // It differs from p_text, which prefills prefix and chunk in one pass, when
  // the format is below 8 bits: the chunk then attends to the quantized prefix.
  double kl_fallback = 0;
  double fallback_kl = 0;  // mean KL(p_reference || p_fallback)
  // The probe's relative RMS deviation of V alone and of K alone (-1: keys not
  // compared, probe_compares_keys), for calibrating either estimator.
  double v_dev = 0, k_dev = -1;
  double top1 = 0;       // share of positions whose argmax equals the reference's
  double nll = 0;        // mean negative log-likelihood of the forced tokens (PPL = exp)
  int recomputed = 0, reused = 0;
  double ttft_splice = 0;  // consumer prefix + splice + suffix, seconds
  double ttft_text = 0;    // the same tokens prefilled as text in this format
};

// `forced` tokens of the reference's greedy continuation are scored.
std::vector<SpliceSample> evaluate_splices(Engine& engine, const std::shared_ptr<KvPool>& pool, const SpliceCase& c,
                                           const std::vector<std::string>& formats,
                                           const std::vector<double>& fractions, int forced, int probe_tokens,
                                           const SpliceSelection& selection = {});

}  // namespace qkvshare
