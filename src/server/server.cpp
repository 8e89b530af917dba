// The HTTP front of `qkvshare serve`: routes, authentication, request to Job,
// responses (JSON and SSE), metrics and logs. See docs/server.md.
#include "qkvshare/server/server.hpp"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include "qkvshare/server/context_store.hpp"
#include "qkvshare/server/http_front.hpp"
#include "qkvshare/server/metrics.hpp"
#include "qkvshare/server/scheduler.hpp"
#include "qkvshare/share/handoff.hpp"

namespace qkvshare::server {

using nlohmann::json;

namespace {

// Splices shorter than this are prefilled as text: the guard's probe alone costs 8 tokens.
constexpr int kMinSpliceTokens = 16;
// HTTP connections served at once (each on its own thread, started as needed):
// below select()'s FD_SETSIZE, which cpp-httplib 0.11 polls sockets with.
constexpr int kMaxHttpThreads = 1000;
// Seconds a client may send nothing in the middle of a request. Real clients
// send a request at once; a short wait frees the threads of those that do not.
constexpr int kReadTimeoutSeconds = 10;

// The longest run of tokens that a and b share (a classic dynamic program,
// O(|a| |b|) steps over two rows: 64M for two 8k-token prompts, tens of ms).
struct SharedRun {
  int a_begin = 0, b_begin = 0, tokens = 0;
};
SharedRun longest_shared_run(std::span<const TokenId> a, std::span<const TokenId> b) {
  SharedRun best;
  std::vector<int> prev(b.size() + 1, 0), cur(b.size() + 1, 0);
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      cur[j] = a[i - 1] == b[j - 1] ? prev[j - 1] + 1 : 0;
      if (cur[j] > best.tokens)
        best = {static_cast<int>(i) - cur[j], static_cast<int>(j) - cur[j], cur[j]};
    }
    std::swap(prev, cur);
  }
  return best;
}

// A context the server seals is found again by its token prefix (automatic
// reuse, fork, continue); one whose tokens were dropped at seal is not that
// prefix any more.
void refuse_eviction(const KvFormat& f) {
  if (f.uses_pq())
    fail(ErrorCode::invalid_argument,
         "KV format {}: the server does not take pq formats yet (context files and its /v1/contexts export do not "
         "carry codebooks); use an integer format",
         f.to_string());
  if (f.evicts())
    fail(ErrorCode::invalid_argument,
         "KV format {} drops tokens when a context is sealed (budget); the server reuses contexts by their token "
         "prefix, so it keeps every token: drop budget=",
         f.to_string());
}

std::int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void send_error(httplib::Response& res, int status, std::string_view type, std::string_view param, std::string_view message) {
  res.status = status;
  res.set_content(error_body(status, type, param, message), "application/json");
}

void send_exception(httplib::Response& res, const std::exception& e) {
  const auto [status, body] = error_response(e);
  res.status = status;
  res.set_content(body, "application/json");
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void register_metrics(Metrics& m) {
  m.counter("qkvshare_requests_total", "HTTP requests by route and status");
  m.counter("qkvshare_prompt_tokens_total", "prompt tokens of completion requests");
  m.counter("qkvshare_tokens_prefilled_total", "prompt tokens computed by a forward pass");
  m.counter("qkvshare_tokens_reused_total", "prompt tokens taken from a sealed context's KV, by mode and source");
  m.counter("qkvshare_tokens_decoded_total", "tokens generated");
  m.counter("qkvshare_requests_cancelled_total", "completions ended because the client went away");
  m.counter("qkvshare_prefix_waits_total", "requests that waited for a running request to feed the prompt prefix they share");
  m.counter("qkvshare_prompt_checkpoints_total", "copies of a fed prompt's KV sealed for the requests that share its prefix");
  m.counter("qkvshare_contexts_evicted_total", "cached contexts evicted (LRU) for the budget or a full pool");
  m.counter("qkvshare_pool_exhausted_total", "requests refused with 503: the pool was full and nothing was evictable");
  m.counter("qkvshare_handoff_opens_total", "descriptor opens in the pool by path (kv or a text fallback and why)");
  m.gauge("qkvshare_reuse_ratio", "reused / prompt tokens since start, by reuse mode");
  m.gauge("qkvshare_queue_depth", "completion requests waiting for a slot");
  m.gauge("qkvshare_sessions_active", "completion requests being prefilled or decoded");
  m.gauge("qkvshare_pool_blocks", "KV pool blocks by state");
  m.gauge("qkvshare_pool_bytes", "KV pool page bytes by state");
  m.gauge("qkvshare_cached_contexts", "sealed contexts the server holds, by KV format");
  m.gauge("qkvshare_cached_blocks", "blocks referenced by the cached contexts, by KV format (shared blocks counted per context)");
  m.gauge("qkvshare_cached_bytes", "KV bytes of the cached contexts, by KV format (shared blocks counted per context)");
  m.gauge("qkvshare_cache_budget_bytes", "KV bytes the cached contexts may use before LRU eviction");
  m.counter("qkvshare_tier_spills_total", "cached contexts spilled to disk (--spill-dir) instead of dropped");
  m.counter("qkvshare_tier_restores_total", "spilled contexts restored from disk for a request");
  m.counter("qkvshare_tier_demotions_total", "cached contexts recoded to the --demote format");
  m.counter("qkvshare_tier_spilled_bytes_total", "bytes written to spill files");
  m.counter("qkvshare_tier_failures_total", "spills (the context was dropped) and restores (a file that did not verify) that failed");
  m.gauge("qkvshare_tier_disk_contexts", "cached contexts whose spill file exists");
  m.gauge("qkvshare_tier_disk_bytes", "bytes of the spill files that exist");
  m.histogram("qkvshare_ttft_seconds", "time from request to first token",
              {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30});
  m.histogram("qkvshare_token_latency_seconds", "time between consecutive tokens of one choice",
              {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1});
}

}  // namespace

struct Server::Impl {
  Engine& engine;
  ServerOptions o;
  Tenants tenants;
  KvFormat default_format;
  std::shared_ptr<SharePool> pool;
  Metrics metrics;
  std::unique_ptr<ContextStore> store;
  std::unique_ptr<Scheduler> scheduler;
  httplib::Server http;
  int port = 0;
  int capacity = 0;
  std::optional<ChatTemplate> tmpl;    // the model's own chat template (or --chat-template)
  std::vector<TokenId> turn_ends;      // the tokens that close a turn in it
  std::atomic<bool> draining{false};
  std::atomic<std::uint64_t> request_seq{0};
  std::mutex tokenizer_mu;  // the tokenizers keep per-call scratch; one encode at a time
  std::mutex stop_mu;
  bool stopped = false;
  bool created_pool = false;

  Impl(Engine& e, ServerOptions opts) : engine(e), o(std::move(opts)) {}

  // ---- helpers -------------------------------------------------------
  std::optional<std::string> tenant_of(const httplib::Request& req, httplib::Response& res) {
    auto t = tenants.authenticate(req.get_header_value("Authorization"));
    if (!t) {
      send_error(res, 401, "invalid_api_key", "", "missing or unknown API key (send 'Authorization: Bearer KEY')");
      res.set_header("WWW-Authenticate", "Bearer");
    }
    return t;
  }

  std::vector<TokenId> encode(const std::string& text, bool bos) {
    const Tokenizer& tok = engine.model().tokenizer();
    std::lock_guard lock(tokenizer_mu);
    std::vector<TokenId> ids;
    if (bos && tok.add_bos()) ids.push_back(tok.bos_id());
    const auto body = tok.encode(text, /*parse_special=*/true);
    ids.insert(ids.end(), body.begin(), body.end());
    return ids;
  }

  // The model's own chat template (tokenizer.chat_template, the model
  // layer's ChatTemplate, shared with the CLI): ChatML for SmolLM2, plain
  // lines for llama2.c models.
  std::string render(const std::vector<ChatMessage>& messages, bool generation_prompt) const {
    return tmpl->format(messages, generation_prompt);
  }
  bool ends_turn(TokenId t) const { return std::find(turn_ends.begin(), turn_ends.end(), t) != turn_ends.end(); }

  KvFormat parse_format(const std::string& text, const std::string& param) const {
    // The parser quotes the text in its messages, unescaped.
    if (std::any_of(text.begin(), text.end(), [](unsigned char c) { return c < 0x20 || c == 0x7f; }))
      bad_request(param, fmt::format("'{}': {} is not a KV format (it holds a control character)", param, quote_input(text)));
    try {
      KvFormat f = KvFormat::parse(text);
      f.validate(engine.kv_shape(), pool->kv_pool(engine.kv_shape())->block_tokens());
      refuse_eviction(f);
      return f;
    } catch (const Error& e) {
      bad_request(param, fmt::format("'{}': {}", param, e.what()));
    }
  }

  // Request -> Job: tokens, where the KV may come from, sampling.
  std::shared_ptr<Job> make_job(const std::string& tenant, const CompletionRequest& r) {
    if (!r.model.empty() && r.model != o.model_id && r.model != "qkvshare")
      throw ApiError(404, "model_not_found", "model",
                     fmt::format("model {} does not exist; this server serves '{}'", quote_input(r.model), o.model_id));
    auto job = std::make_shared<Job>();
    job->tenant = tenant;
    job->endpoint = r.endpoint == Endpoint::chat ? "chat" : "completion";
    const Extension& x = r.ext;
    const int vocab = engine.model().tokenizer().vocab_size();
    for (std::size_t i = 0; i < r.prompt_ids.size(); ++i)
      if (r.prompt_ids[i] >= vocab) {
        const std::string p = fmt::format("prompt[{}]", i);
        bad_request(p, fmt::format("'{}': token id {} is not below the vocabulary size {}", p, r.prompt_ids[i], vocab));
      }
    const auto fresh = [&] {
      if (r.endpoint == Endpoint::chat) return encode(render(r.messages, true), true);
      if (!r.prompt_ids.empty()) return r.prompt_ids;
      return encode(r.prompt, true);
    };
    std::vector<TokenId> full = fresh();
    job->format = x.kv ? parse_format(*x.kv, "qkvshare.kv") : default_format;
    if (!x.context.empty()) {
      const std::uint64_t id = store->resolve(tenant, x.context, "qkvshare.context");
      const std::vector<TokenId> base = store->tokens(id);
      const std::vector<TokenId> transcript = store->transcript(id);
      const KvFormat cf = store->format(id);
      if (x.kv && !(job->format == cf))
        bad_request("qkvshare.kv", fmt::format("'qkvshare.kv': the context is stored as {}; continue, fork and splice keep its format", cf.to_string()));
      job->format = cf;
      if (x.mode == ReuseMode::splice) {
        // The prompt is the client's own (its system prompt, its task); the
        // context's tokens are reused where they occur in it. The last token
        // is always fed, for its logits.
        const auto run = longest_shared_run(std::span<const TokenId>(full.data(), full.size() - 1), base);
        if (run.tokens >= kMinSpliceTokens) job->splice = {run.a_begin, run.b_begin, run.tokens};
        if (x.recompute) job->splice_options.recompute = *x.recompute;
      } else if (!(full.size() > base.size() && std::equal(base.begin(), base.end(), full.begin()))) {
        // Either the client resent the whole conversation (the context is a
        // prefix of it) or it sends only what follows the context. That
        // follows the transcript: a reply cut by length ends on a token with
        // no KV yet, fed now as the resent conversation would feed it.
        std::vector<TokenId> ids;
        if (r.endpoint == Endpoint::chat) {
          // A reply that generation left open is closed first, as the template would have it.
          const bool open = !turn_ends.empty() && !ends_turn(transcript.back());
          ids = encode((open ? tmpl->close_reply() : "") + render(r.messages, true), false);
        } else {
          ids = r.prompt_ids.empty() ? encode(r.prompt, false) : r.prompt_ids;
        }
        full = transcript;
        full.insert(full.end(), ids.begin(), ids.end());
      }
      job->base = id;
      job->mode = x.mode;
    }
    if (static_cast<int>(full.size()) >= capacity)
      throw ApiError(400, "context_length_exceeded", r.endpoint == Endpoint::chat ? "messages" : "prompt",
                     fmt::format("the prompt is {} tokens; the context holds {} (and the reply needs at least one)", full.size(), capacity));
    job->prompt = std::move(full);
    job->auto_reuse = o.auto_reuse && x.auto_reuse;
    job->grant_to = x.grant_to;
    job->n = r.n;
    job->max_tokens = r.max_tokens;
    job->stop = r.stop;
    job->ignore_eos = r.ignore_eos;
    job->sampling.temperature = r.temperature;
    job->sampling.top_p = r.top_p;
    job->sampling.top_k = 0;
    job->sampling.min_p = 0.0f;
    job->sampling.repeat_penalty = 1.0f;
    job->sampling.seed = r.seed ? *r.seed : std::random_device{}();
    return job;
  }

  json context_json(const SealedInfo& c) const {
    json j = {{"id", c.name}, {"handle", c.handle}, {"tokens", c.tokens}, {"format", c.format}};
    if (!c.grants.empty()) {
      json g = json::object();
      for (const auto& [agent, h] : c.grants) g[agent] = h;
      j["grants"] = g;
    }
    return j;
  }

  json extension_json(const Job& job) const {
    json j = {{"reused_tokens", job.cached_tokens},
              {"computed_tokens", job.prompt_tokens - job.cached_tokens},
              {"reuse", {{"mode", to_string(job.reused_as)},
                         {"from", job.reused_from.empty() ? json(nullptr) : json(job.reused_from)},
                         {"automatic", job.automatic}}},
              {"ttft_ms", job.ttft_seconds * 1e3}};
    if (!job.splices.empty()) {
      json all = json::array();
      for (const Job::Splice& s : job.splices) {
        const SpliceResult& r = s.result;
        all.push_back({{"from", s.from}, {"prompt_begin", s.prompt_begin}, {"context_begin", s.context_begin},
                       {"tokens", r.tokens}, {"reused", r.reused}, {"recomputed", r.recomputed},
                       {"probe_tokens", r.probe_tokens}, {"fraction", r.fraction},
                       {"guard_estimate", r.estimate < 0 ? json(nullptr) : json(r.estimate)},
                       {"escalated", r.escalated}, {"text", r.text}});
      }
      j["splices"] = all;
    }
    if (!job.choices.empty()) j["context"] = context_json(job.choices[0].context);
    if (job.choices.size() > 1) {
      json all = json::array();
      for (const ChoiceResult& c : job.choices) all.push_back(context_json(c.context));
      j["contexts"] = all;
    }
    return j;
  }

  json usage_json(const Job& job) const {
    int completion = 0;
    for (const ChoiceResult& c : job.choices) completion += c.completion_tokens;
    return {{"prompt_tokens", job.prompt_tokens},
            {"completion_tokens", completion},
            {"total_tokens", job.prompt_tokens + completion},
            {"prompt_tokens_details", {{"cached_tokens", job.cached_tokens}}}};
  }

  json response_json(const Job& job, const std::string& id, std::int64_t created) const {
    const bool chat = job.endpoint == "chat";
    json choices = json::array();
    for (std::size_t i = 0; i < job.choices.size(); ++i) {
      const ChoiceResult& c = job.choices[i];
      json ch = {{"index", i}, {"finish_reason", c.finish_reason}, {"logprobs", nullptr}};
      if (chat) ch["message"] = {{"role", "assistant"}, {"content", c.text}};
      else ch["text"] = c.text;
      choices.push_back(ch);
    }
    return {{"id", id},
            {"object", chat ? "chat.completion" : "text_completion"},
            {"created", created},
            {"model", o.model_id},
            {"choices", choices},
            {"usage", usage_json(job)},
            {"qkvshare", extension_json(job)}};
  }

  void log_job(const Job& job, int status, const std::string& error) const {
    if (!o.log_requests) return;
    int completion = 0;
    for (const ChoiceResult& c : job.choices) completion += c.completion_tokens;
    json j = {{"ts", unix_now()}, {"event", "completion"}, {"tenant", job.tenant}, {"endpoint", job.endpoint},
              {"status", status}, {"prompt_tokens", job.prompt_tokens}, {"cached_tokens", job.cached_tokens},
              {"reuse", to_string(job.reused_as)}, {"completion_tokens", completion}, {"n", job.n},
              {"ttft_ms", job.ttft_seconds * 1e3},
              {"total_ms", std::chrono::duration<double, std::milli>(Job::Clock::now() - job.submitted).count()}};
    if (!error.empty()) j["error"] = error;
    std::fprintf(stderr, "%s\n", dump(j).c_str());
  }

  void update_reuse_ratio() {
    const double prompt = metrics.value("qkvshare_prompt_tokens_total", "");
    if (prompt <= 0) return;
    for (const char* mode : {"continue", "fork"}) {
      const double r = metrics.value("qkvshare_tokens_reused_total", fmt::format("mode=\"{}\",source=\"auto\"", mode)) +
                       metrics.value("qkvshare_tokens_reused_total", fmt::format("mode=\"{}\",source=\"handle\"", mode));
      metrics.set("qkvshare_reuse_ratio", fmt::format("mode=\"{}\"", mode), r / prompt);
    }
  }

  // ---- completions -----------------------------------------------------
  void completion(Endpoint endpoint, const httplib::Request& req, httplib::Response& res) {
    const auto tenant = tenant_of(req, res);
    if (!tenant) return;
    if (draining) return send_error(res, 503, "server_shutting_down", "", "the server is shutting down");
    std::shared_ptr<Job> job;
    try {
      const CompletionRequest r = decode_request(endpoint, req.body, o.limits);
      job = make_job(*tenant, r);
      scheduler->submit(job);
      {
        std::unique_lock lock(job->mu);
        job->cv.wait(lock, [&] { return job->started; });
        if (job->error) std::rethrow_exception(job->error);
      }
      const std::string id = fmt::format("{}-{}", endpoint == Endpoint::chat ? "chatcmpl" : "cmpl", ++request_seq);
      const std::int64_t created = unix_now();
      if (!r.stream) {
        std::unique_lock lock(job->mu);
        job->cv.wait(lock, [&] { return job->done; });
        if (job->error) std::rethrow_exception(job->error);
        res.set_content(dump(response_json(*job, id, created)), "application/json");
        lock.unlock();
        update_reuse_ratio();
        log_job(*job, 200, "");
        return;
      }
      stream(res, job, id, created, r.include_usage);
    } catch (const std::exception& e) {
      send_exception(res, e);
      if (job) log_job(*job, res.status, e.what());
    }
  }

  std::string chunk(const Job& job, const std::string& id, std::int64_t created, json choices) const {
    return dump({{"id", id}, {"object", job.endpoint == "chat" ? "chat.completion.chunk" : "text_completion"},
                 {"created", created}, {"model", o.model_id}, {"choices", std::move(choices)}});
  }

  void stream(httplib::Response& res, std::shared_ptr<Job> job, std::string id, std::int64_t created, bool include_usage) {
    res.set_header("Cache-Control", "no-cache");
    auto first = std::make_shared<bool>(true);
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, job, id, created, include_usage, first](std::size_t, httplib::DataSink& sink) {
          const bool chat = job->endpoint == "chat";
          const auto send = [&](const std::string& data) {
            const std::string frame = "data: " + data + "\n\n";
            if (!sink.write(frame.data(), frame.size())) {
              job->cancelled = true;  // the client went away: the scheduler frees the session
              return false;
            }
            return true;
          };
          if (*first) {
            *first = false;
            if (chat) {
              json choices = json::array();
              for (int i = 0; i < job->n; ++i)
                choices.push_back({{"index", i}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"finish_reason", nullptr}});
              if (!send(chunk(*job, id, created, choices))) return false;
            }
          }
          std::unique_lock lock(job->mu);
          job->cv.wait(lock, [&] { return !job->events.empty() || job->done; });
          std::deque<JobEvent> events;
          events.swap(job->events);
          const bool done = job->done;
          const std::exception_ptr error = job->error;
          lock.unlock();
          for (const JobEvent& ev : events) {
            json c = {{"index", ev.index}, {"logprobs", nullptr}};
            if (chat) c["delta"] = ev.delta.empty() ? json::object() : json{{"content", ev.delta}};
            else c["text"] = ev.delta;
            c["finish_reason"] = ev.finish_reason ? json(*ev.finish_reason) : json(nullptr);
            if (!send(chunk(*job, id, created, json::array({c})))) return false;
          }
          if (!done) return true;
          if (error) {
            try {
              std::rethrow_exception(error);
            } catch (const std::exception& e) {
              send(error_response(e).second);
              log_job(*job, error_response(e).first, e.what());
            }
          } else {
            json last = json::parse(chunk(*job, id, created, json::array()));
            last["qkvshare"] = extension_json(*job);
            if (include_usage) last["usage"] = usage_json(*job);
            if (!send(dump(last))) return false;
            update_reuse_ratio();
            log_job(*job, 200, "");
          }
          send("[DONE]");
          sink.done();
          return true;
        },
        [job](bool success) {
          if (!success) job->cancelled = true;
        });
  }

  // cpp-httplib 0.11 holds a Content-Length to --max-body-kib but reads a
  // chunked body whole, however long: a POST route reads its body itself
  // and stops at the limit.
  void post(const std::string& pattern, std::function<void(const httplib::Request&, httplib::Response&)> handler) {
    http.Post(pattern, [this, handler = std::move(handler)](const httplib::Request& req, httplib::Response& res,
                                                            const httplib::ContentReader& read) {
      std::string body;
      bool over = false;
      const bool whole = read([&](const char* data, std::size_t n) {
        over = body.size() + n > o.max_body_bytes;
        if (!over) body.append(data, n);
        return !over;
      });
      if (!whole) {
        const int status = over ? 413 : (res.status >= 400 ? res.status : 400);
        send_error(res, status, over ? "request_too_large" : "invalid_request_error", "",
                   library_error_message(req, status, o.max_body_bytes));
        res.set_header("Connection", "close");  // the rest of the body is unread
        return;
      }
      // The library hands a const Request, but the one it owns is not.
      const_cast<httplib::Request&>(req).body = std::move(body);
      handler(req, res);
    });
  }

  // ---- contexts --------------------------------------------------------
  void contexts_routes() {
    http.Get("/v1/contexts", [this](const httplib::Request& req, httplib::Response& res) {
      const auto tenant = tenant_of(req, res);
      if (!tenant) return;
      res.set_content(dump(store->list(*tenant)), "application/json");
    });
    http.Get(R"(/v1/contexts/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
      const auto tenant = tenant_of(req, res);
      if (!tenant) return;
      try {
        const std::uint64_t id = store->resolve(*tenant, req.matches[1], "id");
        res.set_content(dump(store->describe(*tenant, id)), "application/json");
      } catch (const std::exception& e) {
        send_exception(res, e);
      }
    });
    http.Delete(R"(/v1/contexts/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
      const auto tenant = tenant_of(req, res);
      if (!tenant) return;
      try {
        const std::uint64_t id = store->resolve(*tenant, req.matches[1], "id");
        store->release(*tenant, id);
        res.set_content(dump({{"id", ContextStore::name_of(id)}, {"object", "qkvshare.context"}, {"deleted", true}}), "application/json");
      } catch (const std::exception& e) {
        send_exception(res, e);
      }
    });
    post(R"(/v1/contexts/([^/]+)/fork)", [this](const httplib::Request& req, httplib::Response& res) {
      const auto tenant = tenant_of(req, res);
      if (!tenant) return;
      try {
        const auto grants = decode_fork_request(req.body);
        const std::uint64_t id = store->resolve(*tenant, req.matches[1], "id");
        res.set_content(dump(context_json(store->fork(*tenant, id, grants))), "application/json");
      } catch (const std::exception& e) {
        send_exception(res, e);
      }
    });
  }

  void refresh_gauges() {
    const ShareStats s = pool->stats();
    metrics.set("qkvshare_pool_blocks", "state=\"used\"", s.kv.blocks_used);
    metrics.set("qkvshare_pool_blocks", "state=\"free\"", s.kv.blocks_free);
    metrics.set("qkvshare_pool_bytes", "state=\"used\"", static_cast<double>(s.kv.bytes_used));
    metrics.set("qkvshare_pool_bytes", "state=\"total\"", static_cast<double>(s.kv.arena_bytes));
    metrics.set("qkvshare_handoff_opens_total", "path=\"kv\"", static_cast<double>(s.counters.opens_kv));
    metrics.set("qkvshare_handoff_opens_total", "path=\"text\",reason=\"model\"", static_cast<double>(s.counters.fallback_model));
    metrics.set("qkvshare_handoff_opens_total", "path=\"text\",reason=\"format\"", static_cast<double>(s.counters.fallback_format));
    metrics.set("qkvshare_handoff_opens_total", "path=\"text\",reason=\"checksum\"", static_cast<double>(s.counters.fallback_checksum));
    metrics.set("qkvshare_handoff_opens_total", "path=\"text\",reason=\"shape\"", static_cast<double>(s.counters.fallback_shape));
    metrics.set("qkvshare_cache_budget_bytes", "", static_cast<double>(store->budget_bytes()));
    const StoreTierStats t = store->tier_stats();
    metrics.set("qkvshare_tier_spills_total", "", static_cast<double>(t.spills));
    metrics.set("qkvshare_tier_restores_total", "", static_cast<double>(t.restores));
    metrics.set("qkvshare_tier_demotions_total", "", static_cast<double>(t.demotions));
    metrics.set("qkvshare_tier_spilled_bytes_total", "", static_cast<double>(t.bytes_spilled));
    metrics.set("qkvshare_tier_failures_total", "op=\"spill\"", static_cast<double>(t.spill_failures));
    metrics.set("qkvshare_tier_failures_total", "op=\"restore\"", static_cast<double>(t.restore_failures));
    metrics.set("qkvshare_tier_disk_contexts", "", static_cast<double>(t.contexts_on_disk));
    metrics.set("qkvshare_tier_disk_bytes", "", static_cast<double>(t.bytes_on_disk));
    metrics.set("qkvshare_queue_depth", "", scheduler->queue_depth());
    metrics.set("qkvshare_sessions_active", "", scheduler->active());
    // Replaced as a whole, so that a format no context uses any more disappears.
    for (const char* f : {"qkvshare_cached_contexts", "qkvshare_cached_blocks", "qkvshare_cached_bytes"}) metrics.clear(f);
    for (const auto& [format, fs] : store->stats()) {
      const std::string l = fmt::format("format=\"{}\"", format);
      metrics.set("qkvshare_cached_contexts", l, fs.contexts);
      metrics.set("qkvshare_cached_blocks", l, static_cast<double>(fs.blocks));
      metrics.set("qkvshare_cached_bytes", l, static_cast<double>(fs.bytes));
    }
  }

  // A request whose headers show it cannot be served is answered at once,
  // not after the library has waited for (or drained) its body.
  bool refuse_framing(const httplib::Request& req, httplib::Response& res) const {
    const auto refused = check_framing(req, o.max_body_bytes);
    if (!refused) return false;
    send_error(res, refused->status, refused->type, "", refused->message);
    // The body is left unread: what the client still sends is no next request.
    res.set_header("Connection", "close");
    return true;
  }

  void routes() {
    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(dump({{"status", draining ? "shutting_down" : "ok"}, {"model", o.model_id},
                            {"sessions_active", scheduler->active()}, {"queue_depth", scheduler->queue_depth()}}),
                      "application/json");
      if (draining) res.status = 503;
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      refresh_gauges();
      res.set_content(metrics.render(), "text/plain; version=0.0.4");
    });
    http.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
      if (!tenant_of(req, res)) return;
      res.set_content(dump({{"object", "list"},
                            {"data", json::array({{{"id", o.model_id}, {"object", "model"}, {"created", 0},
                                                   {"owned_by", "qkvshare"},
                                                   {"context_length", capacity}}})}}),
                      "application/json");
    });
    post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
      completion(Endpoint::chat, req, res);
    });
    post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      completion(Endpoint::completion, req, res);
    });
    contexts_routes();
    // Both run after the headers and before the library reads the body.
    http.set_expect_100_continue_handler([this](const httplib::Request& req, httplib::Response& res) {
      return refuse_framing(req, res) ? res.status : 100;
    });
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      // The library hands a const Request, but the one it owns is not: byte
      // ranges of a JSON answer mean nothing to an API client, so none are applied.
      const_cast<httplib::Request&>(req).ranges.clear();
      return refuse_framing(req, res) ? httplib::Server::HandlerResponse::Handled
                                      : httplib::Server::HandlerResponse::Unhandled;
    });
    http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      if (res.status == 404)
        return send_error(res, 404, "not_found_error", "", fmt::format("no route for {} {}", req.method, quote_input(req.path)));
      const char* type = res.status == 413 ? "request_too_large" : "invalid_request_error";
      send_error(res, res.status, type, "", library_error_message(req, res.status, o.max_body_bytes));
    });
    http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        send_exception(res, e);
      } catch (...) {
        send_error(res, 500, "server_error", "", "unknown error");
      }
    });
    http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
      std::string route = req.path.rfind("/v1/contexts", 0) == 0 ? "/v1/contexts" : req.path;
      if (route != "/health" && route != "/metrics" && route != "/v1/models" && route != "/v1/chat/completions" &&
          route != "/v1/completions" && route != "/v1/contexts")
        route = "other";
      metrics.add("qkvshare_requests_total", fmt::format("route=\"{}\",status=\"{}\"", route, res.status));
      if (o.log_requests && route != "/metrics" && route != "/health" && route != "/v1/chat/completions" &&
          route != "/v1/completions")
        std::fprintf(stderr, "%s\n", dump({{"ts", unix_now()}, {"event", "http"}, {"method", req.method},
                                           {"path", req.path}, {"status", res.status}}).c_str());
    });
  }
};

Server::Server(Engine& engine, ServerOptions options) : impl_(std::make_unique<Impl>(engine, std::move(options))) {
  Impl& m = *impl_;
  ServerOptions& o = m.o;
  if (o.parallel < 1 || o.parallel > 256) fail(ErrorCode::invalid_argument, "--parallel: {} is not in 1..256", o.parallel);
  if (o.queue < 0 || o.queue > 65536) fail(ErrorCode::invalid_argument, "--queue: {} is not in 0..65536", o.queue);
  if (o.port < 0 || o.port > 65535) fail(ErrorCode::invalid_argument, "--port: {} is not in 0..65535", o.port);
  const int model_ctx = engine.model().config().context_length;
  if (o.ctx < 0 || o.ctx > model_ctx)
    fail(ErrorCode::invalid_argument, "--ctx: {} is not in 1..{} (the model's context length)", o.ctx, model_ctx);
  m.capacity = o.ctx > 0 ? o.ctx : model_ctx;
  if (!o.api_key_file.empty()) m.tenants = Tenants::load(o.api_key_file);
  ShareConfig cfg;
  cfg.bytes = o.pool_bytes;
  // The registry reserves room for max_tokens ids (and text) per record:
  // size it by this server's context, not the share layer's default.
  if (o.max_contexts < 8 || o.max_contexts > 65536)
    fail(ErrorCode::invalid_argument, "--max-contexts: {} is not in 8..65536", o.max_contexts);
  cfg.max_contexts = o.max_contexts;
  cfg.max_grants = 4 * o.max_contexts;
  cfg.max_processes = 32;
  cfg.max_tokens = m.capacity;
  if (o.pool.empty()) {
    m.pool = SharePool::create_anonymous(cfg);
  } else {
    try {
      m.pool = SharePool::attach(o.pool);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::io) throw;
      m.pool = SharePool::create(o.pool, cfg);
      m.created_pool = true;  // ours: unlinked at stop()
    }
  }
  try {
    m.default_format = KvFormat::parse(o.kv);
    m.default_format.validate(engine.kv_shape(), m.pool->kv_pool(engine.kv_shape())->block_tokens());
    refuse_eviction(m.default_format);
  } catch (const Error& e) {
    fail(ErrorCode::invalid_argument, "--kv: {}", e.what());
  }
  const Tokenizer& tok = engine.model().tokenizer();
  m.tmpl = engine.model().chat_template(o.chat_template, o.thinking);
  for (std::string_view piece : m.tmpl->stop_pieces())
    if (const auto id = tok.find(piece)) m.turn_ends.push_back(*id);
  if (o.demote) {
    try {
      o.demote->validate(engine.kv_shape(), m.pool->kv_pool(engine.kv_shape())->block_tokens());
      refuse_eviction(*o.demote);
    } catch (const Error& e) {
      fail(ErrorCode::invalid_argument, "--demote: {}", e.what());
    }
  }
  if (o.cipher && o.spill_dir.empty()) fail(ErrorCode::invalid_argument, "--key encrypts spill files: it needs --spill-dir");
  m.store = std::make_unique<ContextStore>(
      m.pool, engine, StoreOptions{o.cache_bytes, o.auto_reuse, o.spill_dir, o.cipher, o.demote});
  register_metrics(m.metrics);
  m.scheduler = make_batched_scheduler(engine, *m.store, m.metrics, SchedulerOptions{o.parallel, o.queue, 256, m.capacity});
  const auto threads = static_cast<std::size_t>(o.http_threads > 0 ? o.http_threads : kMaxHttpThreads);
  m.http.new_task_queue = [threads] { return new ElasticTaskQueue(threads); };
  m.http.set_payload_max_length(o.max_body_bytes);
  // Agents send many requests in a row: cpp-httplib 0.11 closes a connection
  // after 5 (newer releases after 100), so a client reconnected every fifth
  // request, and each reconnect queues behind a listen backlog of 5.
  m.http.set_keep_alive_max_count(100);
  // A client that started a request and then stalls holds a thread: it gets
  // kReadTimeoutSeconds between packets (the library has no whole-request
  // deadline); an idle keep-alive connection is closed after 5 s (its default).
  m.http.set_read_timeout(kReadTimeoutSeconds);
  m.http.set_write_timeout(30);
  m.routes();
  if (o.port == 0) {
    m.port = m.http.bind_to_any_port(o.host);
  } else {
    m.port = m.http.bind_to_port(o.host, o.port) ? o.port : -1;
  }
  if (m.port < 0) fail(ErrorCode::io, "--host/--port: cannot listen on {}:{} (in use, or not an address of this machine)", o.host, o.port);
}

Server::~Server() { stop(true); }

int Server::port() const noexcept { return impl_->port; }

bool Server::run() { return impl_->http.listen_after_bind(); }

void Server::stop(bool cancel) {
  Impl& m = *impl_;
  std::lock_guard lock(m.stop_mu);
  if (m.stopped) return;
  m.stopped = true;
  m.draining = true;
  m.scheduler->shutdown(cancel);  // running jobs finish (or end), queued ones get 503
  m.http.stop();                  // waits for the handlers, which have their answers now
  m.store->release_all();
  if (m.created_pool) ShmRegion::unlink(m.o.pool);  // processes attached keep their mapping
}

}  // namespace qkvshare::server
