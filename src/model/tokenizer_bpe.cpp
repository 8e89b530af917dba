#include "tokenizer_bpe.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <queue>
#include <unordered_set>

#include "qkvshare/core/error.hpp"

namespace qkvshare::detail {

namespace {

constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Regex =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes stand for themselves,
// the others take code points 256, 257, ... in byte order.
std::array<char32_t, 256> byte_code_points() {
  std::array<char32_t, 256> cps{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    cps[static_cast<std::size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
  }
  return cps;
}

}  // namespace

std::vector<std::string> pretokenizer_regexes(std::string_view pre, bool& known) {
  known = true;
  static const std::unordered_set<std::string_view> digit_split = {
      "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"};
  if (digit_split.contains(pre)) return {R"(\p{N})", kGpt2Regex};
  if (pre == "gpt2" || pre == "default") return {kGpt2Regex};
  if (pre == "llama3" || pre == "llama-bpe" || pre == "llama-v3") return {kLlama3Regex};
  if (pre == "qwen2") return {kQwen2Regex};
  known = false;
  return {kGpt2Regex};
}

class BpeTokenizer::Regex {
 public:
  explicit Regex(const std::string& pattern) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    // MATCH_INVALID_UTF: invalid UTF-8 never matches instead of failing the
    // match, so such bytes become chunks of their own and still round-trip.
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof(message));
      fail(ErrorCode::internal, "pre-tokenizer regex {:?} at {}: {}", pattern, offset,
           reinterpret_cast<const char*>(message));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // the interpreter still works if JIT is unavailable
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Splits [offset, offset+length) of text into matches and the gaps between them.
  void split(std::string_view text, Chunk chunk, pcre2_match_data* match, std::vector<Chunk>& out) const {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data() + chunk.first);
    const std::size_t length = chunk.second;
    std::size_t gap_start = 0;
    std::size_t search = 0;
    while (search < length) {
      const int rc = pcre2_match(code_, subject, length, search, 0, match, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) fail(ErrorCode::internal, "pre-tokenizer regex match failed with PCRE2 error {}", rc);
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
      const std::size_t start = ovector[0];
      const std::size_t end = ovector[1];
      if (end == start) {  // none of the patterns can match empty; never loop
        search = start + 1;
        continue;
      }
      if (start > gap_start) out.emplace_back(chunk.first + gap_start, start - gap_start);
      out.emplace_back(chunk.first + start, end - start);
      gap_start = search = end;
    }
    if (length > gap_start) out.emplace_back(chunk.first + gap_start, length - gap_start);
  }

  pcre2_code* code() const noexcept { return code_; }

 private:
  pcre2_code* code_ = nullptr;
};

BpeTokenizer::BpeTokenizer(BpeVocabulary vocab) {
  pieces_ = std::move(vocab.pieces);
  types_ = std::move(vocab.types);
  QKV_CHECK(types_.size() == pieces_.size());
  bos_id_ = vocab.bos_id;
  eos_id_ = vocab.eos_id;
  add_bos_ = vocab.add_bos;
  index_vocabulary();
  specials_ = SpecialTokenMatcher(pieces_, types_);

  bool known = true;
  for (const std::string& pattern : pretokenizer_regexes(vocab.pre, known))
    regexes_.push_back(std::make_unique<Regex>(pattern));
  if (!known)
    fmt::print(stderr, "warning: unknown tokenizer.ggml.pre {:?}; using the GPT-2 pre-tokenizer\n",
               vocab.pre);

  merge_ranks_.reserve(vocab.merges.size());
  for (std::size_t rank = 0; rank < vocab.merges.size(); ++rank)
    merge_ranks_.emplace(std::move(vocab.merges[rank]), static_cast<int>(rank));  // first rank wins

  const auto cps = byte_code_points();
  std::unordered_map<char32_t, char> byte_of;
  for (std::size_t b = 0; b < 256; ++b) {
    byte_chars_[b] = utf8_encode(cps[b]);
    byte_of.emplace(cps[b], static_cast<char>(b));
  }
  decoded_.resize(pieces_.size());
  for (std::size_t id = 0; id < pieces_.size(); ++id) {
    const std::string& p = pieces_[id];
    if (types_[id] == TokenType::control) continue;
    if (types_[id] == TokenType::user_defined) {  // stored as raw text, not byte-mapped (llama.cpp)
      decoded_[id] = p;
      continue;
    }
    std::string& d = decoded_[id];
    for (std::size_t pos = 0; pos < p.size();) {
      const std::size_t before = pos;
      const auto cp = utf8_decode(p, pos);
      if (!cp) {  // not valid UTF-8: keep the byte as it is
        d += p[pos++];
        continue;
      }
      const auto it = byte_of.find(*cp);
      d += it != byte_of.end() ? std::string(1, it->second) : p.substr(before, pos - before);
    }
  }
}

BpeTokenizer::~BpeTokenizer() = default;

std::vector<BpeTokenizer::Chunk> BpeTokenizer::pre_tokenize(std::string_view text) const {
  std::vector<Chunk> chunks{{0, text.size()}};
  std::vector<Chunk> next;
  for (const auto& regex : regexes_) {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match(
        pcre2_match_data_create_from_pattern(regex->code(), nullptr), &pcre2_match_data_free);
    if (!match) fail(ErrorCode::out_of_memory, "pcre2_match_data_create_from_pattern failed");
    next.clear();
    next.reserve(chunks.size() * 2);
    for (const Chunk& c : chunks) regex->split(text, c, match.get(), next);
    chunks.swap(next);
  }
  return chunks;
}

std::vector<TokenId> BpeTokenizer::encode(std::string_view text, bool parse_special) const {
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 1);
  for (const TextFragment& f : specials_.split(text, parse_special)) {
    if (f.special >= 0) {
      out.push_back(f.special);
      continue;
    }
    for (const Chunk& c : pre_tokenize(f.text)) encode_chunk(f.text.substr(c.first, c.second), out);
  }
  return out;
}

void BpeTokenizer::encode_chunk(std::string_view chunk, std::vector<TokenId>& out) const {
  {
    std::lock_guard lock(cache_mutex_);
    if (const auto it = cache_.find(chunk); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<TokenId> ids;
  merge_chunk(chunk, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard lock(cache_mutex_);
  if (cache_.size() >= 1 << 16) cache_.clear();  // bounded: prose has far fewer distinct words
  cache_.emplace(std::string(chunk), std::move(ids));
}

void BpeTokenizer::merge_chunk(std::string_view chunk, std::vector<TokenId>& out) const {
  // Symbols are byte ranges of the byte-mapped text; a merge keeps the left
  // symbol's index, so "leftmost" is "smallest index".
  struct Symbol {
    std::size_t start;
    std::size_t length;  // 0 once merged into its left neighbour
    int prev;
    int next;
  };
  std::string mapped;
  std::vector<Symbol> symbols;
  symbols.reserve(chunk.size());
  for (const char b : chunk) {
    const std::string& c = byte_chars_[static_cast<unsigned char>(b)];
    const int index = static_cast<int>(symbols.size());
    symbols.push_back({mapped.size(), c.size(), index - 1, index + 1});
    mapped += c;
  }
  symbols.back().next = -1;
  auto text_of = [&](const Symbol& s) { return std::string_view(mapped).substr(s.start, s.length); };

  struct Candidate {
    int rank;
    int left;
    int right;
    std::size_t left_length;
    std::size_t right_length;
  };
  // Lowest rank first, then the leftmost pair (HuggingFace's BPE word merge).
  auto lower_priority = [](const Candidate& a, const Candidate& b) {
    if (a.rank != b.rank) return a.rank > b.rank;
    return a.left > b.left;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(lower_priority)> queue(lower_priority);
  std::string key;
  auto consider = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const Symbol& l = symbols[static_cast<std::size_t>(left)];
    const Symbol& r = symbols[static_cast<std::size_t>(right)];
    key.assign(text_of(l));
    key += ' ';
    key += text_of(r);
    const auto it = merge_ranks_.find(key);
    if (it != merge_ranks_.end()) queue.push({it->second, left, right, l.length, r.length});
  };
  for (std::size_t i = 0; i + 1 < symbols.size(); ++i) consider(static_cast<int>(i), static_cast<int>(i + 1));

  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& l = symbols[static_cast<std::size_t>(c.left)];
    Symbol& r = symbols[static_cast<std::size_t>(c.right)];
    // Stale entries: a side was merged away or grew since the push.
    if (l.next != c.right || l.length != c.left_length || r.length != c.right_length) continue;
    l.length += r.length;
    l.next = r.next;
    if (r.next >= 0) symbols[static_cast<std::size_t>(r.next)].prev = c.left;
    r.length = 0;
    r.next = r.prev = -1;
    consider(l.prev, c.left);
    consider(c.left, l.next);
  }

  for (int i = 0; i >= 0; i = symbols[static_cast<std::size_t>(i)].next) {
    const Symbol& s = symbols[static_cast<std::size_t>(i)];
    if (const auto it = piece_ids_.find(text_of(s)); it != piece_ids_.end()) {
      out.push_back(it->second);
      continue;
    }
    // A merge result missing from the vocabulary: fall back to its bytes' tokens.
    for (std::size_t b = 0; b < s.length;) {
      std::size_t end = b + utf8_sequence_length(static_cast<unsigned char>(mapped[s.start + b]));
      if (const auto byte_it = piece_ids_.find(text_of({s.start + b, end - b, -1, -1}));
          byte_it != piece_ids_.end())
        out.push_back(byte_it->second);
      b = end;
    }
  }
}

std::string BpeTokenizer::token_to_piece(TokenId /*prev*/, TokenId id) const {
  (void)token_type(id);  // range check
  return decoded_[static_cast<std::size_t>(id)];
}

}  // namespace qkvshare::detail
