#pragma once

// A small blocking HTTP/1.1 client over one keep-alive POSIX TCP connection. It is meant for
// load generation and demos against a loopback server: no TLS, no redirects, no proxies, IPv4
// literal or "localhost" hosts only. Every request is bounded by the client's timeout (one
// deadline for connecting and receiving the whole response; each send is bounded by it too),
// so a dead or stuck server can never hang the caller.
//
// Not thread-safe: use one client per thread.

#include <chrono>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kiln::bench {

struct HostPort {
  std::string host;
  int port = 0;
};

// "127.0.0.1:8000" -> {127.0.0.1, 8000}. "localhost" maps to 127.0.0.1.
absl::StatusOr<HostPort> ParseHostPort(const std::string& address);

struct HttpResponse {
  int status = 0;
  std::string content_type;
  std::string body;
};

class HttpClient {
 public:
  HttpClient(HostPort target, std::chrono::milliseconds timeout);
  ~HttpClient();

  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Sends one request on the kept-alive connection (connecting first when needed) and reads
  // the whole response (Content-Length or chunked bodies). A request that fails before any
  // response byte arrived on a reused connection (the server closed it while idle) is retried
  // once on a fresh connection. Non-2xx statuses are returned as responses, not errors; the
  // error status is for transport failures (refused, reset, timeout, malformed response).
  absl::StatusOr<HttpResponse> Post(const std::string& path, const std::string& body,
                                    const std::string& content_type = "application/json");
  absl::StatusOr<HttpResponse> Get(const std::string& path);

  // Drops the connection; the next request reconnects.
  void Close();

  // Number of TCP connections opened so far (reconnects show up here).
  int64_t connects() const { return connects_; }

 private:
  absl::StatusOr<HttpResponse> RoundTrip(const std::string& request, bool* sent_on_reused);
  absl::StatusOr<HttpResponse> Request(const std::string& method, const std::string& path,
                                       const std::string& body, const std::string& content_type);
  absl::Status Connect();
  absl::Status SendAll(const std::string& data);
  // Reads more bytes into buffer_; an error on EOF, timeout or socket failure.
  absl::Status ReadMore();
  absl::StatusOr<std::string> ReadLine();
  absl::Status ReadExactly(size_t n, std::string* out);

  HostPort target_;
  std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point deadline_;  // of the request under way
  int fd_ = -1;
  std::string buffer_;  // received and not yet consumed bytes
  size_t buffer_pos_ = 0;
  int64_t connects_ = 0;
};

}  // namespace kiln::bench
