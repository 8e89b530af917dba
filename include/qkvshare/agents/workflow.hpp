#pragma once
// Workflow files: agents (role, prompt template, generation settings, KV
// format) and steps forming a DAG whose edges carry a handoff mode. The
// schema is documented in docs/workflows.md; examples live in examples/.
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "qkvshare/engine/sampler.hpp"

namespace qkvshare::agents {

enum class HandoffMode {
  text,       // re-encode the upstream output as text (the baseline)
  continue_,  // append to the upstream context itself: exact, exclusive
  fork,       // branch from the upstream context, shared with other forks
  splice,     // insert the upstream reply's KV into this agent's own context (own system prompt):
              // position shift + selective recompute, under the quality guard (engine/splice.hpp)
};
std::string_view to_string(HandoffMode mode) noexcept;

struct AgentSpec {
  std::string name;
  std::string system;           // system message of the agent's role
  std::string prompt;           // template: {task}, {inputs}, {output:STEP}, {doc:NAME}
  int max_tokens = 128;         // 0: read the prompt only (e.g. ingest a document)
  SamplingParams sampling;      // temperature 0 (greedy) unless set
  std::vector<std::string> stop;
  std::string kv;               // KV format name; empty: the run's default
  int line = 0;
};

struct StepInput {
  std::string from;  // upstream step id
  HandoffMode mode = HandoffMode::text;
  double recompute = 0.15;  // splice: fraction of the spliced tokens recomputed under this agent's prefix
  // splice: which tokens of the producer's context: its reply (default), its
  // prompt (the user turn it read, e.g. a document), or both.
  bool splice_prompt = false, splice_reply = true;
  int line = 0;
};

struct StepSpec {
  std::string id;
  std::string agent;
  std::string prompt;  // overrides the agent's template when set
  std::vector<StepInput> inputs;
  int line = 0;

  // The input whose context this step builds on (continue or fork), if any.
  const StepInput* context_input() const;
  bool splices() const;  // has a splice input
};

struct Workflow {
  std::string name;
  std::string task;  // fills {task}
  std::map<std::string, std::string> documents;  // fills {doc:NAME}; loaded from files next to the workflow
  std::string source;  // file name, for messages
  std::map<std::string, AgentSpec> agents;
  std::vector<StepSpec> steps;   // as written
  std::vector<int> order;        // steps in a dependency order

  const StepSpec& step(const std::string& id) const;
  // How many later steps read step `id`'s output or context.
  int consumer_count(const std::string& id) const;

  // Returns the text of a document named in `documents:` (the file as written there).
  using DocumentReader = std::function<std::string(const std::string& file)>;
  // Parses and validates; throws Error(bad_workflow) with "<source>:<line>: <reason>".
  // Documents are read from files next to `source`, or through `read` when given
  // (a workflow compiled into the binary with its documents).
  static Workflow parse(const std::string& yaml_text, const std::string& source = "<workflow>",
                        const DocumentReader& read = {});
  static Workflow load(const std::string& path);
};

}  // namespace qkvshare::agents
