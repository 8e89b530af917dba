// Typed access to GGUF metadata and tensors of an opened file. Lookups that a
// model needs throw Error(bad_model_file) naming the file and the key, so a
// loader can call them without checking each one itself.
#include <limits>

#include "gguf_internal.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/model/gguf.hpp"

namespace qkvshare {

namespace gguf_detail {

std::string printable(std::string_view s) {
  constexpr std::size_t kMaxShown = 96;
  std::string out = "'";
  for (std::size_t i = 0; i < s.size() && i < kMaxShown; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out += static_cast<char>(c);
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  if (s.size() > kMaxShown)
    out += fmt::format("...' ({} bytes)", s.size());
  else
    out += '\'';
  return out;
}

}  // namespace gguf_detail

namespace {

using gguf_detail::printable;

bool is_integer(GgufType t) noexcept {
  switch (t) {
    case GgufType::u8:
    case GgufType::i8:
    case GgufType::u16:
    case GgufType::i16:
    case GgufType::u32:
    case GgufType::i32:
    case GgufType::u64:
    case GgufType::i64:
      return true;
    default:
      return false;
  }
}

bool is_number_element(GgufType t) noexcept {
  return is_integer(t) || t == GgufType::f32 || t == GgufType::f64 || t == GgufType::boolean;
}

std::string describe(const GgufValue& v) {
  if (v.type == GgufType::array) return fmt::format("array of {}", gguf_type_name(v.element_type));
  return std::string(gguf_type_name(v.type));
}

[[noreturn]] void bad_key(const std::string& path, std::string_view key, std::string_view reason) {
  fail(ErrorCode::bad_model_file, "{}: key {}: {}", path, printable(key), reason);
}

}  // namespace

std::string_view gguf_type_name(GgufType type) noexcept {
  switch (type) {
    case GgufType::u8:
      return "u8";
    case GgufType::i8:
      return "i8";
    case GgufType::u16:
      return "u16";
    case GgufType::i16:
      return "i16";
    case GgufType::u32:
      return "u32";
    case GgufType::i32:
      return "i32";
    case GgufType::f32:
      return "f32";
    case GgufType::boolean:
      return "bool";
    case GgufType::string:
      return "string";
    case GgufType::array:
      return "array";
    case GgufType::u64:
      return "u64";
    case GgufType::i64:
      return "i64";
    case GgufType::f64:
      return "f64";
  }
  return "unknown";
}

const GgufValue* GgufFile::find(std::string_view key) const {
  const auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

std::optional<std::string> GgufFile::find_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != GgufType::string)
    bad_key(path(), key, fmt::format("expected string, found {}", describe(*v)));
  return std::get<std::string>(v->scalar);
}

std::string GgufFile::get_string(std::string_view key) const {
  auto s = find_string(key);
  if (!s) bad_key(path(), key, "missing");
  return std::move(*s);
}

std::optional<std::int64_t> GgufFile::find_int(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (!is_integer(v->type)) bad_key(path(), key, fmt::format("expected an integer, found {}", describe(*v)));
  if (const auto* s = std::get_if<std::int64_t>(&v->scalar)) return *s;
  const auto u = std::get<std::uint64_t>(v->scalar);
  if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    bad_key(path(), key, fmt::format("value {} does not fit in int64", u));
  return static_cast<std::int64_t>(u);
}

std::int64_t GgufFile::get_int(std::string_view key) const {
  const auto i = find_int(key);
  if (!i) bad_key(path(), key, "missing");
  return *i;
}

std::optional<double> GgufFile::find_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type == GgufType::f32 || v->type == GgufType::f64) return std::get<double>(v->scalar);
  if (!is_integer(v->type)) bad_key(path(), key, fmt::format("expected a number, found {}", describe(*v)));
  if (const auto* s = std::get_if<std::int64_t>(&v->scalar)) return static_cast<double>(*s);
  return static_cast<double>(std::get<std::uint64_t>(v->scalar));
}

double GgufFile::get_float(std::string_view key) const {
  const auto d = find_float(key);
  if (!d) bad_key(path(), key, "missing");
  return *d;
}

std::optional<bool> GgufFile::find_bool(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != GgufType::boolean)
    bad_key(path(), key, fmt::format("expected bool, found {}", describe(*v)));
  return std::get<bool>(v->scalar);
}

const std::vector<std::string>& GgufFile::get_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) bad_key(path(), key, "missing");
  if (v->type != GgufType::array || v->element_type != GgufType::string)
    bad_key(path(), key, fmt::format("expected array of string, found {}", describe(*v)));
  return v->strings;
}

const std::vector<double>& GgufFile::get_number_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) bad_key(path(), key, "missing");
  if (v->type != GgufType::array || !is_number_element(v->element_type))
    bad_key(path(), key, fmt::format("expected array of numbers, found {}", describe(*v)));
  return v->numbers;
}

const TensorView* GgufFile::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const TensorView& GgufFile::tensor(std::string_view name) const {
  const TensorView* t = find_tensor(name);
  if (t == nullptr) fail(ErrorCode::bad_model_file, "{}: tensor {}: missing", path(), printable(name));
  return *t;
}

}  // namespace qkvshare
