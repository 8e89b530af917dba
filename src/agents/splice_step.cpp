#include "splice_step.hpp"

#include <algorithm>
#include <chrono>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/clock.hpp"

namespace qkvshare::agents {

PreparedSplice prepare_splice_step(Engine& engine, Session& session, SharePool* pool, const ModelFingerprint& fp,
                                   const TurnFormat& turns, const std::string& system, const std::string& prompt,
                                   const std::string& step_id, const std::vector<SpliceInput>& inputs,
                                   const SpliceOptions& guard, int capacity) {
  const auto t0 = std::chrono::steady_clock::now();
  const Tokenizer& tok = engine.model().tokenizer();
  PreparedSplice out;
  out.handoff = pool != nullptr ? "splice" : "text";
  std::vector<TokenId>& pending = out.feed;  // ids not in the KV yet
  const auto add = [&](const std::string& text) {
    const auto ids = tok.encode(text, true);
    pending.insert(pending.end(), ids.begin(), ids.end());
    out.transcript += text;
  };
  if (tok.add_bos() && tok.bos_id() >= 0) pending.push_back(tok.bos_id());
  add(turns.open_user(system));
  for (const SpliceInput& in : inputs) {
    add("[" + in.from + "]\n");
    OpenedContext oc;
    std::string why;
    if (pool != nullptr && in.grant != nullptr) {
      if (in.grant->fingerprint.model != fp.model) {
        why = "model";
      } else {
        oc = pool->open(*in.grant, step_id, true, capacity);
        if (!oc.cache) why = std::string(to_string(oc.refused));
      }
      pool->release(*in.grant, step_id);  // the consumer's cache takes its own block references
      if (!oc.cache) {
        ++out.fallbacks;
        out.handoff = "fallback:" + why;
      }
    }
    for (const SplicePart& part : in.parts) {
      out.transcript += tok.decode(part.ids);
      std::size_t placed = 0;  // ids whose KV came from the producer
      if (oc.cache && part.in_kv > 0) {
        if (!pending.empty()) {
          out.computed += static_cast<int>(pending.size());
          engine.forward(session, pending);
          pending.clear();
        }
        SpliceOptions so = guard;
        so.recompute = in.recompute;
        const SpliceResult r = splice_tokens(engine, session, *oc.cache, oc.tokens, part.begin, part.begin + part.in_kv, so);
        placed = static_cast<std::size_t>(part.in_kv);
        out.spliced += r.tokens;
        out.recomputed += r.recomputed;
        out.reused += r.reused;
        out.probe_tokens += r.probe_tokens;
        out.computed += r.recomputed + r.probe_tokens;
        out.estimate = std::max(out.estimate, r.estimate);
        out.fraction = std::max(out.fraction, r.fraction);
        out.raised += r.escalated && !r.text ? 1 : 0;
        out.to_text += r.text ? 1 : 0;
        ++out.splices;
      }
      pending.insert(pending.end(), part.ids.begin() + static_cast<std::ptrdiff_t>(placed), part.ids.end());
      add("\n\n");
    }
  }
  add(prompt + turns.close_user());
  out.seconds = seconds_since(t0);
  return out;
}

}  // namespace qkvshare::agents
