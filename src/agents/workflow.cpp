#include "qkvshare/agents/workflow.hpp"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"

namespace qkvshare::agents {

std::string_view to_string(HandoffMode mode) noexcept {
  switch (mode) {
    case HandoffMode::text: return "text";
    case HandoffMode::continue_: return "continue";
    case HandoffMode::fork: return "fork";
    case HandoffMode::splice: return "splice";
  }
  return "?";
}

const StepInput* StepSpec::context_input() const {
  for (const auto& in : inputs)
    if (in.mode == HandoffMode::continue_ || in.mode == HandoffMode::fork) return &in;
  return nullptr;
}

bool StepSpec::splices() const {
  for (const auto& in : inputs)
    if (in.mode == HandoffMode::splice) return true;
  return false;
}

const StepSpec& Workflow::step(const std::string& id) const {
  for (const auto& s : steps)
    if (s.id == id) return s;
  fail(ErrorCode::invalid_argument, "{}: no step '{}'", source, id);
}

int Workflow::consumer_count(const std::string& id) const {
  int n = 0;
  for (const auto& s : steps)
    for (const auto& in : s.inputs) n += in.from == id ? 1 : 0;
  return n;
}

namespace {

class Parser {
 public:
  explicit Parser(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void error(const YAML::Node& node, const std::string& what) const {
    const int line = node.IsDefined() ? node.Mark().line + 1 : 0;
    if (line > 0) fail(ErrorCode::bad_workflow, "{}:{}: {}", source_, line, what);
    fail(ErrorCode::bad_workflow, "{}: {}", source_, what);
  }

  // YAML forbids a key twice in one mapping, but yaml-cpp keeps both and one
  // of them would win silently.
  void unique_keys(const YAML::Node& map, const std::string& where) const {
    std::set<std::string> seen;
    for (const auto& kv : map)
      if (!seen.insert(key(kv.first, where)).second) error(kv.first, "'" + key(kv.first, where) + "' appears twice in " + where);
  }

  // A mapping's key as a name: YAML allows a list or a mapping as a key ("? [a, b]"), a workflow does not.
  std::string key(const YAML::Node& k, const std::string& where) const {
    if (!k.IsScalar()) error(k, "a key in " + where + " must be a plain name, not a list or mapping");
    return k.Scalar();
  }

  void only_keys(const YAML::Node& map, const std::set<std::string>& allowed, const std::string& where) const {
    unique_keys(map, where);
    for (const auto& kv : map) {
      const auto key = this->key(kv.first, where);
      if (!allowed.count(key)) {
        std::string list;
        for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
        error(kv.first, "unknown field '" + key + "' in " + where + " (allowed: " + list + ")");
      }
    }
  }

  template <typename T>
  T scalar(const YAML::Node& node, const std::string& what) const {
    if (!node.IsScalar()) error(node, what + " must be a scalar");
    try {
      return node.as<T>();
    } catch (const YAML::Exception&) {
      error(node, what + ": '" + node.Scalar() + "' has the wrong type");
    }
  }

  AgentSpec agent(const std::string& name, const YAML::Node& n) const {
    if (!n.IsMap()) error(n, "agent '" + name + "' must be a mapping");
    only_keys(n, {"role", "system", "prompt", "max_tokens", "temperature", "top_k", "top_p", "min_p",
                  "repeat_penalty", "seed", "stop", "kv"},
              "agent '" + name + "'");
    AgentSpec a;
    a.name = name;
    a.line = n.Mark().line + 1;
    a.sampling.temperature = 0.0f;
    if (n["system"]) a.system = scalar<std::string>(n["system"], "system");
    if (n["role"] && a.system.empty()) a.system = "You are the " + scalar<std::string>(n["role"], "role") + ".";
    if (n["prompt"]) a.prompt = scalar<std::string>(n["prompt"], "prompt");
    if (n["max_tokens"]) {
      a.max_tokens = scalar<int>(n["max_tokens"], "max_tokens");
      if (a.max_tokens < 0 || a.max_tokens > 1 << 20) error(n["max_tokens"], "max_tokens must be in [0, 1048576]");
    }
    if (n["temperature"]) a.sampling.temperature = scalar<float>(n["temperature"], "temperature");
    if (n["top_k"]) a.sampling.top_k = scalar<int>(n["top_k"], "top_k");
    if (n["top_p"]) a.sampling.top_p = scalar<float>(n["top_p"], "top_p");
    if (n["min_p"]) a.sampling.min_p = scalar<float>(n["min_p"], "min_p");
    if (n["repeat_penalty"]) a.sampling.repeat_penalty = scalar<float>(n["repeat_penalty"], "repeat_penalty");
    if (n["seed"]) a.sampling.seed = scalar<std::uint64_t>(n["seed"], "seed");
    if (n["kv"]) a.kv = scalar<std::string>(n["kv"], "kv");
    if (n["stop"]) {
      if (!n["stop"].IsSequence()) error(n["stop"], "stop must be a list of strings");
      for (const auto& s : n["stop"]) a.stop.push_back(scalar<std::string>(s, "stop"));
    }
    try {
      a.sampling.validate();
    } catch (const Error& e) {
      error(n, "agent '" + name + "': " + e.what());
    }
    return a;
  }

  StepInput input(const YAML::Node& n) const {
    StepInput in;
    in.line = n.Mark().line + 1;
    if (n.IsScalar()) {  // shorthand: "- research" means a text input
      in.from = n.as<std::string>();
      return in;
    }
    if (!n.IsMap()) error(n, "an input must be a step id or a mapping {from, mode}");
    only_keys(n, {"from", "mode", "recompute", "span"}, "input");
    if (!n["from"]) error(n, "input needs 'from'");
    in.from = scalar<std::string>(n["from"], "from");
    if (n["mode"]) {
      const auto mode = scalar<std::string>(n["mode"], "mode");
      if (mode == "text") in.mode = HandoffMode::text;
      else if (mode == "continue") in.mode = HandoffMode::continue_;
      else if (mode == "fork") in.mode = HandoffMode::fork;
      else if (mode == "splice") in.mode = HandoffMode::splice;
      else error(n["mode"], "unknown handoff mode '" + mode + "' (text, continue, fork, splice)");
    }
    if (n["recompute"]) {
      if (in.mode != HandoffMode::splice) error(n["recompute"], "'recompute' applies to mode splice only");
      const auto r = scalar<double>(n["recompute"], "recompute");
      if (!(r >= 0.0 && r <= 1.0))
        error(n["recompute"], "recompute must be a fraction from 0 to 1 (0.15 recomputes 15% of the spliced tokens)");
      in.recompute = r;
    }
    if (n["span"]) {
      if (in.mode != HandoffMode::splice) error(n["span"], "'span' applies to mode splice only");
      const auto span = scalar<std::string>(n["span"], "span");
      if (span == "reply") in.splice_prompt = false;
      else if (span == "prompt") in.splice_prompt = true, in.splice_reply = false;
      else if (span == "both") in.splice_prompt = true;
      else error(n["span"], "unknown span '" + span + "' (reply, prompt, both)");
    }
    return in;
  }

  StepSpec step(const YAML::Node& n) const {
    if (!n.IsMap()) error(n, "a step must be a mapping");
    only_keys(n, {"id", "agent", "prompt", "inputs"}, "step");
    StepSpec s;
    s.line = n.Mark().line + 1;
    if (!n["id"]) error(n, "step needs 'id'");
    if (!n["agent"]) error(n, "step needs 'agent'");
    s.id = scalar<std::string>(n["id"], "id");
    s.agent = scalar<std::string>(n["agent"], "agent");
    if (n["prompt"]) s.prompt = scalar<std::string>(n["prompt"], "prompt");
    if (n["inputs"]) {
      if (!n["inputs"].IsSequence()) error(n["inputs"], "inputs must be a list");
      for (const auto& in : n["inputs"]) s.inputs.push_back(input(in));
    }
    return s;
  }

 private:
  std::string source_;
};

// Checks that every {placeholder} in step's template is one the orchestrator
// fills: {output:X} only for a step X that this step reads (its output exists
// by then).
void check_template(const std::string& source, int line, const std::string& text, const StepSpec& step,
                    const std::set<std::string>& step_ids, const std::map<std::string, std::string>& docs) {
  for (std::size_t pos = text.find('{'); pos != std::string::npos; pos = text.find('{', pos + 1)) {
    const std::size_t end = text.find('}', pos);
    if (end == std::string::npos) fail(ErrorCode::bad_workflow, "{}:{}: unclosed '{{' in prompt", source, line);
    const std::string name = text.substr(pos + 1, end - pos - 1);
    if (name == "task" || name == "inputs") continue;
    if (name.rfind("output:", 0) == 0 && step_ids.count(name.substr(7))) {
      const std::string from = name.substr(7);
      const bool reads = std::any_of(step.inputs.begin(), step.inputs.end(), [&](const StepInput& in) { return in.from == from; });
      if (reads) continue;
      fail(ErrorCode::bad_workflow, "{}:{}: step '{}' uses '{{{}}}' but does not read step '{}' (add it to its inputs)",
           source, line, step.id, name, from);
    }
    if (name.rfind("doc:", 0) == 0 && docs.count(name.substr(4))) continue;
    fail(ErrorCode::bad_workflow,
         "{}:{}: unknown placeholder '{{{}}}' (use {{task}}, {{inputs}}, {{output:STEP}} or {{doc:NAME}})", source,
         line, name);
  }
}

void validate(Workflow& w) {
  const std::string& src = w.source;
  std::set<std::string> ids;
  for (const auto& s : w.steps) {
    // Step ids double as the agent ids that descriptors are granted to.
    const bool id_ok = !s.id.empty() && s.id.size() <= 32 &&
                       s.id.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:@-") ==
                           std::string::npos;
    if (!id_ok)
      fail(ErrorCode::bad_workflow, "{}:{}: step id '{}' must be 1-32 characters of A-Z a-z 0-9 _ . : @ -", src, s.line,
           s.id);
    if (!ids.insert(s.id).second) fail(ErrorCode::bad_workflow, "{}:{}: duplicate step id '{}'", src, s.line, s.id);
    if (!w.agents.count(s.agent))
      fail(ErrorCode::bad_workflow, "{}:{}: step '{}' uses unknown agent '{}'", src, s.line, s.id, s.agent);
  }
  std::map<std::string, int> continued;
  for (const auto& s : w.steps) {
    int context_inputs = 0;
    std::set<std::string> seen;
    for (const auto& in : s.inputs) {
      if (!ids.count(in.from))
        fail(ErrorCode::bad_workflow, "{}:{}: step '{}' reads unknown step '{}'", src, in.line, s.id, in.from);
      if (in.from == s.id) fail(ErrorCode::bad_workflow, "{}:{}: step '{}' reads itself", src, in.line, s.id);
      if (!seen.insert(in.from).second)
        fail(ErrorCode::bad_workflow, "{}:{}: step '{}' reads '{}' twice", src, in.line, s.id, in.from);
      const bool context = in.mode == HandoffMode::continue_ || in.mode == HandoffMode::fork;
      if (context && w.step(in.from).splices())
        fail(ErrorCode::bad_workflow, "{}:{}: step '{}' cannot {} '{}', whose context holds spliced segments: splice its reply",
             src, in.line, s.id, to_string(in.mode), in.from);
      if (in.mode == HandoffMode::splice && in.splice_prompt &&
          (w.step(in.from).splices() || w.step(in.from).context_input() != nullptr))
        fail(ErrorCode::bad_workflow, "{}:{}: step '{}' splices the prompt of '{}', which does not start a context of its own",
             src, in.line, s.id, in.from);
      if (context && ++context_inputs > 1)
        fail(ErrorCode::bad_workflow, "{}:{}: step '{}' builds on more than one context (one continue/fork input at most)",
             src, in.line, s.id);
      if (in.mode == HandoffMode::splice && s.context_input() != nullptr)
        fail(ErrorCode::bad_workflow, "{}:{}: step '{}' splices into its own context, so it cannot also continue or fork one",
             src, in.line, s.id);
      if (in.mode == HandoffMode::continue_ && ++continued[in.from] > 1)
        fail(ErrorCode::bad_workflow, "{}:{}: context of '{}' is continued by several steps: use mode fork", src,
             in.line, in.from);
    }
    const AgentSpec& a = w.agents.at(s.agent);
    const std::string& prompt = s.prompt.empty() ? a.prompt : s.prompt;
    if (prompt.empty())
      fail(ErrorCode::bad_workflow, "{}:{}: step '{}' has no prompt (set one on the step or agent '{}')", src, s.line,
           s.id, s.agent);
    check_template(src, s.prompt.empty() ? a.line : s.line, prompt, s, ids, w.documents);
  }
  // Kahn's algorithm, keeping the written order among ready steps.
  std::map<std::string, int> indegree;
  for (const auto& s : w.steps) indegree[s.id] = static_cast<int>(s.inputs.size());
  std::vector<bool> done(w.steps.size(), false);
  for (bool progress = true; progress;) {
    progress = false;
    for (std::size_t i = 0; i < w.steps.size(); ++i) {
      if (done[i] || indegree[w.steps[i].id] != 0) continue;
      done[i] = true;
      progress = true;
      w.order.push_back(static_cast<int>(i));
      for (const auto& t : w.steps)
        for (const auto& in : t.inputs)
          if (in.from == w.steps[i].id) --indegree[t.id];
    }
  }
  if (w.order.size() != w.steps.size()) {
    std::string cycle;
    for (std::size_t i = 0; i < w.steps.size(); ++i)
      if (!done[i]) cycle += (cycle.empty() ? "" : ", ") + w.steps[i].id;
    fail(ErrorCode::bad_workflow, "{}: the steps form a cycle: {}", src, cycle);
  }
}

}  // namespace

namespace {

std::string read_text_file(const std::string& path) {
  check_regular_file(path, "file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::io, "{}: cannot open", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string directory_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

}  // namespace

namespace {
Workflow parse_tree(const YAML::Node& root, const std::string& source, const Workflow::DocumentReader& read);
}  // namespace

Workflow Workflow::parse(const std::string& yaml_text, const std::string& source, const DocumentReader& read) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::DeepRecursion& e) {  // its own message is yaml-cpp's "bad file"
    fail(ErrorCode::bad_workflow, "{}:{}: YAML nested {} levels deep, past the reader's limit", source, e.mark.line + 1, e.depth());
  } catch (const YAML::ParserException& e) {
    fail(ErrorCode::bad_workflow, "{}:{}: YAML syntax error: {}", source, e.mark.line + 1, e.msg);
  }
  try {
    return parse_tree(root, source, read);
  } catch (const YAML::Exception& e) {
    // A shape the checks above did not foresee: still the file's error, with its line.
    fail(ErrorCode::bad_workflow, "{}:{}: {}", source, e.mark.line + 1, e.msg);
  }
}

namespace {
Workflow parse_tree(const YAML::Node& root, const std::string& source, const Workflow::DocumentReader& read) {
  Parser p(source);
  if (!root.IsMap()) fail(ErrorCode::bad_workflow, "{}: a workflow must be a mapping with agents and steps", source);
  p.only_keys(root, {"name", "task", "documents", "agents", "steps"}, "the workflow");
  Workflow w;
  w.source = source;
  if (root["name"]) w.name = p.scalar<std::string>(root["name"], "name");
  if (root["task"]) w.task = p.scalar<std::string>(root["task"], "task");
  if (const YAML::Node docs = root["documents"]) {
    if (!docs.IsMap()) p.error(docs, "'documents' must map names to files");
    p.unique_keys(docs, "'documents'");
    for (const auto& kv : docs) {
      const auto file = p.scalar<std::string>(kv.second, "document");
      try {
        w.documents[p.key(kv.first, "'documents'")] =
            read ? read(file) : read_text_file(file.rfind('/', 0) == 0 ? file : directory_of(source) + "/" + file);
      } catch (const Error& e) {
        p.error(kv.second, std::string("document: ") + e.what());
      }
    }
  }
  const YAML::Node agents = root["agents"];
  if (!agents || !agents.IsMap() || agents.size() == 0) p.error(root, "'agents' must be a non-empty mapping");
  p.unique_keys(agents, "'agents'");
  for (const auto& kv : agents) {
    const auto name = p.key(kv.first, "'agents'");
    w.agents.emplace(name, p.agent(name, kv.second));
  }
  const YAML::Node steps = root["steps"];
  if (!steps || !steps.IsSequence() || steps.size() == 0) p.error(root, "'steps' must be a non-empty list");
  for (const auto& s : steps) w.steps.push_back(p.step(s));
  validate(w);
  return w;
}
}  // namespace

Workflow Workflow::load(const std::string& path) {
  check_regular_file(path, "workflow file");
  std::ifstream in(path);
  if (!in) fail(ErrorCode::io, "{}: cannot open workflow file", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path);
}

}  // namespace qkvshare::agents
