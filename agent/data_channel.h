#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "agent/busy_poll.h"
#include "common/data_frames.h"
#include "common/frame_sender.h"
#include "grpcpp/support/status.h"
#include "inference/grpc_service.pb.h"

namespace kiln {

// The router's side of a local replica's data socket (common/data_frames.h): one connection,
// many calls in flight on it, answers matched by tag. Connects on the first call and again
// after the connection ends. Calls past their deadline fail DEADLINE_EXCEEDED whether or not
// the replica ever answers. Thread-safe.
class DataChannel {
 public:
  explicit DataChannel(std::string path) : path_(std::move(path)) {}
  // Busy-polls for answers (agent/busy_poll.h): windows of `spin_window_micros` around each
  // expected answer, while one of `slots` is free.
  DataChannel(std::string path, int64_t spin_window_micros, std::shared_ptr<SpinSlots> slots)
      : path_(std::move(path)), spin_window_micros_(spin_window_micros), slots_(std::move(slots)) {}
  ~DataChannel();  // closes the connection; calls in flight fail UNAVAILABLE

  using Done = std::function<void(const grpc::Status&)>;
  // Sends `request`; `done` runs exactly once, with `response` filled when OK: on the
  // channel's reader thread, or inline when the call could not be sent. UNAVAILABLE when the
  // replica cannot be reached or its connection ended before it answered (it went away: safe
  // to retry elsewhere). `request` is not used after Call returns. `deadline_unix_micros`:
  // 0 = none.
  void Call(const inference::ModelInferRequest& request, int64_t deadline_unix_micros,
            inference::ModelInferResponse* response, Done done);

  // Sends a frame of `code` with `body` and `deadline_unix_micros` (common/data_frames.h);
  // `done` gets the answer's body when the status is OK (code 0), to read or take. The call
  // fails DEADLINE_EXCEEDED at `expire_unix_micros` (0 = never) whatever the frame says.
  // Otherwise as Call.
  using RawDone = std::function<void(const grpc::Status&, std::string* body)>;
  void CallRaw(uint8_t code, std::string body, int64_t deadline_unix_micros,
               int64_t expire_unix_micros, RawDone done);

  // The replica refused a REST inference frame as a code it does not know (a runtime older
  // than this router): REST goes to it over HTTP until its next connection.
  bool json_refused() const { return json_refused_.load(); }
  void set_json_refused() { json_refused_ = true; }

  // Fails every call in flight (UNAVAILABLE) and every later one: the router is stopping.
  void FailAll();

  // How long a replica may stop in the middle of an answer before its connection is closed,
  // so that a call without a deadline does not wait on a half-sent frame for ever (its calls
  // fail UNAVAILABLE and are retried elsewhere). Tests shorten it; each connection's reader
  // reads it when it starts. Zero, negative or infinite: no limit.
  static constexpr absl::Duration kDefaultAnswerStall = absl::Seconds(10);
  void set_answer_stall_limit(absl::Duration d) {
    answer_stall_micros_ = d <= absl::ZeroDuration() || d == absl::InfiniteDuration()
                               ? 0
                               : absl::ToInt64Microseconds(d);
  }

  const std::string& path() const { return path_; }
  // Connections made to the replica so far (one, unless they ended).
  int connections_made() const { return connections_made_.load(); }
  // No call waits on it.
  bool Idle();
  // Spin windows its readers have begun (busy-polling on).
  uint64_t spins() const { return spins_.load(); }
  // Answers its readers found while spinning (the first frame read after a spin).
  uint64_t spin_answers() const { return spin_answers_.load(); }

 private:
  struct Pending {
    RawDone done;
    uint8_t code;  // the request's (kInferFrame, kJsonInferFrame)
    int64_t expire_unix_micros;  // 0 = never
    int64_t sent_micros;  // when it was registered (monotonic micros)
  };
  struct Connection {
    Connection(int fd, int wake_read, int wake_write, int timer_fd);
    ~Connection();  // closes the descriptors: no other holder can write to a reused one
    const int fd;
    const int wake_read, wake_write;  // a pipe: wakes the reader to plan a spin
    // A timerfd (CLOCK_REALTIME, absolute) armed at the nearest deadline: a call's deadline
    // wakes the reader only if it passes, not when the call is made.
    const int timer_fd;
    // Requests are sent from the router's request threads, which must never wait on a
    // replica that stopped reading (common/frame_sender.h).
    std::unique_ptr<FrameSender> sender;
    std::map<uint64_t, Pending> pending;  // guarded by the channel's mu_
    int64_t waiting_until = 0;            // the deadline timer_fd is armed at (mu_), 0 = none
    bool broken = false;                  // guarded by the channel's mu_
    std::atomic<bool> finished{false};    // its reader has failed or answered every call
    int64_t typical_micros = 0;  // answer time, moving average (its reader's alone)
  };
  void ReadLoop(std::shared_ptr<Connection> c);
  // Fails and forgets the connection's calls (its reader saw it end).
  void Broke(const std::shared_ptr<Connection>& c, const std::string& why);
  // Hands a whole answer frame to the call it answers (none: it was past its deadline).
  // `spun`: the reader found it while spinning.
  void Deliver(const std::shared_ptr<Connection>& c, const FrameHeader& h, std::string* body,
               bool spun);
  // Fails the calls whose deadline passed, and arms the timer at the next; returns it (0 =
  // none).
  int64_t Expire(const std::shared_ptr<Connection>& c);
  // Arms `c`'s timer at `unix_micros` (0 = disarmed) and records it.
  void ArmTimer(Connection& c, int64_t unix_micros) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const int64_t spin_window_micros_ = 0;
  std::atomic<int64_t> answer_stall_micros_{absl::ToInt64Microseconds(kDefaultAnswerStall)};
  const std::shared_ptr<SpinSlots> slots_;
  std::atomic<uint64_t> spins_{0};
  std::atomic<uint64_t> spin_answers_{0};
  absl::Mutex mu_;
  std::shared_ptr<Connection> conn_ ABSL_GUARDED_BY(mu_);
  uint64_t next_tag_ ABSL_GUARDED_BY(mu_) = 1;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool connecting_ ABSL_GUARDED_BY(mu_) = false;  // a caller is connecting (outside the lock)
  std::atomic<int> connections_made_{0};
  std::atomic<bool> json_refused_{false};
  // Every connection's reader, joined by the destructor (never by a reader itself).
  std::vector<std::pair<std::shared_ptr<Connection>, std::thread>> readers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln
