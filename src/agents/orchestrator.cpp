#include "qkvshare/agents/orchestrator.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "qkvshare/core/clock.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/generate.hpp"
#include "qkvshare/engine/scheduler.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "qkvshare/share/handoff.hpp"
#include "reference_trace.hpp"
#include "splice_step.hpp"
#include "transcript.hpp"

namespace qkvshare::agents {

std::string_view to_string(RunMode mode) noexcept {
  switch (mode) {
    case RunMode::independent: return "independent";
    case RunMode::shared_text: return "shared-text";
    case RunMode::qkvshare: return "qkvshare";
    case RunMode::solo: return "solo";
  }
  return "?";
}

RunMode parse_run_mode(std::string_view text) {
  if (text == "independent") return RunMode::independent;
  if (text == "shared-text") return RunMode::shared_text;
  if (text == "qkvshare") return RunMode::qkvshare;
  if (text == "solo") return RunMode::solo;
  fail(ErrorCode::invalid_argument, "--mode: '{}' is not a mode (independent, shared-text, qkvshare, solo)", text);
}

double token_agreement(const std::vector<TokenId>& want, const std::vector<TokenId>& got) {
  const std::size_t n = std::max(want.size(), got.size());
  if (n == 0) return 1.0;
  std::size_t same = 0;
  for (std::size_t i = 0; i < std::min(want.size(), got.size()); ++i) same += want[i] == got[i] ? 1 : 0;
  return static_cast<double>(same) / static_cast<double>(n);
}

namespace {

using Clock = std::chrono::steady_clock;

// One loaded model with its engine; in text modes also a private f16 KV pool.
struct Runtime {
  std::unique_ptr<Model> model;
  std::unique_ptr<Engine> engine;
  std::shared_ptr<KvPool> private_pool;
  std::unique_ptr<Scheduler> scheduler;  // made on first use
};

// What a finished step leaves for its consumers.
struct StepResult {
  std::string transcript;         // the full text of its context, prompt and reply
  std::string output;             // the reply alone
  std::vector<TokenId> pending;   // sampled but not yet in the KV (the last token)
  std::map<std::string, Descriptor> grants;  // consumer step id -> descriptor (qkvshare mode)
  std::vector<TokenId> prompt;    // its prompt's ids, when a later step splices them
  int prompt_begin = 0;           // their first index in the context
  std::vector<TokenId> reply;     // the generated ids
  int reply_begin = 0;            // the reply's first token in the sealed context
  int reply_in_kv = 0;            // reply tokens with KV in it
};

// A step between its preparation and its end (its request runs on the scheduler meanwhile).
struct Running {
  int step_index = 0;
  Clock::time_point t0, submitted;
  StepMetrics m;
  StepResult result;                 // filled as the step goes
  std::unique_ptr<Session> session;
  std::vector<TokenId> feed;         // what the request feeds before generating
  std::string transcript;
  int n0 = 0;                        // session tokens before the feed
  const TraceStep* forced = nullptr; // equal work: the reference run's step
  std::size_t scored = 0;            // forced tokens scored so far
  QualitySum quality;
  bool recording = false;
  TraceStep rec;
};

class Run {
 public:
  Run(const Workflow& wf, const std::string& model_path, const std::string& tok_path, const RunOptions& opts)
      : wf_(wf), opts_(opts) {
    const auto t0 = Clock::now();
    // Steps reuse each other's tokens by position (splice parts, reply
    // offsets); a context that dropped tokens at seal would not match them.
    const auto keeps_every_token = [](const std::string& text, const std::string& where) {
      if (!text.empty() && KvFormat::parse(text).evicts())
        fail(ErrorCode::invalid_argument,
             "{}: KV format {} drops tokens when a context is handed off (budget); workflow steps build on each "
             "other's tokens by position, so they keep every token",
             where, text);
    };
    keeps_every_token(opts.kv, "--kv");
    for (const auto& [name, agent] : wf.agents) keeps_every_token(agent.kv, "agent '" + name + "' kv");
    if (opts.mode == RunMode::independent) {
      // Each agent that runs a step is its own engine with its own weights.
      for (const auto& s : wf.steps) {
        if (runtimes_.count(s.agent)) continue;
        runtimes_[s.agent] = load(model_path, tok_path, MappedFile::Mode::private_copy, 2);
        report_.weight_copies_bytes +=
            runtimes_[s.agent]->model->weight_bytes() + runtimes_[s.agent]->engine->float_copy_bytes();
      }
    } else {
      // Text handoffs in one engine: a private pool with room for every step's context at once (concurrent steps).
      shared_ = load(model_path, tok_path, MappedFile::Mode::shared,
                     opts.mode == RunMode::shared_text ? static_cast<int>(wf.steps.size()) + 1 : 0);
      report_.weight_copies_bytes = shared_->model->weight_bytes() + shared_->engine->float_copy_bytes();
      if (opts.mode == RunMode::qkvshare) {
        fingerprint_ = model_fingerprint(*shared_->model);
        if (!opts.kv.empty()) check_codebook_model(KvFormat::parse(opts.kv), fingerprint_, "--kv");
        for (const auto& [name, agent] : wf.agents)
          if (!agent.kv.empty()) check_codebook_model(KvFormat::parse(agent.kv), fingerprint_, "agent '" + name + "' kv");
        ShareConfig config;
        const KvShape shape = shared_->engine->kv_shape();
        config.max_tokens = opts.context;
        config.max_contexts = static_cast<int>(wf.steps.size()) + 4;
        config.max_grants = 4 * static_cast<int>(wf.steps.size()) + 4;
        config.lease_ms = opts.lease_ms;
        config.bytes = KvPool::arena_bytes_for(shape, config.block_tokens, KvFormat::parse("f16"), opts.context,
                                               static_cast<int>(wf.steps.size()) + 2) +
                       (std::size_t{32} << 20);
        pool_ = SharePool::create_anonymous(config);
        pool_->kv_pool(shape);
        if (opts.tiers.budget_bytes > 0) tiers_ = std::make_unique<ContextTiers>(*pool_, opts.tiers);
      }
    }
    if (!opts.force_reference.empty()) {
      trace_ = ReferenceTrace::load(opts.force_reference);
      forcing_ = true;
    }
    report_.load_seconds = seconds_since(t0);
    report_.workflow = wf.name;
    report_.mode = opts.mode;
    report_.kv = opts.mode == RunMode::qkvshare ? opts.kv : text_kv();
  }

  // Starts every step whose inputs are done, advances all running steps by
  // one scheduler pass (ready steps of one engine share forward passes),
  // completes those that finished, repeats. Independent agents are separate
  // engines, one step at a time as separate model instances would run.
  RunReport run() {
    const auto t0 = Clock::now();
    const std::size_t n = wf_.steps.size();
    // A KV budget holds at rest, between steps (tiers/context_tiers.hpp): with
    // concurrent steps some session would always be live, so it runs them one at a time.
    const bool concurrent = opts_.concurrent && opts_.mode != RunMode::independent && !tiers_;
    for (std::size_t p = 0; p < wf_.order.size(); ++p)
      position_[wf_.steps[static_cast<std::size_t>(wf_.order[p])].id] = static_cast<int>(p);
    std::vector<char> started(n, 0), done(n, 0);
    std::vector<std::optional<StepMetrics>> metrics(n);
    std::map<Runtime*, std::map<RequestId, std::unique_ptr<Running>>> running;
    std::size_t finished = 0, in_flight = 0;
    int index = 0;
    const auto complete = [&](Running& r, const RequestResult* result) {
      const StepSpec& step = wf_.steps[static_cast<std::size_t>(r.step_index)];
      const int pos = position_.at(step.id);
      StepMetrics m = complete_step(r, result);
      if (tiers_) tiers_->step_finished(pos);  // evict until the budget holds
      progress(fmt::format("[{}/{}] {}: {} | prefill {} computed, {} reused | {} new tokens | ttft {:.3f} s | {:.2f} s",
                           pos + 1, n, m.step, m.handoff, m.prefill_computed, m.prefill_reused, m.decode_tokens,
                           m.ttft_seconds, m.seconds));
      report_.prefill_computed += m.prefill_computed;
      report_.prefill_reused += m.prefill_reused;
      metrics[static_cast<std::size_t>(pos)] = std::move(m);
      done[static_cast<std::size_t>(r.step_index)] = 1;
      ++finished;
    };
    while (finished < n) {
      for (int i : wf_.order) {
        const StepSpec& step = wf_.steps[static_cast<std::size_t>(i)];
        if (started[static_cast<std::size_t>(i)] || (!concurrent && in_flight > 0)) continue;
        bool ready = true;
        for (const StepInput& in : step.inputs) ready = ready && done[static_cast<std::size_t>(index_of(in.from))];
        if (!ready) continue;
        started[static_cast<std::size_t>(i)] = 1;
        progress(fmt::format("[{}/{}] {} ({}): running", ++index, n, step.id, step.agent));
        if (tiers_) tiers_->step_started(position_.at(step.id));  // prefetch what the next step needs
        std::unique_ptr<Running> r;
        RequestId id{};
        try {
          r = prepare_step(i);
          r->m.start_seconds = std::chrono::duration<double>(r->t0 - t0).count();
          if (r->feed.empty()) {
            complete(*r, nullptr);
            continue;
          }
          id = scheduler(runtime(step.agent)).submit(request_for(*r));
        } catch (const Error& e) {
          step_failed(step, e);
        }
        Runtime& rt = runtime(step.agent);
        r->submitted = Clock::now();
        running[&rt].emplace(id, std::move(r));
        ++in_flight;
      }
      if (in_flight == 0) {
        QKV_CHECK(finished == n);  // every unstarted step waits on a running one
        continue;
      }
      for (auto& [rt, steps] : running) {
        if (steps.empty()) continue;
        Scheduler& sched = scheduler(*rt);
        sched.step();
        ++report_.forward_passes;
        sample_peak_kv();
        for (RequestResult& res : sched.take_finished()) {
          auto it = steps.find(res.id);
          QKV_CHECK(it != steps.end());
          // The workflow fails as generate() would have, saying which step.
          if (res.error) step_failed(wf_.steps[static_cast<std::size_t>(it->second->step_index)], *res.error);
          complete(*it->second, &res);
          steps.erase(it);
          --in_flight;
        }
      }
    }
    for (auto& m : metrics) report_.steps.push_back(std::move(*m));
    report_.total_seconds = seconds_since(t0);
    if (tiers_) report_.tiers = tiers_->stats();
    tiers_.reset();  // removes the spill files
    if (!opts_.record_reference.empty()) trace_.save(opts_.record_reference);
    if (pool_) {
      const ShareStats st = pool_->stats();
      report_.contexts_alive_at_end = st.contexts;
      report_.pool_blocks_used_at_end = st.kv.blocks_used;
    }
    return report_;
  }

 private:
  // A step's error names the step and where the workflow file defines it
  // ("context length exceeded" alone leaves the reader to guess which).
  [[noreturn]] void step_failed(const StepSpec& step, const Error& e) const {
    fail(e.code(), "{}:{}: step '{}': {}", wf_.source, step.line, step.id, e.what());
  }

  // private_contexts > 0: a private pool (text modes) with room for that many full contexts.
  std::unique_ptr<Runtime> load(const std::string& path, const std::string& tok, MappedFile::Mode mode,
                                int private_contexts) {
    auto r = std::make_unique<Runtime>();
    r->model = Model::load(path, tok, mode);
    EngineOptions eo;
    eo.n_threads = opts_.threads;
    eo.exact_matmul = opts_.exact_matmul;
    eo.float_activations = opts_.float_activations;
    r->engine = std::make_unique<Engine>(*r->model, eo);
    if (private_contexts > 0) {
      PoolConfig pc;
      pc.shape = r->engine->kv_shape();
      pc.capacity_bytes = KvPool::arena_bytes_for(pc.shape, pc.block_tokens, KvFormat::parse(text_kv()), opts_.context,
                                                  private_contexts);
      r->private_pool = KvPool::create(pc);
    }
    return r;
  }

  // The KV format of the text modes' private caches: f16, or the shared-text reference's f32.
  std::string text_kv() const { return opts_.mode == RunMode::shared_text ? opts_.text_kv : "f16"; }

  Runtime& runtime(const std::string& agent) {
    return opts_.mode == RunMode::independent ? *runtimes_.at(agent) : *shared_;
  }

  void progress(const std::string& line) const {
    if (opts_.progress) opts_.progress(line);
  }

  int index_of(const std::string& step_id) const {
    for (std::size_t i = 0; i < wf_.steps.size(); ++i)
      if (wf_.steps[i].id == step_id) return static_cast<int>(i);
    fail(ErrorCode::bad_workflow, "{}: no step '{}'", wf_.source, step_id);
  }

  Scheduler& scheduler(Runtime& rt) {
    if (!rt.scheduler) {
      SchedulerOptions so;
      so.token_budget = opts_.token_budget > 0 ? opts_.token_budget : rt.engine->options().max_batch;
      rt.scheduler = std::make_unique<Scheduler>(*rt.engine, so);
    }
    return *rt.scheduler;
  }

  static std::size_t session_kv_bytes(const Session& session) {
    const auto* pooled = dynamic_cast<const PooledKvCache*>(&session.cache());
    return pooled != nullptr ? pooled->kv_bytes() : 0;
  }

  // KV bytes held at once right now (every live session and sealed context),
  // sampled after every scheduler pass and step completion.
  void sample_peak_kv() {
    std::size_t live = 0;
    if (pool_) {
      live = pool_->stats().kv.bytes_used;
    } else {
      if (shared_ && shared_->private_pool) live += shared_->private_pool->counters().bytes_used;
      for (const auto& [name, rt] : runtimes_)
        if (rt->private_pool) live += rt->private_pool->counters().bytes_used;
    }
    report_.peak_kv_bytes = std::max(report_.peak_kv_bytes, live);
  }

  // A step's context and the tokens it still has to feed: a new session, an
  // opened handoff, a splice, or a text re-read (every mode's preparation).
  std::unique_ptr<Running> prepare_step(int step_index) {
    const StepSpec& step = wf_.steps[static_cast<std::size_t>(step_index)];
    auto run = std::make_unique<Running>();
    Running& r = *run;
    r.step_index = step_index;
    r.t0 = Clock::now();
    const AgentSpec& agent = wf_.agents.at(step.agent);
    Runtime& rt = runtime(step.agent);
    const Tokenizer& tok = rt.model->tokenizer();
    const TurnFormat turns(*rt.model);
    StepMetrics& m = r.m;
    m.step = step.id;
    m.agent = step.agent;
    const std::string prompt = render_prompt(wf_, step, outputs_);

    std::unique_ptr<Session>& session = r.session;
    std::vector<TokenId>& feed = r.feed;
    std::string& transcript = r.transcript;
    StepResult& result = r.result;
    const StepInput* base = step.context_input();
    if (base != nullptr && opts_.mode == RunMode::qkvshare) {
      StepResult& up = results_.at(base->from);
      const auto h0 = Clock::now();
      HandoffOptions ho;
      ho.capacity = opts_.context;
      // Under a budget the context may be on disk: acquire restores it (or
      // waits for its prefetch) and gives the descriptor of the live copy.
      const Descriptor d = tiers_ ? tiers_->acquire(base->from, step.id) : up.grants.at(step.id);
      HandoffResult h = open_session(*pool_, *rt.engine, fingerprint_, d, step.id, ho);
      pool_->release(d, step.id);  // the session holds its own block references
      up.grants.erase(step.id);
      if (tiers_) tiers_->consumed(base->from, step.id);
      m.handoff_seconds = seconds_since(h0);
      session = std::move(h.session);
      m.handoff = h.kv ? std::string(to_string(base->mode)) : "fallback:" + std::string(to_string(h.fallback));
      m.prefill_reused = h.kv ? session->n_past() : 0;
      m.prefill_computed += h.prefill_tokens;
      feed = up.pending;
      const std::string tail = turns.append(agent.system, prompt);
      const auto tail_ids = tok.encode(tail, true);
      feed.insert(feed.end(), tail_ids.begin(), tail_ids.end());
      transcript = up.transcript + tail;
    } else if (step.splices()) {
      session = new_session(rt, step);
      std::vector<SpliceInput> inputs;
      std::map<std::string, Descriptor> restored;  // under a budget: descriptors of the live copies
      for (const auto& in : step.inputs) {
        if (in.mode != HandoffMode::splice) continue;
        StepResult& up = results_.at(in.from);
        const auto g = up.grants.find(step.id);
        const Descriptor* grant = g != up.grants.end() ? &g->second : nullptr;
        if (tiers_ && grant != nullptr) grant = &restored.emplace(in.from, tiers_->acquire(in.from, step.id)).first->second;
        SpliceInput si{in.from, in.recompute, grant, {}};
        if (in.splice_prompt) si.parts.push_back(SplicePart{up.prompt, up.prompt_begin, static_cast<int>(up.prompt.size())});
        if (in.splice_reply) si.parts.push_back(SplicePart{up.reply, up.reply_begin, up.reply_in_kv});
        inputs.push_back(std::move(si));
      }
      const PreparedSplice ps =
          prepare_splice_step(*rt.engine, *session, opts_.mode == RunMode::qkvshare ? pool_.get() : nullptr,
                              fingerprint_, turns, agent.system, prompt, step.id, inputs, opts_.splice, opts_.context);
      for (const auto& in : step.inputs) {
        if (in.mode != HandoffMode::splice) continue;
        results_.at(in.from).grants.erase(step.id);  // released by the splice
        if (tiers_ && restored.count(in.from) != 0) tiers_->consumed(in.from, step.id);
      }
      feed = ps.feed;
      transcript = ps.transcript;
      m.handoff = ps.to_text > 0 && ps.to_text == ps.splices ? "splice:text" : ps.handoff;
      m.handoff_seconds = ps.seconds;
      m.prefill_computed += ps.computed;
      m.prefill_reused = ps.reused;
      m.splice_tokens = ps.spliced;
      m.splice_recomputed = ps.recomputed;
      m.guard_probe_tokens = ps.probe_tokens;
      m.guard_estimate = ps.estimate;
      m.recompute_fraction = ps.fraction;
      m.guard_raised = ps.raised;
      m.guard_text = ps.to_text;
      report_.splices += ps.splices;
      report_.guard_raised += ps.raised;
      report_.guard_text += ps.to_text;
    } else {
      session = new_session(rt, step);
      if (base != nullptr) {  // text handoff: re-read the upstream transcript
        transcript = results_.at(base->from).transcript + turns.append(agent.system, prompt);
        m.handoff = "text";
      } else {
        transcript = turns.open(agent.system, prompt);
        m.handoff = "new";
      }
      if (tok.add_bos() && tok.bos_id() >= 0) feed.push_back(tok.bos_id());
      if (base == nullptr && prompt_spliced(step)) {
        // Its prompt is spliced by a later step: encoded on its own, so that its ids are one known run.
        const auto head = tok.encode(turns.open_user(agent.system), true);
        feed.insert(feed.end(), head.begin(), head.end());
        result.prompt = tok.encode(prompt, true);
        result.prompt_begin = static_cast<int>(feed.size());
        feed.insert(feed.end(), result.prompt.begin(), result.prompt.end());
        const auto tail = tok.encode(turns.close_user(), true);
        feed.insert(feed.end(), tail.begin(), tail.end());
      } else {
        const auto ids = tok.encode(transcript, true);
        feed.insert(feed.end(), ids.begin(), ids.end());
      }
    }

    r.n0 = session->n_past();
    if (forcing_) {
      const auto forced = trace_.steps.find(step.id);
      if (forced != trace_.steps.end()) r.forced = &forced->second;
    }
    r.recording = !opts_.record_reference.empty() && r.forced == nullptr;
    return run;
  }

  // The step's request: its generation settings, or the reference run's
  // tokens (equal work), with the logits scored or recorded as they come.
  Request request_for(Running& r) {
    const StepSpec& step = wf_.steps[static_cast<std::size_t>(r.step_index)];
    const AgentSpec& agent = wf_.agents.at(step.agent);
    Request req;
    req.session = r.session.get();
    req.prompt = r.feed;
    req.options = step_generate_options(agent, opts_.max_tokens_cap, r.forced);
    GenerateOptions& go = req.options;
    if (r.forced != nullptr) {
      go.on_logits = [this, &r](std::span<const float> logits) {
        const TraceStep& ref = *r.forced;
        r.quality.add(trace_.row(ref, r.scored, row_buffer_), logits, ref.tokens[r.scored]);
        ++r.scored;
      };
    } else if (r.recording) {
      go.on_logits = [&r](std::span<const float> logits) {
        std::vector<float> row;
        log_softmax(logits, row);
        r.rec.logprobs.insert(r.rec.logprobs.end(), row.begin(), row.end());
      };
    }
    return req;
  }

  // What a finished step leaves: metrics (times from the step's own start),
  // its output, the seal and grants of its context for the steps building on
  // it. `g` is null for a step that had nothing to feed.
  StepMetrics complete_step(Running& r, const RequestResult* res) {
    const StepSpec& step = wf_.steps[static_cast<std::size_t>(r.step_index)];
    Runtime& rt = runtime(step.agent);
    StepMetrics m = std::move(r.m);
    StepResult result = std::move(r.result);
    std::unique_ptr<Session> session = std::move(r.session);
    if (res == nullptr) {
      m.ttft_seconds = seconds_since(r.t0);
    } else {
      const GenerateResult& g = res->generation;
      QualitySum& quality = r.quality;
      if (r.recording) {
        const std::size_t vocab = static_cast<std::size_t>(rt.model->config().vocab_size);
        TraceStep& rec = r.rec;
        rec.tokens = g.tokens;
        rec.logprobs.resize(g.tokens.size() * vocab);  // not the row that sampled the end of generation
        for (std::size_t i = 0; i < g.tokens.size(); ++i) {
          std::vector<float> row(rec.logprobs.begin() + static_cast<std::ptrdiff_t>(i * vocab),
                                 rec.logprobs.begin() + static_cast<std::ptrdiff_t>((i + 1) * vocab));
          quality.add(row.data(), row, g.tokens[i]);  // its own PPL; KL 0, top-1 1
        }
        trace_.vocab = static_cast<int>(vocab);
        trace_.steps[step.id] = std::move(rec);
      }
      if (quality.n > 0) {
        m.kl = quality.kl / quality.n;
        m.top1 = static_cast<double>(quality.same) / quality.n;
        m.nll = quality.nll / quality.n;
        m.scored_tokens = quality.n;
      }
      // The scheduler times submission to first token; before it, the step's own preparation.
      m.ttft_seconds = g.tokens.empty() ? seconds_since(r.t0)
                                        : std::chrono::duration<double>(r.submitted - r.t0).count() + res->ttft_seconds;
      m.prefill_computed += g.prefill_tokens;
      m.decode_tokens = static_cast<int>(g.tokens.size());
      m.output_tokens = g.tokens;
      m.output = g.text;
      result.reply = g.tokens;
      result.reply_begin = r.n0 + static_cast<int>(r.feed.size());
      result.reply_in_kv = session->n_past() - result.reply_begin;
      // The last sampled token has no KV yet; a continuing consumer feeds it.
      if (!g.tokens.empty() &&
          session->n_past() < r.n0 + static_cast<int>(r.feed.size()) + static_cast<int>(g.tokens.size()))
        result.pending.push_back(g.tokens.back());
    }
    result.output = m.output;
    result.transcript = r.transcript + m.output;
    m.kv_bytes = session_kv_bytes(*session);
    sample_peak_kv();

    if (pool_) hand_over(step, *session, result);
    session.reset();
    sample_peak_kv();
    outputs_[step.id] = result.output;
    results_[step.id] = std::move(result);
    m.seconds = seconds_since(r.t0);
    return m;
  }

  std::unique_ptr<Session> new_session(Runtime& rt, const StepSpec& step) {
    if (opts_.mode == RunMode::qkvshare) {
      const std::string& kv = wf_.agents.at(step.agent).kv;
      return new_pooled_session(*pool_, *rt.engine, KvFormat::parse(kv.empty() ? opts_.kv : kv), opts_.context);
    }
    return std::make_unique<Session>(
        std::make_unique<PooledKvCache>(rt.private_pool, KvFormat::parse(text_kv()), opts_.context));
  }

  bool prompt_spliced(const StepSpec& step) const {
    for (const auto& s : wf_.steps)
      for (const auto& in : s.inputs)
        if (in.from == step.id && in.mode == HandoffMode::splice && in.splice_prompt) return true;
    return false;
  }

  // Seals the step's context and grants it to each step that builds on it;
  // the grants alone keep it alive (the producer's claim is dropped at once).
  void hand_over(const StepSpec& step, const Session& session, StepResult& result) {
    std::vector<std::string> consumers;
    for (const auto& s : wf_.steps)
      for (const auto& in : s.inputs)
        if (in.from == step.id && in.mode != HandoffMode::text) consumers.push_back(s.id);
    if (consumers.empty()) return;
    // A spliced context is handed on as its tail (what this step wrote after
    // its last splice); the workflow check allows only splice consumers then.
    const auto& cache = dynamic_cast<const PooledKvCache&>(session.cache());
    std::unique_ptr<PooledKvCache> tail;
    std::span<const TokenId> tokens(session.tokens());
    if (cache.tail_begin() > 0) {
      tail = cache.tail_context();
      tokens = tokens.subspan(static_cast<std::size_t>(cache.tail_begin()));
      result.reply_begin -= cache.tail_begin();
      result.prompt_begin -= cache.tail_begin();
    }
    const Tokenizer& tok = runtime(step.agent).model->tokenizer();
    const SealedContext sealed =
        pool_->seal(tail ? *tail : cache, tokens, tok.decode(std::vector<TokenId>(tokens.begin(), tokens.end())),
                    fingerprint_, step.id);
    for (const auto& c : consumers) result.grants.emplace(c, pool_->grant(sealed, step.id, c));
    pool_->release(sealed);
    if (tiers_) tiers_->add(step.id, result.grants, position_);
  }

  const Workflow& wf_;
  RunOptions opts_;
  RunReport report_;
  std::map<std::string, std::unique_ptr<Runtime>> runtimes_;
  std::unique_ptr<Runtime> shared_;
  std::shared_ptr<SharePool> pool_;
  std::unique_ptr<ContextTiers> tiers_;  // only under a budget
  std::map<std::string, int> position_;  // step id -> place in the run order
  ModelFingerprint fingerprint_;
  std::map<std::string, StepResult> results_;
  std::map<std::string, std::string> outputs_;
  ReferenceTrace trace_;  // recorded (record_reference) or forced (force_reference)
  std::vector<float> row_buffer_;  // one reference row read back from the trace file
  bool forcing_ = false;
};

}  // namespace

RunReport run_workflow(const Workflow& workflow, const std::string& model_path, const std::string& tokenizer_path,
                       const RunOptions& options) {
  if (options.mode == RunMode::solo) return run_solo(workflow, model_path, tokenizer_path, options);
  Run run(workflow, model_path, tokenizer_path, options);
  return run.run();
}

}  // namespace qkvshare::agents
