#include "qkvshare/engine/generate.hpp"

#include <chrono>

#include "qkvshare/core/error.hpp"

namespace qkvshare {

std::string_view to_string(StopReason reason) noexcept {
  switch (reason) {
    case StopReason::max_tokens: return "max_tokens";
    case StopReason::end_of_generation: return "end_of_generation";
    case StopReason::stop_string: return "stop_string";
    case StopReason::context_full: return "context_full";
  }
  return "unknown";
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Holds back the tail of the text that could still grow into a stop string.
class StopStringFilter {
 public:
  StopStringFilter(const std::vector<std::string>& stops, const std::function<void(std::string_view)>& sink)
      : stops_(stops), sink_(sink) {}

  // Returns true when a stop string was found; text before it is emitted.
  bool push(std::string_view piece, std::string& accepted) {
    pending_ += piece;
    std::size_t cut = std::string::npos;
    for (const auto& s : stops_)
      if (!s.empty()) cut = std::min(cut, pending_.find(s));
    if (cut != std::string::npos) {
      emit(pending_.substr(0, cut), accepted);
      pending_.clear();
      return true;
    }
    std::size_t hold = 0;
    for (const auto& s : stops_)
      for (std::size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k)
        if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
    emit(pending_.substr(0, pending_.size() - hold), accepted);
    pending_.erase(0, pending_.size() - hold);
    return false;
  }
  void flush(std::string& accepted) {
    emit(pending_, accepted);
    pending_.clear();
  }

 private:
  void emit(std::string_view text, std::string& accepted) {
    if (text.empty()) return;
    accepted += text;
    if (sink_) sink_(text);
  }
  const std::vector<std::string>& stops_;
  const std::function<void(std::string_view)>& sink_;
  std::string pending_;
};

}  // namespace

GenerateResult generate(Engine& engine, Session& session, std::span<const TokenId> prompt,
                        const GenerateOptions& options, const std::function<void(std::string_view)>& on_text) {
  if (options.max_new_tokens < 0)
    fail(ErrorCode::invalid_argument, "max new tokens must be >= 0, got {}", options.max_new_tokens);
  if (prompt.empty()) fail(ErrorCode::invalid_argument, "generate: the prompt has no tokens");
  const Tokenizer& tok = engine.model().tokenizer();
  const int limit = std::min(engine.model().config().context_length, session.cache().capacity());
  Sampler sampler(options.sampling);
  GenerateResult result;
  StopStringFilter filter(options.stop_strings, on_text);

  const auto t0 = Clock::now();
  std::span<const float> logits = engine.forward(session, prompt);
  result.prefill_tokens = static_cast<int>(prompt.size());
  result.prefill_seconds = seconds_since(t0);

  const auto t1 = Clock::now();
  TokenId prev = session.tokens().back();
  for (int i = 0; i < options.max_new_tokens; ++i) {
    if (options.on_logits) options.on_logits(logits);
    const TokenId next = sampler.sample(logits, session.tokens());
    if (options.stop_at_end_of_generation && tok.is_end_of_generation(next)) {
      result.stop_reason = StopReason::end_of_generation;
      break;
    }
    result.tokens.push_back(next);
    if (filter.push(tok.token_to_piece(prev, next), result.text)) {
      result.stop_reason = StopReason::stop_string;
      break;
    }
    prev = next;
    if (i + 1 == options.max_new_tokens) break;  // the last token needs no forward pass
    if (session.n_past() >= limit) {
      result.stop_reason = StopReason::context_full;
      break;
    }
    logits = engine.forward(session, std::span<const TokenId>(&next, 1));
    ++result.decode_tokens;
  }
  if (result.stop_reason != StopReason::stop_string) filter.flush(result.text);
  result.decode_seconds = seconds_since(t1);
  return result;
}

GenerateResult generate_forced(Engine& engine, Session& session, std::span<const TokenId> prompt,
                               std::span<const TokenId> forced,
                               const std::function<void(std::span<const float>)>& on_logits) {
  if (prompt.empty()) fail(ErrorCode::invalid_argument, "generate: the prompt has no tokens");
  GenerateResult result;
  const auto t0 = Clock::now();
  std::span<const float> logits = engine.forward(session, prompt);
  result.prefill_tokens = static_cast<int>(prompt.size());
  result.prefill_seconds = seconds_since(t0);
  const auto t1 = Clock::now();
  for (std::size_t i = 0; i < forced.size(); ++i) {
    if (on_logits) on_logits(logits);
    if (i + 1 == forced.size()) break;
    logits = engine.forward(session, forced.subspan(i, 1));
    ++result.decode_tokens;
  }
  result.tokens.assign(forced.begin(), forced.end());
  result.text = engine.model().tokenizer().decode(result.tokens);
  result.decode_seconds = seconds_since(t1);
  return result;
}

}  // namespace qkvshare
