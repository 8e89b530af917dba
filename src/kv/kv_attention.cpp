#include "kv_attention.hpp"

#include <algorithm>
#include <bit>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/half.hpp"
#include "qkvshare/kernels/isa.hpp"
#include "qkvshare/kernels/kv_pq.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"
#include "qkvshare/kernels/ops.hpp"
#include "qkvshare/kv/kv_kernels.hpp"

namespace qkvshare::kv {

namespace {

constexpr int kChunkTokens = 16;  // query tokens per job: a decoded tile serves them all

using Ops = kernels::TileKernels;

// The f32 reference (AttendPath::exact): one query at a time, the scalar
// dot, softmax and axpy of kernels::attend_head_f32_ref over the rows in
// order. One job: query token t, query head h.
void attend_exact_job(const AttendInput& in, std::size_t job) {
  const KvShape& s = in.shape;
  const int D = s.head_dim, T = in.block_tokens, group = s.n_heads / s.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  thread_local std::vector<float> scores;
  const int t = static_cast<int>(job / static_cast<std::size_t>(s.n_heads));
  const int h = static_cast<int>(job % static_cast<std::size_t>(s.n_heads));
  const int kvh = h / group, end = in.first_pos + t + 1, first = std::max(0, in.visible_from + t);
  const int n_keys = end - first;
  scores.resize(static_cast<std::size_t>(n_keys));
  const std::size_t qoff = static_cast<std::size_t>(t) * static_cast<std::size_t>(s.q_dim()) +
                           static_cast<std::size_t>(h) * static_cast<std::size_t>(D);
  const auto row = [&](const std::byte* const* tiles, int j) {
    j += first;
    return reinterpret_cast<const float*>(tiles[(j / T) * s.n_kv_heads + kvh]) + (j % T) * D;
  };
  for (int j = 0; j < n_keys; ++j) scores[static_cast<std::size_t>(j)] = kernels::dot_f32(in.q + qoff, row(in.k_tiles, j), D) * scale;
  kernels::softmax(scores.data(), n_keys);
  std::memset(in.out + qoff, 0, sizeof(float) * static_cast<std::size_t>(D));
  for (int j = 0; j < n_keys; ++j) kernels::axpy(in.out + qoff, scores[static_cast<std::size_t>(j)], row(in.v_tiles, j), D);
}

kernels::Isa isa_of(AttendPath path) {
  switch (path) {
    case AttendPath::avx2: return kernels::Isa::avx2;
    case AttendPath::avx512: return kernels::Isa::avx512;
    case AttendPath::neon: return kernels::Isa::neon;
    case AttendPath::neon_dot: return kernels::Isa::neon_dot;
    default: return kernels::Isa::portable;
  }
}

std::atomic<bool> g_codes_attention{true};
std::atomic<bool> g_pq_tables{false};

using Partial = BlockAttend::Partial;

// Tiles sit wherever the pool put their pages, so the hardware prefetcher
// cannot guess the next one: ask for it while the current one is read.
void prefetch_tile(const std::byte* tile, std::size_t bytes) {
  for (std::size_t off = 0; off < bytes; off += 64) __builtin_prefetch(tile + off);
}

// The per-query tables of pq tiles (kv_pq.hpp) cost 256 products per
// sub-space and query, and their lookups are scalar: never worth it for a
// prefill chunk's many queries (and, measured, not for decode steps either at
// head_dim 64: docs/kv-quality.md "Product quantization"; set_pq_lookup_tables).
constexpr int kPqTableQueries = 16;
bool pq_tables_fit(const kernels::TileCodes& t, int nq) {
  return t.pq_sub > 0 && nq <= kPqTableQueries;
}

// One job's description of the codec of its K (or V) tiles: consecutive
// blocks share their codec (every sealed block of a context but the open
// one), so its layout and kernel view are worked out once per run of equal
// codecs rather than per tile (in a decode step at depth 2048 that was ~5% of
// attention on codes).
struct TileDesc {
  bool set = false;
  KvCodec codec;
  TileLayout layout;
  kernels::TileCodes codes;

  const TileDesc& of(const AttendInput& in, const KvCodec& c, int kind, int h) {
    if (!set || !(codec == c)) {
      codec = c;
      layout = tile_layout(c, in.block_tokens, in.shape.head_dim);
      codes = tile_codes(c, layout, codebook_slice(in.book, c, kind, in.layer, h));
      set = true;
    }
    return *this;
  }
  std::size_t bytes_of(const AttendInput& in, const KvCodec& c) const {
    return set && codec == c ? layout.bytes : tile_layout(c, in.block_tokens, in.shape.head_dim).bytes;
  }
};

// The sparse outliers of a tile read on its codes (kv_kernels.hpp) and what
// they add to rows [lo, hi): each its residual times the query's channel to
// that row's score, and its residual times the row's weight to the weighted
// sums. Decode steps (a few queries) go through the outliers once; prefill
// chunks (many queries) unpack them first, so each query's pass is a tight
// loop (same sums in the same order; measured on the handoff eval with int2
// and 2% outliers, consumer chunks of 1024: 410 against 290 tokens/s).
struct OutlierTerms {
  std::vector<int> row, channel;
  std::vector<float> residual;
};

// Element index -> (row, channel): a shift where head_dim is a power of two.
struct IndexSplit {
  int D, shift;
  explicit IndexSplit(int d) : D(d), shift((d & (d - 1)) == 0 ? std::countr_zero(static_cast<unsigned>(d)) : -1) {}
  int row(int i) const noexcept { return shift >= 0 ? i >> shift : i / D; }
  int channel(int i) const noexcept { return shift >= 0 ? i & (D - 1) : i % D; }
};

constexpr int kOutlierUnpackQueries = 8;

template <typename Add>
void for_each_outlier(const TileOutliers& o, int D, int lo, int hi, int nq, Add add) {
  const IndexSplit split(D);
  if (nq <= kOutlierUnpackQueries) {
    for (int e = 0; e < o.n; ++e) {
      const int j = split.row(o.index[e]);
      if (j < lo || j >= hi) continue;
      const int c = split.channel(o.index[e]);
      const float r = fp16_to_fp32(o.residual[e]);
      for (int i = 0; i < nq; ++i) add(i, j, c, r);
    }
    return;
  }
  thread_local OutlierTerms t;
  t.row.clear(), t.channel.clear(), t.residual.clear();
  for (int e = 0; e < o.n; ++e) {
    const int j = split.row(o.index[e]);
    if (j < lo || j >= hi) continue;
    t.row.push_back(j), t.channel.push_back(split.channel(o.index[e])), t.residual.push_back(fp16_to_fp32(o.residual[e]));
  }
  const int n = static_cast<int>(t.row.size());
  for (int i = 0; i < nq; ++i)
    for (int e = 0; e < n; ++e) add(i, t.row[static_cast<std::size_t>(e)], t.channel[static_cast<std::size_t>(e)], t.residual[static_cast<std::size_t>(e)]);
}

void add_key_outliers(const TileOutliers& o, int D, int lo, int hi, const float* q, int nq, float scale, float* s,
                      std::size_t s_stride) {
  if (o.n == 0) return;
  for_each_outlier(o, D, lo, hi, nq, [&](int i, int j, int c, float r) {
    s[static_cast<std::size_t>(i) * s_stride + static_cast<std::size_t>(j)] += scale * r * q[static_cast<std::size_t>(i) * D + c];
  });
}

void add_value_outliers(const TileOutliers& o, int D, int lo, int hi, const float* p, std::size_t p_stride, int nq,
                        float* out) {
  if (o.n == 0) return;
  for_each_outlier(o, D, lo, hi, nq, [&](int i, int j, int c, float r) {
    out[static_cast<std::size_t>(i) * D + c] += r * p[static_cast<std::size_t>(i) * p_stride + static_cast<std::size_t>(j)];
  });
}

// One job: KV head h, query tokens [t0, t1), key blocks [b0, b1).
void run_job(const AttendInput& in, const Ops& ops, int h, int t0, int t1, int b0, int b1, bool partial,
             Partial* part_ml, float* part_o) {
  const KvShape& s = in.shape;
  const int D = s.head_dim, T = in.block_tokens, G = s.n_heads / s.n_kv_heads;
  const int nq = (t1 - t0) * G, keys = (b1 - b0) * T, total = in.key_total();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  thread_local std::vector<float> qbuf, obuf, scores, tile, qab, qrel;
  thread_local std::vector<std::int16_t> qcodes;  // int16 or int8 per channel (kv_tiles.hpp)
  thread_local std::vector<float> pq_lut, pq_hist;  // kv_pq.hpp: per query, made at the first pq tile
  bool have_lut = false;
  std::optional<kernels::TileCodes> pq_v;  // set at the first pq value tile: how to reduce pq_hist at the end
  qbuf.resize(static_cast<std::size_t>(nq) * D);
  obuf.assign(static_cast<std::size_t>(nq) * D, 0.0f);
  scores.resize(static_cast<std::size_t>(nq) * static_cast<std::size_t>(keys));
  tile.resize(static_cast<std::size_t>(T) * D);
  thread_local std::vector<int> visible;  // keys of this partition query i sees
  thread_local std::vector<int> from;     // the first key query i sees (its window's start)
  thread_local std::vector<Partial> ml;   // per query: (max, sum of exp) over the rows it sees, set after the scores
  visible.resize(static_cast<std::size_t>(nq));
  from.resize(static_cast<std::size_t>(nq));
  int from_min = total;
  ml.assign(static_cast<std::size_t>(nq), Partial{-std::numeric_limits<float>::infinity(), 0.0f});
  for (int i = 0; i < nq; ++i) {
    const int t = t0 + i / G, qh = h * G + i % G;
    std::memcpy(&qbuf[static_cast<std::size_t>(i) * D], in.q + static_cast<std::size_t>(t) * s.q_dim() + qh * D,
                sizeof(float) * static_cast<std::size_t>(D));
    if (in.rotate_k) rotate(&qbuf[static_cast<std::size_t>(i) * D], D);
    const int seen = in.causal ? std::min(in.first_pos + t + 1, total) : total;
    visible[static_cast<std::size_t>(i)] = std::clamp(seen - b0 * T, 0, keys);
    from[static_cast<std::size_t>(i)] = std::max(0, in.visible_from + t);
    from_min = std::min(from_min, from[static_cast<std::size_t>(i)]);
  }
  const int last_block = std::min(b1, in.causal ? (in.first_pos + t1 - 1) / T + 1 : (total + T - 1) / T);
  // Rows of block 0 before key_lo belong to another segment: never read; nor
  // are rows before every query's window.
  const auto lo_of = [&](int b) { return std::max(b == 0 ? in.key_lo : 0, from_min - b * T); };
  // The first row of block b that query i sees (may be >= its limit).
  const auto start_of = [&](int b, int i) { return std::max(lo_of(b), from[static_cast<std::size_t>(i)] - b * T); };
  const int first_block = std::max(b0, from_min / T);
  // Rows of block b that query i sees (may be <= lo), and that any query sees.
  const auto lim_of = [&](int b, int i) {
    return std::min(std::min(T, total - b * T), visible[static_cast<std::size_t>(i)] - (b - b0) * T);
  };
  const auto hi_of = [&](int b) {
    int hi = lo_of(b);
    for (int i = 0; i < nq; ++i) hi = std::max(hi, lim_of(b, i));
    return hi;
  };
  const bool on_codes = codes_attention(), on_tables = on_codes && pq_lookup_tables();
  TileDesc k_desc, v_desc;
  for (int b = first_block; b < last_block; ++b) {
    const int rows = std::min(T, total - b * T), lo = lo_of(b);
    const std::size_t ti = static_cast<std::size_t>(b) * s.n_kv_heads + h;
    const kernels::TileCodes& kc = k_desc.of(in, in.k_codecs[b], 0, h).codes;
    if (b + 1 < last_block) prefetch_tile(in.k_tiles[ti + s.n_kv_heads], k_desc.bytes_of(in, in.k_codecs[b + 1]));
    const bool rows_rope = in.k_positions && !in.keys_relative;  // keys=pre: RoPE on every key row read
    const float* qk = qbuf.data();
    if (in.keys_relative) {  // keys=block: the queries turned back by the block's first position instead
      qrel.assign(qbuf.begin(), qbuf.begin() + static_cast<std::ptrdiff_t>(nq) * D);
      ops.rope(qrel.data(), nq, D, in.rope_inverse + static_cast<std::ptrdiff_t>(in.k_positions[b]) * 2 * D, 0,
               in.rope_style);
      qk = qrel.data();
    }
    if (on_tables && pq_tables_fit(kc, nq) && !in.k_positions) {
      // Scores from the query's table of products with the centroids.
      const int hi = hi_of(b);
      if (hi <= lo) continue;
      if (!have_lut) {
        pq_lut.resize(static_cast<std::size_t>(nq) * kernels::pq_table_floats(kc));
        kernels::pq_lut(ops, kc, qbuf.data(), nq, scale, pq_lut.data());
        have_lut = true;
      }
      float* s0 = &scores[static_cast<std::size_t>(b - b0) * T];
      kernels::pq_scores(kc, in.k_tiles[ti], lo, hi, pq_lut.data(), nq, s0, static_cast<std::size_t>(keys));
      continue;
    }
    if (on_codes && kernels::codes_keys_ok(kc) && !rows_rope) {
      // Scores straight from the codes, for the rows any query sees.
      const int hi = hi_of(b);
      if (hi <= lo) continue;
      qcodes.resize(static_cast<std::size_t>(nq) * D);
      qab.resize(2 * static_cast<std::size_t>(nq));
      ops.query_codes(kc, in.k_tiles[ti], qk, nq, scale, qcodes.data(), qab.data());
      float* s0 = &scores[static_cast<std::size_t>(b - b0) * T];
      ops.code_scores(kc, in.k_tiles[ti], lo, hi, qcodes.data(), qab.data(), nq, s0, static_cast<std::size_t>(keys));
      add_key_outliers(tile_outliers(k_desc.layout, in.k_tiles[ti]), D, lo, hi, qk, nq, scale, s0,
                       static_cast<std::size_t>(keys));
      continue;
    }
    const float* k = reinterpret_cast<const float*>(in.k_tiles[ti]);
    if (in.k_codecs[b].type != KvType::f32) {
      ops.decode(kc, in.k_tiles[ti], rows, tile.data());
      add_outliers(k_desc.layout, in.k_tiles[ti], rows, tile.data());
      k = tile.data();
    }
    if (rows_rope) {  // stored before RoPE: rotated to the positions they were computed at
      if (k != tile.data()) std::memcpy(tile.data(), k, sizeof(float) * static_cast<std::size_t>(rows) * D);
      const int hi = hi_of(b);
      if (hi > lo)
        ops.rope(&tile[static_cast<std::size_t>(lo) * D], hi - lo, D,
                 in.rope_table + static_cast<std::ptrdiff_t>(in.k_positions[b] + lo) * 2 * D, 2 * D, in.rope_style);
      k = tile.data();
    }
    for (int i = 0; i < nq; ++i) {
      const int lim = lim_of(b, i), st = start_of(b, i);
      float* sc = &scores[static_cast<std::size_t>(i) * keys + static_cast<std::size_t>(b - b0) * T];
      const float* qi = qk + static_cast<std::ptrdiff_t>(i) * D;
      if (lim > st) ops.scores(qi, k + static_cast<std::ptrdiff_t>(st) * D, lim - st, D, scale, sc + st);
    }
  }
  for (int i = 0; i < nq; ++i) {
    const int nv = visible[static_cast<std::size_t>(i)];
    Partial& p = ml[static_cast<std::size_t>(i)];
    const int lo = start_of(b0, i);  // rows relative to block b0, as nv
    // [lo, nv) is every row query i sees in this partition, one run: the
    // maximum is taken once over it (one vector pass) rather than per block.
    float* x = &scores[static_cast<std::size_t>(i) * keys + static_cast<std::size_t>(lo)];
    if (nv > lo) p.m = ops.max(x, nv - lo, p.m), p.l = ops.exp_sum(x, nv - lo, p.m);
  }
  for (int b = first_block; b < last_block; ++b) {
    const int rows = std::min(T, total - b * T), lo = lo_of(b);
    const std::size_t ti = static_cast<std::size_t>(b) * s.n_kv_heads + h;
    const kernels::TileCodes& vc = v_desc.of(in, in.v_codecs[b], 1, h).codes;
    if (b + 1 < last_block) prefetch_tile(in.v_tiles[ti + s.n_kv_heads], v_desc.bytes_of(in, in.v_codecs[b + 1]));
    if (on_tables && pq_tables_fit(vc, nq)) {
      // Weights summed per centroid; multiplied with the centroids once, below.
      const int hi = hi_of(b);
      if (hi <= lo) continue;
      if (!pq_v) {
        pq_hist.assign(static_cast<std::size_t>(nq) * kernels::pq_table_floats(vc), 0.0f);
        pq_v = vc;
      }
      float* p0 = &scores[static_cast<std::size_t>(b - b0) * T];
      for (int i = 0; i < nq; ++i) {
        float* pi = p0 + static_cast<std::size_t>(i) * keys;
        for (int j = lo, st = std::min(start_of(b, i), hi); j < st; ++j) pi[j] = 0.0f;
        for (int j = std::max(lo, lim_of(b, i)); j < hi; ++j) pi[j] = 0.0f;
      }
      kernels::pq_accumulate(vc, in.v_tiles[ti], lo, hi, p0, static_cast<std::size_t>(keys), nq, pq_hist.data());
      continue;
    }
    if (on_codes && kernels::codes_values_ok(vc)) {
      // One call for all queries; rows a query does not see weigh 0.
      const int hi = hi_of(b);
      if (hi <= lo) continue;
      float* p0 = &scores[static_cast<std::size_t>(b - b0) * T];
      for (int i = 0; i < nq; ++i) {
        float* pi = p0 + static_cast<std::size_t>(i) * keys;
        for (int j = lo, st = std::min(start_of(b, i), hi); j < st; ++j) pi[j] = 0.0f;
        for (int j = std::max(lo, lim_of(b, i)); j < hi; ++j) pi[j] = 0.0f;
      }
      ops.code_sum(vc, in.v_tiles[ti], lo, hi, p0, static_cast<std::size_t>(keys), nq, obuf.data());
      add_value_outliers(tile_outliers(v_desc.layout, in.v_tiles[ti]), D, lo, hi, p0, static_cast<std::size_t>(keys), nq,
                         obuf.data());
      continue;
    }
    const float* v = reinterpret_cast<const float*>(in.v_tiles[ti]);
    if (in.v_codecs[b].type != KvType::f32) {
      ops.decode(vc, in.v_tiles[ti], rows, tile.data());
      add_outliers(v_desc.layout, in.v_tiles[ti], rows, tile.data());
      v = tile.data();
    }
    for (int i = 0; i < nq; ++i) {
      const int lim = lim_of(b, i), st = start_of(b, i);
      const float* p = &scores[static_cast<std::size_t>(i) * keys + static_cast<std::size_t>(b - b0) * T];
      float* o = &obuf[static_cast<std::size_t>(i) * D];
      if (lim > st) ops.weighted_sum(o, p + st, v + static_cast<std::ptrdiff_t>(st) * D, lim - st, D);
    }
  }
  if (pq_v) kernels::pq_reduce(ops, *pq_v, pq_hist.data(), nq, obuf.data());
  for (int i = 0; i < nq; ++i) {
    const int t = t0 + i / G, qh = h * G + i % G;
    const float* o = &obuf[static_cast<std::size_t>(i) * D];
    if (partial) {
      const std::size_t slot = static_cast<std::size_t>(t) * s.n_heads + qh;
      part_ml[slot] = ml[static_cast<std::size_t>(i)];
      std::memcpy(part_o + slot * D, o, sizeof(float) * static_cast<std::size_t>(D));
      continue;
    }
    float* dst = in.out + static_cast<std::size_t>(t) * s.q_dim() + qh * D;
    const float inv = 1.0f / ml[static_cast<std::size_t>(i)].l;
    for (int c = 0; c < D; ++c) dst[c] = o[c] * inv;
    if (in.rotate_v) unrotate(dst, D);
  }
}

}  // namespace

void BlockAttend::prepare(const AttendInput& in, AttendPath path) {
  const KvShape& s = in.shape;
  QKV_CHECK(in.n > 0 && in.n_blocks * in.block_tokens >= in.key_total() && in.key_lo >= 0 &&
            in.key_lo < in.block_tokens);
  in_ = in;
  given_ = 0;
  const bool plain = in.key_lo == 0 && in.key_end < 0 && in.causal && in.out_ml == nullptr;
  bool all_f32 = true;
  for (int b = 0; b < in.n_blocks; ++b)
    all_f32 = all_f32 && in.k_codecs[b].type == KvType::f32 && in.v_codecs[b].type == KvType::f32;
  const bool direct = all_f32 && !in.rotate_k && !in.rotate_v && !in.k_positions && plain;
  if (path == AttendPath::exact) {
    QKV_CHECK(direct);
    ops_ = nullptr;
    return;
  }
  // The kernels layer's one dispatch: the active level unless a test or
  // benchmark asks for a given one.
  ops_ = path == AttendPath::automatic ? &kernels::tile_kernels() : &kernels::tile_kernels(isa_of(path));
  chunks_ = (in.n + kChunkTokens - 1) / kChunkTokens;
  // Few queries (decode): split the keys too, so every thread has work. The
  // split depends on the problem only, never on the thread count or on the
  // other sessions of a batch, so results are the same on any machine.
  // pq lookup tables are built once per job: one partition per head then.
  bool pq = false;
  for (int b = 0; b < in.n_blocks && !pq && pq_lookup_tables(); ++b) pq = in.k_codecs[b].pq() || in.v_codecs[b].pq();
  // Blocks before every query's window are left out of the split, so that a
  // sliding-window layer's few partitions are not dealt out beside empty ones.
  first_block_ = in.causal ? std::clamp(in.visible_from, 0, in.key_total()) / in.block_tokens : 0;
  const int seen_blocks = in.n_blocks - first_block_;
  const int part_blocks = partition_blocks();
  parts_ = in.n <= 4 && !pq ? (seen_blocks + part_blocks - 1) / part_blocks : 1;
  slots_ = static_cast<std::size_t>(in.n) * static_cast<std::size_t>(s.n_heads);
  if (parts_ > 1) {
    ml_.assign(slots_ * static_cast<std::size_t>(parts_), Partial{});
    po_.assign(slots_ * static_cast<std::size_t>(parts_) * static_cast<std::size_t>(s.head_dim), 0.0f);
  }
}

std::size_t BlockAttend::jobs() const noexcept {
  const KvShape& s = in_.shape;
  if (ops_ == nullptr) return static_cast<std::size_t>(in_.n) * static_cast<std::size_t>(s.n_heads);
  return static_cast<std::size_t>(s.n_kv_heads) * static_cast<std::size_t>(chunks_) *
         static_cast<std::size_t>(parts_ - given_);
}

double BlockAttend::job_cost() const noexcept {
  const KvShape& s = in_.shape;
  double keys = in_.causal ? in_.first_pos + 0.5 * in_.n + 1.0 : in_.key_total() - in_.key_lo;
  if (in_.visible_from != AttendInput::kWholeContext)
    keys = std::min(keys, static_cast<double>(std::max(1, in_.key_total() - in_.visible_from)));
  if (ops_ == nullptr) return keys * s.head_dim;
  const double queries = std::min(in_.n, kChunkTokens) * (s.n_heads / s.n_kv_heads);
  return queries * std::min(keys, static_cast<double>(partition_blocks() * in_.block_tokens)) * s.head_dim;
}

void BlockAttend::run(std::size_t job) {
  if (ops_ == nullptr) {
    attend_exact_job(in_, job);
    return;
  }
  const auto parts = static_cast<std::size_t>(parts_ - given_), chunks = static_cast<std::size_t>(chunks_);
  const int p = given_ + static_cast<int>(job % parts);
  const int c = static_cast<int>(job / parts % chunks);
  const int h = static_cast<int>(job / parts / chunks);
  const int t0 = c * kChunkTokens, t1 = std::min(in_.n, t0 + kChunkTokens);
  const bool split = parts_ > 1;
  const int b0 = split ? first_block_ + p * partition_blocks() : 0;
  const int b1 = split ? std::min(in_.n_blocks, b0 + partition_blocks()) : in_.n_blocks;
  const std::size_t slot0 = slots_ * static_cast<std::size_t>(p);
  if (!split && in_.out_ml != nullptr) {  // one partition: its pieces are the result
    static_assert(sizeof(Partial) == 2 * sizeof(float));
    run_job(in_, *ops_, h, t0, t1, b0, b1, true, reinterpret_cast<Partial*>(in_.out_ml), in_.out_o);
    return;
  }
  run_job(in_, *ops_, h, t0, t1, b0, b1, split, split ? ml_.data() + slot0 : nullptr,
          split ? po_.data() + slot0 * static_cast<std::size_t>(in_.shape.head_dim) : nullptr);
}

void BlockAttend::finish() {
  if (ops_ == nullptr || parts_ <= 1) return;
  // Merge the partitions' softmax pieces: weights exp(m_p - M).
  const int D = in_.shape.head_dim, parts = parts_;
  const std::size_t slots = slots_;
  for (std::size_t slot = 0; slot < slots; ++slot) {
    float M = -std::numeric_limits<float>::infinity();
    for (int p = 0; p < parts; ++p) M = std::max(M, ml_[slots * p + slot].m);
    // slot = t * n_heads + qh
    float* dst = (in_.out_ml != nullptr ? in_.out_o : in_.out) + slot * static_cast<std::size_t>(D);
    std::fill(dst, dst + D, 0.0f);
    float L = 0.0f;
    for (int p = 0; p < parts; ++p) {
      const Partial& pm = ml_[slots * p + slot];
      if (pm.l == 0.0f) continue;
      const float w = std::exp(pm.m - M);
      L += w * pm.l;
      const float* o = &po_[(slots * p + slot) * static_cast<std::size_t>(D)];
      for (int c = 0; c < D; ++c) dst[c] += w * o[c];
    }
    if (in_.out_ml != nullptr) {
      in_.out_ml[2 * slot] = M;
      in_.out_ml[2 * slot + 1] = L;
      continue;
    }
    const float inv = 1.0f / L;
    for (int c = 0; c < D; ++c) dst[c] *= inv;
    if (in_.rotate_v) unrotate(dst, D);
  }
}

void attend_partition(const AttendInput& in, const kernels::TileKernels& ops, int kv_head, int t0, int t1, int b0,
                      int b1, BlockAttend::Partial* ml, float* o) {
  run_job(in, ops, kv_head, t0, t1, b0, b1, true, ml, o);
}

void set_codes_attention(bool on) noexcept { g_codes_attention.store(on, std::memory_order_relaxed); }
bool codes_attention() noexcept { return g_codes_attention.load(std::memory_order_relaxed); }
void set_pq_lookup_tables(bool on) noexcept { g_pq_tables.store(on, std::memory_order_relaxed); }
bool pq_lookup_tables() noexcept { return g_pq_tables.load(std::memory_order_relaxed); }

void attend_blocks(const AttendInput& in, AttendPath path, ThreadPool& pool) {
  BlockAttend work;
  work.prepare(in, path);
  AttendWork* w = &work;
  run_attend_works(std::span<AttendWork* const>(&w, 1), pool);
}

}  // namespace qkvshare::kv
