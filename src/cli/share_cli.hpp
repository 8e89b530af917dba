#pragma once
// `qkvshare generate` in a shared pool: --pool NAME puts the session's KV in
// the pool; --publish OUT --agent A --grant B seals the context after
// generating and writes B's descriptor; --from IN --agent B continues from a
// descriptor without re-reading its text (or falls back to text, and says so).
#include <CLI/CLI.hpp>

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "qkvshare/engine/generate.hpp"
#include "qkvshare/share/handoff.hpp"

namespace qkvshare::cli {

struct ShareArgs {
  std::string pool, publish, from, agent, handoff = "auto", format = "f16";
  std::vector<std::string> grants;
  bool verify = false, keep = false;
};

void add_share_args(CLI::App& cmd, ShareArgs& args);

class ShareRun {
 public:
  // Checks the flags, attaches the pool and, with --from, opens the descriptor.
  ShareRun(const ShareArgs& args, const Model& model, Engine& engine, int ctx);
  bool continuing() const noexcept { return opened_.session != nullptr; }
  // The prompt's ids: appended to the opened context (no BOS) or a fresh
  // prompt. `chat`: the model's chat template, when the prompt is a chat turn.
  std::vector<TokenId> prompt(const Tokenizer& tok, const std::string& text, const ChatTemplate* chat,
                              const std::vector<TokenId>& fresh) const;
  // The session to generate in: handed off, in the pool, or the engine's own.
  std::unique_ptr<Session> session(Engine& engine, int ctx);
  // After generate(): --publish seals and grants; --from releases the grant.
  void finish(Engine& engine, Session& session, const GenerateResult& result);
  nlohmann::json json() const { return report_; }
  bool active() const noexcept { return pool_ != nullptr; }

 private:
  std::optional<Descriptor> own_descriptor_at(const std::string& path) const;
  void release_replaced(const Descriptor& old, const std::string& path);

  const ShareArgs& args_;
  std::shared_ptr<SharePool> pool_;
  ModelFingerprint fingerprint_;
  Descriptor from_;
  HandoffResult opened_;
  nlohmann::json report_ = nlohmann::json::object();
};

}  // namespace qkvshare::cli
