// Decode-only routes (server.hpp): the request decoder behind cpp-httplib's
// parser, without an engine, for tests/fuzz/fuzz_http.cpp. Kept apart from
// server.cpp so that the fuzzer compiles only the decoder.
#include <httplib.h>

#include "qkvshare/server/api.hpp"
#include "qkvshare/server/server.hpp"

namespace qkvshare::server {

namespace {
void answer(httplib::Response& res, const std::exception& e) {
  const auto [status, body] = error_response(e);
  res.status = status;
  res.set_content(body, "application/json");
}
}  // namespace

void install_decode_only_routes(httplib::Server& http) {
  const auto decode = [](Endpoint e) {
    return [e](const httplib::Request& req, httplib::Response& res) {
      try {
        const CompletionRequest r = decode_request(e, req.body);
        if (r.ext.context.rfind("qkv1.", 0) == 0) decode_handle(r.ext.context, "qkvshare.context");
        res.set_content("{}", "application/json");
      } catch (const std::exception& ex) {
        answer(res, ex);
      }
    };
  };
  http.Post("/v1/chat/completions", decode(Endpoint::chat));
  http.Post("/v1/completions", decode(Endpoint::completion));
  http.Post(R"(/v1/contexts/([^/]+)/fork)", [](const httplib::Request& req, httplib::Response& res) {
    try {
      decode_fork_request(req.body);
      res.set_content("{}", "application/json");
    } catch (const std::exception& ex) {
      answer(res, ex);
    }
  });
}

}  // namespace qkvshare::server
