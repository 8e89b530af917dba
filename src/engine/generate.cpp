#include "qkvshare/engine/generate.hpp"


#include <chrono>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/scheduler.hpp"

namespace qkvshare {

std::string_view to_string(StopReason reason) noexcept {
  switch (reason) {
    case StopReason::max_tokens: return "max_tokens";
    case StopReason::end_of_generation: return "end_of_generation";
    case StopReason::stop_string: return "stop_string";
    case StopReason::context_full: return "context_full";
    case StopReason::cancelled: return "cancelled";
    case StopReason::error: return "error";
  }
  return "unknown";
}

GenerateResult generate(Engine& engine, Session& session, std::span<const TokenId> prompt,
                        const GenerateOptions& options, const std::function<void(std::string_view)>& on_text) {
  // One request through the scheduler: the same loop as batched requests,
  // prompt chunks of max_batch tokens as before.
  SchedulerOptions so;
  so.token_budget = engine.options().max_batch;
  Scheduler scheduler(engine, so);
  Request request;
  request.session = &session;
  request.prompt.assign(prompt.begin(), prompt.end());
  request.options = options;
  request.on_text = on_text;
  if (request.prompt.empty()) fail(ErrorCode::invalid_argument, "generate: the prompt has no tokens");
  scheduler.submit(std::move(request));
  scheduler.run_until_idle();
  std::vector<RequestResult> done = scheduler.take_finished();
  QKV_CHECK(done.size() == 1);
  if (done[0].error) throw *done[0].error;
  return std::move(done[0].generation);
}

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
}  // namespace

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
