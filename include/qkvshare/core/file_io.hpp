#pragma once
// Files every layer writes (descriptors, codebooks, models, exported contexts,
// the disk tier): written under a temporary name in the same folder, flushed
// (fsync) and renamed over the final name, so that a reader sees the whole
// file or none, even after kill -9 or a full disk half-way. Temporary names
// end in ".part.<pid>"; a writer killed half-way leaves its part behind, and
// the next write of the same path removes it (remove_stale_parts).
// A target that exists and is not a regular file (/dev/null, /dev/stdout, a
// FIFO) is written in place: renaming over it would replace the device.
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>

namespace qkvshare {

using ByteSink = std::function<void(std::span<const std::uint8_t> bytes)>;

// `body` writes through the sink it is given. Error(io) naming the path and
// the OS reason (a directory, ENOENT, ENOSPC, EIO, ...) when anything fails;
// then nothing is left under either name. `mode` is the new file's
// permissions before the umask. Returns the bytes written.
std::uint64_t write_file_atomic(const std::string& path, const std::function<void(const ByteSink&)>& body,
                                unsigned mode = 0666);
std::uint64_t write_file_atomic(const std::string& path, std::span<const std::uint8_t> bytes, unsigned mode = 0666);

// Whether `pid_text` is a process id (decimal, > 0) of no running process:
// the owner of a leftover named after its pid is gone.
bool names_dead_process(std::string_view pid_text);

// Deletes "<dir>/<prefix>*.part.<pid>" of pids that no longer run (what a
// writer killed half-way left); returns how many it removed.
int remove_stale_parts(const std::string& dir, std::string_view prefix = {});

// Error(io) naming `what` and the path when write_file_atomic could not
// write there (a directory, a missing or unwritable folder): called before
// long work whose result would be lost at the end.
void check_output_file(const std::string& path, std::string_view what);

// Error(io) "<what> '<path>': is a directory" before a reader opens it,
// where a stream would fail with a message naming no file (a missing file is
// left to the reader's own open, whose message names it).
void check_input_file(const std::string& path, std::string_view what);
// The same, and Error(io) "... is not a regular file" for a FIFO or device
// (which could block a reader forever, or never end, like /dev/zero).
void check_regular_file(const std::string& path, std::string_view what);

}  // namespace qkvshare
