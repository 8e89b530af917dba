#pragma once
// Runs one workflow in several modes side by side, each in a child process
// so that its peak RSS (getrusage of the child: VmHWM, every page it touched,
// weights included) is its own, and compares each run's outputs with the
// f32-KV QKVShare run.
#include <string>
#include <vector>

#include "qkvshare/agents/orchestrator.hpp"

namespace qkvshare::agents {

struct ModeSpec {
  RunMode mode = RunMode::qkvshare;
  std::string kv = "f16";
  std::string label() const;  // "independent", "shared-text", "qkvshare:int8", ...
};

// The default comparison: independent, shared-text, qkvshare with f32 (the
// reference), f16, int8, int4 and int2 KV, then solo (for the team overhead;
// its answers are as long as the reference run's).
std::vector<ModeSpec> default_comparison();

struct ComparedRun {
  ModeSpec spec;
  RunReport report;
  std::size_t peak_rss_bytes = 0;
  double agreement = 0;         // greedy tokens equal to the reference run, over all steps
  double consumer_ttft = 0;     // mean time to first token of steps that have upstream inputs
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
