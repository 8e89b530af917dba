#pragma once
// A read-only memory mapping of a whole file. Model weights are used in place
// from this mapping (docs/design.md rule 2); nothing copies them.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace qkvshare {

class MappedFile {
 public:
  // shared: the kernel's page cache backs the mapping, so every mapping of the
  // file in any process shares one copy. private_copy: the bytes are read into
  // anonymous memory of this process, as a separate engine process that does
  // not share pages would hold them (used to measure independent agents).
  enum class Mode { shared, private_copy };

  MappedFile() = default;
  // Throws Error(io) naming the path when the file cannot be opened or mapped.
  explicit MappedFile(const std::string& path, Mode mode = Mode::shared);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::uint8_t* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::span<const std::uint8_t> bytes() const noexcept { return {data_, size_}; }
  const std::string& path() const noexcept { return path_; }

  // Drops the whole pages inside [from, to) (a range of bytes()) from this
  // process's memory; reading them afterwards gives the same bytes, from the
  // file (shared: the page cache again; private_copy: the range becomes a
  // mapping of the file). For data used through another copy, such as packed
  // weights. Best effort: where the system refuses, the pages stay.
  void release(const std::uint8_t* from, const std::uint8_t* to) const noexcept;

 private:
  void reset() noexcept;
  std::string path_;
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
  Mode mode_ = Mode::shared;
};

}  // namespace qkvshare
