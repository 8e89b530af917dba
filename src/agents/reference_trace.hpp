#pragma once
// Equal work across modes (teacher forcing): the reference run (text
// re-prefill, f32 KV) records each step's greedy tokens and the distribution
// that predicted each one; every other mode's run feeds the same tokens and
// scores its own distributions against those, so e2e time, TTFT and memory
// compare identical token streams, and quality is measured along them.
#include <map>
#include <span>
#include <string>
#include <vector>

#include "qkvshare/model/tokenizer.hpp"

namespace qkvshare::agents {

struct TraceStep {
  std::vector<TokenId> tokens;
  std::vector<float> logprobs;  // [tokens][vocab]: row i predicted tokens[i]
};

struct ReferenceTrace {
  int vocab = 0;
  std::map<std::string, TraceStep> steps;
  void save(const std::string& path) const;
  static ReferenceTrace load(const std::string& path);  // Error(io / internal) naming the file
};

void log_softmax(std::span<const float> logits, std::vector<float>& out);

// KL(reference || this run), top-1 agreement and NLL of the forced tokens, summed over positions.
struct QualitySum {
  double kl = 0, nll = 0;
  int same = 0, n = 0;
  void add(const float* ref_logprobs, std::span<const float> logits, TokenId forced);
};

}  // namespace qkvshare::agents
