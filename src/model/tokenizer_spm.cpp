#include "tokenizer_spm.hpp"

#include <optional>
#include <queue>
#include <utility>

#include "qkvshare/core/error.hpp"

namespace qkvshare::detail {

namespace {

constexpr std::string_view kSpaceMark = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space

// run.c starts its best score at -1e10, so pairs scoring at or below it never merge.
constexpr float kNoMergeScore = -1e10f;

std::string unescape_whitespace(std::string_view piece) {
  std::string out;
  out.reserve(piece.size());
  for (std::size_t i = 0; i < piece.size();) {
    if (piece.substr(i, kSpaceMark.size()) == kSpaceMark) {
      out += ' ';
      i += kSpaceMark.size();
    } else {
      out += piece[i++];
    }
  }
  return out;
}

}  // namespace

SpmTokenizer::SpmTokenizer(SpmVocabulary vocab)
    : scores_(std::move(vocab.scores)),
      add_space_prefix_(vocab.add_space_prefix),
      escape_whitespace_(vocab.escape_whitespace) {
  pieces_ = std::move(vocab.pieces);
  types_ = std::move(vocab.types);
  QKV_CHECK(scores_.size() == pieces_.size() && types_.size() == pieces_.size());
  bos_id_ = vocab.bos_id;
  eos_id_ = vocab.eos_id;
  add_bos_ = vocab.add_bos;
  index_vocabulary();
  specials_ = SpecialTokenMatcher(pieces_, types_);

  build_pair_merges();

  // The byte fallback uses the byte pieces by name, which for llama2.c files
  // gives run.c's "byte + 3" because ids 3..258 are <0x00>..<0xFF>.
  byte_ids_.fill(vocab.unk_id);
  decoded_.resize(pieces_.size());
  for (std::size_t id = pieces_.size(); id-- > 0;) {
    const std::string& p = pieces_[id];
    switch (types_[id]) {
      case TokenType::control:
        break;  // decodes to ""
      case TokenType::byte: {
        const auto byte = parse_byte_piece(p);
        QKV_CHECK(byte.has_value());
        byte_ids_[*byte] = static_cast<TokenId>(id);  // walking down: the lowest id wins
        decoded_[id] = std::string(1, static_cast<char>(*byte));
        break;
      }
      default:
        decoded_[id] = escape_whitespace_ ? unescape_whitespace(p) : p;
        break;
    }
  }
}

void SpmTokenizer::build_pair_merges() {
  canonical_.resize(pieces_.size());
  for (std::size_t id = 0; id < pieces_.size(); ++id) canonical_[id] = piece_ids_.find(pieces_[id])->second;
  const std::optional<TokenId> empty = find("");
  for (std::size_t id = 0; id < pieces_.size(); ++id) {
    const auto c = static_cast<TokenId>(id);
    if (canonical_[id] != c || !(scores_[id] > kNoMergeScore)) continue;
    const std::string_view p = pieces_[id];
    for (std::size_t k = 1; k < p.size(); ++k) {
      const auto a = find(p.substr(0, k));
      const auto b = find(p.substr(k));
      if (a && b) pair_merges_.emplace(pair_key(*a, *b), c);
    }
    if (empty) {  // "" + p == p + "" == p
      pair_merges_.emplace(pair_key(*empty, c), c);
      pair_merges_.emplace(pair_key(c, *empty), c);
    }
  }
}

std::vector<TokenId> SpmTokenizer::encode(std::string_view text, bool parse_special) const {
  std::vector<TokenId> out;
  // As llama.cpp: every stretch of text at the start or after a special token
  // gets the dummy prefix, so that decoding can drop it there again.
  bool after_special = true;
  for (const TextFragment& f : specials_.split(text, parse_special)) {
    if (f.special >= 0) {
      out.push_back(f.special);
      after_special = true;
    } else {
      encode_text(f.text, add_space_prefix_ && after_special, out);
      after_special = false;
    }
  }
  return out;
}

void SpmTokenizer::encode_text(std::string_view text, bool space_prefix, std::vector<TokenId>& out) const {
  if (text.empty()) return;
  std::string buf;
  buf.reserve(text.size() + 4);
  const std::string_view space = escape_whitespace_ ? kSpaceMark : std::string_view(" ");
  for (const char c : text) {
    if (c == ' ') {
      buf += space;
    } else {
      buf += c;
    }
  }

  // A doubly linked list of symbols; a merge keeps the left symbol's index,
  // so indices stay in text order and "leftmost" is "smallest index".
  struct Symbol {
    TokenId id;
    int prev;
    int next;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(buf.size());
  auto push = [&symbols](TokenId id) {
    const int index = static_cast<int>(symbols.size());
    symbols.push_back({id, index - 1, index + 1});
  };
  auto push_text = [&](std::string_view cp) {
    if (const auto it = piece_ids_.find(cp); it != piece_ids_.end()) {
      push(it->second);
    } else {
      for (const char b : cp) push(byte_ids_[static_cast<unsigned char>(b)]);
    }
  };
  // The dummy prefix is a symbol of its own even when the text starts with a
  // stray continuation byte (run.c looks it up separately).
  if (space_prefix) push_text(space);
  // run.c groups a byte with the continuation bytes after it, at most 4 in all.
  for (std::size_t i = 0; i < buf.size();) {
    std::size_t j = i + 1;
    while (j < buf.size() && (static_cast<unsigned char>(buf[j]) & 0xC0) == 0x80 && j - i < 4) ++j;
    push_text(std::string_view(buf.data() + i, j - i));
    i = j;
  }
  symbols.back().next = -1;

  struct Candidate {
    float score;
    int left;
    int right;
    TokenId left_id;
    TokenId right_id;
    TokenId merged;
  };
  // Highest score first; on equal scores the leftmost pair, as run.c's scan.
  auto lower_priority = [](const Candidate& a, const Candidate& b) {
    if (a.score != b.score) return a.score < b.score;
    return a.left > b.left;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(lower_priority)> queue(lower_priority);
  auto consider = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const TokenId a = symbols[static_cast<std::size_t>(left)].id;
    const TokenId b = symbols[static_cast<std::size_t>(right)].id;
    if (a < 0 || b < 0) return;  // an unknown byte with no <unk> in the vocabulary
    const auto it = pair_merges_.find(
        pair_key(canonical_[static_cast<std::size_t>(a)], canonical_[static_cast<std::size_t>(b)]));
    if (it == pair_merges_.end()) return;
    queue.push({scores_[static_cast<std::size_t>(it->second)], left, right, a, b, it->second});
  };
  for (std::size_t i = 0; i + 1 < symbols.size(); ++i) consider(static_cast<int>(i), static_cast<int>(i + 1));

  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = symbols[static_cast<std::size_t>(c.left)];
    Symbol& right = symbols[static_cast<std::size_t>(c.right)];
    // Stale entries: one side was merged away or changed since the push.
    if (left.next != c.right || left.id != c.left_id || right.id != c.right_id) continue;
    left.id = c.merged;
    left.next = right.next;
    if (right.next >= 0) symbols[static_cast<std::size_t>(right.next)].prev = c.left;
    right.id = -1;
    right.prev = right.next = -1;
    consider(left.prev, c.left);
    consider(c.left, left.next);
  }

  for (int i = 0; i >= 0; i = symbols[static_cast<std::size_t>(i)].next) {
    const TokenId id = symbols[static_cast<std::size_t>(i)].id;
    if (id >= 0) out.push_back(id);
  }
}

std::string SpmTokenizer::token_to_piece(TokenId prev, TokenId id) const {
  const TokenType type = token_type(id);  // range-checks id
  const std::string& text = decoded_[static_cast<std::size_t>(id)];
  const bool at_start =
      prev < 0 || (prev < vocab_size() && types_[static_cast<std::size_t>(prev)] == TokenType::control);
  // The dummy prefix's space follows BOS (run.c) or starts the text.
  if (add_space_prefix_ && at_start && type != TokenType::byte && !text.empty() && text[0] == ' ')
    return text.substr(1);
  return text;
}

}  // namespace qkvshare::detail
