#pragma once

// Leader election on a coordination.k8s.io/v1 Lease, with client-go's rules and defaults
// (lease 15 s, renew deadline 10 s, retry 2 s). A candidate takes the Lease when it is absent
// or when its holder has not renewed it for leaseDurationSeconds, measured on this process's
// own clock from when it last saw the record change (clocks of different nodes are never
// compared). The leader renews every retry period; when it has not managed to renew for the
// renew deadline it steps down, which is before the lease could have run out for the others.
// Writes carry the resourceVersion read, so two candidates never both win a race.

#include <functional>
#include <string>

#include "absl/time/time.h"
#include "common/clock.h"
#include "controller/kube_client.h"
#include "nlohmann/json.hpp"

namespace kiln {

// The label the leader puts on its own Pod, so that a Service selecting it (the agents'
// kiln-controller-leader) reaches the leader alone.
inline constexpr char kLeaderPodLabel[] = "serving.kiln.dev/leader";

// Sets (leader) or removes the label on Pod `pod` in `ns` with a JSON merge patch.
absl::Status LabelPodAsLeader(KubeClient* client, const std::string& ns, const std::string& pod,
                              bool leader);

struct LeaderElectionOptions {
  std::string lease_name = "kiln-controller";
  std::string identity;  // this candidate (the pod name)
  absl::Duration lease_duration = absl::Seconds(15);
  absl::Duration renew_deadline = absl::Seconds(10);
  absl::Duration retry_period = absl::Seconds(2);
};

class LeaderElector {
 public:
  // INVALID_ARGUMENT unless lease_duration > renew_deadline > retry_period > 0 and an
  // identity is given.
  static absl::Status Validate(const LeaderElectionOptions& o);

  LeaderElector(KubeClient* client, LeaderElectionOptions options, Clock* clock);

  // One round: acquire or renew, and step down when the renew deadline has passed. Returns
  // whether this candidate leads now. Call it every retry period.
  bool Tick();
  bool IsLeader() const { return leading_; }
  // When a leader that does not renew by then must step down (its next Tick then does so
  // without a request); InfiniteFuture while following. Wait no longer than this between ticks.
  absl::Time StepDownAt() const {
    return leading_ ? last_renew_ + options_.renew_deadline : absl::InfiniteFuture();
  }
  // The last error talking to the API ("" when the last round reached it).
  const std::string& last_error() const { return last_error_; }

  // Gives the Lease up (holder emptied) so a successor need not wait for it to expire.
  void Release();

 private:
  // One GET and one write, each waiting at most a retry period and not past `deadline`.
  bool TryAcquireOrRenew(absl::Time deadline);
  std::string LeasesPath() const;  // the namespace's Lease collection

  KubeClient* client_;
  const LeaderElectionOptions options_;
  Clock* clock_;
  bool leading_ = false;
  absl::Time last_renew_ = absl::InfinitePast();
  nlohmann::json observed_spec_;  // the Lease spec last read
  absl::Time observed_at_ = absl::InfinitePast();
  std::string last_error_;
  bool held_by_other_ = false;  // the last read found another holder within its lease
};

}  // namespace kiln
