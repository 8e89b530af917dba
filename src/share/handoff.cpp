#include "qkvshare/share/handoff.hpp"

#include <chrono>

#include "qkvshare/core/clock.hpp"
#include "qkvshare/core/error.hpp"

namespace qkvshare {

HandoffMode parse_handoff_mode(std::string_view text) {
  if (text == "auto") return HandoffMode::automatic;
  if (text == "kv") return HandoffMode::kv;
  if (text == "text") return HandoffMode::text;
  fail(ErrorCode::invalid_argument, "handoff mode '{}' is not one of auto, kv, text", text);
}

std::unique_ptr<Session> new_pooled_session(SharePool& pool, const Engine& engine, const KvFormat& format,
                                            int capacity) {
  if (capacity <= 0) capacity = engine.model().config().context_length;
  return std::make_unique<Session>(
      std::make_unique<PooledKvCache>(pool.kv_pool(engine.kv_shape()), format, capacity));
}

SealedContext seal_session(SharePool& pool, const Engine& engine, const ModelFingerprint& fingerprint,
                           const Session& session, std::string_view producer) {
  const auto* cache = dynamic_cast<const PooledKvCache*>(&session.cache());
  if (cache == nullptr) fail(ErrorCode::invalid_argument, "seal: the session's KV is not in a shared pool");
  const std::string text = engine.model().tokenizer().decode(session.tokens());
  return pool.seal(*cache, session.tokens(), text, fingerprint, producer);
}

HandoffResult open_session(SharePool& pool, Engine& engine, const ModelFingerprint& fingerprint, const Descriptor& d,
                           std::string_view agent, const HandoffOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const int capacity = options.capacity > 0 ? options.capacity : engine.model().config().context_length;
  HandoffResult result;
  // Reasons known before touching the pool.
  std::string detail;
  FallbackReason why = FallbackReason::none;
  if (options.mode == HandoffMode::text) {
    why = FallbackReason::requested;
  } else if (d.fingerprint.model != fingerprint.model) {
    why = FallbackReason::model;
    detail = fmt::format("the context was made by model {}, this is {}", d.fingerprint.hex(), fingerprint.hex());
  } else if (!d.format()) {
    why = FallbackReason::format;
    detail = fmt::format("KV codecs {:#x}/{:#x} are unknown to this build", d.k_codec, d.v_codec);
  } else {
    try {
      pool.kv_pool(engine.kv_shape());
    } catch (const Error& e) {
      if (e.code() != ErrorCode::invalid_argument) throw;
      why = FallbackReason::shape;
      detail = e.what();
    }
  }
  const bool want_kv = why == FallbackReason::none;
  if (!want_kv && options.mode == HandoffMode::kv)
    fail(ErrorCode::bad_descriptor, "context {} cannot be continued on its KV: {}{}{}", d.context_id, to_string(why),
         detail.empty() ? "" : ": ", detail);
  OpenedContext opened = pool.open(d, agent, want_kv, capacity, options.verify, options.use);
  if (opened.cache) {
    opened.cache->set_rope(engine.rope());  // an evicted or spliced context reads its segments moved
    result.session = std::make_unique<Session>(std::move(opened.cache), std::move(opened.tokens));
    result.kv = true;
    result.seconds = seconds_since(t0);
    return result;
  }
  if (want_kv) {
    why = opened.refused;
    detail = opened.refused_detail;
    if (options.mode == HandoffMode::kv)
      fail(ErrorCode::bad_descriptor, "context {} cannot be continued on its KV: {}: {}", d.context_id, to_string(why),
           detail);
  }

  // Text mode: the same token ids when the tokenizer is the same, else the text.
  const Tokenizer& tok = engine.model().tokenizer();
  std::vector<TokenId> ids;
  if (d.fingerprint.tokenizer == fingerprint.tokenizer) {
    ids = std::move(opened.tokens);
  } else {
    if (opened.text.empty())
      fail(ErrorCode::unsupported, "context {}: cannot fall back to text ({}): its text was not stored", d.context_id,
           to_string(why));
    if (tok.add_bos()) ids.push_back(tok.bos_id());
    const auto body = tok.encode(opened.text);
    ids.insert(ids.end(), body.begin(), body.end());
  }
  if (ids.empty()) fail(ErrorCode::invalid_argument, "context {}: nothing to re-encode", d.context_id);
  const std::optional<KvFormat> format = d.format();
  try {
    result.session = new_pooled_session(pool, engine, format.value_or(KvFormat{}), capacity);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::invalid_argument) throw;
    result.session = engine.new_session(capacity);  // the pool holds another model's KV
  }
  engine.forward(*result.session, ids);
  result.fallback = why;
  result.detail = detail;
  result.prefill_tokens = static_cast<int>(ids.size());
  pool.count(why);
  result.seconds = seconds_since(t0);
  return result;
}

}  // namespace qkvshare
