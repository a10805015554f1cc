#pragma once

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

 private:
  absl::StatusOr<absl::Duration> Deadline(int64_t millis) const;

  ControlTarget* target_;
  const absl::Duration default_drain_;
};

}  // namespace kiln
