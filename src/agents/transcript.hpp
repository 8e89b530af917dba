#pragma once
// How agent turns become text: the model's own chat template (Model::chat_template:
// ChatML for SmolLM2, Llama-3, Gemma, ... plain lines for stories260K).
#include <string>

#include "qkvshare/agents/workflow.hpp"
#include "qkvshare/model/model.hpp"

namespace qkvshare::agents {

class TurnFormat {
 public:
  explicit TurnFormat(const Model& model) : tmpl_(model.chat_template()) {}
  // The opening of a fresh context: system and user turns, then the assistant's start.
  std::string open(const std::string& system, const std::string& user) const;
  // open() in two halves around the user turn's content:
  // open(s, u) == open_user(s) + u + close_user().
  std::string open_user(const std::string& system) const;
  std::string close_user() const;
  // Appended to an existing transcript that ends with an assistant reply.
  std::string append(const std::string& system, const std::string& user) const;
  const ChatTemplate& chat_template() const noexcept { return tmpl_; }

 private:
  ChatTemplate tmpl_;
};

// Fills {task}, {inputs}, {output:STEP} and {doc:NAME}. Text inputs the
// template does not place are put before it.
std::string render_prompt(const Workflow& wf, const StepSpec& step, const std::map<std::string, std::string>& outputs);

}  // namespace qkvshare::agents
