#include "controller/admin_server.h"

#include <cpprest/http_listener.h>

#include "common/net_util.h"
#include "common/status.h"

namespace kiln {

namespace http = web::http;

class AdminHttpServer::Impl {
 public:
  Impl(const std::string& uri, AdminApi* api, size_t max_body)
      : api_(api), max_body_(max_body), listener_(uri) {
    for (const auto& m : {http::methods::GET, http::methods::POST, http::methods::PUT,
                          http::methods::DEL}) {
      listener_.support(m, [this](http::http_request r) { Handle(r); });
    }
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
  static void Send(http::http_request& r, const ApiResponse& a) {
    http::http_response resp(static_cast<http::status_code>(a.code));
    resp.set_body(a.body, a.content_type);
    r.reply(resp).then([](pplx::task<void> t) {
      try {
        t.get();
      } catch (const std::exception&) {
      }
    });
  }

  void Handle(http::http_request r) {
    try {
      if (r.headers().content_length() > max_body_) {
        ApiResponse too_big = ErrorResponse(absl::InvalidArgumentError(
            "the request body is over " + std::to_string(max_body_) + " bytes"));
        too_big.code = 413;
        Send(r, too_big);
        return;
      }
      ApiRequest req;
      req.method = r.method();
      req.path = r.relative_uri().path();
      auto auth = r.headers().find(http::header_names::authorization);
      if (auth != r.headers().end()) req.authorization = auth->second;
      if (req.method == "POST" || req.method == "PUT") {
        req.body = r.extract_utf8string(/*ignore_content_type=*/true).get();
        if (req.body.size() > max_body_) {
          ApiResponse too_big = ErrorResponse(absl::InvalidArgumentError(
              "the request body is over " + std::to_string(max_body_) + " bytes"));
          too_big.code = 413;
          Send(r, too_big);
          return;
        }
      }
      Send(r, api_->Handle(req));
    } catch (const std::exception& e) {
      Send(r, ErrorResponse(absl::InternalError(std::string("internal error: ") + e.what())));
    }
  }

  AdminApi* api_;
  size_t max_body_;
  http::experimental::listener::http_listener listener_;
};

absl::StatusOr<std::unique_ptr<AdminHttpServer>> AdminHttpServer::Start(const std::string& bind,
                                                                         int port, AdminApi* api,
                                                                         size_t max_body_bytes) {
  std::unique_ptr<Impl> impl;
  auto bound = OpenOnPort(bind, port, [&](int p) {
    impl = std::make_unique<Impl>("http://" + bind + ":" + std::to_string(p), api, max_body_bytes);
    return impl->Open();
  });
  if (!bound.ok()) return Annotate(bound.status(), "--admin-port/--admin-bind");
  return std::unique_ptr<AdminHttpServer>(new AdminHttpServer(std::move(impl), *bound));
}

AdminHttpServer::AdminHttpServer(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}

AdminHttpServer::~AdminHttpServer() = default;

}  // namespace kiln
