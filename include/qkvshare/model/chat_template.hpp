#pragma once
// Chat templates: how a conversation becomes the text a model was trained on.
// GGUF files carry their template as Jinja source (tokenizer.chat_template);
// rather than run Jinja, the families in use are recognised from their marker
// tokens and rendered by code: ChatML (SmolLM2, Qwen2), Qwen3 (ChatML with
// <think> reasoning), Llama-3, Gemma, Phi-3, Mistral ([INST]). A template that
// matches none is reported with the way out (--chat-template NAME).
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace qkvshare {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

enum class ChatFamily { chatml, qwen3, llama3, gemma, phi3, mistral, plain };

// "chatml", "qwen3", "llama3", "gemma", "phi3", "mistral", "plain".
std::string_view chat_family_name(ChatFamily f) noexcept;
// The family named `name`; throws Error(invalid_argument) listing the names.
ChatFamily parse_chat_family(std::string_view name);
// The family a Jinja template belongs to, from its marker tokens; nullopt if none.
std::optional<ChatFamily> detect_chat_family(std::string_view jinja);

class ChatTemplate {
 public:
  explicit ChatTemplate(ChatFamily family, bool thinking = true) : family_(family), thinking_(thinking) {}
  ChatFamily family() const noexcept { return family_; }
  std::string_view name() const noexcept { return chat_family_name(family_); }

  // The whole conversation; with add_generation_prompt, the opening of the
  // assistant's reply follows. BOS is not part of the text (the tokenizer adds it).
  std::string format(std::span<const ChatMessage> messages, bool add_generation_prompt) const;
  // What closes an assistant reply that generation left open, before the next turn.
  std::string close_reply() const;
  // The special tokens that end a turn in this family (stop tokens when present in the vocabulary).
  std::vector<std::string_view> stop_pieces() const;

 private:
  std::string turn(const std::string& role, const std::string& content) const;
  std::string generation_prompt() const;
  ChatFamily family_;
  bool thinking_;  // Qwen3: false opens the reply with an empty <think></think> block
};

// The system message a template inserts when the conversation has none
// (SmolLM2's "You are a helpful AI assistant named SmolLM...", Qwen2.5's
// "You are Qwen..."): a literal "<|im_start|>system\n...<|im_end|>" in the Jinja source.
std::optional<std::string> template_default_system(std::string_view jinja);

// ChatML, kept for callers that know their model speaks it.
std::string format_chatml(std::span<const ChatMessage> messages, bool add_generation_prompt);

}  // namespace qkvshare
