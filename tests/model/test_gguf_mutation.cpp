// Random-mutation driver for the GGUF reader, run in normal CI and under
// ASan+UBSan: valid files are damaged with a seeded PRNG (bit flips, byte
// writes, truncation, inserted or removed bytes, forged counts, lengths,
// offsets, dims and types) and open() must either succeed or throw
// qkvshare::Error(bad_model_file) — never crash, read out of bounds or throw
// anything else. When it succeeds, every tensor byte and every getter is
// touched so that a bad pointer shows up under ASan.
// QKVSHARE_GGUF_MUTATIONS overrides the iteration count; a failure prints the
// iteration, which reproduces it (the PRNG is seeded per iteration).
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>

#include "test_gguf_util.hpp"

namespace qkvshare {
namespace {

using testing::GgufLayout;

constexpr std::uint64_t kSeed = 0x9e3779b97f4a7c15ull;

std::size_t iterations() {
  if (const char* env = std::getenv("QKVSHARE_GGUF_MUTATIONS"); env != nullptr && *env != '\0')
    return static_cast<std::size_t>(std::strtoull(env, nullptr, 10));
  return 20000;
}

struct Base {
  std::vector<std::uint8_t> bytes;
  GgufLayout layout;
  std::vector<std::size_t> u64_fields, u32_fields;
  explicit Base(std::vector<std::uint8_t> b)
      : bytes(std::move(b)),
        layout(testing::layout_of(bytes)),
        u64_fields(layout.u64_fields()),
        u32_fields(layout.u32_fields()) {}
};

// Values that sit on the edges of the checks: zero, one, off-by-one around
// the real value, sizes near the file size, sign and overflow boundaries.
std::uint64_t interesting(std::mt19937_64& rng, std::uint64_t current, std::size_t file_size) {
  const std::uint64_t choices[] = {0,
                                   1,
                                   current + 1,
                                   current - 1,
                                   current * 2,
                                   file_size,
                                   file_size - 1,
                                   file_size + 32,
                                   0x7fffffffull,
                                   0x80000000ull,
                                   0xffffffffull,
                                   1ull << 32,
                                   0x7fffffffffffffffull,
                                   0x8000000000000000ull,
                                   ~0ull,
                                   ~0ull / 8,
                                   rng(),
                                   rng() % 4096};
  return choices[rng() % std::size(choices)];
}

void mutate_once(std::mt19937_64& rng, std::vector<std::uint8_t>& b, const Base& base) {
  const auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  switch (pick(8)) {
    case 0:  // flip one bit
      if (!b.empty()) b[pick(b.size())] ^= static_cast<std::uint8_t>(1u << pick(8));
      break;
    case 1:  // random byte
      if (!b.empty()) b[pick(b.size())] = static_cast<std::uint8_t>(rng());
      break;
    case 2:  // truncate
      b.resize(pick(b.size() + 1));
      break;
    case 3: {  // insert or erase a few bytes, shifting everything after
      const std::size_t at = pick(b.size() + 1);
      const std::size_t n = 1 + pick(16);
      if (rng() % 2 == 0) {
        for (std::size_t i = 0; i < n; ++i) b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), 0);
      } else {
        b.erase(b.begin() + static_cast<std::ptrdiff_t>(at),
                b.begin() + static_cast<std::ptrdiff_t>(std::min(b.size(), at + n)));
      }
      break;
    }
    case 4:
    case 5:
    case 6: {  // forge a u64 field (count, length, dim, offset)
      const std::size_t at = base.u64_fields[pick(base.u64_fields.size())];
      if (at + 8 > b.size()) break;
      testing::store_le<std::uint64_t>(b, at,
                                       interesting(rng, testing::load_le<std::uint64_t>(b, at), b.size()));
      break;
    }
    default: {  // forge a u32 field (version, value type, n_dims, tensor type)
      const std::size_t at = base.u32_fields[pick(base.u32_fields.size())];
      if (at + 4 > b.size()) break;
      const std::uint32_t v =
          rng() % 2 == 0 ? static_cast<std::uint32_t>(pick(40)) : static_cast<std::uint32_t>(rng());
      testing::store_le<std::uint32_t>(b, at, v);
      break;
    }
  }
}

// Reads everything an accepted file exposes; ASan flags any bad pointer.
std::uint64_t touch(const GgufFile& f) {
  std::uint64_t sum = 0;
  const std::uint8_t* begin = f.file().data();
  const std::uint8_t* end = begin + f.file().size();
  for (const auto& t : f.tensors()) {
    EXPECT_GE(t.data, begin + f.data_offset());
    EXPECT_LE(t.data + t.nbytes, end);
    EXPECT_GT(t.nbytes, 0u);
    EXPECT_EQ(t.row_bytes() * static_cast<std::size_t>(t.rows()), t.nbytes);
    for (std::size_t i = 0; i < t.nbytes; ++i) sum += t.data[i];
  }
  for (const auto& [key, value] : f.metadata()) {
    (void)value;
    const auto tolerate = [&](auto&& get) {
      try {
        get();
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::bad_model_file) << e.what();
      }
    };
    tolerate([&] { sum += static_cast<std::uint64_t>(f.get_int(key)); });
    tolerate([&] { sum += static_cast<std::uint64_t>(f.get_float(key) != 0); });
    tolerate([&] { sum += f.get_string(key).size(); });
    tolerate([&] { sum += f.find_bool(key).value_or(false); });
    tolerate([&] { sum += f.get_string_array(key).size(); });
    tolerate([&] { sum += f.get_number_array(key).size(); });
  }
  return sum;
}

TEST(GgufMutation, RandomDamageEitherLoadsOrThrowsError) {
  const Base bases[] = {Base(testing::sample_writer().to_bytes()),
                        Base(testing::sample_writer(64).to_bytes())};
  const std::string path = testing::gguf_temp_path("mutated.gguf");
  const std::size_t n = iterations();
  std::size_t accepted = 0;
  std::uint64_t sink = 0;
  for (std::size_t it = 0; it < n; ++it) {
    std::mt19937_64 rng(kSeed + it);
    const Base& base = bases[it % std::size(bases)];
    std::vector<std::uint8_t> bytes = base.bytes;
    const std::size_t n_mutations = 1 + static_cast<std::size_t>(rng() % 3);
    for (std::size_t m = 0; m < n_mutations; ++m) mutate_once(rng, bytes, base);
    testing::write_bytes(path, bytes);
    try {
      const auto f = GgufFile::open(path);
      sink += touch(*f);
      ++accepted;
    } catch (const Error& e) {
      const std::string msg = e.what();
      ASSERT_EQ(e.code(), ErrorCode::bad_model_file) << "iteration " << it << ": " << msg;
      ASSERT_EQ(msg.rfind(path + ": ", 0), 0u) << "iteration " << it << ": " << msg;
    } catch (const std::exception& e) {
      FAIL() << "iteration " << it << ": open() threw a non-qkvshare exception: " << e.what();
    }
    if (::testing::Test::HasFailure()) FAIL() << "stopped at iteration " << it;
  }
  // Both outcomes must be common, or the mutations are not exercising the reader.
  if (n >= 1000) {
    EXPECT_GT(accepted, n / 50);
    EXPECT_LT(accepted, n - n / 50);
  }
  RecordProperty("accepted", static_cast<int>(accepted));
  std::printf("GGUF mutations: %zu iterations, %zu accepted, %zu rejected (checksum %llu)\n", n, accepted,
              n - accepted, static_cast<unsigned long long>(sink % 1000));
}

}  // namespace
}  // namespace qkvshare
