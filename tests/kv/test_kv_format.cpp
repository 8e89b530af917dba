#include <gtest/gtest.h>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/kv_format.hpp"

namespace qkvshare {
namespace {

TEST(KvFormat, NamedFormatsParseToKiviDefaults) {
  const KvFormat f = KvFormat::parse("int4");
  EXPECT_EQ(f.k.type, KvType::q4);
  EXPECT_EQ(f.k.axis, KvAxis::channel);
  EXPECT_EQ(f.v.type, KvType::q4);
  EXPECT_EQ(f.v.axis, KvAxis::token);
  EXPECT_EQ(f.v.group, 32);
  const KvFormat e = KvFormat::parse("int8");
  EXPECT_EQ(e.v.group, 0);  // per token per head
  const KvFormat m = KvFormat::parse("k8v2:window=64:sink=4:rot=k");
  EXPECT_EQ(m.k.type, KvType::q8);
  EXPECT_EQ(m.v.type, KvType::q2);
  EXPECT_EQ(m.window, 64);
  EXPECT_EQ(m.sink, 4);
  EXPECT_TRUE(m.rotate_k);
  EXPECT_FALSE(m.rotate_v);
  EXPECT_EQ(KvFormat::parse("f32").k, KvCodec::f32());
  EXPECT_EQ(KvFormat::parse("k16v4").k, KvCodec::f16());
}

TEST(KvFormat, ToStringRoundTrips) {
  for (const char* text : {"f32", "f16", "int8", "int4", "int3", "int2", "k8v4", "k16v2", "k32v16",
                           "int8:kaxis=token", "int4:kaxis=token:kgroup=32", "int2:window=128:sink=32",
                           "int4:vgroup=64", "int3:rot=kv", "k4v2:window=32:rot=v", "int8:lo=int2:top=0.2",
                           "k8v4:window=64:sink=32:lo=k4v2:top=0.35", "f16:budget=0.5",
                           "int8:window=128:sink=32:lo=int2:top=0.2:budget=0.6", "f16:budget=0.5:rank=recent",
                           "int4:budget=0.25:positions=close", "int4:keys=pre", "k8v4:rot=v:keys=pre:lo=int2:top=0.5", "int2:window=64:keys=block",
                           "int2:vgroup=64:outliers=0.01", "k8v4:lo=int2:top=0.2:outliers=0.005", "k16v3:outliers=0.127",
                           "int4:vgroup=64:params=8", "int3:vgroup=64:koutliers=0.02:params=8", "k8v4:lo=int2:top=0.2:params=8"}) {
    const KvFormat f = KvFormat::parse(text);
    EXPECT_EQ(f.to_string(), text);
    EXPECT_EQ(KvFormat::parse(f.to_string()), f) << text;
  }
}

TEST(KvFormat, BadTextNamesThePart) {
  const auto message = [](const char* text) {
    try {
      KvFormat::parse(text);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      return std::string(e.what());
    }
    ADD_FAILURE() << "accepted " << text;
    return std::string();
  };
  EXPECT_NE(message("int5").find("'int5'"), std::string::npos);
  EXPECT_NE(message("q4").find("unknown name"), std::string::npos);
  EXPECT_NE(message("k9v4").find("bits"), std::string::npos);
  EXPECT_NE(message("int4:window").find("key=value"), std::string::npos);
  EXPECT_NE(message("int4:window=-3").find("window"), std::string::npos);
  EXPECT_NE(message("int4:foo=1").find("unknown option"), std::string::npos);
  EXPECT_EQ(message("int4:window=4:window=8"), "KV format 'int4:window=4:window=8': option 'window' is given twice");
  EXPECT_NE(message("int4:keys=pre:keys=post").find("option 'keys' is given twice"), std::string::npos);
  EXPECT_NE(message("int4:rot=x").find("rot"), std::string::npos);
  EXPECT_NE(message("f16:kaxis=token").find("kaxis"), std::string::npos);
  EXPECT_NE(message("int4:vgroup=12").find("vgroup"), std::string::npos);
  EXPECT_NE(message("").find("unknown name"), std::string::npos);
  EXPECT_NE(message("int8:lo=int2").find("both lo=NAME and top=F"), std::string::npos);
  EXPECT_NE(message("int8:top=0.2").find("both lo=NAME and top=F"), std::string::npos);
  EXPECT_NE(message("int8:lo=f16:top=0.2").find("lo must name an integer or pq format"), std::string::npos);
  EXPECT_NE(message("int8:lo=int5:top=0.2").find("lo must name"), std::string::npos);
  EXPECT_NE(message("int8:lo=int2:top=1.5").find("top must be a share"), std::string::npos);
  EXPECT_NE(message("int8:lo=int2:top=0.2x").find("top must be a share"), std::string::npos);
  EXPECT_NE(message("f16:lo=int2:top=0.2").find("integer high-precision"), std::string::npos);
  EXPECT_NE(message("mixed:lo=int2:top=0.2").find("hi=NAME first"), std::string::npos);
  EXPECT_NE(message("int8:budget=1").find("budget must be a share"), std::string::npos);
  EXPECT_NE(message("int8:budget=0").find("budget must be a share"), std::string::npos);
  EXPECT_NE(message("int8:budget=half").find("budget must be a share"), std::string::npos);
  EXPECT_NE(message("int8:rank=recent").find("rank applies to"), std::string::npos);
  EXPECT_NE(message("int8:positions=close").find("positions applies to"), std::string::npos);
  EXPECT_NE(message("int8:budget=0.5:positions=shift").find("positions must be keep or close"), std::string::npos);
  EXPECT_NE(message("int4:keys=rope").find("keys must be post, pre or block"), std::string::npos);
  EXPECT_NE(message("int4:keys=block:rot=k").find("keys=block does not combine with rotated keys"), std::string::npos);
  EXPECT_NE(message("int4:keys=pre:rot=kv").find("keys=pre does not combine with rotated keys"), std::string::npos);
  EXPECT_NE(message("int8:budget=0.5:rank=oldest").find("rank must be attention or recent"), std::string::npos);
  EXPECT_NE(message("int4:params=4").find("params must be 8 (one-byte scales and mins) or 16"), std::string::npos);
  EXPECT_NE(message("f16:params=8").find("params=8 needs integer codes"), std::string::npos);
}

// Mixed precision: `mixed:hi=` names the same format; its bytes lie between
// those of its two precisions, with the top share of cold blocks kept high.
TEST(KvFormat, MixedPrecisionFormats) {
  const KvFormat m = KvFormat::parse("mixed:hi=int8:lo=int2:top=0.25:vgroup=16");
  EXPECT_EQ(m, KvFormat::parse("int8:vgroup=16:lo=int2:top=0.25"));
  EXPECT_TRUE(m.mixed());
  EXPECT_EQ(m.k, KvFormat::parse("int8").k);
  EXPECT_EQ(m.lo_k, KvFormat::parse("int2").k);
  EXPECT_EQ(m.lo_v.group, 16);  // vgroup applies to both precisions
  EXPECT_EQ(m.kept_blocks(8), 2);
  EXPECT_EQ(m.kept_blocks(9), 3);
  EXPECT_EQ(m.kept_blocks(0), 0);
  EXPECT_FALSE(KvFormat::parse("int8").mixed());
  EXPECT_EQ(KvFormat::parse("int8").kept_blocks(7), 7);
  const KvShape s{4, 8, 2, 64};
  const std::size_t hi = KvFormat::parse("int8:vgroup=16").context_bytes(s, 32, 1024);
  const std::size_t lo = KvFormat::parse("int2:vgroup=16").context_bytes(s, 32, 1024);
  const std::size_t mixed = m.context_bytes(s, 32, 1024);
  EXPECT_GT(mixed, lo);
  EXPECT_LT(mixed, hi);
  // 32 cold blocks: 8 at 8 bits, 24 at 2 bits.
  EXPECT_EQ(mixed, (hi / 32) * 8 + (lo / 32) * 24);
  // Dropping is a policy of its own: it observes queries, needs no second precision.
  const KvFormat e = KvFormat::parse("int4:budget=0.5");
  EXPECT_TRUE(e.evicts());
  EXPECT_TRUE(e.observes());
  EXPECT_FALSE(e.mixed());
  EXPECT_TRUE(m.observes());
  EXPECT_FALSE(m.evicts());
  EXPECT_FALSE(KvFormat::parse("int4").observes());
}

TEST(KvFormat, CodecPacksAndRejectsGarbage) {
  const KvCodec c{KvType::q3, KvAxis::token, 32};
  EXPECT_EQ(KvCodec::unpack(c.pack()), c);
  EXPECT_THROW(KvCodec::unpack(0x99), Error);
  EXPECT_THROW(KvCodec::unpack(0x0100), Error);  // f32 with a channel axis
  const KvCodec b{KvType::q2, KvAxis::channel, 0, 3, true};
  EXPECT_EQ(KvCodec::unpack(b.pack()), b);
  EXPECT_EQ(b.pack() & 0xffu, 0x85u);  // the type byte's top bit
  EXPECT_THROW(KvCodec::unpack(0x81), Error);  // f16 with byte parameters
  EXPECT_EQ(KvFormat::parse("k8v4:lo=int2:top=0.2:params=8").lo_v.byte_params, true);
  EXPECT_EQ(KvFormat::parse("k16v4:params=8").k.byte_params, false);  // f16 keys have no parameters
}

TEST(KvFormat, TileBytesAndBitsPerElement) {
  // SmolLM2: head_dim 64, 32-token blocks.
  const TileLayout f16 = tile_layout(KvCodec::f16(), 32, 64);
  EXPECT_EQ(f16.bytes, 32u * 64u * 2u);
  const TileLayout k4 = tile_layout(KvFormat::parse("int4").k, 32, 64);
  EXPECT_EQ(k4.code_bytes, 32u * 32u);
  EXPECT_EQ(k4.param_bytes, 64u * 4u);  // one (scale, min) f16 pair per channel
  const TileLayout v4 = tile_layout(KvFormat::parse("int4").v, 32, 64);
  EXPECT_EQ(v4.param_bytes, 32u * 2u * 4u);  // two groups of 32 channels per token
  EXPECT_DOUBLE_EQ(KvFormat::parse("f16").cold_bits(32, 64), 16.0);
  EXPECT_DOUBLE_EQ(KvFormat::parse("int4").cold_bits(32, 64), 5.0);  // 4 + (0.5 + 1.0 + 0.5... averaged)
  EXPECT_DOUBLE_EQ(KvFormat::parse("int8").cold_bits(32, 64), (9.0 + 8.5) / 2);
  EXPECT_THROW(tile_layout(KvCodec::f16(), 32, 12), Error);  // head_dim must be a multiple of 8
  // Byte parameters: a 12-byte grid, then one byte per scale and per min.
  const TileLayout kb = tile_layout(KvFormat::parse("int4:params=8").k, 32, 64);
  EXPECT_EQ(kb.param_bytes, 12u + 64u * 2u);
  const TileLayout vb = tile_layout(KvFormat::parse("int4:vgroup=64:params=8").v, 32, 64);
  EXPECT_EQ(vb.param_bytes, 12u + 32u * 2u);
  EXPECT_EQ(vb.outlier_offset % 4, 0u);
  EXPECT_DOUBLE_EQ(KvFormat::parse("int4:vgroup=64:params=8").cold_bits(32, 64), 4.0 + (140.0 + 76.0) * 8 / (2 * 2048));
}

TEST(KvFormat, HotBlocks) {
  const KvFormat f = KvFormat::parse("int2:window=40:sink=4");
  // 200 tokens in 32-token blocks: 0..5 full, 6 partly filled.
  EXPECT_TRUE(f.block_is_hot(0, 200, 32));   // sink
  EXPECT_FALSE(f.block_is_hot(1, 200, 32));
  EXPECT_FALSE(f.block_is_hot(3, 200, 32));
  EXPECT_FALSE(f.block_is_hot(4, 200, 32));  // tokens 128..159
  EXPECT_TRUE(f.block_is_hot(5, 200, 32));   // 160..191: within the last 40 (160..199)
  EXPECT_TRUE(f.block_is_hot(6, 200, 32));   // tail
  const KvFormat plain = KvFormat::parse("int4");
  EXPECT_FALSE(plain.block_is_hot(0, 64, 32));
  EXPECT_FALSE(plain.block_is_hot(1, 64, 32));
  EXPECT_TRUE(plain.block_is_hot(2, 65, 32));
}

}  // namespace
}  // namespace qkvshare
