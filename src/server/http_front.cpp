// The server's answers under its routes (http_front.hpp).
#include "qkvshare/server/http_front.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <strings.h>

#include "qkvshare/server/api.hpp"

namespace qkvshare::server {

namespace {

bool expects_body(const std::string& method) { return method == "POST" || method == "PUT" || method == "PATCH"; }

// The methods the library routes (others it refuses with 400 before any route).
bool known_method(const std::string& m) {
  return m == "GET" || m == "HEAD" || m == "POST" || m == "PUT" || m == "PATCH" || m == "DELETE" || m == "OPTIONS";
}

// Content-Length is 1*DIGIT (RFC 9110 8.6); a repeated header must repeat the value.
std::optional<std::uint64_t> content_length(const httplib::Request& req) {
  std::optional<std::uint64_t> length;
  const std::size_t n = req.get_header_value_count("Content-Length");
  for (std::size_t i = 0; i < n; ++i) {
    const std::string v = req.get_header_value("Content-Length", i);
    std::uint64_t x = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    const bool digits = !v.empty() && std::all_of(v.begin(), v.end(), [](unsigned char c) { return c >= '0' && c <= '9'; });
    if (!digits || ec != std::errc() || end != v.data() + v.size() || (length && *length != x)) return std::nullopt;
    length = x;
  }
  return length;
}

std::string kib(std::size_t bytes) { return fmt::format("{} KiB", bytes >> 10); }

}  // namespace

std::optional<HttpError> check_framing(const httplib::Request& req, std::size_t max_body_bytes) {
  bool chunked = false;
  if (req.has_header("Transfer-Encoding")) {
    const std::string te = req.get_header_value("Transfer-Encoding");
    if (strcasecmp(te.c_str(), "chunked") != 0)
      return HttpError{501, "not_implemented",
                       fmt::format("Transfer-Encoding {} is not supported: send the body with Content-Length or as chunked",
                                   quote_input(te))};
    chunked = true;
  }
  if (req.has_header("Content-Length")) {
    const auto length = content_length(req);
    if (!length)
      return HttpError{400, "invalid_request_error",
                       fmt::format("invalid Content-Length {}: it must be one decimal number of bytes",
                                   quote_input(req.get_header_value("Content-Length")))};
    if (*length > max_body_bytes)
      return HttpError{413, "request_too_large",
                       fmt::format("the request body ({} bytes) is larger than the server's limit of {} (--max-body-kib)",
                                   *length, kib(max_body_bytes))};
  } else if (!chunked && expects_body(req.method)) {
    return HttpError{411, "invalid_request_error",
                     fmt::format("{} needs Content-Length or Transfer-Encoding: chunked", req.method)};
  }
  // The library would parse it into form fields, which no route reads.
  if (req.is_multipart_form_data())
    return HttpError{415, "invalid_request_error", "a multipart/form-data body is not accepted: send JSON"};
  return std::nullopt;
}

std::string library_error_message(const httplib::Request& req, int status, std::size_t max_body_bytes) {
  switch (status) {
    case 400:
      // What the library filled in tells how far it got: the request line
      // first (method, target, version), then headers, then the body.
      if (req.version.empty()) return "malformed request line: expected 'METHOD /path HTTP/1.1' ending in CRLF";
      if (req.version != "HTTP/1.1" && req.version != "HTTP/1.0")
        return fmt::format("unsupported HTTP version {} (this server speaks HTTP/1.1 and 1.0)", quote_input(req.version));
      if (!known_method(req.method))
        return fmt::format("unsupported method {}", quote_input(req.method));
      return "malformed request: a header line (longer than 8192 bytes, or not 'Name: value'), a %-escape in the "
             "URL, or the body's framing (chunk sizes, a body shorter than its Content-Length) is invalid";
    case 411: return "a request with a body needs Content-Length or Transfer-Encoding: chunked";
    case 413: return fmt::format("the request body is larger than the server's limit of {} (--max-body-kib)", kib(max_body_bytes));
    case 414: return fmt::format("the request line (URI) is longer than the limit of {} bytes", CPPHTTPLIB_REQUEST_URI_MAX_LENGTH);
    case 415:
      return fmt::format("Content-Encoding {} is not supported: send the body uncompressed",
                         quote_input(req.get_header_value("Content-Encoding")));
    case 416: return "the Range header is not valid; this API does not serve byte ranges (send the request without it)";
    default: return fmt::format("HTTP {}", status);
  }
}

void ElasticTaskQueue::enqueue(std::function<void()> fn) {
  std::lock_guard lock(mu_);
  if (stopping_) return;  // the library stops accepting before it shuts the queue down
  jobs_.push_back(std::move(fn));
  if (idle_ < jobs_.size() && threads_.size() < max_threads_) threads_.emplace_back([this] { work(); });
  cv_.notify_one();
}

void ElasticTaskQueue::shutdown() {
  std::vector<std::thread> threads;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    threads.swap(threads_);
  }
  cv_.notify_all();
  for (std::thread& t : threads) t.join();
}

void ElasticTaskQueue::work() {
  for (;;) {
    std::unique_lock lock(mu_);
    ++idle_;
    cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
    --idle_;
    if (jobs_.empty()) return;  // stopping, nothing left
    std::function<void()> fn = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    fn();
  }
}

}  // namespace qkvshare::server
