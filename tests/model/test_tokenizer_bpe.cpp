// GPT-2 byte-level BPE: a small vocabulary built with GgufWriter for the
// mechanics, and SmolLM2-135M's real one (ids checked against HuggingFace
// tokenizers, see tests/reference/test_tokenizer_reference.py).
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "qkvshare/core/error.hpp"
#include "qkvshare/model/gguf.hpp"
#include "qkvshare/model/tokenizer.hpp"
#include "test_paths.hpp"
#include "test_tokenizer_util.hpp"

namespace qkvshare {
namespace {

using testing::read_text_file;
using testing::shared_path;

// GPT-2's bytes_to_unicode(), written out independently of the library.
std::string byte_char(int b) {
  const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  char32_t cp = static_cast<char32_t>(b);
  if (!printable) {
    cp = 256;
    for (int i = 0; i < b; ++i) {
      const bool p = (i >= 0x21 && i <= 0x7E) || (i >= 0xA1 && i <= 0xAC) || (i >= 0xAE && i <= 0xFF);
      if (!p) ++cp;
    }
  }
  std::string s;
  testing::append_utf8(s, cp);
  return s;
}

struct BpeFixture {
  std::unique_ptr<GgufFile> gguf;
  std::unique_ptr<Tokenizer> tok;
};

// Specials 0..2, the 256 byte characters (3..258), then merge results.
BpeFixture make_bpe(const std::string& pre) {
  std::vector<std::string> tokens{"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  std::vector<std::int32_t> types{3, 3, 3};
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(byte_char(b));
    types.push_back(1);
  }
  const std::vector<std::string> merges{"Ġ Ġ", "h i", "Ġ hi", "1 2", "ĠĠ Ġ"};
  for (const auto& m : merges) {
    tokens.push_back(m.substr(0, m.find(' ')) + m.substr(m.find(' ') + 1));
    types.push_back(1);
  }
  GgufWriter w;
  w.set_string("tokenizer.ggml.model", "gpt2");
  if (!pre.empty()) w.set_string("tokenizer.ggml.pre", pre);
  w.set_string_array("tokenizer.ggml.tokens", tokens);
  w.set_i32_array("tokenizer.ggml.token_type", types);
  w.set_string_array("tokenizer.ggml.merges", merges);
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  const std::string path = testing::temp_dir() + "/bpe.gguf";
  w.write(path);
  BpeFixture f;
  f.gguf = GgufFile::open(path);
  f.tok = load_gguf_tokenizer(*f.gguf);
  return f;
}

TokenId id_of(const Tokenizer& t, const std::string& piece) {
  const auto id = t.find(piece);
  if (!id) throw std::runtime_error("no piece " + piece);
  return *id;
}

TEST(TokenizerBpe, MergesByRankWithinPreTokenizedChunks) {
  const BpeFixture f = make_bpe("smollm");
  const Tokenizer& t = *f.tok;
  EXPECT_FALSE(t.add_bos());
  EXPECT_EQ(t.encode("hi"), (std::vector<TokenId>{id_of(t, "hi")}));
  EXPECT_EQ(t.encode(" hi"), (std::vector<TokenId>{id_of(t, "Ġhi")}));
  // "a  b" pre-tokenizes to "a", " ", " b": the two spaces never meet.
  EXPECT_EQ(t.encode("a  b"),
            (std::vector<TokenId>{id_of(t, "a"), id_of(t, "Ġ"), id_of(t, "Ġ"), id_of(t, "b")}));
  // Trailing spaces stay one chunk; "Ġ Ġ" (rank 0) then "ĠĠ Ġ".
  EXPECT_EQ(t.encode("x   "), (std::vector<TokenId>{id_of(t, "x"), id_of(t, "ĠĠĠ")}));
  // smollm splits every digit, so the "1 2" merge never applies.
  EXPECT_EQ(t.encode("12"), (std::vector<TokenId>{id_of(t, "1"), id_of(t, "2")}));
  EXPECT_EQ(t.decode(t.encode("a  b\n12 hi\t")), "a  b\n12 hi\t");
}

TEST(TokenizerBpe, Gpt2PreTokenizerKeepsDigitRuns) {
  const BpeFixture f = make_bpe("gpt2");
  EXPECT_EQ(f.tok->encode("12"), (std::vector<TokenId>{id_of(*f.tok, "12")}));
}

TEST(TokenizerBpe, UnknownPreTokenizerWarnsAndUsesGpt2) {
  ::testing::internal::CaptureStderr();
  const BpeFixture f = make_bpe("no-such-pre");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("no-such-pre"), std::string::npos) << err;
  EXPECT_EQ(f.tok->encode("12"), (std::vector<TokenId>{id_of(*f.tok, "12")}));
}

TEST(TokenizerBpe, SpecialTokensAndBytes) {
  const BpeFixture f = make_bpe("smollm");
  const Tokenizer& t = *f.tok;
  const auto ids = t.encode("<|im_start|>hi<|im_end|>", true);
  EXPECT_EQ(ids, (std::vector<TokenId>{1, id_of(t, "hi"), 2}));
  EXPECT_EQ(t.decode(ids), "hi");  // control tokens give ""
  const auto plain = t.encode("<|im_start|>hi", false);
  EXPECT_GT(plain.size(), 2u);
  EXPECT_EQ(t.decode(plain), "<|im_start|>hi");
  EXPECT_EQ(t.token_to_piece(-1, id_of(t, "Ġ")), " ");
  EXPECT_EQ(t.token_to_piece(-1, id_of(t, "Ċ")), "\n");
  EXPECT_EQ(t.token_to_piece(-1, id_of(t, byte_char(0xE4))), "\xE4");
  EXPECT_EQ(t.end_of_generation_ids(), (std::vector<TokenId>{0, 2}));
  EXPECT_THROW(t.token_to_piece(-1, t.vocab_size()), Error);
}

TEST(TokenizerBpe, InvalidUtf8RoundTrips) {
  const BpeFixture f = make_bpe("smollm");
  std::mt19937 rng(5);
  for (int i = 0; i < 300; ++i) {
    const std::string s = testing::random_bytes(rng, rng() % 50);
    ASSERT_EQ(f.tok->decode(f.tok->encode(s)), s);
  }
}

// ---- SmolLM2-135M-Instruct ------------------------------------------------

struct Smol {
  std::unique_ptr<GgufFile> gguf;
  std::unique_ptr<Tokenizer> tok;
};

const Smol& smol(const std::string& path) {
  static const Smol s = [&] {
    Smol r;
    r.gguf = GgufFile::open(path);
    r.tok = load_gguf_tokenizer(*r.gguf);
    return r;
  }();
  return s;
}

// Code points whose UTF-8 bytes all have a token in SmolLM2's vocabulary:
// it lacks the bytes 0x04 0x06 0x13 0x14 0x16 0x1D (control characters) and
// the lead bytes of U+40000..U+BFFFF, which HuggingFace drops as well.
bool smol_representable(char32_t cp) {
  for (const char32_t bad : {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D})
    if (cp == bad) return false;
  return cp < 0x40000 || cp >= 0xC0000;
}

TEST(TokenizerSmolLM2, Metadata) {
  QKV_REQUIRE_SMOLLM2(path);
  const Tokenizer& t = *smol(path).tok;
  EXPECT_EQ(t.vocab_size(), 49152);
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_FALSE(t.add_bos());
  EXPECT_EQ(t.end_of_generation_ids(), (std::vector<TokenId>{0, 2}));
  EXPECT_EQ(t.piece(1), "<|im_start|>");
  EXPECT_EQ(t.token_type(1), TokenType::control);
  EXPECT_EQ(t.token_type(100), TokenType::normal);
}

TEST(TokenizerSmolLM2, IdsMatchHuggingFace) {
  QKV_REQUIRE_SMOLLM2(path);
  const Tokenizer& t = *smol(path).tok;
  const std::string text = "Hello world, it's 12345 <|im_start|>user";
  EXPECT_EQ(t.encode(text), (std::vector<TokenId>{19556, 905, 28, 357, 506, 216, 33, 34, 35, 36, 37, 2067,
                                                  108, 306, 79, 3738, 108, 46, 4093}));
  EXPECT_EQ(t.encode(text, true),
            (std::vector<TokenId>{19556, 905, 28, 357, 506, 216, 33, 34, 35, 36, 37, 216, 1, 4093}));
  EXPECT_EQ(t.encode("a  b\n\n\tc   "), (std::vector<TokenId>{81, 216, 278, 1116, 197, 83, 333}));

  const std::vector<ChatMessage> chat{
      {"system", "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
      {"user", "What is 2+2?"}};
  const std::vector<TokenId> expected{1,    9690, 198,   2683, 359,  253,  5356, 5646,  11173, 3365,
                                      3511, 308,  34519, 28,   7018, 411,  407,  19712, 8182,  2,
                                      198,  1,    4093,  198,  1780, 314,  216,  34,    27,    34,
                                      47,   2,    198,   1,    520,  9531, 198};
  EXPECT_EQ(t.encode(format_chatml(chat, true), true), expected);
}

TEST(TokenizerSmolLM2, RoundTripsSharedTexts) {
  QKV_REQUIRE_SMOLLM2(path);
  const Tokenizer& t = *smol(path).tok;
  for (const char* name : {"data/tinystories-valid-sample.txt", "data/wikitext-2-test.raw"}) {
    const std::string text = read_text_file(shared_path(name));
    const auto ids = t.encode(text);
    EXPECT_LT(ids.size(), text.size() / 2) << name;
    EXPECT_TRUE(t.decode(ids) == text) << name << " does not round-trip";
  }
}

TEST(TokenizerSmolLM2, RoundTripsRandomAndWhitespaceText) {
  QKV_REQUIRE_SMOLLM2(path);
  const Tokenizer& t = *smol(path).tok;
  EXPECT_TRUE(t.encode("").empty());
  for (const std::string s : {" ", "  ", "\n", "\n\n", " \n ", "\t\t", "\r\n", "   \t\n  \n"})
    EXPECT_EQ(t.decode(t.encode(s)), s);
  std::mt19937 rng(7);
  for (int i = 0; i < 500; ++i) {
    const std::string s = testing::random_utf8(rng, rng() % 60, smol_representable);
    ASSERT_EQ(t.decode(t.encode(s)), s);
  }
}

TEST(TokenizerSmolLM2, ConcurrentEncodeMatchesSerial) {
  QKV_REQUIRE_SMOLLM2(path);
  const Tokenizer& t = *smol(path).tok;
  const std::string text = read_text_file(shared_path("data/tinystories-valid-sample.txt"));
  const auto expected = t.encode(text);
  std::vector<std::vector<TokenId>> got(4);
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < got.size(); ++i) threads.emplace_back([&, i] { got[i] = t.encode(text); });
  for (auto& th : threads) th.join();
  for (const auto& g : got) EXPECT_EQ(g, expected);
}

TEST(TokenizerChatml, FormatsTurnsAndGenerationPrompt) {
  const std::vector<ChatMessage> chat{{"system", "Be brief."}, {"user", "Hi"}};
  EXPECT_EQ(
      format_chatml(chat, true),
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(format_chatml(std::span(chat).first(1), false), "<|im_start|>system\nBe brief.<|im_end|>\n");
  EXPECT_EQ(format_chatml({}, true), "<|im_start|>assistant\n");
}

}  // namespace
}  // namespace qkvshare
