#pragma once
// What the server decides under its routes, in cpp-httplib 0.11's terms
// (docs/server.md "HTTP"). The library reads a request's body before any
// route sees it, answers what it cannot parse with a bare status, and runs
// every connection on a thread of its task queue; these are the server's
// answers to each: the framing checked from the headers (a pre-routing
// handler), a message for the library's own error statuses, and a task
// queue that grows, so that slow clients do not take every thread.
#include <httplib.h>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace qkvshare::server {

struct HttpError {
  int status = 400;
  std::string type, message;
};

// A request whose headers already say it cannot be served: a body over
// `max_body_bytes` (413), a Content-Length that is not one decimal number
// (400), a transfer coding other than chunked (501), a POST, PUT or PATCH
// with neither Content-Length nor chunked encoding (411: the library would
// read such a body until the client closes), or a multipart/form-data body
// (415). Answered before the body is read.
std::optional<HttpError> check_framing(const httplib::Request& req, std::size_t max_body_bytes);

// The message for a status the library set itself, before or instead of a
// route: `req` holds what it parsed of the request line and headers.
std::string library_error_message(const httplib::Request& req, int status, std::size_t max_body_bytes);

// httplib's ThreadPool starts a fixed number of threads and queues the
// connections beyond them: a few dozen clients that send their request slowly
// (each holds its thread until the read timeout) would make every other
// client wait. This one starts a thread whenever no thread is idle, up to
// `max_threads`, and keeps it for later connections.
class ElasticTaskQueue final : public httplib::TaskQueue {
 public:
  explicit ElasticTaskQueue(std::size_t max_threads) : max_threads_(max_threads) {}
  ~ElasticTaskQueue() override { shutdown(); }
  void enqueue(std::function<void()> fn) override;
  void shutdown() override;  // runs what is queued, then joins every thread

 private:
  void work();

  const std::size_t max_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  std::size_t idle_ = 0;
  bool stopping_ = false;
};

}  // namespace qkvshare::server
