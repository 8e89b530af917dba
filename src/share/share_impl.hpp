#pragma once
// SharePool internals shared by share_pool.cpp (region, processes, reaper,
// KV formatting) and share_context.cpp (seal, grant, open, release).
#include <sys/types.h>

#include <mutex>
#include <span>

#include "qkvshare/share/share_pool.hpp"
#include "share_layout.hpp"

namespace qkvshare::share_detail {

// Holds the registry mutex for a scope.
class RegistryLock;

// One process's view of a region. It is also the KV pool's reference ledger
// for this process: each block reference a session of this process takes or
// drops is counted in the process's ledger row, so that a reaper can give
// back the references of a process that died. The KV pool's arena keeps it
// alive, so it outlives every session of the process.
class Registry final : public RefLedger {
 public:
  Registry(std::shared_ptr<ShmRegion> region, const Layout& layout);
  ~Registry() override;

  void taken(std::uint32_t block) noexcept override;
  void dropping(std::uint32_t block) noexcept override;

  ShareHeader& header() const noexcept { return *reinterpret_cast<ShareHeader*>(region_->data()); }
  ProcessSlot& process(std::uint32_t i) const noexcept;
  ContextRecord& record(std::uint32_t i) const noexcept;
  GrantSlot& grant(std::uint32_t i) const noexcept;
  TableEntry* table(std::uint32_t record) const noexcept;
  SegmentEntry* segments(std::uint32_t record) const noexcept;
  TokenId* tokens(std::uint32_t record) const noexcept;
  char* text(std::uint32_t record) const noexcept;
  std::atomic<std::uint32_t>* ledger_row(std::uint32_t slot) const noexcept;

  const std::shared_ptr<ShmRegion>& region() const noexcept { return region_; }
  const Layout& layout() const noexcept { return layout_; }
  RobustMutex& mutex() noexcept { return mutex_; }
  std::uint32_t slot() const noexcept { return slot_; }

  // Takes a process slot (under the mutex). Throws when all are taken.
  void register_process();
  // Binds this process's ledger row once the KV pool is formatted.
  void bind_ledger() noexcept;
  // The KV pool for maintenance (reaping, repair) when the region has one:
  // this process's own if it has one, else a temporary attachment.
  std::shared_ptr<KvPool> maintenance_pool();
  void set_pool(const std::shared_ptr<KvPool>& pool) { pool_ = pool; }

  // Under the mutex: frees a record, dropping its block references.
  void free_record_locked(std::uint32_t r, KvPool* pool);
  // Under the mutex: reclaims slot `i` (a dead or departed process).
  void reap_slot_locked(std::uint32_t i, bool crashed);
  void release_custody_locked(std::uint32_t i) noexcept;
  int reap_locked();
  // Whether slot i's process is attached and running (a /proc probe).
  bool alive(std::uint32_t i) const;
  // Brings records left mid-change by a holder that died back to a state.
  void repair_locked();
  void bump(CounterIndex c, std::uint64_t n = 1) noexcept;

 private:
  std::shared_ptr<ShmRegion> region_;
  Layout layout_;
  RobustMutex mutex_;
  std::uint32_t slot_ = kNone;
  std::atomic<std::uint32_t>* row_ = nullptr;
  std::uint32_t row_blocks_ = 0;
  std::weak_ptr<KvPool> pool_;
};

class RegistryLock {
 public:
  explicit RegistryLock(Registry& r) : r_(r) { r_.mutex().lock(); }
  ~RegistryLock() { r_.mutex().unlock(); }
  RegistryLock(const RegistryLock&) = delete;
  RegistryLock& operator=(const RegistryLock&) = delete;

 private:
  Registry& r_;
};

// While alive, block references this thread takes or drops are not the
// process's: they belong to a record, or to a dead process being reaped.
class Unledgered {
 public:
  Unledgered() noexcept;
  ~Unledgered();
  Unledgered(const Unledgered&) = delete;
  Unledgered& operator=(const Unledgered&) = delete;
};

std::uint64_t monotonic_ns() noexcept;
std::uint64_t unix_ns() noexcept;
// XXH3-64 over every tile of a block (codecs included).
// XXH3-64 over the blocks' digests: what a descriptor's blocks checksum says.
std::uint64_t full_checksum(const KvPool& pool, const std::vector<BlockRef>& blocks);

}  // namespace qkvshare::share_detail

namespace qkvshare {

struct SharePool::Impl {
  std::shared_ptr<share_detail::Registry> reg;
  std::mutex kv_mutex;  // guards `kv` within this process
  std::shared_ptr<KvPool> kv;
  std::string name;

  share_detail::ShareHeader& h() const noexcept { return reg->header(); }
  void maybe_reap();
  // What an opened cache calls at commit to renew `d`'s lease (share_lease.cpp).
  std::shared_ptr<CommitHook> lease_renewal(const Descriptor& d) const;
  // Finds the record and grant a descriptor names, checking everything the
  // pool knows, for the grantee (or, with `as_producer`, the producer).
  // Under the mutex. Throws Error(bad_descriptor).
  void validate_locked(const Descriptor& d, std::string_view agent, bool as_producer) const;
  // validate_locked, counting a refusal in the pool's `rejected` counter.
  void admit_locked(const Descriptor& d, std::string_view agent, bool as_producer) const;
};

}  // namespace qkvshare
