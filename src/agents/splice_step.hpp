#pragma once
// A step that splices its inputs (workflow mode `splice`): its context is
//   [its own system prompt and user opening]
//   for each spliced input: ["[STEP]\n"][the producer's prompt and/or reply tokens, each + "\n\n"]
//   [its own prompt, then the assistant opening]
// In qkvshare mode the replies' KV is spliced from the producers' sealed
// contexts (engine/splice.hpp: offset, recompute, guard); in the text modes
// the same token ids are prefilled, so every mode reads the same tokens.
#include <memory>
#include <string>
#include <vector>

#include "qkvshare/engine/splice.hpp"
#include "qkvshare/share/handoff.hpp"
#include "transcript.hpp"

namespace qkvshare::agents {

// A run of the producer's tokens: its prompt or its reply.
struct SplicePart {
  std::vector<TokenId> ids;
  int begin = 0;  // index of ids[0] in the producer's sealed context
  int in_kv = 0;  // leading ids that context holds KV for (a reply's last token may have none yet)
};

struct SpliceInput {
  std::string from;
  double recompute = 0.15;
  const Descriptor* grant = nullptr;  // qkvshare mode: the producer's context, granted to this step
  std::vector<SplicePart> parts;      // each one placed as "[STEP]\n" part "\n\n"
};

struct PreparedSplice {
  std::vector<TokenId> feed;  // tokens still to prefill before the first new token
  std::string transcript;
  double seconds = 0;         // building the context (prefix, splices, recompute, guard)
  int computed = 0;           // tokens run through the model while building it (probes included)
  int reused = 0;             // spliced tokens read at an offset from the producers' blocks
  int spliced = 0, recomputed = 0, probe_tokens = 0;
  double estimate = -1;       // the guard's largest estimate over the inputs
  double fraction = -1;       // the largest recompute fraction used
  int splices = 0;            // token runs spliced
  int raised = 0, to_text = 0, fallbacks = 0;  // guard decisions, and inputs whose KV could not be opened
  std::string handoff;        // "splice", "text" or "fallback:<reason>"
};

// Fills `session` (empty) with the step's context up to its own prompt and
// returns what is left to prefill. `pool` is null in the text modes.
PreparedSplice prepare_splice_step(Engine& engine, Session& session, SharePool* pool, const ModelFingerprint& fp,
                                   const TurnFormat& turns, const std::string& system, const std::string& prompt,
                                   const std::string& step_id, const std::vector<SpliceInput>& inputs,
                                   const SpliceOptions& guard, int capacity);

}  // namespace qkvshare::agents
