#include "controller/leader_election.h"

#include <algorithm>

#include "common/logging.h"
#include "controller/model_deployment.h"

namespace kiln {

using nlohmann::json;

absl::Status LeaderElector::Validate(const LeaderElectionOptions& o) {
  if (o.identity.empty()) return absl::InvalidArgumentError("leader election: identity must not be empty");
  if (o.lease_name.empty()) return absl::InvalidArgumentError("leader election: lease name must not be empty");
  if (!(o.retry_period > absl::ZeroDuration())) {
    return absl::InvalidArgumentError("leader election: retry period must be > 0");
  }
  if (!(o.renew_deadline > o.retry_period)) {
    return absl::InvalidArgumentError("leader election: renew deadline must be longer than the retry period");
  }
  if (!(o.lease_duration > o.renew_deadline)) {
    return absl::InvalidArgumentError("leader election: lease duration must be longer than the renew deadline");
  }
  return absl::OkStatus();
}

LeaderElector::LeaderElector(KubeClient* client, LeaderElectionOptions options, Clock* clock)
    : client_(client), options_(std::move(options)), clock_(clock) {}

bool LeaderElector::Tick() {
  auto log = GetLogger("controller.leader");
  // A renewal counts from before it was sent: the others' lease clocks start when they see it,
  // which is after it lands, which is after this. And a leader whose deadline has passed does
  // not try again before stepping down, nor wait past the deadline for an answer.
  const absl::Time start = clock_->Now();
  absl::Time deadline = absl::InfiniteFuture();
  if (leading_) {
    deadline = last_renew_ + options_.renew_deadline;
    if (start >= deadline) {
      log->warn("{} could not renew lease {} for {}: stepping down ({})", options_.identity,
                options_.lease_name, FormatDurationString(start - last_renew_), last_error_);
      leading_ = false;
      return false;
    }
  }
  bool ok = TryAcquireOrRenew(deadline);
  absl::Time now = clock_->Now();
  if (ok && now >= deadline) {
    ok = false;  // it landed, but the answer came after this leader had to step down
    last_error_ = "the renewal was answered after the renew deadline";
  }
  if (ok) {
    if (!leading_) log->info("{} leads (lease {})", options_.identity, options_.lease_name);
    leading_ = true;
    last_renew_ = start;
  } else if (leading_ && held_by_other_) {
    log->warn("{} lost lease {} to another holder: stepping down", options_.identity, options_.lease_name);
    leading_ = false;
  } else if (leading_ && now - last_renew_ >= options_.renew_deadline) {
    log->warn("{} could not renew lease {} for {}: stepping down ({})", options_.identity,
              options_.lease_name, FormatDurationString(now - last_renew_), last_error_);
    leading_ = false;
  }
  return leading_;
}

std::string LeaderElector::LeasesPath() const {
  return "/apis/coordination.k8s.io/v1/namespaces/" + client_->config().ns + "/leases";
}

bool LeaderElector::TryAcquireOrRenew(absl::Time deadline) {
  const std::string ns = client_->config().ns;
  const std::string collection = LeasesPath();
  absl::Time now = clock_->Now();
  held_by_other_ = false;
  // Each request waits a retry period at most, and never past the renew deadline.
  auto timeout = [&] {
    return std::max(absl::Milliseconds(1),
                    std::min(options_.retry_period, deadline - clock_->Now()));
  };
  json spec = {{"holderIdentity", options_.identity},
               {"leaseDurationSeconds", absl::ToInt64Seconds(options_.lease_duration)},
               {"acquireTime", FormatRfc3339Micros(now)},
               {"renewTime", FormatRfc3339Micros(now)},
               {"leaseTransitions", 0}};
  auto got = client_->Call("GET", collection + "/" + options_.lease_name, nullptr, timeout());
  if (!got.ok()) {
    last_error_ = std::string(got.status().message());
    return false;
  }
  if (got->code == 404) {
    json body = {{"apiVersion", "coordination.k8s.io/v1"}, {"kind", "Lease"},
                 {"metadata", {{"name", options_.lease_name}, {"namespace", ns}}}, {"spec", spec}};
    auto created = client_->Call("POST", collection, &body, timeout());
    if (!created.ok()) {
      last_error_ = std::string(created.status().message());
      return false;
    }
    if (created->code != 201 && created->code != 200) {
      last_error_ = "create lease: " + KubeClient::Describe(*created);
      return false;
    }
    last_error_.clear();
    observed_spec_ = spec;
    observed_at_ = now;
    return true;
  }
  if (got->code != 200 || !got->body.is_object()) {
    last_error_ = "get lease: " + KubeClient::Describe(*got);
    return false;
  }
  last_error_.clear();
  json lease = got->body;
  json old = lease.value("spec", json::object());
  if (old != observed_spec_) {  // the record moved: restart this candidate's expiry clock
    observed_spec_ = old;
    observed_at_ = now;
  }
  const std::string holder = old.value("holderIdentity", "");
  const bool mine = holder == options_.identity;
  const absl::Duration held_for = absl::Seconds(old.value("leaseDurationSeconds", int64_t{15}));
  if (!holder.empty() && !mine && observed_at_ + held_for > now) {
    held_by_other_ = true;
    return false;
  }
  if (mine) {
    spec["acquireTime"] = old.value("acquireTime", spec["acquireTime"].get<std::string>());
    spec["leaseTransitions"] = old.value("leaseTransitions", int64_t{0});
  } else {
    spec["leaseTransitions"] = old.value("leaseTransitions", int64_t{0}) + 1;
  }
  lease["spec"] = spec;
  auto put = client_->Call("PUT", collection + "/" + options_.lease_name, &lease, timeout());
  if (!put.ok()) {
    last_error_ = std::string(put.status().message());
    return false;
  }
  if (put->code != 200) {
    last_error_ = "update lease: " + KubeClient::Describe(*put);
    return false;
  }
  observed_spec_ = spec;
  observed_at_ = now;
  return true;
}

void LeaderElector::Release() {
  if (!leading_) return;
  leading_ = false;
  const std::string path = LeasesPath() + "/" + options_.lease_name;
  auto got = client_->Call("GET", path, nullptr, options_.retry_period);
  if (!got.ok() || got->code != 200 || !got->body.is_object()) return;
  json lease = got->body;
  if (lease["spec"].value("holderIdentity", "") != options_.identity) return;
  // As client-go's ReleaseOnCancel: an empty holder and a 1 s lease.
  lease["spec"]["holderIdentity"] = "";
  lease["spec"]["leaseDurationSeconds"] = 1;
  lease["spec"]["renewTime"] = FormatRfc3339Micros(clock_->Now());
  client_->Call("PUT", path, &lease, options_.retry_period).IgnoreError();
}

absl::Status LabelPodAsLeader(KubeClient* client, const std::string& ns, const std::string& pod,
                              bool leader) {
  nlohmann::json patch = {
      {"metadata", {{"labels", {{kLeaderPodLabel, leader ? nlohmann::json("true") : nlohmann::json()}}}}}};
  auto r = client->Call("PATCH", "/api/v1/namespaces/" + ns + "/pods/" + pod, &patch,
                        absl::Seconds(5), "application/merge-patch+json");
  if (!r.ok()) return r.status();
  if (r->code != 200) {
    return absl::UnavailableError("pod " + ns + "/" + pod + ": " + KubeClient::Describe(*r));
  }
  return absl::OkStatus();
}

}  // namespace kiln
