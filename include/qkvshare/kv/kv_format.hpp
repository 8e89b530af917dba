#pragma once
// KV formats: how a context stores keys and values in pool blocks.
//
// A block holds `block_tokens` tokens of every layer. Inside it, the unit of
// storage is a *tile*: the K (or V) rows of one KV head of one layer for the
// block's tokens, [block_tokens][head_dim]. A codec says how a tile is coded:
//  - f32 / f16: plain rows;
//  - q8 / q4 / q3 / q2: unsigned codes packed 8 per `bits` bytes in each row,
//    followed by (scale, min) pairs in f16, so x ~= code * scale + min. The
//    pairs run either per *channel* (one pair per channel over the block's
//    tokens: KIVI's key scheme, robust to outlier channels) or per *token*
//    (one pair per `group` channels of each row: the value scheme).
// A KvFormat picks the codec of full ("cold") blocks for K and V separately,
// plus which blocks stay hot (f16, or f32 for an f32 codec): the newest partly
// filled block always, the blocks holding the last `window` tokens and the
// first `sink` tokens optionally. Optional Hadamard rotation spreads outlier
// channels over the head before storage.
//  - pq: product quantization (kv_codebook.hpp): one byte per `group`
//    channels of a row, the index of the nearest centroid of a calibrated
//    codebook (the format's `book`); no scales.
// An integer codec may also keep a share of a tile's elements apart
// (`outliers`: KVQuant's dense-and-sparse split): the elements whose removal
// narrows their series' (scale, min) range the most are taken out before the
// range is fitted, and stored after the parameters as (element index, f16
// residual) pairs that readers add to the dense codes' values, and may store
// its (scale, min) pairs in one byte each (`params=8`).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <memory>

#include "qkvshare/kv/kv_cache.hpp"

namespace qkvshare {

class KvCodebook;

enum class KvType : std::uint8_t { f32 = 0, f16 = 1, q8 = 2, q4 = 3, q3 = 4, q2 = 5, pq = 6 };
enum class KvAxis : std::uint8_t { token = 0, channel = 1 };
// How keys are stored against RoPE: as the engine rotated them (post), as the
// projection computed them (pre: attention rotates each row to the position it
// was computed at), or rotated by their offset inside their block only (block:
// attention rotates the query back by each block's first position instead, so
// the code kernels still read the tile). pre and block need each block's
// first key position (BlockInfo::key_position).
enum class KeyRope : std::uint8_t { post = 0, pre = 1, block = 2 };
const char* key_rope_name(KeyRope r) noexcept;  // "post", "pre", "block"

struct KvCodec {
  KvType type = KvType::f16;
  KvAxis axis = KvAxis::token;  // integer types only
  std::uint16_t group = 0;      // token axis only: channels per (scale, min) pair; pq: per index
  // Sparse outliers, in tenths of a percent of a tile's elements (integer
  // codecs only; 0: none, at most kMaxOutliers).
  std::uint8_t outliers = 0;
  static constexpr int kMaxOutliers = 127;
  // Integer codecs: (scale, min) pairs in one byte each on a grid the tile
  // sets (kernels/kv_tiles.hpp) instead of f16: half the parameter bits
  // (keys per channel over 32 tokens: 1 -> 0.53 bits per element).
  bool byte_params = false;

  bool quantized() const noexcept { return type != KvType::f32 && type != KvType::f16; }
  bool pq() const noexcept { return type == KvType::pq; }
  // Whether tiles carry (scale, min) pairs: the integer codecs.
  bool scaled() const noexcept { return quantized() && !pq(); }
  int bits() const noexcept;  // bits of one element's value or code (pq: 8 / group)
  bool operator==(const KvCodec&) const = default;

  // Fixed 32-bit form stored in block headers (and, later, descriptors).
  std::uint32_t pack() const noexcept;
  // Throws Error(invalid_argument) for a value no codec packs to.
  static KvCodec unpack(std::uint32_t packed);

  static KvCodec f32() noexcept { return {KvType::f32, KvAxis::token, 0}; }
  static KvCodec f16() noexcept { return {KvType::f16, KvAxis::token, 0}; }
};

// Channels per (scale, min) pair of a per-token codec: the group (0: the
// whole head), lowered to the largest multiple of 8 that divides head_dim.
inline int effective_group(const KvCodec& c, int head_dim) noexcept {
  int g = c.group == 0 || c.group > head_dim ? head_dim : c.group;
  while (g > 8 && head_dim % g != 0) g -= 8;
  return g;
}

// The codec of hot blocks (the partly filled tail, window, sinks) for a cold codec.
inline KvCodec hot_codec(const KvCodec& cold) noexcept {
  return cold.type == KvType::f32 ? KvCodec::f32() : KvCodec::f16();
}

// Byte layout of one tile. Rows are head_dim elements (head_dim % 8 == 0).
struct TileLayout {
  int tokens = 0;
  int head_dim = 0;
  std::size_t row_bytes = 0;    // one row of values or codes
  std::size_t code_bytes = 0;   // tokens * row_bytes
  std::size_t param_offset = 0; // code_bytes rounded up to 4
  std::size_t param_bytes = 0;  // (scale, min) pairs: scales first, then mins (f16, or a header and bytes)
  bool byte_params = false;
  std::size_t n_params = 0;     // number of (scale, min) pairs
  std::size_t param_stride = 0; // n_params rounded up to 8: mins start this many halves after scales
  std::size_t outlier_offset = 0;  // after the parameters: n_outliers u16 element indices, then their f16 residuals
  std::size_t n_outliers = 0;
  std::size_t bytes = 0;        // padded to 32 bytes

  // What a tile stores (codes, scales, mins and outliers), without the padding.
  std::size_t stored_bytes() const noexcept { return code_bytes + param_bytes + 4 * n_outliers; }
};

// Throws Error(invalid_argument) when the codec does not fit the head (group).
TileLayout tile_layout(const KvCodec& codec, int block_tokens, int head_dim);

struct KvFormat {
  KvCodec k = KvCodec::f16();
  KvCodec v = KvCodec::f16();
  int window = 0;  // the newest `window` tokens stay hot (whole blocks)
  int sink = 0;    // the first `sink` tokens stay hot (whole blocks)
  bool rotate_k = false;
  bool rotate_v = false;
  // keys=pre|block (KeyRope): keys stored before RoPE (KVQuant's pre-RoPE
  // keys: a channel pair no longer turns with the position, which codebooks
  // fit better), or before all but their in-block part of it.
  KeyRope key_rope = KeyRope::post;
  // Importance-aware mixed precision (PooledKvCache::demote, when a context is
  // sealed or handed off): of the cold blocks, the `top` share that received
  // the most attention keeps k/v; the others are recoded to lo_k/lo_v.
  // top == 1: one precision.
  KvCodec lo_k = KvCodec::f16();
  KvCodec lo_v = KvCodec::f16();
  double top = 1.0;
  // Token dropping (PooledKvCache::evict, at seal or handoff): the context
  // keeps about `budget` of its tokens, whole blocks: the hot ones (sinks,
  // window, tail; at least the first and the last block) and the most
  // attended of the rest. budget == 1: nothing is dropped.
  double budget = 1.0;
  // How demote() and evict() rank the cold blocks: by the attention the last
  // queries give them, or by recency alone (StreamingLLM's policy: the
  // newest blocks first; the baseline that shows what attention adds).
  enum class Rank : std::uint8_t { attention = 0, recent = 1 };
  Rank rank = Rank::attention;
  // Where the blocks that evict() keeps sit: at the positions they were
  // computed at, the next token after the dropped ones' too (as H2O and
  // SnapKV keep them), or moved back over the gaps (StreamingLLM's cache).
  bool close_positions = false;
  // tail=cold: a handed-off context's partly filled last block ships in the
  // cold codecs (PooledKvCache::code_tail, at seal or handoff) instead of
  // hot, so a handoff ships the format's bits; its consumer reads the codes
  // of those tokens, and copies them into a hot block of its own when it
  // writes there. The producer keeps its hot tail.
  bool cold_tail = false;
  // The codebook of pq codecs (k, v, lo_k or lo_v), shared by every format
  // that names the same file (KvCodebook::shared).
  std::shared_ptr<const KvCodebook> book;
  std::string book_path;

  bool operator==(const KvFormat&) const = default;
  bool mixed() const noexcept { return top < 1.0; }
  bool evicts() const noexcept { return budget < 1.0; }
  // Whether the context records its last queries (demote() and evict() rank blocks by them).
  bool observes() const noexcept { return mixed() || evicts(); }
  // Whether a handed-off context ships other than the producer holds it (reduce_for_handoff).
  bool reduces_at_handoff() const noexcept { return observes() || cold_tail; }
  // Whether any codec of the format is pq (and so needs `book`).
  bool uses_pq() const noexcept { return k.pq() || v.pq() || (mixed() && (lo_k.pq() || lo_v.pq())); }
  // Whether K/V codecs are this mixed format's low precision (a demoted block).
  bool demoted(const KvCodec& bk, const KvCodec& bv) const noexcept { return mixed() && bk == lo_k && bv == lo_v; }
  // Cold blocks that keep k/v out of `cold` when the context is demoted.
  int kept_blocks(int cold) const noexcept;

  // Syntax: NAME[:option=value]... with NAME one of f32, f16, int8, int4, int3,
  // int2, pq4, pq2, pq1 (same for K and V; pqN: N bits per element) or kXvY
  // (X, Y in 32, 16, 8, 4, 3, 2, pq4, pq2, pq1), book=FILE (a codebook of
  // `qkvshare calibrate`, required by pq; FILE holds no ':'), and
  // options window=N, sink=N (tokens), kaxis=channel|token, kgroup=N,
  // vgroup=N, rot=none|k|v|kv, keys=post|pre|block (KeyRope), and lo=NAME:top=F (mixed precision: NAME an
  // integer name as above, 0 < F < 1; vgroup applies to both precisions),
  // budget=F (token dropping, 0 < F < 1), rank=attention|recent (how both
  // choose their blocks), positions=keep|close (where kept blocks sit),
  // tail=hot|cold (the partly filled block of a handed-off context),
  // outliers=F (every integer codec keeps the share F of each tile's
  // elements apart in f16, 0.001 <= F <= 0.127, in steps of 0.001), or
  // koutliers=F / voutliers=F for the keys' or the values' codecs only.
  // `mixed:hi=NAME:lo=NAME:top=F` is the same with the high precision named.
  // Throws Error(invalid_argument) naming the part.
  static KvFormat parse(std::string_view text);
  // Canonical text; parse(to_string()) == *this.
  std::string to_string() const;

  // Checks the format against a model's head size; throws invalid_argument.
  void validate(const KvShape& shape, int block_tokens) const;
  // Bits per stored element of a full cold block (codes, scales and mins).
  double cold_bits(int block_tokens, int head_dim) const;
  // KV bytes of a context of `tokens` tokens with hot blocks counted (and,
  // for a mixed format, its cold blocks as demote() leaves them).
  std::size_t context_bytes(const KvShape& shape, int block_tokens, int tokens) const;
  // Which blocks are hot once `tokens` tokens are stored.
  bool block_is_hot(int block, int tokens, int block_tokens) const noexcept;
};

}  // namespace qkvshare
