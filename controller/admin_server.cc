#include "controller/admin_server.h"

#include "common/http_listener.h"

namespace kiln {

namespace http = web::http;

namespace {

void Send(http::http_request& r, const ApiResponse& a) { ReplyQuietly(r, a.code, a.body, a.content_type); }

ApiResponse TooBig(size_t max_body) {
  ApiResponse too_big = ErrorResponse(
      absl::InvalidArgumentError("the request body is over " + std::to_string(max_body) + " bytes"));
  too_big.code = 413;
  return too_big;
}

void Handle(AdminApi* api, size_t max_body, http::http_request r) {
  try {
    if (r.headers().content_length() > max_body) return Send(r, TooBig(max_body));
    ApiRequest req;
    req.method = r.method();
    req.path = r.relative_uri().path();
    auto auth = r.headers().find(http::header_names::authorization);
    if (auth != r.headers().end()) req.authorization = auth->second;
    if (req.method == "POST" || req.method == "PUT") {
      req.body = r.extract_utf8string(/*ignore_content_type=*/true).get();
      if (req.body.size() > max_body) return Send(r, TooBig(max_body));
    }
    Send(r, api->Handle(req));
  } catch (const std::exception& e) {
    Send(r, ErrorResponse(absl::InternalError(std::string("internal error: ") + e.what())));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpListener>> StartAdminHttpServer(const std::string& bind,
                                                                   int port, AdminApi* api,
                                                                   size_t max_body_bytes) {
  return HttpListener::Start(
      bind, port, {http::methods::GET, http::methods::POST, http::methods::PUT, http::methods::DEL},
      [api, max_body_bytes](http::http_request r) { Handle(api, max_body_bytes, std::move(r)); },
      "--admin-port/--admin-bind");
}

}  // namespace kiln
