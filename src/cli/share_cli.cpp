#include "share_cli.hpp"

#include <cstdio>
#include <filesystem>
#include <optional>

#include "common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"

namespace qkvshare::cli {

void add_share_args(CLI::App& cmd, ShareArgs& a) {
  CLI::Option* pool = cmd.add_option("--pool", a.pool, "Shared pool (`qkvshare pool serve --name NAME`) to keep the KV in");
  cmd.add_option("--publish", a.publish, "After generating, seal the context and write a descriptor here "
                                         "(one per --grant: OUT.<grantee> when there are several)");
  cmd.add_option("--from", a.from, "Continue from this descriptor (the prompt is appended to its context)");
  cmd.add_option("--agent", a.agent, "This agent's id (producer with --publish, grantee with --from)");
  cmd.add_option("--grant", a.grants, "Agent id the published context is granted to (repeatable: a fork)");
  cmd.add_option("--handoff", a.handoff, "auto (KV, else text), kv (KV or fail), text (re-encode)")
      ->check(CLI::IsMember({"auto", "kv", "text"}));
  cmd.add_option("--pool-format", a.format, "KV format of a session in the pool (kv/kv_format.hpp syntax)")
      ->needs(pool);  // without a pool it would be ignored, unchecked
  cmd.add_flag("--verify", a.verify, "--from: rehash every block before using the KV");
  cmd.add_flag("--keep", a.keep, "--from: keep the grant (the descriptor stays valid) instead of releasing it");
}

ShareRun::ShareRun(const ShareArgs& a, const Model& model, Engine& engine, int ctx) : args_(a) {
  const bool sharing = !a.publish.empty() || !a.from.empty();
  if (a.pool.empty()) {
    if (sharing) fail(ErrorCode::invalid_argument, "--publish and --from need --pool NAME");
    return;
  }
  if (sharing && a.agent.empty()) fail(ErrorCode::invalid_argument, "--publish and --from need --agent ID");
  if (!a.agent.empty()) validate_agent_id(a.agent, "--agent");
  if (!a.publish.empty() && a.grants.empty()) fail(ErrorCode::invalid_argument, "--publish needs --grant AGENT");
  for (std::size_t i = 0; i < a.grants.size(); ++i) {
    validate_agent_id(a.grants[i], "--grant");
    for (std::size_t j = 0; j < i; ++j)
      if (a.grants[j] == a.grants[i]) fail(ErrorCode::invalid_argument, "--grant: '{}' is named twice", a.grants[i]);
  }
  for (const std::string& g : a.grants)  // before the work whose handoff they would carry
    check_output_file(a.grants.size() == 1 ? a.publish : a.publish + "." + g, "--publish");
  const KvFormat format = KvFormat::parse(a.format);  // a bad --pool-format fails before any work
  check_codebook(format, model);
  fingerprint_ = model_fingerprint(model);
  pool_ = SharePool::attach(a.pool);
  report_["pool"] = a.pool;
  if (a.from.empty()) return;
  from_ = read_descriptor_file(a.from);
  HandoffOptions o;
  o.mode = parse_handoff_mode(a.handoff);
  o.verify = a.verify;
  o.capacity = ctx;
  opened_ = open_session(*pool_, engine, fingerprint_, from_, a.agent, o);
  report_["from"] = {{"context_id", from_.context_id},
                     {"tokens", from_.token_count},
                     {"mode", opened_.kv ? "kv" : "text"},
                     {"fallback", opened_.kv ? nlohmann::json(nullptr) : nlohmann::json(to_string(opened_.fallback))},
                     {"prefill_tokens", opened_.prefill_tokens},
                     {"open_seconds", opened_.seconds}};
  if (opened_.kv)
    std::fprintf(stderr, "handoff: continuing context %llu (%u tokens) on its KV, opened in %.1f us\n",
                 static_cast<unsigned long long>(from_.context_id), from_.token_count, opened_.seconds * 1e6);
  else
    std::fprintf(stderr, "handoff: text mode for context %llu (%s%s%s): re-encoded %d tokens in %.3f s\n",
                 static_cast<unsigned long long>(from_.context_id), std::string(to_string(opened_.fallback)).c_str(),
                 opened_.detail.empty() ? "" : ": ", opened_.detail.c_str(), opened_.prefill_tokens, opened_.seconds);
}

std::vector<TokenId> ShareRun::prompt(const Tokenizer& tok, const std::string& text, const ChatTemplate* chat,
                                      const std::vector<TokenId>& fresh) const {
  if (!continuing()) return fresh;
  if (chat != nullptr) {
    const ChatMessage turn[] = {{"user", text}};
    return tok.encode(chat->format(turn, true), /*parse_special=*/true);
  }
  return tok.encode(text);
}

std::unique_ptr<Session> ShareRun::session(Engine& engine, int ctx) {
  if (opened_.session) return std::move(opened_.session);
  if (pool_) return new_pooled_session(*pool_, engine, KvFormat::parse(args_.format), ctx);
  return engine.new_session(ctx);
}

// A descriptor this agent published earlier into the same pool, at the path a
// new one is about to overwrite; once overwritten nobody could release its grant.
std::optional<Descriptor> ShareRun::own_descriptor_at(const std::string& path) const {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return std::nullopt;
  try {
    Descriptor d = read_descriptor_file(path);
    if (d.pool_id == pool_->pool_id() && d.producer == args_.agent) return d;
  } catch (const Error&) {
    // Not a descriptor (or unreadable): nothing of this pool to end.
  }
  return std::nullopt;
}

void ShareRun::release_replaced(const Descriptor& old, const std::string& path) {
  try {
    pool_->release(old, old.grantee);
    std::fprintf(stderr, "handoff: %s held context %llu for '%s'; that grant is released\n", path.c_str(),
                 static_cast<unsigned long long>(old.context_id), old.grantee.c_str());
  } catch (const Error&) {
    // Released or revoked already: the file was stale.
  }
}

void ShareRun::finish(Engine& engine, Session& session, const GenerateResult& r) {
  if (!pool_) return;
  if (!args_.from.empty() && !args_.keep) {
    // The producer may have revoked the context while this consumer worked:
    // the answer is made and stays reported; only the release had nothing left to end.
    try {
      pool_->release(from_, args_.agent);
    } catch (const Error& e) {
      std::fprintf(stderr, "handoff: warning: releasing %s: %s\n", args_.from.c_str(), e.what());
    }
  }
  if (args_.publish.empty()) return;
  // generate() leaves its last sampled token outside the context (it needed
  // no forward pass); the consumer must see it, so feed it first.
  const int limit = std::min(engine.model().config().context_length, session.cache().capacity());
  if (r.stop_reason != StopReason::end_of_generation && !r.tokens.empty() && session.n_past() < limit)
    engine.forward(session, std::vector<TokenId>{r.tokens.back()});
  const SealedContext sealed = seal_session(*pool_, engine, fingerprint_, session, args_.agent);
  nlohmann::json out = nlohmann::json::array();
  std::vector<Descriptor> granted;
  try {
    for (const std::string& g : args_.grants) {
      granted.push_back(pool_->grant(sealed, args_.agent, g));
      const std::string path = args_.grants.size() == 1 ? args_.publish : args_.publish + "." + g;
      const std::optional<Descriptor> replaced = own_descriptor_at(path);
      write_descriptor_file(path, granted.back());
      if (replaced) release_replaced(*replaced, path);
      out.push_back({{"grantee", g}, {"path", path}});
      std::fprintf(stderr, "handoff: published context %llu (%d tokens) to '%s' in %s\n",
                   static_cast<unsigned long long>(sealed.context_id), sealed.tokens, g.c_str(), path.c_str());
    }
  } catch (...) {
    // No grant without its descriptor: a grantee could never open or release it.
    for (const Descriptor& d : granted) pool_->revoke(d, args_.agent);
    pool_->release(sealed);
    throw;
  }
  pool_->release(sealed);  // the grants keep it now
  report_["published"] = {{"context_id", sealed.context_id}, {"tokens", sealed.tokens}, {"descriptors", out}};
}

}  // namespace qkvshare::cli
