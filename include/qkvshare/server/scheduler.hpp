#pragma once
// The server's one interface to the engine. A Job is a checked completion
// request (prompt tokens, where its KV may come from, sampling); the
// scheduler runs it to the end and reports text as it is produced.
//
// The implementation (batched_scheduler.cpp) drives the engine's step API
// (engine/scheduler.hpp) from one worker thread: it admits queued jobs up to
// `parallel`, and every step is one Engine::forward_batch over the next token
// of every decoding request and prompt chunks of the others, so concurrent
// requests decode in one batched pass and stream together.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "qkvshare/engine/sampler.hpp"
#include "qkvshare/engine/splice.hpp"
#include "qkvshare/kv/kv_format.hpp"
#include "qkvshare/server/api.hpp"
#include "qkvshare/server/context_store.hpp"

namespace qkvshare::server {

class Metrics;

struct ChoiceResult {
  std::string text;
  std::string finish_reason;  // "stop" | "length"
  int completion_tokens = 0;
  SealedInfo context;         // its sealed context (prompt + reply)
};

struct JobEvent {
  int index = 0;
  std::string delta;
  std::optional<std::string> finish_reason;  // set on a choice's last event
};

struct Job {
  using Clock = std::chrono::steady_clock;
  // Set by the HTTP handler before submit().
  std::string tenant, endpoint;
  std::vector<TokenId> prompt;              // the whole prompt
  std::optional<std::uint64_t> base;        // an explicit context (a prefix of `prompt`, but for splice)
  ReuseMode mode = ReuseMode::none;         // continue / fork / splice with `base`
  // Splice: base's tokens [src_begin, src_begin + tokens) are prompt's
  // [prompt_begin, ...) (the longest run they share; tokens 0: none).
  struct SpliceSpan {
    int prompt_begin = 0, src_begin = 0, tokens = 0;
  } splice;
  SpliceOptions splice_options;
  bool auto_reuse = true;
  KvFormat format;
  std::vector<std::string> grant_to;
  int n = 1, max_tokens = 256;
  SamplingParams sampling;
  std::vector<std::string> stop;
  bool ignore_eos = false;  // replies run to max_tokens or a stop string
  Clock::time_point submitted = Clock::now();
  std::atomic<bool> cancelled{false};       // the client went away

  // Written by the scheduler, read under `mu`.
  std::mutex mu;
  std::condition_variable cv;
  bool started = false;  // prefill done (first tokens follow) or failed
  bool done = false;
  std::exception_ptr error;
  std::deque<JobEvent> events;
  std::vector<ChoiceResult> choices;
  int prompt_tokens = 0, cached_tokens = 0;
  ReuseMode reused_as = ReuseMode::none;    // how the cached tokens were obtained
  std::string reused_from;                  // the context they came from
  bool automatic = false;                   // found by the index, not named by the client
  // Every splice the job made (mode splice: one; automatic reuse: a span of
  // another context found inside the prompt after its prefix, each).
  struct Splice {
    int prompt_begin = 0, context_begin = 0;
    std::string from;
    SpliceResult result;
  };
  std::vector<Splice> splices;
  double ttft_seconds = 0.0;
};

struct SchedulerOptions {
  int parallel = 4;       // jobs decoding at once
  int queue = 64;         // jobs waiting beyond those; more is 429
  int prefill_chunk = 256;  // tokens per step (the step API's token budget), so one long prompt does not stall the others
  int capacity = 0;       // tokens per session (0: the model's context length)
};

class Scheduler {
 public:
  virtual ~Scheduler() = default;
  // Queues a job; ApiError 429 when the queue is full, 503 when shutting down.
  virtual void submit(std::shared_ptr<Job> job) = 0;
  // Stops admitting; with `cancel` ends running jobs at their next step, else
  // lets them finish. Returns when the worker has stopped.
  virtual void shutdown(bool cancel) = 0;
  virtual int queue_depth() const = 0;
  virtual int active() const = 0;
};

std::unique_ptr<Scheduler> make_batched_scheduler(Engine& engine, ContextStore& store, Metrics& metrics,
                                                  SchedulerOptions options);

}  // namespace qkvshare::server
