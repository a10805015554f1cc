#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"

namespace kiln {

// LOADING -> WARM -> SERVING -> DRAINING -> STOPPED, FAILED from any state.
// SERVING -> WARM (demote) is allowed; WARM -> DRAINING too (stop an idle replica).
enum class RuntimeState { kLoading, kWarm, kServing, kDraining, kStopped, kFailed };
constexpr int kRuntimeStateCount = 6;
const char* RuntimeStateName(RuntimeState s);
bool IsAllowedTransition(RuntimeState from, RuntimeState to);

// The one place the runtime's state changes. Each transition is logged and counted.
class Lifecycle {
 public:
  explicit Lifecycle(Clock* clock, std::string log_prefix = "");

  RuntimeState state() const;
  absl::Time since() const;
  std::string failure_reason() const;

  // FAILED_PRECONDITION when the transition is not allowed from the current state.
  absl::Status Transition(RuntimeState to, const std::string& reason);
  // Moves to FAILED from any non-terminal state.
  void Fail(const std::string& reason);

  // Number of transitions into each state.
  std::array<uint64_t, kRuntimeStateCount> transition_counts() const;

 private:
  Clock* clock_;
  const std::string log_prefix_;
  mutable absl::Mutex mu_;
  RuntimeState state_ ABSL_GUARDED_BY(mu_) = RuntimeState::kLoading;
  absl::Time since_ ABSL_GUARDED_BY(mu_);
  std::string failure_reason_ ABSL_GUARDED_BY(mu_);
  std::array<uint64_t, kRuntimeStateCount> counts_ ABSL_GUARDED_BY(mu_){};
};

}  // namespace kiln
