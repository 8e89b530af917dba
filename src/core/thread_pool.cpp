#include "qkvshare/core/thread_pool.hpp"

#include <algorithm>
#include <chrono>
#include <system_error>

#include "qkvshare/core/error.hpp"

namespace qkvshare {

namespace {

// The pool whose work this thread is running now (worker share or caller
// share), so that a nested parallel_for runs inline instead of deadlocking.
thread_local const ThreadPool* t_active_pool = nullptr;
thread_local int t_active_index = 0;

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long a waiter spins before it sleeps adapts between these bounds: a
// spin that ends in success doubles the next budget, one that runs out halves
// it. On idle cores, decoding's back-to-back calls keep the budget at the top
// and hand work over in well under a microsecond. On an oversubscribed machine
// the thread being waited for is often not running, every spin would be
// wasted (and would keep that thread off the core), and the budget falls to
// the bottom: the pool then behaves like a plain condition-variable pool.
// A sleep that ends soon after the spin gave up means the spin was just too
// short (a long prefill call halves the budget down to the bottom, and the
// short gaps of the decoding that follows would otherwise never raise it
// again: every hand-over would pay a futex wake-up), so it raises the budget
// to cover that wait.
constexpr std::int64_t kMinSpinNs = 500;
constexpr std::int64_t kMaxSpinNs = 100'000;

class SpinBudget {
 public:
  // Spins until ready() or the budget is spent; adapts the budget.
  template <class Ready>
  bool spin(Ready ready) {
    const auto start = std::chrono::steady_clock::now();
    start_ = start;
    for (int i = 0;; ++i) {
      if (ready()) {
        budget_ns_ = std::min(kMaxSpinNs, 2 * budget_ns_);
        return true;
      }
      if ((i & 7) == 7 && std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(budget_ns_)) {
        budget_ns_ = std::max(kMinSpinNs, budget_ns_ / 2);
        return false;
      }
      cpu_relax();
    }
  }

  // Called after the sleep that followed a failed spin().
  void woke() {
    const std::int64_t waited =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count();
    if (waited < kMaxSpinNs) budget_ns_ = std::min(kMaxSpinNs, std::max(2 * budget_ns_, 2 * waited));
  }

 private:
  std::int64_t budget_ns_ = kMaxSpinNs;
  std::chrono::steady_clock::time_point start_{};
};

// Each waiting thread adapts its own budget.
thread_local SpinBudget t_spin;

struct ActiveScope {
  const ThreadPool* prev_pool;
  int prev_index;
  ActiveScope(const ThreadPool* pool, int index) : prev_pool(t_active_pool), prev_index(t_active_index) {
    t_active_pool = pool;
    t_active_index = index;
  }
  ~ActiveScope() {
    t_active_pool = prev_pool;
    t_active_index = prev_index;
  }
  ActiveScope(const ActiveScope&) = delete;
  ActiveScope& operator=(const ActiveScope&) = delete;
};

}  // namespace

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  n_threads_ = n_threads;
  workers_.reserve(static_cast<std::size_t>(n_threads_ - 1));
  try {
    for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  } catch (const std::system_error& e) {
    // No destructor runs for a half-built pool: the workers already started
    // would wait forever on members being destroyed.
    const std::size_t started = workers_.size() + 1;  // the caller counts
    stop_workers();
    fail(ErrorCode::out_of_memory, "thread pool: cannot start {} threads, the system refused after {}: {}",
         n_threads_, started, e.what());
  } catch (...) {
    stop_workers();
    throw;
  }
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() noexcept {
  stop_.store(true);
  {
    // Taking the lock orders the store before any sleeper's predicate check.
    std::lock_guard lock(mutex_);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::run_share(int index) noexcept {
  const std::size_t units = (job_n_ + job_grain_ - 1) / job_grain_;
  const std::size_t per = units / static_cast<std::size_t>(n_threads_);
  const std::size_t extra = units % static_cast<std::size_t>(n_threads_);
  const auto idx = static_cast<std::size_t>(index);
  const std::size_t first_unit = idx * per + std::min(idx, extra);
  const std::size_t n_units = per + (idx < extra ? 1 : 0);
  const std::size_t begin = std::min(job_n_, first_unit * job_grain_);
  const std::size_t end = std::min(job_n_, (first_unit + n_units) * job_grain_);
  if (begin >= end) return;
  const ActiveScope scope(this, index);
  try {
    (*job_)(begin, end, index);
  } catch (...) {
    std::lock_guard lock(mutex_);
    if (!first_error_) first_error_ = std::current_exception();
  }
}

// Returns false when the pool is stopping. Sleepers register in
// sleeping_workers_ under the mutex before their last check of generation_;
// parallel_for bumps generation_ before it reads sleeping_workers_, and both
// are sequentially consistent, so one of the two always sees the other.
bool ThreadPool::wait_for_generation(std::uint64_t seen) {
  const auto ready = [&] {
    return stop_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen;
  };
  if (!t_spin.spin(ready)) {
    std::unique_lock lock(mutex_);
    sleeping_workers_.fetch_add(1);
    wake_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
    sleeping_workers_.fetch_sub(1);
    t_spin.woke();
  }
  return !stop_.load(std::memory_order_acquire);
}

void ThreadPool::worker_loop(int index) {
  std::uint64_t seen = 0;
  for (;;) {
    if (!wait_for_generation(seen)) return;
    seen = generation_.load(std::memory_order_acquire);
    run_share(index);
    // The last worker out wakes the caller if it went to sleep (same
    // handshake as above, with caller_sleeping_ and pending_).
    if (pending_.fetch_sub(1) == 1 && caller_sleeping_.load()) {
      std::lock_guard lock(mutex_);
      done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(std::size_t n, std::size_t grain,
                              const std::function<void(std::size_t, std::size_t, int)>& fn) {
  if (n == 0) return;
  grain = std::max<std::size_t>(grain, 1);
  if (t_active_pool == this) {  // nested: this thread already holds a share
    fn(0, n, t_active_index);
    return;
  }
  if (n_threads_ == 1 || n <= grain) {
    const ActiveScope scope(this, 0);
    fn(0, n, 0);
    return;
  }
  std::lock_guard call_lock(call_mutex_);
  job_ = &fn;
  job_n_ = n;
  job_grain_ = grain;
  {
    std::lock_guard lock(mutex_);
    first_error_ = nullptr;
  }
  pending_.store(n_threads_ - 1);
  generation_.fetch_add(1);  // publishes the job fields above
  if (sleeping_workers_.load() > 0) {
    { std::lock_guard lock(mutex_); }
    wake_.notify_all();
  }
  run_share(0);
  const auto all_done = [&] { return pending_.load(std::memory_order_acquire) == 0; };
  if (!t_spin.spin(all_done)) {
    std::unique_lock lock(mutex_);
    caller_sleeping_.store(true);
    done_.wait(lock, [&] { return pending_.load() == 0; });
    caller_sleeping_.store(false);
    t_spin.woke();
  }
  std::exception_ptr error;
  {
    std::lock_guard lock(mutex_);
    error = first_error_;
    first_error_ = nullptr;
  }
  job_ = nullptr;
  if (error) std::rethrow_exception(error);
}

}  // namespace qkvshare
