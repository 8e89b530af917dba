// GGUF writer -> reader round trips, the typed getters, the writer's own
// argument checks and the real SmolLM2 file. Malformed files are covered in
// test_gguf_errors.cpp and random mutations in test_gguf_mutation.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "test_gguf_util.hpp"

namespace qkvshare {
namespace {

using testing::gguf_temp_path;
using testing::layout_of;
using testing::pattern_bytes;
using testing::sample_writer;
using testing::write_bytes;

// Builds metadata-only files with value types GgufWriter has no setter for.
class RawGguf {
 public:
  RawGguf() {
    b_ = {'G', 'G', 'U', 'F'};
    put<std::uint32_t>(3);
    put<std::uint64_t>(0);  // tensors
    put<std::uint64_t>(0);  // kvs, patched by bytes()
  }
  template <typename T>
  void put(T v) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
    b_.insert(b_.end(), p, p + sizeof(T));
  }
  void str(const std::string& s) {
    put<std::uint64_t>(s.size());
    b_.insert(b_.end(), s.begin(), s.end());
  }
  void key(const std::string& k, GgufType t) {
    str(k);
    put<std::uint32_t>(static_cast<std::uint32_t>(t));
    ++n_kv_;
  }
  template <typename T>
  void scalar(const std::string& k, GgufType t, T v) {
    key(k, t);
    put<T>(v);
  }
  template <typename T>
  void array(const std::string& k, GgufType element, const std::vector<T>& values) {
    key(k, GgufType::array);
    put<std::uint32_t>(static_cast<std::uint32_t>(element));
    put<std::uint64_t>(values.size());
    for (const T& v : values) put<T>(v);
  }
  std::vector<std::uint8_t> bytes() {
    testing::store_le<std::uint64_t>(b_, 16, n_kv_);
    return b_;
  }

 private:
  std::vector<std::uint8_t> b_;
  std::uint64_t n_kv_ = 0;
};

std::unique_ptr<GgufFile> open_bytes(const std::vector<std::uint8_t>& bytes, const std::string& name) {
  const std::string path = gguf_temp_path(name);
  write_bytes(path, bytes);
  return GgufFile::open(path);
}

template <typename F>
void expect_error(F&& f, ErrorCode code, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning: " << fragment;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(GgufRoundTrip, WriterMetadataTypes) {
  const auto f = open_bytes(sample_writer().to_bytes(), "meta.gguf");
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->alignment(), 32u);
  EXPECT_FALSE(f->has("general.alignment"));
  EXPECT_EQ(f->get_string("general.architecture"), "llama");
  EXPECT_EQ(f->get_int("llama.block_count"), 2);
  EXPECT_EQ(f->find("llama.block_count")->type, GgufType::u32);
  EXPECT_EQ(f->get_int("test.i32"), -7);
  EXPECT_EQ(f->get_int("test.u64"), std::int64_t{1} << 40);
  EXPECT_EQ(f->get_float("test.f32"), 0.5);
  EXPECT_EQ(f->find_bool("test.bool"), true);
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.tokens"),
            (std::vector<std::string>{"<s>", "</s>", "a", "b"}));
  EXPECT_EQ(f->get_number_array("tokenizer.ggml.scores"), (std::vector<double>{0, -1, 2.5, 3}));
  EXPECT_EQ(f->get_number_array("tokenizer.ggml.token_type"), (std::vector<double>{3, 3, 1, 1}));
  EXPECT_EQ(f->find("tokenizer.ggml.token_type")->element_type, GgufType::i32);
  EXPECT_EQ(f->metadata().size(), 9u);
}

TEST(GgufRoundTrip, EveryValueTypeFromRawBytes) {
  RawGguf raw;
  raw.scalar<std::uint8_t>("v.u8", GgufType::u8, 200);
  raw.scalar<std::int8_t>("v.i8", GgufType::i8, -100);
  raw.scalar<std::uint16_t>("v.u16", GgufType::u16, 60000);
  raw.scalar<std::int16_t>("v.i16", GgufType::i16, -30000);
  raw.scalar<std::uint32_t>("v.u32", GgufType::u32, 4000000000u);
  raw.scalar<std::int32_t>("v.i32", GgufType::i32, -2000000000);
  raw.scalar<float>("v.f32", GgufType::f32, -1.25f);
  raw.scalar<std::uint8_t>("v.bool", GgufType::boolean, 0);
  raw.key("v.string", GgufType::string);
  raw.str("h\xc3\xa9llo");
  raw.scalar<std::uint64_t>("v.u64", GgufType::u64, ~std::uint64_t{0});
  raw.scalar<std::int64_t>("v.i64", GgufType::i64, std::numeric_limits<std::int64_t>::min());
  raw.scalar<double>("v.f64", GgufType::f64, 1e300);
  raw.array<std::uint8_t>("a.u8", GgufType::u8, {1, 255});
  raw.array<std::int8_t>("a.i8", GgufType::i8, {-1, 127});
  raw.array<std::uint16_t>("a.u16", GgufType::u16, {65535});
  raw.array<std::int16_t>("a.i16", GgufType::i16, {-32768});
  raw.array<std::uint32_t>("a.u32", GgufType::u32, {7, 8, 9});
  raw.array<std::uint8_t>("a.bool", GgufType::boolean, {1, 0, 1});
  raw.array<std::uint64_t>("a.u64", GgufType::u64, {1ull << 50});
  raw.array<std::int64_t>("a.i64", GgufType::i64, {-(1ll << 50)});
  raw.array<double>("a.f64", GgufType::f64, {0.125, -2});
  raw.array<std::uint32_t>("a.empty", GgufType::u32, {});
  raw.key("a.string", GgufType::array);
  raw.put<std::uint32_t>(8);
  raw.put<std::uint64_t>(3);
  for (const char* s : {"", "x", "yz"}) raw.str(s);
  const auto f = open_bytes(raw.bytes(), "types.gguf");

  EXPECT_EQ(f->get_int("v.u8"), 200);
  EXPECT_EQ(f->get_int("v.i8"), -100);
  EXPECT_EQ(f->get_int("v.u16"), 60000);
  EXPECT_EQ(f->get_int("v.i16"), -30000);
  EXPECT_EQ(f->get_int("v.u32"), 4000000000);
  EXPECT_EQ(f->get_int("v.i32"), -2000000000);
  EXPECT_EQ(f->get_float("v.f32"), -1.25);
  EXPECT_EQ(f->find_bool("v.bool"), false);
  EXPECT_EQ(f->get_string("v.string"), "h\xc3\xa9llo");
  EXPECT_EQ(std::get<std::uint64_t>(f->find("v.u64")->scalar), ~std::uint64_t{0});
  EXPECT_EQ(f->get_int("v.i64"), std::numeric_limits<std::int64_t>::min());
  EXPECT_EQ(f->get_float("v.f64"), 1e300);
  EXPECT_EQ(f->get_float("v.u8"), 200.0);  // get_float accepts any numeric type
  EXPECT_EQ(f->get_number_array("a.u8"), (std::vector<double>{1, 255}));
  EXPECT_EQ(f->get_number_array("a.i8"), (std::vector<double>{-1, 127}));
  EXPECT_EQ(f->get_number_array("a.u16"), (std::vector<double>{65535}));
  EXPECT_EQ(f->get_number_array("a.i16"), (std::vector<double>{-32768}));
  EXPECT_EQ(f->get_number_array("a.u32"), (std::vector<double>{7, 8, 9}));
  EXPECT_EQ(f->get_number_array("a.bool"), (std::vector<double>{1, 0, 1}));
  EXPECT_EQ(f->get_number_array("a.u64"), (std::vector<double>{std::ldexp(1.0, 50)}));
  EXPECT_EQ(f->get_number_array("a.i64"), (std::vector<double>{-std::ldexp(1.0, 50)}));
  EXPECT_EQ(f->get_number_array("a.f64"), (std::vector<double>{0.125, -2}));
  EXPECT_TRUE(f->get_number_array("a.empty").empty());
  EXPECT_EQ(f->get_string_array("a.string"), (std::vector<std::string>{"", "x", "yz"}));
  EXPECT_TRUE(f->tensors().empty());
}

TEST(GgufRoundTrip, TensorsKeepOrderShapeTypeAndBytes) {
  const auto f = open_bytes(sample_writer().to_bytes(), "tensors.gguf");
  ASSERT_EQ(f->tensors().size(), 4u);
  const auto& ts = f->tensors();
  EXPECT_EQ(ts[0].name, "t.f32");
  EXPECT_EQ(ts[1].name, "t.q8_0");
  EXPECT_EQ(ts[2].name, "t.f16");
  EXPECT_EQ(ts[3].name, "t.q4_1");
  struct Want {
    GgmlType type;
    int n_dims;
    std::array<std::int64_t, 4> ne;
    std::size_t nbytes;
  };
  const Want want[] = {{GgmlType::F32, 2, {4, 2, 1, 1}, 32},
                       {GgmlType::Q8_0, 2, {32, 2, 1, 1}, 68},
                       {GgmlType::F16, 3, {2, 1, 3, 1}, 12},
                       {GgmlType::Q4_1, 4, {32, 1, 1, 2}, 40}};
  const std::uint8_t* base = f->file().data();
  for (std::size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE(ts[i].name);
    EXPECT_EQ(ts[i].type, want[i].type);
    EXPECT_EQ(ts[i].n_dims, want[i].n_dims);
    EXPECT_EQ(ts[i].ne, want[i].ne);
    EXPECT_EQ(ts[i].nbytes, want[i].nbytes);
    const auto at = static_cast<std::size_t>(ts[i].data - base);
    EXPECT_EQ(at % 32, 0u);
    EXPECT_GE(at, f->data_offset());
    const auto expected = pattern_bytes(want[i].nbytes, static_cast<std::uint8_t>(i + 1));
    EXPECT_EQ(std::vector<std::uint8_t>(ts[i].data, ts[i].data + ts[i].nbytes), expected);
    EXPECT_EQ(&f->tensor(ts[i].name), &ts[i]);
  }
  EXPECT_EQ(f->data_offset() % 32, 0u);
  EXPECT_EQ(f->find_tensor("nope"), nullptr);
  EXPECT_EQ(ts[1].row_bytes(), 34u);
  EXPECT_EQ(ts[1].row(1), ts[1].data + 34);
}

TEST(GgufRoundTrip, CustomAlignmentIsWrittenAndHonoured) {
  const auto bytes = sample_writer(256).to_bytes();
  EXPECT_EQ(bytes.size() % 256, 0u);
  const auto f = open_bytes(bytes, "align.gguf");
  EXPECT_EQ(f->alignment(), 256u);
  EXPECT_EQ(f->get_int("general.alignment"), 256);
  EXPECT_EQ(f->find("general.alignment")->type, GgufType::u32);
  EXPECT_EQ(f->data_offset() % 256, 0u);
  for (const auto& t : f->tensors()) EXPECT_EQ(static_cast<std::size_t>(t.data - f->file().data()) % 256, 0u);
}

TEST(GgufRoundTrip, KeysKeepInsertionOrder) {
  const auto l = layout_of(sample_writer(64).to_bytes());
  std::vector<std::string> keys;
  for (const auto& kv : l.kvs) keys.push_back(kv.key);
  EXPECT_EQ(keys, (std::vector<std::string>{"general.architecture", "llama.block_count", "test.i32",
                                            "test.u64", "test.f32", "test.bool", "tokenizer.ggml.tokens",
                                            "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                                            "general.alignment"}));
}

TEST(GgufRoundTrip, Version2IsAccepted) {
  auto bytes = sample_writer().to_bytes();
  testing::store_le<std::uint32_t>(bytes, 4, 2);
  EXPECT_EQ(open_bytes(bytes, "v2.gguf")->version(), 2u);
}

TEST(GgufRoundTrip, MetadataOnlyFile) {
  GgufWriter w;
  w.set_string("general.name", "empty");
  const auto f = open_bytes(w.to_bytes(), "notensors.gguf");
  EXPECT_TRUE(f->tensors().empty());
  EXPECT_EQ(f->get_string("general.name"), "empty");
}

TEST(GgufRoundTrip, WriteToFileReplacesAtomically) {
  const std::string path = gguf_temp_path("written.gguf");
  write_bytes(path, {1, 2, 3});
  sample_writer().write(path);
  EXPECT_EQ(GgufFile::open(path)->tensors().size(), 4u);
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(path).parent_path()))
    EXPECT_EQ(e.path().string().find(".part."), std::string::npos) << e.path();
  expect_error([] { sample_writer().write("/nonexistent-dir/x.gguf"); }, ErrorCode::io,
               "/nonexistent-dir/x.gguf");
}

TEST(GgufWriter, RejectsBadArguments) {
  GgufWriter w;
  w.set_u32("k", 1);
  expect_error([&] { w.set_string("k", "again"); }, ErrorCode::invalid_argument, "key 'k': set twice");
  expect_error([&] { w.set_u32("", 1); }, ErrorCode::invalid_argument, "empty metadata key");
  expect_error([&] { w.add_tensor("t", GgmlType::F32, {4}, std::vector<std::uint8_t>(15)); },
               ErrorCode::invalid_argument, "15 data bytes given, a F32 tensor of this shape needs 16");
  expect_error([&] { w.add_tensor("t", GgmlType::Q8_0, {33}, std::vector<std::uint8_t>(34)); },
               ErrorCode::invalid_argument, "not a multiple of the Q8_0 block size 32");
  expect_error([&] { w.add_tensor("t", GgmlType::F32, {}, {}); }, ErrorCode::invalid_argument,
               "0 dimensions");
  expect_error(
      [&] {
        w.add_tensor("t", GgmlType::F32, {1, 1, 1, 1, 1}, std::vector<std::uint8_t>(4));
      },
      ErrorCode::invalid_argument, "5 dimensions");
  expect_error(
      [&] {
        w.add_tensor("t", GgmlType::F32, {4, 0}, {});
      },
      ErrorCode::invalid_argument, "dimension 0 is not positive");
  expect_error([&] { w.add_tensor("t", static_cast<GgmlType>(99), {4}, {}); }, ErrorCode::invalid_argument,
               "unknown type 99");
  expect_error(
      [&] {
        w.add_tensor("t", GgmlType::F32, {std::int64_t{1} << 62, 8}, {});
      },
      ErrorCode::invalid_argument, "overflows");
  w.add_tensor("t", GgmlType::F32, {4}, std::vector<std::uint8_t>(16));
  expect_error([&] { w.add_tensor("t", GgmlType::F32, {4}, std::vector<std::uint8_t>(16)); },
               ErrorCode::invalid_argument, "tensor 't': added twice");
  expect_error([&] { w.set_alignment(0); }, ErrorCode::invalid_argument, "power of two");
  expect_error([&] { w.set_alignment(48); }, ErrorCode::invalid_argument, "power of two");
}

TEST(GgufGetters, TypeMismatchesAndMissingKeysNameFileAndKey) {
  RawGguf raw;
  raw.scalar<std::uint64_t>("big", GgufType::u64, ~std::uint64_t{0});
  raw.scalar<std::uint8_t>("flag", GgufType::boolean, 1);
  raw.scalar<float>("real", GgufType::f32, 1.5f);
  raw.scalar<std::int32_t>("int", GgufType::i32, 3);
  raw.array<std::int32_t>("ints", GgufType::i32, {1});
  raw.key("name", GgufType::string);
  raw.str("n");
  const auto f = open_bytes(raw.bytes(), "getters.gguf");
  const std::string p = f->path() + ": key ";
  const auto bad = ErrorCode::bad_model_file;
  expect_error([&] { f->get_int("big"); }, bad,
               p + "'big': value 18446744073709551615 does not fit in int64");
  expect_error([&] { f->get_int("flag"); }, bad, p + "'flag': expected an integer, found bool");
  expect_error([&] { f->get_int("real"); }, bad, p + "'real': expected an integer, found f32");
  expect_error([&] { f->get_int("absent"); }, bad, p + "'absent': missing");
  expect_error([&] { f->get_float("name"); }, bad, p + "'name': expected a number, found string");
  expect_error([&] { f->get_float("flag"); }, bad, p + "'flag': expected a number, found bool");
  expect_error([&] { f->get_string("int"); }, bad, p + "'int': expected string, found i32");
  expect_error([&] { f->get_string("absent"); }, bad, p + "'absent': missing");
  expect_error([&] { f->find_bool("int"); }, bad, p + "'int': expected bool, found i32");
  expect_error([&] { f->get_string_array("ints"); }, bad,
               p + "'ints': expected array of string, found array of i32");
  expect_error([&] { f->get_number_array("name"); }, bad,
               p + "'name': expected array of numbers, found string");
  expect_error([&] { f->get_number_array("absent"); }, bad, p + "'absent': missing");
  expect_error([&] { f->tensor("w"); }, bad, f->path() + ": tensor 'w': missing");
  EXPECT_EQ(f->find_int("absent"), std::nullopt);
  EXPECT_EQ(f->find_float("absent"), std::nullopt);
  EXPECT_EQ(f->find_string("absent"), std::nullopt);
  EXPECT_EQ(f->find_bool("absent"), std::nullopt);
  EXPECT_EQ(f->find_float("big"), std::ldexp(1.0, 64));
  EXPECT_EQ(gguf_type_name(GgufType::boolean), "bool");
  EXPECT_EQ(gguf_type_name(static_cast<GgufType>(77)), "unknown");
}

TEST(GgufOpen, MissingFileIsIoError) {
  expect_error([] { GgufFile::open(gguf_temp_path("does-not-exist.gguf")); }, ErrorCode::io,
               "does-not-exist.gguf");
}

TEST(GgufRealModel, SmolLM2MetadataAndTensors) {
  QKV_REQUIRE_SMOLLM2(path);
  const auto f = GgufFile::open(path);
  EXPECT_EQ(f->tensors().size(), 272u);
  EXPECT_EQ(f->get_string("general.architecture"), "llama");
  EXPECT_EQ(f->get_int("llama.block_count"), 30);
  const TensorView& emb = f->tensor("token_embd.weight");
  EXPECT_EQ(emb.type, GgmlType::Q8_0);
  EXPECT_EQ(emb.n_dims, 2);
  EXPECT_EQ(emb.ne, (std::array<std::int64_t, 4>{576, 49152, 1, 1}));
  EXPECT_EQ(emb.nbytes, std::size_t{576} / 32 * 34 * 49152);
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.tokens").size(), 49152u);
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.merges").size(), 48900u);
  const auto end = f->file().data() + f->file().size();
  for (const auto& t : f->tensors()) {
    EXPECT_GE(t.data, f->file().data() + f->data_offset()) << t.name;
    EXPECT_LE(t.data + t.nbytes, end) << t.name;
  }
}

}  // namespace
}  // namespace qkvshare
