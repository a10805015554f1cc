#pragma once

// An asynchronous HTTP/1.1 client (Boost.Beast) for the router's REST forwards: one thread,
// connections kept alive and reused per address. It replaced cpprestsdk's client there, whose
// continuations ran on that library's thread pool and cost the router hundreds of µs a call.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kiln {

struct HttpClientRequest {
  std::string method = "GET";  // GET or POST
  std::string target = "/";    // the path (and query), already encoded
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  std::string content_type;  // sent with a body
};

struct HttpClientResponse {
  int code = 0;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  // The first header of that name (case-insensitive).
  std::optional<std::string> Header(std::string_view name) const;
};

class HttpClient {
 public:
  struct Options {
    absl::Duration connect_timeout = absl::Seconds(5);
    // The whole exchange after the connection is made: writing the request and reading all of
    // the response.
    absl::Duration timeout = absl::Seconds(300);
    int64_t max_response_bytes = int64_t{1} << 30;
    // Idle connections kept per address; more are closed once their exchange ends.
    int max_idle_per_address = 32;
  };
  explicit HttpClient(Options options);
  ~HttpClient();  // Stop()
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  using Done = std::function<void(absl::StatusOr<HttpClientResponse>)>;
  // Sends `request` to `address` ("host:port"). `done` runs exactly once: on the client's
  // thread, or inline here once the client is stopped or when `address` is not host:port.
  //   UNAVAILABLE: no connection could be made, the peer closed or reset it before the whole
  //     response (when that was a kept-alive connection and none of the response had come,
  //     the request is first sent once more on a new connection), or the client is stopping;
  //   DEADLINE_EXCEEDED: a timeout passed; RESOURCE_EXHAUSTED: a response over the limit;
  //   INVALID_ARGUMENT: a bad address or request; INTERNAL: a response that is not HTTP.
  void Send(const std::string& address, HttpClientRequest request, Done done);

  // Fails every exchange in flight (UNAVAILABLE) and every later one, and waits until each
  // has had its `done`. Not from a `done` (it joins the client's thread). Idempotent.
  void Stop();

  // Connections made so far, and kept-alive ones now idle (tests: they are reused, and dropped
  // when their peer closes them).
  int64_t connections_made() const;
  int idle_connections() const;

 private:
  class Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace kiln
