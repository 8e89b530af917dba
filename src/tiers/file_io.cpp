#include "qkvshare/tiers/file_io.hpp"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
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

}  // namespace

std::uint64_t write_file_atomic(const std::string& path, const std::function<void(const ByteSink&)>& body) {
  const std::string part = path + ".part." + std::to_string(::getpid());
  Fd f;
  f.fd = ::open(part.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (f.fd < 0) fail(ErrorCode::io, "{}: cannot create: {}", part, std::strerror(errno));
  std::uint64_t total = 0;
  try {
    body([&](std::span<const std::uint8_t> bytes) {
      std::size_t done = 0;
      while (done < bytes.size()) {
        const ssize_t w = ::write(f.fd, bytes.data() + done, bytes.size() - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0)
          fail(ErrorCode::io, "{}: write failed after {} bytes: {}", path, total + done,
               w < 0 ? std::strerror(errno) : "no progress");
        done += static_cast<std::size_t>(w);
      }
      total += done;
    });
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

int remove_stale_parts(const std::string& dir) {
  int removed = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const auto at = name.rfind(".part.");
    if (at == std::string::npos) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + at + 6, &end, 10);
    if (end == nullptr || *end != '\0' || pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      std::filesystem::remove(e.path(), ec);
      removed += ec ? 0 : 1;
    }
  }
  return removed;
}

}  // namespace qkvshare
