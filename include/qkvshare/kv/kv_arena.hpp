#pragma once
// The two things a KV pool borrows from its surroundings: the bytes it lives
// in (Arena) and the lock around its free lists (PoolLock). Both are
// interfaces because the bytes may be process memory today and a POSIX shared
// memory mapping tomorrow, and the lock a std::mutex today and a robust
// process-shared pthread mutex (stored in the arena header's lock area) then.
#include <cstddef>
#include <memory>
#include <mutex>

namespace qkvshare {

// A byte range the pool formats and uses. The pool stores no pointers inside
// it (only offsets and indices), so the same arena may be mapped at different
// addresses in different processes.
class Arena {
 public:
  virtual ~Arena() = default;
  virtual std::byte* data() noexcept = 0;
  virtual std::size_t size() const noexcept = 0;
};

// Zeroed, 4096-byte aligned process memory (an anonymous mapping: pages are
// committed when first touched).
class HeapArena final : public Arena {
 public:
  explicit HeapArena(std::size_t bytes);
  std::byte* data() noexcept override { return data_.get(); }
  std::size_t size() const noexcept override { return size_; }

 private:
  struct Free {
    std::size_t bytes;  // of the mapping
    void operator()(std::byte* p) const noexcept;
  };
  std::unique_ptr<std::byte, Free> data_;
  std::size_t size_;
};

// Guards the pool's free lists (BasicLockable, so std::lock_guard works). A
// process-shared lock keeps its state in the arena header's reserved lock
// area (KvPool::lock_area()); the process-local one below needs none.
class PoolLock {
 public:
  virtual ~PoolLock() = default;
  virtual void lock() = 0;
  virtual void unlock() = 0;
};

class LocalPoolLock final : public PoolLock {
 public:
  void lock() override { mutex_.lock(); }
  void unlock() override { mutex_.unlock(); }

 private:
  std::mutex mutex_;
};

}  // namespace qkvshare
