#pragma once
// GPT-2 byte-level BPE: regex pre-tokenization (PCRE2), bytes mapped to
// printable code points, rank-ordered merges.
#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "qkvshare/model/tokenizer.hpp"
#include "tokenizer_common.hpp"

namespace qkvshare::detail {

struct BpeVocabulary {
  std::vector<std::string> pieces;  // byte-mapped, as in tokenizer.ggml.tokens
  std::vector<TokenType> types;
  std::vector<std::string> merges;  // "left right", rank = index; a space at index >= 1
  std::string pre;                  // tokenizer.ggml.pre
  TokenId bos_id = -1;
  TokenId eos_id = -1;
  bool add_bos = false;
};

// The regexes that llama.cpp applies for a tokenizer.ggml.pre value, in order;
// each one splits every chunk that the previous ones produced. Unknown values
// give GPT-2's regex and known = false.
std::vector<std::string> pretokenizer_regexes(std::string_view pre, bool& known);

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(BpeVocabulary vocab);
  ~BpeTokenizer() override;

  std::vector<TokenId> encode(std::string_view text, bool parse_special = false) const override;
  std::string token_to_piece(TokenId prev, TokenId id) const override;

 private:
  class Regex;
  using Chunk = std::pair<std::size_t, std::size_t>;  // offset, length
  std::vector<Chunk> pre_tokenize(std::string_view text) const;
  void encode_chunk(std::string_view chunk, std::vector<TokenId>& out) const;
  void merge_chunk(std::string_view chunk, std::vector<TokenId>& out) const;

  std::vector<std::unique_ptr<Regex>> regexes_;
  std::unordered_map<std::string, int, PieceHash, std::equal_to<>> merge_ranks_;
  std::array<std::string, 256> byte_chars_;  // byte -> its GPT-2 code point, UTF-8
  std::vector<std::string> decoded_;         // per token: its bytes in decoded text
  SpecialTokenMatcher specials_;

  // Pre-tokenized chunks repeat a lot (words); encode() is const and may run
  // on several threads, hence the mutex.
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<TokenId>, PieceHash, std::equal_to<>> cache_;
};

}  // namespace qkvshare::detail
