#pragma once
// A shared context pool: the KV pool plus the registry of sealed contexts,
// in one region that every process attached to it maps (docs/design.md
// "Handoff"). docs/handoff.md describes the layout and lifetime rules.
//
// Lifetime, in short:
//  - a sealed context is a *record* holding one reference on each of its
//    blocks; it lives while its producer's claim (SealedContext) or any grant
//    (descriptor) is live, or until the producer revokes it;
//  - sessions hold their own block references, recorded per process in a
//    ledger, so the references of a process that dies (even by kill -9) are
//    given back by the reaper, which any attached process runs on attach and
//    then at most every reap_interval_ms when it seals or opens;
//  - freeing a record or a grant moves its generation on, so a descriptor
//    naming it can never be opened again, even after the slot is reused.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "qkvshare/share/descriptor.hpp"
#include "qkvshare/share/shm_region.hpp"

namespace qkvshare {

struct ShareConfig {
  std::size_t bytes = std::size_t{256} << 20;  // the whole region: registry, ledgers and KV arena
  int block_tokens = 32;
  int max_contexts = 64;    // sealed contexts alive at once
  int max_grants = 256;     // descriptors alive at once
  int max_processes = 32;   // processes attached at once
  int max_tokens = 16384;   // tokens of one sealed context
  int reap_interval_ms = 100;
  // A holder that has not used an opened context for this long is idle: the
  // tiers may demote or spill its context before any other (docs/tiers.md).
  int lease_ms = 30000;
};

// How open() uses a grant. `hold`: the opener takes custody (a crash of the
// opener voids the grant, docs/handoff.md "Grant custody") and renews its
// lease while its session commits tokens. `copy`: a reader that copies the
// context (spill, export, push, demote) leaves custody and lease as they are,
// so it may open a grant any number of times.
enum class GrantUse { hold, copy };

// issued: not opened yet; held: its opener is alive and used it within the
// lease; idle: its opener is alive and did not; delivered: its opener exited.
enum class GrantStatus { issued, held, idle, delivered };
std::string_view to_string(GrantStatus state) noexcept;  // "issued", "held", "idle", "delivered"

// One live grant, as `pool ls` lists it.
struct GrantInfo {
  std::uint32_t slot = 0, generation = 0;
  std::uint64_t context_id = 0;
  std::string producer, grantee;
  GrantStatus state = GrantStatus::issued;
  int holder_pid = 0;          // 0: nobody has custody
  std::uint64_t idle_ms = 0;   // since the holder last used it (or since it was issued)
};

// The producer's claim on a context it sealed; give it back with release().
struct SealedContext {
  std::uint32_t slot = 0, generation = 0;
  std::uint64_t context_id = 0;
  int tokens = 0;
};

struct ShareCounters {
  std::uint64_t seals = 0, grants = 0, opens_kv = 0, opens_text = 0;
  // Opens that fell back to text, by reason, and those that asked for text.
  std::uint64_t fallback_model = 0, fallback_format = 0, fallback_checksum = 0, fallback_shape = 0;
  std::uint64_t text_requested = 0;
  std::uint64_t releases = 0, revokes = 0, rejected = 0;
  std::uint64_t processes_reaped = 0, references_reaped = 0;
  std::uint64_t grants_reaped = 0;  // grants voided because their holder crashed
};

enum class FallbackReason { none, model, format, checksum, shape, requested };
std::string_view to_string(FallbackReason reason) noexcept;

struct ShareStats {
  std::string name;
  std::uint64_t pool_id = 0;
  std::size_t region_bytes = 0;
  bool kv_formatted = false;
  KvShape shape;
  int block_tokens = 0;
  PoolCounters kv;
  int max_processes = 0, max_contexts = 0, max_grants = 0, max_tokens = 0;
  int processes = 0, contexts = 0, grants = 0;
  int grants_held = 0, grants_idle = 0;  // opened grants whose holder is active / idle past the lease
  int lease_ms = 0;
  ShareCounters counters;
  std::string json() const;
};

// A validated descriptor's context, copied out of the registry.
struct OpenedContext {
  std::vector<TokenId> tokens;
  std::string text;                       // empty when it did not fit the record
  std::unique_ptr<PooledKvCache> cache;   // the KV, when asked for and usable
  FallbackReason refused = FallbackReason::none;  // why not, when asked for
  std::string refused_detail;
};

// What check() found, for `context inspect`.
struct DescriptorStatus {
  bool pool_matches = false, capability_valid = false, live = false, checksums_match = false;
  bool blocks_verified = false;  // only when a full verify ran
  std::string problem;           // the first problem, empty when valid
};

class SharePool {
 public:
  // A named POSIX shared-memory pool (`qkvshare pool serve`).
  static std::shared_ptr<SharePool> create(const std::string& name, const ShareConfig& config);
  static std::shared_ptr<SharePool> attach(const std::string& name);
  // An anonymous shared mapping: one process and the children it forks.
  static std::shared_ptr<SharePool> create_anonymous(const ShareConfig& config);
  // A region mapped already (e.g. inherited across fork()): validates and registers.
  static std::shared_ptr<SharePool> attach_region(std::shared_ptr<ShmRegion> region);
  // Removes NAME only while it still names the pool `pool_id` (a server
  // shutting down must not remove a newer pool given the same name after its
  // own was unlinked); false when it did not.
  static bool unlink_if_same(const std::string& name, std::uint64_t pool_id) noexcept;
  ~SharePool();
  SharePool(const SharePool&) = delete;
  SharePool& operator=(const SharePool&) = delete;

  const std::shared_ptr<ShmRegion>& region() const noexcept;
  std::uint64_t pool_id() const noexcept;
  int max_tokens() const noexcept;

  // The KV pool for `shape`, formatting the region's KV arena on first use;
  // Error(invalid_argument) when it holds KV of another shape.
  std::shared_ptr<KvPool> kv_pool(const KvShape& shape);
  // The KV pool of whatever shape was formatted; nullptr when none was.
  std::shared_ptr<KvPool> kv_pool_if_any();

  // Freezes `cache` (which must live in this pool): the record takes its own
  // reference on each block, so its full blocks are never written again and
  // whoever appends copies the partly filled tail first. `tokens` are the ids
  // the cache holds, `text` their text (for a consumer with another
  // tokenizer). Hashes the blocks not hashed by an earlier seal.
  SealedContext seal(const PooledKvCache& cache, std::span<const TokenId> tokens, std::string_view text,
                     const ModelFingerprint& fingerprint, std::string_view producer);
  // A descriptor for `grantee`, signed with the pool's secret.
  Descriptor grant(const SealedContext& sealed, std::string_view producer, std::string_view grantee);
  // Drops the producer's claim; the record goes when no grant is left.
  void release(const SealedContext& sealed);

  // Validates `d` for `agent` (pool, grantee, capability, generations,
  // table and token checksums) and copies the context out; with `want_kv`,
  // also attaches its blocks as a cache of `capacity` tokens (no KV byte is
  // copied) unless the stored block checksum, the pool shape or `verify`
  // (a full rehash of the blocks) says no. Error(bad_descriptor) otherwise.
  // With GrantUse::hold the opened cache renews the grant's lease as it
  // commits tokens (rate limited: at most a few stores per lease).
  OpenedContext open(const Descriptor& d, std::string_view agent, bool want_kv, int capacity, bool verify = false,
                     GrantUse use = GrantUse::hold);
  // Renews the lease of `d`'s grant (a holder working on it without committing).
  void touch(const Descriptor& d) noexcept;
  // Every live grant, with its holder and lease state.
  std::vector<GrantInfo> grants();
  int lease_ms() const noexcept;
  // The grantee is done: its grant ends (the descriptor goes stale).
  void release(const Descriptor& d, std::string_view agent);
  // The producer ends the context and every grant of it.
  void revoke(const Descriptor& d, std::string_view agent);
  void revoke(const SealedContext& sealed);

  // Checks a descriptor without an agent (`context inspect`); with `verify`,
  // rehashes the blocks. Never throws for a bad descriptor: reports it.
  DescriptorStatus check(const Descriptor& d, bool verify = false);

  // Reclaims processes that died (or detached leaving references). Returns
  // how many were reaped. Runs on attach and, rate limited, on seal/open.
  int reap();
  ShareStats stats();
  void count(FallbackReason reason) noexcept;  // an open that fell back (handoff.cpp)

  struct Impl;
  explicit SharePool(std::unique_ptr<Impl> impl);  // use create() / attach()

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace qkvshare
