#include "agent/runtime_client.h"

#include <grpcpp/create_channel.h>

#include "common/grpc_status.h"

namespace kiln {

namespace {

class GrpcRuntimeClient : public RuntimeClient {
 public:
  GrpcRuntimeClient(const std::string& socket, absl::Duration timeout)
      : stub_(v1::RuntimeControl::NewStub(
            grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()))),
        timeout_(timeout) {}

  absl::StatusOr<v1::RuntimeState> GetState() override {
    return Call<v1::GetStateRequest, v1::RuntimeState>(&v1::RuntimeControl::Stub::GetState);
  }
  absl::StatusOr<v1::RuntimeState> Promote() override {
    return Call<v1::PromoteRequest, v1::RuntimeState>(&v1::RuntimeControl::Stub::Promote);
  }
  absl::StatusOr<v1::RuntimeState> Demote() override {
    return Call<v1::DemoteRequest, v1::RuntimeState>(&v1::RuntimeControl::Stub::Demote);
  }
  absl::StatusOr<v1::RuntimeStats> Stats() override {
    return Call<v1::StatsRequest, v1::RuntimeStats>(&v1::RuntimeControl::Stub::Stats);
  }

 private:
  template <typename Req, typename Resp>
  absl::StatusOr<Resp> Call(grpc::Status (v1::RuntimeControl::Stub::*method)(
      grpc::ClientContext*, const Req&, Resp*)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
    Resp resp;
    grpc::Status s = (stub_.get()->*method)(&ctx, Req(), &resp);
    if (!s.ok()) return FromGrpcStatus(s);
    return resp;
  }

  std::unique_ptr<v1::RuntimeControl::Stub> stub_;
  absl::Duration timeout_;
};

}  // namespace

std::unique_ptr<RuntimeClient> GrpcRuntimeClientFactory::Connect(const std::string& socket_path) {
  return std::make_unique<GrpcRuntimeClient>(socket_path, timeout_);
}

}  // namespace kiln
