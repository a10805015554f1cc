#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kiln/v1/runtime_control.grpc.pb.h"

namespace kiln {

// The status a RuntimeClient call answers while its answer is still on its way
// (IsAnswerPending): the call goes on, and a later call of the same method takes its answer
// instead of asking again.
absl::Status AnswerPending(const std::string& method);
bool IsAnswerPending(const absl::Status& status);

// The agent's side of kiln.v1.RuntimeControl, one per replica's control socket.
//
// GetState, Promote, Demote, Stats and Load may answer AnswerPending() when the runtime is slow to
// answer: the agent's loop asks every replica in turn and must not wait on a wedged one.
// Promote and Demote are idempotent, so asking again is always safe. An OK Promote or Demote
// answer nobody came back for is dropped once a fresh GetState is answered (the state says
// more than it), and any answer nobody came back for within a second is dropped too.
class RuntimeClient {
 public:
  virtual ~RuntimeClient() = default;
  virtual absl::StatusOr<v1::RuntimeState> GetState() = 0;
  virtual absl::StatusOr<v1::RuntimeState> Promote() = 0;
  virtual absl::StatusOr<v1::RuntimeState> Demote() = 0;
  virtual absl::StatusOr<v1::RuntimeStats> Stats() = 0;
  // Hands a pre-started runtime (kiln-runtime --prestart) its replica: `args` are the command
  // line a cold start would have had. OK once the runtime accepted them. May answer
  // AnswerPending() like the calls above; a runtime takes one Load, so a later Load call takes
  // the answer of the one on its way (its own `args` unused), and that answer is kept for it
  // however long it takes to come back.
  virtual absl::Status Load(const std::vector<std::string>& args) = 0;

  // GetState, waiting for the answer (or the call's deadline) instead of answering pending:
  // for the agent's start-up, which must know before it goes on. A client whose GetState may
  // answer pending overrides it.
  virtual absl::StatusOr<v1::RuntimeState> AwaitState();
  // Starts a Stats call and returns at once, so that a caller asking many replicas (a status
  // report, a metrics scrape) waits for the slowest of them, not for the sum: the next
  // AwaitStats() takes its answer. The base class starts nothing; its AwaitStats asks then.
  virtual void StartStats() {}
  // Stats, waiting for the answer (or the call's deadline) instead of answering pending; the
  // call StartStats began, when there is one.
  virtual absl::StatusOr<v1::RuntimeStats> AwaitStats() { return Stats(); }
};

class RuntimeClientFactory {
 public:
  virtual ~RuntimeClientFactory() = default;
  virtual std::unique_ptr<RuntimeClient> Connect(const std::string& socket_path) = 0;
};

// gRPC over the unix socket; every call has `timeout`, or 200 ms once a call timed out, until
// the runtime answers again. A call waits up to `inline_wait` for its answer (the whole
// timeout by default), then answers AnswerPending() and goes on; `on_late_answer` (may be
// empty) runs when such a call's answer comes, so that its caller can come back for it. It
// runs on the factory's completion-queue thread under the call's own lock: it must not block,
// nor call the client.
// Thread-safe.
class GrpcRuntimeClientFactory : public RuntimeClientFactory {
 public:
  explicit GrpcRuntimeClientFactory(absl::Duration timeout = absl::Seconds(2),
                                    absl::Duration inline_wait = absl::InfiniteDuration(),
                                    std::function<void()> on_late_answer = nullptr);
  ~GrpcRuntimeClientFactory() override;
  std::unique_ptr<RuntimeClient> Connect(const std::string& socket_path) override;

 private:
  absl::Duration timeout_;
  absl::Duration inline_wait_;
  std::function<void()> on_late_answer_;
  // The completion queue (and its thread) its clients' calls end on; shared with them.
  std::shared_ptr<class CallQueue> calls_;
};

}  // namespace kiln
