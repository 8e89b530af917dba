// The registry in a shared region: process slots, the reference ledger, the
// reaper, the repair after a holder of the mutex died, and block checksums.
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <ctime>
#include <fstream>
#include <thread>

#include <xxhash.h>

#include "qkvshare/core/error.hpp"
#include "share_impl.hpp"

namespace qkvshare {

using namespace share_detail;

namespace share_detail {

namespace {

thread_local int t_unledgered = 0;

// Process start time (clock ticks since boot) and state from /proc/PID/stat;
// false when there is no such process (or no /proc).
bool proc_stat(pid_t pid, std::uint64_t& start, char& state) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!in || !std::getline(in, line)) return false;
  const std::size_t close = line.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  state = line[close + 2];
  // Fields after the name start at field 3 (state); starttime is field 22.
  std::size_t pos = close + 2;
  for (int field = 3; field < 22; ++field) {
    pos = line.find(' ', pos);
    if (pos == std::string::npos) return false;
    ++pos;
  }
  start = std::strtoull(line.c_str() + pos, nullptr, 10);
  return true;
}

enum class Liveness { alive, dead, unknown };

Liveness probe(const ProcessSlot& p) {
  const auto pid = static_cast<pid_t>(p.pid);
  std::uint64_t start = 0;
  char state = 0;
  if (proc_stat(pid, start, state)) {
    // A zombie (killed, not yet waited for) holds no memory: it is dead to us.
    if (state == 'Z' || state == 'X' || state == 'x') return Liveness::dead;
    return start == p.start_ticks ? Liveness::alive : Liveness::dead;  // else the pid was reused
  }
  if (::kill(pid, 0) == 0) return Liveness::alive;
  return errno == ESRCH ? Liveness::dead : Liveness::unknown;
}

}  // namespace

std::uint64_t monotonic_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

std::uint64_t unix_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

Unledgered::Unledgered() noexcept { ++t_unledgered; }
Unledgered::~Unledgered() { --t_unledgered; }

Registry::Registry(std::shared_ptr<ShmRegion> region, const Layout& layout)
    : region_(std::move(region)), layout_(layout), mutex_(header().mutex, [this] { repair_locked(); }) {}

Registry::~Registry() {
  if (slot_ == kNone) return;
  // Leave the slot free, or, when references or claims are left behind (a
  // session was leaked), marked for the reaper of another process.
  bool leftovers = false;
  for (std::uint32_t b = 0; row_ != nullptr && b < row_blocks_ && !leftovers; ++b)
    leftovers = row_[b].load(std::memory_order_relaxed) != 0;
  try {
    RegistryLock lock(*this);
    release_custody_locked(slot_);
    for (std::uint32_t r = 0; r < header().max_contexts && !leftovers; ++r)
      leftovers = record(r).state == kRecSealed && record(r).owner_slot == slot_;
    process(slot_).state.store(leftovers ? kProcExited : kProcFree, std::memory_order_release);
  } catch (...) {
    process(slot_).state.store(kProcExited, std::memory_order_release);
  }
}

void Registry::taken(std::uint32_t block) noexcept {
  if (t_unledgered == 0 && block < row_blocks_) row_[block].fetch_add(1, std::memory_order_relaxed);
}
void Registry::dropping(std::uint32_t block) noexcept {
  if (t_unledgered == 0 && block < row_blocks_) row_[block].fetch_sub(1, std::memory_order_relaxed);
}

ProcessSlot& Registry::process(std::uint32_t i) const noexcept {
  return reinterpret_cast<ProcessSlot*>(region_->data() + layout_.processes)[i];
}
ContextRecord& Registry::record(std::uint32_t i) const noexcept {
  return reinterpret_cast<ContextRecord*>(region_->data() + layout_.records)[i];
}
GrantSlot& Registry::grant(std::uint32_t i) const noexcept {
  return reinterpret_cast<GrantSlot*>(region_->data() + layout_.grants)[i];
}
TableEntry* Registry::table(std::uint32_t r) const noexcept {
  return reinterpret_cast<TableEntry*>(region_->data() + layout_.data + std::uint64_t{r} * layout_.data_stride);
}
SegmentEntry* Registry::segments(std::uint32_t r) const noexcept {
  return reinterpret_cast<SegmentEntry*>(reinterpret_cast<std::byte*>(table(r)) + layout_.table_bytes);
}
TokenId* Registry::tokens(std::uint32_t r) const noexcept {
  return reinterpret_cast<TokenId*>(reinterpret_cast<std::byte*>(segments(r)) + layout_.segment_bytes);
}
char* Registry::text(std::uint32_t r) const noexcept {
  return reinterpret_cast<char*>(tokens(r)) + layout_.token_bytes;
}
std::atomic<std::uint32_t>* Registry::ledger_row(std::uint32_t slot) const noexcept {
  const ShareHeader& h = header();
  return reinterpret_cast<std::atomic<std::uint32_t>*>(region_->data() + h.ledger_offset) +
         std::uint64_t{slot} * h.ledger_blocks;
}

std::uint64_t full_checksum(const KvPool& pool, const std::vector<BlockRef>& blocks) {
  std::vector<std::uint64_t> digests;
  digests.reserve(blocks.size());
  for (BlockRef b : blocks) digests.push_back(pool.compute_checksum(b));
  return XXH3_64bits(digests.data(), digests.size() * sizeof(std::uint64_t));
}

void Registry::bump(CounterIndex c, std::uint64_t n) noexcept {
  header().counters[c].fetch_add(n, std::memory_order_relaxed);
}

void Registry::register_process() {
  const ShareHeader& h = header();
  const auto pid = ::getpid();
  std::uint64_t start = 0;
  char state = 0;
  proc_stat(pid, start, state);
  RegistryLock lock(*this);
  for (int attempt = 0; attempt < 2 && slot_ == kNone; ++attempt) {
    if (attempt == 1) reap_locked();
    for (std::uint32_t i = 0; i < h.max_processes; ++i) {
      ProcessSlot& p = process(i);
      if (p.state.load(std::memory_order_acquire) != kProcFree) continue;
      p.pid = static_cast<std::uint32_t>(pid);
      p.start_ticks = start;
      p.heartbeat_ns.store(monotonic_ns(), std::memory_order_relaxed);
      p.registered_unix_ns = unix_ns();
      p.state.store(kProcLive, std::memory_order_release);
      slot_ = i;
      break;
    }
  }
  if (slot_ == kNone)
    fail(ErrorCode::out_of_memory, "pool '{}': all {} process slots are taken", region_->name(), h.max_processes);
  if (h.kv_state.load(std::memory_order_acquire) != 0) bind_ledger();
}

void Registry::bind_ledger() noexcept {
  row_blocks_ = header().ledger_blocks;
  row_ = ledger_row(slot_);
}

std::shared_ptr<KvPool> Registry::maintenance_pool() {
  if (header().kv_state.load(std::memory_order_acquire) == 0) return nullptr;
  if (auto p = pool_.lock()) return p;
  const ShareHeader& h = header();
  auto lock = std::make_unique<RobustPoolLock>();
  RobustPoolLock* raw = lock.get();
  auto pool = KvPool::attach(std::make_unique<SubArena>(region_, region_->data() + h.pool_offset, h.pool_bytes),
                             std::move(lock));
  raw->bind(pool->lock_area(), [p = pool.get()] { p->rebuild_free_lists(); });
  return pool;
}

void Registry::free_record_locked(std::uint32_t r, KvPool* pool) {
  ContextRecord& rec = record(r);
  if (rec.state != kRecReleasing) {
    rec.state = kRecReleasing;
    ++rec.generation;  // from here on no descriptor of it opens
  }
  {
    Unledgered record_refs;
    const TableEntry* t = table(r);
    while (rec.retained > 0) {
      const TableEntry e = t[rec.retained - 1];
      if (pool != nullptr) pool->release(BlockRef{e.index, e.generation});
      --rec.retained;
    }
  }
  rec.owner_slot = kNone;
  rec.grants = 0;
  rec.state = kRecFree;
}

void Registry::repair_locked() {
  // Only a holder of the mutex changes records, grants and process slots,
  // and each change but a record's seal or release is a single store.
  auto pool = maintenance_pool();
  for (std::uint32_t r = 0; r < header().max_contexts; ++r) {
    const std::uint32_t s = record(r).state;
    if (s == kRecSealing || s == kRecReleasing) free_record_locked(r, pool.get());
  }
}

void Registry::release_custody_locked(std::uint32_t i) noexcept {
  for (std::uint32_t g = 0; g < header().max_grants; ++g)
    if (grant(g).state == kGrantLive && grant(g).holder_slot == i) grant(g).holder_slot = kNone;
}

void Registry::reap_slot_locked(std::uint32_t i, bool crashed) {
  ShareHeader& h = header();
  auto pool = maintenance_pool();
  // Grants in its custody: a crash may have come between issuing a grant and
  // passing it on, so nobody else can release it; a clean exit passed them on.
  if (crashed) {
    for (std::uint32_t gi = 0; gi < h.max_grants; ++gi) {
      GrantSlot& g = grant(gi);
      if (g.state != kGrantLive || g.holder_slot != i) continue;
      g.state = kGrantFree;
      ++g.generation;
      bump(kGrantsReaped);
      ContextRecord& rec = record(g.record_slot);
      if (rec.state != kRecSealed || rec.generation != g.record_generation) continue;
      --rec.grants;
      if (rec.grants == 0 && rec.owner_slot == kNone) free_record_locked(g.record_slot, pool.get());
    }
  } else {
    release_custody_locked(i);
  }
  // The producer claims it held.
  for (std::uint32_t r = 0; r < h.max_contexts; ++r) {
    ContextRecord& rec = record(r);
    if (rec.state != kRecSealed || rec.owner_slot != i) continue;
    rec.owner_slot = kNone;
    if (rec.grants == 0) free_record_locked(r, pool.get());
  }
  // Its sessions' block references.
  std::uint64_t refs = 0;
  if (pool && h.kv_state.load(std::memory_order_acquire) != 0) {
    Unledgered not_ours;
    std::atomic<std::uint32_t>* row = ledger_row(i);
    for (std::uint32_t b = 0; b < h.ledger_blocks; ++b) {
      std::uint32_t n = row[b].exchange(0, std::memory_order_relaxed);
      if (n == 0) continue;
      const BlockRef ref = pool->live_ref(b);
      for (; n > 0 && ref.valid(); --n, ++refs) pool->release(ref);
    }
  }
  process(i).state.store(kProcFree, std::memory_order_release);
  bump(kProcessesReaped);
  bump(kReferencesReaped, refs);
}

bool Registry::alive(std::uint32_t i) const {
  const ProcessSlot& p = process(i);
  if (p.state.load(std::memory_order_acquire) != kProcLive) return false;
  return i == slot_ || probe(p) != Liveness::dead;
}

int Registry::reap_locked() {
  int reaped = 0;
  for (std::uint32_t i = 0; i < header().max_processes; ++i) {
    if (i == slot_) continue;
    const ProcessSlot& p = process(i);
    const std::uint32_t s = p.state.load(std::memory_order_acquire);
    if (s == kProcFree) continue;
    const bool exited = s == kProcExited;
    if (exited || probe(p) == Liveness::dead) {
      reap_slot_locked(i, !exited);
      ++reaped;
    }
  }
  header().last_reap_ns.store(monotonic_ns(), std::memory_order_relaxed);
  return reaped;
}

}  // namespace share_detail

}  // namespace qkvshare
