#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "controller/admin_api.h"

namespace kiln {

// The admin API's HTTP listener (cpprestsdk): moves requests to AdminApi and replies back.
// Bodies over `max_body_bytes` are refused with 413.
class AdminHttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<AdminHttpServer>> Start(const std::string& bind, int port,
                                                                AdminApi* api,
                                                                size_t max_body_bytes = 1 << 20);
  ~AdminHttpServer();
  int port() const { return port_; }

 private:
  class Impl;
  AdminHttpServer(std::unique_ptr<Impl> impl, int port);
  std::unique_ptr<Impl> impl_;
  int port_;
};

}  // namespace kiln
