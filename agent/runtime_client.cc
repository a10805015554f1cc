#include "agent/runtime_client.h"

#include <grpcpp/create_channel.h>

#include <algorithm>

#include "common/grpc_status.h"

namespace kiln {

namespace {

class GrpcRuntimeClient : public RuntimeClient {
 public:
  GrpcRuntimeClient(const std::string& socket, absl::Duration timeout)
      : stub_(v1::RuntimeControl::NewStub(
            grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(), Args()))),
        timeout_(timeout) {}

  // A starting runtime creates its socket a moment after the agent first looks: reconnect
  // quickly instead of gRPC's default of seconds.
  static grpc::ChannelArguments Args() {
    grpc::ChannelArguments a;
    a.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
    a.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
    a.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
    return a;
  }

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
  absl::Status Load(const std::vector<std::string>& args) override {
    grpc::ClientContext ctx;
    // The runtime reads the model's config (and checks its files) before it answers.
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + std::max(timeout_, absl::Seconds(10))));
    v1::LoadRequest req;
    for (const auto& a : args) req.add_args(a);
    v1::LoadResponse resp;
    return FromGrpcStatus(stub_->Load(&ctx, req, &resp));
  }

 private:
  template <typename Req, typename Resp>
  absl::StatusOr<Resp> Call(grpc::Status (v1::RuntimeControl::Stub::*method)(
      grpc::ClientContext*, const Req&, Resp*)) {
    grpc::ClientContext ctx;
    // A runtime that let a call time out (stopped, wedged) is given a short time from then on,
    // until it answers again: the agent's loop asks every replica in turn, and must not wait
    // out the whole timeout for it on every pass until it is declared silent.
    ctx.set_deadline(absl::ToChronoTime(
        absl::Now() + (silent_ ? std::min(timeout_, kSilentTimeout) : timeout_)));
    Resp resp;
    grpc::Status s = (stub_.get()->*method)(&ctx, Req(), &resp);
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) silent_ = true;
    if (!s.ok()) return FromGrpcStatus(s);
    silent_ = false;
    return resp;
  }

  static constexpr absl::Duration kSilentTimeout = absl::Milliseconds(200);
  std::unique_ptr<v1::RuntimeControl::Stub> stub_;
  absl::Duration timeout_;
  bool silent_ = false;  // the last call timed out (the client is used from one thread)
};

}  // namespace

std::unique_ptr<RuntimeClient> GrpcRuntimeClientFactory::Connect(const std::string& socket_path) {
  return std::make_unique<GrpcRuntimeClient>(socket_path, timeout_);
}

}  // namespace kiln
