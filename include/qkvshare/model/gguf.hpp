#pragma once
// GGUF v2/v3 reader: header, metadata, tensor infos and alignment are parsed
// and validated up front; tensor data stays in the read-only mapping.
// Every malformed input throws Error(bad_model_file) with a message of the
// form "<path>: <item>: <reason>". Beyond the format rules, the reader rejects
// empty keys and tensor names, bool values other than 0/1, arrays of arrays
// and tensors whose data overlap.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "qkvshare/core/mapped_file.hpp"
#include "qkvshare/tensor/tensor.hpp"

namespace qkvshare {

enum class GgufType : std::uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7,
  string = 8, array = 9, u64 = 10, i64 = 11, f64 = 12,
};
std::string_view gguf_type_name(GgufType type) noexcept;

// One metadata value. Scalars of every integer width are held widened; arrays
// keep their element type.
struct GgufValue {
  GgufType type = GgufType::u8;
  GgufType element_type = GgufType::u8;  // for arrays
  std::variant<std::uint64_t, std::int64_t, double, bool, std::string> scalar;
  std::vector<std::string> strings;      // array of string
  std::vector<double> numbers;           // array of any numeric or bool type
};

class GgufFile {
 public:
  // Opens, maps and validates. Throws Error(io) if the file cannot be read and
  // Error(bad_model_file) for any malformed content.
  static std::unique_ptr<GgufFile> open(const std::string& path,
                                        MappedFile::Mode mode = MappedFile::Mode::shared);

  const std::string& path() const noexcept { return file_.path(); }
  std::uint32_t version() const noexcept { return version_; }
  std::size_t alignment() const noexcept { return alignment_; }
  std::size_t data_offset() const noexcept { return data_offset_; }

  const GgufValue* find(std::string_view key) const;
  bool has(std::string_view key) const { return find(key) != nullptr; }
  const std::map<std::string, GgufValue, std::less<>>& metadata() const noexcept { return metadata_; }

  // Typed getters. The required forms throw Error(bad_model_file) naming the
  // file and key when the key is missing or has an incompatible type; the
  // optional forms return nullopt only when the key is missing.
  std::string get_string(std::string_view key) const;
  std::optional<std::string> find_string(std::string_view key) const;
  std::int64_t get_int(std::string_view key) const;  // any integer type, range checked
  std::optional<std::int64_t> find_int(std::string_view key) const;
  double get_float(std::string_view key) const;       // any numeric type
  std::optional<double> find_float(std::string_view key) const;
  std::optional<bool> find_bool(std::string_view key) const;
  const std::vector<std::string>& get_string_array(std::string_view key) const;
  const std::vector<double>& get_number_array(std::string_view key) const;

  const std::vector<TensorView>& tensors() const noexcept { return tensors_; }
  const TensorView* find_tensor(std::string_view name) const;
  const TensorView& tensor(std::string_view name) const;  // throws naming file and tensor

  const MappedFile& file() const noexcept { return file_; }

 private:
  GgufFile() = default;
  MappedFile file_;
  std::uint32_t version_ = 0;
  std::size_t alignment_ = 32;
  std::size_t data_offset_ = 0;
  std::map<std::string, GgufValue, std::less<>> metadata_;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::size_t, std::less<>> tensor_index_;
};

// Writes GGUF v3 files: used by `qkvshare make-model` and by tests that need
// well-formed or deliberately broken files. Keys and tensors keep insertion
// order; setting a key or adding a tensor name twice throws
// Error(invalid_argument).
class GgufWriter {
 public:
  void set_u32(const std::string& key, std::uint32_t v);
  void set_i32(const std::string& key, std::int32_t v);
  void set_u64(const std::string& key, std::uint64_t v);
  void set_f32(const std::string& key, float v);
  void set_bool(const std::string& key, bool v);
  void set_string(const std::string& key, const std::string& v);
  void set_string_array(const std::string& key, const std::vector<std::string>& v);
  void set_f32_array(const std::string& key, const std::vector<float>& v);
  void set_i32_array(const std::string& key, const std::vector<std::int32_t>& v);
  // `shape` is in ggml order (shape[0] = ne[0], the contiguous dimension);
  // `data` must hold exactly the bytes of a tensor of this type and shape.
  void add_tensor(const std::string& name, GgmlType type, const std::vector<std::int64_t>& shape,
                  std::vector<std::uint8_t> data);
  // Power of two up to 2^30; also writes general.alignment (at the position
  // of the first call). Without a call the file uses the default 32 and has
  // no general.alignment key.
  void set_alignment(std::size_t alignment);
  // Serialises to bytes / to a file (throws Error(io) on write failure).
  std::vector<std::uint8_t> to_bytes() const;
  void write(const std::string& path) const;

 private:
  struct Kv {
    std::string key;
    std::vector<std::uint8_t> encoded;  // type tag + value, little endian
  };
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<std::int64_t> shape;
    std::vector<std::uint8_t> data;
  };
  void put_kv(const std::string& key, std::vector<std::uint8_t> encoded);
  std::vector<Kv> kvs_;
  std::vector<Tensor> tensors_;
  std::size_t alignment_ = 32;
};

}  // namespace qkvshare
