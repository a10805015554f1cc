#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/http_server.h"
#include "controller/admin_api.h"

namespace kiln {

// The admin API over HTTP: moves requests to AdminApi and replies back. Bodies over
// `max_body_bytes` are refused with 413.
absl::StatusOr<std::unique_ptr<HttpServer>> StartAdminHttpServer(const std::string& bind,
                                                                   int port, AdminApi* api,
                                                                   size_t max_body_bytes = 1 << 20);

}  // namespace kiln
