#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/http_server.h"

namespace kiln {

// The agent's admin HTTP endpoints: /healthz, /readyz, /metrics, /v1/replicas (GET only).
struct AdminHandlers {
  std::function<bool()> live;
  std::function<bool()> ready;
  std::function<std::string()> metrics;   // Prometheus text format
  std::function<std::string()> replicas;  // JSON
  // Only with --fake-gpus: POST /v1/fake-gpus/{index}/xid/{code} raises an Xid event on that
  // fake GPU (how demos and tests make a GPU fail). Unset: the endpoint is 404.
  std::function<absl::Status(int index, uint64_t xid)> inject_xid;
};

absl::StatusOr<std::unique_ptr<HttpServer>> StartAdminServer(const std::string& bind, int port,
                                                               AdminHandlers handlers);

}  // namespace kiln
