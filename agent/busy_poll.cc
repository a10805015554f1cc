#include "agent/busy_poll.h"

#include <algorithm>

namespace kiln {

SpinWindow PlanSpin(int64_t now, int64_t oldest_sent, int64_t typical_micros,
                    int64_t window_micros) {
  if (window_micros <= 0 || oldest_sent <= 0) return {};
  const int64_t expected = oldest_sent + std::max<int64_t>(typical_micros, 0);
  SpinWindow w;
  w.from = expected - window_micros / 2;
  w.until = w.from + window_micros;
  if (w.until <= now) return {};
  w.from = std::max(w.from, now);
  return w;
}

int64_t NextTypical(int64_t typical_micros, int64_t observed_micros) {
  if (observed_micros < 0) return typical_micros;
  if (typical_micros <= 0) return observed_micros;
  return typical_micros + (observed_micros - typical_micros) / 8;
}

bool SpinSlots::TryAcquire() {
  int n = free_.load();
  while (n > 0) {
    if (free_.compare_exchange_weak(n, n - 1)) return true;
  }
  return false;
}

}  // namespace kiln
