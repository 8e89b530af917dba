#pragma once
// Quality of KV formats on real text: perplexity over windows, and against the
// f32-KV run of the same windows the KL divergence of the next-token
// distributions and top-1 agreement (qkvshare eval, docs/kv-quality.md).
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "qkvshare/engine/engine.hpp"
#include "qkvshare/kv/kv_format.hpp"

namespace qkvshare {

// How a window is run. prefill: the whole window by one session, in
// max_batch passes. handoff: a producer prefills the first half and its
// context is sealed; a consumer continues it (the producer's blocks shared, as
// a handoff opens them) in passes of `chunk` tokens and is scored on the
// second half, its own tokens read at the precision of its passes.
enum class EvalProtocol { prefill, handoff };

struct EvalOptions {
  int ctx = 512;             // window length in tokens; windows do not overlap
  long max_scored = 0;       // stop once this many tokens are scored (whole windows); 0: the whole text,
                             // < 0: no quality windows at all (decode speed only)
  bool score_all = false;    // score every position; default: the second half of each window (llama.cpp)
  int block_tokens = 32;
  EvalProtocol protocol = EvalProtocol::prefill;
  int chunk = 64;            // handoff: the consumer's tokens per forward pass
  int decode_tokens = 0;     // > 0: also time this many decode steps ending at depth ctx, per format
                             // (formats interleaved step by step; the median step counts)
  // Called with a line of progress (window, format, running perplexity).
  std::function<void(const std::string&)> progress;
};

struct EvalFormatResult {
  std::string format;
  double bits_per_element = 0.0;     // stored bytes of a full window (codes, scales, mins, hot blocks) per element
  double cold_bits_per_element = 0.0;  // a full quantized block alone
  // Handoff protocol: the producer's context as handed off, measured on its
  // blocks (whole blocks, hot ones included). For a mixed format
  // bits_per_element is then measured too: the scored window as stored (the
  // producer's half demoted, the consumer's own blocks in the high precision).
  double handoff_bits_per_element = 0.0;
  double kv_bytes_per_token = 0.0;   // pool pages a full window holds, per token (page padding included)
  double ppl = 0.0;
  double ppl_delta_pct = 0.0;        // vs the f32 reference
  double mean_kl = 0.0;              // KL(f32 || format), nats per position
  double p99_kl = 0.0;
  double top1 = 0.0;                 // fraction of positions whose argmax equals the f32 argmax
  long scored = 0;
  double prefill_tokens_per_s = 0.0;
  double decode_tokens_per_s = 0.0;  // 0 unless decode_tokens > 0
};

struct EvalReport {
  int ctx = 0;
  long windows = 0;
  long scored = 0;  // per format
  long text_tokens = 0;
  bool score_all = false;
  std::vector<EvalFormatResult> results;  // results[0] is the f32 reference
};

// The formats `--kv all` runs.
std::vector<KvFormat> all_eval_formats();

// Evaluates `formats` (the f32 reference is always run first) over `tokens`,
// the whole tokenized text. Throws Error(invalid_argument) when the text is
// shorter than one window or ctx exceeds the model's context.
EvalReport evaluate_kv(Engine& engine, std::span<const TokenId> tokens, std::span<const KvFormat> formats,
                       const EvalOptions& options);

}  // namespace qkvshare
