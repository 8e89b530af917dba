#include "transcript.hpp"

#include "qkvshare/core/error.hpp"

namespace qkvshare::agents {

std::string TurnFormat::open(const std::string& system, const std::string& user) const {
  std::vector<ChatMessage> turns;
  if (!system.empty()) turns.push_back({"system", system});
  turns.push_back({"user", user});
  return tmpl_.format(turns, /*add_generation_prompt=*/true);
}

// The template is applied to a marker in place of the user's content and cut
// around it, so the two halves hold for every chat template the model layer knows.
namespace {
constexpr const char* kUserMark = "\x01qkvshare-user-content\x01";
std::pair<std::string, std::string> split_user(const TurnFormat& f, const std::string& system) {
  const std::string full = f.open(system, kUserMark);
  const std::size_t at = full.find(kUserMark);
  QKV_CHECK(at != std::string::npos);
  return {full.substr(0, at), full.substr(at + std::char_traits<char>::length(kUserMark))};
}
}  // namespace

std::string TurnFormat::open_user(const std::string& system) const { return split_user(*this, system).first; }

std::string TurnFormat::close_user() const { return split_user(*this, "").second; }

std::string TurnFormat::append(const std::string& system, const std::string& user) const {
  // The previous reply is still open: close it, then open the new turn.
  return tmpl_.close_reply() + open(system, user);
}

std::string render_prompt(const Workflow& wf, const StepSpec& step, const std::map<std::string, std::string>& outputs) {
  const AgentSpec& agent = wf.agents.at(step.agent);
  const std::string& tmpl = step.prompt.empty() ? agent.prompt : step.prompt;
  std::string inputs;
  for (const auto& in : step.inputs) {
    if (in.mode != HandoffMode::text) continue;
    inputs += "[" + in.from + "]\n" + outputs.at(in.from) + "\n\n";
  }
  std::string out;
  bool placed_inputs = false;
  for (std::size_t pos = 0; pos < tmpl.size();) {
    const std::size_t open = tmpl.find('{', pos);
    if (open == std::string::npos) {
      out += tmpl.substr(pos);
      break;
    }
    const std::size_t close = tmpl.find('}', open);
    QKV_CHECK(close != std::string::npos);  // the parser checked every placeholder
    out += tmpl.substr(pos, open - pos);
    const std::string name = tmpl.substr(open + 1, close - open - 1);
    if (name == "task") {
      out += wf.task;
    } else if (name == "inputs") {
      out += inputs;
      placed_inputs = true;
    } else if (name.rfind("output:", 0) == 0) {
      const auto it = outputs.find(name.substr(7));
      QKV_CHECK(it != outputs.end());
      out += it->second;
    } else if (name.rfind("doc:", 0) == 0) {
      out += wf.documents.at(name.substr(4));
    }
    pos = close + 1;
  }
  return placed_inputs || inputs.empty() ? out : inputs + out;
}

}  // namespace qkvshare::agents
