// Malformed tokenizer data: llama2.c files and GGUF tokenizer metadata must
// fail with Error(bad_tokenizer) naming the file, the item and the reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>

#include "qkvshare/core/error.hpp"
#include "qkvshare/model/gguf.hpp"
#include "qkvshare/model/tokenizer.hpp"
#include "test_paths.hpp"
#include "test_tokenizer_util.hpp"

namespace qkvshare {
namespace {

std::string temp_file(const std::string& name, const std::string& bytes) {
  static const std::string dir = testing::temp_dir();
  const std::string path = dir + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

void put_i32(std::string& s, std::int32_t v) {
  s.append(reinterpret_cast<const char*>(&v), 4);
}
void put_f32(std::string& s, float v) {
  s.append(reinterpret_cast<const char*>(&v), 4);
}

// A well-formed llama2.c tokenizer file of `n` tokens "t0", "t1", ...
std::string llama2c_bytes(int n, std::int32_t max_len = 8) {
  std::string s;
  put_i32(s, max_len);
  for (int i = 0; i < n; ++i) {
    const std::string piece = "t" + std::to_string(i);
    put_f32(s, static_cast<float>(-i));
    put_i32(s, static_cast<std::int32_t>(piece.size()));
    s += piece;
  }
  return s;
}

void expect_error(const std::function<void()>& f, ErrorCode code, const std::string& path,
                  const std::vector<std::string>& mentions) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning " << mentions.front();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.code(), code) << msg;
    EXPECT_EQ(msg.rfind(path + ": ", 0), 0u) << "message does not start with the path: " << msg;
    for (const auto& m : mentions)
      EXPECT_NE(msg.find(m), std::string::npos) << "'" << m << "' not in: " << msg;
  }
}

void expect_bad_llama2c(const std::string& bytes, int vocab_size, const std::vector<std::string>& mentions) {
  const std::string path = temp_file("tok.bin", bytes);
  expect_error([&] { load_llama2c_tokenizer(path, vocab_size); }, ErrorCode::bad_tokenizer, path, mentions);
}

TEST(TokenizerErrors, WellFormedSyntheticLlama2cFileLoads) {
  const std::string path = temp_file("ok.bin", llama2c_bytes(300));
  const auto t = load_llama2c_tokenizer(path, 300);
  EXPECT_EQ(t->vocab_size(), 300);
  EXPECT_EQ(t->piece(299), "t299");
  // Trailing bytes after the vocabulary are ignored, as run.c does.
  const std::string longer = temp_file("longer.bin", llama2c_bytes(300) + "junk");
  EXPECT_EQ(load_llama2c_tokenizer(longer, 300)->vocab_size(), 300);
}

TEST(TokenizerErrors, Llama2cMalformedFiles) {
  expect_bad_llama2c("", 10, {"max_token_length", "truncated"});
  expect_bad_llama2c("\x01\x00", 10, {"max_token_length", "truncated"});
  {
    std::string s;
    put_i32(s, 0);
    expect_bad_llama2c(s, 10, {"max_token_length 0"});
    s.clear();
    put_i32(s, -5);
    expect_bad_llama2c(s, 10, {"max_token_length -5"});
  }
  // Fewer tokens than the checkpoint's vocabulary.
  expect_bad_llama2c(llama2c_bytes(10), 11, {"token 10", "10 of 11"});
  // Cut inside token 5's score, length and bytes.
  const std::string ok = llama2c_bytes(10);
  const std::size_t token5 = 4 + 5 * (4 + 4 + 2);
  expect_bad_llama2c(ok.substr(0, token5 + 2), 10, {"token 5 score", "truncated"});
  expect_bad_llama2c(ok.substr(0, token5 + 6), 10, {"token 5 length", "truncated"});
  expect_bad_llama2c(ok.substr(0, token5 + 9), 10, {"token 5 bytes", "truncated"});
  // Lengths: negative, over max_token_length, huge.
  for (const std::int32_t bad : {-1, 9, 0x7fffffff}) {
    std::string s = ok;
    std::memcpy(s.data() + token5 + 4, &bad, 4);
    expect_bad_llama2c(s, 10, {"token 5", "length " + std::to_string(bad), "max_token_length 8"});
  }
  // A score that is not a number (merges are ranked by score).
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::string s = ok;
    std::memcpy(s.data() + token5, &bad, 4);
    expect_bad_llama2c(s, 10, {"token 5", "not a finite number"});
  }
  // A length within max_token_length but past the end of the file.
  {
    std::string s = llama2c_bytes(3, 1000);
    const std::int32_t len = 500;
    std::memcpy(s.data() + 4 + 2 * 10 + 4, &len, 4);
    expect_bad_llama2c(s, 3, {"token 2 bytes", "truncated"});
  }
}

TEST(TokenizerErrors, Llama2cBadArguments) {
  const std::string path = temp_file("ok.bin", llama2c_bytes(10));
  expect_bad_llama2c(llama2c_bytes(10), 0, {"vocab_size 0"});
  expect_bad_llama2c(llama2c_bytes(10), -3, {"vocab_size -3"});
  // A corrupt checkpoint's huge vocabulary must not allocate for it.
  expect_bad_llama2c(llama2c_bytes(10), 0x7fffffff, {"token 10", "10 of 2147483647"});
  const std::string missing = testing::temp_dir() + "/does-not-exist.bin";
  expect_error([&] { load_llama2c_tokenizer(missing, 10); }, ErrorCode::io, missing, {"cannot open"});
}

// ---- GGUF tokenizer metadata -------------------------------------------

// A valid gpt2 vocabulary (or llama, with the same tokens); tests drop or
// replace single keys (GgufWriter refuses to set a key twice).
struct GgufVocab {
  std::optional<std::string> model = "gpt2";
  std::optional<std::vector<std::string>> tokens = std::vector<std::string>{"<|endoftext|>", "a", "b", "ab"};
  std::optional<std::vector<std::int32_t>> types = std::vector<std::int32_t>{3, 1, 1, 1};
  std::optional<std::vector<float>> scores = std::vector<float>{0, -1, -2, -3};
  std::optional<std::vector<std::string>> merges = std::vector<std::string>{"a b"};
  std::function<void(GgufWriter&)> extra;  // further or replacement keys

  static GgufVocab llama() {
    GgufVocab v;
    v.model = "llama";
    return v;
  }
};

// Expects load_gguf_tokenizer to fail mentioning all of `mentions`, or to
// succeed when `mentions` is empty.
void expect_bad_gguf(const GgufVocab& v, const std::vector<std::string>& mentions) {
  GgufWriter w;
  if (v.model) w.set_string("tokenizer.ggml.model", *v.model);
  if (v.tokens) w.set_string_array("tokenizer.ggml.tokens", *v.tokens);
  if (v.types) w.set_i32_array("tokenizer.ggml.token_type", *v.types);
  if (v.scores) w.set_f32_array("tokenizer.ggml.scores", *v.scores);
  if (v.merges) w.set_string_array("tokenizer.ggml.merges", *v.merges);
  if (v.extra) v.extra(w);
  const std::string path = testing::temp_dir() + "/tok.gguf";
  w.write(path);
  const auto g = GgufFile::open(path);
  if (mentions.empty()) {
    EXPECT_NO_THROW(load_gguf_tokenizer(*g));
    return;
  }
  expect_error([&] { load_gguf_tokenizer(*g); }, ErrorCode::bad_tokenizer, path, mentions);
}

template <typename F>
GgufVocab with(F&& change, GgufVocab v = {}) {
  change(v);
  return v;
}

TEST(TokenizerErrors, GgufValidVocabulariesLoad) {
  expect_bad_gguf({}, {});
  expect_bad_gguf(GgufVocab::llama(), {});
  // token_type is optional (llama.cpp defaults every token to normal).
  expect_bad_gguf(with([](GgufVocab& v) { v.types.reset(); }), {});
}

TEST(TokenizerErrors, GgufMissingKeys) {
  expect_bad_gguf(with([](GgufVocab& v) { v.model.reset(); }), {"tokenizer.ggml.model", "missing"});
  expect_bad_gguf(with([](GgufVocab& v) { v.tokens.reset(); }), {"tokenizer.ggml.tokens", "missing"});
  expect_bad_gguf(with([](GgufVocab& v) { v.merges.reset(); }), {"tokenizer.ggml.merges", "missing"});
  expect_bad_gguf(with([](GgufVocab& v) { v.scores.reset(); }, GgufVocab::llama()),
                  {"tokenizer.ggml.scores", "missing"});
}

TEST(TokenizerErrors, GgufWrongValues) {
  expect_bad_gguf(with([](GgufVocab& v) { v.model = "bert"; }),
                  {"tokenizer.ggml.model", "bert", "not supported"});
  expect_bad_gguf(with([](GgufVocab& v) { v.tokens = std::vector<std::string>{}; }),
                  {"tokenizer.ggml.tokens", "no tokens"});
  expect_bad_gguf(with([](GgufVocab& v) {
                    v.tokens.reset();
                    v.extra = [](GgufWriter& w) { w.set_u32("tokenizer.ggml.tokens", 4); };
                  }),
                  {"tokenizer.ggml.tokens", "array of string"});
  expect_bad_gguf(with([](GgufVocab& v) {
                    v.merges.reset();
                    v.extra = [](GgufWriter& w) { w.set_u32("tokenizer.ggml.merges", 1); };
                  }),
                  {"tokenizer.ggml.merges"});
  expect_bad_gguf(with([](GgufVocab& v) {
                    v.extra = [](GgufWriter& w) { w.set_string("tokenizer.ggml.add_bos_token", "yes"); };
                  }),
                  {"tokenizer.ggml.add_bos_token", "bool"});
}

TEST(TokenizerErrors, GgufInconsistentArrays) {
  expect_bad_gguf(with([](GgufVocab& v) {
                    v.types = std::vector<std::int32_t>{3, 1, 1};
                  }),
                  {"tokenizer.ggml.token_type", "3 entries", "has 4"});
  expect_bad_gguf(with([](GgufVocab& v) {
                    v.types = std::vector<std::int32_t>{3, 1, 9, 1};
                  }),
                  {"tokenizer.ggml.token_type", "entry 2", "9"});
  expect_bad_gguf(with(
                      [](GgufVocab& v) {
                        v.scores = std::vector<float>{0, 1};
                      },
                      GgufVocab::llama()),
                  {"tokenizer.ggml.scores", "2 entries", "has 4"});
  expect_bad_gguf(with(
                      [](GgufVocab& v) {
                        v.scores = std::vector<float>{0, std::numeric_limits<float>::quiet_NaN(), -2, -3};
                      },
                      GgufVocab::llama()),
                  {"tokenizer.ggml.scores", "token 1", "not a finite number"});
  expect_bad_gguf(with(
                      [](GgufVocab& v) {
                        v.types = std::vector<std::int32_t>{3, 6, 1, 1};
                      },
                      GgufVocab::llama()),
                  {"token 1", "type byte", "<0xNN>"});
}

TEST(TokenizerErrors, GgufIdsOutOfRange) {
  auto extra = [](std::function<void(GgufWriter&)> f, GgufVocab v = {}) {
    v.extra = std::move(f);
    return v;
  };
  expect_bad_gguf(extra([](GgufWriter& w) { w.set_u32("tokenizer.ggml.eos_token_id", 4); }),
                  {"tokenizer.ggml.eos_token_id", "id 4 out of range"});
  expect_bad_gguf(extra([](GgufWriter& w) { w.set_i32("tokenizer.ggml.bos_token_id", -2); }),
                  {"tokenizer.ggml.bos_token_id", "id -2 out of range"});
  expect_bad_gguf(
      extra([](GgufWriter& w) { w.set_u32("tokenizer.ggml.unknown_token_id", 100); }, GgufVocab::llama()),
      {"tokenizer.ggml.unknown_token_id", "out of range"});
}

TEST(TokenizerErrors, GgufMalformedMerges) {
  auto merges = [](std::vector<std::string> m) { return with([&](GgufVocab& v) { v.merges = m; }); };
  expect_bad_gguf(merges({"a b", "ab"}), {"tokenizer.ggml.merges", "entry 1", "ab"});
  expect_bad_gguf(merges({"a "}), {"tokenizer.ggml.merges", "entry 0"});
  expect_bad_gguf(merges({" a"}), {"tokenizer.ggml.merges", "entry 0"});
}

}  // namespace
}  // namespace qkvshare
