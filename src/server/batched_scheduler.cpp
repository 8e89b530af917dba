// BatchedScheduler (scheduler.hpp): the server's jobs on the engine's step
// API. One worker thread owns a qkvshare::Scheduler; every step() is one
// Engine::forward_batch carrying the next token of every decoding request and
// prompt chunks of prefilling ones, so concurrent HTTP requests share every
// weight read. A job is one engine request per choice; with n > 1 the prompt
// is fed once (a request with max_new_tokens 0) and the choices fork its KV.
#include <algorithm>
#include <list>
#include <map>
#include <thread>

#include "qkvshare/engine/scheduler.hpp"
#include "qkvshare/core/clock.hpp"
#include "qkvshare/server/metrics.hpp"
#include "qkvshare/server/scheduler.hpp"
#include "qkvshare/share/handoff.hpp"

namespace qkvshare::server {

namespace {

// Shorter runs of another context are prefilled: a splice costs its guard's 8-token probe.
constexpr int kMinAutoSplice = 32;
// A job waits for a running one to feed the prompt prefix they share when it
// would save at least this many tokens over what the index already holds.
constexpr int kMinSharedPrefix = 16;

using Clock = std::chrono::steady_clock;

struct Choice {
  std::unique_ptr<Session> session;
  RequestId id = 0;
  bool live = false;
  Clock::time_point last = Clock::now();
  ChoiceResult result;
  std::optional<TokenId> pending;  // the last sampled token of a reply cut by length: not fed, so not in the session
};

struct Running {
  std::shared_ptr<Job> job;
  // Admitted but not begun: a running job is still feeding the prompt prefix
  // this one shares with it (concurrent agents resending one transcript).
  bool waiting = true, waited = false;
  std::optional<std::uint64_t> checkpoint;  // its fed prompt, sealed for the jobs that waited on it
  std::unique_ptr<Session> prefix;  // n > 1: the session the prompt is fed into, then forked
  RequestId prefill_id = 0;
  bool prefill_live = false;
  std::vector<Choice> choices;
  std::exception_ptr error;         // the job failed; waits for its live requests to end
  bool cancel_sent = false, emitted = false, first_token = false;
  int retries = 0;
  bool live() const {
    return waiting || prefill_live || std::any_of(choices.begin(), choices.end(), [](const Choice& c) { return c.live; });
  }
};

std::size_t common_prefix(std::span<const TokenId> a, std::span<const TokenId> b) {
  return static_cast<std::size_t>(std::mismatch(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(std::min(a.size(), b.size())),
                                                b.begin()).first - a.begin());
}

const char* finish_reason(StopReason r) {
  return r == StopReason::end_of_generation || r == StopReason::stop_string ? "stop" : "length";
}

// A reply cut by length ends on a sampled token that was never fed (the next
// step would have); the client's transcript holds it, so the context keeps it.
// (An end-of-generation token is not in `tokens`; a stop string's text is cut anyway.)
std::optional<TokenId> pending_token(const GenerateResult& g) {
  const bool by_length = g.stop_reason == StopReason::max_tokens || g.stop_reason == StopReason::context_full;
  if (!by_length || g.tokens.empty()) return std::nullopt;
  return g.tokens.back();
}

class BatchedScheduler final : public Scheduler {
 public:
  BatchedScheduler(Engine& engine, ContextStore& store, Metrics& metrics, SchedulerOptions o)
      : engine_(engine), store_(store), metrics_(metrics), o_(o),
        steps_(engine, qkvshare::SchedulerOptions{o.prefill_chunk, 0}) {
    if (o_.capacity <= 0) o_.capacity = engine.model().config().context_length;
    worker_ = std::thread([this] { loop(); });
  }
  ~BatchedScheduler() override { shutdown(true); }

  void submit(std::shared_ptr<Job> job) override {
    std::lock_guard lock(mu_);
    if (stopping_) throw ApiError(503, "server_shutting_down", "", "the server is shutting down");
    if (static_cast<int>(queue_.size()) + active_ >= o_.parallel + o_.queue)
      throw ApiError(429, "rate_limit_error", "",
                     fmt::format("the request queue is full ({} waiting, {} running); retry later", queue_.size(), active_));
    queue_.push_back(std::move(job));
    cv_.notify_all();
  }

  void shutdown(bool cancel) override {
    {
      std::lock_guard lock(mu_);
      if (!stopping_) {
        stopping_ = true;
        cancel_all_ = cancel;
        for (auto& j : queue_) fail_job(*j, shutting_down());
        queue_.clear();
      }
      cv_.notify_all();
    }
    if (worker_.joinable()) worker_.join();
  }

  int queue_depth() const override {
    std::lock_guard lock(mu_);
    return static_cast<int>(queue_.size());
  }
  int active() const override {
    std::lock_guard lock(mu_);
    return active_;
  }

 private:
  static std::exception_ptr shutting_down() {
    return std::make_exception_ptr(ApiError(503, "server_shutting_down", "", "the server is shutting down"));
  }
  static void fail_job(Job& job, std::exception_ptr e) {
    std::lock_guard lock(job.mu);
    job.error = std::move(e);
    job.started = job.done = true;
    job.cv.notify_all();
  }

  void loop() {
    for (;;) {
      std::vector<std::shared_ptr<Job>> admitted;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !running_.empty() || !queue_.empty(); });
        if (stopping_ && cancel_all_)
          for (Running& r : running_) r.job->cancelled = true;
        if (stopping_ && running_.empty()) {
          active_ = 0;
          return;
        }
        while (!queue_.empty() && static_cast<int>(running_.size() + admitted.size()) < o_.parallel) {
          admitted.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
        active_ = static_cast<int>(running_.size() + admitted.size());
      }
      for (auto& job : admitted) {
        running_.emplace_back();
        running_.back().job = std::move(job);
      }
      start_waiting();
      for (Running& r : running_)
        if (r.job->cancelled && (r.waiting || !r.cancel_sent)) {
          metrics_.add("qkvshare_requests_cancelled_total", "");
          auto gone = std::make_exception_ptr(ApiError(499, "cancelled", "", "the client closed the connection"));
          if (r.waiting) {  // never begun: nothing to stop in the engine
            r.waiting = false;
            r.error = std::move(gone);
          } else {
            cancel(r, std::move(gone));
          }
        }
      metrics_.set("qkvshare_queue_depth", "", queue_depth());
      metrics_.set("qkvshare_sessions_active", "", static_cast<double>(running_.size()));
      steps_.step();
      start_waiting();
      for (RequestResult& res : steps_.take_finished()) finished(res);
      for (auto it = running_.begin(); it != running_.end();) {
        if (it->live()) {
          ++it;
          continue;
        }
        if (it->error) {
          it->choices.clear();  // the blocks go back before the client hears of it
          it->prefix.reset();
          fail_job(*it->job, it->error);
        }
        release_checkpoint(*it);
        it = running_.erase(it);
      }
      {
        std::lock_guard lock(mu_);
        active_ = static_cast<int>(running_.size());
      }
      if (const int n = store_.evict_over_budget(); n > 0) metrics_.add("qkvshare_contexts_evicted_total", "", n);
    }
  }

  // Jobs that can feed a prompt prefix for others: one engine request on a session of their own.
  static bool feeds_prefix(const Running& r) {
    return !r.waiting && r.job->n == 1 && r.job->auto_reuse && !r.job->base && !r.error && r.choices.size() == 1 &&
           r.choices[0].live && r.choices[0].session;
  }

  // The running job whose prompt shares the longest prefix with `j`'s, when
  // that prefix is at least kMinSharedPrefix tokens longer than what the
  // index holds; nullptr otherwise. Concurrent agents resend one transcript:
  // the first computes its new part, the others fork it.
  Running* prefix_source(const Running& j) {
    const Job& job = *j.job;
    if (!job.auto_reuse || job.base) return nullptr;
    Running* best = nullptr;
    std::size_t best_len = 0;
    for (Running& r : running_) {
      if (&r == &j || r.checkpoint || !feeds_prefix(r) || r.job->tenant != job.tenant || !(r.job->format == job.format))
        continue;
      const std::size_t n = common_prefix(job.prompt, r.job->prompt);
      if (n > best_len) best = &r, best_len = n;
    }
    if (best == nullptr) return nullptr;
    const int indexed = store_.lookup(job.tenant, job.format, job.prompt).tokens;
    return static_cast<int>(best_len) >= indexed + kMinSharedPrefix ? best : nullptr;
  }

  // Begins, in arrival order, every admitted job whose shared prefix no
  // running job is still feeding; a source that has fed its prompt (its first
  // token is out) first seals a copy of its KV, indexed, for them to fork.
  void start_waiting() {
    for (Running& r : running_) {
      if (!r.waiting || r.job->cancelled) continue;
      if (Running* src = prefix_source(r)) {
        if (!src->first_token) {
          if (!r.waited) metrics_.add("qkvshare_prefix_waits_total", "");
          r.waited = true;
          continue;
        }
        checkpoint(*src);
      }
      r.waiting = false;
      begin(r);
    }
  }

  void checkpoint(Running& r) {
    Session& session = *r.choices[0].session;
    auto& cache = dynamic_cast<PooledKvCache&>(session.cache());
    if (cache.size() != session.n_past()) return;
    try {
      const Session copy(cache.fork(), session.tokens());
      r.checkpoint = store_.add(r.job->tenant, copy, {}, true).id;
      metrics_.add("qkvshare_prompt_checkpoints_total", "");
    } catch (const Error&) {
      // pool or records full: the jobs waiting on it begin without it
    }
  }

  // The checkpoint is a prefix of the job's own context (sealed at its end), or of nothing if it failed.
  void release_checkpoint(Running& r) {
    if (!r.checkpoint) return;
    try {
      store_.release(r.job->tenant, *r.checkpoint);
    } catch (const ApiError&) {
      // evicted meanwhile
    }
    r.checkpoint.reset();
  }

  // Where the job's KV comes from (a named context, the index, or nothing), then its engine requests.
  void begin(Running& r) {
    try {
      Job& job = *r.job;
      std::unique_ptr<Session> session = open_reuse(job);
      job.prompt_tokens = static_cast<int>(job.prompt.size());
      metrics_.add("qkvshare_prompt_tokens_total", "", job.prompt_tokens);
      int spliced = 0;  // counted by splice_span under mode="splice"
      for (const Job::Splice& sp : job.splices) spliced += sp.result.reused;
      if (job.reused_as != ReuseMode::splice)
        metrics_.add("qkvshare_tokens_reused_total",
                     fmt::format("mode=\"{}\",source=\"{}\"", to_string(job.reused_as),
                                 job.automatic ? "auto" : job.base ? "handle" : "none"),
                     job.cached_tokens - spliced);
      // What the session does not hold yet (after a splice, more than the reused tokens).
      std::vector<TokenId> rest(job.prompt.begin() + session->n_past(), job.prompt.end());
      metrics_.add("qkvshare_tokens_prefilled_total", "", static_cast<double>(rest.size()));
      if (job.n == 1) {
        r.choices.resize(1);
        r.choices[0].session = std::move(session);
        submit_choice(r, 0, std::move(rest));
      } else if (rest.size() == 1) {
        r.prefix = std::move(session);
        fork_choices(r);
      } else {
        r.prefix = std::move(session);
        Request q;
        q.session = r.prefix.get();
        q.prompt.assign(rest.begin(), rest.end() - 1);  // the last token is fed by each choice
        q.options.max_new_tokens = 0;
        r.prefill_id = steps_.submit(std::move(q));
        r.prefill_live = true;
      }
    } catch (...) {
      r.error = std::current_exception();
    }
  }

  // Splices run here, on the worker thread before the job joins the batch:
  // a splice needs the KV of everything before it in place, so the text
  // before each span is prefilled inline. The span's tokens come from the
  // source context's blocks at their new position, a share recomputed under
  // the guard (engine/splice.hpp).
  void splice_span(Job& job, Session& session, std::uint64_t from, int prompt_begin, int context_begin, int tokens) {
    const int whole = static_cast<int>(store_.tokens(from).size());
    std::unique_ptr<Session> src = store_.open_prefix(from, job.tenant, whole, o_.capacity);
    if (!src || src->n_past() != whole) return;  // gone or cut: the span is prefilled with the rest
    if (prompt_begin > session.n_past()) {
      const std::span<const TokenId> gap(job.prompt.data() + session.n_past(),
                                         static_cast<std::size_t>(prompt_begin - session.n_past()));
      engine_.forward(session, gap);
      metrics_.add("qkvshare_tokens_prefilled_total", "", static_cast<double>(gap.size()));
    }
    Job::Splice sp{prompt_begin, context_begin, ContextStore::name_of(from), {}};
    sp.result = splice_tokens(engine_, session, dynamic_cast<const PooledKvCache&>(src->cache()), src->tokens(),
                              context_begin, context_begin + tokens, job.splice_options);
    job.cached_tokens += sp.result.reused;
    metrics_.add("qkvshare_tokens_prefilled_total", "", sp.result.recomputed + sp.result.probe_tokens);
    metrics_.add("qkvshare_tokens_reused_total",
                 fmt::format("mode=\"splice\",source=\"{}\"", job.base ? "handle" : "auto"), sp.result.reused);
    job.splices.push_back(std::move(sp));
  }

  // Automatic reuse after the prefix: runs of the tenant's other contexts
  // inside the rest of the prompt (other agents' replies quoted in it).
  void auto_splices(Job& job, Session& session) {
    const auto* cache = dynamic_cast<const PooledKvCache*>(&session.cache());
    if (cache == nullptr) return;
    const int end = static_cast<int>(job.prompt.size()) - 1;  // the last token is fed, for its logits
    for (const ReuseIndex::Span& s :
         store_.find_spans(job.tenant, job.format, job.prompt, session.n_past(), end, kMinAutoSplice)) {
      // A splice adds a segment or two; a sealed record holds kMaxContextSegments.
      if (cache->segments().size() + 4 > kMaxContextSegments) break;
      if (s.prompt_begin < session.n_past()) continue;
      splice_span(job, session, s.context_id, s.prompt_begin, s.context_begin, s.tokens);
    }
  }

  std::unique_ptr<Session> open_reuse(Job& job) {
    job.cached_tokens = 0;
    job.reused_as = ReuseMode::none;
    job.automatic = false;
    job.reused_from.clear();
    job.splices.clear();
    if (job.base && job.mode == ReuseMode::splice) {
      job.reused_as = ReuseMode::splice;
      job.reused_from = ContextStore::name_of(*job.base);
      auto session = new_pooled_session(store_.pool(), engine_, job.format, o_.capacity);
      if (job.splice.tokens > 0)
        splice_span(job, *session, *job.base, job.splice.prompt_begin, job.splice.src_begin, job.splice.tokens);
      return session;
    }
    std::unique_ptr<Session> session = open_prefix(job);
    if (job.auto_reuse && !job.base) auto_splices(job, *session);
    return session;
  }

  std::unique_ptr<Session> open_prefix(Job& job) {
    const int limit = static_cast<int>(job.prompt.size()) - 1;  // at least one token is fed, for its logits
    std::optional<std::uint64_t> from = job.base;
    int want = 0;
    if (job.base) {
      want = std::min(static_cast<int>(store_.tokens(*job.base).size()), limit);
    } else if (job.auto_reuse) {
      const ReuseIndex::Match m = store_.lookup(job.tenant, job.format, job.prompt);
      if (m.tokens > 0) {
        from = m.context_id;
        want = std::min(m.tokens, limit);
        job.automatic = true;
      }
    }
    std::unique_ptr<Session> session;
    if (from && want > 0) {
      try {
        session = store_.open_prefix(*from, job.tenant, want, o_.capacity);
      } catch (const ApiError&) {
        if (job.base) throw;  // the named context went away: the client must hear it
      }
    }
    if (!session) {
      job.automatic = false;
      return new_pooled_session(store_.pool(), engine_, job.format, o_.capacity);
    }
    job.cached_tokens = session->n_past();
    job.reused_from = ContextStore::name_of(*from);
    const bool whole = job.cached_tokens == static_cast<int>(store_.tokens(*from).size());
    job.reused_as = job.base ? job.mode : (whole ? ReuseMode::continue_ : ReuseMode::fork);
    return session;
  }

  void fork_choices(Running& r) {
    Job& job = *r.job;
    r.choices.resize(static_cast<std::size_t>(job.n));
    for (int i = 0; i < job.n; ++i) {
      auto& cache = dynamic_cast<PooledKvCache&>(r.prefix->cache());
      r.choices[static_cast<std::size_t>(i)].session = std::make_unique<Session>(cache.fork(), r.prefix->tokens());
    }
    r.prefix.reset();  // the forks hold the blocks
    for (int i = 0; i < job.n; ++i) submit_choice(r, i, {job.prompt.back()});
  }

  void submit_choice(Running& r, int i, std::vector<TokenId> prompt) {
    Job& job = *r.job;
    Choice& c = r.choices[static_cast<std::size_t>(i)];
    Request q;
    q.session = c.session.get();
    q.prompt = std::move(prompt);
    q.options.max_new_tokens = job.max_tokens;
    q.options.sampling = job.sampling;
    q.options.sampling.seed = job.sampling.seed + static_cast<std::uint64_t>(i);
    q.options.stop_strings = job.stop;
    q.options.stop_at_end_of_generation = !job.ignore_eos;
    q.on_text = [this, &r, i](std::string_view text) {
      r.emitted = true;
      emit(*r.job, i, std::string(text));
    };
    q.on_token = [this, &r, i](TokenId) {
      Choice& ch = r.choices[static_cast<std::size_t>(i)];
      if (!r.first_token) {
        r.first_token = true;
        r.job->ttft_seconds = seconds_since(r.job->submitted);
        metrics_.observe("qkvshare_ttft_seconds", r.job->ttft_seconds);
        std::lock_guard lock(r.job->mu);
        r.job->started = true;
        r.job->cv.notify_all();
      } else {
        metrics_.observe("qkvshare_token_latency_seconds", seconds_since(ch.last));
      }
      ch.last = Clock::now();
      metrics_.add("qkvshare_tokens_decoded_total", "");
    };
    c.id = steps_.submit(std::move(q));
    c.live = true;
    ids_[c.id] = {&r, i};
  }

  void cancel(Running& r, std::exception_ptr why) {
    r.cancel_sent = true;
    if (!r.error) r.error = std::move(why);
    if (r.prefill_live) steps_.cancel(r.prefill_id);
    for (const Choice& c : r.choices)
      if (c.live) steps_.cancel(c.id);
  }

  void emit(Job& job, int index, std::string delta, std::optional<std::string> finish = std::nullopt) {
    if (delta.empty() && !finish) return;
    std::lock_guard lock(job.mu);
    job.events.push_back({index, std::move(delta), std::move(finish)});
    job.cv.notify_all();
  }

  // The error a failed engine request gives the client; a full pool is
  // first answered by evicting cached contexts and starting the job again.
  void failed(Running& r, const Error& e) {
    if (e.code() == ErrorCode::out_of_memory && !r.emitted && !r.error && r.retries < 8) {
      int evicted = 0;
      while (evicted < 4 && store_.evict_one()) ++evicted;
      if (evicted > 0) {
        metrics_.add("qkvshare_contexts_evicted_total", "", evicted);
        pending_restart_ = true;
        return;
      }
    }
    if (e.code() == ErrorCode::out_of_memory) {
      metrics_.add("qkvshare_pool_exhausted_total", "");
      cancel(r, std::make_exception_ptr(ApiError(
                    503, "pool_exhausted", "", fmt::format("the KV pool is exhausted and no cached context is left to evict: {}", e.what()))));
    } else {
      cancel(r, std::make_exception_ptr(e));
    }
  }

  void finished(RequestResult& res) {
    if (res.id == 0) return;
    Running* rp = nullptr;
    int index = -1;
    if (const auto it = ids_.find(res.id); it != ids_.end()) {
      rp = it->second.first;
      index = it->second.second;
      ids_.erase(it);
    } else {
      for (Running& r : running_)
        if (r.prefill_live && r.prefill_id == res.id) rp = &r;
      if (rp == nullptr) return;
      rp->prefill_live = false;
    }
    Running& r = *rp;
    if (index >= 0) r.choices[static_cast<std::size_t>(index)].live = false;
    pending_restart_ = false;
    if (res.error) failed(r, *res.error);
    if (pending_restart_) {
      if (r.live()) {  // other choices still run: stop them, the job then fails rather than restarting half
        cancel(r, std::make_exception_ptr(ApiError(503, "pool_exhausted", "", "the KV pool is exhausted")));
        return;
      }
      ++r.retries;
      r.choices.clear();
      r.prefix.reset();
      begin(r);
      return;
    }
    if (r.error) return;
    if (res.generation.stop_reason == StopReason::cancelled) return;
    if (index < 0) return fork_choices(r);
    Choice& choice = r.choices[static_cast<std::size_t>(index)];
    choice.pending = pending_token(res.generation);
    ChoiceResult& out = choice.result;
    out.text = res.generation.text;
    out.finish_reason = finish_reason(res.generation.stop_reason);
    out.completion_tokens = static_cast<int>(res.generation.tokens.size());
    if (!r.first_token) {  // ended before any token (end of generation at once)
      r.first_token = true;
      r.job->ttft_seconds = seconds_since(r.job->submitted);
      metrics_.observe("qkvshare_ttft_seconds", r.job->ttft_seconds);
    }
    emit(*r.job, index, "", out.finish_reason);
    if (!r.live()) complete(r);
  }

  void complete(Running& r) {
    Job& job = *r.job;
    try {
      for (Choice& c : r.choices) c.result.context = store_.add(job.tenant, *c.session, job.grant_to, true, c.pending);
    } catch (...) {
      r.error = std::current_exception();
      return;
    }
    // `continue` moves on from the named context: the new one replaces it.
    if (job.base && job.mode == ReuseMode::continue_) {
      try {
        store_.release(job.tenant, *job.base);
      } catch (const ApiError&) {
        // evicted or released meanwhile: nothing left to drop
      }
    }
    std::lock_guard lock(job.mu);
    for (Choice& c : r.choices) job.choices.push_back(std::move(c.result));
    r.choices.clear();
    job.started = job.done = true;
    job.cv.notify_all();
  }

  Engine& engine_;
  ContextStore& store_;
  Metrics& metrics_;
  SchedulerOptions o_;
  qkvshare::Scheduler steps_;
  std::list<Running> running_;  // worker thread only; stable addresses for the callbacks
  std::map<RequestId, std::pair<Running*, int>> ids_;
  bool pending_restart_ = false;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false, cancel_all_ = false;
  int active_ = 0;
  std::thread worker_;
};

}  // namespace

std::unique_ptr<Scheduler> make_batched_scheduler(Engine& engine, ContextStore& store, Metrics& metrics,
                                                  SchedulerOptions options) {
  return std::make_unique<BatchedScheduler>(engine, store, metrics, options);
}

}  // namespace qkvshare::server
