#pragma once
// Runs a workflow's DAG in dependency order on one device, in one of three
// ways that share the same prompts, so their costs compare directly:
//  - independent: every agent is its own engine with its own private copy of
//    the weights and its own f16 KV cache; handoffs re-encode the upstream
//    transcript as text (multi-agent apps on llama.cpp today);
//  - shared_text: one engine for all agents, text handoffs;
//  - qkvshare: one engine, KV in a shared pool; continue/fork edges hand the
//    sealed context over as a descriptor and the consumer appends to it.
// Text edges (a step reading another's output inside its prompt) are text in
// every mode.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "qkvshare/agents/workflow.hpp"
#include "qkvshare/engine/splice.hpp"
#include "qkvshare/model/tokenizer.hpp"
#include "qkvshare/tiers/context_tiers.hpp"

namespace qkvshare::agents {

//  - solo: not a team at all, the denominator of the team overhead: one agent
//    in one session (f16 KV) reads the material once and writes every step's
//    answer itself, sequentially (solo_run.cpp).
enum class RunMode { independent, shared_text, qkvshare, solo };
std::string_view to_string(RunMode mode) noexcept;
RunMode parse_run_mode(std::string_view text);  // Error(invalid_argument) naming it

struct RunOptions {
  RunMode mode = RunMode::qkvshare;
  std::string kv = "int8";  // KV format of new contexts in qkvshare mode (an agent's `kv` overrides)
  int threads = 0;
  int context = 4096;       // token capacity of a session
  int max_tokens_cap = 0;   // > 0: no agent generates more (small models with short contexts)
  // Float activations in every matmul (EngineOptions::exact_matmul): slow; isolates what the KV
  // formats change from the 8-bit activation rounding, which amplifies any perturbation.
  bool exact_matmul = false;
  // The SIMD kernels with float activations (EngineOptions::float_activations):
  // weights dequantized to f32 once per engine, counted in weight_copies_bytes.
  bool float_activations = false;
  std::string text_kv = "f16";  // KV format of shared-text mode (the comparison's reference uses f32)
  // Equal work: record each step's tokens and distributions to this file, or
  // force the tokens of such a file and score against it (compare_modes).
  std::string record_reference, force_reference;
  SpliceOptions splice;     // the guard of splice edges (each edge's `recompute` replaces splice.recompute)
  // Steps whose inputs are ready run at once through the engine's scheduler
  // (their decode tokens share forward passes); false: one step at a time.
  // Independent mode is always one at a time (separate engines), and so is a
  // run under a KV budget (the budget holds between steps, when no session is live).
  bool concurrent = true;
  int token_budget = 256;   // tokens per scheduler pass (prompt chunks + decode tokens), <= max_batch
  std::function<void(const std::string&)> progress;  // one line per event, for stderr
  // qkvshare mode: a pool byte budget for contexts at rest, with disk spill
  // and prefetch (tiers/context_tiers.hpp); budget_bytes 0 turns it off.
  TierOptions tiers;
  // qkvshare mode: the pool's lease (ShareConfig::lease_ms): a holder idle
  // this long gives its context up to the tiers first.
  int lease_ms = 30000;
};

struct StepMetrics {
  std::string step, agent;
  std::string handoff;        // "new", "text", "continue", "fork", or "fallback:<reason>"
  double start_seconds = 0;   // when the step started, from the start of the run
  double ttft_seconds = 0;    // step start to the first generated token (handoff included)
  double seconds = 0;         // the whole step, from its own start (concurrent steps overlap)
  double handoff_seconds = 0; // opening the upstream context
  int prefill_computed = 0;   // tokens run through the model before the first new token
  int prefill_reused = 0;     // upstream tokens whose KV was reused instead
  int decode_tokens = 0;
  std::size_t kv_bytes = 0;   // KV bytes of this step's context when it ends (shared blocks included)
  // Splice inputs (qkvshare mode): tokens spliced, of them recomputed, tokens
  // the guard's probes ran, its largest estimate, the largest recompute
  // fraction used, and how often it raised the fraction or went to text.
  int splice_tokens = 0, splice_recomputed = 0, guard_probe_tokens = 0;
  double guard_estimate = -1, recompute_fraction = -1;
  int guard_raised = 0, guard_text = 0;
  // Along the reference's tokens (teacher forcing, -1 when not measured): mean
  // KL(p_reference || p_this_run), top-1 agreement, mean NLL of the tokens.
  double kl = -1, top1 = -1, nll = -1;
  int scored_tokens = 0;
  std::vector<TokenId> output_tokens;
  std::string output;
};

struct RunReport {
  std::string workflow;
  RunMode mode = RunMode::qkvshare;
  std::string kv;  // KV format ("f16" for the text baselines)
  std::vector<StepMetrics> steps;
  double total_seconds = 0;
  double load_seconds = 0;
  std::size_t peak_kv_bytes = 0;       // KV bytes held at once, at the worst moment
  std::size_t weight_copies_bytes = 0; // weight bytes this run holds in memory (f32 copies included)
  int prefill_computed = 0;
  int prefill_reused = 0;
  int contexts_alive_at_end = 0;       // sealed contexts left in the pool (0 when lifetimes are right)
  std::size_t pool_blocks_used_at_end = 0;
  std::uint64_t forward_passes = 0;    // scheduler passes (concurrent steps share them)
  TierStats tiers;                     // what the budget moved (RunOptions::tiers)
  int splices = 0, guard_raised = 0, guard_text = 0;  // splice counters over the run
  std::string json() const;
  static RunReport from_json(const std::string& text);
};

// Loads the model (once, or once per agent in independent mode) and runs.
RunReport run_workflow(const Workflow& workflow, const std::string& model_path, const std::string& tokenizer_path,
                       const RunOptions& options);

// RunMode::solo (solo_run.cpp); run_workflow calls it for that mode.
RunReport run_solo(const Workflow& workflow, const std::string& model_path, const std::string& tokenizer_path,
                   const RunOptions& options);

// Fraction of positions where `got` has the same token as `want`, over the
// longer of the two (a missing token counts as a mismatch).
double token_agreement(const std::vector<TokenId>& want, const std::vector<TokenId>& got);

}  // namespace qkvshare::agents
