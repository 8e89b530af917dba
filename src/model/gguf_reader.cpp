// GGUF parsing and validation. Every read goes through Cursor, which checks
// bounds against the mapping first, and every count read from the file is
// compared with the bytes that remain before anything is allocated for it, so
// a forged header cannot make us read out of bounds or allocate gigabytes.
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <span>
#include <utility>

#include "gguf_internal.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/model/gguf.hpp"

namespace qkvshare {

static_assert(std::endian::native == std::endian::little,
              "GGUF is little-endian; this reader assumes the host is too");

namespace {

using gguf_detail::printable;

// Smallest encodings, used to reject counts that cannot fit in what remains:
// a kv is a key length, a value type and at least one value byte; a tensor
// info is a name length, n_dims, one dimension, a type and an offset.
constexpr std::uint64_t kMinKvBytes = 8 + 4 + 1;
constexpr std::uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;
constexpr std::size_t kDefaultAlignment = 32;

class Cursor {
 public:
  Cursor(const std::string& path, std::span<const std::uint8_t> bytes) : path_(path), bytes_(bytes) {}

  std::size_t pos() const noexcept { return pos_; }
  std::size_t size() const noexcept { return bytes_.size(); }
  std::size_t remaining() const noexcept { return bytes_.size() - pos_; }

  template <typename... Args>
  [[noreturn]] void bad(std::string_view item, fmt::format_string<Args...> format, Args&&... args) const {
    fail(ErrorCode::bad_model_file, "{}: {}: {}", path_, item,
         fmt::format(format, std::forward<Args>(args)...));
  }

  void need(std::uint64_t n, std::string_view item, std::string_view what) const {
    if (n > remaining())
      bad(item, "truncated: {} needs {} bytes at offset {}, but only {} remain (file is {} bytes)", what, n,
          pos_, remaining(), size());
  }

  template <typename T>
  T read(std::string_view item, std::string_view what) {
    need(sizeof(T), item, what);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string read_string(std::string_view item, std::string_view what) {
    const auto len = read<std::uint64_t>(item, what);
    need(len, item, what);
    std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), static_cast<std::size_t>(len));
    pos_ += static_cast<std::size_t>(len);
    return s;
  }

 private:
  const std::string& path_;
  std::span<const std::uint8_t> bytes_;
  std::size_t pos_ = 0;
};

bool known_value_type(std::uint32_t raw) noexcept {
  return raw <= static_cast<std::uint32_t>(GgufType::f64);
}

// Encoded size of one element; 8 for strings (only their length prefix).
std::uint64_t min_element_bytes(GgufType type) noexcept {
  switch (type) {
    case GgufType::u8:
    case GgufType::i8:
    case GgufType::boolean:
      return 1;
    case GgufType::u16:
    case GgufType::i16:
      return 2;
    case GgufType::u32:
    case GgufType::i32:
    case GgufType::f32:
      return 4;
    default:
      return 8;
  }
}

bool read_bool(Cursor& in, std::string_view item) {
  const std::size_t at = in.pos();
  const auto b = in.read<std::uint8_t>(item, "bool value");
  if (b > 1) in.bad(item, "bool value at offset {} is {} (must be 0 or 1)", at, b);
  return b == 1;
}

// Reads one numeric or bool element of an array as a double.
double read_number(Cursor& in, GgufType type, std::string_view item) {
  switch (type) {
    case GgufType::u8:
      return in.read<std::uint8_t>(item, "array element");
    case GgufType::i8:
      return in.read<std::int8_t>(item, "array element");
    case GgufType::u16:
      return in.read<std::uint16_t>(item, "array element");
    case GgufType::i16:
      return in.read<std::int16_t>(item, "array element");
    case GgufType::u32:
      return in.read<std::uint32_t>(item, "array element");
    case GgufType::i32:
      return in.read<std::int32_t>(item, "array element");
    case GgufType::f32:
      return in.read<float>(item, "array element");
    case GgufType::boolean:
      return read_bool(in, item) ? 1.0 : 0.0;
    case GgufType::u64:
      return static_cast<double>(in.read<std::uint64_t>(item, "array element"));
    case GgufType::i64:
      return static_cast<double>(in.read<std::int64_t>(item, "array element"));
    case GgufType::f64:
      return in.read<double>(item, "array element");
    case GgufType::string:
    case GgufType::array:
      break;
  }
  in.bad(item, "internal: {} is not a numeric type", gguf_type_name(type));
}

void read_array(Cursor& in, GgufValue& v, std::string_view item) {
  const auto raw = in.read<std::uint32_t>(item, "array element type");
  if (raw == static_cast<std::uint32_t>(GgufType::array)) in.bad(item, "arrays of arrays are not supported");
  if (!known_value_type(raw)) in.bad(item, "unknown array element type {}", raw);
  v.element_type = static_cast<GgufType>(raw);
  const auto count = in.read<std::uint64_t>(item, "array count");
  const std::uint64_t min_bytes = min_element_bytes(v.element_type);
  if (count > in.remaining() / min_bytes)
    in.bad(item, "array of {} {} elements cannot fit in the {} bytes that remain", count,
           gguf_type_name(v.element_type), in.remaining());
  const auto n = static_cast<std::size_t>(count);
  if (v.element_type == GgufType::string) {
    v.strings.reserve(n);
    for (std::size_t i = 0; i < n; ++i) v.strings.push_back(in.read_string(item, "string element"));
  } else {
    v.numbers.reserve(n);
    for (std::size_t i = 0; i < n; ++i) v.numbers.push_back(read_number(in, v.element_type, item));
  }
}

GgufValue read_value(Cursor& in, std::string_view item) {
  const auto raw = in.read<std::uint32_t>(item, "value type");
  if (!known_value_type(raw)) in.bad(item, "unknown value type {}", raw);
  GgufValue v;
  v.type = static_cast<GgufType>(raw);
  switch (v.type) {
    case GgufType::u8:
      v.scalar = std::uint64_t{in.read<std::uint8_t>(item, "u8 value")};
      break;
    case GgufType::i8:
      v.scalar = std::int64_t{in.read<std::int8_t>(item, "i8 value")};
      break;
    case GgufType::u16:
      v.scalar = std::uint64_t{in.read<std::uint16_t>(item, "u16 value")};
      break;
    case GgufType::i16:
      v.scalar = std::int64_t{in.read<std::int16_t>(item, "i16 value")};
      break;
    case GgufType::u32:
      v.scalar = std::uint64_t{in.read<std::uint32_t>(item, "u32 value")};
      break;
    case GgufType::i32:
      v.scalar = std::int64_t{in.read<std::int32_t>(item, "i32 value")};
      break;
    case GgufType::u64:
      v.scalar = in.read<std::uint64_t>(item, "u64 value");
      break;
    case GgufType::i64:
      v.scalar = in.read<std::int64_t>(item, "i64 value");
      break;
    case GgufType::f32:
      v.scalar = double{in.read<float>(item, "f32 value")};
      break;
    case GgufType::f64:
      v.scalar = in.read<double>(item, "f64 value");
      break;
    case GgufType::boolean:
      v.scalar = read_bool(in, item);
      break;
    case GgufType::string:
      v.scalar = in.read_string(item, "string value");
      break;
    case GgufType::array:
      read_array(in, v, item);
      break;
  }
  return v;
}

// Raw tensor info as read, before the data section start is known.
struct TensorInfo {
  TensorView view;
  std::uint64_t offset = 0;  // relative to the data section
  std::string item;          // "tensor 'name'" for messages
};

TensorInfo read_tensor_info(Cursor& in, std::size_t index, std::size_t alignment) {
  TensorInfo t;
  const std::string name = in.read_string(fmt::format("tensor #{}", index), "name");
  if (name.empty()) in.bad(fmt::format("tensor #{}", index), "empty tensor name");
  t.item = fmt::format("tensor {}", printable(name));
  const std::string_view item = t.item;
  t.view.name = name;

  const auto n_dims = in.read<std::uint32_t>(item, "n_dims");
  if (n_dims == 0 || n_dims > 4) in.bad(item, "n_dims is {} (must be 1 to 4)", n_dims);
  t.view.n_dims = static_cast<int>(n_dims);
  std::int64_t n_elements = 1;
  for (std::uint32_t d = 0; d < n_dims; ++d) {
    const auto ne = in.read<std::uint64_t>(item, "dimension");
    if (ne == 0) in.bad(item, "ne[{}] is 0", d);
    if (ne > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      in.bad(item, "ne[{}] is {} (negative as int64)", d, static_cast<std::int64_t>(ne));
    t.view.ne[d] = static_cast<std::int64_t>(ne);
    if (__builtin_mul_overflow(n_elements, t.view.ne[d], &n_elements))
      in.bad(item, "element count overflows int64 (ne = [{}])",
             fmt::join(t.view.ne.begin(), t.view.ne.begin() + d + 1, ", "));
  }

  const auto raw_type = in.read<std::uint32_t>(item, "type");
  const TypeTraits* traits = find_type_traits(raw_type);
  if (traits == nullptr) in.bad(item, "unknown tensor type {}", raw_type);
  t.view.type = static_cast<GgmlType>(raw_type);
  if (t.view.ne[0] % traits->block_size != 0)
    in.bad(item, "ne[0] = {} is not a multiple of the {} block size {}", t.view.ne[0], traits->name,
           traits->block_size);
  std::size_t nbytes = static_cast<std::size_t>(t.view.ne[0] / traits->block_size);
  bool overflow = __builtin_mul_overflow(nbytes, traits->type_size, &nbytes);
  for (int d = 1; d < 4; ++d)
    overflow = overflow || __builtin_mul_overflow(nbytes, static_cast<std::size_t>(t.view.ne[d]), &nbytes);
  if (overflow) in.bad(item, "byte size overflows size_t");
  t.view.nbytes = nbytes;

  t.offset = in.read<std::uint64_t>(item, "data offset");
  if (t.offset % alignment != 0)
    in.bad(item, "data offset {} is not a multiple of the alignment {}", t.offset, alignment);
  return t;
}

// The spec says u32; any integer type is accepted since the value is what matters.
std::size_t read_alignment(const std::map<std::string, GgufValue, std::less<>>& metadata, const Cursor& in) {
  const auto it = metadata.find("general.alignment");
  if (it == metadata.end()) return kDefaultAlignment;
  const GgufValue& v = it->second;
  constexpr std::string_view item = "key 'general.alignment'";
  const auto* u = std::get_if<std::uint64_t>(&v.scalar);
  const auto* s = std::get_if<std::int64_t>(&v.scalar);
  if (v.type == GgufType::array || (u == nullptr && s == nullptr))
    in.bad(item, "expected an integer, found {}", gguf_type_name(v.type));
  if (s != nullptr && *s <= 0) in.bad(item, "alignment is {} (must be a non-zero power of two)", *s);
  const std::uint64_t a = u != nullptr ? *u : static_cast<std::uint64_t>(*s);
  if (!std::has_single_bit(a)) in.bad(item, "alignment is {} (must be a non-zero power of two)", a);
  return static_cast<std::size_t>(a);
}

}  // namespace

std::unique_ptr<GgufFile> GgufFile::open(const std::string& path, MappedFile::Mode mode) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->file_ = MappedFile(path, mode);
  Cursor in(f->file_.path(), f->file_.bytes());

  constexpr std::string_view header = "header";
  in.need(4, header, "magic");
  const std::uint8_t* magic = f->file_.data();
  if (std::memcmp(magic, "GGUF", 4) != 0)
    in.bad(header, "not a GGUF file (magic bytes {:02x} {:02x} {:02x} {:02x}, expected 47 47 55 46 \"GGUF\")",
           magic[0], magic[1], magic[2], magic[3]);
  in.read<std::uint32_t>(header, "magic");
  f->version_ = in.read<std::uint32_t>(header, "version");
  if (f->version_ != 2 && f->version_ != 3) {
    const std::uint32_t swapped = __builtin_bswap32(f->version_);
    in.bad(header, "unsupported GGUF version {} (supported: 2, 3){}", f->version_,
           swapped == 2 || swapped == 3 ? "; this looks like a big-endian file" : "");
  }
  const auto tensor_count = in.read<std::uint64_t>(header, "tensor count");
  const auto kv_count = in.read<std::uint64_t>(header, "metadata count");
  if (kv_count > in.remaining() / kMinKvBytes)
    in.bad(header, "metadata count {} cannot fit in the {} bytes that remain", kv_count, in.remaining());
  if (tensor_count > in.remaining() / kMinTensorInfoBytes ||
      kv_count * kMinKvBytes + tensor_count * kMinTensorInfoBytes > in.remaining())
    in.bad(header, "tensor count {} with metadata count {} cannot fit in the {} bytes that remain",
           tensor_count, kv_count, in.remaining());

  for (std::uint64_t i = 0; i < kv_count; ++i) {
    const std::string entry = fmt::format("metadata entry #{}", i);
    std::string key = in.read_string(entry, "key");
    if (key.empty()) in.bad(entry, "empty key");
    const std::string item = fmt::format("key {}", printable(key));
    if (f->metadata_.contains(key)) in.bad(item, "duplicate key");
    GgufValue value = read_value(in, item);
    f->metadata_.emplace(std::move(key), std::move(value));
  }
  f->alignment_ = read_alignment(f->metadata_, in);

  std::vector<TensorInfo> infos;
  infos.reserve(static_cast<std::size_t>(tensor_count));
  for (std::uint64_t i = 0; i < tensor_count; ++i) {
    TensorInfo t = read_tensor_info(in, static_cast<std::size_t>(i), f->alignment_);
    if (f->tensor_index_.contains(t.view.name)) in.bad(t.item, "duplicate tensor name");
    f->tensor_index_.emplace(t.view.name, static_cast<std::size_t>(i));
    infos.push_back(std::move(t));
  }

  const std::size_t size = in.size();
  const std::size_t align = f->alignment_;
  std::size_t data_offset = 0;
  if (__builtin_add_overflow(in.pos(), align - 1, &data_offset))
    in.bad("data section", "start overflows size_t (alignment {})", align);
  data_offset &= ~(align - 1);
  // A file without tensors may end right after its metadata, unpadded.
  if (!infos.empty() && data_offset > size)
    in.bad("data section", "starts at offset {}, past the end of the file ({} bytes)", data_offset, size);
  f->data_offset_ = data_offset;

  std::vector<std::pair<std::uint64_t, std::size_t>> by_offset;  // (file offset, index)
  by_offset.reserve(infos.size());
  for (std::size_t i = 0; i < infos.size(); ++i) {
    TensorInfo& t = infos[i];
    std::uint64_t begin = 0;
    std::uint64_t end = 0;
    if (__builtin_add_overflow(std::uint64_t{data_offset}, t.offset, &begin))
      in.bad(t.item, "data [offset {} + {}, {} bytes] extends past end of file ({} bytes)", data_offset,
             t.offset, t.view.nbytes, size);
    if (__builtin_add_overflow(begin, std::uint64_t{t.view.nbytes}, &end) || end > size)
      in.bad(t.item, "data [offset {}, {} bytes] extends past end of file ({} bytes)", begin, t.view.nbytes,
             size);
    t.view.data = f->file_.data() + begin;
    by_offset.emplace_back(begin, i);
  }
  // Overlapping tensors are rejected: no writer produces them (llama.cpp's
  // reader does not check), and aliased weights in a model file are far more
  // likely a corrupt or forged file than an intended space saving.
  std::sort(by_offset.begin(), by_offset.end());
  for (std::size_t k = 1; k < by_offset.size(); ++k) {
    const TensorInfo& prev = infos[by_offset[k - 1].second];
    const TensorInfo& cur = infos[by_offset[k].second];
    if (by_offset[k - 1].first + prev.view.nbytes > by_offset[k].first)
      in.bad(cur.item, "data [offset {}, {} bytes] overlaps {} [offset {}, {} bytes]", by_offset[k].first,
             cur.view.nbytes, prev.item, by_offset[k - 1].first, prev.view.nbytes);
  }

  f->tensors_.reserve(infos.size());
  for (auto& t : infos) f->tensors_.push_back(std::move(t.view));
  return f;
}

}  // namespace qkvshare
