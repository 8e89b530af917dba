#include "qkvshare/model/tokenizer.hpp"

namespace qkvshare {

std::string format_chatml(std::span<const ChatMessage> messages, bool add_generation_prompt) {
  std::string out;
  for (const ChatMessage& m : messages) {
    out += "<|im_start|>";
    out += m.role;
    out += '\n';
    out += m.content;
    out += "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace qkvshare
