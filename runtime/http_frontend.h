#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "runtime/model_host.h"

namespace kiln {

// The Open Inference Protocol REST frontend (common/HttpServer):
//   GET  /v2/health/live, /v2/health/ready, /v2
//   GET  /v2/models/{m}[/versions/{v}], .../ready
//   POST /v2/models/{m}[/versions/{v}]/infer
class HttpFrontend {
 public:
  // One HTTP thread by default: a second makes every request hop between them (a wake-up
  // each), which cost more than it gave on a 2-vCPU VM even at 32 clients (bench/RESULTS.md).
  static constexpr int kDefaultThreads = 1;
  struct Options {
    std::string bind_address = "0.0.0.0";
    int port = 0;  // 0 = pick a free port
    int64_t max_request_bytes = 64LL * 1024 * 1024;
    int threads = kDefaultThreads;  // reading, JSON decoding and encoding
    std::string server_version;
  };
  static absl::StatusOr<std::unique_ptr<HttpFrontend>> Start(ModelHost* host, Options options);
  ~HttpFrontend();

  int port() const { return port_; }
  void Stop();

 private:
  class Impl;
  explicit HttpFrontend(std::unique_ptr<Impl> impl, int port);
  std::unique_ptr<Impl> impl_;
  int port_;
};

}  // namespace kiln
