#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kiln {

// The agent's admin HTTP endpoints (cpprestsdk): /healthz, /readyz, /metrics, /v1/replicas.
class AdminServer {
 public:
  struct Handlers {
    std::function<bool()> live;
    std::function<bool()> ready;
    std::function<std::string()> metrics;   // Prometheus text format
    std::function<std::string()> replicas;  // JSON
  };
  static absl::StatusOr<std::unique_ptr<AdminServer>> Start(const std::string& bind, int port,
                                                            Handlers handlers);
  ~AdminServer();
  int port() const { return port_; }

 private:
  class Impl;
  AdminServer(std::unique_ptr<Impl> impl, int port);
  std::unique_ptr<Impl> impl_;
  int port_;
};

}  // namespace kiln
