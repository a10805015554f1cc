#pragma once

#include "absl/time/time.h"

namespace kiln {

// When this process started (from /proc/self/stat and /proc/uptime), so that
// start-up timings include loading shared libraries before main(). `fallback` when unknown.
absl::Time ProcessStartTime(absl::Time fallback);

}  // namespace kiln
