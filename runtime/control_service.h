#pragma once

#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/grpc_h2_server.h"
#include "kiln/v1/runtime_control.pb.h"

namespace kiln {

// What the control service drives; RuntimeServer implements it.
class ControlTarget {
 public:
  virtual ~ControlTarget() = default;
  virtual v1::RuntimeState GetState() = 0;
  virtual absl::Status Promote() = 0;
  // Whether Promote() may take long (a warm-up inference first): then it, and a Demote (which
  // waits for a Promote under way), run on a thread of their own; else both are answered at
  // once on the server's thread.
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

// kiln.v1.RuntimeControl, served on the runtime's unix socket by kiln's own HTTP/2 gRPC server
// (common/grpc_h2_server.h), as the inference port is: grpc++'s callback server hands each call
// between several threads, and on a 2-vCPU VM waking them cost an idle replica's Promote about
// half a millisecond. The quick calls (GetState, Stats, and Promote and Demote when there is
// no warm-up on promotion to wait for) are answered on the server's thread; the ones that can
// block (Promote's warm-up and a Demote waiting for it, Drain, Shutdown, Load) run on a thread
// of their own, so the quick ones still answer meanwhile.
class ControlService {
 public:
  // At most this many blocking calls at once; more are refused RESOURCE_EXHAUSTED (Shutdown
  // never is).
  static constexpr int kMaxBlockingCalls = 16;
  static constexpr char kServicePrefix[] = "/kiln.v1.RuntimeControl/";

  ControlService(ControlTarget* target, absl::Duration default_drain)
      : target_(target), default_drain_(default_drain) {}
  // Joins the workers (JoinWorkers): a blocking call still running is waited for.
  ~ControlService();

  // One call, on the server's thread: answered there, or handed to a worker.
  void Serve(std::shared_ptr<GrpcH2Server::Call> call);
  // Waits until every blocking call's worker has returned (each has answered its call, or found
  // it gone).
  void JoinWorkers();

 private:
  struct Worker {
    std::thread thread;
    bool exited = false;  // past its call's Finish
  };
  void Dispatch(const std::shared_ptr<GrpcH2Server::Call>& call);
  absl::StatusOr<absl::Duration> Deadline(int64_t millis) const;
  // Answers the call with what `work` returns (an exception: INTERNAL), run on a thread of its
  // own. `bounded`: refused RESOURCE_EXHAUSTED while kMaxBlockingCalls are unfinished.
  using Work = std::function<std::pair<grpc::Status, std::string>()>;
  void Blocking(std::shared_ptr<GrpcH2Server::Call> call, Work work, bool bounded = true);

  ControlTarget* target_;
  const absl::Duration default_drain_;
  absl::Mutex mu_;
  std::list<Worker> workers_ ABSL_GUARDED_BY(mu_);
  int active_ ABSL_GUARDED_BY(mu_) = 0;  // blocking calls not yet finished
};

// The control socket's server: `service` on the unix socket `path`, created mode 0600 (no
// moment where others could connect). A socket left by a crashed runtime is removed first;
// anything else at the path, or a socket another process still answers on, is an error naming
// --control-socket. The service must outlive the server.
class ControlServer {
 public:
  static absl::StatusOr<std::unique_ptr<ControlServer>> Start(const std::string& path,
                                                              ControlService* service);
  ~ControlServer();  // Stop(0)
  // Stops taking calls, gives those in flight up to `grace` to be answered (a reply already
  // given is written out first), cancels the rest and closes the socket; the path is left for
  // the caller to remove. Idempotent.
  void Stop(absl::Duration grace);

 private:
  ControlServer(std::unique_ptr<GrpcH2Server> server, int fd)
      : server_(std::move(server)), fd_(fd) {}
  std::unique_ptr<GrpcH2Server> server_;
  int fd_ = -1;
};

inline absl::StatusOr<std::unique_ptr<ControlServer>> StartControlServer(
    const std::string& path, ControlService* service) {
  return ControlServer::Start(path, service);
}

}  // namespace kiln
