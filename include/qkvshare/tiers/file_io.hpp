#pragma once
// Crash-safe files for the disk tier and `context export`: a file is written
// under a temporary name in the same folder, flushed (fsync) and renamed over
// its final name, so a reader sees either the whole file or none, even after
// kill -9 or a full disk half-way. Temporary names end in ".part.<pid>";
// remove_stale_parts() deletes those of processes that no longer exist.
#include <cstdint>
#include <functional>
#include <string>

#include "qkvshare/tiers/context_file.hpp"

namespace qkvshare {

// `body` writes through the sink it is given. Error(io) naming the path and
// the OS reason (ENOSPC, EFBIG, EIO, ...) when anything fails; then nothing
// is left under either name. Returns the bytes written.
std::uint64_t write_file_atomic(const std::string& path, const std::function<void(const ByteSink&)>& body);
// Deletes "<dir>/*.part.<pid>" of dead pids; returns how many it removed.
int remove_stale_parts(const std::string& dir);

}  // namespace qkvshare
