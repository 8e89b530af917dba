// ThreadPool: coverage of ranges, exceptions, nesting, concurrent callers,
// and both wake-up paths (spinning workers, sleeping workers). Also run
// under TSan (-DQKVSHARE_TSAN=ON).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/thread_pool.hpp"

namespace qkvshare {
namespace {

void expect_each_index_once(ThreadPool& pool, std::size_t n, std::size_t grain) {
  std::vector<std::atomic<int>> hits(n);
  std::atomic<int> bad_thread{0};
  pool.parallel_for(n, grain, [&](std::size_t begin, std::size_t end, int thread) {
    if (thread < 0 || thread >= pool.size()) bad_thread.fetch_add(1);
    if (begin % grain != 0 && begin != 0) bad_thread.fetch_add(1);
    for (std::size_t i = begin; i < end; ++i) hits[i].fetch_add(1);
  });
  EXPECT_EQ(bad_thread.load(), 0);
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n " << n << " grain " << grain << " index " << i;
}

TEST(ThreadPool, EveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (std::size_t n : {1, 2, 7, 16, 100, 1001})
      for (std::size_t grain : {1, 4, 16, 2000}) expect_each_index_once(pool, n, grain);
  }
}

TEST(ThreadPool, ZeroItemsCallsNothing) {
  ThreadPool pool(2);
  bool called = false;
  pool.parallel_for(0, 1, [&](std::size_t, std::size_t, int) { called = true; });
  EXPECT_FALSE(called);
}

TEST(ThreadPool, ManyShortCallsAsInDecoding) {
  ThreadPool pool(2);
  std::atomic<long> sum{0};
  for (int call = 0; call < 20000; ++call)
    pool.parallel_for(64, 8, [&](std::size_t b, std::size_t e, int) { sum.fetch_add(static_cast<long>(e - b)); });
  EXPECT_EQ(sum.load(), 20000L * 64);
}

TEST(ThreadPool, WakesWorkersThatWentToSleep) {
  ThreadPool pool(3);
  for (int call = 0; call < 5; ++call) {
    std::this_thread::sleep_for(std::chrono::milliseconds(3));  // longer than the spin: workers sleep
    expect_each_index_once(pool, 30, 1);
  }
}

TEST(ThreadPool, CallerSleepsUntilASlowWorkerFinishes) {
  ThreadPool pool(2);
  std::atomic<int> done{0};
  pool.parallel_for(2, 1, [&](std::size_t b, std::size_t, int) {
    if (b == 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    done.fetch_add(1);
  });
  EXPECT_EQ(done.load(), 2);
}

TEST(ThreadPool, RethrowsTheFirstExceptionAndStaysUsable) {
  ThreadPool pool(2);
  EXPECT_THROW(pool.parallel_for(10, 1,
                                 [](std::size_t b, std::size_t, int) {
                                   if (b >= 5) throw std::runtime_error("worker failed");
                                 }),
               std::runtime_error);
  EXPECT_THROW(pool.parallel_for(10, 1, [](std::size_t, std::size_t, int) { throw std::logic_error("all"); }),
               std::logic_error);
  expect_each_index_once(pool, 50, 3);
}

TEST(ThreadPool, NestedCallsRunInline) {
  ThreadPool pool(2);
  std::atomic<int> inner{0};
  pool.parallel_for(4, 1, [&](std::size_t b, std::size_t e, int) {
    for (std::size_t i = b; i < e; ++i)
      pool.parallel_for(10, 1, [&](std::size_t ib, std::size_t ie, int) { inner.fetch_add(static_cast<int>(ie - ib)); });
  });
  EXPECT_EQ(inner.load(), 40);
}

TEST(ThreadPool, ConcurrentCallersAreSerialised) {
  ThreadPool pool(2);
  std::atomic<long> sum{0};
  auto caller = [&] {
    for (int i = 0; i < 2000; ++i)
      pool.parallel_for(32, 4, [&](std::size_t b, std::size_t e, int) { sum.fetch_add(static_cast<long>(e - b)); });
  };
  std::thread a(caller), b(caller);
  a.join();
  b.join();
  EXPECT_EQ(sum.load(), 2L * 2000 * 32);
}

TEST(ThreadPool, DestroysWhileWorkersSpinOrSleep) {
  for (int sleep_ms : {0, 3}) {
    ThreadPool pool(4);
    expect_each_index_once(pool, 40, 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
  }
}

// The line "Threads: N" of /proc/self/status.
int threads_of_this_process() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  return -1;
}

// Address space for a few thread stacks more than the process maps now, so
// the system refuses a thread part-way through a big pool.
void leave_room_for_a_few_threads() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0;
  statm >> pages;
  const rlim_t limit = pages * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)) + (rlim_t{40} << 20);
  const rlimit rl{limit, limit};
  ::setrlimit(RLIMIT_AS, &rl);
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define QKVSHARE_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define QKVSHARE_TEST_SANITIZED 1
#endif
#endif

// A half-built pool used to hang (the started workers waited on a condition
// variable being destroyed) or terminate (joinable threads destroyed). It must
// stop and join what it started and throw an Error. In a child process,
// under an address-space limit and an alarm that turns a hang into a failure.
TEST(ThreadPool, RefusedThreadStopsTheStartedOnesAndThrows) {
#ifdef QKVSHARE_TEST_SANITIZED
  GTEST_SKIP() << "sanitizers reserve address space an RLIMIT_AS cannot leave room for";
#endif
  if (std::getenv("QKVSHARE_EMULATED") != nullptr) GTEST_SKIP() << "under qemu-user (scripts/test_aarch64.sh)";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ::alarm(30);
        const int before = threads_of_this_process();
        leave_room_for_a_few_threads();
        try {
          ThreadPool pool(512);
          std::_Exit(10);  // the limit did not bite
        } catch (const Error& e) {
          const bool named = std::string(e.what()).find("cannot start 512 threads") != std::string::npos;
          const int code = e.code() != ErrorCode::out_of_memory ? 11
                           : !named                             ? 12
                           : threads_of_this_process() != before ? 13
                                                                 : 0;
          std::_Exit(code);
        }
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace qkvshare
