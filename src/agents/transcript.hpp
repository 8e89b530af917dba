#pragma once
// How agent turns become text: ChatML when the model's vocabulary has
// <|im_start|> (SmolLM2, Qwen2), plain lines otherwise (stories260K).
#include <string>

#include "qkvshare/agents/workflow.hpp"
#include "qkvshare/model/tokenizer.hpp"

namespace qkvshare::agents {

class TurnFormat {
 public:
  explicit TurnFormat(const Tokenizer& tok);
  // The opening of a fresh context: system and user turns, then the assistant's start.
  std::string open(const std::string& system, const std::string& user) const;
  // open() in two halves around the user turn's content:
  // open(s, u) == open_user(s) + u + close_user().
  std::string open_user(const std::string& system) const;
  std::string close_user() const;
  // Appended to an existing transcript that ends with an assistant reply.
  std::string append(const std::string& system, const std::string& user) const;
  bool chatml() const noexcept { return chatml_; }

 private:
  std::string turn(const std::string& role, const std::string& content) const;
  bool chatml_;
};

// Fills {task}, {inputs}, {output:STEP} and {doc:NAME}. Text inputs the
// template does not place are put before it.
std::string render_prompt(const Workflow& wf, const StepSpec& step, const std::map<std::string, std::string>& outputs);

}  // namespace qkvshare::agents
