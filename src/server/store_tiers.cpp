// The context store's tiers (docs/tiers.md, "The server"): what eviction does
// to a cached context when the server has --demote / --spill-dir, and how a
// spilled one comes back. The policy is LRU (the server has no DAG).
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "qkvshare/core/error.hpp"
#include "qkvshare/server/api.hpp"
#include "qkvshare/server/context_store.hpp"

namespace qkvshare::server {

namespace {

// One JSON line on stderr, like the server's request log: an operator sees why
// a context was not kept without scraping /metrics.
void log_tier_event(const nlohmann::json& event) {
  std::fprintf(stderr, "%s\n", event.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
}

}  // namespace

void ContextStore::claim_spill_dir() {
  // The files are named by this store's ids, which start again at every
  // start: a folder two servers share would mix their contexts, and the files
  // a killed server left are nobody's. So a server holds the folder's lock
  // while it runs and clears those files when it gets it.
  const std::string lock_path = disk_->dir() + "/.qkvshare-serve.lock";
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) fail(ErrorCode::io, "--spill-dir {}: cannot open {}: {}", disk_->dir(), lock_path, std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK)
      fail(ErrorCode::invalid_argument, "--spill-dir {}: another qkvshare serve is using this folder; give each server its own",
           disk_->dir());
    fail(ErrorCode::io, "--spill-dir {}: cannot lock {}: {}", disk_->dir(), lock_path, std::strerror(err));
  }
  spill_lock_fd_ = fd;
  std::size_t stale = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(disk_->dir(), ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("ctx-") && name.ends_with(".qkvctx") && std::filesystem::remove(entry.path(), ec)) ++stale;
  }
  if (stale > 0) log_tier_event({{"event", "stale_spill_files_removed"}, {"dir", disk_->dir()}, {"files", stale}});
}

void ContextStore::release_spill_dir() noexcept {
  if (spill_lock_fd_ < 0) return;
  ::close(spill_lock_fd_);  // closing drops the flock
  spill_lock_fd_ = -1;
}

void ContextStore::regrant_locked(Entry& e, const SealedContext& sealed) {
  // The owner's grant and every tenant's grant again, on the new sealed context.
  Descriptor own = pool_->grant(sealed, e.owner, e.owner);
  std::map<std::string, Descriptor> grants;
  for (const auto& [agent, old] : e.grants) grants.emplace(agent, pool_->grant(sealed, e.owner, agent));
  e.sealed = sealed;
  e.own = own;
  e.grants = std::move(grants);
}

bool ContextStore::demote_locked(std::uint64_t id, Entry& e) {
  e.demote_tried = true;
  const KvFormat& to = *options_.demote;
  const auto kv = pool_->kv_pool(engine_.kv_shape());
  if (e.format.cold_bits(kv->block_tokens(), kv->shape().head_dim) <= to.cold_bits(kv->block_tokens(), kv->shape().head_dim))
    return false;  // no fewer bits: nothing to gain, spill it instead
  const KvFormat from = e.format;
  std::optional<SealedContext> sealed;
  PooledKvCache::RecodeCost cost;
  std::size_t bytes_after = 0;
  std::vector<std::uint32_t> blocks_after;
  try {
    {
      // A copy: the store keeps custody and the lease as they were.
      OpenedContext oc = pool_->open(e.own, e.owner, /*want_kv=*/true, static_cast<int>(e.tokens.size()),
                                     /*verify=*/false, GrantUse::copy);
      if (!oc.cache) fail(ErrorCode::bad_descriptor, "its KV cannot be used here: {}", oc.refused_detail);
      const auto copy = oc.cache->recoded(to, &cost);
      bytes_after = copy->kv_bytes();
      for (const KvSegment& s : copy->segments())
        for (const BlockRef& b : s.blocks) blocks_after.push_back(b.index);
      sealed = pool_->seal(*copy, oc.tokens, oc.text, fingerprint_, e.owner);
    }
    const SealedContext old = e.sealed;
    regrant_locked(e, *sealed);
    pool_->revoke(old);  // the old blocks go back to the pool
  } catch (const Error& err) {
    // The context stays as it was; a half-made copy goes back to the pool.
    if (sealed && !(e.sealed.context_id == sealed->context_id)) pool_->revoke(*sealed);
    log_tier_event({{"event", "demote_failed"}, {"context", name_of(id)}, {"to", to.to_string()}, {"error", err.what()}});
    return false;
  }
  forget_file_locked(id, e);  // a file would hold the old precision
  e.demoted_from = from;
  e.k_rel_rms = cost.k_rel_rms;
  e.v_rel_rms = cost.v_rel_rms;
  log_tier_event({{"event", "demote"}, {"context", name_of(id)}, {"from", from.to_string()}, {"to", to.to_string()},
                  {"kv_bytes_before", e.bytes}, {"kv_bytes_after", bytes_after},
                  {"k_rel_rms", cost.k_rel_rms}, {"v_rel_rms", cost.v_rel_rms}});
  e.format = to;
  e.bytes = bytes_after;
  e.blocks = static_cast<int>(blocks_after.size());
  e.block_index = std::move(blocks_after);
  // Automatic reuse matches a request's KV format: the demoted context is found by requests in its new one.
  if (e.indexed) {
    index_.erase(id);
    index_.insert(id, partition(e.owner, e.format), e.tokens);
  }
  ++tier_stats_.demotions;
  return true;
}

bool ContextStore::spill_locked(std::uint64_t id, Entry& e) {
  if (!e.file_kept) {
    try {
      const SpillResult r = disk_->spill(*pool_, e.own, e.owner, name_of(id));
      e.file_bytes = r.file_bytes;
      e.file_kept = true;
      tier_stats_.bytes_spilled += r.file_bytes;
      tier_stats_.bytes_on_disk += r.file_bytes;
      ++tier_stats_.contexts_on_disk;
    } catch (const Error& err) {
      // Nothing was written (file_io writes under a temporary name): the caller drops the context, as without tiers.
      ++tier_stats_.spill_failures;
      log_tier_event({{"event", "spill_failed"}, {"context", name_of(id)}, {"action", "dropped"}, {"error", err.what()}});
      return false;
    }
  }
  try {
    pool_->revoke(e.sealed);  // every descriptor ends; the blocks go back to the pool
  } catch (const Error&) {
    // Already revoked elsewhere: its blocks are back either way.
  }
  e.on_disk = true;
  ++tier_stats_.spills;
  return true;
}

void ContextStore::ensure_resident_locked(std::uint64_t id, Entry& e) {
  if (!e.on_disk) return;
  RestoreResult r;
  try {
    // A full pool gives room by evicting others (this one is not in RAM, so it is never the victim).
    for (;;) {
      try {
        r = disk_->restore(*pool_, name_of(id), e.owner, &fingerprint_);
        break;
      } catch (const Error& err) {
        if (err.code() != ErrorCode::out_of_memory || !evict_one_locked()) throw;
      }
    }
  } catch (const Error& err) {
    if (err.code() == ErrorCode::out_of_memory) throw;  // the scheduler answers a full pool (retry or 503)
    // A file that does not verify is never decoded: the context is gone, and a request prefills instead.
    ++tier_stats_.restore_failures;
    log_tier_event({{"event", "restore_failed"}, {"context", name_of(id)}, {"action", "dropped"}, {"error", err.what()}});
    const std::string what = err.what();
    drop_locked(id);
    throw ApiError(404, "not_found_error", "qkvshare.context",
                   fmt::format("context {} was spilled to disk and could not be restored: {}", name_of(id), what));
  }
  try {
    regrant_locked(e, r.sealed);  // the store keeps import_sealed's reference, as add() keeps seal()'s
  } catch (...) {
    pool_->revoke(r.sealed);
    throw;
  }
  e.on_disk = false;
  e.last_used = ++clock_;
  ++tier_stats_.restores;
}

void ContextStore::forget_file_locked(std::uint64_t id, Entry& e) noexcept {
  if (!e.file_kept) return;
  disk_->remove(name_of(id));
  tier_stats_.bytes_on_disk -= e.file_bytes;
  --tier_stats_.contexts_on_disk;
  e.file_kept = false;
  e.file_bytes = 0;
}

StoreTierStats ContextStore::tier_stats() {
  std::lock_guard lock(mu_);
  return tier_stats_;
}

}  // namespace qkvshare::server
