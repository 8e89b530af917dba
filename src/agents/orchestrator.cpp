#include "qkvshare/agents/orchestrator.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/generate.hpp"
#include "qkvshare/engine/scheduler.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "qkvshare/share/handoff.hpp"
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
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// One loaded model with its engine; in text modes also a private f16 KV pool.
struct Runtime {
  std::unique_ptr<Model> model;
  std::unique_ptr<Engine> engine;
  std::shared_ptr<KvPool> private_pool;
  std::unique_ptr<Scheduler> scheduler;  // made on first use
};

// A step between its preparation and its end.
struct Running {
  int step_index = 0;
  std::chrono::steady_clock::time_point t0, submitted;
  StepMetrics m;
  std::unique_ptr<Session> session;
  std::vector<TokenId> feed;
  std::string transcript;
  int n0 = 0;  // session tokens before the feed
};

// What a finished step leaves for its consumers.
struct StepResult {
  std::string transcript;         // the full text of its context, prompt and reply
  std::string output;             // the reply alone
  std::vector<TokenId> pending;   // sampled but not yet in the KV (the last token)
  std::map<std::string, Descriptor> grants;  // consumer step id -> descriptor (qkvshare mode)
};

class Run {
 public:
  Run(const Workflow& wf, const std::string& model_path, const std::string& tok_path, const RunOptions& opts)
      : wf_(wf), opts_(opts) {
    const auto t0 = Clock::now();
    if (opts.mode == RunMode::independent) {
      // Each agent that runs a step is its own engine with its own weights.
      for (const auto& s : wf.steps) {
        if (runtimes_.count(s.agent)) continue;
        runtimes_[s.agent] = load(model_path, tok_path, MappedFile::Mode::private_copy, 2);
        report_.weight_copies_bytes += runtimes_[s.agent]->model->weight_bytes();
      }
    } else {
      // Text handoffs in one engine: a private pool with room for every step's context at once (concurrent steps).
      shared_ = load(model_path, tok_path, MappedFile::Mode::shared,
                     opts.mode == RunMode::shared_text ? static_cast<int>(wf.steps.size()) + 1 : 0);
      report_.weight_copies_bytes = shared_->model->weight_bytes();
      if (opts.mode == RunMode::qkvshare) {
        fingerprint_ = model_fingerprint(*shared_->model);
        ShareConfig config;
        const KvShape shape = shared_->engine->kv_shape();
        config.max_tokens = opts.context;
        config.max_contexts = static_cast<int>(wf.steps.size()) + 4;
        config.max_grants = 4 * static_cast<int>(wf.steps.size()) + 4;
        config.bytes = KvPool::arena_bytes_for(shape, config.block_tokens, KvFormat::parse("f16"), opts.context,
                                               static_cast<int>(wf.steps.size()) + 2) +
                       (std::size_t{32} << 20);
        pool_ = SharePool::create_anonymous(config);
        pool_->kv_pool(shape);
        if (opts.tiers.budget_bytes > 0) tiers_ = std::make_unique<ContextTiers>(*pool_, opts.tiers);
      }
    }
    report_.load_seconds = since(t0);
    report_.workflow = wf.name;
    report_.mode = opts.mode;
    report_.kv = opts.mode == RunMode::qkvshare ? opts.kv : "f16";
  }

  // Starts every step whose inputs are done, advances all running steps by
  // one scheduler pass (so ready steps of one engine share forward passes),
  // completes those that finished, repeats. Independent agents are separate
  // engines, one step at a time as separate model instances would run.
  RunReport run() {
    const auto t0 = Clock::now();
    const std::size_t n = wf_.steps.size();
    // The tiers' budget policy (evict / prefetch by steps-to-execution) assumes one step at a
    // time, so a run under a KV budget stays sequential for now.
    const bool concurrent = opts_.concurrent && opts_.mode != RunMode::independent && !tiers_;
    std::vector<char> started(n, 0), done(n, 0);
    std::vector<std::optional<StepMetrics>> metrics(n);
    std::map<Runtime*, std::map<RequestId, Running>> running;
    std::size_t finished = 0, in_flight = 0;
    int index = 0;
    for (std::size_t p = 0; p < wf_.order.size(); ++p)
      position_[wf_.steps[static_cast<std::size_t>(wf_.order[p])].id] = static_cast<int>(p);
    const auto complete = [&](Running& r, const RequestResult* result) {
      const int i = r.step_index;
      StepMetrics m = complete_step(r, result);
      const std::size_t pos = static_cast<std::size_t>(std::find(wf_.order.begin(), wf_.order.end(), i) - wf_.order.begin());
      progress(fmt::format("[{}/{}] {}: {} | prefill {} computed, {} reused | {} new tokens | ttft {:.3f} s | {:.2f} s",
                           pos + 1, n, m.step, m.handoff, m.prefill_computed, m.prefill_reused, m.decode_tokens,
                           m.ttft_seconds, m.seconds));
      report_.prefill_computed += m.prefill_computed;
      report_.prefill_reused += m.prefill_reused;
      metrics[pos] = std::move(m);
      if (tiers_) tiers_->step_finished(static_cast<int>(pos));  // evict until the budget holds
      done[static_cast<std::size_t>(i)] = 1;
      ++finished;
      release_finished_inputs(wf_.steps[static_cast<std::size_t>(i)]);
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
        Running r = prepare_step(i);
        r.m.start_seconds = std::chrono::duration<double>(r.t0 - t0).count();
        if (r.feed.empty()) {
          complete(r, nullptr);
          continue;
        }
        Runtime& rt = runtime(step.agent);
        Scheduler& sched = scheduler(rt);
        Request req;
        req.session = r.session.get();
        req.prompt = r.feed;
        req.options = generate_options(step);
        r.submitted = Clock::now();
        const RequestId id = sched.submit(std::move(req));
        running[&rt].emplace(id, std::move(r));
        ++in_flight;
      }
      if (in_flight == 0) {
        QKV_CHECK(finished == n || std::count(started.begin(), started.end(), 1) > static_cast<long>(finished));
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
          if (res.error) throw *res.error;  // the workflow fails as generate() would have
          complete(it->second, &res);
          steps.erase(it);
          --in_flight;
        }
      }
    }
    for (auto& m : metrics) report_.steps.push_back(std::move(*m));
    report_.total_seconds = since(t0);
    if (tiers_) report_.tiers = tiers_->stats();
    tiers_.reset();  // removes the spill files
    if (pool_) {
      const ShareStats st = pool_->stats();
      report_.contexts_alive_at_end = st.contexts;
      report_.pool_blocks_used_at_end = st.kv.blocks_used;
    }
    return report_;
  }

 private:
  // private_contexts > 0: a private f16 pool with room for that many full contexts.
  std::unique_ptr<Runtime> load(const std::string& path, const std::string& tok, MappedFile::Mode mode,
                                int private_contexts) {
    auto r = std::make_unique<Runtime>();
    r->model = Model::load(path, tok, mode);
    EngineOptions eo;
    eo.n_threads = opts_.threads;
    eo.exact_matmul = opts_.exact_matmul;
    r->engine = std::make_unique<Engine>(*r->model, eo);
    if (private_contexts > 0) {
      PoolConfig pc;
      pc.shape = r->engine->kv_shape();
      pc.capacity_bytes =
          KvPool::arena_bytes_for(pc.shape, pc.block_tokens, KvFormat::parse("f16"), opts_.context, private_contexts);
      r->private_pool = KvPool::create(pc);
    }
    return r;
  }

  Runtime& runtime(const std::string& agent) {
    return opts_.mode == RunMode::independent ? *runtimes_.at(agent) : *shared_;
  }

  void progress(const std::string& line) const {
    if (opts_.progress) opts_.progress(line);
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

  int index_of(const std::string& step_id) const {
    for (std::size_t i = 0; i < wf_.steps.size(); ++i)
      if (wf_.steps[i].id == step_id) return static_cast<int>(i);
    fail(ErrorCode::bad_workflow, "{}: no step '{}'", wf_.source, step_id);
  }

  Scheduler& scheduler(Runtime& rt) {
    if (!rt.scheduler) {
      SchedulerOptions so;
      so.token_budget = opts_.token_budget;
      rt.scheduler = std::make_unique<Scheduler>(*rt.engine, so);
    }
    return *rt.scheduler;
  }

  // A step's context and the tokens it still has to feed: a new session, an
  // opened handoff, or a text re-read (every mode's way of preparing a step).
  Running prepare_step(int step_index) {
    const StepSpec& step = wf_.steps[static_cast<std::size_t>(step_index)];
    const auto t0 = Clock::now();
    const AgentSpec& agent = wf_.agents.at(step.agent);
    Runtime& rt = runtime(step.agent);
    const Tokenizer& tok = rt.model->tokenizer();
    const TurnFormat turns(tok);
    StepMetrics m;
    m.step = step.id;
    m.agent = step.agent;
    const std::string prompt = render_prompt(wf_, step, outputs_);

    std::unique_ptr<Session> session;
    std::vector<TokenId> feed;
    std::string transcript;
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
      m.handoff_seconds = since(h0);
      session = std::move(h.session);
      m.handoff = h.kv ? std::string(to_string(base->mode)) : "fallback:" + std::string(to_string(h.fallback));
      m.prefill_reused = h.kv ? session->n_past() : 0;
      m.prefill_computed += h.prefill_tokens;
      feed = up.pending;
      const std::string tail = turns.append(agent.system, prompt);
      const auto tail_ids = tok.encode(tail, true);
      feed.insert(feed.end(), tail_ids.begin(), tail_ids.end());
      transcript = up.transcript + tail;
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
      const auto ids = tok.encode(transcript, true);
      feed.insert(feed.end(), ids.begin(), ids.end());
    }

    Running r;
    r.step_index = step_index;
    r.t0 = t0;
    r.m = std::move(m);
    r.session = std::move(session);
    r.feed = std::move(feed);
    r.transcript = std::move(transcript);
    r.n0 = r.session->n_past();
    return r;
  }

  GenerateOptions generate_options(const StepSpec& step) const {
    const AgentSpec& agent = wf_.agents.at(step.agent);
    GenerateOptions go;
    go.max_new_tokens = opts_.max_tokens_cap > 0 ? std::min(agent.max_tokens, opts_.max_tokens_cap) : agent.max_tokens;
    go.sampling = agent.sampling;
    go.stop_strings = agent.stop;
    return go;
  }

  // What a finished step leaves: metrics (times from the step's own start),
  // its output, the seal and grants of its context for the steps building on it.
  StepMetrics complete_step(Running& r, const RequestResult* g) {
    const StepSpec& step = wf_.steps[static_cast<std::size_t>(r.step_index)];
    StepMetrics m = std::move(r.m);
    std::unique_ptr<Session> session = std::move(r.session);
    StepResult result;
    if (g == nullptr) {
      m.ttft_seconds = since(r.t0);
    } else {
      // Submission to first token is measured by the scheduler; before it, this step's own preparation.
      m.ttft_seconds = std::chrono::duration<double>(r.submitted - r.t0).count() + g->ttft_seconds;
      if (g->generation.tokens.empty()) m.ttft_seconds = since(r.t0);
      m.prefill_computed += g->generation.prefill_tokens;
      m.decode_tokens = static_cast<int>(g->generation.tokens.size());
      m.output_tokens = g->generation.tokens;
      m.output = g->generation.text;
      // The last sampled token has no KV yet; a continuing consumer feeds it.
      if (!g->generation.tokens.empty() &&
          session->n_past() < r.n0 + static_cast<int>(r.feed.size()) + static_cast<int>(g->generation.tokens.size()))
        result.pending.push_back(g->generation.tokens.back());
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
    m.seconds = since(r.t0);
    return m;
  }

  std::unique_ptr<Session> new_session(Runtime& rt, const StepSpec& step) {
    if (opts_.mode == RunMode::qkvshare) {
      const std::string& kv = wf_.agents.at(step.agent).kv;
      return new_pooled_session(*pool_, *rt.engine, KvFormat::parse(kv.empty() ? opts_.kv : kv), opts_.context);
    }
    return std::make_unique<Session>(
        std::make_unique<PooledKvCache>(rt.private_pool, KvFormat::parse("f16"), opts_.context));
  }

  // Seals the step's context and grants it to each step that builds on it;
  // the grants alone keep it alive (the producer's claim is dropped at once).
  void hand_over(const StepSpec& step, const Session& session, StepResult& result) {
    std::vector<std::string> consumers;
    for (const auto& s : wf_.steps)
      if (const StepInput* in = s.context_input(); in != nullptr && in->from == step.id) consumers.push_back(s.id);
    if (consumers.empty()) return;
    const SealedContext sealed = seal_session(*pool_, *runtime(step.agent).engine, fingerprint_, session, step.id);
    for (const auto& c : consumers) result.grants.emplace(c, pool_->grant(sealed, step.id, c));
    pool_->release(sealed);
    if (tiers_) tiers_->add(step.id, result.grants, position_);
  }

  // Text outputs are plain strings; nothing to release for them. Context
  // grants are released by their consumers as they open them.
  void release_finished_inputs(const StepSpec&) {}

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
};

}  // namespace

RunReport run_workflow(const Workflow& workflow, const std::string& model_path, const std::string& tokenizer_path,
                       const RunOptions& options) {
  if (options.mode == RunMode::solo) return run_solo(workflow, model_path, tokenizer_path, options);
  Run run(workflow, model_path, tokenizer_path, options);
  return run.run();
}

}  // namespace qkvshare::agents
