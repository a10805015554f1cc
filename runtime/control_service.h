#pragma once

#include <grpcpp/server.h>

#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kiln/v1/runtime_control.grpc.pb.h"

namespace kiln {

// What the control service drives; RuntimeServer implements it.
class ControlTarget {
 public:
  virtual ~ControlTarget() = default;
  virtual v1::RuntimeState GetState() = 0;
  virtual absl::Status Promote() = 0;
  // Whether Promote() may take long (a warm-up inference first): then it runs on a thread of
  // its own; else it is answered at once on the gRPC thread, as Demote is.
  virtual bool PromoteWaits() const { return true; }
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
//
// On gRPC's callback API, like the inference service: a synchronous service would give the
// process gRPC's sync-server threads, and those poll the one epoll set every server in the
// process shares, so they would pick up the inference port's reads and hand each request to
// another thread (measured: +100 to +200 µs per gRPC ModelInfer on a 2-vCPU VM). The quick
// calls answer inline; the ones that can block (Promote's warm-up, Drain, Shutdown, Load) run
// on a thread of their own so no gRPC thread waits on them.
class ControlService final : public v1::RuntimeControl::CallbackService {
 public:
  // At most this many blocking calls at once; more are refused RESOURCE_EXHAUSTED (Shutdown
  // never is).
  static constexpr int kMaxBlockingCalls = 16;

  ControlService(ControlTarget* target, absl::Duration default_drain)
      : target_(target), default_drain_(default_drain) {}
  // After the server has stopped (which waits for every call to finish): joins the workers.
  ~ControlService() override;

  grpc::ServerUnaryReactor* GetState(grpc::CallbackServerContext* ctx, const v1::GetStateRequest*,
                                     v1::RuntimeState* resp) override;
  grpc::ServerUnaryReactor* Promote(grpc::CallbackServerContext* ctx, const v1::PromoteRequest*,
                                    v1::RuntimeState* resp) override;
  grpc::ServerUnaryReactor* Demote(grpc::CallbackServerContext* ctx, const v1::DemoteRequest*,
                                   v1::RuntimeState* resp) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* ctx, const v1::DrainRequest* req,
                                  v1::DrainResponse* resp) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest*,
                                  v1::RuntimeStats* resp) override;
  grpc::ServerUnaryReactor* Shutdown(grpc::CallbackServerContext* ctx,
                                     const v1::ShutdownRequest* req,
                                     v1::ShutdownResponse* resp) override;
  grpc::ServerUnaryReactor* Load(grpc::CallbackServerContext* ctx, const v1::LoadRequest* req,
                                 v1::LoadResponse* resp) override;

 private:
  struct Worker {
    std::thread thread;
    bool exited = false;  // past its call's Finish
  };
  absl::StatusOr<absl::Duration> Deadline(int64_t millis) const;
  // Finishes the call with `work`'s status (an exception: INTERNAL), run on a thread of its
  // own. `bounded`: refused RESOURCE_EXHAUSTED while kMaxBlockingCalls are unfinished.
  grpc::ServerUnaryReactor* Blocking(grpc::CallbackServerContext* ctx,
                                     std::function<grpc::Status()> work, bool bounded = true);

  ControlTarget* target_;
  const absl::Duration default_drain_;
  absl::Mutex mu_;
  std::list<Worker> workers_ ABSL_GUARDED_BY(mu_);
  int active_ ABSL_GUARDED_BY(mu_) = 0;  // blocking calls not yet finished
};

// Serves `service` on the unix socket `path`, created mode 0600. A socket left by a crashed
// runtime is removed first; anything else at the path, or a socket another process still
// answers on, is an error naming --control-socket.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartControlServer(const std::string& path,
                                                                 grpc::Service* service);

}  // namespace kiln
