#pragma once
// The decode loop: feed a prompt, then sample until a stop condition, with
// streamed text and timings.
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "qkvshare/engine/engine.hpp"
#include "qkvshare/engine/sampler.hpp"

namespace qkvshare {

struct GenerateOptions {
  int max_new_tokens = 128;
  SamplingParams sampling;
  std::vector<std::string> stop_strings;  // generation ends before the first occurrence
  bool stop_at_end_of_generation = true;  // EOS / end-of-turn tokens
  // Sees the logits each generated token was sampled from (quality measurements).
  std::function<void(std::span<const float>)> on_logits;
  // Teacher forcing: when not empty, these are the generated tokens instead
  // of samples (no end-of-generation or stop-string ends; max_new_tokens is
  // their count), so that runs compare along one token stream.
  std::vector<TokenId> forced;
};

// cancelled and error only end Scheduler requests (generate() throws instead).
enum class StopReason { max_tokens, end_of_generation, stop_string, context_full, cancelled, error };
std::string_view to_string(StopReason reason) noexcept;

struct GenerateResult {
  std::vector<TokenId> tokens;  // generated ids (an end-of-generation token is not included)
  std::string text;             // their text, cut before a stop string
  StopReason stop_reason = StopReason::max_tokens;
  int prefill_tokens = 0;
  int decode_tokens = 0;          // forward passes after the prompt
  double prefill_seconds = 0.0;   // prompt forward, which also yields the first token
  double decode_seconds = 0.0;
};

// Appends `prompt` to the session, then generates. `on_text` receives text as
// soon as it cannot be part of a stop string. A prompt that does not fit the
// context throws Error(context_full); reaching the limit while generating
// ends with StopReason::context_full.
GenerateResult generate(Engine& engine, Session& session, std::span<const TokenId> prompt,
                        const GenerateOptions& options,
                        const std::function<void(std::string_view)>& on_text = {});

// Teacher forcing: appends `prompt`, then feeds `forced` one token at a time
// instead of sampling, so that runs compare along one token stream; on_logits
// sees the distribution that predicts each forced token. Like generate(), the
// last token gets no forward pass. The result's tokens are `forced`.
GenerateResult generate_forced(Engine& engine, Session& session, std::span<const TokenId> prompt,
                               std::span<const TokenId> forced,
                               const std::function<void(std::span<const float>)>& on_logits);

}  // namespace qkvshare
