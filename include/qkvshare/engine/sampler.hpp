#pragma once
// Next-token choice from logits: greedy, or temperature sampling with top-k,
// top-p and min-p filtering, after a repetition penalty. Seeded: the same
// seed, logits and history give the same token.
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "qkvshare/model/tokenizer.hpp"

namespace qkvshare {

struct SamplingParams {
  float temperature = 0.8f;  // <= 0: greedy
  int top_k = 40;            // <= 0: off
  float top_p = 0.95f;       // >= 1: off
  float min_p = 0.05f;       // <= 0: off
  float repeat_penalty = 1.0f;  // 1: off
  int repeat_last_n = 64;
  std::uint64_t seed = 0;

  // Throws Error(invalid_argument) naming the bad field.
  void validate() const;
};

class Sampler {
 public:
  explicit Sampler(SamplingParams params);
  // `history` is the token sequence so far (for the repetition penalty).
  TokenId sample(std::span<const float> logits, std::span<const TokenId> history);
  const SamplingParams& params() const noexcept { return params_; }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, TokenId>> candidates_;
  std::vector<float> adjusted_;
};

}  // namespace qkvshare
