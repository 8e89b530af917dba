#pragma once
// One background thread of this process that runs jobs in the order they
// were queued (block checksums; the quantization of blocks a pass fills).
// Its mutexes and condition variables live in raw storage and are never
// destroyed: a child of fork() inherits them locked (by the prepare handler)
// and must neither use nor destroy them. fork() waits for a job in progress;
// a child starts no thread (a child of a multithreaded process may only do
// async-signal-safe work until it execs; ThreadSanitizer kills one that
// starts a thread), so push() refuses there and the caller does the work.
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace qkvshare::kv {

class BackgroundWorker {
 public:
  // The worker of one purpose (each is its own thread and queue).
  enum class Purpose { checksums, quantization };
  static BackgroundWorker& get(Purpose purpose);

  // Queues `job` and returns its ticket (> 0), or 0 when this process may not
  // run a thread (a child of fork()): the caller then runs it itself.
  std::uint64_t push(std::function<void()> job);
  // Returns once the job of `ticket` and every one queued before it are done.
  void wait(std::uint64_t ticket);
  // Returns once every job queued so far is done.
  void wait_all();

  // fork() handlers (pthread_atfork, installed by get()).
  void prepare_fork();
  void after_fork(bool child);

  ~BackgroundWorker();
  BackgroundWorker(const BackgroundWorker&) = delete;
  BackgroundWorker& operator=(const BackgroundWorker&) = delete;

 private:
  BackgroundWorker();
  std::mutex& mutex();
  std::mutex& running();
  std::condition_variable& wake();
  std::condition_variable& done_cv();
  void run();

  alignas(std::mutex) unsigned char mutex_storage_[sizeof(std::mutex)];
  alignas(std::mutex) unsigned char running_storage_[sizeof(std::mutex)];
  alignas(std::condition_variable) unsigned char wake_storage_[sizeof(std::condition_variable)];
  alignas(std::condition_variable) unsigned char done_storage_[sizeof(std::condition_variable)];
  std::thread* thread_ = nullptr;
  std::deque<std::function<void()>> queue_;
  std::uint64_t queued_ = 0, done_ = 0;
  bool stop_ = false;
  // Written by the only thread of a forked child; never written in the parent.
  bool forked_child_ = false;
};

}  // namespace qkvshare::kv
