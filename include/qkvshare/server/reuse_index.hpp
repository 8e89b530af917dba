#pragma once
// The automatic-reuse index: for an incoming prompt, which sealed context
// shares the longest token prefix with it. Like vLLM's prefix cache it keys
// full blocks by a hash chain (block i's key hashes its tokens together with
// block i-1's key, so equal keys mean equal prefixes), and like vLLM's
// cache_salt every chain starts from a partition string (tenant + KV format)
// so that lookups never cross tenants or formats. Matches are verified
// token by token (a hash collision can only cost a lookup, never a wrong
// reuse) and extended past the last full block to the exact common prefix.
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

 private:
  struct Entry {
    std::string partition;
    std::vector<TokenId> tokens;
    std::vector<std::uint64_t> keys;  // one per full block
    std::uint64_t order = 0;
  };
  std::uint64_t seed(std::string_view partition) const;
  std::uint64_t next_key(std::uint64_t prev, std::span<const TokenId> block) const;

  int block_tokens_;
  std::uint64_t order_ = 0;
  std::unordered_map<std::uint64_t, Entry> contexts_;
  std::unordered_multimap<std::uint64_t, std::uint64_t> by_key_;  // block key -> context id
};

}  // namespace qkvshare::server
