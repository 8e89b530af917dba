#include "qkvshare/kv/block_checksums.hpp"

#include <atomic>

#include "background_worker.hpp"

namespace qkvshare::kv {

namespace {

std::atomic<bool> g_on{true};

BackgroundWorker& checksum_worker() { return BackgroundWorker::get(BackgroundWorker::Purpose::checksums); }

}  // namespace

void checksum_later(const std::shared_ptr<KvPool>& pool, BlockRef ref) {
  if (!g_on.load(std::memory_order_relaxed)) return;
  // A child of fork() runs no worker: its seals hash what they need.
  checksum_worker().push([weak = std::weak_ptr<KvPool>(pool), ref] {
    const std::shared_ptr<KvPool> p = weak.lock();
    if (p) p->keep_checksum_if_live(ref);  // skipped when the block was freed before its turn
  });
}

void wait_for_checksums() { checksum_worker().wait_all(); }

void set_background_checksums(bool on) noexcept { g_on.store(on, std::memory_order_relaxed); }

}  // namespace qkvshare::kv
