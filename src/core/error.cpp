#include "qkvshare/core/error.hpp"

namespace qkvshare {

std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::invalid_argument: return "invalid argument";
    case ErrorCode::bad_model_file: return "bad model file";
    case ErrorCode::bad_tokenizer: return "bad tokenizer";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::io: return "I/O error";
    case ErrorCode::context_full: return "context full";
    case ErrorCode::out_of_memory: return "out of memory";
    case ErrorCode::bad_descriptor: return "bad descriptor";
    case ErrorCode::bad_workflow: return "bad workflow";
    case ErrorCode::internal: return "internal error";
  }
  return "unknown error";
}

}  // namespace qkvshare
