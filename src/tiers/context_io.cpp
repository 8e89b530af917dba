#include "qkvshare/tiers/context_io.hpp"

#include <algorithm>
#include <vector>

#include "qkvshare/core/error.hpp"

namespace qkvshare {

static_assert(kBlockWindowFreed == 16u, "context files name a block of the global layers alone by flag bit 4");

namespace {

std::vector<BlockRef> flat_blocks(const PooledKvCache& cache) {
  std::vector<BlockRef> out;
  for (const KvSegment& s : cache.segments()) out.insert(out.end(), s.blocks.begin(), s.blocks.end());
  return out;
}

// Releases the blocks an import allocated unless it completes.
struct BlockGuard {
  KvPool& pool;
  std::vector<BlockRef> blocks;
  ~BlockGuard() {
    for (BlockRef b : blocks) pool.release(b);
  }
};

}  // namespace

ModelFingerprint fingerprint_of(const ContextMeta& meta) {
  ModelFingerprint fp;
  fp.model = meta.model_fingerprint;
  fp.tokenizer = meta.tokenizer_fingerprint;
  return fp;
}

ContextMeta context_meta(const PooledKvCache& cache, std::span<const TokenId> tokens, std::string_view text,
                         const ModelFingerprint& fp) {
  if (static_cast<std::size_t>(cache.size()) != tokens.size() || tokens.empty())
    fail(ErrorCode::invalid_argument, "export: the cache holds {} tokens, {} token ids given", cache.size(),
         tokens.size());
  ContextMeta m;
  m.model_fingerprint = fp.model;
  m.tokenizer_fingerprint = fp.tokenizer;
  m.shape = cache.shape();
  m.block_tokens = cache.pool().block_tokens();
  m.format = cache.format();
  m.tokens.assign(tokens.begin(), tokens.end());
  m.text = std::string(text);
  if (cache.position_gap() != 0)
    fail(ErrorCode::unsupported, "export: the context dropped tokens and kept their neighbours' positions; the file "
                                 "format has no field for that yet");
  const int T = m.block_tokens;
  for (const KvSegment& s : cache.segments()) {
    if (s.blocks.empty()) continue;
    // The file records a segment as whole blocks from row 0 (what eviction
    // leaves); a splice's segment cut inside a block has no form there yet.
    if (s.first_row != 0)
      fail(ErrorCode::unsupported, "export: a segment starting at row {} of a block (a splice) cannot be written yet",
           s.first_row);
    m.segments.push_back(ContextSegment{s.position_offset, static_cast<std::uint32_t>(s.blocks.size())});
    for (std::size_t j = 0; j < s.blocks.size(); ++j) {
      const BlockInfo info = cache.pool().info(s.blocks[j]);
      ContextBlock cb;
      cb.k = info.k;
      cb.v = info.v;
      cb.flags = info.flags;
      cb.key_position = (info.flags & (kBlockPreRopeK | kBlockRelativeK)) != 0 ? info.key_position : 0;
      // The pool's fill of a shared block may run ahead of this context (a
      // fork appended to its copy); the segment's own count is what it holds.
      cb.fill = static_cast<std::uint32_t>(std::min(T, s.tokens - static_cast<int>(j) * T));
      m.blocks.push_back(cb);
    }
  }
  for (std::size_t i = 0; i + 1 < m.blocks.size(); ++i)
    if (m.blocks[i].fill != static_cast<std::uint32_t>(T))
      fail(ErrorCode::unsupported, "export: block {} holds {} of {} rows before the last block (a splice's segment)", i,
           m.blocks[i].fill, T);
  return m;
}

BlockSource pooled_block_source(const PooledKvCache& cache) {
  std::vector<BlockRef> blocks = flat_blocks(cache);
  const int T = cache.pool().block_tokens(), n = cache.size();
  return [&cache, blocks = std::move(blocks), T, n](std::size_t i, std::span<std::uint8_t> plain) {
    KvPool& pool = cache.pool();
    const KvShape& s = pool.shape();
    const BlockInfo info = pool.info(blocks[i]);
    const int fill = std::min(T, n - static_cast<int>(i) * T);
    for (int kind = 0; kind < 2; ++kind) {
      const KvCodec& c = kind == 0 ? info.k : info.v;
      for (int l = 0; l < s.n_layers; ++l)
        for (int h = 0; h < s.n_kv_heads && pool.stores_layer(blocks[i], l); ++h)
          tile_to_canonical(c, T, s.head_dim, fill, pool.tile(blocks[i], kind, l, h),
                            plain.data() + tile_offset(s, T, info.k, info.v, kind, l, h, info.flags));
    }
  };
}

std::uint64_t write_pooled_context(const PooledKvCache& cache, std::span<const TokenId> tokens, std::string_view text,
                                   const ModelFingerprint& fp, const ByteSink& sink, const BlockCipher* cipher) {
  return write_context(context_meta(cache, tokens, text, fp), pooled_block_source(cache), sink, cipher);
}

std::unique_ptr<PooledKvCache> import_context(const ContextReader& reader, std::shared_ptr<KvPool> pool, int capacity,
                                              const BlockCipher* cipher) {
  const ContextMeta& m = reader.meta();
  const KvShape& s = pool->shape();
  if (!s.same_dims(m.shape) || pool->block_tokens() != m.block_tokens)
    fail(ErrorCode::bad_descriptor,
         "import: the context's KV shape ({} layers, {} KV heads x {}, blocks of {}) is not the pool's ({}, {} x {}, {})",
         m.shape.n_layers, m.shape.n_kv_heads, m.shape.head_dim, m.block_tokens, s.n_layers, s.n_kv_heads, s.head_dim,
         pool->block_tokens());
  // Blocks of the global layers alone need a pool that knows which layers those are.
  const bool lean = std::any_of(m.blocks.begin(), m.blocks.end(),
                                [](const ContextBlock& b) { return (b.flags & kBlockWindowFreed) != 0; });
  if (lean && s.layer_window != m.shape.layer_window)
    fail(ErrorCode::bad_descriptor, "import: the context holds blocks that left a sliding window of {} tokens; the "
         "pool's layers have {}", m.shape.max_window(), s.layer_window.empty() ? "no windows" : "other windows");
  if (capacity < static_cast<int>(m.tokens.size()))
    fail(ErrorCode::invalid_argument, "import: {} tokens do not fit a capacity of {}", m.tokens.size(), capacity);
  const int T = m.block_tokens;
  BlockGuard guard{*pool, {}};
  std::vector<std::uint8_t> plain;
  for (std::size_t i = 0; i < m.blocks.size(); ++i) {
    const ContextBlock& b = m.blocks[i];
    plain.resize(reader.plain_bytes(i));
    reader.read_block(i, plain, cipher);  // authenticated and checksummed before any byte reaches the pool
    const BlockRef ref = pool->allocate(b.k, b.v, b.flags, b.key_position);
    guard.blocks.push_back(ref);
    for (int kind = 0; kind < 2; ++kind) {
      const KvCodec& c = kind == 0 ? b.k : b.v;
      for (int l = 0; l < s.n_layers; ++l)
        for (int h = 0; h < s.n_kv_heads && pool->stores_layer(ref, l); ++h)
          tile_from_canonical(c, T, s.head_dim, plain.data() + tile_offset(s, T, b.k, b.v, kind, l, h, b.flags),
                              pool->tile(ref, kind, l, h));
    }
    pool->set_fill(ref, static_cast<int>(b.fill));
  }
  // Each segment: its run of blocks from row 0, as many tokens as they hold.
  std::vector<KvSegment> segments;
  std::size_t next = 0;
  for (const ContextSegment& seg : m.segments) {
    KvSegment ks{seg.position_offset, {}, 0, 0};
    for (std::uint32_t j = 0; j < seg.blocks && next < guard.blocks.size(); ++j, ++next) {
      ks.blocks.push_back(guard.blocks[next]);
      ks.tokens += static_cast<int>(m.blocks[next].fill);
    }
    segments.push_back(std::move(ks));
  }
  auto cache = PooledKvCache::adopt(pool, m.format, capacity, std::move(segments), static_cast<int>(m.tokens.size()));
  return cache;  // the guard drops the import's own references: the cache holds one each
}

std::uint64_t export_descriptor(SharePool& pool, const Descriptor& d, std::string_view agent, const ByteSink& sink,
                                const BlockCipher* cipher) {
  pool.kv_pool_if_any();  // binds this process to the pool's KV arena, whatever its shape
  OpenedContext opened = pool.open(d, agent, true, static_cast<int>(d.token_count), false, GrantUse::copy);
  if (!opened.cache)
    fail(ErrorCode::bad_descriptor, "export: the KV of context {} cannot be used here ({}: {})", d.context_id,
         to_string(opened.refused), opened.refused_detail);
  return write_pooled_context(*opened.cache, opened.tokens, opened.text, d.fingerprint, sink, cipher);
}

SealedContext import_sealed(SharePool& pool, const ContextReader& reader, std::string_view producer,
                            const ModelFingerprint* expected, const BlockCipher* cipher) {
  const ContextMeta& m = reader.meta();
  const ModelFingerprint fp = fingerprint_of(m);
  if (expected != nullptr && expected->model != fp.model)
    fail(ErrorCode::bad_descriptor, "import: the context was made by model {}, not by this model ({})", fp.hex(),
         expected->hex());
  std::shared_ptr<KvPool> kv;
  try {
    // A file that names no windows (version 2) holds whole blocks, which a pool of the same dimensions
    // takes whatever its windows; otherwise the shapes must agree (or an empty pool is formatted for it).
    kv = pool.kv_pool_if_any();
    const bool whole_blocks_fit = kv && m.shape.layer_window.empty() && kv->shape().same_dims(m.shape);
    if (!whole_blocks_fit) kv = pool.kv_pool(m.shape);
  } catch (const Error& e) {
    fail(ErrorCode::bad_descriptor, "import: {}", e.what());
  }
  auto cache = import_context(reader, kv, static_cast<int>(m.tokens.size()), cipher);
  return pool.seal(*cache, m.tokens, m.text, fp, producer);
}

}  // namespace qkvshare
