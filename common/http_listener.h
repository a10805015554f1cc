#pragma once

// A cpprestsdk HTTP listener on bind:port (port 0 picks a free one) that hands every request
// to one handler, and a reply that ignores a client that has gone away. The runtime's REST
// front end and the agent's and the controller's admin endpoints are built on it.

#include <cpprest/http_msg.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kiln {

class HttpListener {
 public:
  using Handler = std::function<void(web::http::http_request)>;

  // Requests with one of `methods` go to `handler` (others get 405; no methods: every
  // request goes to the handler). `flags` names the
  // options that chose bind and port, for the error when it cannot listen.
  static absl::StatusOr<std::unique_ptr<HttpListener>> Start(
      const std::string& bind, int port, const std::vector<web::http::method>& methods,
      Handler handler, const std::string& flags);
  ~HttpListener();  // stops listening

  int port() const { return port_; }

 private:
  class Impl;
  HttpListener(std::unique_ptr<Impl> impl, int port);
  std::unique_ptr<Impl> impl_;
  int port_;
};

// Sends the reply; a failure to write it (the client left) is dropped.
void ReplyQuietly(web::http::http_request& request, int code, const std::string& body,
                  const std::string& content_type);

}  // namespace kiln
