// The descriptor's byte layout, its validation and the capability MAC.
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "qkvshare/core/error.hpp"
#include "qkvshare/share/descriptor.hpp"
#include "qkvshare/share/hmac_sha256.hpp"
#include "test_paths.hpp"

namespace qkvshare {
namespace {

Descriptor sample() {
  Descriptor d;
  d.pool_id = 0x1122334455667788ull;
  d.context_id = 42;
  d.record_slot = 3;
  d.record_generation = 7;
  d.grant_slot = 9;
  d.grant_generation = 2;
  d.token_count = 100;
  d.position_begin = 0;
  d.position_end = 100;
  d.block_tokens = 32;
  d.block_count = 4;
  d.set_format(KvFormat::parse("k8v4:window=64"));
  d.fingerprint.model[0] = 0xab;
  d.fingerprint.tokenizer = 0x55;
  d.blocks_checksum = 1;
  d.table_checksum = 2;
  d.tokens_checksum = 3;
  d.created_unix_ns = 123456789;
  d.producer = "researcher";
  d.grantee = "writer-2";
  d.capability[0] = 0x77;
  return d;
}

// Sets the self checksum of edited bytes, so that the deeper checks run.
void reseal(DescriptorBytes& b) {
  const std::uint64_t sum = XXH3_64bits(b.data(), 248);
  for (int i = 0; i < 8; ++i) b[248 + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(sum >> (8 * i));
}

std::string rejection(std::span<const std::uint8_t> bytes) {
  try {
    Descriptor::decode(bytes, "d.desc");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::bad_descriptor) << e.what();
    return e.what();
  }
  return "accepted";
}

TEST(Descriptor, RoundTripsEveryField) {
  const Descriptor d = sample();
  const DescriptorBytes b = d.encode();
  const Descriptor e = Descriptor::decode(b);
  EXPECT_EQ(e.encode(), b);
  EXPECT_EQ(e.pool_id, d.pool_id);
  EXPECT_EQ(e.grantee, "writer-2");
  EXPECT_EQ(e.format()->to_string(), KvFormat::parse("k8v4:window=64").to_string());
  EXPECT_EQ(e.capability, d.capability);
}

TEST(Descriptor, RoundTripsAMixedPrecisionFormat) {
  Descriptor d = sample();
  const KvFormat f = KvFormat::parse("int8:sink=32:lo=k4v2:top=0.2");
  d.set_format(f);
  const DescriptorBytes b = d.encode();
  EXPECT_EQ(b[232] | b[233] << 8 | b[234] << 16, 200000);  // the share in millionths, little-endian
  const Descriptor e = Descriptor::decode(b);
  ASSERT_TRUE(e.format().has_value());
  EXPECT_EQ(*e.format(), f);
  EXPECT_EQ(nlohmann::json::parse(e.json())["mixed"]["top"], 0.2);
}

TEST(Descriptor, LayoutIsFixedLittleEndian) {
  const DescriptorBytes b = sample().encode();
  EXPECT_EQ(0, std::memcmp(b.data(), "QKVDESC\0", 8));
  EXPECT_EQ(b[8], 1);  // version
  EXPECT_EQ(b[10], 0);  // size 256 = 0x0100
  EXPECT_EQ(b[11], 1);
  EXPECT_EQ(b[16], 0x88);  // pool id, low byte first
  EXPECT_EQ(b[23], 0x11);
  EXPECT_EQ(b[24], 42);    // context id
  EXPECT_EQ(b[48], 100);   // token count
  EXPECT_EQ(b[88], 0xab);  // model fingerprint
  EXPECT_EQ(0, std::memcmp(&b[144], "researcher", 10));
  EXPECT_EQ(0, std::memcmp(&b[176], "writer-2", 8));
  EXPECT_EQ(b[208], 0x77);  // capability
}

TEST(Descriptor, JsonViewNamesTheFields) {
  const auto j = nlohmann::json::parse(sample().json());
  EXPECT_EQ(j["context_id"], 42);
  EXPECT_EQ(j["grantee"], "writer-2");
  EXPECT_EQ(j["kv_format"], KvFormat::parse("k8v4:window=64").to_string());
  EXPECT_EQ(j["positions"][1], 100);
  EXPECT_EQ(j["record"]["generation"], 7);
}

TEST(Descriptor, RejectsTruncatedLongAndForeignInput) {
  const DescriptorBytes b = sample().encode();
  for (std::size_t n : {0, 1, 8, 100, 255})
    EXPECT_NE(rejection(std::span(b.data(), n)).find("truncated"), std::string::npos);
  std::vector<std::uint8_t> longer(b.begin(), b.end());
  longer.push_back(0);
  EXPECT_NE(rejection(longer).find("exactly 256"), std::string::npos);
  DescriptorBytes m = b;
  m[0] = 'X';
  EXPECT_NE(rejection(m).find("bad magic"), std::string::npos);
  m = b;
  m[8] = 2;
  EXPECT_NE(rejection(m).find("version 2"), std::string::npos);
}

TEST(Descriptor, SelfChecksumCatchesAnyEdit) {
  const DescriptorBytes b = sample().encode();
  for (std::size_t i = 12; i < 248; i += 7) {
    DescriptorBytes m = b;
    m[i] ^= 0x10;
    EXPECT_NE(rejection(m).find("self checksum"), std::string::npos) << i;
  }
}

TEST(Descriptor, RejectsInconsistentFieldsEvenWithAValidChecksum) {
  const DescriptorBytes b = sample().encode();
  const auto edit = [&](std::size_t at, std::uint8_t value) {
    DescriptorBytes m = b;
    m[at] = value;
    reseal(m);
    return rejection(m);
  };
  EXPECT_NE(edit(48, 0).find("token count"), std::string::npos);          // tokens 0 (with a 100-token range)
  EXPECT_NE(edit(56, 99).find("position range"), std::string::npos);     // end != begin + tokens
  EXPECT_NE(edit(60, 33).find("power of two"), std::string::npos);        // block size
  EXPECT_NE(edit(64, 3).find("blocks cannot hold"), std::string::npos);   // too few blocks
  EXPECT_NE(edit(65, 1).find("blocks cannot hold"), std::string::npos);   // 260: more than 64 segments could use
  EXPECT_NE(edit(12, 1).find("flags"), std::string::npos);
  EXPECT_NE(edit(244, 1).find("reserved"), std::string::npos);  // 236..243: the codebook id
  EXPECT_NE(edit(230, 1).find("mixed-precision"), std::string::npos);  // low codecs without a share
  EXPECT_NE(edit(235, 1).find("mixed-precision"), std::string::npos);  // a share above 999999 millionths
  DescriptorBytes m = b;
  std::memset(&m[144], 0, 32);
  reseal(m);
  EXPECT_NE(rejection(m).find("producer id is empty"), std::string::npos);
  EXPECT_NE(edit(176, ' ').find("grantee id has a character"), std::string::npos);
  EXPECT_NE(edit(185, 'x').find("NUL-padded"), std::string::npos);
}

TEST(Descriptor, RoundTripsAColdTailAndRefusesImpossibleFlags) {
  Descriptor d = sample();
  const KvFormat f = KvFormat::parse("int4:keys=block:tail=cold");
  d.set_format(f);
  EXPECT_EQ(d.format_flags, 8u | 16u);
  ASSERT_TRUE(Descriptor::decode(d.encode()).format().has_value());
  EXPECT_EQ(*Descriptor::decode(d.encode()).format(), f);
  for (const std::uint32_t flags : {32u, 12u, 16u | 12u}) {  // an unknown bit; KeyRope 3
    d.format_flags = flags;
    EXPECT_FALSE(Descriptor::decode(d.encode()).format().has_value()) << flags;
  }
  d.set_format(KvFormat::parse("f16"));
  d.format_flags = 16u;  // tail=cold on a format without codes
  EXPECT_FALSE(Descriptor::decode(d.encode()).format().has_value());
}

TEST(Descriptor, UnknownCodecsDecodeButHaveNoFormat) {
  Descriptor d = sample();
  d.k_codec = 0xdeadbeef;
  const Descriptor e = Descriptor::decode(d.encode());
  EXPECT_FALSE(e.format().has_value());
  EXPECT_TRUE(nlohmann::json::parse(e.json())["kv_format"].is_null());
}

TEST(Descriptor, AgentIds) {
  EXPECT_NO_THROW(validate_agent_id("a.b-c_d:e@f9", "x"));
  EXPECT_THROW(validate_agent_id("", "x"), Error);
  EXPECT_THROW(validate_agent_id("has space", "x"), Error);
  EXPECT_THROW(validate_agent_id(std::string(33, 'a'), "x"), Error);
}

TEST(Descriptor, FilesRoundTripAndErrorsNameThePath) {
  const std::string dir = testing::temp_dir();
  const Descriptor d = sample();
  write_descriptor_file(dir + "/a.desc", d);
  EXPECT_EQ(read_descriptor_file(dir + "/a.desc").encode(), d.encode());
  try {
    read_descriptor_file(dir + "/missing.desc");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io);
    EXPECT_NE(std::string(e.what()).find("missing.desc"), std::string::npos);
  }
}

std::string hex(std::span<const std::uint8_t> b) {
  std::string s;
  for (auto x : b) s += fmt::format("{:02x}", x);
  return s;
}

TEST(HmacSha256, MatchesPublishedVectors) {
  const std::string abc = "abc";
  EXPECT_EQ(hex(share_detail::sha256(std::span(reinterpret_cast<const std::uint8_t*>(abc.data()), abc.size()))),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // RFC 4231 test cases 1 and 2.
  const std::vector<std::uint8_t> key1(20, 0x0b);
  const std::string msg1 = "Hi There";
  EXPECT_EQ(hex(share_detail::hmac_sha256(key1, std::span(reinterpret_cast<const std::uint8_t*>(msg1.data()), msg1.size()))),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  const std::string key2 = "Jefe", msg2 = "what do ya want for nothing?";
  EXPECT_EQ(hex(share_detail::hmac_sha256(std::span(reinterpret_cast<const std::uint8_t*>(key2.data()), key2.size()),
                                          std::span(reinterpret_cast<const std::uint8_t*>(msg2.data()), msg2.size()))),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // RFC 4231 test case 6: a key longer than the block is hashed first.
  const std::vector<std::uint8_t> key6(131, 0xaa);
  const std::string msg6 = "Test Using Larger Than Block-Size Key - Hash Key First";
  EXPECT_EQ(hex(share_detail::hmac_sha256(key6, std::span(reinterpret_cast<const std::uint8_t*>(msg6.data()), msg6.size()))),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

}  // namespace
}  // namespace qkvshare
