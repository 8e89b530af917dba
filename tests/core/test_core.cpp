#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/mapped_file.hpp"
#include "qkvshare/core/thread_pool.hpp"
#include "test_paths.hpp"

namespace qkvshare {
namespace {

TEST(ThreadPool, CoversEveryIndexExactlyOnce) {
  ThreadPool pool(3);
  for (std::size_t n : {0u, 1u, 2u, 7u, 64u, 1000u, 1001u}) {
    for (std::size_t grain : {1u, 4u, 16u}) {
      std::vector<std::atomic<int>> hits(n);
      pool.parallel_for(n, grain, [&](std::size_t b, std::size_t e, int) {
        for (std::size_t i = b; i < e; ++i) hits[i]++;
      });
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
    }
  }
}

TEST(ThreadPool, RangesAreAlignedToTheGrainAndThreadIndicesDistinct) {
  ThreadPool pool(2);
  std::mutex m;
  std::set<int> threads;
  pool.parallel_for(100, 16, [&](std::size_t b, std::size_t, int t) {
    EXPECT_EQ(b % 16, 0u);
    std::lock_guard lock(m);
    EXPECT_TRUE(threads.insert(t).second);
  });
}

TEST(ThreadPool, ExceptionReachesTheCaller) {
  ThreadPool pool(2);
  EXPECT_THROW(pool.parallel_for(100, 1,
                                 [](std::size_t b, std::size_t, int) {
                                   if (b > 0) fail(ErrorCode::internal, "boom");
                                 }),
               Error);
  // The pool still works afterwards.
  std::atomic<std::size_t> sum{0};
  pool.parallel_for(10, 1, [&](std::size_t b, std::size_t e, int) {
    for (std::size_t i = b; i < e; ++i) sum += i;
  });
  EXPECT_EQ(sum.load(), 45u);
}

TEST(ThreadPool, ManySmallJobs) {
  ThreadPool pool(2);
  std::atomic<long> total{0};
  for (int rep = 0; rep < 5000; ++rep)
    pool.parallel_for(8, 1, [&](std::size_t b, std::size_t e, int) { total += static_cast<long>(e - b); });
  EXPECT_EQ(total.load(), 5000 * 8);
}

TEST(MappedFile, MapsContentAndNamesMissingFiles) {
  const std::string path = testing::temp_dir() + "/f.bin";
  std::ofstream(path, std::ios::binary) << "hello";
  MappedFile f(path);
  ASSERT_EQ(f.size(), 5u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(f.data()), 5), "hello");
  try {
    MappedFile missing(path + ".nope");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io);
    EXPECT_NE(std::string(e.what()).find("f.bin.nope"), std::string::npos);
  }
  EXPECT_THROW(MappedFile(testing::temp_dir()), Error);  // a directory
}

// A FIFO is refused without waiting for a writer (open() used to block
// forever before the regular-file check). The alarm turns a hang into a failure.
TEST(MappedFile, RefusesAFifoWithoutBlocking) {
  if (std::getenv("QKVSHARE_EMULATED") != nullptr) GTEST_SKIP() << "under qemu-user (scripts/test_aarch64.sh)";
  const std::string path = testing::temp_dir() + "/fifo";
  ::unlink(path.c_str());
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  EXPECT_EXIT(
      {
        ::alarm(20);
        try {
          MappedFile f(path);
          std::_Exit(10);
        } catch (const Error& e) {
          const bool named = std::string(e.what()) == path + ": not a regular file";
          std::_Exit(e.code() == ErrorCode::io && named ? 0 : 11);
        }
      },
      ::testing::ExitedWithCode(0), "");
  ::unlink(path.c_str());
}

TEST(MappedFile, EmptyFileAndMove) {
  const std::string path = testing::temp_dir() + "/empty.bin";
  std::ofstream(path, std::ios::binary).flush();
  MappedFile f(path);
  EXPECT_EQ(f.size(), 0u);
  MappedFile g = std::move(f);
  EXPECT_EQ(g.path(), path);
}

// Released pages read the same afterwards, in both modes, and a range that
// is not inside the file, or holds no whole page, is left alone.
TEST(MappedFile, ReleasedPagesReadTheSame) {
  const std::string path = testing::temp_dir() + "/release.bin";
  std::string content(5 * 4096 + 123, '\0');
  for (std::size_t i = 0; i < content.size(); ++i) content[i] = static_cast<char>((i * 131) % 251);
  std::ofstream(path, std::ios::binary) << content;
  for (const auto mode : {MappedFile::Mode::shared, MappedFile::Mode::private_copy}) {
    MappedFile f(path, mode);
    f.release(f.data() + 100, f.data() + 4 * 4096 + 7);  // pages 1-3 whole
    f.release(f.data(), f.data() + 10);                   // no whole page
    f.release(f.data() + 4096, f.data() + f.size() + 4096);  // past the end: refused
    ASSERT_EQ(f.size(), content.size());
    EXPECT_EQ(0, std::memcmp(f.data(), content.data(), content.size())) << static_cast<int>(mode);
    f.release(f.data(), f.data() + f.size());
    EXPECT_EQ(0, std::memcmp(f.data(), content.data(), content.size())) << static_cast<int>(mode);
  }
}

TEST(Error, CarriesCodeAndMessage) {
  try {
    fail(ErrorCode::bad_model_file, "{}: tensor '{}': {}", "m.gguf", "x", "bad");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::bad_model_file);
    EXPECT_STREQ(e.what(), "m.gguf: tensor 'x': bad");
    EXPECT_EQ(to_string(e.code()), "bad model file");
  }
}

}  // namespace
}  // namespace qkvshare
