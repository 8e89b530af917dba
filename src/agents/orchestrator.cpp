#include "qkvshare/agents/orchestrator.hpp"

#include <chrono>
#include <map>
#include <memory>
#include <set>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/generate.hpp"
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
  }
  return "?";
}

RunMode parse_run_mode(std::string_view text) {
  if (text == "independent") return RunMode::independent;
  if (text == "shared-text") return RunMode::shared_text;
  if (text == "qkvshare") return RunMode::qkvshare;
  fail(ErrorCode::invalid_argument, "--mode: '{}' is not a mode (independent, shared-text, qkvshare)", text);
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

class Run {
 public:
  Run(const Workflow& wf, const std::string& model_path, const std::string& tok_path, const RunOptions& opts)
      : wf_(wf), opts_(opts) {
    const auto t0 = Clock::now();
    if (opts.mode == RunMode::independent) {
      // Each agent that runs a step is its own engine with its own weights.
      for (const auto& s : wf.steps) {
        if (runtimes_.count(s.agent)) continue;
        runtimes_[s.agent] = load(model_path, tok_path, MappedFile::Mode::private_copy, true);
        report_.weight_copies_bytes += runtimes_[s.agent]->model->weight_bytes();
      }
    } else {
      shared_ = load(model_path, tok_path, MappedFile::Mode::shared, opts.mode == RunMode::shared_text);
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
    if (!opts.force_reference.empty()) {
      trace_ = ReferenceTrace::load(opts.force_reference);
      forcing_ = true;
    }
    report_.load_seconds = since(t0);
    report_.workflow = wf.name;
    report_.mode = opts.mode;
    report_.kv = opts.mode == RunMode::qkvshare ? opts.kv : text_kv();
  }

  RunReport run() {
    const auto t0 = Clock::now();
    int index = 0;
    for (std::size_t p = 0; p < wf_.order.size(); ++p)
      position_[wf_.steps[static_cast<std::size_t>(wf_.order[p])].id] = static_cast<int>(p);
    for (int i : wf_.order) {
      const StepSpec& step = wf_.steps[static_cast<std::size_t>(i)];
      progress(fmt::format("[{}/{}] {} ({}): running", ++index, wf_.steps.size(), step.id, step.agent));
      if (tiers_) tiers_->step_started(index - 1);  // prefetch what the next step needs
      StepMetrics m = run_step(step);
      if (tiers_) tiers_->step_finished(index - 1);  // evict until the budget holds
      progress(fmt::format("[{}/{}] {}: {} | prefill {} computed, {} reused | {} new tokens | ttft {:.3f} s | {:.2f} s",
                           index, wf_.steps.size(), step.id, m.handoff, m.prefill_computed, m.prefill_reused,
                           m.decode_tokens, m.ttft_seconds, m.seconds));
      report_.prefill_computed += m.prefill_computed;
      report_.prefill_reused += m.prefill_reused;
      report_.steps.push_back(std::move(m));
      release_finished_inputs(step);
    }
    report_.total_seconds = since(t0);
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
  std::unique_ptr<Runtime> load(const std::string& path, const std::string& tok, MappedFile::Mode mode,
                                bool private_pool) {
    auto r = std::make_unique<Runtime>();
    r->model = Model::load(path, tok, mode);
    EngineOptions eo;
    eo.n_threads = opts_.threads;
    eo.exact_matmul = opts_.exact_matmul;
    r->engine = std::make_unique<Engine>(*r->model, eo);
    if (private_pool) {
      PoolConfig pc;
      pc.shape = r->engine->kv_shape();
      pc.capacity_bytes = KvPool::arena_bytes_for(pc.shape, pc.block_tokens, KvFormat::parse(text_kv()), opts_.context, 2);
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

  std::size_t live_kv_bytes(const Session& current) const {
    if (pool_) return pool_->stats().kv.bytes_used;
    const auto* pooled = dynamic_cast<const PooledKvCache*>(&current.cache());
    return pooled != nullptr ? pooled->kv_bytes() : 0;
  }

  StepMetrics run_step(const StepSpec& step) {
    const auto t0 = Clock::now();
    const AgentSpec& agent = wf_.agents.at(step.agent);
    Runtime& rt = runtime(step.agent);
    const Tokenizer& tok = rt.model->tokenizer();
    const TurnFormat turns(*rt.model);
    StepMetrics m;
    m.step = step.id;
    m.agent = step.agent;
    const std::string prompt = render_prompt(wf_, step, outputs_);

    std::unique_ptr<Session> session;
    std::vector<TokenId> feed;
    std::string transcript;
    StepResult result;
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

    GenerateOptions go;
    go.max_new_tokens = opts_.max_tokens_cap > 0 ? std::min(agent.max_tokens, opts_.max_tokens_cap) : agent.max_tokens;
    go.sampling = agent.sampling;
    go.stop_strings = agent.stop;
    if (feed.empty()) {
      m.ttft_seconds = since(t0);
    } else {
      const int n0 = session->n_past();
      QualitySum quality;
      GenerateResult g;
      const auto forced = forcing_ ? trace_.steps.find(step.id) : trace_.steps.end();
      if (forced != trace_.steps.end()) {  // equal work: the reference run's tokens
        const TraceStep& ref = forced->second;
        std::size_t i = 0;
        g = generate_forced(*rt.engine, *session, feed, ref.tokens, [&](std::span<const float> logits) {
          quality.add(&ref.logprobs[i * logits.size()], logits, ref.tokens[i]);
          ++i;
        });
      } else {
        TraceStep rec;
        if (!opts_.record_reference.empty())
          go.on_logits = [&](std::span<const float> logits) {
            const std::size_t at = rec.logprobs.size();
            rec.logprobs.resize(at + logits.size());
            std::vector<float> row;
            log_softmax(logits, row);
            std::copy(row.begin(), row.end(), rec.logprobs.begin() + static_cast<std::ptrdiff_t>(at));
          };
        g = generate(*rt.engine, *session, feed, go);
        if (!opts_.record_reference.empty()) {
          const std::size_t vocab = static_cast<std::size_t>(rt.model->config().vocab_size);
          rec.tokens = g.tokens;
          rec.logprobs.resize(g.tokens.size() * vocab);  // not the row that sampled the end of generation
          for (std::size_t i = 0; i < g.tokens.size(); ++i) {
            std::vector<float> row(rec.logprobs.begin() + static_cast<std::ptrdiff_t>(i * vocab),
                                   rec.logprobs.begin() + static_cast<std::ptrdiff_t>((i + 1) * vocab));
            std::vector<float> logits(row.begin(), row.end());
            quality.add(row.data(), logits, g.tokens[i]);  // its own PPL; KL 0, top-1 1
          }
          trace_.vocab = static_cast<int>(vocab);
          trace_.steps[step.id] = std::move(rec);
        }
      }
      if (quality.n > 0) {
        m.kl = quality.kl / quality.n;
        m.top1 = static_cast<double>(quality.same) / quality.n;
        m.nll = quality.nll / quality.n;
        m.scored_tokens = quality.n;
      }
      m.ttft_seconds = m.handoff_seconds + g.prefill_seconds;
      m.prefill_computed += g.prefill_tokens;
      m.decode_tokens = static_cast<int>(g.tokens.size());
      m.output_tokens = g.tokens;
      m.output = g.text;
      result.reply = g.tokens;
      result.reply_begin = n0 + static_cast<int>(feed.size());
      result.reply_in_kv = session->n_past() - result.reply_begin;
      // The last sampled token has no KV yet; a continuing consumer feeds it.
      if (!g.tokens.empty() &&
          session->n_past() < n0 + static_cast<int>(feed.size()) + static_cast<int>(g.tokens.size()))
        result.pending.push_back(g.tokens.back());
    }
    result.output = m.output;
    result.transcript = transcript + m.output;
    m.kv_bytes = live_kv_bytes(*session);
    report_.peak_kv_bytes = std::max(report_.peak_kv_bytes, m.kv_bytes);

    if (pool_) hand_over(step, *session, result);
    session.reset();
    if (pool_) report_.peak_kv_bytes = std::max(report_.peak_kv_bytes, pool_->stats().kv.bytes_used);
    outputs_[step.id] = result.output;
    results_[step.id] = std::move(result);
    m.seconds = since(t0);
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
  ReferenceTrace trace_;  // recorded (record_reference) or forced (force_reference)
  bool forcing_ = false;
};

}  // namespace

RunReport run_workflow(const Workflow& workflow, const std::string& model_path, const std::string& tokenizer_path,
                       const RunOptions& options) {
  Run run(workflow, model_path, tokenizer_path, options);
  return run.run();
}

}  // namespace qkvshare::agents
