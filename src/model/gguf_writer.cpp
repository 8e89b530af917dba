// GGUF v3 writer. Keys and tensors are written in insertion order; tensor data
// is padded to the alignment as the reader (ours and llama.cpp's) expects.

#include <bit>

#include "gguf_internal.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"
#include "qkvshare/model/gguf.hpp"

namespace qkvshare {

namespace {

using gguf_detail::printable;

constexpr std::uint32_t kVersion = 3;

template <typename T>
void put(std::vector<std::uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

void put_string(std::vector<std::uint8_t>& out, const std::string& s) {
  put<std::uint64_t>(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}

void put_type(std::vector<std::uint8_t>& out, GgufType t) {
  put<std::uint32_t>(out, static_cast<std::uint32_t>(t));
}

template <typename T>
std::vector<std::uint8_t> scalar(GgufType t, T v) {
  std::vector<std::uint8_t> out;
  put_type(out, t);
  put<T>(out, v);
  return out;
}

template <typename T>
std::vector<std::uint8_t> array(GgufType element, const std::vector<T>& values) {
  std::vector<std::uint8_t> out;
  put_type(out, GgufType::array);
  put_type(out, element);
  put<std::uint64_t>(out, values.size());
  for (const T& v : values) {
    if constexpr (std::is_same_v<T, std::string>)
      put_string(out, v);
    else
      put<T>(out, v);
  }
  return out;
}

std::size_t align_up(std::size_t n, std::size_t alignment) {
  return (n + alignment - 1) & ~(alignment - 1);
}

void pad_to(std::vector<std::uint8_t>& out, std::size_t alignment) {
  out.resize(align_up(out.size(), alignment), 0);
}

}  // namespace

void GgufWriter::put_kv(const std::string& key, std::vector<std::uint8_t> encoded) {
  if (key.empty()) fail(ErrorCode::invalid_argument, "GGUF writer: empty metadata key");
  for (const Kv& kv : kvs_)
    if (kv.key == key) fail(ErrorCode::invalid_argument, "GGUF writer: key {}: set twice", printable(key));
  kvs_.push_back({key, std::move(encoded)});
}

void GgufWriter::set_u32(const std::string& key, std::uint32_t v) {
  put_kv(key, scalar(GgufType::u32, v));
}
void GgufWriter::set_i32(const std::string& key, std::int32_t v) {
  put_kv(key, scalar(GgufType::i32, v));
}
void GgufWriter::set_u64(const std::string& key, std::uint64_t v) {
  put_kv(key, scalar(GgufType::u64, v));
}
void GgufWriter::set_f32(const std::string& key, float v) {
  put_kv(key, scalar(GgufType::f32, v));
}
void GgufWriter::set_bool(const std::string& key, bool v) {
  put_kv(key, scalar<std::uint8_t>(GgufType::boolean, v ? 1 : 0));
}

void GgufWriter::set_string(const std::string& key, const std::string& v) {
  std::vector<std::uint8_t> out;
  put_type(out, GgufType::string);
  put_string(out, v);
  put_kv(key, std::move(out));
}

void GgufWriter::set_string_array(const std::string& key, const std::vector<std::string>& v) {
  put_kv(key, array(GgufType::string, v));
}
void GgufWriter::set_f32_array(const std::string& key, const std::vector<float>& v) {
  put_kv(key, array(GgufType::f32, v));
}
void GgufWriter::set_i32_array(const std::string& key, const std::vector<std::int32_t>& v) {
  put_kv(key, array(GgufType::i32, v));
}

void GgufWriter::add_tensor(const std::string& name, GgmlType type, const std::vector<std::int64_t>& shape,
                            std::vector<std::uint8_t> data) {
  const auto bad = [&](std::string_view reason) {
    fail(ErrorCode::invalid_argument, "GGUF writer: tensor {}: {}", printable(name), reason);
  };
  if (name.empty()) bad("empty name");
  for (const Tensor& t : tensors_)
    if (t.name == name) bad("added twice");
  const TypeTraits* traits = find_type_traits(static_cast<std::uint32_t>(type));
  if (traits == nullptr) bad(fmt::format("unknown type {}", static_cast<std::uint32_t>(type)));
  if (shape.empty() || shape.size() > 4) bad(fmt::format("{} dimensions (must be 1 to 4)", shape.size()));
  for (const std::int64_t ne : shape)
    if (ne <= 0) bad(fmt::format("dimension {} is not positive", ne));
  if (shape[0] % traits->block_size != 0)
    bad(fmt::format("ne[0] = {} is not a multiple of the {} block size {}", shape[0], traits->name,
                    traits->block_size));
  std::size_t nbytes = static_cast<std::size_t>(shape[0] / traits->block_size);
  bool overflow = __builtin_mul_overflow(nbytes, traits->type_size, &nbytes);
  for (std::size_t d = 1; d < shape.size(); ++d)
    overflow = overflow || __builtin_mul_overflow(nbytes, static_cast<std::size_t>(shape[d]), &nbytes);
  if (overflow) bad("byte size overflows size_t");
  if (data.size() != nbytes)
    bad(fmt::format("{} data bytes given, a {} tensor of this shape needs {}", data.size(), traits->name,
                    nbytes));
  tensors_.push_back({name, type, shape, std::move(data)});
}

// The key is written (where first set) only when this is called, so files from
// writers that never call it carry no general.alignment, like llama.cpp's.
void GgufWriter::set_alignment(std::size_t alignment) {
  if (!std::has_single_bit(alignment) || alignment > (std::size_t{1} << 30))
    fail(ErrorCode::invalid_argument, "GGUF writer: alignment {} must be a power of two up to 2^30",
         alignment);
  alignment_ = alignment;
  auto encoded = scalar(GgufType::u32, static_cast<std::uint32_t>(alignment));
  for (Kv& kv : kvs_) {
    if (kv.key == "general.alignment") {
      kv.encoded = std::move(encoded);
      return;
    }
  }
  kvs_.push_back({"general.alignment", std::move(encoded)});
}

std::vector<std::uint8_t> GgufWriter::to_bytes() const {
  std::vector<std::uint8_t> out;
  out.insert(out.end(), {'G', 'G', 'U', 'F'});
  put<std::uint32_t>(out, kVersion);
  put<std::uint64_t>(out, tensors_.size());
  put<std::uint64_t>(out, kvs_.size());
  for (const Kv& kv : kvs_) {
    put_string(out, kv.key);
    out.insert(out.end(), kv.encoded.begin(), kv.encoded.end());
  }
  std::size_t offset = 0;
  for (const Tensor& t : tensors_) {
    put_string(out, t.name);
    put<std::uint32_t>(out, static_cast<std::uint32_t>(t.shape.size()));
    for (const std::int64_t ne : t.shape) put<std::uint64_t>(out, static_cast<std::uint64_t>(ne));
    put<std::uint32_t>(out, static_cast<std::uint32_t>(t.type));
    put<std::uint64_t>(out, offset);
    offset = align_up(offset + t.data.size(), alignment_);
  }
  pad_to(out, alignment_);
  for (const Tensor& t : tensors_) {
    out.insert(out.end(), t.data.begin(), t.data.end());
    pad_to(out, alignment_);
  }
  return out;
}

// Through a temporary file renamed over `path` (core/file_io.hpp), so a
// failed write never leaves a truncated model where a good one was.
void GgufWriter::write(const std::string& path) const {
  const std::vector<std::uint8_t> bytes = to_bytes();
  write_file_atomic(path, std::span<const std::uint8_t>(bytes.data(), bytes.size()));
}

}  // namespace qkvshare
