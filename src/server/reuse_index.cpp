#include "qkvshare/server/reuse_index.hpp"

#include <xxhash.h>

#include <algorithm>

#include "qkvshare/core/error.hpp"

namespace qkvshare::server {

ReuseIndex::ReuseIndex(int block_tokens) : block_tokens_(block_tokens) {
  if (block_tokens <= 0) fail(ErrorCode::invalid_argument, "reuse index: block size {} must be positive", block_tokens);
}

std::uint64_t ReuseIndex::seed(std::string_view partition) const { return XXH3_64bits(partition.data(), partition.size()); }

std::uint64_t ReuseIndex::next_key(std::uint64_t prev, std::span<const TokenId> block) const {
  return XXH3_64bits_withSeed(block.data(), block.size_bytes(), prev);
}

void ReuseIndex::insert(std::uint64_t context_id, std::string_view partition, std::span<const TokenId> tokens) {
  erase(context_id);
  Entry e{std::string(partition), std::vector<TokenId>(tokens.begin(), tokens.end()), {}, {}, ++order_};
  std::uint64_t key = seed(partition);
  const std::size_t T = static_cast<std::size_t>(block_tokens_);
  for (std::size_t b = 0; (b + 1) * T <= tokens.size(); ++b) {
    key = next_key(key, tokens.subspan(b * T, T));
    e.keys.push_back(key);
    by_key_.emplace(key, context_id);
  }
  const std::uint64_t salt = seed(partition);
  for (std::size_t a = 0; a + kAnchor <= tokens.size(); a += kAnchor) {
    const std::uint64_t h = next_key(salt, tokens.subspan(a, kAnchor));
    e.anchors.push_back(h);
    by_anchor_.emplace(h, std::make_pair(context_id, static_cast<int>(a)));
  }
  contexts_.emplace(context_id, std::move(e));
}

void ReuseIndex::erase(std::uint64_t context_id) {
  const auto it = contexts_.find(context_id);
  if (it == contexts_.end()) return;
  for (std::uint64_t key : it->second.keys) {
    auto [lo, hi] = by_key_.equal_range(key);
    for (auto k = lo; k != hi; ++k)
      if (k->second == context_id) {
        by_key_.erase(k);
        break;
      }
  }
  for (std::uint64_t h : it->second.anchors) {
    auto [lo, hi] = by_anchor_.equal_range(h);
    for (auto k = lo; k != hi; ++k)
      if (k->second.first == context_id) {
        by_anchor_.erase(k);
        break;
      }
  }
  contexts_.erase(it);
}

ReuseIndex::Match ReuseIndex::longest_prefix(std::string_view partition, std::span<const TokenId> prompt) const {
  const std::size_t T = static_cast<std::size_t>(block_tokens_);
  // Walk the prompt's chain while some context has the same key; the
  // candidates of the deepest such block share at least that many blocks.
  std::uint64_t key = seed(partition);
  std::vector<std::uint64_t> candidates;
  for (std::size_t b = 0; (b + 1) * T <= prompt.size(); ++b) {
    key = next_key(key, prompt.subspan(b * T, T));
    auto [lo, hi] = by_key_.equal_range(key);
    if (lo == hi) break;
    candidates.clear();
    for (auto k = lo; k != hi; ++k) candidates.push_back(k->second);
  }
  Match best;
  std::uint64_t best_order = 0;
  for (std::uint64_t id : candidates) {
    const Entry& e = contexts_.at(id);
    if (e.partition != partition) continue;  // a hash collision across partitions
    const std::size_t n = std::min(e.tokens.size(), prompt.size());
    const auto diff = std::mismatch(e.tokens.begin(), e.tokens.begin() + static_cast<std::ptrdiff_t>(n), prompt.begin());
    const int common = static_cast<int>(diff.first - e.tokens.begin());
    if (common < block_tokens_) continue;  // a collision: not even one block agrees
    if (common > best.tokens || (common == best.tokens && e.order > best_order)) {
      best = {id, common, static_cast<int>(e.tokens.size())};
      best_order = e.order;
    }
  }
  return best;
}

std::vector<ReuseIndex::Span> ReuseIndex::spans(std::string_view partition, std::span<const TokenId> prompt, int from,
                                                int end, int min_tokens) const {
  std::vector<Span> out;
  end = std::min(end, static_cast<int>(prompt.size()));
  const std::uint64_t salt = seed(partition);
  int floor = from;  // a span may not reach back before the previous one's end
  for (int i = from; i + kAnchor <= end;) {
    Span best;
    std::uint64_t best_order = 0;
    auto [lo, hi] = by_anchor_.equal_range(next_key(salt, prompt.subspan(static_cast<std::size_t>(i), kAnchor)));
    for (auto k = lo; k != hi; ++k) {
      const Entry& e = contexts_.at(k->second.first);
      if (e.partition != partition) continue;
      const std::span<const TokenId> c(e.tokens);
      const int at = k->second.second;
      if (!std::equal(c.begin() + at, c.begin() + at + kAnchor, prompt.begin() + i)) continue;  // a collision
      int back = 0;
      while (i - back > floor && at - back > 0 && c[static_cast<std::size_t>(at - back - 1)] == prompt[static_cast<std::size_t>(i - back - 1)])
        ++back;
      int fwd = kAnchor;
      while (i + fwd < end && at + fwd < static_cast<int>(c.size()) &&
             c[static_cast<std::size_t>(at + fwd)] == prompt[static_cast<std::size_t>(i + fwd)])
        ++fwd;
      const Span s{i - back, k->second.first, at - back, back + fwd};
      if (s.tokens > best.tokens || (s.tokens == best.tokens && e.order > best_order)) {
        best = s;
        best_order = e.order;
      }
    }
    if (best.tokens >= min_tokens) {
      out.push_back(best);
      i = floor = best.prompt_begin + best.tokens;
    } else {
      ++i;
    }
  }
  return out;
}

}  // namespace qkvshare::server
