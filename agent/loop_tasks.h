#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kiln {

// Work other threads hand to the agent's loop (a controller's assignment, a routing table),
// each answered with its outcome. A task the loop does not begin within the caller's wait is
// withdrawn and never runs: the caller was told it failed (and Nacked it), so it must not take
// effect behind that answer. One the loop has begun is waited for to its end.
class LoopTasks {
 public:
  // `on_queued` runs after each task is queued (to wake the loop).
  explicit LoopTasks(std::function<void()> on_queued = nullptr)
      : on_queued_(std::move(on_queued)) {}

  // Queues `task` and waits up to `wait` for the loop to begin it, then for it to finish.
  // DEADLINE_EXCEEDED when the loop did not begin it in time (it is withdrawn).
  absl::Status Run(std::function<absl::Status()> task, absl::Duration wait);

  // The loop's side: runs what was queued before this call and not withdrawn. Returns how
  // many ran.
  int RunPending();

  // Something is queued (withdrawn tasks included until the next RunPending).
  bool HasPending() const;

 private:
  struct Task {
    std::function<absl::Status()> fn;
    absl::Mutex mu;
    bool began ABSL_GUARDED_BY(mu) = false;
    bool withdrawn ABSL_GUARDED_BY(mu) = false;
    bool done ABSL_GUARDED_BY(mu) = false;
    absl::Status result ABSL_GUARDED_BY(mu);
  };
  const std::function<void()> on_queued_;
  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<Task>> queue_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln
