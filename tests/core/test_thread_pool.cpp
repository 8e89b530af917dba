// ThreadPool: coverage of ranges, exceptions, nesting, concurrent callers,
// and both wake-up paths (spinning workers, sleeping workers). Also run
// under TSan (-DQKVSHARE_TSAN=ON).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

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

}  // namespace
}  // namespace qkvshare
