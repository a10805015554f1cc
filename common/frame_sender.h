#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kiln {

// Writes whole frames to a stream socket without ever blocking the thread that sends them
// (a replica's engine thread, the router's request thread): a frame the socket takes at once
// is written there and then; what does not fit waits in a backlog that a writer thread of its
// own (started the first time one is needed) drains, in order. A peer that reads nothing for
// `stall` while frames wait, or a backlog over `max_backlog_bytes`, breaks the connection:
// the socket is shut down both ways, which ends its reader too.
//
// Why not a blocking write: a peer that stops reading (a stopped or wedged process) would hold
// the sending thread, and through it every other call that thread serves. Why not a writer
// thread for every frame: a hand-off costs a wake-up across CPUs on each frame.
class FrameSender {
 public:
  // `fd` stays the caller's: never closed here.
  FrameSender(int fd, absl::Duration stall, size_t max_backlog_bytes);
  ~FrameSender();  // stops and joins the writer thread; frames still waiting are dropped

  // False when the connection is broken (now or before): the frame went nowhere.
  bool Send(std::string frame);

  // Frames (or parts of one) waiting for the socket. For tests and metrics.
  size_t backlog_bytes();
  bool broken();
  // Why the sender gave up on the peer and broke the connection (it read nothing for the
  // stall, or the backlog went over its limit); "" when it did not (a send that failed because
  // the peer closed is the peer's doing).
  std::string why_given_up();

 private:
  void Break(std::string why, bool chosen) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes from the front of the backlog what the socket takes now. False on an error.
  bool Drain() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WriteLoop();

  const int fd_;
  const absl::Duration stall_;
  const size_t max_backlog_bytes_;
  absl::Mutex mu_;
  std::deque<std::string> backlog_ ABSL_GUARDED_BY(mu_);
  size_t front_sent_ ABSL_GUARDED_BY(mu_) = 0;  // bytes of backlog_.front() already written
  size_t backlog_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  std::string why_ ABSL_GUARDED_BY(mu_);
  bool chosen_ ABSL_GUARDED_BY(mu_) = false;  // broken by its own choice, not a failed send
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread writer_;  // started under mu_, joined by the destructor
};

}  // namespace kiln
