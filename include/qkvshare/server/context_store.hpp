#pragma once
// The server's sealed contexts: every completion's context (prompt + reply)
// is sealed into the shared pool, indexed for automatic reuse within its
// tenant, and named to the client by a handle (a descriptor granted to the
// tenant, so another process on the same pool can open it too). Contexts are
// evicted least recently used first when the pool's KV bytes pass the budget
// or the registry runs out of records; a handle to an evicted context is
// answered 404. With tiers (StoreOptions::spill_dir / demote, docs/tiers.md)
// an evicted context is first recoded to fewer bits, then spilled to a file,
// and restored from it (every block verified) when a request reuses it; its
// ctx- id stays valid, the handles given out before the spill do not.
// Thread-safe: HTTP handlers and the scheduler share it.
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "qkvshare/engine/engine.hpp"
#include "qkvshare/server/reuse_index.hpp"
#include "qkvshare/share/share_pool.hpp"
#include "qkvshare/tiers/disk_tier.hpp"

namespace qkvshare::server {

struct StoreOptions {
  std::size_t budget_bytes = 0;  // KV bytes of the pool kept for cached contexts (0: 3/4 of the arena)
  bool auto_reuse = true;
  // Tiers: where evicted contexts are spilled (empty: dropped, as without
  // tiers), the key that seals their blocks, and the format a context is
  // recoded to before it is spilled (lossy; the change is measured).
  std::string spill_dir;
  std::shared_ptr<const BlockCipher> cipher;
  std::optional<KvFormat> demote;
};

// What the tiers did, for /metrics.
struct StoreTierStats {
  std::uint64_t spills = 0, restores = 0, demotions = 0, spill_failures = 0, restore_failures = 0;
  std::uint64_t bytes_spilled = 0;   // written to spill files, in all
  std::uint64_t bytes_on_disk = 0;   // in the spill files that exist now
  std::uint64_t contexts_on_disk = 0;
};

struct SealedInfo {
  std::uint64_t id = 0;
  std::string name;    // "ctx-<16 hex>"
  std::string handle;  // the owner's descriptor, as a handle
  int tokens = 0;
  std::string format;
  std::vector<std::pair<std::string, std::string>> grants;  // agent -> handle
};

class ContextStore {
 public:
  ContextStore(std::shared_ptr<SharePool> pool, Engine& engine, StoreOptions options);
  ~ContextStore();  // revokes every context it sealed
  ContextStore(const ContextStore&) = delete;
  ContextStore& operator=(const ContextStore&) = delete;

  SharePool& pool() noexcept { return *pool_; }
  static std::string name_of(std::uint64_t id);

  // Seals `session` for `owner`, grants it to `grant_to`, indexes it for
  // reuse under the session's own KV format. `pending`: the reply's last
  // sampled token, which has no KV yet (a reply that ended by length); it is
  // part of the transcript a client continues, not of the sealed tokens.
  SealedInfo add(const std::string& owner, const Session& session, const std::vector<std::string>& grant_to, bool index,
                 std::optional<TokenId> pending = std::nullopt);

  // A client's reference ("ctx-..." id or "qkv1." handle) to a context
  // `tenant` may open: its own, or granted to it. Throws ApiError 400 (not a
  // reference), 404 (unknown, evicted, released or another tenant's).
  std::uint64_t resolve(const std::string& tenant, const std::string& ref, const std::string& param);
  // The tokens (those with KV) and format of a resolved context.
  std::vector<TokenId> tokens(std::uint64_t id);
  // Its tokens and then its pending token, if any: what the model has seen
  // and said, so the text a request appends to the context follows it.
  std::vector<TokenId> transcript(std::uint64_t id);
  KvFormat format(std::uint64_t id);

  // Longest indexed prefix of `prompt` among `tenant`'s contexts in `format`.
  ReuseIndex::Match lookup(const std::string& tenant, const KvFormat& format, std::span<const TokenId> prompt);
  // Runs of `tenant`'s contexts in `format` inside prompt[from, end) (ReuseIndex::spans).
  std::vector<ReuseIndex::Span> find_spans(const std::string& tenant, const KvFormat& format,
                                           std::span<const TokenId> prompt, int from, int end, int min_tokens);

  // A session on the first `tokens` tokens of context `id` (no KV copied), of
  // `capacity` tokens. The result may hold fewer tokens (down to a block
  // boundary: a quantized block cannot be cut); returns nullptr when none is left.
  std::unique_ptr<Session> open_prefix(std::uint64_t id, const std::string& tenant, int tokens, int capacity);

  // Owner: revokes the context and all its handles; grantee: drops its grant.
  void release(const std::string& tenant, std::uint64_t id);
  // A new context on the same blocks, owned by `tenant`.
  SealedInfo fork(const std::string& tenant, std::uint64_t id, const std::vector<std::string>& grant_to);
  nlohmann::json describe(const std::string& tenant, std::uint64_t id);
  nlohmann::json list(const std::string& tenant);

  // Evicts least recently used contexts while the pool uses more KV bytes
  // than the budget; evict_one() for an allocation that failed. Both return
  // how many contexts went.
  int evict_over_budget();
  bool evict_one();

  // Per KV format: blocks and bytes count each pool block once, however many
  // cached contexts share it (a context and the ones that continued it).
  struct FormatStats {
    int contexts = 0;
    long long tokens = 0, blocks = 0;
    std::size_t bytes = 0;
  };
  std::map<std::string, FormatStats> stats();
  std::uint64_t evictions() const noexcept { return evictions_; }
  StoreTierStats tier_stats();
  std::size_t budget_bytes() const noexcept { return options_.budget_bytes; }
  void release_all();

 private:
  struct Entry {
    std::string owner;
    SealedContext sealed;
    Descriptor own;  // granted to the owner: the handle, and what internal opens use
    std::map<std::string, Descriptor> grants;
    std::vector<TokenId> tokens;
    std::optional<TokenId> pending;  // sampled, not fed (add())
    KvFormat format;
    std::size_t bytes = 0;
    int blocks = 0;
    std::vector<std::uint32_t> block_index;  // pool blocks it holds (shared with its forks)
    std::int64_t created_ms = 0;
    std::uint64_t last_used = 0;
    bool indexed = false;
    bool on_disk = false;     // spilled: `sealed` and every descriptor are revoked, the file holds it
    bool file_kept = false;   // the spill file still matches the context (after a restore): no rewrite
    std::uint64_t file_bytes = 0;
    bool demote_tried = false;
    std::optional<KvFormat> demoted_from;  // with the measured relative RMS change of K and V
    double k_rel_rms = 0, v_rel_rms = 0;
  };
  std::string partition(const std::string& tenant, const KvFormat& format) const;
  // 404 naming `param` unless visible.
  Entry& visible(const std::string& tenant, std::uint64_t id, const std::string& param = "qkvshare.context");
  SealedInfo add_locked(const std::string& owner, const PooledKvCache& cache, std::span<const TokenId> tokens,
                        const std::vector<std::string>& grant_to, bool index,
                        std::optional<TokenId> pending = std::nullopt);
  void drop_locked(std::uint64_t id);
  bool evict_one_locked();
  // store_tiers.cpp
  bool demote_locked(std::uint64_t id, Entry& e);
  bool spill_locked(std::uint64_t id, Entry& e);
  void ensure_resident_locked(std::uint64_t id, Entry& e);
  void forget_file_locked(std::uint64_t id, Entry& e) noexcept;
  void regrant_locked(Entry& e, const SealedContext& sealed);
  void claim_spill_dir();
  void release_spill_dir() noexcept;
  std::unique_ptr<Session> cut_segments(const PooledKvCache& cache, const Entry& e, int tokens, int capacity);

  std::shared_ptr<SharePool> pool_;
  Engine& engine_;
  StoreOptions options_;
  ModelFingerprint fingerprint_;
  std::mutex mu_;
  std::map<std::uint64_t, Entry> entries_;
  ReuseIndex index_;
  std::uint64_t clock_ = 0, evictions_ = 0;
  std::unique_ptr<DiskTier> disk_;
  int spill_lock_fd_ = -1;  // flock on the spill folder: one server a folder
  StoreTierStats tier_stats_;
};

}  // namespace qkvshare::server
