#include "test_paths.hpp"

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <vector>

namespace qkvshare::testing {

namespace fs = std::filesystem;

std::string shared_path(std::string_view relative) {
  return (fs::path(QKVSHARE_SHARED_DIR) / relative).string();
}

std::optional<std::string> smollm2_path() {
  if (const char* env = std::getenv("QKVSHARE_MODEL"); env != nullptr && *env != '\0') {
    if (fs::exists(env)) return std::string(env);
    return std::nullopt;
  }
  fs::path dir;
  if (const char* cache = std::getenv("QKVSHARE_CACHE"); cache != nullptr && *cache != '\0') {
    dir = cache;
  } else if (const char* home = std::getenv("HOME"); home != nullptr) {
    dir = fs::path(home) / ".cache" / "qkvshare" / "models";
  }
  const fs::path p = dir / "SmolLM2-135M-Instruct.Q4_1.gguf";
  if (fs::exists(p)) return p.string();
  return std::nullopt;
}

namespace {
struct TempDirs {
  std::mutex mutex;
  std::vector<fs::path> dirs;
  ~TempDirs() {
    std::error_code ec;
    for (const auto& d : dirs) fs::remove_all(d, ec);
  }
};
TempDirs& temp_dirs() {
  static TempDirs dirs;
  return dirs;
}
}  // namespace

std::string temp_dir() {
  std::string pattern = (fs::temp_directory_path() / "qkvshare-test-XXXXXX").string();
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  const char* made = ::mkdtemp(buf.data());
  if (made == nullptr) throw std::runtime_error("mkdtemp failed");
  auto& dirs = temp_dirs();
  std::lock_guard lock(dirs.mutex);
  dirs.dirs.emplace_back(made);
  return made;
}

std::string cli_path() { return QKVSHARE_CLI_PATH; }
std::string source_path(std::string_view relative) {
  return (fs::path(QKVSHARE_SOURCE_DIR) / relative).string();
}

}  // namespace qkvshare::testing
