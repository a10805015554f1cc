#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kiln/v1/runtime_control.grpc.pb.h"

namespace kiln {

// The agent's side of kiln.v1.RuntimeControl, one per replica's control socket.
class RuntimeClient {
 public:
  virtual ~RuntimeClient() = default;
  virtual absl::StatusOr<v1::RuntimeState> GetState() = 0;
  virtual absl::StatusOr<v1::RuntimeState> Promote() = 0;
  virtual absl::StatusOr<v1::RuntimeState> Demote() = 0;
  virtual absl::StatusOr<v1::RuntimeStats> Stats() = 0;
  // Hands a pre-started runtime (kiln-runtime --prestart) its replica: `args` are the command
  // line a cold start would have had. OK once the runtime accepted them.
  virtual absl::Status Load(const std::vector<std::string>& args) = 0;
};

class RuntimeClientFactory {
 public:
  virtual ~RuntimeClientFactory() = default;
  virtual std::unique_ptr<RuntimeClient> Connect(const std::string& socket_path) = 0;
};

// gRPC over the unix socket; every call has `timeout`, or 200 ms once a call timed out, until
// the runtime answers again.
class GrpcRuntimeClientFactory : public RuntimeClientFactory {
 public:
  explicit GrpcRuntimeClientFactory(absl::Duration timeout = absl::Seconds(2)) : timeout_(timeout) {}
  std::unique_ptr<RuntimeClient> Connect(const std::string& socket_path) override;

 private:
  absl::Duration timeout_;
};

}  // namespace kiln
