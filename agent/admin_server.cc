#include "agent/admin_server.h"

#include <charconv>
#include <string_view>

#include "common/status.h"

namespace kiln {

namespace http = web::http;

namespace {

// POST /v1/fake-gpus/{index}/xid/{code}.
void InjectXid(const AdminHandlers& handlers, const std::string& path, http::http_request& r) {
  if (!handlers.inject_xid) {
    ReplyQuietly(r, 404, "no fake GPUs on this agent (only with --fake-gpus)\n", "text/plain");
    return;
  }
  if (r.method() != http::methods::POST) {
    ReplyQuietly(r, 405, "POST /v1/fake-gpus/{index}/xid/{code}\n", "text/plain");
    return;
  }
  // Digits only: /v1/fake-gpus/{index}/xid/{code}.
  auto number = [](std::string_view text, auto* out) {
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
    return ec == std::errc() && end == text.data() + text.size() && !text.empty() &&
           text.front() != '-' && text.front() != '+';
  };
  std::string_view rest(path);
  rest.remove_prefix(std::string_view("/v1/fake-gpus/").size());
  size_t slash = rest.find('/');
  int index = -1;
  uint64_t xid = 0;
  if (slash == std::string_view::npos || rest.substr(slash, 5) != "/xid/" ||
      !number(rest.substr(0, slash), &index) || !number(rest.substr(slash + 5), &xid)) {
    ReplyQuietly(r, 400, "path: want /v1/fake-gpus/{index}/xid/{code} (digits), got " + path + "\n",
                 "text/plain");
    return;
  }
  absl::Status s = handlers.inject_xid(index, xid);
  ReplyQuietly(r, s.ok() ? 200 : HttpStatusFromCode(s.code()),
               s.ok() ? "xid " + std::to_string(xid) + " on fake GPU " + std::to_string(index) + "\n"
                      : std::string(s.message()) + "\n",
               "text/plain");
}

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
    } else if (path.rfind("/v1/fake-gpus/", 0) == 0) {
      InjectXid(handlers, path, r);
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
      bind, port, {http::methods::GET, http::methods::POST},
      [handlers = std::move(handlers)](http::http_request r) { Handle(handlers, std::move(r)); },
      "--admin-port/--admin-bind");
}

}  // namespace kiln
