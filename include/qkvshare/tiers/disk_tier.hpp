#pragma once
// The disk tier: a sealed context written to one portable context file
// (context_file.hpp), optionally encrypted, and mapped back (mmap) when it is
// needed again. Files are written crash-safely (file_io.hpp): a failed or
// killed spill leaves no file and changes nothing in the pool.
#include <memory>
#include <string>
#include <string_view>

#include "qkvshare/share/share_pool.hpp"
#include "qkvshare/tiers/context_file.hpp"

namespace qkvshare {

struct SpillResult {
  std::string path;
  std::uint64_t file_bytes = 0;
  std::size_t kv_bytes = 0;  // pool bytes of the context's blocks
  int tokens = 0;
  double seconds = 0;
};

struct RestoreResult {
  SealedContext sealed;
  std::uint64_t file_bytes = 0;
  double seconds = 0;
};

class DiskTier {
 public:
  // Creates `dir` when missing and removes parts left by dead processes.
  // `cipher` (may be null) seals every block written and opens every block read.
  explicit DiskTier(std::string dir, std::shared_ptr<const BlockCipher> cipher = nullptr);

  const std::string& dir() const noexcept { return dir_; }
  std::string path_of(std::string_view name) const;  // <dir>/<name>.qkvctx

  // Writes the context `d` names (opened as its grantee `agent`) to
  // path_of(name). Error(io) naming the file and the OS reason when the
  // disk refuses (full, quota, I/O error); the pool is never touched.
  SpillResult spill(SharePool& pool, const Descriptor& d, std::string_view agent, std::string_view name) const;
  // Maps path_of(name) and imports it into `pool` as `producer`'s sealed
  // context, verifying every block (tag, checksum) and, with `expected`,
  // the model. Error(bad_descriptor) / Error(io) naming the file otherwise.
  RestoreResult restore(SharePool& pool, std::string_view name, std::string_view producer,
                        const ModelFingerprint* expected = nullptr) const;
  void remove(std::string_view name) const noexcept;

 private:
  std::string dir_;
  std::shared_ptr<const BlockCipher> cipher_;
};

}  // namespace qkvshare
