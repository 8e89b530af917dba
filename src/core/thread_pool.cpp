#include "qkvshare/core/thread_pool.hpp"

#include <algorithm>

namespace qkvshare {

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  n_threads_ = n_threads;
  workers_.reserve(static_cast<std::size_t>(n_threads_ - 1));
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_share(int index) {
  const std::size_t units = (job_n_ + job_grain_ - 1) / job_grain_;
  const std::size_t per = units / static_cast<std::size_t>(n_threads_);
  const std::size_t extra = units % static_cast<std::size_t>(n_threads_);
  const auto idx = static_cast<std::size_t>(index);
  const std::size_t first_unit = idx * per + std::min(idx, extra);
  const std::size_t n_units = per + (idx < extra ? 1 : 0);
  const std::size_t begin = std::min(job_n_, first_unit * job_grain_);
  const std::size_t end = std::min(job_n_, (first_unit + n_units) * job_grain_);
  if (begin >= end) return;
  try {
    (*job_)(begin, end, index);
  } catch (...) {
    std::lock_guard lock(mutex_);
    if (!first_error_) first_error_ = std::current_exception();
  }
}

void ThreadPool::worker_loop(int index) {
  std::uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_share(index);
    {
      std::lock_guard lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(std::size_t n, std::size_t grain,
                              const std::function<void(std::size_t, std::size_t, int)>& fn) {
  if (n == 0) return;
  grain = std::max<std::size_t>(grain, 1);
  if (n_threads_ == 1 || n <= grain) {
    fn(0, n, 0);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    job_ = &fn;
    job_n_ = n;
    job_grain_ = grain;
    first_error_ = nullptr;
    pending_ = n_threads_ - 1;
    ++generation_;
  }
  wake_.notify_all();
  run_share(0);
  std::exception_ptr error;
  {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
    job_ = nullptr;
    error = first_error_;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace qkvshare
