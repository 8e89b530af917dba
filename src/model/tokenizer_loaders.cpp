// Building tokenizers from llama2.c tokenizer files and GGUF metadata. All
// input is validated here, so the tokenizer classes can rely on it.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"
#include "qkvshare/model/gguf.hpp"
#include "tokenizer_bpe.hpp"
#include "tokenizer_spm.hpp"

namespace qkvshare {

namespace {

using detail::parse_byte_piece;

std::vector<char> read_whole_file(const std::string& path) {
  check_input_file(path, "tokenizer file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::io, "{}: cannot open tokenizer file: {}", path, std::strerror(errno));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail(ErrorCode::io, "{}: read failed", path);
  return bytes;
}

// Bounds-checked little-endian reads over the file's bytes.
class Reader {
 public:
  Reader(const std::vector<char>& bytes, const std::string& path) : bytes_(bytes), path_(path) {}
  std::size_t offset() const noexcept { return offset_; }
  std::size_t left() const noexcept { return bytes_.size() - offset_; }

  template <typename T>
  T read(std::string_view item) {
    T v;
    need(sizeof(T), item);
    std::memcpy(&v, bytes_.data() + offset_, sizeof(T));
    offset_ += sizeof(T);
    return v;
  }
  std::string read_string(std::size_t n, std::string_view item) {
    need(n, item);
    std::string s(bytes_.data() + offset_, n);
    offset_ += n;
    return s;
  }

 private:
  void need(std::size_t n, std::string_view item) const {
    if (n > left())
      fail(ErrorCode::bad_tokenizer, "{}: {}: truncated: needs {} bytes at offset {}, file is {} bytes",
           path_, item, n, offset_, bytes_.size());
  }
  const std::vector<char>& bytes_;
  const std::string& path_;
  std::size_t offset_ = 0;
};

}  // namespace

std::unique_ptr<Tokenizer> load_llama2c_tokenizer(const std::string& path, int vocab_size) {
  if (vocab_size <= 0)
    fail(ErrorCode::bad_tokenizer, "{}: vocab_size {} (from the checkpoint) must be positive", path,
         vocab_size);
  const std::vector<char> bytes = read_whole_file(path);
  Reader r(bytes, path);
  const auto max_token_length = r.read<std::int32_t>("header max_token_length");
  if (max_token_length <= 0)
    fail(ErrorCode::bad_tokenizer, "{}: header: max_token_length {} must be positive", path,
         max_token_length);

  detail::SpmVocabulary v;
  const auto n = static_cast<std::size_t>(vocab_size);
  // A corrupt checkpoint may claim a huge vocabulary: reserve no more than the
  // file can hold (8 bytes per token at least), the loop reports the rest.
  const std::size_t fits = std::min(n, r.left() / 8);
  v.pieces.reserve(fits);
  v.scores.reserve(fits);
  v.types.reserve(fits);
  for (std::size_t i = 0; i < n; ++i) {
    if (r.left() == 0)
      fail(ErrorCode::bad_tokenizer, "{}: token {}: file ends after {} of {} tokens", path, i, i, vocab_size);
    const std::string item = fmt::format("token {}", i);
    const auto score = r.read<float>(item + " score");
    if (!std::isfinite(score))  // merges are ranked by score: a NaN would break the ordering
      fail(ErrorCode::bad_tokenizer, "{}: token {}: score {} is not a finite number", path, i, score);
    const auto length = r.read<std::int32_t>(item + " length");
    if (length < 0 || length > max_token_length)
      fail(ErrorCode::bad_tokenizer, "{}: token {}: length {} outside [0, max_token_length {}]", path, i,
           length, max_token_length);
    v.pieces.push_back(r.read_string(static_cast<std::size_t>(length), item + " bytes"));
    v.scores.push_back(score);
    // llama2.c's fixed layout: <unk>, <s>, </s>, then the byte tokens.
    TokenType type = TokenType::normal;
    if (i == 0)
      type = TokenType::unknown;
    else if (i <= 2)
      type = TokenType::control;
    else if (i <= 258 && parse_byte_piece(v.pieces.back()) == static_cast<std::uint8_t>(i - 3))
      type = TokenType::byte;
    v.types.push_back(type);
  }
  v.unk_id = 0;
  v.bos_id = vocab_size > 1 ? 1 : -1;
  v.eos_id = vocab_size > 2 ? 2 : -1;
  v.add_bos = true;
  v.add_space_prefix = true;
  v.escape_whitespace = false;
  return std::make_unique<detail::SpmTokenizer>(std::move(v));
}

namespace {

// GGUF getters throw bad_model_file; for tokenizer keys report bad_tokenizer.
template <typename F>
auto tokenizer_key(F&& get) -> decltype(get()) {
  try {
    return get();
  } catch (const Error& e) {
    if (e.code() != ErrorCode::bad_model_file) throw;
    fail(ErrorCode::bad_tokenizer, "{}", e.what());
  }
}

constexpr std::string_view kTokens = "tokenizer.ggml.tokens";

std::vector<TokenType> read_types(const GgufFile& g, std::size_t n) {
  constexpr std::string_view key = "tokenizer.ggml.token_type";
  std::vector<TokenType> types(n, TokenType::normal);
  if (!g.has(key)) return types;
  const auto& raw = tokenizer_key([&]() -> const auto& { return g.get_number_array(key); });
  if (raw.size() != n)
    fail(ErrorCode::bad_tokenizer, "{}: key '{}': {} entries, but {} has {}", g.path(), key, raw.size(),
         kTokens, n);
  for (std::size_t i = 0; i < n; ++i) {
    const double t = raw[i];
    if (!(t >= 0 && t <= 6) || t != std::floor(t))
      fail(ErrorCode::bad_tokenizer, "{}: key '{}': entry {}: {} is not a token type 0..6", g.path(), key, i,
           t);
    types[i] = static_cast<TokenType>(static_cast<int>(t));
  }
  return types;
}

TokenId read_id(const GgufFile& g, std::string_view key, std::size_t n, TokenId fallback) {
  const auto id = tokenizer_key([&] { return g.find_int(key); });
  if (!id) return fallback;
  if (*id < 0 || static_cast<std::uint64_t>(*id) >= n)
    fail(ErrorCode::bad_tokenizer, "{}: key '{}': id {} out of range [0, {})", g.path(), key, *id, n);
  return static_cast<TokenId>(*id);
}

bool read_bool(const GgufFile& g, std::string_view key, bool fallback) {
  return tokenizer_key([&] { return g.find_bool(key); }).value_or(fallback);
}

std::unique_ptr<Tokenizer> load_spm(const GgufFile& g, std::vector<std::string> pieces,
                                    std::vector<TokenType> types) {
  constexpr std::string_view key = "tokenizer.ggml.scores";
  const std::size_t n = pieces.size();
  if (!g.has(key))
    fail(ErrorCode::bad_tokenizer, "{}: key '{}': missing (needed by a llama vocabulary)", g.path(), key);
  const auto& raw = tokenizer_key([&]() -> const auto& { return g.get_number_array(key); });
  if (raw.size() != n)
    fail(ErrorCode::bad_tokenizer, "{}: key '{}': {} entries, but {} has {}", g.path(), key, raw.size(),
         kTokens, n);
  detail::SpmVocabulary v;
  v.scores.assign(raw.begin(), raw.end());
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(v.scores[i]))  // merges are ranked by score: a NaN would break the ordering
      fail(ErrorCode::bad_tokenizer, "{}: key '{}': token {}: score {} is not a finite number", g.path(), key, i,
           v.scores[i]);
    const bool looks_byte = parse_byte_piece(pieces[i]).has_value();
    if (types[i] == TokenType::byte && !looks_byte)
      fail(ErrorCode::bad_tokenizer, "{}: token {}: type byte but the piece is {:?}, not <0xNN>", g.path(), i,
           pieces[i]);
    // Without token types, recognise the byte pieces by their form.
    if (!g.has("tokenizer.ggml.token_type") && looks_byte) types[i] = TokenType::byte;
  }
  v.pieces = std::move(pieces);
  v.types = std::move(types);
  // llama.cpp's defaults for SentencePiece vocabularies.
  v.unk_id = read_id(g, "tokenizer.ggml.unknown_token_id", n, n > 0 ? 0 : -1);
  v.bos_id = read_id(g, "tokenizer.ggml.bos_token_id", n, n > 1 ? 1 : -1);
  v.eos_id = read_id(g, "tokenizer.ggml.eos_token_id", n, n > 2 ? 2 : -1);
  v.add_bos = read_bool(g, "tokenizer.ggml.add_bos_token", true);
  v.add_space_prefix = read_bool(g, "tokenizer.ggml.add_space_prefix", true);
  v.escape_whitespace = true;
  return std::make_unique<detail::SpmTokenizer>(std::move(v));
}

std::unique_ptr<Tokenizer> load_bpe(const GgufFile& g, std::vector<std::string> pieces,
                                    std::vector<TokenType> types) {
  constexpr std::string_view key = "tokenizer.ggml.merges";
  const std::size_t n = pieces.size();
  if (!g.has(key))
    fail(ErrorCode::bad_tokenizer, "{}: key '{}': missing (needed by a gpt2 vocabulary)", g.path(), key);
  detail::BpeVocabulary v;
  v.merges = tokenizer_key([&]() -> const auto& { return g.get_string_array(key); });
  for (std::size_t i = 0; i < v.merges.size(); ++i) {
    const std::string& m = v.merges[i];
    // As llama.cpp: the separator is the first space after the first byte.
    const auto space = m.find(' ', 1);
    if (space == std::string::npos || space + 1 == m.size())
      fail(ErrorCode::bad_tokenizer, "{}: key '{}': entry {}: {:?} is not \"left right\"", g.path(), key, i,
           m);
  }
  v.pre = tokenizer_key([&] { return g.find_string("tokenizer.ggml.pre"); }).value_or("default");
  v.pieces = std::move(pieces);
  v.types = std::move(types);
  v.bos_id = read_id(g, "tokenizer.ggml.bos_token_id", n, -1);
  v.eos_id = read_id(g, "tokenizer.ggml.eos_token_id", n, -1);
  v.add_bos = read_bool(g, "tokenizer.ggml.add_bos_token", false);
  return std::make_unique<detail::BpeTokenizer>(std::move(v));
}

}  // namespace

std::unique_ptr<Tokenizer> load_gguf_tokenizer(const GgufFile& g) {
  constexpr std::string_view model_key = "tokenizer.ggml.model";
  if (!g.has(model_key)) fail(ErrorCode::bad_tokenizer, "{}: key '{}': missing", g.path(), model_key);
  const std::string model = tokenizer_key([&] { return g.get_string(model_key); });
  if (model != "llama" && model != "gpt2")
    fail(ErrorCode::bad_tokenizer, "{}: key '{}': tokenizer model {:?} is not supported (llama, gpt2)",
         g.path(), model_key, model);

  if (!g.has(kTokens)) fail(ErrorCode::bad_tokenizer, "{}: key '{}': missing", g.path(), kTokens);
  std::vector<std::string> pieces =
      tokenizer_key([&]() -> const auto& { return g.get_string_array(kTokens); });
  if (pieces.empty()) fail(ErrorCode::bad_tokenizer, "{}: key '{}': no tokens", g.path(), kTokens);
  if (pieces.size() > static_cast<std::size_t>(std::numeric_limits<TokenId>::max()))
    fail(ErrorCode::bad_tokenizer, "{}: key '{}': {} tokens is too many", g.path(), kTokens, pieces.size());
  std::vector<TokenType> types = read_types(g, pieces.size());
  if (model == "llama") return load_spm(g, std::move(pieces), std::move(types));
  return load_bpe(g, std::move(pieces), std::move(types));
}

}  // namespace qkvshare
