#include "qkvshare/core/file_io.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "qkvshare/core/error.hpp"

namespace qkvshare {

namespace {

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Writes everything `body` gives to fd; `total` counts what was written.
void pump(int fd, const std::string& path, const std::function<void(const ByteSink&)>& body, std::uint64_t& total) {
  body([&](std::span<const std::uint8_t> bytes) {
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0)
        fail(ErrorCode::io, "{}: write failed after {} bytes: {}", path, total + done,
             w < 0 ? std::strerror(errno) : "no progress");
      done += static_cast<std::size_t>(w);
    }
    total += done;
  });
}

}  // namespace

std::uint64_t write_file_atomic(const std::string& path, const std::function<void(const ByteSink&)>& body,
                                unsigned mode) {
  if (path.empty()) fail(ErrorCode::invalid_argument, "output path is empty");
  std::uint64_t total = 0;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    if (S_ISDIR(st.st_mode)) fail(ErrorCode::io, "{}: is a directory", path);
    Fd f;
    f.fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (f.fd < 0) fail(ErrorCode::io, "{}: cannot open for writing: {}", path, std::strerror(errno));
    pump(f.fd, path, body, total);
    return total;
  }
  {
    const auto slash = path.rfind('/');
    remove_stale_parts(slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash),
                       (slash == std::string::npos ? path : path.substr(slash + 1)) + ".part.");
  }
  const std::string part = path + ".part." + std::to_string(::getpid());
  Fd f;
  f.fd = ::open(part.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, static_cast<mode_t>(mode));
  if (f.fd < 0) fail(ErrorCode::io, "{}: cannot create {}: {}", path, part, std::strerror(errno));
  try {
    pump(f.fd, path, body, total);
    if (::fsync(f.fd) != 0) fail(ErrorCode::io, "{}: fsync failed: {}", path, std::strerror(errno));
    const int fd = f.fd;
    f.fd = -1;
    if (::close(fd) != 0) fail(ErrorCode::io, "{}: close failed: {}", path, std::strerror(errno));
    if (::rename(part.c_str(), path.c_str()) != 0)
      fail(ErrorCode::io, "{}: rename from {} failed: {}", path, part, std::strerror(errno));
  } catch (...) {
    ::unlink(part.c_str());
    throw;
  }
  return total;
}

std::uint64_t write_file_atomic(const std::string& path, std::span<const std::uint8_t> bytes, unsigned mode) {
  return write_file_atomic(path, [&](const ByteSink& sink) { sink(bytes); }, mode);
}

bool names_dead_process(std::string_view pid_text) {
  const std::string digits(pid_text);
  char* end = nullptr;
  const long pid = std::strtol(digits.c_str(), &end, 10);
  if (digits.empty() || end == nullptr || *end != '\0' || pid <= 0) return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

int remove_stale_parts(const std::string& dir, std::string_view prefix) {
  int removed = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const auto at = name.rfind(".part.");
    if (at == std::string::npos || !names_dead_process(std::string_view(name).substr(at + 6))) continue;
    std::error_code rm;
    std::filesystem::remove(e.path(), rm);
    removed += rm ? 0 : 1;
  }
  return removed;
}

void check_output_file(const std::string& path, std::string_view what) {
  if (path.empty()) fail(ErrorCode::invalid_argument, "{}: the path is empty", what);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) fail(ErrorCode::io, "{} '{}': is a directory", what, path);
    if (!S_ISREG(st.st_mode)) return;  // a device or FIFO: written in place
  }
  const auto slash = path.rfind('/');
  const std::string folder = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  if (::stat(folder.c_str(), &st) != 0) fail(ErrorCode::io, "{} '{}': folder {}: {}", what, path, folder, std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) fail(ErrorCode::io, "{} '{}': {} is not a folder", what, path, folder);
  if (::access(folder.c_str(), W_OK) != 0)
    fail(ErrorCode::io, "{} '{}': cannot write in {}: {}", what, path, folder, std::strerror(errno));
}

void check_input_file(const std::string& path, std::string_view what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return;  // the reader's own open names a missing file
  if (S_ISDIR(st.st_mode)) fail(ErrorCode::io, "{} '{}': is a directory", what, path);
}

void check_regular_file(const std::string& path, std::string_view what) {
  check_input_file(path, what);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) fail(ErrorCode::io, "{} '{}': not a regular file", what, path);
}

}  // namespace qkvshare
