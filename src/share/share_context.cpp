// Seal, grant, open, release and revoke: the lifetime of a sealed context.
#include <xxhash.h>

#include <cstring>

#include "qkvshare/core/error.hpp"
#include "share_impl.hpp"

namespace qkvshare {

using namespace share_detail;


namespace {

// Covers the block table and the segment table: an edited segment fails it as an edited block does.
std::uint64_t table_checksum(const TableEntry* table, std::size_t n, const SegmentEntry* segs, std::size_t m) {
  return XXH3_64bits_withSeed(segs, m * sizeof(SegmentEntry), XXH3_64bits(table, n * sizeof(TableEntry)));
}

bool equal_tags(const std::array<std::uint8_t, kCapabilityBytes>& a, const std::array<std::uint8_t, kCapabilityBytes>& b) {
  std::uint8_t diff = 0;  // constant time: the comparison does not tell where a forgery went wrong
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<std::uint8_t>(a[i] ^ b[i]);
  return diff == 0;
}

std::string record_producer(const ContextRecord& rec) {
  return std::string(rec.producer, strnlen(rec.producer, sizeof rec.producer));
}

Descriptor descriptor_of(const ShareHeader& h, const ContextRecord& rec, std::uint32_t r, const GrantSlot& g,
                         std::uint32_t gi) {
  Descriptor d;
  d.pool_id = h.pool_id;
  d.context_id = rec.context_id;
  d.record_slot = r;
  d.record_generation = rec.generation;
  d.grant_slot = gi;
  d.grant_generation = g.generation;
  d.token_count = rec.token_count;
  d.position_begin = rec.position_begin;
  d.position_end = rec.position_begin + rec.token_count + rec.position_gap;
  d.block_tokens = rec.block_tokens;
  d.block_count = rec.block_count;
  d.k_codec = rec.k_codec;
  d.v_codec = rec.v_codec;
  d.window = rec.window;
  d.sink = rec.sink;
  d.format_flags = rec.format_flags;
  d.lo_k_codec = rec.lo_k_codec;
  d.lo_v_codec = rec.lo_v_codec;
  d.top_millionths = rec.top_millionths;
  d.codebook_id = rec.codebook_id;
  std::memcpy(d.fingerprint.model.data(), rec.model_fp, sizeof rec.model_fp);
  d.fingerprint.tokenizer = rec.tokenizer_fp;
  d.blocks_checksum = rec.blocks_checksum;
  d.table_checksum = rec.table_checksum;
  d.tokens_checksum = rec.tokens_checksum;
  d.created_unix_ns = rec.created_unix_ns;
  d.producer = record_producer(rec);
  d.grantee = std::string(g.grantee, strnlen(g.grantee, sizeof g.grantee));
  return d;
}

ContextRecord& live_record(Registry& reg, const SealedContext& s) {
  if (s.slot >= reg.header().max_contexts) fail(ErrorCode::invalid_argument, "sealed context names slot {}", s.slot);
  ContextRecord& rec = reg.record(s.slot);
  if (rec.state != kRecSealed || rec.generation != s.generation || rec.context_id != s.context_id)
    fail(ErrorCode::bad_descriptor, "context {} is stale: it was released or revoked", s.context_id);
  return rec;
}

// Ends every grant of record r, then the record.
void revoke_locked(Registry& reg, std::uint32_t r) {
  ContextRecord& rec = reg.record(r);
  for (std::uint32_t i = 0; i < reg.header().max_grants; ++i) {
    GrantSlot& g = reg.grant(i);
    if (g.state == kGrantLive && g.record_slot == r && g.record_generation == rec.generation) {
      g.state = kGrantFree;
      ++g.generation;
    }
  }
  reg.free_record_locked(r, reg.maintenance_pool().get());
  reg.bump(kRevokes);
}

}  // namespace

void SharePool::Impl::validate_locked(const Descriptor& d, std::string_view agent, bool as_producer) const {
  const ShareHeader& hd = h();
  if (d.pool_id != hd.pool_id)
    fail(ErrorCode::bad_descriptor, "descriptor of context {} belongs to pool {:016x}, not to pool '{}' ({:016x})",
         d.context_id, d.pool_id, name, hd.pool_id);
  if (as_producer && agent != d.producer)
    fail(ErrorCode::bad_descriptor, "only the producer '{}' of context {} may revoke it, not '{}'", d.producer,
         d.context_id, agent);
  if (!as_producer && agent != d.grantee)
    fail(ErrorCode::bad_descriptor, "descriptor of context {} is granted to '{}', not to '{}'", d.context_id, d.grantee,
         agent);
  if (!equal_tags(capability_tag(std::span<const std::uint8_t>(hd.secret, kSecretBytes), d.encode()), d.capability))
    fail(ErrorCode::bad_descriptor,
         "descriptor of context {}: capability tag does not verify (forged, edited, or issued by another pool)",
         d.context_id);
  if (d.record_slot >= hd.max_contexts || d.grant_slot >= hd.max_grants)
    fail(ErrorCode::bad_descriptor, "descriptor names record {} / grant {}, beyond the pool's {} / {}", d.record_slot,
         d.grant_slot, hd.max_contexts, hd.max_grants);
  const ContextRecord& rec = reg->record(d.record_slot);
  if (rec.state != kRecSealed || rec.generation != d.record_generation || rec.context_id != d.context_id)
    fail(ErrorCode::bad_descriptor, "descriptor is stale: context {} was released or revoked", d.context_id);
  const GrantSlot& g = reg->grant(d.grant_slot);
  if (!as_producer && (g.state != kGrantLive || g.generation != d.grant_generation || g.record_slot != d.record_slot ||
                       g.record_generation != d.record_generation))
    fail(ErrorCode::bad_descriptor, "descriptor is stale: this grant of context {} was released", d.context_id);
  if (rec.token_count != d.token_count || rec.block_count != d.block_count || rec.block_tokens != d.block_tokens ||
      rec.position_begin != d.position_begin || rec.position_begin + rec.token_count + rec.position_gap != d.position_end ||
      rec.k_codec != d.k_codec || rec.v_codec != d.v_codec || rec.window != d.window || rec.sink != d.sink ||
      rec.format_flags != d.format_flags || rec.lo_k_codec != d.lo_k_codec || rec.lo_v_codec != d.lo_v_codec ||
      rec.top_millionths != d.top_millionths || rec.codebook_id != d.codebook_id || std::memcmp(rec.model_fp, d.fingerprint.model.data(), 16) != 0 ||
      rec.tokenizer_fp != d.fingerprint.tokenizer || rec.table_checksum != d.table_checksum ||
      rec.tokens_checksum != d.tokens_checksum || record_producer(rec) != d.producer)
    fail(ErrorCode::bad_descriptor, "descriptor of context {} does not match its record in pool '{}'", d.context_id,
         name);
}

void SharePool::Impl::admit_locked(const Descriptor& d, std::string_view agent, bool as_producer) const {
  try {
    validate_locked(d, agent, as_producer);
  } catch (const Error&) {
    reg->bump(kRejected);
    throw;
  }
}

SealedContext SharePool::seal(const PooledKvCache& producer_cache, std::span<const TokenId> tokens,
                              std::string_view text, const ModelFingerprint& fp, std::string_view producer) {
  validate_agent_id(producer, "seal");
  // A mixed format ships demoted, a format with a budget evicted, one with
  // tail=cold its partly filled block coded: a fork of the producer's
  // context, reduced so, is what the record holds; the producer keeps its own blocks (and
  // their precision) for as long as it runs.
  std::unique_ptr<PooledKvCache> reduced;
  std::vector<TokenId> kept_tokens;
  if (producer_cache.format().reduces_at_handoff() && static_cast<std::size_t>(producer_cache.size()) == tokens.size()) {
    reduced = producer_cache.fork();  // (a count mismatch is reported below)
    kept_tokens.assign(tokens.begin(), tokens.end());
    reduce_for_handoff(*reduced, kept_tokens);
    tokens = kept_tokens;
  }
  const PooledKvCache& cache = reduced ? *reduced : producer_cache;
  impl_->maybe_reap();
  std::shared_ptr<KvPool> pool;
  {
    std::lock_guard guard(impl_->kv_mutex);
    pool = impl_->kv;
  }
  if (!pool || &cache.pool() != pool.get())
    fail(ErrorCode::invalid_argument, "seal: the context's KV does not live in pool '{}'", impl_->name);
  const int n = cache.size();
  const ShareHeader& hd = impl_->h();
  if (n <= 0 || static_cast<std::size_t>(n) != tokens.size())
    fail(ErrorCode::invalid_argument, "seal: the cache holds {} tokens, {} token ids given", n, tokens.size());
  if (static_cast<std::uint32_t>(n) > hd.max_tokens)
    fail(ErrorCode::invalid_argument, "seal: {} tokens exceed pool '{}''s {} tokens per context", n, impl_->name,
         hd.max_tokens);
  // The block table is the segments' blocks in order; the segment table
  // says which run of it each segment reads, and where it sits.
  Registry& reg = *impl_->reg;
  const int T = pool->block_tokens();
  std::vector<BlockRef> blocks;
  std::vector<SegmentEntry> segs;
  for (const KvSegment& seg : cache.segments()) {
    if (seg.tokens == 0) continue;
    segs.push_back(SegmentEntry{static_cast<std::uint32_t>(blocks.size()), static_cast<std::uint32_t>(seg.blocks.size()),
                                static_cast<std::uint32_t>(seg.first_row), static_cast<std::uint32_t>(seg.tokens),
                                seg.position_offset, 0});
    blocks.insert(blocks.end(), seg.blocks.begin(), seg.blocks.end());
  }
  if (segs.size() > kMaxRecordSegments || blocks.size() > reg.layout().max_blocks)
    fail(ErrorCode::unsupported, "seal: {} segments over {} blocks exceed a record's {} segments and {} blocks",
         segs.size(), blocks.size(), kMaxRecordSegments, reg.layout().max_blocks);
  if (segs.front().position_offset > 0)
    fail(ErrorCode::unsupported, "seal: the context's first segment sits after the position its keys were rotated at");

  // Checksums, outside the lock: the cache holds every block. A full block's
  // was kept when it filled (KvPool::checksum, computed in the background);
  // only the partly filled tail, and blocks the background has not reached,
  // are hashed here.
  std::vector<std::uint64_t> digests(blocks.size());
  std::vector<TableEntry> table(blocks.size());
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    table[b] = TableEntry{blocks[b].index, blocks[b].generation};
    digests[b] = pool->checksum(blocks[b]);
  }
  const KvFormat& f = cache.format();
  const bool keep_text = text.size() <= impl_->reg->layout().text_bytes;

  RegistryLock lock(reg);
  std::uint32_t r = 0;
  while (r < hd.max_contexts && reg.record(r).state != kRecFree) ++r;
  if (r == hd.max_contexts)
    fail(ErrorCode::out_of_memory, "pool '{}': all {} context records are in use; release contexts", impl_->name,
         hd.max_contexts);
  ContextRecord& rec = reg.record(r);
  rec.state = kRecSealing;
  rec.owner_slot = reg.slot();
  rec.grants = 0;
  rec.retained = 0;
  rec.token_count = static_cast<std::uint32_t>(n);
  rec.block_count = static_cast<std::uint32_t>(blocks.size());
  rec.block_tokens = static_cast<std::uint32_t>(T);
  rec.k_codec = f.k.pack();
  rec.v_codec = f.v.pack();
  rec.window = static_cast<std::uint32_t>(f.window);
  rec.sink = static_cast<std::uint32_t>(f.sink);
  {
    Descriptor mixed;  // the one encoding of a format's flags and mixed-precision fields
    mixed.set_format(f);
    rec.format_flags = mixed.format_flags;
    rec.lo_k_codec = mixed.lo_k_codec;
    rec.lo_v_codec = mixed.lo_v_codec;
    rec.top_millionths = mixed.top_millionths;
    rec.codebook_id = mixed.codebook_id;
  }
  std::memcpy(rec.model_fp, fp.model.data(), sizeof rec.model_fp);
  rec.tokenizer_fp = fp.tokenizer;
  rec.blocks_checksum = XXH3_64bits(digests.data(), digests.size() * sizeof(std::uint64_t));
  rec.table_checksum = table_checksum(table.data(), table.size(), segs.data(), segs.size());
  rec.tokens_checksum = XXH3_64bits(tokens.data(), tokens.size() * sizeof(TokenId));
  rec.text_bytes = keep_text ? static_cast<std::uint32_t>(text.size()) : 0;
  rec.text_checksum = keep_text ? XXH3_64bits(text.data(), text.size()) : 0;
  rec.created_unix_ns = unix_ns();
  std::memset(rec.producer, 0, sizeof rec.producer);
  std::memcpy(rec.producer, producer.data(), producer.size());
  rec.position_begin = static_cast<std::uint32_t>(-segs.front().position_offset);
  rec.segment_count = static_cast<std::uint32_t>(segs.size());
  rec.position_gap = static_cast<std::uint32_t>(cache.position_gap());
  std::memcpy(reg.segments(r), segs.data(), segs.size() * sizeof(SegmentEntry));
  {
    // The record's own references: not this process's, so they survive it.
    Unledgered record_refs;
    TableEntry* t = reg.table(r);
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      t[b] = table[b];
      pool->retain(blocks[b]);
      rec.retained = static_cast<std::uint32_t>(b + 1);
    }
  }
  std::memcpy(reg.tokens(r), tokens.data(), tokens.size() * sizeof(TokenId));
  if (keep_text) std::memcpy(reg.text(r), text.data(), text.size());
  rec.context_id = impl_->h().next_context_id++;
  rec.state = kRecSealed;
  reg.bump(kSeals);
  return SealedContext{r, rec.generation, rec.context_id, n};
}

Descriptor SharePool::grant(const SealedContext& sealed, std::string_view producer, std::string_view grantee) {
  validate_agent_id(producer, "grant: producer");
  validate_agent_id(grantee, "grant: grantee");
  Registry& reg = *impl_->reg;
  const ShareHeader& hd = impl_->h();
  RegistryLock lock(reg);
  ContextRecord& rec = live_record(reg, sealed);
  if (record_producer(rec) != producer)
    fail(ErrorCode::invalid_argument, "grant: context {} was sealed by '{}', not by '{}'", rec.context_id,
         record_producer(rec), producer);
  std::uint32_t gi = 0;
  while (gi < hd.max_grants && reg.grant(gi).state != kGrantFree) ++gi;
  if (gi == hd.max_grants)
    fail(ErrorCode::out_of_memory, "pool '{}': all {} grants are in use; release descriptors", impl_->name,
         hd.max_grants);
  GrantSlot& g = reg.grant(gi);
  g.record_slot = sealed.slot;
  g.record_generation = rec.generation;
  std::memset(g.grantee, 0, sizeof g.grantee);
  std::memcpy(g.grantee, grantee.data(), grantee.size());
  g.holder_slot = reg.slot();
  g.opened = 0;
  g.touched_ns.store(monotonic_ns(), std::memory_order_relaxed);
  g.state = kGrantLive;
  ++rec.grants;
  Descriptor d = descriptor_of(hd, rec, sealed.slot, g, gi);
  d.capability = capability_tag(std::span<const std::uint8_t>(hd.secret, kSecretBytes), d.encode());
  reg.bump(kGrants);
  return d;
}

void SharePool::release(const SealedContext& sealed) {
  Registry& reg = *impl_->reg;
  RegistryLock lock(reg);
  ContextRecord& rec = live_record(reg, sealed);
  if (rec.owner_slot != reg.slot())
    fail(ErrorCode::invalid_argument, "release: this process does not hold the producer's claim on context {}",
         rec.context_id);
  rec.owner_slot = kNone;
  if (rec.grants == 0) reg.free_record_locked(sealed.slot, reg.maintenance_pool().get());
  reg.bump(kReleases);
}

void SharePool::release(const Descriptor& d, std::string_view agent) {
  Registry& reg = *impl_->reg;
  RegistryLock lock(reg);
  impl_->admit_locked(d, agent, false);
  GrantSlot& g = reg.grant(d.grant_slot);
  g.state = kGrantFree;
  ++g.generation;
  ContextRecord& rec = reg.record(d.record_slot);
  --rec.grants;
  if (rec.grants == 0 && rec.owner_slot == kNone) reg.free_record_locked(d.record_slot, reg.maintenance_pool().get());
  reg.bump(kReleases);
}

void SharePool::revoke(const Descriptor& d, std::string_view agent) {
  Registry& reg = *impl_->reg;
  RegistryLock lock(reg);
  impl_->admit_locked(d, agent, true);
  revoke_locked(reg, d.record_slot);
}

void SharePool::revoke(const SealedContext& sealed) {
  Registry& reg = *impl_->reg;
  RegistryLock lock(reg);
  live_record(reg, sealed);
  revoke_locked(reg, sealed.slot);
}

OpenedContext SharePool::open(const Descriptor& d, std::string_view agent, bool want_kv, int capacity, bool verify,
                              GrantUse use) {
  impl_->maybe_reap();
  OpenedContext out;
  std::shared_ptr<KvPool> pool;
  {
    std::lock_guard guard(impl_->kv_mutex);
    pool = impl_->kv;
  }
  const auto refuse = [&out](FallbackReason why, std::string detail) {
    if (out.refused != FallbackReason::none) return;
    out.refused = why;
    out.refused_detail = std::move(detail);
  };
  const std::optional<KvFormat> format = d.format();
  if (want_kv && !pool) refuse(FallbackReason::shape, "this process has no KV pool of the model's shape");
  if (want_kv && !format) refuse(FallbackReason::format, fmt::format("codecs {:#x}/{:#x} are unknown", d.k_codec, d.v_codec));
  if (want_kv && format && format->uses_pq() && !format->book)
    refuse(FallbackReason::format,
           fmt::format("codebook {:016x} of the pq format is not loaded in this process", d.codebook_id));
  if (want_kv && static_cast<std::uint32_t>(capacity) < d.token_count)
    fail(ErrorCode::invalid_argument, "open: capacity {} cannot hold context {} of {} tokens", capacity, d.context_id,
         d.token_count);
  Registry& reg = *impl_->reg;
  std::vector<BlockRef> table_blocks;  // in table order, as blocks_checksum hashes them
  {
    RegistryLock lock(reg);
    impl_->admit_locked(d, agent, false);
    if (use == GrantUse::hold) {  // delivered: in the opener's custody now
      GrantSlot& g = reg.grant(d.grant_slot);
      g.holder_slot = reg.slot();
      g.opened = 1;
      g.touched_ns.store(monotonic_ns(), std::memory_order_relaxed);
    }
    const ContextRecord& rec = reg.record(d.record_slot);
    const TokenId* ids = reg.tokens(d.record_slot);
    out.tokens.assign(ids, ids + rec.token_count);
    if (XXH3_64bits(out.tokens.data(), out.tokens.size() * sizeof(TokenId)) != rec.tokens_checksum) {
      reg.bump(kRejected);
      fail(ErrorCode::bad_descriptor, "context {}: its stored token ids fail their checksum (pool memory corrupted)",
           d.context_id);
    }
    if (rec.text_bytes > 0 && rec.text_bytes <= reg.layout().text_bytes) {
      out.text.assign(reg.text(d.record_slot), rec.text_bytes);
      if (XXH3_64bits(out.text.data(), out.text.size()) != rec.text_checksum) out.text.clear();
    }
    const TableEntry* t = reg.table(d.record_slot);
    const SegmentEntry* se = reg.segments(d.record_slot);
    const bool table_ok = rec.block_count <= reg.layout().max_blocks && rec.segment_count >= 1 &&
                          rec.segment_count <= kMaxRecordSegments &&
                          table_checksum(t, rec.block_count, se, rec.segment_count) == rec.table_checksum;
    if (!table_ok) refuse(FallbackReason::checksum, "the stored block table fails its checksum");
    if (rec.blocks_checksum != d.blocks_checksum)
      refuse(FallbackReason::checksum, "the stored block checksum differs from the descriptor's");
    if (want_kv && out.refused == FallbackReason::none) {
      if (rec.block_tokens != static_cast<std::uint32_t>(pool->block_tokens()))
        refuse(FallbackReason::shape, "block sizes differ");
    }
    if (want_kv && out.refused == FallbackReason::none) {
      std::vector<KvSegment> segments;
      for (std::uint32_t i = 0; i < rec.segment_count; ++i) {
        const SegmentEntry& e = se[i];
        if (e.table_begin > rec.block_count || e.blocks > rec.block_count - e.table_begin) {
          refuse(FallbackReason::checksum, fmt::format("segment {} runs past the block table", i));
          break;
        }
        KvSegment seg{e.position_offset, {}, static_cast<int>(e.first_row), static_cast<int>(e.tokens)};
        for (std::uint32_t b = e.table_begin; b < e.table_begin + e.blocks; ++b)
          seg.blocks.push_back(BlockRef{t[b].index, t[b].generation});
        segments.push_back(std::move(seg));
      }
      for (std::uint32_t b = 0; b < rec.block_count; ++b) table_blocks.push_back(BlockRef{t[b].index, t[b].generation});
      if (out.refused == FallbackReason::none) try {
          out.cache = PooledKvCache::adopt(pool, *format, capacity, std::move(segments), static_cast<int>(rec.token_count));
          out.cache->set_position_gap(static_cast<int>(rec.position_gap));
        } catch (const Error& e) {
          if (e.code() != ErrorCode::invalid_argument) throw;
          refuse(FallbackReason::format, e.what());
        }
    }
  }
  if (verify && out.cache && full_checksum(*pool, table_blocks) != d.blocks_checksum) {
    out.cache.reset();
    refuse(FallbackReason::checksum, "the blocks do not match the checksum taken when they were sealed");
  }
  if (out.cache) {
    reg.bump(kOpensKv);
    if (use == GrantUse::hold) out.cache->set_commit_hook(impl_->lease_renewal(d));
  }
  return out;
}

DescriptorStatus SharePool::check(const Descriptor& d, bool verify) {
  DescriptorStatus st;
  const ShareHeader& hd = impl_->h();
  st.pool_matches = d.pool_id == hd.pool_id;
  st.capability_valid =
      st.pool_matches && equal_tags(capability_tag(std::span<const std::uint8_t>(hd.secret, kSecretBytes), d.encode()),
                                    d.capability);
  try {
    const std::shared_ptr<KvPool> pool = verify ? kv_pool_if_any() : nullptr;
    if (verify && !pool) fail(ErrorCode::bad_descriptor, "pool '{}' holds no KV to verify", impl_->name);
    std::vector<BlockRef> blocks;
    {
      RegistryLock lock(*impl_->reg);
      impl_->validate_locked(d, d.grantee, false);
      // Hold the blocks for the rehash, which runs outside the lock.
      const TableEntry* t = impl_->reg->table(d.record_slot);
      for (std::uint32_t b = 0; pool && b < d.block_count; ++b) {
        blocks.push_back(BlockRef{t[b].index, t[b].generation});
        pool->retain(blocks.back());
      }
    }
    st.live = st.checksums_match = true;
    if (pool) {
      const bool same = full_checksum(*pool, blocks) == d.blocks_checksum;
      for (BlockRef b : blocks) pool->release(b);
      if (!same)
        fail(ErrorCode::bad_descriptor, "context {}: its blocks do not match the checksum taken when they were sealed",
             d.context_id);
      st.blocks_verified = true;
    }
  } catch (const Error& e) {
    st.problem = e.what();
    if (st.problem.find("stale") != std::string::npos) st.live = false;
  }
  return st;
}

}  // namespace qkvshare
