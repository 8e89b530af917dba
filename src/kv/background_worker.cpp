#include "background_worker.hpp"

#include <pthread.h>

#include <new>
#include <utility>

namespace qkvshare::kv {

namespace {

// The workers made so far, for the fork handlers (installed once).
BackgroundWorker* g_workers[2] = {nullptr, nullptr};

void install_fork_handlers() {
  static const bool installed = [] {
    pthread_atfork(
        [] {
          for (BackgroundWorker* w : g_workers)
            if (w != nullptr) w->prepare_fork();
        },
        [] {
          for (BackgroundWorker* w : g_workers)
            if (w != nullptr) w->after_fork(false);
        },
        [] {
          for (BackgroundWorker* w : g_workers)
            if (w != nullptr) w->after_fork(true);
        });
    return true;
  }();
  (void)installed;
}

}  // namespace

BackgroundWorker& BackgroundWorker::get(Purpose purpose) {
  static BackgroundWorker checksums, quantization;
  static const bool registered = [] {
    g_workers[0] = &checksums;
    g_workers[1] = &quantization;
    install_fork_handlers();
    return true;
  }();
  (void)registered;
  return purpose == Purpose::checksums ? checksums : quantization;
}

BackgroundWorker::BackgroundWorker() {
  new (mutex_storage_) std::mutex;
  new (running_storage_) std::mutex;
  new (wake_storage_) std::condition_variable;
  new (done_storage_) std::condition_variable;
}

// fork() waits for a job in progress and for the queue's lock; the child
// keeps them as they are (never touched there again) and starts no thread.
void BackgroundWorker::prepare_fork() {
  mutex().lock();
  running().lock();
}

void BackgroundWorker::after_fork(bool child) {
  if (child) {
    forked_child_ = true;
    return;
  }
  running().unlock();
  mutex().unlock();
}

std::mutex& BackgroundWorker::mutex() { return *std::launder(reinterpret_cast<std::mutex*>(mutex_storage_)); }
std::mutex& BackgroundWorker::running() { return *std::launder(reinterpret_cast<std::mutex*>(running_storage_)); }
std::condition_variable& BackgroundWorker::wake() {
  return *std::launder(reinterpret_cast<std::condition_variable*>(wake_storage_));
}
std::condition_variable& BackgroundWorker::done_cv() {
  return *std::launder(reinterpret_cast<std::condition_variable*>(done_storage_));
}

std::uint64_t BackgroundWorker::push(std::function<void()> job) {
  if (forked_child_) return 0;
  std::uint64_t ticket = 0;
  {
    std::lock_guard lock(mutex());
    if (thread_ == nullptr) thread_ = new std::thread([this] { run(); });
    queue_.push_back(std::move(job));
    ticket = ++queued_;
  }
  wake().notify_one();
  return ticket;
}

void BackgroundWorker::wait(std::uint64_t ticket) {
  if (forked_child_ || ticket == 0) return;
  std::unique_lock lock(mutex());
  done_cv().wait(lock, [&] { return done_ >= ticket; });
}

void BackgroundWorker::wait_all() {
  if (forked_child_) return;
  std::uint64_t target = 0;
  {
    std::lock_guard lock(mutex());
    target = queued_;
  }
  wait(target);
}

BackgroundWorker::~BackgroundWorker() {
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

void BackgroundWorker::run() {
  std::unique_lock lock(mutex());
  for (;;) {
    wake().wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    std::function<void()> job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    {
      std::lock_guard busy(running());
      job();
    }
    lock.lock();
    ++done_;
    done_cv().notify_all();
  }
}

}  // namespace qkvshare::kv
