#pragma once

#include <chrono>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kiln {

// The one source of time. Production code takes a Clock&; tests pass a SimulatedClock and
// advance it instead of sleeping.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;
};

class RealClock : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
};

// Steady time (CLOCK_MONOTONIC) from an arbitrary start, for ages and windows kept in memory
// only: a wall clock stepped by NTP or by hand does not stretch or cut them. Never for times
// written down or shown.
class MonotonicClock : public Clock {
 public:
  absl::Time Now() override {
    return absl::UnixEpoch() + absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
  }
};

// Time moves only when the test says so.
class SimulatedClock : public Clock {
 public:
  explicit SimulatedClock(absl::Time start = absl::UnixEpoch() + absl::Hours(24 * 365 * 50))
      : now_(start) {}
  absl::Time Now() override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }
  void Set(absl::Time t) {
    absl::MutexLock lock(&mu_);
    now_ = t;
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln
