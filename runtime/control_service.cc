#include "runtime/control_service.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include <grpcpp/server_builder.h>

#include "common/data_frames.h"
#include "common/grpc_status.h"

namespace kiln {

absl::StatusOr<absl::Duration> ControlService::Deadline(int64_t millis) const {
  if (millis < 0 || millis > 3'600'000) {
    return absl::InvalidArgumentError("deadline_millis: must be in 0..3600000 (0 = default), got " +
                                      std::to_string(millis));
  }
  return millis == 0 ? default_drain_ : absl::Milliseconds(millis);
}

grpc::Status ControlService::GetState(grpc::ServerContext*, const v1::GetStateRequest*,
                                      v1::RuntimeState* resp) {
  *resp = target_->GetState();
  return grpc::Status::OK;
}

grpc::Status ControlService::Promote(grpc::ServerContext*, const v1::PromoteRequest*,
                                     v1::RuntimeState* resp) {
  absl::Status s = target_->Promote();
  *resp = target_->GetState();
  return ToGrpcStatus(s);
}

grpc::Status ControlService::Demote(grpc::ServerContext*, const v1::DemoteRequest*,
                                    v1::RuntimeState* resp) {
  absl::Status s = target_->Demote();
  *resp = target_->GetState();
  return ToGrpcStatus(s);
}

grpc::Status ControlService::Drain(grpc::ServerContext*, const v1::DrainRequest* req,
                                   v1::DrainResponse* resp) {
  auto deadline = Deadline(req->deadline_millis());
  if (!deadline.ok()) return ToGrpcStatus(deadline.status());
  auto drained = target_->Drain(*deadline);
  if (!drained.ok()) return ToGrpcStatus(drained.status());
  resp->set_drained(*drained);
  resp->set_in_flight(target_->InFlight());
  *resp->mutable_state() = target_->GetState();
  return grpc::Status::OK;
}

grpc::Status ControlService::Stats(grpc::ServerContext*, const v1::StatsRequest*,
                                   v1::RuntimeStats* resp) {
  *resp = target_->Stats();
  return grpc::Status::OK;
}

grpc::Status ControlService::Shutdown(grpc::ServerContext*, const v1::ShutdownRequest* req,
                                      v1::ShutdownResponse* resp) {
  auto deadline = Deadline(req->deadline_millis());
  if (!deadline.ok()) return ToGrpcStatus(deadline.status());
  resp->set_drained(target_->Shutdown(*deadline));
  return grpc::Status::OK;
}

grpc::Status ControlService::Load(grpc::ServerContext*, const v1::LoadRequest* req,
                                  v1::LoadResponse*) {
  return ToGrpcStatus(target_->Load({req->args().begin(), req->args().end()}));
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartControlServer(const std::string& path,
                                                                 grpc::Service* service) {
  if (auto s = ClearStaleSocket(path, "--control-socket"); !s.ok()) return s;
  grpc::ServerBuilder b;
  b.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  b.RegisterService(service);
  // The socket is created 0600 (no window in which others could connect).
  mode_t old_umask = umask(0177);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  umask(old_umask);
  if (!server) return absl::UnavailableError("--control-socket: cannot listen on " + path);
  if (chmod(path.c_str(), 0600) != 0) {
    return absl::PermissionDeniedError("--control-socket: cannot chmod 0600 " + path);
  }
  return server;
}

}  // namespace kiln
