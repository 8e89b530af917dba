#pragma once
// Shared memory for the context registry and the KV pool: a POSIX shared
// memory object (shm_open + mmap) that any process may map by name, or an
// anonymous MAP_SHARED mapping for one process (and the children it forks).
// Nothing stored inside is a pointer, so each process may map it anywhere.
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "qkvshare/kv/kv_arena.hpp"

namespace qkvshare {

class ShmRegion {
 public:
  // Creates /qkvshare.NAME of `bytes` zeroed bytes; Error(io) when it exists.
  static std::shared_ptr<ShmRegion> create(const std::string& name, std::size_t bytes);
  // Maps an existing object; Error(io) naming the pool when there is none.
  static std::shared_ptr<ShmRegion> open(const std::string& name);
  static std::shared_ptr<ShmRegion> anonymous(std::size_t bytes);
  // Removes the name (mappings stay valid); false when there was none.
  static bool unlink(const std::string& name) noexcept;
  // Error(invalid_argument) unless NAME is 1..64 of [A-Za-z0-9_.-].
  static void validate_name(const std::string& name);

  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  std::byte* data() const noexcept { return base_; }
  std::size_t size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }  // empty when anonymous

 private:
  ShmRegion(std::byte* base, std::size_t size, std::string name) : base_(base), size_(size), name_(std::move(name)) {}
  std::byte* base_;
  std::size_t size_;
  std::string name_;
};

// An Arena over part of a region; keeps the mapping alive.
class SubArena final : public Arena {
 public:
  SubArena(std::shared_ptr<void> keep_alive, std::byte* data, std::size_t size)
      : keep_(std::move(keep_alive)), data_(data), size_(size) {}
  std::byte* data() noexcept override { return data_; }
  std::size_t size() const noexcept override { return size_; }

 private:
  std::shared_ptr<void> keep_;
  std::byte* data_;
  std::size_t size_;
};

// A process-shared robust pthread mutex stored in shared memory. When its
// holder died, the next lock() runs `repair` (which must bring whatever the
// mutex guards back to a consistent state) and then marks it consistent.
class RobustMutex {
 public:
  static constexpr std::size_t kBytes = 64;
  // Formats the mutex at `at` (kBytes, by the region's creator only).
  static void init(void* at);
  explicit RobustMutex(void* at, std::function<void()> repair = {}) : m_(at), repair_(std::move(repair)) {}
  void set_repair(std::function<void()> repair) { repair_ = std::move(repair); }
  void lock();
  void unlock();
  // Repairs performed by this process (each one a holder that died).
  unsigned repairs() const noexcept { return repairs_; }

 private:
  void* m_;
  std::function<void()> repair_;
  unsigned repairs_ = 0;
};

// The KV pool's lock in a shared region: the RobustMutex in the pool header's
// lock area; a dead holder's half-done free-list change is repaired by
// rebuilding the free lists from the block reference counts.
class RobustPoolLock final : public PoolLock {
 public:
  RobustPoolLock() : mutex_(nullptr) {}
  void bind(void* at, std::function<void()> repair) { mutex_ = RobustMutex(at, std::move(repair)); }
  void lock() override { mutex_.lock(); }
  void unlock() override { mutex_.unlock(); }

 private:
  RobustMutex mutex_;
};

}  // namespace qkvshare
