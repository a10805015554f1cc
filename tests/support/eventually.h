#pragma once

// A bounded poll for tests: the condition is looked at every `every` until it holds or
// `limit` has passed (then once more), never a bare sleep.
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kiln::testing {

template <typename F>
bool Eventually(F pred, absl::Duration limit, absl::Duration every = absl::Milliseconds(5)) {
  const absl::Time end = absl::Now() + limit;
  while (absl::Now() < end) {
    if (pred()) return true;
    absl::SleepFor(every);
  }
  return pred();
}

}  // namespace kiln::testing
