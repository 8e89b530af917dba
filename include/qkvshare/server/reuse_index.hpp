#pragma once
// The automatic-reuse index: for an incoming prompt, which sealed context
// shares the longest token prefix with it. Like vLLM's prefix cache it keys
// full blocks by a hash chain (block i's key hashes its tokens together with
// block i-1's key, so equal keys mean equal prefixes), and like vLLM's
// cache_salt every chain starts from a partition string (tenant + KV format)
// so that lookups never cross tenants or formats. Matches are verified
// token by token (a hash collision can only cost a lookup, never a wrong
// reuse) and extended past the last full block to the exact common prefix.
//
// Spans: the same contexts also anchor every kAnchor-token run that starts at
// a multiple of kAnchor (an unchained hash, salted by the partition), so that
// a run of another context's tokens anywhere in a prompt (another agent's
// reply quoted in it) is found by hashing each prompt position once: a common
// run of 2 * kAnchor - 1 tokens or more always holds an anchor.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "qkvshare/model/tokenizer.hpp"

namespace qkvshare::server {

class ReuseIndex {
 public:
  explicit ReuseIndex(int block_tokens);

  // Indexes a context's tokens under `partition`; re-inserting an id replaces it.
  void insert(std::uint64_t context_id, std::string_view partition, std::span<const TokenId> tokens);
  void erase(std::uint64_t context_id);
  std::size_t size() const noexcept { return contexts_.size(); }

  struct Match {
    std::uint64_t context_id = 0;
    int tokens = 0;          // common prefix length; 0: no match
    int context_tokens = 0;  // the matched context's length
  };
  // The longest common prefix (at least one full block) among the contexts of
  // `partition`; ties go to the most recently inserted context.
  Match longest_prefix(std::string_view partition, std::span<const TokenId> prompt) const;

  static constexpr int kAnchor = 16;
  struct Span {
    int prompt_begin = 0;
    std::uint64_t context_id = 0;
    int context_begin = 0;
    int tokens = 0;
  };
  // Runs of at least `min_tokens` tokens of prompt[from, end) that equal runs
  // of contexts of `partition`, left to right, not overlapping: at each
  // position the longest run found (ties: the most recent context), extended
  // both ways and verified token by token.
  std::vector<Span> spans(std::string_view partition, std::span<const TokenId> prompt, int from, int end,
                          int min_tokens) const;

 private:
  struct Entry {
    std::string partition;
    std::vector<TokenId> tokens;
    std::vector<std::uint64_t> keys;  // one per full block
    std::vector<std::uint64_t> anchors;  // one per kAnchor tokens
    std::uint64_t order = 0;
  };
  std::uint64_t seed(std::string_view partition) const;
  std::uint64_t next_key(std::uint64_t prev, std::span<const TokenId> block) const;

  int block_tokens_;
  std::uint64_t order_ = 0;
  std::unordered_map<std::uint64_t, Entry> contexts_;
  std::unordered_multimap<std::uint64_t, std::uint64_t> by_key_;  // block key -> context id
  std::unordered_multimap<std::uint64_t, std::pair<std::uint64_t, int>> by_anchor_;  // anchor -> (context, position)
};

}  // namespace qkvshare::server
