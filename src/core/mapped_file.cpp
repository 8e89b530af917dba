#include "qkvshare/core/mapped_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "qkvshare/core/error.hpp"

namespace qkvshare {

MappedFile::MappedFile(const std::string& path, Mode mode) : path_(path), mode_(mode) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer
  // before the check below could reject it (it changes nothing for a regular file).
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(ErrorCode::io, "{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    fail(ErrorCode::io, "{}: cannot stat: {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(ErrorCode::io, "{}: not a regular file", path);
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0 && mode == Mode::private_copy) {
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      fail(ErrorCode::io, "{}: cannot allocate {} bytes: {}", path, size_, std::strerror(err));
    }
    auto* dst = static_cast<std::uint8_t*>(p);
    for (std::size_t done = 0; done < size_;) {
      const ssize_t got = ::pread(fd, dst + done, size_ - done, static_cast<off_t>(done));
      if (got <= 0) {
        int err = got < 0 ? errno : EIO;
        ::munmap(p, size_);
        ::close(fd);
        fail(ErrorCode::io, "{}: read failed at byte {}: {}", path, done, std::strerror(err));
      }
      done += static_cast<std::size_t>(got);
    }
    data_ = dst;
  } else if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      fail(ErrorCode::io, "{}: cannot mmap {} bytes: {}", path, size_, std::strerror(err));
    }
    data_ = static_cast<const std::uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() { reset(); }

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)), mode_(other.mode_) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    reset();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mode_ = other.mode_;
  }
  return *this;
}

void MappedFile::release(const std::uint8_t* from, const std::uint8_t* to) const noexcept {
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (page_size <= 0 || data_ == nullptr || from < data_ || to > data_ + size_) return;
  const auto page = static_cast<std::uintptr_t>(page_size);
  const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(data_);  // page-aligned: mmap's
  const std::uintptr_t lo = (reinterpret_cast<std::uintptr_t>(from) + page - 1) / page * page;
  const std::uintptr_t hi = reinterpret_cast<std::uintptr_t>(to) / page * page;
  if (hi <= lo) return;
  if (mode_ == Mode::shared) {
    ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
    return;
  }
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // never waits, as above
  if (fd < 0) return;
  ::mmap(reinterpret_cast<void*>(lo), hi - lo, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, static_cast<off_t>(lo - base));
  ::close(fd);
}

void MappedFile::reset() noexcept {
  if (data_ != nullptr) ::munmap(const_cast<std::uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace qkvshare
