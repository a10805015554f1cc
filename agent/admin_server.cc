#include "agent/admin_server.h"

#include <charconv>
#include <string_view>

#include "common/status.h"

namespace kiln {

namespace {

// POST /v1/fake-gpus/{index}/xid/{code}.
void InjectXid(const AdminHandlers& handlers, const std::string& path, const std::string& method,
               const HttpReply& r) {
  if (!handlers.inject_xid) {
    r.Send(404, "no fake GPUs on this agent (only with --fake-gpus)\n", "text/plain");
    return;
  }
  if (method != "POST") {
    r.Send(405, "POST /v1/fake-gpus/{index}/xid/{code}\n", "text/plain");
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
    r.Send(400, "path: want /v1/fake-gpus/{index}/xid/{code} (digits), got " + path + "\n",
                 "text/plain");
    return;
  }
  absl::Status s = handlers.inject_xid(index, xid);
  r.Send(s.ok() ? 200 : HttpStatusFromCode(s.code()),
               s.ok() ? "xid " + std::to_string(xid) + " on fake GPU " + std::to_string(index) + "\n"
                      : std::string(s.message()) + "\n",
               "text/plain");
}

void Handle(const AdminHandlers& handlers, const HttpRequest& request, const HttpReply& r) {
  const std::string& path = request.path;
  try {
    if (request.method != "GET" && request.method != "POST") {
      r.Send(405, "method " + request.method + " is not allowed here\n", "text/plain");
    } else if (path == "/healthz") {
      bool ok = handlers.live();
      r.Send(ok ? 200 : 503, ok ? "ok\n" : "event loop stalled\n", "text/plain");
    } else if (path == "/readyz") {
      bool ok = handlers.ready();
      r.Send(ok ? 200 : 503, ok ? "ready\n" : "not serving an assignment yet\n", "text/plain");
    } else if (path == "/metrics") {
      r.Send(200, handlers.metrics(), "text/plain; version=0.0.4; charset=utf-8");
    } else if (path == "/v1/replicas") {
      r.Send(200, handlers.replicas(), "application/json");
    } else if (path.rfind("/v1/fake-gpus/", 0) == 0) {
      InjectXid(handlers, path, request.method, r);
    } else {
      r.Send(404, "no such endpoint\n", "text/plain");
    }
  } catch (const std::exception& e) {
    r.Send(500, std::string("internal error: ") + e.what() + "\n", "text/plain");
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpServer>> StartAdminServer(const std::string& bind, int port,
                                                             AdminHandlers handlers) {
  HttpServer::Options o;
  o.bind_address = bind;
  o.port = port;
  // More than one: a /metrics scrape asks every replica for its Stats (2 s each for a hung one),
  // and /healthz and /readyz must not wait behind it.
  o.threads = 4;
  o.max_body_bytes = 64 * 1024;  // nothing it serves takes a body
  o.flags = "--admin-port/--admin-bind";
  return HttpServer::Start(o, [handlers = std::move(handlers)](HttpRequest request, HttpReply r) {
    Handle(handlers, request, r);
  });
}

}  // namespace kiln
