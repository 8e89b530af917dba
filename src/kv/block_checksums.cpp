#include "qkvshare/kv/block_checksums.hpp"

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <new>
#include <thread>
#include <utility>

namespace qkvshare::kv {

namespace {

std::atomic<bool> g_on{true};

struct Job {
  std::weak_ptr<KvPool> pool;
  BlockRef ref;
};

// One worker per process. Its mutexes and condition variables live in raw
// storage and are never destroyed: a child of fork() inherits them locked (by
// the prepare handler) and must neither use nor destroy them.
class Worker {
 public:
  static Worker& get() {
    static Worker w;
    return w;
  }

  void push(Job job) {
    if (forked_child_) return;  // see reset_in_child()
    {
      std::lock_guard lock(mutex());
      if (thread_ == nullptr) thread_ = new std::thread([this] { run(); });
      queue_.push_back(std::move(job));
      ++queued_;
    }
    wake().notify_one();
  }

  void wait() {
    if (forked_child_) return;
    std::unique_lock lock(mutex());
    const std::uint64_t target = queued_;
    done_cv().wait(lock, [&] { return done_ >= target; });
  }

  ~Worker() {
    if (forked_child_) return;
    std::thread* t = nullptr;
    {
      std::lock_guard lock(mutex());
      stop_ = true;
      t = std::exchange(thread_, nullptr);
    }
    wake().notify_all();
    if (t != nullptr) {
      t->join();
      delete t;
    }
  }

 private:
  Worker() {
    new (mutex_storage_) std::mutex;
    new (computing_storage_) std::mutex;
    new (wake_storage_) std::condition_variable;
    new (done_storage_) std::condition_variable;
    // fork() waits for a hash in progress (KvPool's hashing_ mark must not be
    // copied into a child, whose releases would wait for it forever).
    pthread_atfork(
        [] {
          get().mutex().lock();
          get().computing().lock();
        },
        [] {
          get().computing().unlock();
          get().mutex().unlock();
        },
        [] { get().reset_in_child(); });
  }

  std::mutex& mutex() { return *std::launder(reinterpret_cast<std::mutex*>(mutex_storage_)); }
  std::mutex& computing() { return *std::launder(reinterpret_cast<std::mutex*>(computing_storage_)); }
  std::condition_variable& wake() { return *std::launder(reinterpret_cast<std::condition_variable*>(wake_storage_)); }
  std::condition_variable& done_cv() { return *std::launder(reinterpret_cast<std::condition_variable*>(done_storage_)); }

  // In the child, after fork(): the parent's thread does not exist here and
  // its locks stay as fork left them, never touched again. The child starts
  // no thread of its own: a child of a multithreaded process may only do
  // async-signal-safe work until it execs (POSIX; ThreadSanitizer kills one
  // that starts a thread), so its seals hash the blocks they need themselves.
  // Written by the only thread of the child; never written in the parent.
  void reset_in_child() { forked_child_ = true; }

  void run() {
    std::unique_lock lock(mutex());
    for (;;) {
      wake().wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      Job job = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      {
        std::lock_guard busy(computing());
        compute(job);
      }
      lock.lock();
      ++done_;
      done_cv().notify_all();
    }
  }

  static void compute(const Job& job) noexcept {
    const std::shared_ptr<KvPool> pool = job.pool.lock();
    if (pool) pool->keep_checksum_if_live(job.ref);  // skipped when the block was freed before its turn
  }

  alignas(std::mutex) unsigned char mutex_storage_[sizeof(std::mutex)];
  alignas(std::mutex) unsigned char computing_storage_[sizeof(std::mutex)];
  alignas(std::condition_variable) unsigned char wake_storage_[sizeof(std::condition_variable)];
  alignas(std::condition_variable) unsigned char done_storage_[sizeof(std::condition_variable)];
  std::thread* thread_ = nullptr;
  std::deque<Job> queue_;
  std::uint64_t queued_ = 0, done_ = 0;
  bool stop_ = false;
  bool forked_child_ = false;
};

}  // namespace

void checksum_later(const std::shared_ptr<KvPool>& pool, BlockRef ref) {
  if (!g_on.load(std::memory_order_relaxed)) return;
  Worker::get().push(Job{pool, ref});
}

void wait_for_checksums() { Worker::get().wait(); }

void set_background_checksums(bool on) noexcept { g_on.store(on, std::memory_order_relaxed); }

}  // namespace qkvshare::kv
