#pragma once
// Crash-safe files for the disk tier and `context export` are written by
// core/file_io.hpp's write_file_atomic (temporary ".part.<pid>" name, fsync,
// rename); a process killed half-way leaves its part file behind, which
// remove_stale_parts() deletes once that process no longer exists.
#include <string>

#include "qkvshare/core/file_io.hpp"

namespace qkvshare {

// Deletes "<dir>/*.part.<pid>" of dead pids; returns how many it removed.
int remove_stale_parts(const std::string& dir);

}  // namespace qkvshare
