#pragma once
// Shared by the GGUF tests: a small well-formed sample file, a map of where
// each header field of a well-formed file sits (so tests can forge exactly one
// field), and helpers to write bytes to a temp file and check errors.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/model/gguf.hpp"
#include "test_paths.hpp"

namespace qkvshare::testing {

// Deterministic bytes for a tensor of `n` bytes.
inline std::vector<std::uint8_t> pattern_bytes(std::size_t n, std::uint8_t seed) {
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>(seed + i * 7);
  return v;
}

// Every metadata type the writer can produce and tensors of several types and
// ranks, kept small so that random mutations mostly hit structure.
inline GgufWriter sample_writer(std::size_t alignment = 0) {
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_u32("llama.block_count", 2);
  w.set_i32("test.i32", -7);
  w.set_u64("test.u64", 1ull << 40);
  w.set_f32("test.f32", 0.5f);
  w.set_bool("test.bool", true);
  w.set_string_array("tokenizer.ggml.tokens", {"<s>", "</s>", "a", "b"});
  w.set_f32_array("tokenizer.ggml.scores", {0.f, -1.f, 2.5f, 3.f});
  w.set_i32_array("tokenizer.ggml.token_type", {3, 3, 1, 1});
  if (alignment != 0) w.set_alignment(alignment);
  w.add_tensor("t.f32", GgmlType::F32, {4, 2}, pattern_bytes(32, 1));
  w.add_tensor("t.q8_0", GgmlType::Q8_0, {32, 2}, pattern_bytes(68, 2));
  w.add_tensor("t.f16", GgmlType::F16, {2, 1, 3}, pattern_bytes(12, 3));
  w.add_tensor("t.q4_1", GgmlType::Q4_1, {32, 1, 1, 2}, pattern_bytes(40, 4));
  return w;
}

// Byte positions of the fields of a well-formed file.
struct GgufLayout {
  struct Kv {
    std::string key;
    std::size_t key_len = 0, type = 0, value = 0;  // value: first byte after the type tag
    std::size_t elem_type = 0, count = 0;          // arrays only (0 otherwise)
    std::vector<std::size_t> lengths;              // string lengths inside the value
  };
  struct Tensor {
    std::string name;
    std::size_t name_len = 0, n_dims = 0, type = 0, offset = 0;
    std::vector<std::size_t> dims;
  };
  std::size_t tensor_count_pos = 8, kv_count_pos = 16;
  std::vector<Kv> kvs;
  std::vector<Tensor> tensors;
  std::size_t infos_end = 0;

  // All u64 fields and all u32 fields, for mutation tests.
  std::vector<std::size_t> u64_fields() const {
    std::vector<std::size_t> out{tensor_count_pos, kv_count_pos};
    for (const auto& kv : kvs) {
      out.push_back(kv.key_len);
      if (kv.count != 0) out.push_back(kv.count);
      out.insert(out.end(), kv.lengths.begin(), kv.lengths.end());
    }
    for (const auto& t : tensors) {
      out.push_back(t.name_len);
      out.push_back(t.offset);
      out.insert(out.end(), t.dims.begin(), t.dims.end());
    }
    return out;
  }
  std::vector<std::size_t> u32_fields() const {
    std::vector<std::size_t> out{4};  // version
    for (const auto& kv : kvs) {
      out.push_back(kv.type);
      if (kv.elem_type != 0) out.push_back(kv.elem_type);
    }
    for (const auto& t : tensors) {
      out.push_back(t.n_dims);
      out.push_back(t.type);
    }
    return out;
  }
};

template <typename T>
T load_le(const std::vector<std::uint8_t>& b, std::size_t at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof(T));
  return v;
}
template <typename T>
void store_le(std::vector<std::uint8_t>& b, std::size_t at, T v) {
  std::memcpy(b.data() + at, &v, sizeof(T));
}

// Walks a file that is known to be well formed (e.g. from GgufWriter).
inline GgufLayout layout_of(const std::vector<std::uint8_t>& b) {
  GgufLayout l;
  std::size_t p = 24;
  const auto str = [&](std::vector<std::size_t>* lengths) {
    if (lengths != nullptr) lengths->push_back(p);
    const auto n = load_le<std::uint64_t>(b, p);
    std::string s(reinterpret_cast<const char*>(b.data() + p + 8), n);
    p += 8 + n;
    return s;
  };
  const auto elem_size = [](std::uint32_t t) -> std::size_t {
    switch (t) {
      case 0:
      case 1:
      case 7:
        return 1;
      case 2:
      case 3:
        return 2;
      case 4:
      case 5:
      case 6:
        return 4;
      default:
        return 8;
    }
  };
  const auto n_kv = load_le<std::uint64_t>(b, 16);
  for (std::uint64_t i = 0; i < n_kv; ++i) {
    GgufLayout::Kv kv;
    kv.key_len = p;
    kv.key = str(nullptr);
    kv.type = p;
    const auto type = load_le<std::uint32_t>(b, p);
    p += 4;
    kv.value = p;
    if (type == 8) {
      str(&kv.lengths);
    } else if (type == 9) {
      kv.elem_type = p;
      const auto et = load_le<std::uint32_t>(b, p);
      kv.count = p + 4;
      const auto count = load_le<std::uint64_t>(b, p + 4);
      p += 12;
      for (std::uint64_t k = 0; k < count; ++k) {
        if (et == 8)
          str(&kv.lengths);
        else
          p += elem_size(et);
      }
    } else {
      p += elem_size(type);
    }
    l.kvs.push_back(kv);
  }
  const auto n_t = load_le<std::uint64_t>(b, 8);
  for (std::uint64_t i = 0; i < n_t; ++i) {
    GgufLayout::Tensor t;
    t.name_len = p;
    t.name = str(nullptr);
    t.n_dims = p;
    const auto nd = load_le<std::uint32_t>(b, p);
    p += 4;
    for (std::uint32_t d = 0; d < nd; ++d, p += 8) t.dims.push_back(p);
    t.type = p;
    t.offset = p + 4;
    p += 12;
    l.tensors.push_back(t);
  }
  l.infos_end = p;
  return l;
}

inline const GgufLayout::Kv& kv_of(const GgufLayout& l, const std::string& key) {
  for (const auto& kv : l.kvs)
    if (kv.key == key) return kv;
  throw std::runtime_error("test layout has no key " + key);
}
inline const GgufLayout::Tensor& tensor_of(const GgufLayout& l, const std::string& name) {
  for (const auto& t : l.tensors)
    if (t.name == name) return t;
  throw std::runtime_error("test layout has no tensor " + name);
}

// Unlinks first: rewriting a file in place through O_TRUNC makes ext4 flush it
// to disk on close (auto_da_alloc), which slowed the mutation test tenfold.
inline void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::remove(path.c_str());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

// One temp folder for all GGUF tests of this process.
inline std::string gguf_temp_path(const std::string& name) {
  static const std::string dir = temp_dir();
  return dir + "/" + name;
}

// Writes `bytes`, opens them and expects Error(bad_model_file) whose message
// is "<path>: <item>: ..." and mentions `reason`.
inline void expect_bad_file(const std::vector<std::uint8_t>& bytes, const std::string& item,
                            const std::string& reason) {
  const std::string path = gguf_temp_path("bad.gguf");
  write_bytes(path, bytes);
  try {
    GgufFile::open(path);
    ADD_FAILURE() << "open() accepted a file that should fail with: " << item << ": " << reason;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.code(), ErrorCode::bad_model_file) << msg;
    EXPECT_EQ(msg.rfind(path + ": " + item + ": ", 0), 0u)
        << "message: " << msg << "\nexpected item: " << item;
    EXPECT_NE(msg.find(reason), std::string::npos) << "message: " << msg << "\nexpected reason: " << reason;
  }
}

}  // namespace qkvshare::testing
