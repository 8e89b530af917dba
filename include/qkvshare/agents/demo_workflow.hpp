#pragma once
// The README's main job: examples/w4_roles.yaml (a researcher, a writer and a
// reviewer, each with its own system prompt, on a ~1,500-token source text,
// every edge a splice), compiled into the binary with its source text.
#include "qkvshare/agents/workflow.hpp"

namespace qkvshare {
class Tokenizer;
}

namespace qkvshare::agents {

Workflow demo_workflow();

// How much of the demo's source text a context holds.
struct SourceFit {
  int kept_tokens = 0, total_tokens = 0;
  int kept_sentences = 0, total_sentences = 0;
  bool cut() const { return kept_sentences < total_sentences; }
};

// Cuts the demo's source after the last whole sentence that leaves room, in a
// context of `context` tokens, for the replies (capped at `max_tokens_cap`
// when > 0, as run --max-tokens does), the prompts and the longest system
// prompt: the largest context a mode builds (solo: one session of all three
// turns) then fits. So the demo runs on short-context models too (stories260K:
// 512 tokens). An estimate with a margin: a run that still does not fit fails
// with the engine's context error.
SourceFit fit_demo_source(Workflow& wf, const Tokenizer& tok, int context, int max_tokens_cap);

}  // namespace qkvshare::agents
