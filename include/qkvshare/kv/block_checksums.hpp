#pragma once
// Checksums of full blocks, computed off the decode path (issue 16 item 2).
//
// Sealing a context needs the checksum of each of its blocks. A block that
// fills never changes again, so PooledKvCache hands it here when it fills,
// and one background thread of this process computes its checksum and keeps
// it in the block's header (KvPool::checksum), while decoding goes on. A
// seal then reads the kept values: constant work per block instead of hashing
// the whole context. The thread takes no block reference (counts stay what
// their owners made them); blocks freed before their turn are skipped, and a
// pool destroyed meanwhile too (jobs hold it weakly). The thread starts on
// first use and is joined at exit; fork() waits for a hash in progress, and a
// child of fork() starts no thread (its seals hash what they need).
#include <memory>

#include "qkvshare/kv/kv_pool.hpp"

namespace qkvshare::kv {

// Queues `ref`'s checksum (a no-op when background checksums are off).
void checksum_later(const std::shared_ptr<KvPool>& pool, BlockRef ref);
// Waits until every block queued so far is done (benchmarks and tests).
void wait_for_checksums();
// Process-wide switch, default on. Off: seal computes what it does not find
// kept (how sealing worked before; bench_handoff measures both).
void set_background_checksums(bool on) noexcept;

}  // namespace qkvshare::kv
