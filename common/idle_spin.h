#pragma once

// Limits shared by the threads that wait busily for work instead of sleeping (an "idle spin":
// the runtime's executions', gRPC and REST threads).

#include <algorithm>
#include <cstdint>

#include "absl/time/time.h"

namespace kiln {

// kiln-runtime --idle-spin-us and kiln-agent --runtime-idle-spin-us: at most 10 ms.
inline constexpr int64_t kMaxIdleSpinMicros = 10000;

// A spin of 0..1 hour: its end is computed on steady_clock, which an infinite one would
// overflow. Below zero: no spin.
inline absl::Duration ClampIdleSpin(absl::Duration spin) {
  return std::clamp(spin, absl::ZeroDuration(), absl::Hours(1));
}

}  // namespace kiln
