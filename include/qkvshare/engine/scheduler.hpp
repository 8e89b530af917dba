#pragma once
// Continuous batching over one Engine: requests (a session, a prompt, the
// generation settings) join and leave between steps; each step() is one
// Engine::forward_batch that carries the next token of every decoding request
// and prompt chunks of prefilling ones, so concurrent agents share every
// weight read.
//
// Per step, at most `token_budget` tokens run (this bounds a step's latency):
// decoding requests go first, one token each, by priority, then least
// recently served (fair when there are more of them than budget); the rest of
// the budget goes to prompts, chunked, by priority, then submission order (a
// long prompt is cut into chunks so decoding requests keep their pace). While
// a prompt waits, decoders leave it at least a quarter of the budget.
//
// Generation is exactly generate()'s (generate.hpp, which runs through a
// Scheduler): sampling, end-of-generation and stop strings, max tokens and
// the context limit per request; the last sampled token is not fed (it has no
// KV yet). A request fails alone: an entry error of forward_batch (pool
// exhausted, ...) or a throwing callback ends that request with its Error and
// leaves its session at its last good step; the other requests go on.
//
// Threads: submit(), cancel() and size() may be called from any thread; step()
// and run_until_idle() from one thread at a time (the engine's driver), which
// is also where every callback runs. A session must stay alive and untouched
// by others from submit() until its request has finished.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <vector>

#include "qkvshare/engine/engine.hpp"
#include "qkvshare/engine/generate.hpp"

namespace qkvshare {

using RequestId = std::uint64_t;

struct Request {
  Session* session = nullptr;   // not owned
  std::vector<TokenId> prompt;  // fed first; at least one token
  GenerateOptions options;
  int priority = 0;             // higher runs first
  std::function<void(std::string_view)> on_text;  // text as soon as it cannot be part of a stop string
  std::function<void(TokenId)> on_token;          // every generated token (end-of-generation excluded)
};

struct RequestResult {
  RequestId id = 0;
  GenerateResult generation;  // stop_reason cancelled / error when it did not end by itself
  std::optional<Error> error; // set when the request failed
  double ttft_seconds = 0;    // submit() to the first generated token (0 if none)
  double seconds = 0;         // submit() to the end
  int steps = 0;              // forward passes this request took part in
};

struct SchedulerOptions {
  int token_budget = 128;  // most tokens per step; capped at the engine's max_batch
  int max_sessions = 0;    // most requests per step (0: no limit)
};

class Scheduler {
 public:
  explicit Scheduler(Engine& engine, SchedulerOptions options = {});
  ~Scheduler();  // unfinished requests are dropped without callbacks
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request for the next step. Throws Error(invalid_argument) for a
  // null session, an empty prompt, bad options, an out-of-range token, a
  // session already in a request; Error(context_full) when the prompt does
  // not fit the session. Nothing is queued then.
  RequestId submit(Request request);
  // Ends the request at the next step boundary (StopReason::cancelled, what
  // it generated so far kept). Returns false for an unknown or finished id.
  bool cancel(RequestId id);

  // One forward pass over the chosen entries; false when there was nothing to run.
  bool step();
  void run_until_idle();

  // Requests submitted and not finished.
  std::size_t size() const noexcept { return unfinished_.load(); }
  // Results finished since the last call, in finishing order.
  std::vector<RequestResult> take_finished();
  std::uint64_t steps_run() const noexcept { return steps_; }

  // Called with each result as it finishes (on the stepping thread), after
  // the request's own callbacks.
  std::function<void(const RequestResult&)> on_finished;

 private:
  using Clock = std::chrono::steady_clock;
  struct Active;
  void admit();
  void sample(Active& a, std::span<const float> logits);
  void finish(Active& a, StopReason reason, std::optional<Error> error);

  Engine& engine_;
  SchedulerOptions options_;
  std::mutex mutex_;  // guards incoming_, cancelled_, sessions_, live_, next_id_
  std::list<Active> incoming_;
  std::set<RequestId> cancelled_;
  std::set<const Session*> sessions_;
  std::set<RequestId> live_;
  RequestId next_id_ = 1;
  std::atomic<std::size_t> unfinished_{0};
  std::list<Active> active_;  // stepping thread only
  std::vector<RequestResult> finished_;
  std::uint64_t steps_ = 0;
};

}  // namespace qkvshare
