// Chat templates: recognition of each family from the marker tokens of its
// Jinja source, the text of each family for a system + user + assistant +
// user conversation (as the models' own templates render it), the Model's
// choice (flag, file, vocabulary) and its errors.
#include <gtest/gtest.h>

#include "qkvshare/core/error.hpp"
#include "qkvshare/model/chat_template.hpp"

namespace qkvshare {
namespace {

const ChatMessage kConversation[] = {
    {"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello!"}, {"user", "2+2?"}};

TEST(ChatTemplate, RecognisesEachFamilyFromItsMarkers) {
  // Excerpts of the templates shipped in the models' GGUF files.
  EXPECT_EQ(detect_chat_family("{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'}}"),
            ChatFamily::chatml);
  EXPECT_EQ(detect_chat_family("{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n"
                               "</think>\n\n' }}{%- endif %}{{- '<|im_start|>assistant\n' }}"),
            ChatFamily::qwen3);
  EXPECT_EQ(detect_chat_family("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"),
            ChatFamily::llama3);
  EXPECT_EQ(detect_chat_family("{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"),
            ChatFamily::gemma);
  EXPECT_EQ(detect_chat_family("{{'<|user|>' + '\n' + message['content'] + '<|end|>' + '\n' + '<|assistant|>' + '\n'}}"),
            ChatFamily::phi3);
  EXPECT_EQ(detect_chat_family("{{ bos_token }}{% for message in messages %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"),
            ChatFamily::mistral);
  EXPECT_EQ(detect_chat_family("{{ message.content }}### Response:"), std::nullopt);
}

TEST(ChatTemplate, RendersEachFamily) {
  const struct {
    ChatFamily family;
    std::string text;
  } cases[] = {
      {ChatFamily::chatml,
       "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
       "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"},
      {ChatFamily::llama3,
       "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi"
       "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user"
       "<|end_header_id|>\n\n2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
      {ChatFamily::gemma,
       "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
       "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"},
      {ChatFamily::phi3,
       "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\n2+2?<|end|>\n"
       "<|assistant|>\n"},
      {ChatFamily::mistral, "[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] 2+2? [/INST]"},
      {ChatFamily::plain, "Be brief.\nHi\nHello!\n2+2?\n"},
  };
  for (const auto& c : cases) EXPECT_EQ(ChatTemplate(c.family).format(kConversation, true), c.text) << chat_family_name(c.family);
}

TEST(ChatTemplate, Qwen3DropsEarlierReasoningAndCanSkipThinking) {
  const ChatMessage conv[] = {{"user", "Hi"}, {"assistant", "<think>\nsay hi\n</think>\n\nHello!"}, {"user", "Bye"}};
  EXPECT_EQ(ChatTemplate(ChatFamily::qwen3).format(conv, true),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(ChatTemplate(ChatFamily::qwen3, /*thinking=*/false).format(std::span(conv, 1), true),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

TEST(ChatTemplate, DefaultSystemMessageOfTheTemplate) {
  // SmolLM2-135M-Instruct's template, verbatim from its GGUF file.
  const std::string smollm2 =
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
      "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
      "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
  EXPECT_EQ(template_default_system(smollm2), "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  EXPECT_EQ(detect_chat_family(smollm2), ChatFamily::chatml);
  EXPECT_EQ(template_default_system("{{'<|im_start|>system\n' + message['content'] + '<|im_end|>'}}"), std::nullopt);
}

TEST(ChatTemplate, StopPiecesAndNames) {
  EXPECT_EQ(ChatTemplate(ChatFamily::llama3).stop_pieces().front(), "<|eot_id|>");
  EXPECT_EQ(ChatTemplate(ChatFamily::gemma).stop_pieces().front(), "<end_of_turn>");
  EXPECT_EQ(ChatTemplate(ChatFamily::phi3).close_reply(), "<|end|>\n");
  for (ChatFamily f : {ChatFamily::chatml, ChatFamily::qwen3, ChatFamily::llama3, ChatFamily::gemma, ChatFamily::phi3,
                       ChatFamily::mistral, ChatFamily::plain})
    EXPECT_EQ(parse_chat_family(chat_family_name(f)), f);
  try {
    parse_chat_family("vicuna");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("'vicuna' is not one of chatml, qwen3, llama3"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace qkvshare
