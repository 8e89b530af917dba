#pragma once
// The OpenAI-compatible request surface of `qkvshare serve`: decoding a
// request body into a checked CompletionRequest, and the error type that
// carries an HTTP status and OpenAI's error shape. Decoding never trusts the
// body: every field is type- and range-checked and a bad one is named in the
// error (`param`), as OpenAI does.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/model/tokenizer.hpp"

namespace qkvshare::server {

// An Error with the HTTP status and OpenAI error `type`/`param` it maps to.
// Still a qkvshare::Error, so the one error style holds (docs/design.md rule 6).
class ApiError : public Error {
 public:
  ApiError(int status, std::string type, std::string param, const std::string& message)
      : Error(status == 503 ? ErrorCode::out_of_memory : status == 501 ? ErrorCode::unsupported
              : status >= 500 ? ErrorCode::internal : ErrorCode::invalid_argument, message),
        status_(status), type_(std::move(type)), param_(std::move(param)) {}
  int status() const noexcept { return status_; }
  const std::string& type() const noexcept { return type_; }
  const std::string& param() const noexcept { return param_; }

 private:
  int status_;
  std::string type_, param_;
};

// 400 invalid_request_error naming `param`.
[[noreturn]] void bad_request(std::string_view param, const std::string& message);

// A client's string quoted for an error message: 'text', control characters
// as \u00XX (an exception's message is a C string: a NUL would cut it short).
std::string quote_input(std::string_view text);

// {"error": {"message", "type", "param", "code"}}.
std::string error_body(int status, std::string_view type, std::string_view param, std::string_view message);
// The status and body of any exception escaping a handler: ApiError as is,
// other qkvshare::Error by its code (context_full 400, out_of_memory 503,
// bad_descriptor 404, unsupported 501, others 500).
std::pair<int, std::string> error_response(const std::exception& e);

enum class Endpoint { chat, completion };

enum class ReuseMode { none, continue_, fork, splice };
std::string_view to_string(ReuseMode mode) noexcept;

// The `qkvshare` extension object of a request (clients that do not know it
// never send it; docs/server.md has the schema).
struct Extension {
  std::string context;                 // a handle (descriptor) or a context id "ctx-..."; empty: none
  ReuseMode mode = ReuseMode::none;    // continue (default with a context) | fork | splice
  std::optional<std::string> kv;       // KV format of a new context (kv_format.hpp syntax)
  std::vector<std::string> grant_to;   // agent ids that get a handle to the result
  bool auto_reuse = true;              // "reuse": false turns the index off for this request
  std::optional<double> recompute;     // splice: share of the reused span recomputed (0..1; SpliceOptions)
};

struct Limits {
  int max_tokens = 4096;     // generated tokens per choice
  int max_n = 8;             // choices per request
  int max_messages = 1024;
  int max_stops = 4;
  std::size_t max_string_bytes = std::size_t{1} << 20;
};

struct CompletionRequest {
  Endpoint endpoint = Endpoint::chat;
  std::string model;
  std::vector<ChatMessage> messages;   // chat
  std::string prompt;                  // completion (text)
  std::vector<TokenId> prompt_ids;     // completion given as token ids
  int max_tokens = 256;
  float temperature = 1.0f;            // OpenAI defaults
  float top_p = 1.0f;
  std::vector<std::string> stop;
  std::optional<std::uint64_t> seed;
  int n = 1;
  bool stream = false;
  bool include_usage = false;          // stream_options.include_usage
  bool ignore_eos = false;             // llama-server's and vLLM's extension: end-of-turn tokens do not end a reply
  Extension ext;
};

// Throws ApiError(400) naming the field for malformed JSON, wrong types,
// out-of-range values, unsupported options that change the output (tools,
// logprobs, penalties, ...) and unknown fields of the `qkvshare` object.
// Unknown top-level fields are ignored, as OpenAI-compatible servers do.
CompletionRequest decode_request(Endpoint endpoint, std::string_view body, const Limits& limits = {});

// Body of POST /v1/contexts/{id}/fork: optional {"grant_to": [...]}.
std::vector<std::string> decode_fork_request(std::string_view body);

// Handles on the wire: "qkv1." + base64url(256-byte descriptor), no padding.
std::string encode_handle(const std::vector<std::uint8_t>& descriptor_bytes);
// Throws ApiError(400, param) when `text` is not a handle.
std::vector<std::uint8_t> decode_handle(std::string_view text, std::string_view param);

}  // namespace qkvshare::server
