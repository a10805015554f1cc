#include "agent/admin_server.h"

#include <cpprest/http_listener.h>

#include "common/net_util.h"
#include "common/status.h"

namespace kiln {

namespace http = web::http;

class AdminServer::Impl {
 public:
  Impl(const std::string& uri, Handlers h) : handlers_(std::move(h)), listener_(uri) {
    listener_.support(http::methods::GET, [this](http::http_request r) { Handle(r); });
  }
  absl::Status Open() {
    try {
      listener_.open().wait();
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return absl::UnavailableError(std::string("cannot listen: ") + e.what());
    }
  }
  ~Impl() {
    try {
      listener_.close().wait();
    } catch (const std::exception&) {
    }
  }

 private:
  void Handle(http::http_request r) {
    std::string path = r.relative_uri().path();
    auto reply = [&](int code, const std::string& body, const std::string& type) {
      http::http_response resp(static_cast<http::status_code>(code));
      resp.set_body(body, type);
      r.reply(resp).then([](pplx::task<void> t) {
        try {
          t.get();
        } catch (const std::exception&) {
        }
      });
    };
    try {
      if (path == "/healthz") {
        bool ok = handlers_.live();
        reply(ok ? 200 : 503, ok ? "ok\n" : "event loop stalled\n", "text/plain");
      } else if (path == "/readyz") {
        bool ok = handlers_.ready();
        reply(ok ? 200 : 503, ok ? "ready\n" : "not serving the assignment yet\n", "text/plain");
      } else if (path == "/metrics") {
        reply(200, handlers_.metrics(), "text/plain; version=0.0.4; charset=utf-8");
      } else if (path == "/v1/replicas") {
        reply(200, handlers_.replicas(), "application/json");
      } else {
        reply(404, "no such endpoint\n", "text/plain");
      }
    } catch (const std::exception& e) {
      reply(500, std::string("internal error: ") + e.what() + "\n", "text/plain");
    }
  }

  Handlers handlers_;
  http::experimental::listener::http_listener listener_;
};

absl::StatusOr<std::unique_ptr<AdminServer>> AdminServer::Start(const std::string& bind, int port,
                                                                 Handlers handlers) {
  std::unique_ptr<Impl> impl;
  auto bound = OpenOnPort(bind, port, [&](int p) {
    impl = std::make_unique<Impl>("http://" + bind + ":" + std::to_string(p), handlers);
    return impl->Open();
  });
  if (!bound.ok()) return Annotate(bound.status(), "--admin-port/--admin-bind");
  return std::unique_ptr<AdminServer>(new AdminServer(std::move(impl), *bound));
}

AdminServer::AdminServer(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}

AdminServer::~AdminServer() = default;

}  // namespace kiln
