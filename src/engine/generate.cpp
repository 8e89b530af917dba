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

GenerateResult generate_forced(Engine& engine, Session& session, std::span<const TokenId> prompt,
                               std::span<const TokenId> forced,
                               const std::function<void(std::span<const float>)>& on_logits) {
  GenerateOptions options;
  options.forced.assign(forced.begin(), forced.end());
  options.max_new_tokens = static_cast<int>(forced.size());
  options.on_logits = on_logits;
  return generate(engine, session, prompt, options);
}

}  // namespace qkvshare
