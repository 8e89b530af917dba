// RunMode::solo, the denominator of the team overhead: ONE agent in ONE
// session (f16 KV) reads the workflow's material once and writes every
// step's answer itself, one after the other. Each step's turn is its prompt
// with the other steps' outputs left out (the agent wrote them above, in its
// own context). With a reference trace (RunOptions::force_reference, as the
// comparison gives every mode) it writes exactly the reference run's answers,
// token for token, so both sides decode the same tokens.
#include <chrono>

#include "qkvshare/agents/orchestrator.hpp"
#include "qkvshare/core/clock.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/generate.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "reference_trace.hpp"
#include "transcript.hpp"

namespace qkvshare::agents {

RunReport run_solo(const Workflow& wf, const std::string& model_path, const std::string& tokenizer_path,
                   const RunOptions& opts) {
  using Clock = std::chrono::steady_clock;
  RunReport report;
  report.workflow = wf.name;
  report.mode = RunMode::solo;
  report.kv = "f16";
  const auto t_load = Clock::now();
  auto model = Model::load(model_path, tokenizer_path, MappedFile::Mode::shared);
  EngineOptions eo;
  eo.n_threads = opts.threads;
  eo.exact_matmul = opts.exact_matmul;
  eo.float_activations = opts.float_activations;
  Engine engine(*model, eo);
  report.weight_copies_bytes = model->weight_bytes() + engine.float_copy_bytes();
  // Everything in one context: room for every step's share of it.
  const int capacity = std::min(model->config().context_length,
                                opts.context * std::max<int>(2, static_cast<int>(wf.steps.size())));
  PoolConfig pc;
  pc.shape = engine.kv_shape();
  pc.capacity_bytes = KvPool::arena_bytes_for(pc.shape, pc.block_tokens, KvFormat::parse("f16"), capacity, 1);
  auto pool = KvPool::create(pc);
  Session session(std::make_unique<PooledKvCache>(pool, KvFormat::parse("f16"), capacity));
  report.load_seconds = seconds_since(t_load);
  const ReferenceTrace trace =
      opts.force_reference.empty() ? ReferenceTrace{} : ReferenceTrace::load(opts.force_reference);

  const Tokenizer& tok = model->tokenizer();
  const TurnFormat turns(*model);
  std::map<std::string, std::string> nothing;
  for (const auto& s : wf.steps) nothing[s.id] = "";
  std::string last_system;
  std::vector<TokenId> pending;
  const auto t0 = Clock::now();
  for (int i : wf.order) {
    const StepSpec& step = wf.steps[static_cast<std::size_t>(i)];
    const AgentSpec& agent = wf.agents.at(step.agent);
    const auto ts = Clock::now();
    StepMetrics m;
    m.step = step.id;
    m.agent = step.agent;
    m.handoff = "solo";
    m.start_seconds = std::chrono::duration<double>(ts - t0).count();
    const std::string system = agent.system == last_system ? "" : agent.system;
    if (!agent.system.empty()) last_system = agent.system;
    const std::string prompt = render_prompt(wf, step, nothing);
    std::vector<TokenId> feed = pending;
    if (session.n_past() == 0 && tok.add_bos() && tok.bos_id() >= 0) feed.push_back(tok.bos_id());
    const auto ids = tok.encode(session.n_past() == 0 ? turns.open(system, prompt) : turns.append(system, prompt), true);
    feed.insert(feed.end(), ids.begin(), ids.end());
    const auto forced = trace.steps.find(step.id);  // the reference run's answer, when given
    const GenerateOptions go =
        step_generate_options(agent, opts.max_tokens_cap, forced != trace.steps.end() ? &forced->second : nullptr);
    const int n0 = session.n_past();
    const GenerateResult g = generate(engine, session, feed, go);
    m.ttft_seconds = seconds_since(ts) - g.decode_seconds;
    m.prefill_computed = g.prefill_tokens;
    m.decode_tokens = static_cast<int>(g.tokens.size());
    m.output_tokens = g.tokens;
    m.output = g.text;
    pending.clear();
    if (!g.tokens.empty() && session.n_past() < n0 + static_cast<int>(feed.size() + g.tokens.size()))
      pending.push_back(g.tokens.back());
    m.kv_bytes = static_cast<const PooledKvCache&>(session.cache()).kv_bytes();
    m.seconds = seconds_since(ts);
    report.prefill_computed += m.prefill_computed;
    report.peak_kv_bytes = std::max(report.peak_kv_bytes, pool->counters().bytes_used);
    if (opts.progress)
      opts.progress(fmt::format("[solo] {}: {} prompt tokens, {} new tokens, {:.2f} s", step.id, m.prefill_computed,
                                m.decode_tokens, m.seconds));
    report.steps.push_back(std::move(m));
    if (g.stop_reason == StopReason::context_full) break;  // the rest does not fit one context
  }
  report.total_seconds = seconds_since(t0);
  report.forward_passes = 0;
  return report;
}

}  // namespace qkvshare::agents
