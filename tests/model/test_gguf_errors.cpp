// Each malformed-input case the GGUF reader must reject: a well-formed file
// from GgufWriter with one field forged, checked for ErrorCode::bad_model_file
// and a message "<path>: <item>: <reason>" naming the broken item.
#include <gtest/gtest.h>

#include <limits>

#include "test_gguf_util.hpp"

namespace qkvshare {
namespace {

using testing::expect_bad_file;
using testing::kv_of;
using testing::layout_of;
using testing::load_le;
using testing::sample_writer;
using testing::store_le;
using testing::tensor_of;

constexpr std::uint64_t kMaxU64 = std::numeric_limits<std::uint64_t>::max();

struct Sample {
  std::vector<std::uint8_t> bytes = sample_writer().to_bytes();
  testing::GgufLayout layout = layout_of(bytes);
};

TEST(GgufBadFile, WrongMagic) {
  Sample s;
  s.bytes[3] = 'X';
  expect_bad_file(s.bytes, "header", "not a GGUF file (magic bytes 47 47 55 58");
}

TEST(GgufBadFile, EmptyAndTinyFiles) {
  expect_bad_file({}, "header", "truncated: magic needs 4 bytes at offset 0");
  expect_bad_file({'G', 'G', 'U', 'F', 3, 0}, "header", "truncated: version");
}

TEST(GgufBadFile, UnsupportedVersion) {
  for (const std::uint32_t v : {0u, 1u, 4u, 0x7fffffffu}) {
    Sample s;
    store_le<std::uint32_t>(s.bytes, 4, v);
    expect_bad_file(s.bytes, "header", fmt::format("unsupported GGUF version {} (supported: 2, 3)", v));
  }
  Sample s;
  store_le<std::uint32_t>(s.bytes, 4, 0x03000000u);
  expect_bad_file(s.bytes, "header", "big-endian");
}

// Cutting the file anywhere before the end of the last tensor's data fails
// with a truncation message; only the trailing padding may go.
TEST(GgufBadFile, TruncatedAnywhere) {
  const Sample s;
  const auto f = [&] {
    const std::string path = testing::gguf_temp_path("full.gguf");
    testing::write_bytes(path, s.bytes);
    return GgufFile::open(path);
  }();
  const auto& last = f->tensors().back();
  const auto needed = static_cast<std::size_t>(last.data - f->file().data()) + last.nbytes;
  ASSERT_LE(needed, s.bytes.size());
  for (std::size_t len = 0; len < needed; ++len) {
    SCOPED_TRACE(len);
    const std::vector<std::uint8_t> cut(s.bytes.begin(), s.bytes.begin() + static_cast<std::ptrdiff_t>(len));
    const std::string path = testing::gguf_temp_path("cut.gguf");
    testing::write_bytes(path, cut);
    try {
      GgufFile::open(path);
      ADD_FAILURE() << "accepted a file cut to " << len << " bytes";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(e.code(), ErrorCode::bad_model_file);
      EXPECT_EQ(msg.rfind(path + ": ", 0), 0u) << msg;
      const bool names_cause = msg.find("truncated") != std::string::npos ||
                               msg.find("past the end of the file") != std::string::npos ||
                               msg.find("extends past end of file") != std::string::npos ||
                               msg.find("cannot fit") != std::string::npos;
      EXPECT_TRUE(names_cause) << msg;
    }
  }
  for (std::size_t len = needed; len <= s.bytes.size(); ++len) {
    const std::string path = testing::gguf_temp_path("cut.gguf");
    testing::write_bytes(path, {s.bytes.begin(), s.bytes.begin() + static_cast<std::ptrdiff_t>(len)});
    EXPECT_NO_THROW(GgufFile::open(path)) << len;
  }
}

TEST(GgufBadFile, AbsurdTensorCount) {
  Sample s;
  store_le<std::uint64_t>(s.bytes, 8, kMaxU64);
  expect_bad_file(s.bytes, "header", "tensor count 18446744073709551615 with metadata count 9 cannot fit");
  store_le<std::uint64_t>(s.bytes, 8, 1ull << 40);
  expect_bad_file(s.bytes, "header", "tensor count 1099511627776");
}

TEST(GgufBadFile, AbsurdMetadataCount) {
  Sample s;
  store_le<std::uint64_t>(s.bytes, 16, kMaxU64 / 2);
  expect_bad_file(s.bytes, "header", "metadata count 9223372036854775807 cannot fit in the");
}

TEST(GgufBadFile, KeyLongerThanFile) {
  Sample s;
  store_le<std::uint64_t>(s.bytes, s.layout.kvs[1].key_len, 1ull << 40);
  expect_bad_file(s.bytes, "metadata entry #1", "truncated: key needs 1099511627776 bytes");
}

TEST(GgufBadFile, StringValueLongerThanFile) {
  Sample s;
  const auto& kv = kv_of(s.layout, "general.architecture");
  store_le<std::uint64_t>(s.bytes, kv.lengths[0], kMaxU64);
  expect_bad_file(s.bytes, "key 'general.architecture'",
                  "truncated: string value needs 18446744073709551615");
}

TEST(GgufBadFile, StringArrayElementLongerThanFile) {
  Sample s;
  const auto& kv = kv_of(s.layout, "tokenizer.ggml.tokens");
  store_le<std::uint64_t>(s.bytes, kv.lengths[2], 1ull << 33);
  expect_bad_file(s.bytes, "key 'tokenizer.ggml.tokens'", "truncated: string element needs 8589934592 bytes");
}

TEST(GgufBadFile, ArrayCountTooLarge) {
  for (const char* key : {"tokenizer.ggml.tokens", "tokenizer.ggml.scores"}) {
    Sample s;
    store_le<std::uint64_t>(s.bytes, kv_of(s.layout, key).count, kMaxU64 / 3);
    expect_bad_file(s.bytes, fmt::format("key '{}'", key), "array of 6148914691236517205");
  }
}

TEST(GgufBadFile, DuplicateKey) {
  Sample s;
  // "test.i32" -> "test.u64", which comes later.
  const auto& kv = kv_of(s.layout, "test.i32");
  std::memcpy(s.bytes.data() + kv.key_len + 8, "test.u64", 8);
  expect_bad_file(s.bytes, "key 'test.u64'", "duplicate key");
}

TEST(GgufBadFile, EmptyKey) {
  Sample s;
  store_le<std::uint64_t>(s.bytes, s.layout.kvs[2].key_len, 0);
  expect_bad_file(s.bytes, "metadata entry #2", "empty key");
}

TEST(GgufBadFile, UnknownValueType) {
  Sample s;
  store_le<std::uint32_t>(s.bytes, kv_of(s.layout, "test.i32").type, 13);
  expect_bad_file(s.bytes, "key 'test.i32'", "unknown value type 13");
}

TEST(GgufBadFile, ArrayOfArrays) {
  Sample s;
  store_le<std::uint32_t>(s.bytes, kv_of(s.layout, "tokenizer.ggml.scores").elem_type, 9);
  expect_bad_file(s.bytes, "key 'tokenizer.ggml.scores'", "arrays of arrays are not supported");
}

TEST(GgufBadFile, UnknownArrayElementType) {
  Sample s;
  store_le<std::uint32_t>(s.bytes, kv_of(s.layout, "tokenizer.ggml.scores").elem_type, 4000);
  expect_bad_file(s.bytes, "key 'tokenizer.ggml.scores'", "unknown array element type 4000");
}

TEST(GgufBadFile, BoolNotZeroOrOne) {
  Sample s;
  s.bytes[kv_of(s.layout, "test.bool").value] = 2;
  expect_bad_file(s.bytes, "key 'test.bool'", "is 2 (must be 0 or 1)");
}

TEST(GgufBadFile, KeyWithControlBytesIsEscaped) {
  Sample s;
  const auto& kv = kv_of(s.layout, "test.i32");
  s.bytes[kv.key_len + 8] = '\n';
  store_le<std::uint32_t>(s.bytes, kv.type, 99);
  expect_bad_file(s.bytes, "key '\\x0aest.i32'", "unknown value type 99");
}

TEST(GgufBadFile, BadAlignment) {
  for (const std::uint32_t a : {0u, 3u, 48u}) {
    GgufWriter w = sample_writer();
    w.set_u32("general.alignment", a);
    expect_bad_file(w.to_bytes(), "key 'general.alignment'",
                    fmt::format("alignment is {} (must be a non-zero power of two)", a));
  }
  GgufWriter negative = sample_writer();
  negative.set_i32("general.alignment", -64);
  expect_bad_file(negative.to_bytes(), "key 'general.alignment'", "alignment is -64");
  GgufWriter text = sample_writer();
  text.set_string("general.alignment", "32");
  expect_bad_file(text.to_bytes(), "key 'general.alignment'", "expected an integer, found string");
  GgufWriter list = sample_writer();
  list.set_i32_array("general.alignment", {32});
  expect_bad_file(list.to_bytes(), "key 'general.alignment'", "expected an integer, found array");
}

TEST(GgufBadFile, DuplicateTensorName) {
  Sample s;
  const auto& t = tensor_of(s.layout, "t.f16");
  std::memcpy(s.bytes.data() + t.name_len + 8, "t.f32", 5);
  expect_bad_file(s.bytes, "tensor 't.f32'", "duplicate tensor name");
}

TEST(GgufBadFile, EmptyTensorName) {
  Sample s;
  store_le<std::uint64_t>(s.bytes, s.layout.tensors[1].name_len, 0);
  expect_bad_file(s.bytes, "tensor #1", "empty tensor name");
}

TEST(GgufBadFile, TensorNameLongerThanFile) {
  Sample s;
  store_le<std::uint64_t>(s.bytes, s.layout.tensors[3].name_len, kMaxU64 - 3);
  expect_bad_file(s.bytes, "tensor #3", "truncated: name needs 18446744073709551612 bytes");
}

TEST(GgufBadFile, UnknownTensorType) {
  Sample s;
  store_le<std::uint32_t>(s.bytes, tensor_of(s.layout, "t.q8_0").type, 4);  // Q4_2, removed from ggml
  expect_bad_file(s.bytes, "tensor 't.q8_0'", "unknown tensor type 4");
  store_le<std::uint32_t>(s.bytes, tensor_of(s.layout, "t.q8_0").type, 0xdeadbeef);
  expect_bad_file(s.bytes, "tensor 't.q8_0'", "unknown tensor type 3735928559");
}

TEST(GgufBadFile, KnownButUnsupportedTensorTypeStillLoads) {
  GgufWriter w;
  w.add_tensor("k", GgmlType::Q8_K, {256, 2}, std::vector<std::uint8_t>(2 * 292));
  const std::string path = testing::gguf_temp_path("q8k.gguf");
  testing::write_bytes(path, w.to_bytes());
  const auto f = GgufFile::open(path);
  EXPECT_EQ(f->tensor("k").type, GgmlType::Q8_K);
  EXPECT_FALSE(is_supported_weight_type(f->tensor("k").type));
}

TEST(GgufBadFile, NDimsOutOfRange) {
  for (const std::uint32_t n : {0u, 5u, 0xffffffffu}) {
    Sample s;
    store_le<std::uint32_t>(s.bytes, tensor_of(s.layout, "t.f16").n_dims, n);
    expect_bad_file(s.bytes, "tensor 't.f16'", fmt::format("n_dims is {} (must be 1 to 4)", n));
  }
}

TEST(GgufBadFile, ZeroDimension) {
  Sample s;
  store_le<std::uint64_t>(s.bytes, tensor_of(s.layout, "t.f16").dims[2], 0);
  expect_bad_file(s.bytes, "tensor 't.f16'", "ne[2] is 0");
}

TEST(GgufBadFile, NegativeDimension) {
  Sample s;
  store_le<std::uint64_t>(s.bytes, tensor_of(s.layout, "t.f32").dims[1], kMaxU64);
  expect_bad_file(s.bytes, "tensor 't.f32'", "ne[1] is -1 (negative as int64)");
}

TEST(GgufBadFile, ElementCountOverflowsInt64) {
  Sample s;
  const auto& t = tensor_of(s.layout, "t.f32");
  store_le<std::uint64_t>(s.bytes, t.dims[0], 1ull << 32);
  store_le<std::uint64_t>(s.bytes, t.dims[1], 1ull << 31);
  expect_bad_file(s.bytes, "tensor 't.f32'", "element count overflows int64 (ne = [4294967296, 2147483648])");
}

TEST(GgufBadFile, ByteSizeOverflowsSizeT) {
  Sample s;
  const auto& t = tensor_of(s.layout, "t.f32");
  store_le<std::uint64_t>(s.bytes, t.dims[0], 1ull << 62);
  store_le<std::uint64_t>(s.bytes, t.dims[1], 1);
  expect_bad_file(s.bytes, "tensor 't.f32'", "byte size overflows size_t");
}

TEST(GgufBadFile, FirstDimensionNotMultipleOfBlockSize) {
  Sample s;
  store_le<std::uint64_t>(s.bytes, tensor_of(s.layout, "t.q4_1").dims[0], 48);
  expect_bad_file(s.bytes, "tensor 't.q4_1'", "ne[0] = 48 is not a multiple of the Q4_1 block size 32");
}

TEST(GgufBadFile, MisalignedOffset) {
  Sample s;
  const auto& t = tensor_of(s.layout, "t.q8_0");
  store_le<std::uint64_t>(s.bytes, t.offset, load_le<std::uint64_t>(s.bytes, t.offset) + 4);
  expect_bad_file(s.bytes, "tensor 't.q8_0'", "is not a multiple of the alignment 32");
}

TEST(GgufBadFile, TensorDataPastEndOfFile) {
  Sample s;
  const auto& t = tensor_of(s.layout, "t.q8_0");
  store_le<std::uint64_t>(s.bytes, t.offset, 1ull << 20);
  const std::size_t data_offset = (s.layout.infos_end + 31) / 32 * 32;
  expect_bad_file(s.bytes, "tensor 't.q8_0'",
                  fmt::format("data [offset {}, 68 bytes] extends past end of file ({} bytes)",
                              data_offset + (1u << 20), s.bytes.size()));
}

TEST(GgufBadFile, TensorOffsetOverflows) {
  Sample s;
  store_le<std::uint64_t>(s.bytes, tensor_of(s.layout, "t.f16").offset, kMaxU64 - 31);
  expect_bad_file(s.bytes, "tensor 't.f16'", "extends past end of file");
}

TEST(GgufBadFile, DataSectionPastEndOfFile) {
  // A large alignment puts the data section well past the tensor infos.
  auto bytes = sample_writer(4096).to_bytes();
  bytes.resize(layout_of(bytes).infos_end + 1);
  expect_bad_file(bytes, "data section", "starts at offset 4096, past the end of the file");
}

TEST(GgufBadFile, OverlappingTensors) {
  Sample s;
  const auto& a = tensor_of(s.layout, "t.f32");
  const auto& b = tensor_of(s.layout, "t.f16");
  store_le<std::uint64_t>(s.bytes, b.offset, load_le<std::uint64_t>(s.bytes, a.offset));
  expect_bad_file(s.bytes, "tensor 't.f16'", "overlaps tensor 't.f32'");
}

}  // namespace
}  // namespace qkvshare
