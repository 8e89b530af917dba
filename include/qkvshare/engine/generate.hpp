#pragma once
// The decode loop: feed a prompt, then sample until a stop condition, with
// streamed text and timings.
#include <functional>
#include <memory>
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
};

enum class StopReason { max_tokens, end_of_generation, stop_string, context_full };
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

// generate() one token at a time, for callers that drive the loop themselves
// (the Python package's stream iterator): the constructor prefills the prompt,
// each step() samples one token and runs its forward pass when another token
// will follow. generate() is this loop, so both give the same tokens.
class Generation {
 public:
  Generation(Engine& engine, Session& session, std::span<const TokenId> prompt, const GenerateOptions& options);
  ~Generation();
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  bool done() const noexcept { return done_; }
  // One token; returns the text it released (often empty: held back for a
  // stop string, or nothing left). Error(invalid_argument) after done().
  std::string step();
  // The tokens and text so far; final (stop reason, timings) once done().
  const GenerateResult& result() const noexcept { return result_; }
  // Next-token logits of the last forward pass (owned here: the engine's own
  // buffer is overwritten by any other session's pass on the same engine).
  std::span<const float> logits() const noexcept { return logits_; }

 private:
  class StopFilter;
  Engine& engine_;
  Session& session_;
  GenerateOptions options_;
  Sampler sampler_;
  std::unique_ptr<StopFilter> filter_;
  GenerateResult result_;
  std::vector<float> logits_;
  TokenId prev_ = -1;
  int limit_ = 0;
  bool done_ = false;
  double decode_start_ = 0.0;  // steady-clock seconds when decoding began
  void finish(StopReason reason);
  void keep_logits(std::span<const float> logits) { logits_.assign(logits.begin(), logits.end()); }
};

}  // namespace qkvshare
