#include "agent/controller_client.h"

#include <grpcpp/create_channel.h>

#include "absl/random/random.h"

#include "common/grpc_status.h"

namespace kiln {

ControllerClient::ControllerClient(std::string address, Hooks hooks,
                                   std::shared_ptr<grpc::ChannelCredentials> credentials,
                                   std::string server_name, absl::Duration status_period)
    : address_(std::move(address)), hooks_(std::move(hooks)), status_period_(status_period) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetMaxReceiveMessageSize(64 << 20);
  if (!server_name.empty()) args.SetSslTargetNameOverride(server_name);
  if (!credentials) credentials = grpc::InsecureChannelCredentials();
  stub_ = v1::ControlPlane::NewStub(grpc::CreateCustomChannel(address_, credentials, args));
}

ControllerClient::~ControllerClient() { Stop(); }

void ControllerClient::Start() { thread_ = std::thread([this]() { Run(); }); }

void ControllerClient::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (ctx_) ctx_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
}

bool ControllerClient::connected() const {
  absl::MutexLock lock(&mu_);
  return connected_;
}

uint64_t ControllerClient::connects() const {
  absl::MutexLock lock(&mu_);
  return connects_;
}

void ControllerClient::Run() {
  absl::Duration backoff = absl::Seconds(1);
  absl::BitGen jitter;
  for (;;) {
    absl::Time started = absl::Now();
    if (!Session()) return;
    if (absl::Now() - started > absl::Seconds(30)) backoff = absl::Seconds(1);  // was healthy
    // 80-100% of the backoff: a fleet that lost its controller together does not come back
    // in lockstep.
    const absl::Duration wait = backoff * absl::Uniform(jitter, 0.8, 1.0);
    hooks_.log("controller " + address_ + ": disconnected; retrying in " +
               absl::FormatDuration(absl::Trunc(wait, absl::Milliseconds(1))) +
               " (serving the last assignment meanwhile)");
    absl::MutexLock lock(&mu_);
    auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&stop), wait)) return;
    backoff = std::min(backoff * 2, kMaxReconnectBackoff);
  }
}

bool ControllerClient::Session() {
  grpc::ClientContext ctx;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return false;
    ctx_ = &ctx;
  }
  auto stream = stub_->Connect(&ctx);
  v1::AgentMessage reg;
  *reg.mutable_register_() = hooks_.make_register();
  bool ok;
  {
    absl::MutexLock lock(&write_mu_);
    ok = stream->Write(reg);
  }
  bool done = false;
  bool ended_by_controller = true;  // Read() returned false, not a Write() failure of ours
  std::thread status;
  if (ok) {
    {
      absl::MutexLock lock(&mu_);
      connected_ = true;
      connects_++;
    }
    hooks_.log("controller " + address_ + ": connected and registered");
    status = std::thread([&]() { StatusLoop(stream.get(), &done); });
    v1::ControllerMessage msg;
    while (stream->Read(&msg)) {
      v1::AgentMessage reply;
      if (msg.has_assignment()) {
        absl::Status s;
        {
          absl::MutexLock lock(&apply_mu_);
          unsaved_.reset();  // replaced by this one
          s = hooks_.apply_assignment(msg.assignment());
          if (absl::IsUnavailable(s)) unsaved_ = msg.assignment();
        }
        if (s.ok()) {
          reply.mutable_ack()->set_generation(msg.assignment().generation());
          reply.mutable_ack()->set_kind(v1::Ack::ASSIGNMENT);
        } else {
          reply.mutable_nack()->set_generation(msg.assignment().generation());
          reply.mutable_nack()->set_kind(v1::Ack::ASSIGNMENT);
          reply.mutable_nack()->set_reason(std::string(s.message()));
        }
      } else if (msg.has_routing_table()) {
        absl::Status s = hooks_.apply_routing(msg.routing_table());
        if (s.ok()) {
          reply.mutable_ack()->set_generation(msg.routing_table().generation());
          reply.mutable_ack()->set_kind(v1::Ack::ROUTING_TABLE);
        } else {
          reply.mutable_nack()->set_generation(msg.routing_table().generation());
          reply.mutable_nack()->set_kind(v1::Ack::ROUTING_TABLE);
          reply.mutable_nack()->set_reason(std::string(s.message()));
        }
      } else {
        continue;  // a message this agent does not know: ignore it (forward compatible)
      }
      absl::MutexLock lock(&write_mu_);
      if (!stream->Write(reply)) {
        ended_by_controller = false;
        break;
      }
    }
  }
  {
    absl::MutexLock lock(&mu_);
    connected_ = false;
    done = true;
  }
  if (!ended_by_controller) ctx.TryCancel();
  if (status.joinable()) status.join();
  // Why the stream ended (a refused Register, a failed TLS handshake, the controller gone).
  absl::Status s = FromGrpcStatus(stream->Finish());
  if (!s.ok() && !absl::IsCancelled(s)) {
    hooks_.log("controller " + address_ + ": " + s.ToString());
  }
  {
    absl::MutexLock lock(&mu_);
    ctx_ = nullptr;
    return !stopping_;
  }
}

void ControllerClient::StatusLoop(
    grpc::ClientReaderWriter<v1::AgentMessage, v1::ControllerMessage>* stream, bool* done) {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(done), status_period_)) return;
    }
    // An assignment Nacked as not saved: tried again, and Acked once applied (the Ack of the
    // generation in force clears the controller's refusal).
    std::optional<v1::AgentMessage> acked;
    {
      absl::MutexLock lock(&apply_mu_);
      if (unsaved_ && hooks_.apply_assignment(*unsaved_).ok()) {
        acked.emplace();
        acked->mutable_ack()->set_generation(unsaved_->generation());
        acked->mutable_ack()->set_kind(v1::Ack::ASSIGNMENT);
        hooks_.log("controller " + address_ + ": assignment generation " +
                   std::to_string(unsaved_->generation()) + " saved and applied after all");
        unsaved_.reset();
      }
    }
    v1::AgentMessage m;
    *m.mutable_status() = hooks_.make_status();
    absl::MutexLock lock(&write_mu_);
    if (acked && !stream->Write(*acked)) return;
    if (!stream->Write(m)) return;
  }
}

}  // namespace kiln
