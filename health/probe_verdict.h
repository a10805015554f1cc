#pragma once

#include "absl/status/status.h"

namespace kiln {

// What one failed or passed inference probe says of a SERVING replica.
enum class ProbeVerdict {
  kHealthy,  // it answered
  kBusy,     // it ran out of time or queue room, but the model went on executing: routed
  kUnfit,    // the probe itself did not fit what serves there (another model, new inputs):
             // out of routing until a probe passes, never restarted for it
  kBroken,   // the model failed, or the replica refused or executed nothing: out of routing,
             // and counted towards a restart
};

// `executed_since_last`: the replica ran at least one execution between the probe before
// this one and this one's answer (RuntimeStats.batches went up). It tells a replica that is
// only overloaded (its queue full, or the probe queued behind a long backlog) from one whose
// model or device hangs.
ProbeVerdict JudgeProbe(const absl::Status& status, bool executed_since_last);

const char* ProbeVerdictName(ProbeVerdict v);

}  // namespace kiln
