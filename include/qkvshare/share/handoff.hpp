#pragma once
// Handoff between agents at the engine level: seal a session's context,
// and open a descriptor as a session that continues from the exact state
// (tokens, positions, KV) without re-reading or copying anything. When the
// consumer cannot use the KV (another model, an unknown format, a checksum
// mismatch, a pool of another shape) it falls back to text mode on its own:
// the context's tokens (or, for another tokenizer, its text) are prefilled
// again, and the reason is reported and counted.
#include <memory>
#include <string>
#include <string_view>

#include "qkvshare/engine/engine.hpp"
#include "qkvshare/share/share_pool.hpp"

namespace qkvshare {

enum class HandoffMode { automatic, kv, text };
HandoffMode parse_handoff_mode(std::string_view text);  // "auto", "kv", "text"

struct HandoffOptions {
  HandoffMode mode = HandoffMode::automatic;
  bool verify = false;  // rehash every block before using the KV
  int capacity = 0;     // tokens the session may hold (0: the model's context length)
  GrantUse use = GrantUse::hold;  // copy: read the context without taking the grant's custody
};

struct HandoffResult {
  std::unique_ptr<Session> session;
  bool kv = false;                        // continued on the producer's blocks
  FallbackReason fallback = FallbackReason::none;
  std::string detail;                     // why, in words
  int prefill_tokens = 0;                 // tokens re-encoded by the fallback
  double seconds = 0.0;
};

// A session whose KV lives in the pool, in `format`.
std::unique_ptr<Session> new_pooled_session(SharePool& pool, const Engine& engine, const KvFormat& format,
                                            int capacity = 0);

// Seals `session` (whose cache must be a PooledKvCache of `pool`). Note that
// after generate() the last sampled token is not in the session yet: feed it
// first when the consumer should see it.
SealedContext seal_session(SharePool& pool, const Engine& engine, const ModelFingerprint& fingerprint,
                           const Session& session, std::string_view producer);

// Opens `d` for `agent` as a session of `engine`. Error(bad_descriptor) for a
// descriptor this pool rejects (forged, stale, another grantee or pool); in
// HandoffMode::kv also when the KV cannot be used.
HandoffResult open_session(SharePool& pool, Engine& engine, const ModelFingerprint& fingerprint, const Descriptor& d,
                           std::string_view agent, const HandoffOptions& options = {});

}  // namespace qkvshare
