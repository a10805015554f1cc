#include "common/http_listener.h"

#include <cpprest/http_listener.h>

#include "common/net_util.h"
#include "common/status.h"

namespace kiln {

namespace http = web::http;

class HttpListener::Impl {
 public:
  Impl(const std::string& uri, const std::vector<http::method>& methods, const Handler& handler)
      : listener_(uri) {
    if (methods.empty()) listener_.support(handler);
    for (const auto& m : methods) listener_.support(m, handler);
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
  http::experimental::listener::http_listener listener_;
};

absl::StatusOr<std::unique_ptr<HttpListener>> HttpListener::Start(
    const std::string& bind, int port, const std::vector<http::method>& methods, Handler handler,
    const std::string& flags) {
  std::unique_ptr<Impl> impl;
  auto bound = OpenOnPort(bind, port, [&](int p) {
    impl = std::make_unique<Impl>("http://" + bind + ":" + std::to_string(p), methods, handler);
    return impl->Open();
  });
  if (!bound.ok()) return Annotate(bound.status(), flags);
  return std::unique_ptr<HttpListener>(new HttpListener(std::move(impl), *bound));
}

HttpListener::HttpListener(std::unique_ptr<Impl> impl, int port) : impl_(std::move(impl)), port_(port) {}

HttpListener::~HttpListener() = default;

void ReplyQuietly(http::http_request& request, int code, const std::string& body,
                  const std::string& content_type) {
  http::http_response resp(static_cast<http::status_code>(code));
  resp.set_body(body, content_type);
  request.reply(resp).then([](pplx::task<void> t) {
    try {
      t.get();
    } catch (const std::exception&) {
    }
  });
}

}  // namespace kiln
