#include "health/restart_policy.h"

#include <algorithm>

namespace kiln {

RestartDecision OnCrash(CrashHistory& h, absl::Time now, const RestartPolicy& p) {
  if (h.last_start != absl::InfinitePast() && now - h.last_start >= p.healthy_reset) {
    h.consecutive = 0;
  }
  // Until the next start: crashes with no start between them (launches that failed) are one
  // run of failures, not a healthy stretch each.
  h.last_start = absl::InfinitePast();
  h.consecutive++;
  h.crashes.push_back(now);
  while (!h.crashes.empty() && now - h.crashes.front() > p.crash_loop_window) h.crashes.pop_front();

  RestartDecision d;
  d.crashes_in_window = static_cast<int>(h.crashes.size());
  d.crash_loop = d.crashes_in_window > p.crash_loop_threshold;
  absl::Duration backoff = p.initial_backoff;
  for (int i = 1; i < h.consecutive && backoff < p.max_backoff; ++i) backoff *= 2;
  d.backoff = d.crash_loop ? p.max_backoff : std::min(backoff, p.max_backoff);
  d.restart_at = now + d.backoff;
  return d;
}

}  // namespace kiln
