#pragma once
// Keeps a workflow's handed-off contexts under a pool byte budget (docs/design.md
// "Tiers"; the policy of KVFlow, NeurIPS'25): between steps, while the pool
// holds more than the budget, the context at rest whose next consumer runs
// furthest in the future (steps-to-execution in the DAG order; least
// recently used among equals) is demoted to fewer bits in RAM when a demotion
// format is given (TierOptions::demote; every context at rest first), else
// spilled to the disk tier and its record revoked; a context the next step needs is prefetched back on a background
// thread while the current step runs, and one still on disk when its
// consumer starts is restored then. Spilled contexts come back bit-exact
// (every block authenticated and checksummed), re-sealed and re-granted
// under new descriptors, which the orchestrator takes from acquire(). A file
// stays until the context's last consumer has it, so evicting a context
// restored from disk again costs no write.
//
// The hook into the orchestrator is narrow: add() after sealing, acquire()
// and consumed() around opening, step_started() / step_finished() around a
// step. A context whose grants are held by live processes all idle past
// the pool's lease (SharePool::grants) is a victim before any other; one a
// holder used within the lease is never one. The budget applies at rest (between steps): the running step's own
// context must be in RAM, and a prefetch may add the next step's input on top.
#include <condition_variable>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "qkvshare/share/share_pool.hpp"
#include "qkvshare/tiers/disk_tier.hpp"

namespace qkvshare {

struct TierOptions {
  std::size_t budget_bytes = 0;  // pool KV bytes allowed at rest; 0: no budget (nothing moves)
  std::string spill_dir;         // disk tier folder (created; files removed when done)
  std::shared_ptr<const BlockCipher> cipher;  // seals spilled blocks; null: plaintext files
  bool prefetch = true;          // restore the next step's inputs in the background
  // The demotion tier: over the budget, a victim is first recoded into this
  // format (fewer bits, in RAM: PooledKvCache::recoded) and only spilled to
  // disk when every context at rest is demoted and the pool is still over.
  // Lossy: each demotion's change to the KV is measured and reported.
  std::optional<KvFormat> demote;
};

// One context recoded by the demotion tier, and what it cost.
struct TierDemotion {
  std::string producer;
  std::string from, to;  // KV formats
  std::size_t bytes_before = 0, bytes_after = 0;  // the context's pool bytes
  double k_rel_rms = 0, v_rel_rms = 0;  // relative RMS change of the K and V rows its consumers read
  double seconds = 0;
};

struct TierStats {
  int spills = 0;              // contexts written to disk
  int evictions = 0;           // contexts dropped from RAM (spills + clean re-evictions)
  int restores_on_demand = 0;  // restored when the consumer started (on its critical path)
  int prefetches = 0;          // restored in the background before the consumer started
  int idle_victims = 0;        // victims held by a live process idle past the pool's lease (taken first)
  std::uint64_t bytes_written = 0, bytes_read = 0;
  double restore_wait_seconds = 0;  // consumers' time spent waiting for a restore or prefetch
  std::size_t peak_at_rest_bytes = 0;  // pool bytes after enforcing, at the worst step boundary
  std::vector<std::string> failures;   // spills and demotions that failed (the context stayed as it was), with the reason
  std::vector<TierDemotion> demotions; // contexts recoded to TierOptions::demote, in order
};

class ContextTiers {
 public:
  ContextTiers(SharePool& pool, TierOptions options);
  ~ContextTiers();  // waits for prefetches, releases what is left, removes spill files
  ContextTiers(const ContextTiers&) = delete;
  ContextTiers& operator=(const ContextTiers&) = delete;

  // A context sealed by `producer` and granted to consumers (step id ->
  // descriptor); `position` gives each consumer's place in the run order.
  void add(const std::string& producer, std::map<std::string, Descriptor> grants,
           const std::map<std::string, int>& position);
  // The live descriptor for `consumer`'s grant of `producer`'s context,
  // restoring it first when it is on disk (or waiting for its prefetch).
  Descriptor acquire(const std::string& producer, const std::string& consumer);
  // `consumer` opened (and released) its grant; the context is forgotten
  // after its last consumer, and its file removed.
  void consumed(const std::string& producer, const std::string& consumer);

  // Step `position` starts: prefetch the contexts step position + 1 needs.
  void step_started(int position);
  // Step `position` ended (no session alive): evict until the budget holds.
  void step_finished(int position);

  TierStats stats() const;

 private:
  struct Entry;
  void evict_locked(Entry& e, std::unique_lock<std::mutex>& lock);
  bool demotable(const Entry& e) const;  // a demotion format is set and e has not been tried
  bool demote_locked(Entry& e);
  void restore_into(Entry& e, std::unique_lock<std::mutex>& lock, bool background);
  int next_use(const Entry& e) const;
  std::size_t pool_bytes() const;

  SharePool& pool_;
  TierOptions options_;
  DiskTier disk_;
  mutable std::mutex mutex_;
  std::map<std::string, std::unique_ptr<Entry>> entries_;  // by producer step id
  TierStats stats_;
  std::uint64_t clock_ = 0;
};

}  // namespace qkvshare
