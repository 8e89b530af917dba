#pragma once
// The one error-handling style of the code base (docs/design.md rule 6): every
// failure that a caller or user can cause throws qkvshare::Error with a code
// and a message that names the input, the item and the reason. Programming
// errors (broken invariants) are also Error with ErrorCode::internal. Entry
// points (CLI, server) catch Error at the top, print it and exit non-zero.
#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <string_view>

namespace qkvshare {

enum class ErrorCode {
  invalid_argument,  // a flag, request or API argument is wrong
  bad_model_file,    // a model file (GGUF, llama2.c) is malformed or unsupported
  bad_tokenizer,     // tokenizer data is malformed
  unsupported,       // a valid input that this build does not handle
  io,                // the OS refused (open, mmap, read, shm)
  context_full,      // a sequence would exceed the context length
  out_of_memory,     // a pool or arena is exhausted
  bad_descriptor,    // a context descriptor failed validation
  bad_workflow,      // a workflow file is invalid
  internal,          // a broken invariant: a bug
};

std::string_view to_string(ErrorCode code) noexcept;

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

template <typename... Args>
[[noreturn]] void fail(ErrorCode code, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(code, fmt::format(format, std::forward<Args>(args)...));
}

// Checks an internal invariant; unlike assert it stays on in release builds.
#define QKV_CHECK(cond)                                                                    \
  do {                                                                                     \
    if (!(cond)) ::qkvshare::fail(::qkvshare::ErrorCode::internal, "{}:{}: check failed: {}", \
                                  __FILE__, __LINE__, #cond);                              \
  } while (0)

}  // namespace qkvshare
