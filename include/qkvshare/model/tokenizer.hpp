#pragma once
// Tokenizers built from a model's own vocabulary data:
//  - SentencePiece-style (scores, greedy highest-score pair merging, byte
//    fallback <0xNN>): llama2.c tokenizer files and GGUF `llama` vocabularies;
//  - GPT-2 byte-level BPE (merge ranks, byte<->unicode mapping, the model's
//    pre-tokenizer regex): GGUF `gpt2` vocabularies such as SmolLM2's.
// Special tokens (control / user-defined) are matched literally in the text
// when encode() is asked to parse them.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "qkvshare/model/chat_template.hpp"  // ChatMessage, format_chatml

namespace qkvshare {

class GgufFile;

using TokenId = std::int32_t;

// GGUF tokenizer.ggml.token_type values.
enum class TokenType : std::int32_t {
  undefined = 0, normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6,
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Text to ids. Never adds BOS (the caller decides, see add_bos()). With
  // parse_special, special-token texts such as "<|im_start|>" become their ids;
  // without, they are tokenized as plain text.
  virtual std::vector<TokenId> encode(std::string_view text, bool parse_special = false) const = 0;

  // The bytes that token `id` contributes when it follows `prev` (-1 at the
  // start). Byte tokens give their raw byte; SentencePiece drops the leading
  // space that its dummy prefix put at the start of the text, i.e. when `prev`
  // is -1 or a control token such as BOS. Control tokens give "".
  virtual std::string token_to_piece(TokenId prev, TokenId id) const = 0;

  // Concatenation of token_to_piece over the sequence, so that
  // decode(encode(s)) == s for any UTF-8 s whose bytes the vocabulary can
  // represent. (SmolLM2's byte-level vocabulary lacks six control bytes and
  // the lead bytes of U+40000..U+BFFFF; encode drops those bytes, as
  // HuggingFace tokenizers and llama.cpp do.)
  std::string decode(std::span<const TokenId> ids) const;

  int vocab_size() const noexcept { return static_cast<int>(pieces_.size()); }
  const std::string& piece(TokenId id) const;     // the stored vocabulary string
  TokenType token_type(TokenId id) const;
  std::optional<TokenId> find(std::string_view piece) const;

  TokenId bos_id() const noexcept { return bos_id_; }
  TokenId eos_id() const noexcept { return eos_id_; }
  bool add_bos() const noexcept { return add_bos_; }
  // End-of-generation tokens: EOS plus end-of-turn tokens such as <|im_end|>.
  bool is_end_of_generation(TokenId id) const noexcept;
  const std::vector<TokenId>& end_of_generation_ids() const noexcept { return eog_ids_; }

 protected:
  // Call once pieces_, types_ and eos_id_ are final: builds the piece index
  // (the lowest id wins for duplicate pieces) and eog_ids_.
  void index_vocabulary();

  struct PieceHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, TokenId, PieceHash, std::equal_to<>> piece_ids_;
  std::vector<std::string> pieces_;
  std::vector<TokenType> types_;
  TokenId bos_id_ = -1;
  TokenId eos_id_ = -1;
  bool add_bos_ = false;
  std::vector<TokenId> eog_ids_;
};

// llama2.c tokenizer file (tok512.bin): int32 max_token_length, then per token
// float32 score, int32 length, bytes. `vocab_size` comes from the checkpoint.
// Throws Error(bad_tokenizer) naming the file, the token index and the reason;
// Error(io) when the file cannot be read. Encoding follows run.c exactly.
std::unique_ptr<Tokenizer> load_llama2c_tokenizer(const std::string& path, int vocab_size);

// From GGUF metadata tokenizer.ggml.* (model "llama" -> SentencePiece,
// "gpt2" -> byte-level BPE with the pre-tokenizer named by tokenizer.ggml.pre;
// an unknown pre value falls back to GPT-2's with a warning on stderr).
// Throws Error(bad_tokenizer) naming the file, key and reason.
std::unique_ptr<Tokenizer> load_gguf_tokenizer(const GgufFile& gguf);


}  // namespace qkvshare
