#pragma once
// A fixed set of worker threads started once; parallel_for hands each worker a
// contiguous share of [0, n). No thread is started per token or per call.
//
// Decoding issues a few hundred short parallel_for calls per token, so a
// wake-up must cost far less than a condition variable's (10-50 us): idle
// workers spin on an atomic generation counter for a while (about 100 us)
// before they sleep on the condition variable, and the caller likewise spins
// before it sleeps waiting for them.
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace qkvshare {

class ThreadPool {
 public:
  // n_threads counts the calling thread; 0 means all hardware threads.
  // Error(out_of_memory) when the system cannot start that many threads.
  explicit ThreadPool(int n_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const noexcept { return n_threads_; }

  // Calls fn(begin, end, thread_index) on disjoint ranges covering [0, n);
  // ranges are aligned to `grain` items. Returns when all are done. The first
  // exception thrown by fn is rethrown here. Calls from several threads are
  // serialised; a call from inside fn runs inline on the calling worker.
  void parallel_for(std::size_t n, std::size_t grain,
                    const std::function<void(std::size_t, std::size_t, int)>& fn);

 private:
  void stop_workers() noexcept;
  void worker_loop(int index);
  void run_share(int index) noexcept;
  bool wait_for_generation(std::uint64_t seen);

  int n_threads_ = 1;
  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one parallel_for at a time
  std::mutex mutex_;       // guards sleeping and first_error_
  std::condition_variable wake_;
  std::condition_variable done_;
  // Incremented (release) after the job fields below are written; workers
  // read them after seeing the new value (acquire).
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<int> pending_{0};          // workers still running the current job
  std::atomic<int> sleeping_workers_{0};
  std::atomic<bool> caller_sleeping_{false};
  std::atomic<bool> stop_{false};
  const std::function<void(std::size_t, std::size_t, int)>* job_ = nullptr;
  std::size_t job_n_ = 0;
  std::size_t job_grain_ = 1;
  std::exception_ptr first_error_;
};

}  // namespace qkvshare
