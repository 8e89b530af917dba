// The HTTP front under the routes: framing answered from the headers, the
// library's own errors explained, the task queue that grows.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>

#include "qkvshare/server/http_front.hpp"

using namespace qkvshare::server;

namespace {

httplib::Request request(std::string method, httplib::Headers headers) {
  httplib::Request r;
  r.method = std::move(method);
  r.version = "HTTP/1.1";
  r.path = "/v1/chat/completions";
  r.headers = std::move(headers);
  return r;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

constexpr std::size_t kLimit = std::size_t{8} << 20;

}  // namespace

TEST(HttpFront, FramingThatCanBeServed) {
  EXPECT_FALSE(check_framing(request("POST", {{"Content-Length", "42"}}), kLimit));
  EXPECT_FALSE(check_framing(request("POST", {{"Content-Length", std::to_string(kLimit)}}), kLimit));
  EXPECT_FALSE(check_framing(request("POST", {{"Transfer-Encoding", "Chunked"}}), kLimit));
  EXPECT_FALSE(check_framing(request("GET", {}), kLimit));
  EXPECT_FALSE(check_framing(request("DELETE", {}), kLimit));  // clients send a DELETE without a body or its length
  EXPECT_FALSE(check_framing(request("POST", {{"Content-Length", "7"}, {"Content-Length", "7"}}), kLimit));
}

TEST(HttpFront, FramingRefusedFromTheHeaders) {
  const auto too_big = check_framing(request("POST", {{"Content-Length", "1000000000000"}}), kLimit);
  ASSERT_TRUE(too_big);
  EXPECT_EQ(too_big->status, 413);
  EXPECT_TRUE(has(too_big->message, "limit of 8192 KiB (--max-body-kib)")) << too_big->message;
  for (const char* bad : {"-5", "+5", "5 ", "0x10", "", "99999999999999999999999"}) {
    const auto e = check_framing(request("POST", {{"Content-Length", bad}}), kLimit);
    ASSERT_TRUE(e) << bad;
    EXPECT_EQ(e->status, 400) << bad;
    EXPECT_TRUE(has(e->message, "invalid Content-Length")) << e->message;
  }
  const auto twice = check_framing(request("POST", {{"Content-Length", "7"}, {"Content-Length", "8"}}), kLimit);
  ASSERT_TRUE(twice);
  EXPECT_EQ(twice->status, 400);
  const auto none = check_framing(request("POST", {}), kLimit);
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 411);
  EXPECT_TRUE(has(none->message, "POST needs Content-Length or Transfer-Encoding: chunked")) << none->message;
  const auto coding = check_framing(request("POST", {{"Transfer-Encoding", "gzip, chunked"}}), kLimit);
  ASSERT_TRUE(coding);
  EXPECT_EQ(coding->status, 501);
  EXPECT_TRUE(has(coding->message, "'gzip, chunked'")) << coding->message;
  const auto form = check_framing(
      request("POST", {{"Content-Length", "9"}, {"Content-Type", "multipart/form-data; boundary=x"}}), kLimit);
  ASSERT_TRUE(form);
  EXPECT_EQ(form->status, 415);
}

TEST(HttpFront, TheLibrarysErrorsSayWhatIsWrong) {
  httplib::Request line;  // the request line did not parse
  EXPECT_TRUE(has(library_error_message(line, 400, kLimit), "malformed request line"));
  httplib::Request version = request("GET", {});
  version.version = "HTTP/9.9";
  EXPECT_TRUE(has(library_error_message(version, 400, kLimit), "unsupported HTTP version 'HTTP/9.9'"));
  EXPECT_TRUE(has(library_error_message(request("BREW", {}), 400, kLimit), "unsupported method 'BREW'"));
  EXPECT_TRUE(has(library_error_message(request("TRACE", {}), 400, kLimit), "unsupported method 'TRACE'"));
  EXPECT_TRUE(has(library_error_message(request("POST", {}), 400, kLimit), "malformed request"));
  EXPECT_TRUE(has(library_error_message(request("POST", {}), 411, kLimit), "Content-Length or Transfer-Encoding"));
  EXPECT_TRUE(has(library_error_message(request("POST", {}), 413, kLimit), "limit of 8192 KiB (--max-body-kib)"));
  EXPECT_TRUE(has(library_error_message(request("GET", {}), 414, kLimit), "longer than the limit of 8192 bytes"));
  EXPECT_TRUE(has(library_error_message(request("GET", {}), 416, kLimit), "does not serve byte ranges"));
}

TEST(HttpFront, TaskQueueGrowsWhileEveryThreadIsHeld) {
  ElasticTaskQueue queue(8);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> started{0};
  for (int i = 0; i < 4; ++i)  // four slow clients
    queue.enqueue([&started, released] {
      ++started;
      released.wait();
    });
  std::promise<void> served;
  queue.enqueue([&served] { served.set_value(); });  // a fifth does not wait for them
  EXPECT_EQ(served.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  release.set_value();
  queue.shutdown();
  EXPECT_EQ(started.load(), 4);
}

TEST(HttpFront, TaskQueueQueuesBeyondItsLimitAndDrainsAtShutdown) {
  ElasticTaskQueue queue(2);
  std::atomic<int> ran{0};
  for (int i = 0; i < 50; ++i) queue.enqueue([&ran] { ++ran; });
  queue.shutdown();
  EXPECT_EQ(ran.load(), 50);
}
