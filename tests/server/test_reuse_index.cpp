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
