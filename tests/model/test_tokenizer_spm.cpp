// SentencePiece-style tokenizers: the llama2.c tok512 vocabulary against a
// naive port of run.c, and GGUF `llama` vocabularies built with GgufWriter.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "qkvshare/core/error.hpp"
#include "qkvshare/model/gguf.hpp"
#include "qkvshare/model/tokenizer.hpp"
#include "test_paths.hpp"
#include "test_tokenizer_util.hpp"

namespace qkvshare {
namespace {

using testing::NaiveRunC;
using testing::read_text_file;
using testing::shared_path;

const std::string& tok512_path() {
  static const std::string p = shared_path("models/tok512.bin");
  return p;
}

const Tokenizer& tok512() {
  static const std::unique_ptr<Tokenizer> t = load_llama2c_tokenizer(tok512_path(), 512);
  return *t;
}

const NaiveRunC& naive() {
  static const NaiveRunC n(tok512_path(), 512);
  return n;
}

TEST(TokenizerLlama2c, LoadsTok512Vocabulary) {
  const Tokenizer& t = tok512();
  EXPECT_EQ(t.vocab_size(), 512);
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_TRUE(t.add_bos());
  EXPECT_EQ(t.token_type(0), TokenType::unknown);
  EXPECT_EQ(t.token_type(1), TokenType::control);
  EXPECT_EQ(t.token_type(2), TokenType::control);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(t.token_type(b + 3), TokenType::byte) << b;
  EXPECT_EQ(t.token_type(259), TokenType::normal);
  EXPECT_EQ(t.piece(3), "<0x00>");
  EXPECT_EQ(t.piece(258), "<0xFF>");
  EXPECT_EQ(t.piece(403), " Once");
  EXPECT_EQ(t.find(" "), std::optional<TokenId>(410));
  EXPECT_EQ(t.find("no such piece"), std::nullopt);
  EXPECT_EQ(t.end_of_generation_ids(), std::vector<TokenId>{2});
  EXPECT_TRUE(t.is_end_of_generation(2));
  EXPECT_FALSE(t.is_end_of_generation(1));
  EXPECT_THROW(t.piece(512), Error);
  EXPECT_THROW(t.token_type(-1), Error);
}

TEST(TokenizerLlama2c, OnceUponATimeGivesRunCIds) {
  // run.c: " Once" " upon" " a" " time" (checked by hand against the vocabulary
  // and by tests/reference/tokenizer_llama2c.py); no BOS from encode().
  const std::vector<TokenId> expected{403, 407, 261, 378};
  EXPECT_EQ(tok512().encode("Once upon a time"), expected);
  EXPECT_EQ(naive().encode("Once upon a time"), expected);
  EXPECT_EQ(tok512().decode(expected), "Once upon a time");
}

TEST(TokenizerLlama2c, EmptyAndWhitespaceOnlyText) {
  EXPECT_TRUE(tok512().encode("").empty());
  EXPECT_EQ(tok512().decode(std::vector<TokenId>{}), "");
  for (const std::string s : {" ", "  ", "\n", " \n\t ", "\n\n\n", "\t", "   x   "}) {
    const auto ids = tok512().encode(s);
    EXPECT_EQ(ids, naive().encode(s)) << s;
    EXPECT_EQ(tok512().decode(ids), s) << s;
  }
}

TEST(TokenizerLlama2c, FastEncodeMatchesNaiveRunC) {
  std::mt19937 rng(1234);
  const std::string story = read_text_file(shared_path("data/tinystories-valid-sample.txt"));
  for (int i = 0; i < 300; ++i) {
    std::string s;
    switch (i % 3) {
      case 0:
        s = testing::random_utf8(rng, rng() % 80);
        break;
      case 1:
        s = testing::random_bytes(rng, rng() % 60);
        break;  // invalid UTF-8, stray continuation bytes
      default:
        s = story.substr(rng() % (story.size() - 300), rng() % 300);
        break;
    }
    ASSERT_EQ(tok512().encode(s), naive().encode(s)) << "text: " << s;
  }
  // A longer stretch: many equal-score ties and long merge chains.
  const std::string long_text = story.substr(0, 2000);
  EXPECT_EQ(tok512().encode(long_text), naive().encode(long_text));
}

TEST(TokenizerLlama2c, RoundTripsSharedTexts) {
  for (const char* name : {"data/tinystories-valid-sample.txt", "data/wikitext-2-test.raw"}) {
    const std::string text = read_text_file(shared_path(name));
    const auto ids = tok512().encode(text);
    EXPECT_LT(ids.size(), text.size()) << name;
    EXPECT_TRUE(tok512().decode(ids) == text) << name << " does not round-trip";
  }
}

TEST(TokenizerLlama2c, RoundTripsRandomUtf8AndBytes) {
  std::mt19937 rng(99);
  for (int i = 0; i < 500; ++i) {
    const std::string s =
        i % 2 == 0 ? testing::random_utf8(rng, rng() % 100) : testing::random_bytes(rng, rng() % 100);
    ASSERT_EQ(tok512().decode(tok512().encode(s)), s);
  }
}

TEST(TokenizerLlama2c, TokenToPieceFollowsRunC) {
  const Tokenizer& t = tok512();
  EXPECT_EQ(t.token_to_piece(1, 403), "Once");   // after BOS the dummy-prefix space goes
  EXPECT_EQ(t.token_to_piece(-1, 403), "Once");  // so it does at the start of a sequence
  EXPECT_EQ(t.token_to_piece(378, 403), " Once");
  EXPECT_EQ(t.token_to_piece(-1, 3 + 'A'), "A");  // byte tokens give their byte
  EXPECT_EQ(t.token_to_piece(1, 3 + ' '), " ");   // and are never stripped
  EXPECT_EQ(t.token_to_piece(5, 3 + 0xE4), "\xE4");
  EXPECT_EQ(t.token_to_piece(-1, 1), "");  // control tokens
  EXPECT_EQ(t.token_to_piece(-1, 2), "");
  const std::vector<TokenId> with_bos{1, 403, 407, 261, 378};
  EXPECT_EQ(t.decode(with_bos), "Once upon a time");
  EXPECT_THROW(t.token_to_piece(-1, 512), Error);
}

TEST(TokenizerLlama2c, EncodesAMegabyteQuickly) {
  // An O(n^2) merge loop would take hours here; the limit is loose enough for
  // Debug and sanitizer builds.
  std::string text = read_text_file(shared_path("data/wikitext-2-test.raw")).substr(0, 1 << 20);
  const auto start = std::chrono::steady_clock::now();
  const auto ids = tok512().encode(text);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("tok512: %zu bytes -> %zu tokens in %.3f s\n", text.size(), ids.size(), seconds);
  EXPECT_LT(seconds, 60.0);
}

// ---- GGUF `llama` vocabularies -------------------------------------------

struct SpmFixture {
  std::unique_ptr<GgufFile> gguf;
  std::unique_ptr<Tokenizer> tok;
};

// <unk> <s> </s>, the 256 byte tokens, then a few pieces with U+2581 spaces.
SpmFixture make_spm(bool add_space_prefix, bool with_user_defined = false) {
  std::vector<std::string> tokens{"<unk>", "<s>", "</s>"};
  std::vector<float> scores{0, 0, 0};
  std::vector<std::int32_t> types{2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(fmt::format("<0x{:02X}>", b));
    scores.push_back(0);
    types.push_back(6);
  }
  const std::vector<std::pair<std::string, float>> normal{
      {"\xE2\x96\x81", -1}, {"h", -2}, {"i", -3}, {"hi", -4}, {"\xE2\x96\x81hi", -5}, {"!", -6}, {"x", -7}};
  for (const auto& [p, s] : normal) {
    tokens.push_back(p);
    scores.push_back(s);
    types.push_back(1);
  }
  if (with_user_defined) {
    tokens.push_back("<tool>");
    scores.push_back(0);
    types.push_back(4);
  }
  GgufWriter w;
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_string_array("tokenizer.ggml.tokens", tokens);
  w.set_f32_array("tokenizer.ggml.scores", scores);
  w.set_i32_array("tokenizer.ggml.token_type", types);
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_bool("tokenizer.ggml.add_space_prefix", add_space_prefix);
  const std::string path = testing::temp_dir() + "/spm.gguf";
  w.write(path);
  SpmFixture f;
  f.gguf = GgufFile::open(path);
  f.tok = load_gguf_tokenizer(*f.gguf);
  return f;
}

TEST(TokenizerSpmGguf, EscapesSpacesAndFallsBackToBytes) {
  const SpmFixture f = make_spm(true);
  const Tokenizer& t = *f.tok;
  const TokenId sp = *t.find("\xE2\x96\x81");
  const TokenId sp_hi = *t.find("\xE2\x96\x81hi");
  const TokenId bang = *t.find("!");
  EXPECT_TRUE(t.add_bos());
  EXPECT_EQ(t.encode("hi"), (std::vector<TokenId>{sp_hi}));
  EXPECT_EQ(t.encode("hi hi!"), (std::vector<TokenId>{sp_hi, sp_hi, bang}));
  // 'z' and the CJK character have no piece: their bytes' tokens (id byte + 3).
  EXPECT_EQ(t.encode("z\xE4\xBD\xA0"), (std::vector<TokenId>{sp, 3 + 'z', 3 + 0xE4, 3 + 0xBD, 3 + 0xA0}));
  for (const std::string s : {"hi", "hi hi!", " hi", "  ", "z\xE4\xBD\xA0 x", ""})
    EXPECT_EQ(t.decode(t.encode(s)), s) << s;
  EXPECT_EQ(t.token_to_piece(1, sp_hi), "hi");
  EXPECT_EQ(t.token_to_piece(bang, sp_hi), " hi");
}

TEST(TokenizerSpmGguf, WithoutSpacePrefix) {
  const SpmFixture f = make_spm(false);
  const Tokenizer& t = *f.tok;
  EXPECT_EQ(t.encode("hi"), (std::vector<TokenId>{*t.find("hi")}));
  EXPECT_EQ(t.token_to_piece(-1, *t.find("\xE2\x96\x81hi")), " hi");  // nothing to strip
  for (const std::string s : {"hi", " hi hi", "x "}) EXPECT_EQ(t.decode(t.encode(s)), s) << s;
}

TEST(TokenizerSpmGguf, ParsesSpecialTokensOnlyWhenAsked) {
  const SpmFixture f = make_spm(true, true);
  const Tokenizer& t = *f.tok;
  const TokenId tool = *t.find("<tool>");
  const TokenId sp_hi = *t.find("\xE2\x96\x81hi");
  // As llama.cpp, text after a special token gets the dummy prefix again.
  EXPECT_EQ(t.encode("<s>hi<tool>hi", true), (std::vector<TokenId>{1, sp_hi, tool, sp_hi}));
  const auto plain = t.encode("<s>hi", false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 1), 0);
  EXPECT_EQ(t.decode(plain), "<s>hi");
  EXPECT_EQ(t.decode(std::vector<TokenId>{1, sp_hi, 2}), "hi");
}

}  // namespace
}  // namespace qkvshare
