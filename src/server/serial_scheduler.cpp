// SerialScheduler (scheduler.hpp): one worker thread, round-robin steps over
// the active jobs through Engine::forward.
#include <algorithm>
#include <thread>

#include "qkvshare/server/metrics.hpp"
#include "qkvshare/server/scheduler.hpp"
#include "qkvshare/share/handoff.hpp"

namespace qkvshare::server {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Holds back the tail of the text that could still grow into a stop string
// (the same rule as generate(): text is released once no stop can start in it).
class StopFilter {
 public:
  explicit StopFilter(const std::vector<std::string>& stops) : stops_(&stops) {}
  // Appends `piece`; returns the text that is safe to emit; sets `hit` when a stop string appeared.
  std::string push(std::string_view piece, bool& hit) {
    pending_ += piece;
    std::size_t cut = std::string::npos;
    for (const auto& s : *stops_) cut = std::min(cut, pending_.find(s));
    if (cut != std::string::npos) {
      hit = true;
      std::string out = pending_.substr(0, cut);
      pending_.clear();
      return out;
    }
    std::size_t hold = 0;
    for (const auto& s : *stops_)
      for (std::size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k)
        if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
    std::string out = pending_.substr(0, pending_.size() - hold);
    pending_.erase(0, pending_.size() - hold);
    return out;
  }
  std::string flush() { return std::exchange(pending_, {}); }

 private:
  const std::vector<std::string>* stops_;
  std::string pending_;
};

struct Choice {
  std::unique_ptr<Session> session;
  Sampler sampler;
  StopFilter filter;
  std::vector<float> logits;
  TokenId prev = -1;
  int produced = 0;
  bool finished = false;
  Clock::time_point last = Clock::now();
  ChoiceResult result;
};

struct Running {
  std::shared_ptr<Job> job;
  std::unique_ptr<Session> session;  // during prefill
  std::size_t fed = 0;
  bool set_up = false;
  std::vector<Choice> choices;
};

class SerialScheduler final : public Scheduler {
 public:
  SerialScheduler(Engine& engine, ContextStore& store, Metrics& metrics, SchedulerOptions o)
      : engine_(engine), store_(store), metrics_(metrics), o_(o) {
    if (o_.capacity <= 0) o_.capacity = engine.model().config().context_length;
    worker_ = std::thread([this] { loop(); });
  }
  ~SerialScheduler() override { shutdown(true); }

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
        for (auto& j : queue_) fail_job(*j, std::make_exception_ptr(ApiError(503, "server_shutting_down", "", "the server is shutting down")));
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
  static void fail_job(Job& job, std::exception_ptr e) {
    std::lock_guard lock(job.mu);
    job.error = std::move(e);
    job.started = job.done = true;
    job.cv.notify_all();
  }

  void loop() {
    std::vector<Running> running;
    for (;;) {
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !running.empty() || !queue_.empty(); });
        if (stopping_ && (running.empty() || cancel_all_)) {
          for (Running& r : running) fail_job(*r.job, std::make_exception_ptr(ApiError(503, "server_shutting_down", "", "the server shut down during the request")));
          active_ = 0;
          return;
        }
        while (!queue_.empty() && static_cast<int>(running.size()) < o_.parallel) {
          running.push_back(Running{std::move(queue_.front()), nullptr, 0, false, {}});
          queue_.pop_front();
        }
        active_ = static_cast<int>(running.size());
      }
      metrics_.set("qkvshare_queue_depth", "", queue_depth());
      metrics_.set("qkvshare_sessions_active", "", static_cast<double>(running.size()));
      for (Running& r : running) {
        try {
          if (r.job->cancelled) throw ApiError(499, "cancelled", "", "the client closed the connection");
          step(r);
        } catch (...) {
          if (r.job->cancelled) metrics_.add("qkvshare_requests_cancelled_total", "");
          r.session.reset();
          r.choices.clear();  // gives the blocks back before the client hears of it
          fail_job(*r.job, std::current_exception());
        }
      }
      std::erase_if(running, [](const Running& r) {
        std::lock_guard lock(r.job->mu);
        return r.job->done;
      });
      {
        std::lock_guard lock(mu_);
        active_ = static_cast<int>(running.size());
      }
      // Keep the cache within its budget once the pass's blocks are settled.
      if (const int n = store_.evict_over_budget(); n > 0) metrics_.add("qkvshare_contexts_evicted_total", "", n);
    }
  }

  // Engine::forward, evicting cached contexts while the pool is exhausted.
  std::vector<float> forward(Session& s, std::span<const TokenId> tokens) {
    for (;;) {
      try {
        const std::span<const float> l = engine_.forward(s, tokens);
        return {l.begin(), l.end()};
      } catch (const Error& e) {
        if (e.code() != ErrorCode::out_of_memory) throw;
        if (store_.evict_one()) {
          metrics_.add("qkvshare_contexts_evicted_total", "");
          continue;
        }
        metrics_.add("qkvshare_pool_exhausted_total", "");
        throw ApiError(503, "pool_exhausted", "", fmt::format("the KV pool is exhausted and no cached context is left to evict: {}", e.what()));
      }
    }
  }

  void set_up(Running& r) {
    Job& job = *r.job;
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
    if (from && want > 0) {
      try {
        r.session = store_.open_prefix(*from, job.tenant, want, o_.capacity);
      } catch (const ApiError&) {
        if (job.base) throw;  // the named context went away: the client must hear it
        r.session.reset();    // an indexed one was evicted meanwhile: compute instead
      }
    }
    if (r.session) {
      job.cached_tokens = r.session->n_past();
      job.reused_from = ContextStore::name_of(*from);
      const bool whole = job.cached_tokens == static_cast<int>(store_.tokens(*from).size());
      job.reused_as = job.base ? job.mode : (whole ? ReuseMode::continue_ : ReuseMode::fork);
    } else {
      r.session = new_pooled_session(store_.pool(), engine_, job.format, o_.capacity);
    }
    job.prompt_tokens = static_cast<int>(job.prompt.size());
    r.fed = static_cast<std::size_t>(job.cached_tokens);
    r.set_up = true;
    metrics_.add("qkvshare_tokens_reused_total", fmt::format("mode=\"{}\",source=\"{}\"", to_string(job.reused_as),
                                                             job.automatic ? "auto" : job.base ? "handle" : "none"),
                 job.cached_tokens);
    metrics_.add("qkvshare_prompt_tokens_total", "", job.prompt_tokens);
  }

  void step(Running& r) {
    Job& job = *r.job;
    if (!r.set_up) set_up(r);
    if (r.choices.empty()) {
      const std::size_t n = std::min(job.prompt.size() - r.fed, static_cast<std::size_t>(o_.prefill_chunk));
      std::vector<float> logits = forward(*r.session, std::span<const TokenId>(job.prompt).subspan(r.fed, n));
      r.fed += n;
      metrics_.add("qkvshare_tokens_prefilled_total", "", static_cast<double>(n));
      if (r.fed < job.prompt.size()) return;
      start_choices(r, std::move(logits));
    }
    for (Choice& c : r.choices)
      if (!c.finished) decode(r, c);
    if (std::all_of(r.choices.begin(), r.choices.end(), [](const Choice& c) { return c.finished; })) finish(r);
  }

  void start_choices(Running& r, std::vector<float> logits) {
    Job& job = *r.job;
    const std::uint64_t seed = job.sampling.seed;
    for (int i = 0; i < job.n; ++i) {
      SamplingParams p = job.sampling;
      p.seed = seed + static_cast<std::uint64_t>(i);
      std::unique_ptr<Session> s;
      if (i + 1 == job.n) {
        s = std::move(r.session);
      } else {
        auto& cache = dynamic_cast<PooledKvCache&>(r.session->cache());
        s = std::make_unique<Session>(cache.fork(), r.session->tokens());
      }
      Choice c{std::move(s), Sampler(p), StopFilter(job.stop), logits, job.prompt.back(), 0, false, Clock::now(), {}};
      r.choices.push_back(std::move(c));
    }
    job.ttft_seconds = since(job.submitted);
    metrics_.observe("qkvshare_ttft_seconds", job.ttft_seconds);
    std::lock_guard lock(job.mu);
    job.started = true;
    job.cv.notify_all();
  }

  void emit(Job& job, int index, std::string delta, std::optional<std::string> finish = std::nullopt) {
    if (delta.empty() && !finish) return;
    std::lock_guard lock(job.mu);
    job.events.push_back({index, std::move(delta), std::move(finish)});
    job.cv.notify_all();
  }

  void decode(Running& r, Choice& c) {
    Job& job = *r.job;
    const int index = static_cast<int>(&c - r.choices.data());
    const Tokenizer& tok = engine_.model().tokenizer();
    const TokenId next = c.sampler.sample(c.logits, c.session->tokens());
    const auto end = [&](const char* reason, std::string tail) {
      c.finished = true;
      c.result.finish_reason = reason;
      c.result.text += tail;
      emit(job, index, std::move(tail), std::string(reason));
    };
    if (tok.is_end_of_generation(next)) return end("stop", c.filter.flush());
    ++c.produced;
    ++c.result.completion_tokens;
    metrics_.add("qkvshare_tokens_decoded_total", "");
    metrics_.observe("qkvshare_token_latency_seconds", since(c.last));
    c.last = Clock::now();
    bool hit = false;
    std::string text = c.filter.push(tok.token_to_piece(c.prev, next), hit);
    c.prev = next;
    if (hit) return end("stop", std::move(text));
    c.result.text += text;
    emit(job, index, std::move(text));
    if (c.produced >= job.max_tokens || c.session->n_past() >= o_.capacity) return end("length", c.filter.flush());
    c.logits = forward(*c.session, std::span<const TokenId>(&next, 1));
  }

  void finish(Running& r) {
    Job& job = *r.job;
    for (Choice& c : r.choices)
      c.result.context = store_.add(job.tenant, *c.session, job.format, job.grant_to, true);
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
    job.done = true;
    job.cv.notify_all();
  }

  Engine& engine_;
  ContextStore& store_;
  Metrics& metrics_;
  SchedulerOptions o_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false, cancel_all_ = false;
  int active_ = 0;
  std::thread worker_;
};

}  // namespace

std::unique_ptr<Scheduler> make_serial_scheduler(Engine& engine, ContextStore& store, Metrics& metrics,
                                                 SchedulerOptions options) {
  return std::make_unique<SerialScheduler>(engine, store, metrics, options);
}

}  // namespace qkvshare::server
