#pragma once
// Where tests find the shared read-only models and data, the default model
// cache and the built CLI.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <string_view>

namespace qkvshare::testing {

// A path under ../shared (models/stories260K.bin, data/wikitext-2-test.raw, ...).
std::string shared_path(std::string_view relative);
// SmolLM2-135M-Instruct GGUF: $QKVSHARE_MODEL, else the set-up's cache folder
// ($QKVSHARE_CACHE or ~/.cache/qkvshare/models). nullopt when absent.
std::optional<std::string> smollm2_path();
// A fresh directory under the system temp folder, removed at exit.
std::string temp_dir();
std::string cli_path();
std::string source_path(std::string_view relative);

}  // namespace qkvshare::testing

// Skips the current test with a loud message when the default model is absent.
#define QKV_REQUIRE_SMOLLM2(var)                                                                   \
  const auto var##_opt = ::qkvshare::testing::smollm2_path();                                      \
  if (!var##_opt) {                                                                                \
    std::fprintf(stderr,                                                                           \
                 "\n*** SKIPPED: SmolLM2-135M GGUF not found. Run scripts/fetch_model.sh or set " \
                 "QKVSHARE_MODEL. ***\n\n");                                                       \
    GTEST_SKIP() << "SmolLM2-135M GGUF not found (run scripts/fetch_model.sh)";                   \
  }                                                                                                \
  const std::string var = *var##_opt
