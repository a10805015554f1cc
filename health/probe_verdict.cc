#include "health/probe_verdict.h"

namespace kiln {

ProbeVerdict JudgeProbe(const absl::Status& status, bool executed_since_last) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return ProbeVerdict::kHealthy;
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kResourceExhausted:
      return executed_since_last ? ProbeVerdict::kBusy : ProbeVerdict::kBroken;
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kCancelled:
      return ProbeVerdict::kBroken;
    default:  // INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, UNIMPLEMENTED, ...
      return ProbeVerdict::kUnfit;
  }
}

const char* ProbeVerdictName(ProbeVerdict v) {
  switch (v) {
    case ProbeVerdict::kHealthy:
      return "healthy";
    case ProbeVerdict::kBusy:
      return "busy";
    case ProbeVerdict::kUnfit:
      return "unfit";
    case ProbeVerdict::kBroken:
      return "broken";
  }
  return "?";
}

}  // namespace kiln
