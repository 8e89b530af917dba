// core/file_io.hpp: whole files or none, devices written in place, and the
// path checks that run before long work.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"
#include "test_paths.hpp"

namespace qkvshare {
namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::span<const std::uint8_t> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

bool has_part_file(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().find(".part.") != std::string::npos) return true;
  return false;
}

template <class F>
std::string error_of(F f, ErrorCode want) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), want) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no Error thrown";
  return {};
}

TEST(WriteFileAtomic, ReplacesAWholeFileAndCountsBytes) {
  const std::string dir = testing::temp_dir(), path = dir + "/out.bin";
  std::ofstream(path) << "old contents, longer than the new";
  EXPECT_EQ(write_file_atomic(path, bytes_of("new")), 3u);
  EXPECT_EQ(read_all(path), "new");
  EXPECT_FALSE(has_part_file(dir));
}

TEST(WriteFileAtomic, AFailedBodyLeavesTheOldFileAndNoPart) {
  const std::string dir = testing::temp_dir(), path = dir + "/keep.bin";
  std::ofstream(path) << "kept";
  EXPECT_THROW(write_file_atomic(path,
                                 [](const ByteSink& sink) {
                                   sink(bytes_of("half"));
                                   throw std::runtime_error("the producer failed");
                                 }),
               std::runtime_error);
  EXPECT_EQ(read_all(path), "kept");
  EXPECT_FALSE(has_part_file(dir));
}

// A writer killed half-way leaves "<name>.part.<pid>"; the next write of the
// same name removes it, and nothing of a live writer or another name.
TEST(WriteFileAtomic, RemovesPartsThatDeadWritersLeft) {
  const std::string dir = testing::temp_dir();
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);  // a pid that no longer runs
  const std::string dead = ".part." + std::to_string(child), live = ".part." + std::to_string(::getppid());
  for (const std::string& name : {"out.bin" + dead, "out.bin" + live, "other.bin" + dead})
    std::ofstream(dir + "/" + name) << "half";
  write_file_atomic(dir + "/out.bin", bytes_of("whole"));
  EXPECT_EQ(read_all(dir + "/out.bin"), "whole");
  EXPECT_FALSE(std::filesystem::exists(dir + "/out.bin" + dead));
  EXPECT_TRUE(std::filesystem::exists(dir + "/out.bin" + live));    // its writer may still finish
  EXPECT_TRUE(std::filesystem::exists(dir + "/other.bin" + dead));  // another name's, left to its writer
  EXPECT_EQ(remove_stale_parts(dir), 1);
  EXPECT_FALSE(std::filesystem::exists(dir + "/other.bin" + dead));
}

TEST(WriteFileAtomic, NamesADirectoryAndAMissingFolder) {
  const std::string dir = testing::temp_dir();
  EXPECT_EQ(error_of([&] { write_file_atomic(dir, bytes_of("x")); }, ErrorCode::io), dir + ": is a directory");
  const std::string missing = dir + "/no/such/folder/f.bin";
  EXPECT_NE(error_of([&] { write_file_atomic(missing, bytes_of("x")); }, ErrorCode::io).find(missing), std::string::npos);
  EXPECT_FALSE(has_part_file(dir));
}

// Renaming over /dev/null (or any device or FIFO) would replace it with a
// plain file: such a target is written in place and stays what it was.
TEST(WriteFileAtomic, WritesAFifoInPlace) {
  const std::string path = testing::temp_dir() + "/pipe";
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  std::string got;
  std::thread reader([&] { got = read_all(path); });
  EXPECT_EQ(write_file_atomic(path, bytes_of("through the pipe")), 16u);
  reader.join();
  EXPECT_EQ(got, "through the pipe");
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}

TEST(PathChecks, NameWhatIsWrongBeforeAnyWork) {
  const std::string dir = testing::temp_dir();
  EXPECT_EQ(error_of([&] { check_output_file(dir, "--json"); }, ErrorCode::io), "--json '" + dir + "': is a directory");
  EXPECT_NE(error_of([&] { check_output_file(dir + "/none/x.json", "--json"); }, ErrorCode::io).find("folder " + dir + "/none"),
            std::string::npos);
  EXPECT_NO_THROW(check_output_file(dir + "/new.json", "--json"));
  EXPECT_NO_THROW(check_output_file("/dev/null", "--json"));

  EXPECT_EQ(error_of([&] { check_input_file(dir, "--text"); }, ErrorCode::io), "--text '" + dir + "': is a directory");
  EXPECT_NO_THROW(check_input_file(dir + "/missing.txt", "--text"));  // left to the reader's open
  EXPECT_NO_THROW(check_input_file("/dev/null", "--text"));
  EXPECT_EQ(error_of([&] { check_regular_file("/dev/null", "document"); }, ErrorCode::io),
            "document '/dev/null': not a regular file");
  const std::string file = dir + "/doc.txt";
  std::ofstream(file) << "text";
  EXPECT_NO_THROW(check_regular_file(file, "document"));
}

}  // namespace
}  // namespace qkvshare
