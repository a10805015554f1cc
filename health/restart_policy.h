#pragma once

#include <deque>

#include "absl/time/time.h"

namespace kiln {

// How a supervisor restarts a replica that exits on its own.
struct RestartPolicy {
  absl::Duration initial_backoff = absl::Seconds(1);
  absl::Duration max_backoff = absl::Seconds(60);
  // Running this long without a crash resets the backoff.
  absl::Duration healthy_reset = absl::Minutes(10);
  // More than `crash_loop_threshold` crashes within `crash_loop_window` is a crash loop.
  int crash_loop_threshold = 5;
  absl::Duration crash_loop_window = absl::Minutes(10);
};

// What a supervisor remembers of one replica's crashes (a value; no clock inside).
struct CrashHistory {
  std::deque<absl::Time> crashes;  // within the window
  int consecutive = 0;             // crashes since the last healthy stretch
  absl::Time last_start = absl::InfinitePast();
};

struct RestartDecision {
  // Restart no sooner than this.
  absl::Time restart_at;
  absl::Duration backoff;
  // A crash loop: report it; the restart waits the maximum backoff (never hot).
  bool crash_loop = false;
  int crashes_in_window = 0;
};

// Records a crash at `now` and decides when to restart: 1 s doubling to 60 s, reset after
// ten healthy minutes (from a start to the crash after it: a start that fails does not call
// OnStart, and the failures after a long run keep doubling); more than five crashes in ten
// minutes is a crash loop.
RestartDecision OnCrash(CrashHistory& history, absl::Time now, const RestartPolicy& policy);

// Records a (re)start at `now`.
inline void OnStart(CrashHistory& history, absl::Time now) { history.last_start = now; }

}  // namespace kiln
