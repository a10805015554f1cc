#pragma once

// A small blocking gRPC client: unary calls over one HTTP/2 connection (nghttp2) on a POSIX
// TCP socket, one call at a time, no TLS. It exists to measure a server: grpc++'s synchronous
// client spends about 60-90 us of CPU per call on the development VM (bench/RESULTS.md), more
// than the server it measures, while this one sends a ready-serialized request in one write
// and reads the reply in the same thread. Every call is bounded by the client's timeout, so a
// dead or stuck server cannot hang the caller.
//
// Not thread-safe: use one client per thread.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/http_client.h"  // HostPort

namespace kiln::bench {

struct GrpcReply {
  int status = -1;      // grpc-status (0 = OK)
  std::string message;  // grpc-message
  std::string body;     // the response message's bytes (the one gRPC message, unframed)
};

class H2GrpcClient {
 public:
  // `spin`: wait for the reply busily (non-blocking reads in a loop) instead of sleeping in
  // poll(), which leaves out what waking this thread costs: the server's send then finds it
  // running. For measuring the server only; it holds a CPU while it waits.
  H2GrpcClient(HostPort target, std::chrono::milliseconds timeout, bool spin = false);
  ~H2GrpcClient();

  H2GrpcClient(const H2GrpcClient&) = delete;
  H2GrpcClient& operator=(const H2GrpcClient&) = delete;

  // One unary call: `path` is "/package.Service/Method", `request` the serialized message.
  // A gRPC error is a reply with status != 0; the error status is for the transport (refused,
  // reset, timeout, a reply that is not one gRPC message). After a transport error the
  // connection is dropped and the next call connects again.
  absl::StatusOr<GrpcReply> Call(const std::string& path, const std::string& request);

  int64_t connects() const { return connects_; }

  struct Session;  // nghttp2's session and what its callbacks fill in

 private:
  absl::Status Connect();
  void Close();
  absl::Status Flush();  // writes what nghttp2 has queued
  absl::Status Pump(std::chrono::steady_clock::time_point deadline);  // reads once

  HostPort target_;
  std::chrono::milliseconds timeout_;
  bool spin_ = false;
  int fd_ = -1;
  std::unique_ptr<Session> session_;
  int64_t connects_ = 0;
};

}  // namespace kiln::bench
