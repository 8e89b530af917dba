#include "qkvshare/agents/demo_workflow.hpp"

#include <algorithm>
#include <regex>

#include "qkvshare/core/error.hpp"
#include "qkvshare/model/tokenizer.hpp"

namespace qkvshare::agents {

namespace embedded {  // build/generated/demo_workflow_text.cpp (src/CMakeLists.txt)
extern const char kDemoWorkflowYaml[];
extern const char kDemoDocumentName[];
extern const char kDemoDocumentText[];
}  // namespace embedded

namespace {

constexpr const char* kSourceDocument = "source";
constexpr int kTurnOverhead = 8;  // chat-template tokens around one turn
constexpr int kMargin = 16;

// Offsets just past each sentence's full stop or line (a heading), and the end of the text.
std::vector<std::size_t> sentence_ends(const std::string& text) {
  std::vector<std::size_t> ends;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const bool stop = text[i] == '.' && (i + 1 == text.size() || text[i + 1] == ' ' || text[i + 1] == '\n');
    if (text[i] == '\n' || stop) ends.push_back(i + 1);
  }
  if (ends.empty() || ends.back() < text.size()) ends.push_back(text.size());
  return ends;
}

int count_tokens(const Tokenizer& tok, const std::string& text) { return static_cast<int>(tok.encode(text).size()); }

}  // namespace

Workflow demo_workflow() {
  return Workflow::parse(embedded::kDemoWorkflowYaml, "<built-in demo: examples/w4_roles.yaml>",
                         [](const std::string& file) -> std::string {
                           if (file != embedded::kDemoDocumentName)
                             fail(ErrorCode::bad_workflow, "built-in demo: no document '{}' is compiled in", file);
                           return embedded::kDemoDocumentText;
                         });
}

SourceFit fit_demo_source(Workflow& wf, const Tokenizer& tok, int context, int max_tokens_cap) {
  std::string& source = wf.documents.at(kSourceDocument);
  // What every mode's largest context holds besides the source: each step's
  // prompt (its template, placeholders left out) and reply, one system prompt.
  static const std::regex placeholder(R"(\{[a-z]+(:[A-Za-z0-9_]+)?\})");
  int fixed = kMargin, longest_system = 0;
  for (const StepSpec& s : wf.steps) {
    const AgentSpec& agent = wf.agents.at(s.agent);
    const std::string& prompt = s.prompt.empty() ? agent.prompt : s.prompt;
    const int reply = max_tokens_cap > 0 ? std::min(agent.max_tokens, max_tokens_cap) : agent.max_tokens;
    fixed += count_tokens(tok, std::regex_replace(prompt, placeholder, "")) + reply + kTurnOverhead;
    longest_system = std::max(longest_system, count_tokens(tok, agent.system));
  }
  fixed += longest_system;
  const std::vector<std::size_t> ends = sentence_ends(source);
  SourceFit fit;
  fit.total_sentences = static_cast<int>(ends.size());
  fit.total_tokens = count_tokens(tok, source);
  // Token counts grow with the prefix: the longest prefix that fits, by bisection.
  int lo = 0, hi = fit.total_sentences;
  int kept_tokens = 0;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    const int n = count_tokens(tok, source.substr(0, ends[static_cast<std::size_t>(mid - 1)]));
    if (fixed + n <= context) {
      lo = mid;
      kept_tokens = n;
    } else {
      hi = mid - 1;
    }
  }
  fit.kept_sentences = lo;
  fit.kept_tokens = lo == fit.total_sentences ? fit.total_tokens : kept_tokens;
  if (fit.cut()) source.resize(lo == 0 ? 0 : ends[static_cast<std::size_t>(lo - 1)]);
  return fit;
}

}  // namespace qkvshare::agents
