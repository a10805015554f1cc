#include "controller/admin_server.h"

namespace kiln {

namespace {

void Send(const HttpReply& r, const ApiResponse& a) { r.Send(a.code, a.body, a.content_type); }

// Bodies over the limit never get here: the server answers 413 from their declared length.
void Handle(AdminApi* api, HttpRequest request, const HttpReply& r) {
  try {
    if (request.method != "GET" && request.method != "POST" && request.method != "PUT" &&
        request.method != "DELETE") {
      // UNIMPLEMENTED is the admin API's 405.
      return Send(r, ErrorResponse(absl::UnimplementedError("method " + request.method +
                                                            " is not allowed here")));
    }
    ApiRequest req;
    req.method = std::move(request.method);
    req.path = std::move(request.path);
    if (auto auth = request.Header("Authorization")) req.authorization = std::string(*auth);
    if (req.method == "POST" || req.method == "PUT") req.body = std::move(request.body);
    Send(r, api->Handle(req));
  } catch (const std::exception& e) {
    Send(r, ErrorResponse(absl::InternalError(std::string("internal error: ") + e.what())));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpServer>> StartAdminHttpServer(const std::string& bind, int port,
                                                                 AdminApi* api,
                                                                 size_t max_body_bytes) {
  HttpServer::Options o;
  o.bind_address = bind;
  o.port = port;
  o.threads = 4;  // a handler may wait on the store (the Kubernetes API)
  o.max_body_bytes = static_cast<int64_t>(max_body_bytes);
  o.flags = "--admin-port/--admin-bind";
  return HttpServer::Start(
      o, [api](HttpRequest request, HttpReply r) { Handle(api, std::move(request), r); });
}

}  // namespace kiln
