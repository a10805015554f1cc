#include "runtime/lifecycle.h"

#include "common/logging.h"

namespace kiln {

const char* RuntimeStateName(RuntimeState s) {
  switch (s) {
    case RuntimeState::kLoading:
      return "LOADING";
    case RuntimeState::kWarm:
      return "WARM";
    case RuntimeState::kServing:
      return "SERVING";
    case RuntimeState::kDraining:
      return "DRAINING";
    case RuntimeState::kStopped:
      return "STOPPED";
    case RuntimeState::kFailed:
      return "FAILED";
  }
  return "UNKNOWN";
}

bool IsAllowedTransition(RuntimeState from, RuntimeState to) {
  using S = RuntimeState;
  if (from == S::kStopped || from == S::kFailed) return false;
  if (to == S::kFailed) return true;
  switch (from) {
    case S::kLoading:
      return to == S::kWarm;
    case S::kWarm:
      return to == S::kServing || to == S::kDraining;
    case S::kServing:
      return to == S::kWarm || to == S::kDraining;
    case S::kDraining:
      return to == S::kStopped;
    default:
      return false;
  }
}

Lifecycle::Lifecycle(Clock* clock, std::string log_prefix)
    : clock_(clock), log_prefix_(std::move(log_prefix)), since_(clock->Now()) {
  counts_[static_cast<int>(RuntimeState::kLoading)] = 1;
}

RuntimeState Lifecycle::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

absl::Time Lifecycle::since() const {
  absl::MutexLock lock(&mu_);
  return since_;
}

std::string Lifecycle::failure_reason() const {
  absl::MutexLock lock(&mu_);
  return failure_reason_;
}

absl::Status Lifecycle::Transition(RuntimeState to, const std::string& reason) {
  RuntimeState from;
  {
    absl::MutexLock lock(&mu_);
    from = state_;
    if (!IsAllowedTransition(from, to)) {
      return absl::FailedPreconditionError(std::string("cannot go from ") +
                                           RuntimeStateName(from) + " to " +
                                           RuntimeStateName(to));
    }
    state_ = to;
    since_ = clock_->Now();
    counts_[static_cast<int>(to)]++;
    if (to == RuntimeState::kFailed) failure_reason_ = reason;
  }
  auto log = GetLogger("runtime.lifecycle");
  if (to == RuntimeState::kFailed) {
    log->error("{}{} -> {}: {}", log_prefix_, RuntimeStateName(from), RuntimeStateName(to), reason);
  } else {
    log->info("{}{} -> {}: {}", log_prefix_, RuntimeStateName(from), RuntimeStateName(to), reason);
  }
  return absl::OkStatus();
}

void Lifecycle::Fail(const std::string& reason) {
  (void)Transition(RuntimeState::kFailed, reason);
}

std::array<uint64_t, kRuntimeStateCount> Lifecycle::transition_counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

}  // namespace kiln
