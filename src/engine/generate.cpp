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
double now_seconds() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

}  // namespace

// Holds back the tail of the text that could still grow into a stop string.
class Generation::StopFilter {
 public:
  explicit StopFilter(const std::vector<std::string>& stops) : stops_(stops) {}

  // Returns true when a stop string was found; text before it is appended
  // to `accepted` and `released`.
  bool push(std::string_view piece, std::string& accepted, std::string& released) {
    pending_ += piece;
    std::size_t cut = std::string::npos;
    for (const auto& s : stops_)
      if (!s.empty()) cut = std::min(cut, pending_.find(s));
    if (cut != std::string::npos) {
      emit(pending_.substr(0, cut), accepted, released);
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
    emit(pending_.substr(0, pending_.size() - hold), accepted, released);
    pending_.erase(0, pending_.size() - hold);
    return false;
  }
  void flush(std::string& accepted, std::string& released) {
    emit(pending_, accepted, released);
    pending_.clear();
  }

 private:
  static void emit(std::string_view text, std::string& accepted, std::string& released) {
    accepted += text;
    released += text;
  }
  const std::vector<std::string>& stops_;
  std::string pending_;
};

Generation::Generation(Engine& engine, Session& session, std::span<const TokenId> prompt,
                       const GenerateOptions& options)
    : engine_(engine), session_(session), options_(options), sampler_(options.sampling) {
  if (options_.max_new_tokens < 0)
    fail(ErrorCode::invalid_argument, "max new tokens must be >= 0, got {}", options_.max_new_tokens);
  if (prompt.empty()) fail(ErrorCode::invalid_argument, "generate: the prompt has no tokens");
  filter_ = std::make_unique<StopFilter>(options_.stop_strings);
  limit_ = std::min(engine.model().config().context_length, session.cache().capacity());
  const double t0 = now_seconds();
  keep_logits(engine.forward(session, prompt));
  result_.prefill_tokens = static_cast<int>(prompt.size());
  result_.prefill_seconds = now_seconds() - t0;
  decode_start_ = now_seconds();
  prev_ = session.tokens().back();
  if (options_.max_new_tokens == 0) finish(StopReason::max_tokens);
}

Generation::~Generation() = default;

void Generation::finish(StopReason reason) {
  result_.stop_reason = reason;
  done_ = true;
  result_.decode_seconds = now_seconds() - decode_start_;
}

std::string Generation::step() {
  if (done_) fail(ErrorCode::invalid_argument, "generate: the generation has already ended");
  const Tokenizer& tok = engine_.model().tokenizer();
  std::string released;
  const TokenId next = sampler_.sample(logits_, session_.tokens());
  if (options_.stop_at_end_of_generation && tok.is_end_of_generation(next)) {
    filter_->flush(result_.text, released);
    finish(StopReason::end_of_generation);
    return released;
  }
  result_.tokens.push_back(next);
  if (filter_->push(tok.token_to_piece(prev_, next), result_.text, released)) {
    finish(StopReason::stop_string);
    return released;
  }
  prev_ = next;
  StopReason reason = StopReason::max_tokens;
  bool stop = static_cast<int>(result_.tokens.size()) == options_.max_new_tokens;  // the last token needs no pass
  if (!stop && session_.n_past() >= limit_) {
    stop = true;
    reason = StopReason::context_full;
  }
  if (stop) {
    filter_->flush(result_.text, released);
    finish(reason);
    return released;
  }
  keep_logits(engine_.forward(session_, std::span<const TokenId>(&next, 1)));
  ++result_.decode_tokens;
  return released;
}

GenerateResult generate(Engine& engine, Session& session, std::span<const TokenId> prompt,
                        const GenerateOptions& options, const std::function<void(std::string_view)>& on_text) {
  Generation g(engine, session, prompt, options);
  while (!g.done()) {
    const std::string text = g.step();
    if (on_text && !text.empty()) on_text(text);
  }
  return g.result();
}

}  // namespace qkvshare
