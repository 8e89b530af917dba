// Bounded random-mutation test of the descriptor parser and of open(), run in
// normal CI and under ASan+UBSan (tests/fuzz/fuzz_descriptor.cpp is the
// libFuzzer counterpart). Valid descriptors of a live pool are damaged with a
// seeded PRNG (bit flips, byte writes, truncation, extension, forged fields
// with the self checksum recomputed so that the deeper checks run); decode()
// and open() must either succeed or throw Error(bad_descriptor), never crash
// or throw anything else, and only the untouched descriptor may open.
// QKVSHARE_DESCRIPTOR_MUTATIONS overrides the iteration count; a failure
// prints the iteration, which reproduces it (the PRNG is seeded per iteration).
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdlib>
#include <cstring>
#include <random>

#include "qkvshare/core/error.hpp"
#include "share_test_util.hpp"

namespace qkvshare {
namespace {

std::size_t iterations() {
  if (const char* env = std::getenv("QKVSHARE_DESCRIPTOR_MUTATIONS"); env != nullptr && *env != '\0')
    return static_cast<std::size_t>(std::strtoull(env, nullptr, 10));
  return 20000;
}

// Offsets and widths of the integer fields (docs/handoff.md).
constexpr std::pair<std::size_t, int> kFields[] = {
    {8, 2},  {10, 2}, {12, 4},  {16, 8},  {24, 8},  {32, 4},  {36, 4},  {40, 4},  {44, 4},  {48, 4},
    {52, 4}, {56, 4}, {60, 4},  {64, 4},  {68, 4},  {72, 4},  {76, 4},  {80, 4},  {84, 4},  {104, 8},
    {112, 8}, {120, 8}, {128, 8}, {136, 8}};

void reseal(std::vector<std::uint8_t>& b) {
  if (b.size() < kDescriptorBytes) return;
  const std::uint64_t sum = XXH3_64bits(b.data(), 248);
  for (int i = 0; i < 8; ++i) b[248 + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(sum >> (8 * i));
}

void mutate(std::mt19937_64& rng, std::vector<std::uint8_t>& b) {
  const auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  switch (pick(6)) {
    case 0:
      if (!b.empty()) b[pick(b.size())] ^= static_cast<std::uint8_t>(1u << pick(8));
      break;
    case 1:
      if (!b.empty()) b[pick(b.size())] = static_cast<std::uint8_t>(rng());
      break;
    case 2:
      b.resize(pick(b.size() + 1));
      break;
    case 3:
      b.insert(b.begin() + static_cast<std::ptrdiff_t>(pick(b.size() + 1)), 1 + pick(8), static_cast<std::uint8_t>(rng()));
      break;
    default: {  // a forged field value that passes the self checksum
      const auto [at, width] = kFields[pick(std::size(kFields))];
      const std::uint64_t values[] = {0, 1, 2, 31, 32, 33, 255, 256, 0xffff, 0x7fffffff, 0xffffffff, ~0ull, rng()};
      std::uint64_t v = values[pick(std::size(values))];
      if (pick(3) == 0) {  // off by one from the real value
        std::uint64_t cur = 0;
        for (int i = 0; i < width && at + static_cast<std::size_t>(i) < b.size(); ++i)
          cur |= std::uint64_t{b[at + static_cast<std::size_t>(i)]} << (8 * i);
        v = cur + (pick(2) ? 1 : ~0ull);
      }
      for (int i = 0; i < width && at + static_cast<std::size_t>(i) < b.size(); ++i)
        b[at + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(v >> (8 * i));
      reseal(b);
      break;
    }
  }
}

TEST(DescriptorMutation, DecodeAndOpenNeverCrashAndOnlyTheOriginalOpens) {
  auto pool = SharePool::create_anonymous(testing::small_config());
  const KvShape shape = testing::tiny_shape();
  auto kv = pool->kv_pool(shape);
  ThreadPool threads(1);
  PooledKvCache cache(kv, KvFormat::parse("f16"), 256);
  testing::append_random(cache, 45, 1, threads);
  const std::vector<TokenId> ids(45, 3);
  const SealedContext sealed = pool->seal(cache, ids, "text", ModelFingerprint{}, "A");
  const Descriptor original = pool->grant(sealed, "A", "B");
  const DescriptorBytes good = original.encode();
  const PoolCounters start = kv->counters();

  std::size_t decoded = 0, opened = 0;
  const std::size_t n = iterations();
  for (std::size_t it = 0; it < n; ++it) {
    std::mt19937_64 rng(0x5eed0000ull + it);
    std::vector<std::uint8_t> b(good.begin(), good.end());
    const int rounds = 1 + static_cast<int>(rng() % 3);
    for (int r = 0; r < rounds; ++r) mutate(rng, b);
    try {
      const Descriptor d = Descriptor::decode(b, "mutant");
      ++decoded;
      OpenedContext o = pool->open(d, d.grantee, (it & 1) != 0, 256);
      ++opened;
      ASSERT_EQ(0, std::memcmp(b.data(), good.data(), 224)) << "iteration " << it << ": a changed descriptor opened";
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), ErrorCode::bad_descriptor) << "iteration " << it << ": " << e.what();
    } catch (const std::exception& e) {
      FAIL() << "iteration " << it << ": unexpected exception " << e.what();
    }
  }
  std::fprintf(stderr, "%zu mutants: %zu decoded, %zu opened (unchanged in the signed part)\n", n, decoded, opened);
  EXPECT_GT(decoded, n / 10);  // the forged fields do get past the self checksum
  // Nothing stored was touched: the original still opens, nothing leaked.
  EXPECT_TRUE(pool->open(original, "B", true, 256).cache != nullptr);
  EXPECT_EQ(kv->counters().blocks_free, start.blocks_free);
  EXPECT_TRUE(pool->check(original, true).blocks_verified);
}

}  // namespace
}  // namespace qkvshare
