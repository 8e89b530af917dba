#include "qkvshare/model/chat_template.hpp"

#include "qkvshare/core/error.hpp"

namespace qkvshare {

namespace {

constexpr ChatFamily kFamilies[] = {ChatFamily::chatml, ChatFamily::qwen3,   ChatFamily::llama3, ChatFamily::gemma,
                                    ChatFamily::phi3,   ChatFamily::mistral, ChatFamily::plain};

bool has(std::string_view s, std::string_view what) { return s.find(what) != std::string_view::npos; }

// Gemma and Mistral have no system role: their templates put the system
// text in front of the first user message, separated by a blank line.
std::vector<ChatMessage> fold_system(std::span<const ChatMessage> messages) {
  std::vector<ChatMessage> out;
  std::string pending;
  for (const ChatMessage& m : messages) {
    if (m.role == "system") {
      pending += m.content + "\n\n";
      continue;
    }
    out.push_back(m);
    if (m.role == "user" && !pending.empty()) {
      out.back().content = pending + out.back().content;
      pending.clear();
    }
  }
  if (!pending.empty()) out.push_back({"user", pending});
  return out;
}

}  // namespace

std::string_view chat_family_name(ChatFamily f) noexcept {
  switch (f) {
    case ChatFamily::chatml: return "chatml";
    case ChatFamily::qwen3: return "qwen3";
    case ChatFamily::llama3: return "llama3";
    case ChatFamily::gemma: return "gemma";
    case ChatFamily::phi3: return "phi3";
    case ChatFamily::mistral: return "mistral";
    case ChatFamily::plain: return "plain";
  }
  return "?";
}

ChatFamily parse_chat_family(std::string_view name) {
  std::string names;
  for (ChatFamily f : kFamilies) {
    if (chat_family_name(f) == name) return f;
    names += (names.empty() ? "" : ", ") + std::string(chat_family_name(f));
  }
  fail(ErrorCode::invalid_argument, "chat template '{}' is not one of {}", name, names);
}

std::optional<ChatFamily> detect_chat_family(std::string_view t) {
  // Most specific markers first: Qwen3 is ChatML plus reasoning tags.
  if (has(t, "<|im_start|>")) return has(t, "<think>") ? ChatFamily::qwen3 : ChatFamily::chatml;
  if (has(t, "<|start_header_id|>")) return ChatFamily::llama3;
  if (has(t, "<start_of_turn>")) return ChatFamily::gemma;
  if (has(t, "<|assistant|>") && has(t, "<|end|>")) return ChatFamily::phi3;
  if (has(t, "[INST]")) return ChatFamily::mistral;
  return std::nullopt;
}

std::optional<std::string> template_default_system(std::string_view t) {
  constexpr std::string_view kOpen = "<|im_start|>system\n";
  const std::size_t begin = t.find(kOpen);
  if (begin == std::string_view::npos) return std::nullopt;
  const std::size_t end = t.find("<|im_end|>", begin);
  if (end == std::string_view::npos) return std::nullopt;
  const std::string_view text = t.substr(begin + kOpen.size(), end - begin - kOpen.size());
  // Only literal text: an expression (message['content'], a variable) is not a default.
  if (text.empty() || text.find_first_of("{}'\"+") != std::string_view::npos) return std::nullopt;
  return std::string(text);
}

std::string ChatTemplate::turn(const std::string& role, const std::string& content) const {
  switch (family_) {
    case ChatFamily::chatml:
    case ChatFamily::qwen3: return "<|im_start|>" + role + "\n" + content + "<|im_end|>\n";
    case ChatFamily::llama3: return "<|start_header_id|>" + role + "<|end_header_id|>\n\n" + content + "<|eot_id|>";
    case ChatFamily::gemma:
      return "<start_of_turn>" + std::string(role == "assistant" ? "model" : role) + "\n" + content + "<end_of_turn>\n";
    case ChatFamily::phi3: return "<|" + role + "|>\n" + content + "<|end|>\n";
    case ChatFamily::mistral: return role == "assistant" ? content + "</s>" : "[INST] " + content + " [/INST]";
    case ChatFamily::plain: return content + "\n";
  }
  return content;
}

std::string ChatTemplate::generation_prompt() const {
  switch (family_) {
    case ChatFamily::chatml: return "<|im_start|>assistant\n";
    case ChatFamily::qwen3: return thinking_ ? "<|im_start|>assistant\n" : "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    case ChatFamily::llama3: return "<|start_header_id|>assistant<|end_header_id|>\n\n";
    case ChatFamily::gemma: return "<start_of_turn>model\n";
    case ChatFamily::phi3: return "<|assistant|>\n";
    case ChatFamily::mistral:
    case ChatFamily::plain: return "";
  }
  return "";
}

std::string ChatTemplate::format(std::span<const ChatMessage> messages, bool add_generation_prompt) const {
  std::string out;
  const bool folds = family_ == ChatFamily::gemma || family_ == ChatFamily::mistral;
  const std::vector<ChatMessage> folded = folds ? fold_system(messages) : std::vector<ChatMessage>();
  for (const ChatMessage& m : folds ? std::span<const ChatMessage>(folded) : messages) {
    std::string content = m.content;
    // Qwen3 keeps only the answer of earlier assistant turns, not their reasoning.
    if (family_ == ChatFamily::qwen3 && m.role == "assistant")
      if (const auto end = content.find("</think>"); end != std::string::npos) {
        content.erase(0, end + 8);
        content.erase(0, content.find_first_not_of('\n') == std::string::npos ? content.size()
                                                                                : content.find_first_not_of('\n'));
      }
    out += turn(m.role, content);
  }
  if (add_generation_prompt) out += generation_prompt();
  return out;
}

std::string ChatTemplate::close_reply() const {
  switch (family_) {
    case ChatFamily::chatml:
    case ChatFamily::qwen3: return "<|im_end|>\n";
    case ChatFamily::llama3: return "<|eot_id|>";
    case ChatFamily::gemma: return "<end_of_turn>\n";
    case ChatFamily::phi3: return "<|end|>\n";
    case ChatFamily::mistral: return "</s>";
    case ChatFamily::plain: return "\n";
  }
  return "";
}

std::vector<std::string_view> ChatTemplate::stop_pieces() const {
  switch (family_) {
    case ChatFamily::chatml:
    case ChatFamily::qwen3: return {"<|im_end|>", "<|endoftext|>"};
    case ChatFamily::llama3: return {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"};
    case ChatFamily::gemma: return {"<end_of_turn>", "<eos>"};
    case ChatFamily::phi3: return {"<|end|>", "<|endoftext|>"};
    case ChatFamily::mistral: return {"</s>"};
    case ChatFamily::plain: return {};
  }
  return {};
}

std::string format_chatml(std::span<const ChatMessage> messages, bool add_generation_prompt) {
  return ChatTemplate(ChatFamily::chatml).format(messages, add_generation_prompt);
}

}  // namespace qkvshare
