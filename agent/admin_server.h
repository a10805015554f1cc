#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/http_listener.h"

namespace kiln {

// The agent's admin HTTP endpoints: /healthz, /readyz, /metrics, /v1/replicas (GET only).
struct AdminHandlers {
  std::function<bool()> live;
  std::function<bool()> ready;
  std::function<std::string()> metrics;   // Prometheus text format
  std::function<std::string()> replicas;  // JSON
};

absl::StatusOr<std::unique_ptr<HttpListener>> StartAdminServer(const std::string& bind, int port,
                                                               AdminHandlers handlers);

}  // namespace kiln
