#include "qkvshare/engine/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "qkvshare/core/error.hpp"

namespace qkvshare {

void SamplingParams::validate() const {
  if (!std::isfinite(temperature) || temperature < 0.0f)
    fail(ErrorCode::invalid_argument, "temperature must be a finite number >= 0, got {}", temperature);
  if (!(top_p > 0.0f && top_p <= 1.0f)) fail(ErrorCode::invalid_argument, "top-p must be in (0, 1], got {}", top_p);
  if (!(min_p >= 0.0f && min_p < 1.0f)) fail(ErrorCode::invalid_argument, "min-p must be in [0, 1), got {}", min_p);
  if (!(repeat_penalty > 0.0f && std::isfinite(repeat_penalty)))
    fail(ErrorCode::invalid_argument, "repeat penalty must be > 0, got {}", repeat_penalty);
  if (repeat_last_n < 0) fail(ErrorCode::invalid_argument, "repeat-last-n must be >= 0, got {}", repeat_last_n);
  if (top_k < 0) fail(ErrorCode::invalid_argument, "top-k must be >= 0, got {}", top_k);
}

Sampler::Sampler(SamplingParams params) : params_(params), rng_(params.seed) { params_.validate(); }

TokenId Sampler::sample(std::span<const float> logits, std::span<const TokenId> history) {
  QKV_CHECK(!logits.empty());
  adjusted_.assign(logits.begin(), logits.end());
  if (params_.repeat_penalty != 1.0f && params_.repeat_last_n > 0) {
    // CTRL-style penalty, as llama.cpp applies it: divide positive logits, multiply negative ones.
    const std::size_t n = std::min(history.size(), static_cast<std::size_t>(params_.repeat_last_n));
    std::unordered_set<TokenId> seen(history.end() - static_cast<std::ptrdiff_t>(n), history.end());
    for (TokenId t : seen) {
      if (t < 0 || static_cast<std::size_t>(t) >= adjusted_.size()) continue;
      float& l = adjusted_[static_cast<std::size_t>(t)];
      l = l > 0.0f ? l / params_.repeat_penalty : l * params_.repeat_penalty;
    }
  }
  if (params_.temperature <= 0.0f) {
    // Greedy; ties go to the lowest id, as in llama2.c's argmax.
    return static_cast<TokenId>(std::max_element(adjusted_.begin(), adjusted_.end()) - adjusted_.begin());
  }

  candidates_.clear();
  candidates_.reserve(adjusted_.size());
  for (std::size_t i = 0; i < adjusted_.size(); ++i)
    candidates_.emplace_back(adjusted_[i], static_cast<TokenId>(i));
  auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  std::size_t keep = candidates_.size();
  if (params_.top_k > 0) keep = std::min(keep, static_cast<std::size_t>(params_.top_k));
  std::partial_sort(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(keep), candidates_.end(),
                    by_logit);
  candidates_.resize(keep);

  // Probabilities at the sampling temperature over the kept candidates.
  const float max_logit = candidates_.front().first;
  std::vector<double> probs(keep);
  double sum = 0.0;
  for (std::size_t i = 0; i < keep; ++i) {
    probs[i] = std::exp(static_cast<double>(candidates_[i].first - max_logit) / params_.temperature);
    sum += probs[i];
  }
  for (double& p : probs) p /= sum;

  std::size_t n = keep;
  if (params_.top_p < 1.0f) {
    double cum = 0.0;
    for (std::size_t i = 0; i < keep; ++i) {
      cum += probs[i];
      if (cum >= params_.top_p) {
        n = i + 1;
        break;
      }
    }
  }
  if (params_.min_p > 0.0f) {
    const double floor = probs[0] * params_.min_p;
    std::size_t m = 1;
    while (m < n && probs[m] >= floor) ++m;
    n = m;
  }
  std::discrete_distribution<std::size_t> pick(probs.begin(), probs.begin() + static_cast<std::ptrdiff_t>(n));
  return candidates_[pick(rng_)].second;
}

}  // namespace qkvshare
