// Reads a portable context file and prints what it holds in host terms:
// tokens, text, and per block the sums of its decoded f16/f32 elements,
// codes and quantization parameters, after converting every tile to the
// host's native order. Then re-encodes the context from those native tiles
// and checks the bytes are identical to the file. Built natively and, by
// big_endian_test.sh, for s390x (big endian) under qemu: the two outputs
// must be the same line for line. Depends on core, kv_format and the
// context format only (no OS-specific or third-party runtime).
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/half.hpp"
#include "qkvshare/tiers/context_file.hpp"

using namespace qkvshare;

namespace {

// Sums of one native tile: values (float codecs) or codes and params.
struct TileSums {
  double values = 0, scales = 0, mins = 0;
  std::uint64_t codes = 0;
};

TileSums sums_of(const KvCodec& c, int T, int D, const std::byte* tile) {
  const TileLayout l = tile_layout(c, T, D);
  TileSums s;
  if (c.type == KvType::f32) {
    for (std::size_t i = 0; i < l.code_bytes / 4; ++i) {
      float f;
      std::memcpy(&f, tile + 4 * i, 4);
      s.values += f;
    }
  } else if (c.type == KvType::f16) {
    for (std::size_t i = 0; i < l.code_bytes / 2; ++i) {
      std::uint16_t h;
      std::memcpy(&h, tile + 2 * i, 2);
      s.values += fp16_to_fp32(h);
    }
  } else {
    for (std::size_t i = 0; i < l.code_bytes; ++i) s.codes += static_cast<std::uint8_t>(tile[i]);
    if (l.byte_params) {  // the grid (f32 min_lo, f32 min_step, i16 exponent), then byte scales and mins
      float lo, step;
      std::int16_t e;
      std::memcpy(&lo, tile + l.param_offset, 4);
      std::memcpy(&step, tile + l.param_offset + 4, 4);
      std::memcpy(&e, tile + l.param_offset + 8, 2);
      const std::byte* bytes = tile + l.param_offset + 12;
      for (std::size_t i = 0; i < l.n_params; ++i) {
        s.scales += static_cast<double>(static_cast<std::uint8_t>(bytes[i])) * 0x1p-16 + e;
        s.mins += static_cast<double>(lo) + static_cast<double>(step) * static_cast<std::uint8_t>(bytes[l.param_stride + i]);
      }
      return s;
    }
    for (std::size_t i = 0; i < l.n_params; ++i) {
      std::uint16_t h;
      std::memcpy(&h, tile + l.param_offset + 2 * i, 2);
      s.scales += fp16_to_fp32(h);
      std::memcpy(&h, tile + l.param_offset + 2 * (l.param_stride + i), 2);
      s.mins += fp16_to_fp32(h);
    }
  }
  return s;
}

int run(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "%s: cannot open\n", path);
    return 2;
  }
  const std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const ContextReader reader(bytes, path);
  const ContextMeta& m = reader.meta();
  const KvShape& s = m.shape;
  const int T = m.block_tokens;
  std::printf("format %s shape %d/%d/%d/%d block %d tokens %zu segments %zu blocks %zu\n", m.format.to_string().c_str(),
              s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim, T, m.tokens.size(), m.segments.size(),
              m.blocks.size());
  std::int64_t token_sum = 0;
  for (std::int32_t t : m.tokens) token_sum += t;
  std::printf("token sum %" PRId64 " first %d last %d text %zu bytes\n", token_sum, m.tokens.front(), m.tokens.back(),
              m.text.size());
  // Native tiles of every block, kept for the re-encoding.
  std::vector<std::vector<std::byte>> native(m.blocks.size());
  std::vector<std::uint8_t> plain;
  for (std::size_t b = 0; b < m.blocks.size(); ++b) {
    const ContextBlock& blk = m.blocks[b];
    plain.resize(reader.plain_bytes(b));
    reader.read_block(b, plain, nullptr);
    native[b].resize(plain.size());
    TileSums total;
    for (int kind = 0; kind < 2; ++kind) {
      const KvCodec& c = kind == 0 ? blk.k : blk.v;
      for (int l = 0; l < s.n_layers; ++l)
        for (int h = 0; h < s.n_kv_heads && s.stored_index(l, (blk.flags & 16u) != 0) >= 0; ++h) {
          const std::size_t off = tile_offset(s, T, blk.k, blk.v, kind, l, h, blk.flags);
          tile_from_canonical(c, T, s.head_dim, plain.data() + off, native[b].data() + off);
          const TileSums t = sums_of(c, T, s.head_dim, native[b].data() + off);
          total.values += t.values;
          total.scales += t.scales;
          total.mins += t.mins;
          total.codes += t.codes;
        }
    }
    std::printf("block %zu codecs %08x/%08x flags %u key position %d fill %u values %a scales %a mins %a codes %" PRIu64 "\n",
                b, blk.k.pack(), blk.v.pack(), blk.flags, blk.key_position, blk.fill, total.values, total.scales, total.mins,
                total.codes);
  }
  const BlockSource source = [&](std::size_t b, std::span<std::uint8_t> out) {
    const ContextBlock& blk = m.blocks[b];
    for (int kind = 0; kind < 2; ++kind)
      for (int l = 0; l < s.n_layers; ++l)
        for (int h = 0; h < s.n_kv_heads && s.stored_index(l, (blk.flags & 16u) != 0) >= 0; ++h) {
          const std::size_t off = tile_offset(s, T, blk.k, blk.v, kind, l, h, blk.flags);
          tile_to_canonical(kind == 0 ? blk.k : blk.v, T, s.head_dim, static_cast<int>(blk.fill),
                            native[b].data() + off, out.data() + off);
        }
  };
  const std::vector<std::uint8_t> again = encode_context(m, source);
  const unsigned version = bytes[8] | (bytes[9] << 8), written = again[8] | (again[9] << 8);
  bool same = again == bytes;
  if (version != written) {
    // An older file re-encodes in the current version: the same tokens, text and blocks (checksums).
    const ContextReader upgraded(again, "re-encoded");
    const ContextMeta& u = upgraded.meta();
    same = u.tokens == m.tokens && u.text == m.text && u.blocks.size() == m.blocks.size();
    for (std::size_t b = 0; same && b < m.blocks.size(); ++b)
      same = u.blocks[b].checksum == m.blocks[b].checksum && u.blocks[b].fill == m.blocks[b].fill &&
             u.blocks[b].flags == m.blocks[b].flags && u.blocks[b].key_position == m.blocks[b].key_position;
  }
  std::printf("version %u, re-encoded %zu bytes (version %u): %s\n", version, again.size(), written,
              same ? "identical" : "DIFFERENT");
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: context_dump FILE.qkvctx\n");
    return 2;
  }
  try {
    return run(argv[1]);
  } catch (const Error& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
}
