#pragma once
// Equal work across modes (teacher forcing): the reference run (text
// re-prefill, f32 KV) records each step's greedy tokens and the distribution
// that predicted each one; every other mode's run feeds the same tokens and
// scores its own distributions against those, so e2e time, TTFT and memory
// compare identical token streams, and quality is measured along them.
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "qkvshare/agents/workflow.hpp"
#include "qkvshare/engine/generate.hpp"
#include "qkvshare/model/tokenizer.hpp"

namespace qkvshare::agents {

struct TraceStep {
  std::vector<TokenId> tokens;
  std::vector<float> logprobs;  // [tokens][vocab]: row i predicted tokens[i]; empty when loaded
  std::uint64_t logprobs_offset = 0;  // where they are in the loaded file
};

// A loaded trace keeps only the tokens in memory and reads each distribution
// row from the file when it is scored: the rows are 4 x vocab bytes per
// token (69 MB for W1 on SmolLM2), which would otherwise sit in every forced
// run's peak RSS and blur the memory comparison.
struct ReferenceTrace {
  int vocab = 0;
  std::map<std::string, TraceStep> steps;
  void save(const std::string& path) const;
  static ReferenceTrace load(const std::string& path);  // Error(io / internal) naming the file
  // Row i of step s's distributions (from memory when recorded, else the file).
  const float* row(const TraceStep& s, std::size_t i, std::vector<float>& buffer) const;

 private:
  std::string path_;
  std::shared_ptr<int> fd_;  // the loaded file, closed with the last copy
};

// A step's generation settings: the agent's sampling, stop strings and
// length (capped by max_tokens_cap > 0), or, given the reference's step,
// exactly its tokens (equal work).
GenerateOptions step_generate_options(const AgentSpec& agent, int max_tokens_cap, const TraceStep* forced);

void log_softmax(std::span<const float> logits, std::vector<float>& out);

// KL(reference || this run), top-1 agreement and NLL of the forced tokens, summed over positions.
struct QualitySum {
  double kl = 0, nll = 0;
  int same = 0, n = 0;
  void add(const float* ref_logprobs, std::span<const float> logits, TokenId forced);
};

}  // namespace qkvshare::agents
