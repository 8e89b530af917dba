// The reuse index: longest common prefix, block granularity, partitions.
#include <gtest/gtest.h>

#include <numeric>

#include "qkvshare/server/reuse_index.hpp"

using namespace qkvshare;
using namespace qkvshare::server;

namespace {
std::vector<TokenId> seq(int n, int start = 0) {
  std::vector<TokenId> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}
}  // namespace

TEST(ReuseIndex, FindsTheLongestPrefixToTheToken) {
  ReuseIndex idx(4);
  auto a = seq(10);
  auto b = seq(14);
  b[9] = 999;  // b agrees with a prompt for 9 tokens only
  idx.insert(1, "t", a);
  idx.insert(2, "t", b);
  auto prompt = seq(20);
  auto m = idx.longest_prefix("t", prompt);
  EXPECT_EQ(m.context_id, 1u);  // 10 common tokens beat 9
  EXPECT_EQ(m.tokens, 10);
  EXPECT_EQ(m.context_tokens, 10);
  prompt[6] = -5;
  m = idx.longest_prefix("t", prompt);
  EXPECT_EQ(m.tokens, 6);  // inside the second block: still found through the first
}

TEST(ReuseIndex, NeedsOneFullBlockAndRespectsPartitions) {
  ReuseIndex idx(4);
  idx.insert(1, "tenantA\nint8", seq(12));
  EXPECT_EQ(idx.longest_prefix("tenantB\nint8", seq(12)).tokens, 0);
  EXPECT_EQ(idx.longest_prefix("tenantA\nint4", seq(12)).tokens, 0);
  EXPECT_EQ(idx.longest_prefix("tenantA\nint8", seq(3)).tokens, 0);
  auto p = seq(12);
  p[2] = 77;
  EXPECT_EQ(idx.longest_prefix("tenantA\nint8", p).tokens, 0);  // differs inside the first block
  EXPECT_EQ(idx.longest_prefix("tenantA\nint8", seq(12)).tokens, 12);
}

TEST(ReuseIndex, EraseAndReplace) {
  ReuseIndex idx(2);
  idx.insert(1, "t", seq(8));
  idx.insert(2, "t", seq(8));
  EXPECT_EQ(idx.longest_prefix("t", seq(9)).context_id, 2u);  // ties: the newest
  idx.erase(2);
  EXPECT_EQ(idx.longest_prefix("t", seq(9)).context_id, 1u);
  idx.insert(1, "t", seq(4, 100));  // replaced
  EXPECT_EQ(idx.longest_prefix("t", seq(9)).tokens, 0);
  EXPECT_EQ(idx.longest_prefix("t", seq(6, 100)).tokens, 4);
  EXPECT_EQ(idx.size(), 1u);
  idx.erase(1);
  idx.erase(1);
  EXPECT_EQ(idx.size(), 0u);
}

// Spans: runs of other contexts anywhere in a prompt, found through the
// anchors (every 16 tokens), extended both ways, non-overlapping, partitioned.
TEST(ReuseIndex, FindsRunsOfOtherContextsInsideAPrompt) {
  ReuseIndex idx(32);
  const auto reply_a = seq(70, 1000);   // another agent's context
  const auto reply_b = seq(40, 5000);
  idx.insert(1, "t", reply_a);
  idx.insert(2, "t", reply_b);
  idx.insert(3, "u", seq(70, 1000));  // another tenant's copy of A
  // [own 10][A 5..65][own 7][B 0..40][own 3]
  std::vector<TokenId> prompt = seq(10, 1);
  prompt.insert(prompt.end(), reply_a.begin() + 5, reply_a.begin() + 65);
  for (int i = 0; i < 7; ++i) prompt.push_back(900 + i);
  prompt.insert(prompt.end(), reply_b.begin(), reply_b.end());
  for (int i = 0; i < 3; ++i) prompt.push_back(950 + i);
  const int n = static_cast<int>(prompt.size());
  auto spans = idx.spans("t", prompt, 0, n, 32);
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].context_id, 1u);
  EXPECT_EQ(spans[0].prompt_begin, 10);
  EXPECT_EQ(spans[0].context_begin, 5);  // extended back from the anchor at 16
  EXPECT_EQ(spans[0].tokens, 60);
  EXPECT_EQ(spans[1].context_id, 2u);
  EXPECT_EQ(spans[1].prompt_begin, 77);
  EXPECT_EQ(spans[1].context_begin, 0);
  EXPECT_EQ(spans[1].tokens, 40);
  // A window that starts inside A: the run is cut at `from`; a minimum above B's length drops B.
  spans = idx.spans("t", prompt, 20, n, 41);
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].prompt_begin, 20);
  EXPECT_EQ(spans[0].context_begin, 15);
  EXPECT_EQ(spans[0].tokens, 50);
  // `end` bounds the runs; another partition sees only its own contexts.
  EXPECT_EQ(idx.spans("t", prompt, 0, 50, 32).front().tokens, 40);
  EXPECT_EQ(idx.spans("u", prompt, 0, n, 32).size(), 1u);
  EXPECT_TRUE(idx.spans("v", prompt, 0, n, 32).empty());
  idx.erase(1);
  spans = idx.spans("t", prompt, 0, n, 32);
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].context_id, 2u);
}
