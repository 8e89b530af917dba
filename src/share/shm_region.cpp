#include "qkvshare/share/shm_region.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "qkvshare/core/error.hpp"

namespace qkvshare {

namespace {

std::string object_name(const std::string& name) { return "/qkvshare." + name; }

std::byte* map(int fd, std::size_t bytes, const std::string& what) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) fail(ErrorCode::io, "{}: mmap of {} bytes failed: {}", what, bytes, std::strerror(errno));
  return static_cast<std::byte*>(p);
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const noexcept { return fd_; }

 private:
  int fd_;
};

}  // namespace

void ShmRegion::validate_name(const std::string& name) {
  if (name.empty() || name.size() > 64)
    fail(ErrorCode::invalid_argument, "pool name '{}' must have 1 to 64 characters", name);
  for (char c : name)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-'))
      fail(ErrorCode::invalid_argument, "pool name '{}' may only use letters, digits and _ . -", name);
}

std::shared_ptr<ShmRegion> ShmRegion::create(const std::string& name, std::size_t bytes) {
  validate_name(name);
  const std::string obj = object_name(name);
  Fd fd(::shm_open(obj.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (fd.get() < 0) {
    if (errno == EEXIST)
      fail(ErrorCode::io, "pool '{}' already exists (another `pool serve`?); remove /dev/shm{} if it is left over", name,
           obj);
    fail(ErrorCode::io, "pool '{}': shm_open failed: {}", name, std::strerror(errno));
  }
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::shm_unlink(obj.c_str());
    fail(ErrorCode::io, "pool '{}': cannot size it to {} bytes: {}", name, bytes, std::strerror(err));
  }
  try {
    return std::shared_ptr<ShmRegion>(new ShmRegion(map(fd.get(), bytes, "pool '" + name + "'"), bytes, name));
  } catch (...) {
    ::shm_unlink(obj.c_str());
    throw;
  }
}

std::shared_ptr<ShmRegion> ShmRegion::open(const std::string& name) {
  validate_name(name);
  Fd fd(::shm_open(object_name(name).c_str(), O_RDWR | O_CLOEXEC, 0));
  if (fd.get() < 0) {
    if (errno == ENOENT) fail(ErrorCode::io, "pool '{}' does not exist (start it with `qkvshare pool serve --name {}`)", name, name);
    fail(ErrorCode::io, "pool '{}': shm_open failed: {}", name, std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(ErrorCode::io, "pool '{}': fstat failed: {}", name, std::strerror(errno));
  if (st.st_size <= 0) fail(ErrorCode::io, "pool '{}' is empty (its creator has not sized it yet, or died)", name);
  const auto bytes = static_cast<std::size_t>(st.st_size);
  return std::shared_ptr<ShmRegion>(new ShmRegion(map(fd.get(), bytes, "pool '" + name + "'"), bytes, name));
}

std::shared_ptr<ShmRegion> ShmRegion::anonymous(std::size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) fail(ErrorCode::out_of_memory, "cannot map {} bytes of shared memory: {}", bytes, std::strerror(errno));
  return std::shared_ptr<ShmRegion>(new ShmRegion(static_cast<std::byte*>(p), bytes, {}));
}

bool ShmRegion::unlink(const std::string& name) noexcept {
  return ::shm_unlink(object_name(name).c_str()) == 0;
}

ShmRegion::~ShmRegion() { ::munmap(base_, size_); }

static_assert(sizeof(pthread_mutex_t) <= RobustMutex::kBytes);

void RobustMutex::init(void* at) {
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  const int rc = pthread_mutex_init(static_cast<pthread_mutex_t*>(at), &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) fail(ErrorCode::io, "cannot initialise a process-shared mutex: {}", std::strerror(rc));
}

void RobustMutex::lock() {
  auto* m = static_cast<pthread_mutex_t*>(m_);
  const int rc = pthread_mutex_lock(m);
  if (rc == 0) return;
  if (rc == EOWNERDEAD) {
    // The previous holder died inside its critical section: fix the data,
    // then let the mutex be used again. A repair that throws leaves the mutex
    // unrecoverable, so every later lock() reports it instead of hanging.
    try {
      if (repair_) repair_();
    } catch (...) {
      pthread_mutex_unlock(m);
      throw;
    }
    ++repairs_;
    pthread_mutex_consistent(m);
    return;
  }
  if (rc == ENOTRECOVERABLE)
    fail(ErrorCode::io, "shared pool lock is unrecoverable (a repair failed); recreate the pool");
  fail(ErrorCode::io, "shared pool lock failed: {}", std::strerror(rc));
}

void RobustMutex::unlock() { pthread_mutex_unlock(static_cast<pthread_mutex_t*>(m_)); }

}  // namespace qkvshare
