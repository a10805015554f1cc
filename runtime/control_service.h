#pragma once

#include <grpcpp/server.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kiln/v1/runtime_control.grpc.pb.h"

namespace kiln {

// What the control service drives; RuntimeServer implements it.
class ControlTarget {
 public:
  virtual ~ControlTarget() = default;
  virtual v1::RuntimeState GetState() = 0;
  virtual absl::Status Promote() = 0;
  virtual absl::Status Demote() = 0;
  // Refuses new work and waits up to `deadline` for in-flight work; true when drained.
  virtual absl::StatusOr<bool> Drain(absl::Duration deadline) = 0;
  virtual v1::RuntimeStats Stats() = 0;
  // Drains (bounded) and asks the process to exit once the reply is sent.
  virtual bool Shutdown(absl::Duration deadline) = 0;
  virtual int64_t InFlight() = 0;
  // A pre-started runtime takes its model; a loaded one refuses.
  virtual absl::Status Load(const std::vector<std::string>& args) {
    (void)args;
    return absl::FailedPreconditionError("a model is already loaded; Load is for --prestart");
  }
};

// kiln.v1.RuntimeControl, served on the runtime's unix socket.
class ControlService final : public v1::RuntimeControl::Service {
 public:
  ControlService(ControlTarget* target, absl::Duration default_drain)
      : target_(target), default_drain_(default_drain) {}

  grpc::Status GetState(grpc::ServerContext*, const v1::GetStateRequest*,
                        v1::RuntimeState* resp) override;
  grpc::Status Promote(grpc::ServerContext*, const v1::PromoteRequest*,
                       v1::RuntimeState* resp) override;
  grpc::Status Demote(grpc::ServerContext*, const v1::DemoteRequest*,
                      v1::RuntimeState* resp) override;
  grpc::Status Drain(grpc::ServerContext*, const v1::DrainRequest* req,
                     v1::DrainResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext*, const v1::StatsRequest*,
                     v1::RuntimeStats* resp) override;
  grpc::Status Shutdown(grpc::ServerContext*, const v1::ShutdownRequest* req,
                        v1::ShutdownResponse* resp) override;
  grpc::Status Load(grpc::ServerContext*, const v1::LoadRequest* req,
                    v1::LoadResponse* resp) override;

 private:
  absl::StatusOr<absl::Duration> Deadline(int64_t millis) const;

  ControlTarget* target_;
  const absl::Duration default_drain_;
};

// Serves `service` on the unix socket `path`, created mode 0600. A socket left by a crashed
// runtime is removed first; anything else at the path, or a socket another process still
// answers on, is an error naming --control-socket.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartControlServer(const std::string& path,
                                                                 grpc::Service* service);

}  // namespace kiln
