#include "agent/admin_server.h"

namespace kiln {

namespace http = web::http;

namespace {

void Handle(const AdminHandlers& handlers, http::http_request r) {
  std::string path = r.relative_uri().path();
  try {
    if (path == "/healthz") {
      bool ok = handlers.live();
      ReplyQuietly(r, ok ? 200 : 503, ok ? "ok\n" : "event loop stalled\n", "text/plain");
    } else if (path == "/readyz") {
      bool ok = handlers.ready();
      ReplyQuietly(r, ok ? 200 : 503, ok ? "ready\n" : "not serving the assignment yet\n", "text/plain");
    } else if (path == "/metrics") {
      ReplyQuietly(r, 200, handlers.metrics(), "text/plain; version=0.0.4; charset=utf-8");
    } else if (path == "/v1/replicas") {
      ReplyQuietly(r, 200, handlers.replicas(), "application/json");
    } else {
      ReplyQuietly(r, 404, "no such endpoint\n", "text/plain");
    }
  } catch (const std::exception& e) {
    ReplyQuietly(r, 500, std::string("internal error: ") + e.what() + "\n", "text/plain");
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpListener>> StartAdminServer(const std::string& bind, int port,
                                                               AdminHandlers handlers) {
  return HttpListener::Start(
      bind, port, {http::methods::GET},
      [handlers = std::move(handlers)](http::http_request r) { Handle(handlers, std::move(r)); },
      "--admin-port/--admin-bind");
}

}  // namespace kiln
