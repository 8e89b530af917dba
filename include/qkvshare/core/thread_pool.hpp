#pragma once
// A fixed set of worker threads started once; parallel_for hands each worker a
// contiguous share of [0, n). No thread is started per token or per call.
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace qkvshare {

class ThreadPool {
 public:
  // n_threads counts the calling thread; 0 means all hardware threads.
  explicit ThreadPool(int n_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const noexcept { return n_threads_; }

  // Calls fn(begin, end, thread_index) on disjoint ranges covering [0, n);
  // ranges are aligned to `grain` items. Returns when all are done. The first
  // exception thrown by fn is rethrown here.
  void parallel_for(std::size_t n, std::size_t grain,
                    const std::function<void(std::size_t, std::size_t, int)>& fn);

 private:
  void worker_loop(int index);
  void run_share(int index);

  int n_threads_ = 1;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  // The job of the current generation.
  const std::function<void(std::size_t, std::size_t, int)>* job_ = nullptr;
  std::size_t job_n_ = 0;
  std::size_t job_grain_ = 1;
  std::exception_ptr first_error_;
};

}  // namespace qkvshare
