#pragma once

// Autoscaling on requests in flight, a pure function of the reports and the time.
//
// The raw recommendation is ceil(in-flight across the deployment's SERVING replicas /
// targetInFlight), clamped to [min, max]. Up at once: a higher recommendation is taken on the
// tick it appears. Down only after `stabilization`: the replica count is the highest
// recommendation seen within the window, so a dip shorter than the window changes nothing
// (the same rule as Kubernetes' HPA scale-down stabilisation). The count in place when the
// history starts counts as a recommendation, so nothing scales down in the first window after
// a controller start.

#include <cstdint>
#include <deque>
#include <string>
#include <utility>

#include "absl/time/time.h"
#include "controller/model_deployment.h"

namespace kiln {

class AutoscaleHistory {
 public:
  // The replica count to run now. `in_flight` is the sum over the deployment's SERVING
  // replicas; `have_reports` false (no replica has reported yet) keeps the current count.
  int64_t Recommend(const Autoscale& spec, double in_flight, bool have_reports, int64_t current,
                    absl::Time now, absl::Duration stabilization);

 private:
  std::deque<std::pair<absl::Time, int64_t>> recent_;  // (when, raw recommendation)
};

// ceil(in_flight / target) clamped to [min, max].
int64_t RawRecommendation(const Autoscale& spec, double in_flight);

// Scale-down to WARM first: how many replicas beyond a deployment's SERVING count stay WARM
// now. Each scale-down leaves its replicas WARM for `window` from when it happened; a scale-up
// inside a window takes replicas back from the newest batches first (they are promoted), so
// a batch counts only replicas still left over. A new stable version starts afresh (the old
// version's replicas drain as usual).
class WarmAfterScaleDown {
 public:
  // The deployment's SERVING count of `version` now; returns the replicas to leave WARM.
  int64_t Update(const std::string& version, int64_t serving, absl::Time now,
                 absl::Duration window);
  // What to keep in the deployment's status, and take up again after a restart.
  const std::string& version() const { return version_; }
  int64_t last_serving() const { return last_serving_; }
  const std::deque<std::pair<absl::Time, int64_t>>& batches() const { return batches_; }
  void Restore(std::string version, int64_t last_serving,
               std::deque<std::pair<absl::Time, int64_t>> batches);
  void Clear() { batches_.clear(); }  // the lingering replicas are gone

 private:
  std::string version_;
  int64_t last_serving_ = 0;
  std::deque<std::pair<absl::Time, int64_t>> batches_;  // (until, replicas), oldest first
};

}  // namespace kiln
