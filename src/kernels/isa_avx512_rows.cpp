// AVX-512 + VNNI kernels of Q4_0, Q4_1, Q8_0, Q4_K and Q5_K weights on 16-row
// tiles (Q4_K/Q5_K: see FK45Rows below; their one-token decode reads rows as
// they lie instead, see gemv_k_rowmajor).
// Built with AVX-512 flags; reached only through isa.cpp after the CPU check.
//
// A block column of 16 rows (16 x 32 codes) is transposed so that 32-bit
// lane r of vector k holds codes 4k..4k+3 of row r. Eight vpdpbusd, each with
// 4 activation bytes broadcast from memory, then leave row r's whole integer
// block dot in lane r: one conversion and two FMAs per block serve 16 rows,
// where a row-major layout needs them per 4 codes of one row, and the 16
// results are stored without horizontal sums. The transposition is a few
// shuffles per block; prefill decodes a tile once into a buffer and reuses it
// for every token of a chunk, decode streams it (up to 8 tokens at once: a
// batch of sessions decoding together uses each decoded block for all). Both run the same arithmetic
// per output, in the same order: a token's result does not depend on its batch.
#include <cstddef>
#include <cstring>
#include <new>

#include "gemm_tiles.hpp"  // step_buffer
#include "kernel_table.hpp"
#include "qkvshare/kernels/quant.hpp"  // block layouts only
#include "simd_intrin.hpp"

namespace qkvshare::kernels::detail::avx512 {
namespace {

constexpr int kRows = 16;

// One 32-block column of a tile, decoded: unsigned codes u (q + offset, the
// offset removed by ActQ8::bsum), the scale and (Q4_1) the minimum per row.
struct Tile {
  __m512i w[8];
  __m512 d;
  __m512 m;
};

struct RowTile {
  const std::uint8_t* base;        // row r0
  alignas(64) std::int32_t off[kRows];  // row r - row r0 in bytes; rows past the matrix repeat its last row
  __mmask16 valid;                 // the rows that exist (only they are stored)
  const std::uint8_t* row(int r) const { return base + off[r]; }
};

RowTile row_tile(const GemmArgs& a, std::int64_t r0) {
  RowTile t;
  const std::int64_t n = a.n_rows - r0 < kRows ? a.n_rows - r0 : kRows;
  t.base = a.w + static_cast<std::size_t>(r0) * a.row_bytes;
  for (int r = 0; r < kRows; ++r) t.off[r] = static_cast<std::int32_t>(static_cast<std::size_t>(r < n ? r : n - 1) * a.row_bytes);
  t.valid = static_cast<__mmask16>((1u << n) - 1u);
  return t;
}

// The first 4 bytes of block b in each row (f16 d, then f16 m or codes).
[[gnu::always_inline]] inline __m512i gather_heads(const RowTile& t, std::int64_t b, std::size_t block_bytes) {
  return _mm512_i32gather_epi32(_mm512_load_si512(t.off), t.base + static_cast<std::size_t>(b) * block_bytes, 1);
}
inline __m512 low_f16(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }

// 16 bytes per row (at ptr(r)), transposed 4x4 within each 128-bit lane
// (lane L of Z_j holds row j + 4L): lane r of out[c] holds dword c of row r.
template <class Ptr>
[[gnu::always_inline]] inline void transpose16(Ptr ptr, __m512i* out) {
  __m512i z[4];
  for (int j = 0; j < 4; ++j) {
    const auto qs = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(ptr(r))); };
    __m512i v = _mm512_castsi128_si512(qs(j));
    v = _mm512_inserti32x4(v, qs(j + 4), 1);
    v = _mm512_inserti32x4(v, qs(j + 8), 2);
    z[j] = _mm512_inserti32x4(v, qs(j + 12), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Codes of 4-bit blocks: 16 bytes per row, transposed, then split into
// nibbles: byte j holds codes j (low) and j + 16 (high).
template <class Block>
[[gnu::always_inline]] inline void transpose_nibbles(const RowTile& t, std::int64_t b, Tile& out) {
  __m512i raw[4];
  transpose16([&](int r) { return reinterpret_cast<const Block*>(t.row(r))[b].qs; }, raw);
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < 4; ++c) {
    out.w[c] = _mm512_and_si512(raw[c], lo4);
    out.w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw[c], 4), lo4);
  }
}

// 32 bytes per row (at ptr(r)), transposed 8x8 within each 256-bit half
// (half H of Z_j holds row j + 8H): lane r of out[k] holds bytes 4k..4k+3 of row r.
template <class Ptr>
[[gnu::always_inline]] inline void transpose32(Ptr ptr, __m512i* out) {
  __m512i z[8];
  for (int j = 0; j < 8; ++j) {
    const auto qs = [&](int r) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ptr(r))); };
    z[j] = _mm512_inserti64x4(_mm512_castsi256_si512(qs(j)), qs(j + 8), 1);
  }
  __m512i u[8];
  for (int h = 0; h < 2; ++h) {  // rows 0-3 and 4-7 of each half
    const __m512i* zz = z + 4 * h;
    const __m512i t0 = _mm512_unpacklo_epi32(zz[0], zz[1]), t1 = _mm512_unpackhi_epi32(zz[0], zz[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(zz[2], zz[3]), t3 = _mm512_unpackhi_epi32(zz[2], zz[3]);
    u[4 * h + 0] = _mm512_unpacklo_epi64(t0, t2);
    u[4 * h + 1] = _mm512_unpackhi_epi64(t0, t2);
    u[4 * h + 2] = _mm512_unpacklo_epi64(t1, t3);
    u[4 * h + 3] = _mm512_unpackhi_epi64(t1, t3);
  }
  // u[c] / u[4 + c]: dwords c (128-bit lanes 0, 2) and c + 4 (lanes 1, 3) of rows 0-3 / 4-7 of each half.
  const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int c = 0; c < 4; ++c) {
    out[c] = _mm512_permutex2var_epi64(u[c], lo, u[4 + c]);
    out[c + 4] = _mm512_permutex2var_epi64(u[c], hi, u[4 + c]);
  }
}

// Codes of Q8_0, offset to unsigned.
[[gnu::always_inline]] inline void transpose_bytes32(const RowTile& t, std::int64_t b, Tile& out) {
  transpose32([&](int r) { return reinterpret_cast<const BlockQ8_0*>(t.row(r))[b].qs; }, out.w);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int k = 0; k < 8; ++k) out.w[k] = _mm512_xor_si512(out.w[k], flip);
}

struct FQ4_0 {
  static constexpr bool kMin = false;
  [[gnu::always_inline]] static void decode(const RowTile& t, std::int64_t b, Tile& out) {
    transpose_nibbles<BlockQ4_0>(t, b, out);
    out.d = low_f16(gather_heads(t, b, sizeof(BlockQ4_0)));
  }
};

// Rows packed by pack_tiles (packed_weights.hpp): block b of a tile is its
// 16 rows' f16 scales (and Q4_1's minimums), then the code vectors already
// in the order transpose16 / transpose32 give (Q8_0's offset to unsigned).
// The same Tile values as the unpacked formats', with no gather and no
// shuffles, read from one run of bytes instead of 16 rows apart.
inline __m512 packed_f16(const std::uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void packed_nibbles(const std::uint8_t* codes, Tile& out) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < 4; ++c) {
    const __m512i raw = _mm512_loadu_si512(codes + 64 * c);
    out.w[c] = _mm512_and_si512(raw, lo4);
    out.w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
  }
}

struct FQ4_0Packed {
  static constexpr bool kMin = false;
  [[gnu::always_inline]] static void decode(const RowTile& t, std::int64_t b, Tile& out) {
    const std::uint8_t* p = t.base + static_cast<std::size_t>(b) * kRows * sizeof(BlockQ4_0);
    out.d = packed_f16(p);
    packed_nibbles(p + 2 * kRows, out);
  }
};

struct FQ4_1Packed {
  static constexpr bool kMin = true;
  [[gnu::always_inline]] static void decode(const RowTile& t, std::int64_t b, Tile& out) {
    const std::uint8_t* p = t.base + static_cast<std::size_t>(b) * kRows * sizeof(BlockQ4_1);
    out.d = packed_f16(p);
    out.m = packed_f16(p + 2 * kRows);
    packed_nibbles(p + 4 * kRows, out);
  }
};

struct FQ8_0Packed {
  static constexpr bool kMin = false;
  [[gnu::always_inline]] static void decode(const RowTile& t, std::int64_t b, Tile& out) {
    const std::uint8_t* p = t.base + static_cast<std::size_t>(b) * kRows * sizeof(BlockQ8_0);
    out.d = packed_f16(p);
    for (int k = 0; k < 8; ++k) out.w[k] = _mm512_loadu_si512(p + 2 * kRows + 64 * k);
  }
};

struct FQ4_1 {
  static constexpr bool kMin = true;
  [[gnu::always_inline]] static void decode(const RowTile& t, std::int64_t b, Tile& out) {
    transpose_nibbles<BlockQ4_1>(t, b, out);
    const __m512i dm = gather_heads(t, b, sizeof(BlockQ4_1));
    out.d = low_f16(dm);
    out.m = low_f16(_mm512_srli_epi32(dm, 16));
  }
};

struct FQ8_0 {
  static constexpr bool kMin = false;
  [[gnu::always_inline]] static void decode(const RowTile& t, std::int64_t b, Tile& out) {
    transpose_bytes32(t, b, out);
    out.d = low_f16(gather_heads(t, b, sizeof(BlockQ8_0)));
  }
};

// acc[t] += the 16 rows' dots with block b of token t0 + t.
template <bool kMin, int T>
inline void mac(__m512* acc, const Tile& w, const ActQ8& act, std::int64_t t0, std::int64_t b) {
  const std::int64_t nb = act.cols / 32;
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    const std::int64_t blk = (t0 + t) * nb + b;
    const std::int8_t* x = act.qs + 32 * blk;
    __m512i p = _mm512_set1_epi32(act.bsum[blk]);
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      std::int32_t x4;
      std::memcpy(&x4, x + 4 * k, 4);
      p = _mm512_dpbusd_epi32(p, w.w[k], _mm512_set1_epi32(x4));
    }
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(w.d, _mm512_set1_ps(act.d[blk])), acc[t]);
    if constexpr (kMin) acc[t] = _mm512_fmadd_ps(w.m, _mm512_set1_ps(act.s[blk]), acc[t]);
  }
}

template <int T>
inline void store(const GemmArgs& a, const RowTile& rt, std::int64_t r0, std::int64_t t0, const __m512* acc) {
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(a.y + (t0 + t) * a.ldy + r0, rt.valid, acc[t]);
}

// A tile's 16 rows are contiguous bytes, and so is the next tile's: while
// block b of this tile is read, the b-th slice of the next tile is asked for,
// so that the whole next tile is on its way by the time it starts, whatever
// the row length (short rows left the first lines of every tile to DRAM
// latency when only in-row lines ahead were fetched).
inline void prefetch_slice(const GemmArgs& a, const RowTile& rt, std::int64_t b, std::int64_t nb) {
  const std::size_t tile_bytes = kRows * a.row_bytes;
  const std::uint8_t* next = rt.base + tile_bytes;
  const std::uint8_t* end = a.w + static_cast<std::size_t>(a.n_rows) * a.row_bytes;
  const std::size_t from = tile_bytes * static_cast<std::size_t>(b) / static_cast<std::size_t>(nb) / 64 * 64;
  const std::size_t to = tile_bytes * static_cast<std::size_t>(b + 1) / static_cast<std::size_t>(nb);
  for (std::size_t off = from; off < to && next + off < end; off += 64) __builtin_prefetch(next + off, 0, 3);
}

// Decode: the rows streamed once, each block decoded into registers and used
// by all T tokens (T > 1: several sessions decoding together).
template <class F, int T>
void gemv_rows_tokens(const GemmArgs& a, const RowTile& rt, std::int64_t r0) {
  const std::int64_t nb = a.cols / 32;
  __m512 acc[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b) {
    prefetch_slice(a, rt, b, nb);
    Tile w;
    F::decode(rt, b, w);
    mac<F::kMin, T>(acc, w, a.act, 0, b);
  }
  store<T>(a, rt, r0, 0, acc);
}

template <class F, int T>
void gemv_tokens(const GemmArgs& a) {
  for (std::int64_t r0 = 0; r0 < a.n_rows; r0 += kRows) gemv_rows_tokens<F, T>(a, row_tile(a, r0), r0);
}

template <class F, int T>
void tokens_from_buffer(const GemmArgs& a, const RowTile& rt, std::int64_t r0, const Tile* buf, std::int64_t t0) {
  __m512 acc[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (std::int64_t b = 0; b < a.cols / 32; ++b) mac<F::kMin, T>(acc, buf[b], a.act, t0, b);
  store<T>(a, rt, r0, t0, acc);
}

// Prefill: tokens go in chunks whose activations stay in L2; within a chunk
// each 16-row tile is decoded once into this thread's buffer and swept over
// the chunk's tokens, kT at a time.
template <class F, std::size_t kBlockBytes>
void gemm_rows(const GemmArgs& a) {
  const std::int64_t nb = a.cols / 32;
  switch (a.n_tokens) {
    case 1: return gemv_tokens<F, 1>(a);
    case 2: return gemv_tokens<F, 2>(a);
    case 3: return gemv_tokens<F, 3>(a);
    case 4: return gemv_tokens<F, 4>(a);
    case 5: return gemv_tokens<F, 5>(a);
    case 6: return gemv_tokens<F, 6>(a);
    case 7: return gemv_tokens<F, 7>(a);
    case 8: return gemv_tokens<F, 8>(a);
    default: break;
  }
  constexpr int kT = 8;
  constexpr std::int64_t kTokenChunk = 64;
  Tile* buf = step_buffer<Tile>(static_cast<std::size_t>(nb));
  for (std::int64_t tc = 0; tc < a.n_tokens; tc += kTokenChunk) {
    const std::int64_t tc_end = tc + kTokenChunk < a.n_tokens ? tc + kTokenChunk : a.n_tokens;
    for (std::int64_t r0 = 0; r0 < a.n_rows; r0 += kRows) {
      const RowTile rt = row_tile(a, r0);
      for (std::int64_t b = 0; b < nb; ++b) F::decode(rt, b, buf[b]);
      std::int64_t t = tc;
      for (; t + kT <= tc_end; t += kT) tokens_from_buffer<F, kT>(a, rt, r0, buf, t);
      for (; t + 4 <= tc_end; t += 4) tokens_from_buffer<F, 4>(a, rt, r0, buf, t);
      for (; t < tc_end; ++t) tokens_from_buffer<F, 1>(a, rt, r0, buf, t);
    }
  }
}

// ---- Q4_K / Q5_K on 16-row tiles, with the super-block activations ----
// (kernel_table.hpp ActQ8::dk.) A step is sub-block j of super-block sb: its
// 16 rows' 32 codes transposed as above, so eight vpdpbusd leave each row's
// integer sub-block dot in its lane; times the rows' 6-bit scales (vpmulld)
// it is summed in integers over the super-block, then converted once and
// scaled by d_r * dk. The minimums' part is an FMA per sub-block with the
// activation block's sum (ActQ8::s). The 16 rows' packed scales are unpacked
// together, lane by lane (scales_mins_k4's arithmetic on gathered dwords).
struct TileK {
  __m512i w[8];
  __m512i sc;   // lane r: row r's scale of this sub-block
  __m512 mins;  // lane r: -dmin_r * m_j
  __m512 d;     // lane r: row r's d
};

// The 16 rows' d, -dmin and 6-bit scales and minimums of super-block sb,
// lane by lane: sm[0] / sm[1] lane r hold row r's scales 0-3 / 4-7 as bytes,
// sm[2] / sm[3] its minimums. Shared by the tile and the row-major paths, so
// that both run the same float operations on the same values.
struct ScalesK {
  __m512i sm[4];
  __m512 d, neg_dmin;
};

// From lane r = row r's dwords of the block's head: d and dmin, then the 12
// bytes of packed scales (scales_mins_k4's arithmetic on each lane).
[[gnu::always_inline]] inline ScalesK unpack_scales(__m512i head, __m512i u0, __m512i u1, __m512i u2) {
  ScalesK k;
  k.d = low_f16(head);
  k.neg_dmin = _mm512_sub_ps(_mm512_setzero_ps(), low_f16(_mm512_srli_epi32(head, 16)));
  const __m512i low6 = _mm512_set1_epi32(0x3f3f3f3f), low4 = _mm512_set1_epi32(0x0f0f0f0f),
                low2 = _mm512_set1_epi32(0x03030303);
  k.sm[0] = _mm512_and_si512(u0, low6);  // scales 0-3
  k.sm[1] = _mm512_or_si512(_mm512_and_si512(u2, low4),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), low2), 4));
  k.sm[2] = _mm512_and_si512(u1, low6);  // minimums 0-3
  k.sm[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), low4),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), low2), 4));
  return k;
}

// The block heads gathered (the tile paths: loading them instead measured no
// faster there) or loaded 16 bytes per row and transposed (row-major decode,
// where the four 16-lane gathers took about a fifth of the time).
template <class Block>
[[gnu::always_inline]] inline ScalesK scales_k(const RowTile& t, std::int64_t sb) {
  const __m512i idx = _mm512_load_si512(t.off);
  const std::uint8_t* base = t.base + static_cast<std::size_t>(sb) * sizeof(Block);
  const std::uint8_t* sp = base + offsetof(Block, scales);
  return unpack_scales(_mm512_i32gather_epi32(idx, base, 1), _mm512_i32gather_epi32(idx, sp, 1),
                       _mm512_i32gather_epi32(idx, sp + 4, 1), _mm512_i32gather_epi32(idx, sp + 8, 1));
}
template <class Block>
[[gnu::always_inline]] inline ScalesK scales_k_loaded(const RowTile& t, std::int64_t sb) {
  static_assert(offsetof(Block, scales) == 4 && sizeof(Block::scales) == 12);
  __m512i v[4];
  transpose16([&](int r) { return reinterpret_cast<const Block*>(t.row(r)) + sb; }, v);
  return unpack_scales(v[0], v[1], v[2], v[3]);
}

inline __m512i byte_of(__m512i v, int i) { return _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(0xff)); }
// Lane r: row r's scale of sub-block j, and -dmin_r * m_j.
inline __m512i scale_k(const ScalesK& k, int j) { return byte_of(k.sm[j / 4], j % 4); }
inline __m512 mins_k(const ScalesK& k, int j) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(byte_of(k.sm[2 + j / 4], j % 4)), k.neg_dmin);
}

template <class BlockT, bool kFiveBits>
struct FK45Rows {
  using Block = BlockT;
  static constexpr bool kFive = kFiveBits;
  // The 8 sub-block tiles of super-block sb.
  [[gnu::always_inline]] static void decode(const RowTile& t, std::int64_t sb, TileK* out) {
    const ScalesK ks = scales_k<Block>(t, sb);
    __m512i h[8];
    if constexpr (kFive)
      transpose32([&](int r) { return reinterpret_cast<const Block*>(t.row(r))[sb].qh; }, h);
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c and 2c + 1 share their 32 bytes
      __m512i raw[8];
      transpose32([&](int r) { return reinterpret_cast<const Block*>(t.row(r))[sb].qs + 32 * c; }, raw);
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * c + half;
        TileK& o = out[j];
        for (int k = 0; k < 8; ++k) {
          __m512i u = _mm512_and_si512(half ? _mm512_srli_epi16(raw[k], 4) : raw[k], _mm512_set1_epi8(0x0f));
          if constexpr (kFive) {  // bit j of qh byte l: the 5th bit of value l
            const __m512i bit = _mm512_and_si512(_mm512_srli_epi16(h[k], j), _mm512_set1_epi8(1));
            u = _mm512_or_si512(u, _mm512_slli_epi16(bit, 4));
          }
          o.w[k] = u;
        }
        o.sc = scale_k(ks, j);
        o.mins = mins_k(ks, j);
        o.d = ks.d;
      }
    }
  }
};

// acc[t] += the 16 rows' dots with super-block sb of token t0 + t.
template <int T>
inline void mac_k(__m512* acc, const TileK* w, const ActQ8& act, std::int64_t t0, std::int64_t sb) {
  const std::int64_t nsb = act.cols / kQK_K;
  __m512i isum[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) isum[t] = _mm512_setzero_si512();
  for (int j = 0; j < 8; ++j) {
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const std::int64_t blk = ((t0 + t) * nsb + sb) * 8 + j;
      const std::int8_t* x = act.qs + 32 * blk;
      __m512i p = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        std::int32_t x4;
        std::memcpy(&x4, x + 4 * k, 4);
        p = _mm512_dpbusd_epi32(p, w[j].w[k], _mm512_set1_epi32(x4));
      }
      isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(p, w[j].sc));
      acc[t] = _mm512_fmadd_ps(w[j].mins, _mm512_set1_ps(act.s[blk]), acc[t]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    const __m512 scale = _mm512_mul_ps(w[0].d, _mm512_set1_ps(act.dk[(t0 + t) * nsb + sb]));
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), scale, acc[t]);
  }
}

template <class F, int T>
void gemv_k_tokens(const GemmArgs& a) {
  const std::int64_t nsb = a.cols / kQK_K;
  for (std::int64_t r0 = 0; r0 < a.n_rows; r0 += kRows) {
    const RowTile rt = row_tile(a, r0);
    __m512 acc[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (std::int64_t sb = 0; sb < nsb; ++sb) {
      prefetch_slice(a, rt, sb, nsb);
      TileK w[8];
      F::decode(rt, sb, w);
      mac_k<T>(acc, w, a.act, 0, sb);
    }
    store<T>(a, rt, r0, 0, acc);
  }
}

template <int T>
void tokens_k_from_buffer(const GemmArgs& a, const RowTile& rt, std::int64_t r0, const TileK* buf, std::int64_t t0) {
  __m512 acc[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (std::int64_t sb = 0; sb < a.cols / kQK_K; ++sb) mac_k<T>(acc, buf + 8 * sb, a.act, t0, sb);
  store<T>(a, rt, r0, t0, acc);
}

// ---- Q4_K / Q5_K decode, row-major ----
// One token uses each decoded tile once, so the transposition above costs
// more than the products it feeds. Here each row's super-block is read as it
// lies, 64 codes per vector: maddubs sums u * x in 16 bits (at most
// 2 * 31 * 128, no saturation) and vpdpwssd multiplies each sub-block's sums
// by its scale into 32-bit lanes. The 16 rows' lane vectors are then summed
// across lanes in one transposing tree, leaving row r's super-block sum in
// lane r: the same integer as mac_k's isum (integer sums are exact in any
// order), followed by mac_k's float operations in mac_k's order. So decode
// gives the tile path's bits, and a token's result still does not depend on
// its batch (tests/kernels/test_matmul_isa.cpp).

// The activations of one super-block, paired as a row's codes pair them:
// vector 2c + half holds sub-blocks 4c + half (low 256 bits) and 4c + 2 + half
// (high), matching the low (half 0) or high (half 1) nibbles of qs bytes 64c..64c+63.
struct XK {
  __m512i x[4];
};
inline XK load_xk(const ActQ8& act, std::int64_t sb) {
  const std::int8_t* q = act.qs + kQK_K * sb;
  XK o;
  for (int c = 0; c < 2; ++c) {
    const __m512i a = _mm512_loadu_si512(q + 128 * c), b = _mm512_loadu_si512(q + 128 * c + 64);
    o.x[2 * c] = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(1, 0, 1, 0));
    o.x[2 * c + 1] = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 2, 3, 2));
  }
  return o;
}

// 16-bit lanes of 128-bit lanes 0-1 take byte lo, of lanes 2-3 byte hi, of a
// broadcast dword (the zero-extended scale of the sub-block a lane multiplies).
inline __m512i scale_pick(int lo, int hi) {
  const auto w = [](int b) { return static_cast<std::int32_t>(0x80008000u | (b << 16) | b); };
  return _mm512_set_epi32(w(hi), w(hi), w(hi), w(hi), w(hi), w(hi), w(hi), w(hi), w(lo), w(lo), w(lo), w(lo), w(lo),
                          w(lo), w(lo), w(lo));
}

// One row's super-block: 16 lanes whose sum is the integer sum of its sub-
// blocks' dots times their scales. sc03 / sc47: the row's scales as bytes.
template <class Block, bool kFive>
[[gnu::always_inline]] inline __m512i row_isum_k(const Block* blk, const XK& x, std::int32_t sc03, std::int32_t sc47) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  __m512i h;
  if constexpr (kFive) h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk->qh)));
  __m512i isum = _mm512_setzero_si512();
  for (int c = 0; c < 2; ++c) {
    const __m512i q = _mm512_loadu_si512(blk->qs + 64 * c);
    const __m512i sc = _mm512_set1_epi32(c ? sc47 : sc03);
    for (int half = 0; half < 2; ++half) {
      __m512i u = _mm512_and_si512(half ? _mm512_srli_epi16(q, 4) : q, lo4);
      if constexpr (kFive) {
        // Bit j of qh byte l is the 5th bit of value l of sub-block j; this
        // vector holds sub-blocks j0 = 4c + half (low half) and j0 + 2 (high):
        // shift each half's bit to bit 4 (16-bit shifts by at most 4 keep a
        // byte's bit 4 within the byte).
        const int j0 = 4 * c + half;
        const auto shifted = [&](int j) {
          return j <= 4 ? _mm512_slli_epi16(h, 4 - j) : _mm512_srli_epi16(h, j - 4);
        };
        const __m512i hb = _mm512_mask_blend_epi64(0xf0, shifted(j0), shifted(j0 + 2));
        u = _mm512_ternarylogic_epi32(u, hb, _mm512_set1_epi8(0x10), 0xf8);  // u | (hb & 0x10)
      }
      const __m512i s16 = _mm512_shuffle_epi8(sc, scale_pick(half, 2 + half));
      isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(u, x.x[2 * c + half]), s16);
    }
  }
  return isum;
}

// Dword i of 128-bit lane L of the result: the sum of v[i]'s dwords
// 4L..4L+3 (four rows' partial sums, one per 128-bit lane).
inline __m512i sum4(const __m512i* v) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}
// Lane 4k + i: the sum of all 16 lanes of row 4k + i, from g[k] = sum4 of
// rows 4k..4k+3.
inline __m512i sum16(const __m512i* g) {
  const auto fold = [](__m512i p, __m512i q) {  // 128-bit lanes: p's 0+1, 2+3, then q's
    return _mm512_add_epi32(_mm512_shuffle_i32x4(p, q, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(p, q, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return fold(fold(g[0], g[1]), fold(g[2], g[3]));
}

// Asks for block sb of the row tile_bytes further on (the same row of the
// next tile), every line of it: the next tile is on its way while this one
// is read, as prefetch_slice does for the tile paths, without a loop.
template <class Block>
[[gnu::always_inline]] inline void prefetch_block(const Block* blk, std::size_t tile_bytes) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(blk) + tile_bytes;
  for (std::size_t off = 0; off < sizeof(Block); off += 64) __builtin_prefetch(p + off, 0, 3);
  __builtin_prefetch(p + sizeof(Block) - 1, 0, 3);
}

template <class Block, bool kFive>
void gemv_k_rowmajor(const GemmArgs& a) {
  const std::int64_t nsb = a.cols / kQK_K;
  const std::size_t tile_bytes = kRows * a.row_bytes;
  for (std::int64_t r0 = 0; r0 < a.n_rows; r0 += kRows) {
    const RowTile rt = row_tile(a, r0);
    const std::int64_t ahead = a.n_rows - r0 - kRows;  // rows of the next tile
    __m512 acc = _mm512_setzero_ps();
    for (std::int64_t sb = 0; sb < nsb; ++sb) {
      const ScalesK k = scales_k_loaded<Block>(rt, sb);
      alignas(64) std::int32_t sc03[kRows], sc47[kRows];
      _mm512_store_si512(sc03, k.sm[0]);
      _mm512_store_si512(sc47, k.sm[1]);
      const XK x = load_xk(a.act, sb);
      __m512i g[4];
      for (int q = 0; q < 4; ++q) {
        __m512i v[4];
        for (int i = 0; i < 4; ++i) {
          const int r = 4 * q + i;
          const Block* blk = reinterpret_cast<const Block*>(rt.row(r)) + sb;
          if (r < ahead) prefetch_block(blk, tile_bytes);
          v[i] = row_isum_k<Block, kFive>(blk, x, sc03[r], sc47[r]);
        }
        g[q] = sum4(v);
      }
      const __m512i isum = sum16(g);
      // mac_k<1>'s float operations, in its order.
      for (int j = 0; j < 8; ++j) acc = _mm512_fmadd_ps(mins_k(k, j), _mm512_set1_ps(a.act.s[sb * 8 + j]), acc);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(k.d, _mm512_set1_ps(a.act.dk[sb])), acc);
    }
    store<1>(a, rt, r0, 0, &acc);
  }
}

template <class F>
void gemm_k_rows(const GemmArgs& a) {
  switch (a.n_tokens) {
    case 1: return gemv_k_rowmajor<typename F::Block, F::kFive>(a);
    case 2: return gemv_k_tokens<F, 2>(a);
    case 3: return gemv_k_tokens<F, 3>(a);
    case 4: return gemv_k_tokens<F, 4>(a);
    default: break;
  }
  constexpr std::int64_t kTokenChunk = 64;
  const std::int64_t nsb = a.cols / kQK_K;
  TileK* buf = step_buffer<TileK>(static_cast<std::size_t>(8 * nsb));
  for (std::int64_t tc = 0; tc < a.n_tokens; tc += kTokenChunk) {
    const std::int64_t tc_end = tc + kTokenChunk < a.n_tokens ? tc + kTokenChunk : a.n_tokens;
    for (std::int64_t r0 = 0; r0 < a.n_rows; r0 += kRows) {
      const RowTile rt = row_tile(a, r0);
      for (std::int64_t sb = 0; sb < nsb; ++sb) F::decode(rt, sb, buf + 8 * sb);
      std::int64_t t = tc;
      for (; t + 4 <= tc_end; t += 4) tokens_k_from_buffer<4>(a, rt, r0, buf, t);
      for (; t < tc_end; ++t) tokens_k_from_buffer<1>(a, rt, r0, buf, t);
    }
  }
}

}  // namespace

void gemm_q8_0(const GemmArgs& a) { gemm_rows<FQ8_0, sizeof(BlockQ8_0)>(a); }
void gemm_q4_0(const GemmArgs& a) { gemm_rows<FQ4_0, sizeof(BlockQ4_0)>(a); }
void gemm_q4_1(const GemmArgs& a) { gemm_rows<FQ4_1, sizeof(BlockQ4_1)>(a); }
// a.w: the packed rows, a.n_rows a multiple of 16.
void gemm_q4_0_packed(const GemmArgs& a) { gemm_rows<FQ4_0Packed, sizeof(BlockQ4_0)>(a); }
void gemm_q4_1_packed(const GemmArgs& a) { gemm_rows<FQ4_1Packed, sizeof(BlockQ4_1)>(a); }
void gemm_q8_0_packed(const GemmArgs& a) { gemm_rows<FQ8_0Packed, sizeof(BlockQ8_0)>(a); }
void gemm_q4_k_rows(const GemmArgs& a) { gemm_k_rows<FK45Rows<BlockQ4_K, false>>(a); }
void gemm_q5_k_rows(const GemmArgs& a) { gemm_k_rows<FK45Rows<BlockQ5_K, true>>(a); }

}  // namespace qkvshare::kernels::detail::avx512
