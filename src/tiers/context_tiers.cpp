#include "qkvshare/tiers/context_tiers.hpp"

#include <chrono>
#include <climits>
#include <optional>
#include <tuple>

#include "qkvshare/core/clock.hpp"
#include "qkvshare/core/error.hpp"

namespace qkvshare {

struct ContextTiers::Entry {
  std::string producer;
  std::map<std::string, Descriptor> grants;  // remaining consumer -> live descriptor (while resident)
  std::map<std::string, int> position;       // remaining consumer -> its place in the run order
  bool resident = true;
  bool on_disk = false;       // the file holds this context (written once, kept until the last consumer)
  bool spill_failed = false;  // the disk refused once: keep it in RAM
  bool demoted = false;       // recoded to TierOptions::demote (or already at no more bits)
  std::uint64_t last_use = 0;
  std::size_t kv_bytes = 0;     // pool bytes when resident (from the format; exact for full blocks)
  std::future<void> restoring;  // a background restore in flight (or done, not yet collected)
};

namespace {
bool ready(const std::future<void>& f) {
  return f.valid() && f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

enum class TierHold { none, idle, active };

// Per context id: active when some live holder used one of its grants within
// the lease, idle when it has holders and all are idle, none when no live
// process holds a grant of it (at rest).
std::map<std::uint64_t, TierHold> holds_by_context(SharePool& pool) {
  std::map<std::uint64_t, TierHold> out;
  for (const GrantInfo& g : pool.grants()) {
    TierHold& h = out[g.context_id];
    if (g.state == GrantStatus::held) h = TierHold::active;
    else if (g.state == GrantStatus::idle && h == TierHold::none) h = TierHold::idle;
  }
  return out;
}
}  // namespace

ContextTiers::ContextTiers(SharePool& pool, TierOptions options)
    : pool_(pool), options_(std::move(options)), disk_(options_.spill_dir, options_.cipher) {}

ContextTiers::~ContextTiers() {
  std::unique_lock lock(mutex_);
  for (auto& [name, e] : entries_) {
    if (e->restoring.valid()) {
      lock.unlock();
      try {
        e->restoring.get();
      } catch (const Error&) {  // already counted; nothing to undo
      }
      lock.lock();
    }
    if (e->on_disk) disk_.remove(e->producer);
  }
}

std::size_t ContextTiers::pool_bytes() const { return pool_.stats().kv.bytes_used; }

int ContextTiers::next_use(const Entry& e) const {
  int best = INT_MAX;
  for (const auto& [consumer, pos] : e.position) best = std::min(best, pos);
  return best;
}

void ContextTiers::add(const std::string& producer, std::map<std::string, Descriptor> grants,
                       const std::map<std::string, int>& position) {
  if (grants.empty()) return;
  auto e = std::make_unique<Entry>();
  e->producer = producer;
  for (const auto& [consumer, d] : grants) {
    const auto it = position.find(consumer);
    QKV_CHECK(it != position.end());
    e->position[consumer] = it->second;
  }
  const Descriptor& any = grants.begin()->second;
  if (const auto f = any.format(); f && pool_.kv_pool_if_any())
    e->kv_bytes = f->context_bytes(pool_.kv_pool_if_any()->shape(), static_cast<int>(any.block_tokens),
                                   static_cast<int>(any.token_count));
  e->grants = std::move(grants);
  std::lock_guard lock(mutex_);
  e->last_use = ++clock_;
  QKV_CHECK(entries_.count(producer) == 0);
  entries_[producer] = std::move(e);
}

void ContextTiers::restore_into(Entry& e, std::unique_lock<std::mutex>& lock, bool background) {
  // Called with the lock held; the import itself runs without it.
  const std::string producer = e.producer;
  std::vector<std::string> consumers;
  for (const auto& [c, pos] : e.position) consumers.push_back(c);
  lock.unlock();
  RestoreResult r;
  std::map<std::string, Descriptor> grants;
  try {
    r = disk_.restore(pool_, producer, producer);
    for (const std::string& c : consumers) grants.emplace(c, pool_.grant(r.sealed, producer, c));
    pool_.release(r.sealed);  // the grants keep it
  } catch (...) {
    lock.lock();
    throw;
  }
  lock.lock();
  e.grants = std::move(grants);
  e.resident = true;
  e.last_use = ++clock_;
  stats_.bytes_read += r.file_bytes;
  ++(background ? stats_.prefetches : stats_.restores_on_demand);
}

Descriptor ContextTiers::acquire(const std::string& producer, const std::string& consumer) {
  std::unique_lock lock(mutex_);
  const auto it = entries_.find(producer);
  if (it == entries_.end())
    fail(ErrorCode::internal, "tiers: no context of '{}' is tracked for '{}'", producer, consumer);
  Entry& e = *it->second;
  const auto t0 = std::chrono::steady_clock::now();
  if (e.restoring.valid()) {
    std::future<void> f = std::move(e.restoring);
    lock.unlock();
    f.get();  // a failed prefetch rethrows here, naming the file
    lock.lock();
    stats_.restore_wait_seconds += seconds_since(t0);
  } else if (!e.resident) {
    restore_into(e, lock, false);
    stats_.restore_wait_seconds += seconds_since(t0);
  }
  e.last_use = ++clock_;
  const auto g = e.grants.find(consumer);
  if (g == e.grants.end())
    fail(ErrorCode::internal, "tiers: the context of '{}' has no grant for '{}'", producer, consumer);
  return g->second;
}

void ContextTiers::consumed(const std::string& producer, const std::string& consumer) {
  std::lock_guard lock(mutex_);
  const auto it = entries_.find(producer);
  if (it == entries_.end()) return;
  Entry& e = *it->second;
  e.grants.erase(consumer);
  e.position.erase(consumer);
  if (e.position.empty()) {
    if (e.on_disk) disk_.remove(producer);
    entries_.erase(it);
  }
}

void ContextTiers::step_started(int position) {
  if (!options_.prefetch || options_.budget_bytes == 0) return;
  std::lock_guard lock(mutex_);
  // What stays at rest after this step: resident contexts a later step needs.
  std::size_t kept = 0;
  for (const auto& [name, ep] : entries_)
    if (ep->resident || ep->restoring.valid()) {
      for (const auto& [c, pos] : ep->position)
        if (pos > position) {
          kept += ep->kv_bytes;
          break;
        }
    }
  for (auto& [name, ep] : entries_) {
    Entry& e = *ep;
    if (e.resident || e.restoring.valid() || next_use(e) != position + 1) continue;
    // Only what the budget can keep: a prefetch evicted again at the step's end would be wasted work.
    if (kept + e.kv_bytes > options_.budget_bytes) continue;
    kept += e.kv_bytes;
    e.restoring = std::async(std::launch::async, [this, &e] {
      std::unique_lock l(mutex_);
      restore_into(e, l, true);
    });
  }
}

void ContextTiers::evict_locked(Entry& e, std::unique_lock<std::mutex>& lock) {
  QKV_CHECK(e.resident && !e.grants.empty());
  const auto& [grantee, d] = *e.grants.begin();
  if (!e.on_disk) {
    try {
      const SpillResult r = disk_.spill(pool_, d, grantee, e.producer);
      stats_.bytes_written += r.file_bytes;
      ++stats_.spills;
      e.on_disk = true;
    } catch (const Error& err) {
      // Nothing changed in the pool: the context stays in RAM, and says why.
      e.spill_failed = true;
      stats_.failures.push_back(fmt::format("spill of '{}' failed, kept in RAM: {}", e.producer, err.what()));
      return;
    }
  }
  pool_.revoke(d, e.producer);  // every grant ends; the blocks go back to the pool
  e.grants.clear();
  e.resident = false;
  ++stats_.evictions;
  (void)lock;
}

bool ContextTiers::demotable(const Entry& e) const { return options_.demote && !e.demoted; }

bool ContextTiers::demote_locked(Entry& e) {
  QKV_CHECK(e.resident && !e.grants.empty() && options_.demote);
  e.demoted = true;  // tried once, whatever the outcome
  const auto t0 = std::chrono::steady_clock::now();
  const KvFormat& to = *options_.demote;
  const auto& [grantee, d] = *e.grants.begin();
  const std::optional<KvFormat> from = d.format();
  const auto kv = pool_.kv_pool_if_any();
  if (!from || !kv) return false;
  if (from->cold_bits(kv->block_tokens(), kv->shape().head_dim) <= to.cold_bits(kv->block_tokens(), kv->shape().head_dim))
    return false;  // no fewer bits: nothing to gain
  TierDemotion record{e.producer, from->to_string(), to.to_string()};
  std::optional<SealedContext> sealed;
  try {
    {
      OpenedContext opened = pool_.open(d, grantee, true, static_cast<int>(d.token_count), false, GrantUse::copy);
      if (!opened.cache)
        fail(ErrorCode::bad_descriptor, "its KV cannot be used here ({}: {})", to_string(opened.refused),
             opened.refused_detail);
      PooledKvCache::RecodeCost cost;
      const auto copy = opened.cache->recoded(to, &cost);
      record.bytes_before = opened.cache->kv_bytes();
      record.bytes_after = copy->kv_bytes();
      record.k_rel_rms = cost.k_rel_rms;
      record.v_rel_rms = cost.v_rel_rms;
      sealed = pool_.seal(*copy, opened.tokens, opened.text, d.fingerprint, e.producer);
    }
    std::map<std::string, Descriptor> grants;
    for (const auto& [consumer, old] : e.grants) grants.emplace(consumer, pool_.grant(*sealed, e.producer, consumer));
    pool_.release(*sealed);  // the grants keep it
    pool_.revoke(d, e.producer);  // the old blocks go back to the pool
    e.grants = std::move(grants);
  } catch (const Error& err) {
    // The context stays as it was, in RAM; a half-made copy goes back to the pool.
    if (sealed) pool_.revoke(*sealed);
    stats_.failures.push_back(fmt::format("demotion of '{}' to {} failed, kept as it was: {}", e.producer,
                                          to.to_string(), err.what()));
    return false;
  }
  if (e.on_disk) {  // the file holds the old precision: the next eviction writes this one
    disk_.remove(e.producer);
    e.on_disk = false;
  }
  e.kv_bytes = record.bytes_after;
  record.seconds = seconds_since(t0);
  stats_.demotions.push_back(std::move(record));
  return true;
}

void ContextTiers::step_finished(int position) {
  if (options_.budget_bytes == 0) return;
  std::unique_lock lock(mutex_);
  const int now = position + 1;
  std::size_t bytes = pool_bytes();
  while (bytes > options_.budget_bytes) {
    Entry* victim = nullptr;
    const std::map<std::uint64_t, TierHold> holds = holds_by_context(pool_);
    const auto hold_of = [&](const Entry& x) {
      const auto it = holds.find(x.grants.begin()->second.context_id);
      return it == holds.end() ? TierHold::none : it->second;
    };
    for (auto& [name, ep] : entries_) {
      Entry& e = *ep;
      if (ready(e.restoring)) {  // a finished prefetch is resident like any other context
        std::string failed;
        lock.unlock();
        try {
          e.restoring.get();
        } catch (const Error& err) {
          failed = err.what();
        }
        lock.lock();
        if (!failed.empty()) stats_.failures.push_back(fmt::format("prefetch of '{}' failed: {}", e.producer, failed));
      }
      if (!e.resident || e.restoring.valid() || e.grants.empty()) continue;
      if (!demotable(e) && e.spill_failed) continue;
      if (hold_of(e) == TierHold::active) continue;  // a holder is working on it
      // Idle-held contexts first (their holder has stopped using them), then
      // demotion (it keeps the context in RAM), then spilling; the furthest
      // next use first within each, the least recently used among equals.
      const auto key = [&](const Entry& x) {
        return std::make_tuple(hold_of(x) == TierHold::idle, demotable(x), next_use(x) - now,
                               -static_cast<long long>(x.last_use));
      };
      if (victim == nullptr || key(e) > key(*victim)) victim = &e;
    }
    if (victim == nullptr) break;
    if (hold_of(*victim) == TierHold::idle) ++stats_.idle_victims;
    if (demotable(*victim))
      demote_locked(*victim);
    else
      evict_locked(*victim, lock);
    bytes = pool_bytes();
  }
  stats_.peak_at_rest_bytes = std::max(stats_.peak_at_rest_bytes, bytes);
}

TierStats ContextTiers::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

}  // namespace qkvshare
