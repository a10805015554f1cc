#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "runtime/model_host.h"

namespace kiln {

// ModelInfer and REST inference on a unix socket for the node's router (common/data_frames.h):
// the same decoding, engine and encoding as the gRPC and REST frontends, without HTTP. One
// thread per connection reads requests and hands them to the engine; answers are written from whichever thread finishes
// them (a connection's writes are serialised), in the order they finish.
class DataServer {
 public:
  // Listens on `path` (mode 0600; a stale socket file is replaced). Errors name --data-socket.
  static absl::StatusOr<std::unique_ptr<DataServer>> Start(const std::string& path,
                                                           ModelHost* host,
                                                           int64_t max_request_bytes);
  ~DataServer();

  // Stops accepting, closes every connection (requests in the engine still finish; their
  // answers have nowhere to go) and removes the socket file. Safe to call more than once.
  void Stop();

  const std::string& path() const { return path_; }

  // At most this many connections at once (a router keeps one per replica); more are closed.
  static constexpr int kMaxConnections = 64;

 private:
  struct Connection;
  DataServer(std::string path, int listen_fd, ModelHost* host, int64_t max_request_bytes);
  void AcceptLoop();
  void ReadLoop(std::shared_ptr<Connection> c);
  void Serve(const std::shared_ptr<Connection>& c, uint64_t tag, int64_t deadline_unix_micros,
             const std::string& body);
  // A REST inference (kJsonInferFrame); takes `body`.
  void ServeJson(const std::shared_ptr<Connection>& c, uint64_t tag, int64_t deadline_unix_micros,
                 std::string* body);

  const std::string path_;
  const int listen_fd_;
  ModelHost* const host_;
  const int64_t max_request_bytes_;
  std::thread accept_thread_;

  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  int readers_ ABSL_GUARDED_BY(mu_) = 0;  // ReadLoops running
};

}  // namespace kiln
