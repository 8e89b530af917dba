// libFuzzer target: tokenizer files (llama2.c tokenizer files and GGUF
// tokenizer.ggml.* metadata) and the encoders built from them. An input is
//   [kind: 1 byte, even = llama2.c, odd = GGUF][vocab_size: u16][text length: u16][text][file bytes]
// The file goes into an in-memory file (memfd); the vocabulary it yields must
// encode the text and decode the ids without a crash, a hang or an id outside
// the vocabulary. Any exception other than qkvshare::Error is a finding.
// QKVSHARE_FUZZ_SEED_DIR=DIR writes well-formed seeds of both kinds into DIR.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "memory_file.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/model/gguf.hpp"
#include "qkvshare/model/tokenizer.hpp"

namespace {

std::string header(char kind, std::uint16_t vocab, const std::string& text) {
  std::string s(1, kind);
  const std::uint16_t len = static_cast<std::uint16_t>(text.size());
  s.append(reinterpret_cast<const char*>(&vocab), 2);
  s.append(reinterpret_cast<const char*>(&len), 2);
  return s + text;
}

// The pieces of a small SentencePiece-style vocabulary: <unk>, <s>, </s>, the
// 256 byte pieces, then a few merges.
std::vector<std::string> spm_pieces() {
  std::vector<std::string> p = {"<unk>", "<s>", "</s>"};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    p.emplace_back(buf);
  }
  for (const char* m : {"\xe2\x96\x81", "a", "b", "ab", "\xe2\x96\x81" "a", "\xe2\x96\x81" "ab", "ba"}) p.emplace_back(m);
  return p;
}

void write_seeds(const std::string& dir) {
  const std::string text = "ab ba abab\xc3\xa9 <s> x";
  const std::vector<std::string> pieces = spm_pieces();
  {  // llama2.c
    std::string file;
    const std::int32_t max_len = 8;
    file.append(reinterpret_cast<const char*>(&max_len), 4);
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      const float score = -static_cast<float>(i);
      const std::int32_t len = static_cast<std::int32_t>(pieces[i].size());
      file.append(reinterpret_cast<const char*>(&score), 4);
      file.append(reinterpret_cast<const char*>(&len), 4);
      file += pieces[i];
    }
    std::ofstream(dir + "/seed-llama2c.bin", std::ios::binary)
        << header(0, static_cast<std::uint16_t>(pieces.size()), text) << file;
  }
  for (const bool gpt2 : {false, true}) {  // GGUF, SentencePiece and byte-level BPE
    qkvshare::GgufWriter w;
    w.set_string("general.architecture", "llama");
    w.set_string("tokenizer.ggml.model", gpt2 ? "gpt2" : "llama");
    if (gpt2) {
      w.set_string_array("tokenizer.ggml.tokens", {"<|endoftext|>", "a", "b", "ab", "\xc4\xa0", "\xc4\xa0" "a"});
      w.set_i32_array("tokenizer.ggml.token_type", {3, 1, 1, 1, 1, 1});
      w.set_string_array("tokenizer.ggml.merges", {"a b", "\xc4\xa0 a"});
    } else {
      w.set_string_array("tokenizer.ggml.tokens", pieces);
      std::vector<float> scores;
      for (std::size_t i = 0; i < pieces.size(); ++i) scores.push_back(-static_cast<float>(i));
      w.set_f32_array("tokenizer.ggml.scores", scores);
    }
    const std::string path = dir + "/seed-gguf-file.tmp";
    w.write(path);
    std::ifstream in(path, std::ios::binary);
    const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(dir + (gpt2 ? "/seed-gguf-gpt2.bin" : "/seed-gguf-llama.bin"), std::ios::binary)
        << header(1, 0, text) << file;
    std::remove(path.c_str());
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("QKVSHARE_FUZZ_SEED_DIR"); dir != nullptr && *dir != '\0') write_seeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 5) return 0;
  std::uint16_t vocab = 0, text_len = 0;
  std::memcpy(&vocab, data + 1, 2);
  std::memcpy(&text_len, data + 3, 2);
  if (5u + text_len > size) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 5, text_len);
  const std::string path = qkvshare::fuzz::memory_file_with(data + 5 + text_len, size - 5 - text_len);
  try {
    std::unique_ptr<qkvshare::Tokenizer> tok;
    std::unique_ptr<qkvshare::GgufFile> gguf;
    if (data[0] % 2 == 0) {
      tok = qkvshare::load_llama2c_tokenizer(path, vocab);
    } else {
      gguf = qkvshare::GgufFile::open(path);
      tok = qkvshare::load_gguf_tokenizer(*gguf);
    }
    for (const bool special : {false, true}) {
      const std::vector<qkvshare::TokenId> ids = tok->encode(text, special);
      for (const qkvshare::TokenId id : ids)
        if (id < 0 || id >= tok->vocab_size()) {
          std::fprintf(stderr, "encode gave id %d outside the vocabulary of %d\n", id, tok->vocab_size());
          std::abort();
        }
      (void)tok->decode(ids);
    }
  } catch (const qkvshare::Error&) {
  }
  return 0;
}
