#pragma once

// An HTTP/1.1 server (Boost.Beast) for the runtime's REST front end, the node router's REST
// ingress and the agent's and controller's admin endpoints.
//
// What it guarantees a caller, whatever the client does:
// - a body whose declared Content-Length is over `max_body_bytes` is refused with 413 from its
//   header alone, before a byte of it is read; a chunked body is cut (413) at the limit;
// - a header over `max_header_bytes` gets 431, a malformed request 400; each closes the
//   connection (after reading and dropping, for `linger_timeout`, what the client still
//   sends, so that it reads the error instead of a connection reset);
// - a client that does not finish its request header within `header_timeout` (counted from
//   the connection's accept or its previous reply), or its body within `body_timeout`, is
//   disconnected, so slow clients cannot hold connections forever;
// - keep-alive connections, `Expect: 100-continue` answered;
// - a handler may answer from any thread, later (HttpReply); a request whose every HttpReply
//   copy is dropped unanswered gets 500 rather than hanging.
// Errors the server sends itself have a JSON body {"error": "..."}.

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
#include "common/uri.h"

namespace kiln {

struct HttpRequest {
  std::string method;  // as sent: "GET", "POST", ...
  std::string path;    // the target before '?', still percent-encoded
  std::string query;   // the target after '?', still percent-encoded
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;

  // The value of the first header named `name` (case-insensitive), if any.
  std::optional<std::string_view> Header(std::string_view name) const;
};

struct HttpResponse {
  int code = 200;
  std::string body;
  std::string content_type = "text/plain";
  std::vector<std::pair<std::string, std::string>> headers;  // extra ones
};

namespace http_internal {
class ReplySlot;
}

// The one answer to one request. Copies share it: the first Send wins, later ones are
// dropped. Send may be called from any thread; it never blocks on the client.
class HttpReply {
 public:
  explicit HttpReply(std::shared_ptr<http_internal::ReplySlot> slot) : slot_(std::move(slot)) {}
  void Send(HttpResponse response) const;
  void Send(int code, std::string body, std::string content_type) const;

 private:
  std::shared_ptr<http_internal::ReplySlot> slot_;
};

class HttpServer {
 public:
  struct Options {
    std::string bind_address = "0.0.0.0";
    int port = 0;  // 0 = pick a free port
    int threads = 2;
    int64_t max_body_bytes = 64LL * 1024 * 1024;
    int64_t max_header_bytes = 16 * 1024;
    absl::Duration header_timeout = absl::Seconds(60);
    absl::Duration body_timeout = absl::Seconds(120);
    absl::Duration write_timeout = absl::Seconds(60);
    // After a reply that closes the connection, how long what the client still sends (a
    // refused body) is read and dropped, so it sees the reply rather than a reset.
    absl::Duration linger_timeout = absl::Seconds(5);
    // Names the options that chose bind address and port, for the error when it cannot listen.
    std::string flags = "--bind-address/--port";
    // After each piece of work (a request read, a handler run, a reply written), a thread
    // polls busily this long for more before it sleeps in the kernel (0 = never): a request
    // that comes meanwhile is read with no wake-up to pay, at the cost of up to this much of
    // a CPU each time.
    absl::Duration idle_spin = absl::ZeroDuration();
    // A listening socket handed over (systemd socket activation) to accept on instead of
    // binding `bind_address`/`port`; the server works on its own duplicate. -1 = none.
    int listen_fd = -1;
  };
  // Called on one of the server's threads for each complete request.
  using Handler = std::function<void(HttpRequest request, HttpReply reply)>;

  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(Options options, Handler handler);
  ~HttpServer();  // Stop(absl::Seconds(10))

  int port() const { return port_; }

  // Stops accepting and closes idle connections; requests already read get up to `grace` to
  // have their replies written (each then closes its connection); then everything closes.
  // Replies sent after that are dropped. Idempotent.
  void Stop(absl::Duration grace);

  class State;

 private:
  HttpServer(std::shared_ptr<State> state, int port);
  std::shared_ptr<State> state_;
  int port_;
};

// Checks that `fd` is a listening TCP socket (handed over by systemd socket activation, say)
// and returns a close-on-exec duplicate of it; errors start with `what`.
absl::StatusOr<int> DupListener(int fd, const std::string& what);
// The local TCP port of socket `fd` (IPv4 or IPv6); 0 when it has none.
int LocalPort(int fd);

// The JSON error body of the Open Inference Protocol's REST errors, {"error": "..."} (bytes
// that are not UTF-8 are replaced, never thrown on).
std::string JsonError(const std::string& message);

}  // namespace kiln
