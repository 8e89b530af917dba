#include "qkvshare/tiers/disk_tier.hpp"

#include <unistd.h>

#include <chrono>
#include <filesystem>

#include "qkvshare/core/clock.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/mapped_file.hpp"
#include "qkvshare/tiers/context_io.hpp"
#include "qkvshare/core/file_io.hpp"

namespace qkvshare {

DiskTier::DiskTier(std::string dir, std::shared_ptr<const BlockCipher> cipher)
    : dir_(std::move(dir)), cipher_(std::move(cipher)) {
  if (dir_.empty()) fail(ErrorCode::invalid_argument, "disk tier: no spill folder given");
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec || !std::filesystem::is_directory(dir_))
    fail(ErrorCode::io, "{}: cannot create the spill folder: {}", dir_, ec ? ec.message() : "not a folder");
  remove_stale_parts(dir_);
}

std::string DiskTier::path_of(std::string_view name) const { return dir_ + "/" + std::string(name) + ".qkvctx"; }

SpillResult DiskTier::spill(SharePool& pool, const Descriptor& d, std::string_view agent, std::string_view name) const {
  const auto t0 = std::chrono::steady_clock::now();
  SpillResult r;
  r.path = path_of(name);
  r.tokens = static_cast<int>(d.token_count);
  pool.kv_pool_if_any();
  OpenedContext opened = pool.open(d, agent, true, static_cast<int>(d.token_count), false, GrantUse::copy);
  if (!opened.cache)
    fail(ErrorCode::bad_descriptor, "spill: the KV of context {} cannot be used here ({}: {})", d.context_id,
         to_string(opened.refused), opened.refused_detail);
  r.kv_bytes = opened.cache->kv_bytes();
  r.file_bytes = write_file_atomic(r.path, [&](const ByteSink& sink) {
    write_pooled_context(*opened.cache, opened.tokens, opened.text, d.fingerprint, sink, cipher_.get());
  }, 0600);
  r.seconds = seconds_since(t0);
  return r;
}

RestoreResult DiskTier::restore(SharePool& pool, std::string_view name, std::string_view producer,
                                const ModelFingerprint* expected) const {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string path = path_of(name);
  const MappedFile file(path);  // mmap'd back: blocks are copied from the page cache into the pool once
  const ContextReader reader(file.bytes(), path);
  RestoreResult r;
  r.sealed = import_sealed(pool, reader, producer, expected, cipher_.get());
  r.file_bytes = file.size();
  r.seconds = seconds_since(t0);
  return r;
}

void DiskTier::remove(std::string_view name) const noexcept {
  std::error_code ec;
  std::filesystem::remove(path_of(name), ec);
}

}  // namespace qkvshare
