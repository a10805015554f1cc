#pragma once

// A kiln.v1.RuntimeControl service on a unix socket for tests of the agent's client: each
// method answers at once, or holds its calls (a wedged runtime) until released or cancelled.
#include <grpcpp/grpcpp.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kiln/v1/runtime_control.grpc.pb.h"

namespace kiln::testing {

class HeldRuntimeControl final : public v1::RuntimeControl::Service {
 public:
  // Serves on `path` (replaced); null server() when it could not.
  explicit HeldRuntimeControl(std::string path, v1::LifecycleState state = v1::SERVING)
      : path_(std::move(path)), state_(state) {
    std::filesystem::remove(path_);
    grpc::ServerBuilder b;
    b.AddListeningPort("unix:" + path_, grpc::InsecureServerCredentials());
    b.RegisterService(this);
    server_ = b.BuildAndStart();
  }
  ~HeldRuntimeControl() override {
    Hold("", false);
    if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    std::filesystem::remove(path_);
  }
  grpc::Server* server() { return server_.get(); }

  // Holds (or stops holding) calls of `method` ("GetState", "Promote", ...; "" = all).
  void Hold(const std::string& method, bool hold) {
    absl::MutexLock lock(&mu_);
    if (method.empty()) {
      held_.clear();
    } else {
      held_[method] = hold;
    }
  }
  // Promote/Demote answer `s` (until set back to OK), leaving the state as it is.
  void Refuse(const std::string& method, grpc::Status s) {
    absl::MutexLock lock(&mu_);
    refusals_[method] = std::move(s);
  }
  // Calls of `method` that came, and how much time each had left when it came.
  std::vector<absl::Duration> calls(const std::string& method) {
    absl::MutexLock lock(&mu_);
    return calls_[method];
  }
  // Calls of `method` on their way (held).
  int held_now(const std::string& method) {
    absl::MutexLock lock(&mu_);
    return holding_[method];
  }
  v1::LifecycleState state() {
    absl::MutexLock lock(&mu_);
    return state_;
  }

  grpc::Status GetState(grpc::ServerContext* ctx, const v1::GetStateRequest*,
                        v1::RuntimeState* resp) override {
    Come("GetState", ctx);
    resp->set_state(state());
    return grpc::Status::OK;
  }
  grpc::Status Stats(grpc::ServerContext* ctx, const v1::StatsRequest*,
                     v1::RuntimeStats* resp) override {
    Come("Stats", ctx);
    resp->set_requests(calls("Stats").size());
    return grpc::Status::OK;
  }
  grpc::Status Promote(grpc::ServerContext* ctx, const v1::PromoteRequest*,
                       v1::RuntimeState* resp) override {
    return Move("Promote", ctx, v1::SERVING, resp);
  }
  grpc::Status Demote(grpc::ServerContext* ctx, const v1::DemoteRequest*,
                      v1::RuntimeState* resp) override {
    return Move("Demote", ctx, v1::WARM, resp);
  }
  // Takes one Load (its arguments are kept); later ones are refused, as a runtime does.
  grpc::Status Load(grpc::ServerContext* ctx, const v1::LoadRequest* req,
                    v1::LoadResponse*) override {
    Come("Load", ctx);
    absl::MutexLock lock(&mu_);
    if (!loaded_.empty()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "a model is already loaded");
    }
    loaded_.assign(req->args().begin(), req->args().end());
    return grpc::Status::OK;
  }
  // The arguments of the Load taken (empty: none).
  std::vector<std::string> loaded() {
    absl::MutexLock lock(&mu_);
    return loaded_;
  }

 private:
  grpc::Status Move(const std::string& method, grpc::ServerContext* ctx, v1::LifecycleState to,
                    v1::RuntimeState* resp) {
    Come(method, ctx);
    absl::MutexLock lock(&mu_);
    if (auto r = refusals_.find(method); r != refusals_.end() && !r->second.ok()) return r->second;
    state_ = to;
    resp->set_state(state_);
    return grpc::Status::OK;
  }

  // Records the call, then holds it while its method is held (bounded: 30 s, or until the
  // caller gives up: a cancellation is nothing a condition can wait on, so it is polled).
  void Come(const std::string& method, grpc::ServerContext* ctx) {
    absl::MutexLock lock(&mu_);
    calls_[method].push_back(absl::FromChrono(ctx->deadline()) - absl::Now());
    ++holding_[method];
    const absl::Time until = absl::Now() + absl::Seconds(30);
    auto released = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto it = held_.find(method);
      return it == held_.end() || !it->second;
    };
    while (!released() && !ctx->IsCancelled() && absl::Now() < until) {
      mu_.AwaitWithTimeout(absl::Condition(&released), absl::Milliseconds(5));
    }
    --holding_[method];
  }

  const std::string path_;
  absl::Mutex mu_;
  v1::LifecycleState state_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, bool> held_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<absl::Duration>> calls_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> holding_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> loaded_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, grpc::Status> refusals_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace kiln::testing
