#include "qkvshare/engine/scheduler.hpp"

#include <algorithm>

#include "stop_filter.hpp"

namespace qkvshare {

struct Scheduler::Active {
  Active(RequestId id_, Request r)
      : id(id_), req(std::move(r)), sampler(req.options.sampling), filter(req.options.stop_strings, req.on_text) {}
  RequestId id;
  Request req;
  Sampler sampler;
  detail::StopStringFilter filter;
  RequestResult result;
  std::size_t fed = 0;        // prompt tokens fed so far
  TokenId next = -1;          // decoding: the sampled token to feed
  TokenId prev = -1;          // the token before `next`, for its text piece
  bool decoding = false;
  std::uint64_t last_served = 0;  // step number of its last pass (fairness)
  Clock::time_point submitted = Clock::now();
  Clock::time_point prompt_done;
  // This step's entry.
  std::size_t chunk = 0;
};

namespace {
double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
}  // namespace

Scheduler::Scheduler(Engine& engine, SchedulerOptions options) : engine_(engine), options_(options) {
  if (options_.token_budget <= 0)
    fail(ErrorCode::invalid_argument, "scheduler: token budget must be positive, got {}", options_.token_budget);
  if (options_.max_sessions < 0)
    fail(ErrorCode::invalid_argument, "scheduler: max sessions must be >= 0, got {}", options_.max_sessions);
  options_.token_budget = std::min(options_.token_budget, engine.options().max_batch);
}

Scheduler::~Scheduler() = default;

RequestId Scheduler::submit(Request request) {
  if (request.session == nullptr) fail(ErrorCode::invalid_argument, "submit: no session");
  if (request.prompt.empty()) fail(ErrorCode::invalid_argument, "submit: the prompt has no tokens");
  if (request.options.max_new_tokens < 0)
    fail(ErrorCode::invalid_argument, "max new tokens must be >= 0, got {}", request.options.max_new_tokens);
  request.options.sampling.validate();
  const ModelConfig& c = engine_.model().config();
  if (!request.options.forced.empty()) {
    for (TokenId t : request.options.forced)
      if (t < 0 || t >= c.vocab_size)
        fail(ErrorCode::invalid_argument, "submit: forced token id {} is outside the vocabulary [0, {})", t,
             c.vocab_size);
    request.options.max_new_tokens = static_cast<int>(request.options.forced.size());
    request.options.stop_strings.clear();
  }
  for (TokenId t : request.prompt)
    if (t < 0 || t >= c.vocab_size)
      fail(ErrorCode::invalid_argument, "submit: token id {} is outside the vocabulary [0, {})", t, c.vocab_size);
  const Session& s = *request.session;
  const std::size_t limit = static_cast<std::size_t>(std::min(c.context_length, s.cache().capacity()));
  if (static_cast<std::size_t>(s.n_past()) + request.prompt.size() > limit)
    fail(ErrorCode::context_full, "context length exceeded: {} tokens already + {} new > limit of {}", s.n_past(),
         request.prompt.size(), limit);
  std::lock_guard lock(mutex_);
  if (!sessions_.insert(request.session).second)
    fail(ErrorCode::invalid_argument, "submit: the session already belongs to an unfinished request");
  const RequestId id = next_id_++;
  live_.insert(id);
  incoming_.emplace_back(id, std::move(request));
  ++unfinished_;
  return id;
}

bool Scheduler::cancel(RequestId id) {
  std::lock_guard lock(mutex_);
  if (!live_.count(id)) return false;
  cancelled_.insert(id);
  return true;
}

std::vector<RequestResult> Scheduler::take_finished() {
  std::vector<RequestResult> out;
  out.swap(finished_);
  return out;
}

void Scheduler::admit() {
  std::set<RequestId> cancelled;
  {
    std::lock_guard lock(mutex_);
    active_.splice(active_.end(), incoming_);
    cancelled.swap(cancelled_);
  }
  for (auto it = active_.begin(); it != active_.end();) {
    auto next = std::next(it);
    if (cancelled.count(it->id)) finish(*it, StopReason::cancelled, std::nullopt);
    it = next;
  }
}

void Scheduler::finish(Active& a, StopReason reason, std::optional<Error> error) {
  const auto now = Clock::now();
  GenerateResult& g = a.result.generation;
  g.stop_reason = reason;
  if (reason != StopReason::stop_string && reason != StopReason::error) {
    try {
      a.filter.flush(g.text);
    } catch (const Error& e) {
      error = e;
      g.stop_reason = StopReason::error;
    }
  }
  if (a.decoding || a.fed == a.req.prompt.size()) {
    g.prefill_seconds = seconds_between(a.submitted, a.prompt_done);
    g.decode_seconds = seconds_between(a.prompt_done, now);
  } else {
    g.prefill_seconds = seconds_between(a.submitted, now);
  }
  a.result.id = a.id;
  a.result.error = std::move(error);
  a.result.seconds = seconds_between(a.submitted, now);
  finished_.push_back(std::move(a.result));
  {
    std::lock_guard lock(mutex_);
    sessions_.erase(a.req.session);
    live_.erase(a.id);
  }
  --unfinished_;
  const RequestResult& r = finished_.back();
  const auto it = std::find_if(active_.begin(), active_.end(), [&](const Active& x) { return &x == &a; });
  active_.erase(it);  // a is gone from here on
  if (on_finished) on_finished(r);
}

// After the logits of the request's last fed token: generate()'s loop body.
void Scheduler::sample(Active& a, std::span<const float> logits) {
  const GenerateOptions& o = a.req.options;
  GenerateResult& g = a.result.generation;
  Session& session = *a.req.session;
  const Tokenizer& tok = engine_.model().tokenizer();
  if (!a.decoding) {
    a.prompt_done = Clock::now();
    a.decoding = true;
    a.prev = session.tokens().back();
    if (o.max_new_tokens == 0) return finish(a, StopReason::max_tokens, std::nullopt);
  }
  if (o.on_logits) o.on_logits(logits);
  const bool forcing = !o.forced.empty();
  const TokenId next = forcing ? o.forced[g.tokens.size()] : a.sampler.sample(logits, session.tokens());
  if (g.tokens.empty()) a.result.ttft_seconds = seconds_between(a.submitted, Clock::now());
  if (!forcing && o.stop_at_end_of_generation && tok.is_end_of_generation(next))
    return finish(a, StopReason::end_of_generation, std::nullopt);
  g.tokens.push_back(next);
  try {
    if (a.req.on_token) a.req.on_token(next);
    if (a.filter.push(tok.token_to_piece(a.prev, next), g.text)) return finish(a, StopReason::stop_string, std::nullopt);
  } catch (const Error& e) {
    return finish(a, StopReason::error, e);
  } catch (const std::exception& e) {
    return finish(a, StopReason::error, Error(ErrorCode::internal, fmt::format("a stream callback threw: {}", e.what())));
  }
  a.prev = next;
  if (static_cast<int>(g.tokens.size()) == o.max_new_tokens) return finish(a, StopReason::max_tokens, std::nullopt);
  const int limit = std::min(engine_.model().config().context_length, session.cache().capacity());
  if (session.n_past() >= limit) return finish(a, StopReason::context_full, std::nullopt);
  a.next = next;
}

bool Scheduler::step() {
  admit();
  if (active_.empty()) return false;
  const int budget = options_.token_budget;
  const auto max_sessions =
      options_.max_sessions > 0 ? static_cast<std::size_t>(options_.max_sessions) : active_.size();
  std::vector<Active*> decoders, prompts;
  for (Active& a : active_) (a.decoding ? decoders : prompts).push_back(&a);
  std::stable_sort(decoders.begin(), decoders.end(), [](const Active* x, const Active* y) {
    if (x->req.priority != y->req.priority) return x->req.priority > y->req.priority;
    return x->last_served < y->last_served;
  });
  std::stable_sort(prompts.begin(), prompts.end(),
                   [](const Active* x, const Active* y) { return x->req.priority > y->req.priority; });
  // While a prompt waits, decoders leave it a quarter of the budget and one
  // session slot, so prompts are never starved by a full house of decoders.
  const int reserve = prompts.empty() || budget == 1 ? 0 : std::max(1, budget / 4);
  const std::size_t decoder_slots = prompts.empty() || max_sessions <= 1 ? max_sessions : max_sessions - 1;
  std::vector<Active*> chosen;
  int used = 0;
  const auto take_prompt = [&](Active* a) {
    a->chunk = std::min(a->req.prompt.size() - a->fed, static_cast<std::size_t>(budget - used));
    used += static_cast<int>(a->chunk);
    chosen.push_back(a);
  };
  if (max_sessions == 1) {
    // One session per pass: plain round robin by priority, then least recently served.
    std::vector<Active*> all;
    for (Active& a : active_) all.push_back(&a);
    Active* b = *std::min_element(all.begin(), all.end(), [](const Active* x, const Active* y) {
      if (x->req.priority != y->req.priority) return x->req.priority > y->req.priority;
      return x->last_served < y->last_served;
    });
    if (b->decoding) {
      b->chunk = 1;
      chosen.push_back(b);
    } else {
      take_prompt(b);
    }
  } else {
    for (Active* a : decoders) {
      if (used >= budget - reserve || chosen.size() >= decoder_slots) break;
      a->chunk = 1;
      ++used;
      chosen.push_back(a);
    }
    for (Active* a : prompts) {
      if (used >= budget || chosen.size() >= max_sessions) break;
      take_prompt(a);
    }
  }
  std::vector<BatchEntry> entries;
  entries.reserve(chosen.size());
  for (Active* a : chosen) {
    BatchEntry e;
    e.session = a->req.session;
    if (a->decoding) {
      e.tokens = std::span<const TokenId>(&a->next, 1);
    } else {
      e.tokens = std::span<const TokenId>(a->req.prompt).subspan(a->fed, a->chunk);
      e.logits = a->fed + a->chunk == a->req.prompt.size() ? LogitsWanted::last : LogitsWanted::none;
    }
    entries.push_back(e);
  }
  ++steps_;
  const std::span<const BatchOutcome> out = engine_.forward_batch(entries);
  for (std::size_t i = 0; i < chosen.size(); ++i) {
    Active& a = *chosen[i];
    a.last_served = steps_;
    ++a.result.steps;
    if (out[i].error) {
      finish(a, StopReason::error, out[i].error);
      continue;
    }
    if (a.decoding) {
      ++a.result.generation.decode_tokens;
    } else {
      a.fed += a.chunk;
      a.result.generation.prefill_tokens += static_cast<int>(a.chunk);
      if (a.fed < a.req.prompt.size()) continue;
    }
    sample(a, out[i].logits);
  }
  return true;
}

void Scheduler::run_until_idle() {
  while (step()) {
  }
}

}  // namespace qkvshare
