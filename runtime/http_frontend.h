#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "runtime/model_host.h"

namespace kiln {

// One REST inference: `*body` (taken) for `model`/`version` from the path, served by `host`.
// `answer` runs exactly once (maybe on this thread) with the HTTP status and JSON body the REST
// port sends. `deadline_unix_micros` (0 = none) is the caller's, as on the data socket; with
// `add_version` the answer's parameters say which version served (kiln-version).
void ServeRestInfer(ModelHost* host, std::string* body, const std::string& model,
                    const std::string& version, int64_t max_request_bytes,
                    int64_t deadline_unix_micros, bool add_version,
                    std::function<void(int http_status, std::string json)> answer);

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
    int64_t max_request_bytes = kDefaultMaxRequestBytes;
    int threads = kDefaultThreads;  // reading, JSON decoding and encoding
    // After each piece of work a thread polls busily this long before it sleeps
    // (HttpServer::Options::idle_spin).
    absl::Duration idle_spin = absl::ZeroDuration();
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
