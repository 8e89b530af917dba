#pragma once
// Runs one workflow in several modes side by side, each in a child process
// so that its peak RSS (getrusage of the child: VmHWM, every page it touched,
// weights included) is its own. The work is equal: the first mode is the
// reference (text re-prefill with f32 KV, greedy); every other mode is
// teacher-forced along the reference's tokens, so each one generates the same
// token stream, and its quality is measured along it per consumer step: mean
// KL(p_reference || p_mode), top-1 agreement and PPL of the forced tokens.
#include <string>
#include <vector>

#include "qkvshare/agents/orchestrator.hpp"

namespace qkvshare::agents {

struct ModeSpec {
  RunMode mode = RunMode::qkvshare;
  std::string kv = "f16";
  std::string label() const;  // "independent", "shared-text", "qkvshare:int8", ...
};

// The default comparison: shared-text with f32 KV (the reference),
// independent, shared-text (f16), qkvshare with f16, int8, int4 and int2 KV,
// then solo (one agent writing the same answers: the team overhead's denominator).
std::vector<ModeSpec> default_comparison();
// "shared-text:f32,independent,qkvshare:int8" -> specs; Error(invalid_argument) naming a bad item.
std::vector<ModeSpec> parse_mode_specs(const std::string& text);

struct ComparedRun {
  ModeSpec spec;
  RunReport report;
  std::size_t peak_rss_bytes = 0;
  double agreement = 0;         // tokens equal to the reference run's, over all steps (1 when forced)
  double consumer_ttft = 0;     // mean time to first token of steps that have upstream inputs
  // Over the consumer steps' forced tokens (the reference scores itself: KL 0, top-1 1).
  double kl = 0, top1 = 0, ppl = 0;
  // Team overhead: this run's e2e time, peak RSS and peak KV over the solo run's (0 without one).
  double team_time = 0, team_rss = 0, team_kv = 0;
};

std::vector<ComparedRun> compare_modes(const Workflow& wf, const std::string& model_path,
                                       const std::string& tokenizer_path, const RunOptions& base,
                                       const std::vector<ModeSpec>& modes);

// A fixed-width table of the comparison.
std::string format_comparison(const std::vector<ComparedRun>& runs);
std::string comparison_json(const std::vector<ComparedRun>& runs);

}  // namespace qkvshare::agents
