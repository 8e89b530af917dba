// libFuzzer target for the server's request path: cpp-httplib's HTTP parser
// (request line, headers, chunked bodies, Content-Length) in front of the
// request decoder (JSON -> CompletionRequest, the qkvshare extension,
// handles). Inputs whose first byte is odd skip HTTP and go straight to the
// decoder, so that coverage feedback (the decoder is instrumented; Debian's
// libcpp-httplib.so is not) reaches the JSON checks quickly. Any exception
// other than an ApiError answer, and any sanitizer report, is a finding.
//   CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DQKVSHARE_FUZZ=ON && cmake --build build-fuzz --target fuzz_http
//   ./build-fuzz/tests/fuzz/fuzz_http -max_total_time=60 tests/fuzz/corpus_http
#include <httplib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "qkvshare/server/api.hpp"
#include "qkvshare/server/server.hpp"

namespace {

class FuzzedStream final : public httplib::Stream {
 public:
  FuzzedStream(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  bool is_readable() const override { return true; }
  bool is_writable() const override { return true; }
  ssize_t read(char* ptr, std::size_t size) override {
    const std::size_t n = std::min(size, size_ - pos_);
    std::memcpy(ptr, data_ + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, std::size_t size) override {
    response_.append(ptr, size);
    return static_cast<ssize_t>(size);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = "127.0.0.1";
    port = 1;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip = "127.0.0.1";
    port = 2;
  }
  socket_t socket() const override { return 0; }
  const std::string& response() const { return response_; }

 private:
  const std::uint8_t* data_;
  std::size_t size_, pos_ = 0;
  std::string response_;
};

class FuzzableServer : public httplib::Server {
 public:
  FuzzableServer() {
    set_payload_max_length(1 << 16);
    qkvshare::server::install_decode_only_routes(*this);
  }
  void run(FuzzedStream& stream) {
    bool closed = false;
    process_request(stream, /*close_connection=*/true, closed, nullptr);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  if (data[0] & 1) {
    const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
    for (const auto e : {qkvshare::server::Endpoint::chat, qkvshare::server::Endpoint::completion}) {
      try {
        const auto r = qkvshare::server::decode_request(e, body);
        if (r.ext.context.rfind("qkv1.", 0) == 0) qkvshare::server::decode_handle(r.ext.context, "qkvshare.context");
      } catch (const qkvshare::server::ApiError& err) {
        if (err.status() != 400) {
          std::fprintf(stderr, "decoder answered %d: %s\n", err.status(), err.what());
          std::abort();
        }
      }
    }
    return 0;
  }
  static FuzzableServer server;
  FuzzedStream stream(data + 1, size - 1);
  server.run(stream);
  // A request cut off before its request line closes the connection silently;
  // anything else must be answered with an HTTP response.
  if (!stream.response().empty() && stream.response().rfind("HTTP/1.1 ", 0) != 0) {
    std::fprintf(stderr, "a malformed HTTP response for the input\n");
    std::abort();
  }
  return 0;
}
