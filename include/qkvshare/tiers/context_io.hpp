#pragma once
// Moving contexts between the pool and the portable format: export a
// context's blocks tile by tile into canonical bytes, import a file's blocks
// into fresh pool blocks (bit-exact: no requantization), and the two
// share-level operations built on them (a descriptor's context to bytes, and
// bytes to a sealed context of this pool). Used by the disk and remote
// tiers and by `qkvshare context export/import`.
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "qkvshare/share/fingerprint.hpp"
#include "qkvshare/share/share_pool.hpp"
#include "qkvshare/tiers/context_file.hpp"

namespace qkvshare {

// The portable view of a context living in a pool (payloads are read by
// pooled_block_source).
ContextMeta context_meta(const PooledKvCache& cache, std::span<const TokenId> tokens, std::string_view text,
                         const ModelFingerprint& fingerprint);
BlockSource pooled_block_source(const PooledKvCache& cache);

// Writes the context to `sink`; returns the bytes written.
std::uint64_t write_pooled_context(const PooledKvCache& cache, std::span<const TokenId> tokens, std::string_view text,
                                   const ModelFingerprint& fingerprint, const ByteSink& sink,
                                   const BlockCipher* cipher = nullptr);

// Allocates the reader's blocks in `pool` and fills them (every block is
// authenticated and checksummed first); the result holds the only reference
// to each block. Error(bad_descriptor) for a file that does not fit the pool
// (shape, block size) and for every validation failure; Error(out_of_memory)
// when the pool is full. On failure every block allocated is given back.
std::unique_ptr<PooledKvCache> import_context(const ContextReader& reader, std::shared_ptr<KvPool> pool, int capacity,
                                              const BlockCipher* cipher = nullptr);

// Opens `d` as `agent` and writes its context; the grant stays live.
std::uint64_t export_descriptor(SharePool& pool, const Descriptor& d, std::string_view agent, const ByteSink& sink,
                                const BlockCipher* cipher = nullptr);

// Imports into `pool` and seals it as `producer`'s context. With `expected`,
// a file made by another model is refused (Error(bad_descriptor)).
SealedContext import_sealed(SharePool& pool, const ContextReader& reader, std::string_view producer,
                            const ModelFingerprint* expected = nullptr, const BlockCipher* cipher = nullptr);

ModelFingerprint fingerprint_of(const ContextMeta& meta);

}  // namespace qkvshare
