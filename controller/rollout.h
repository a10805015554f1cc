#pragma once

// Canary rollouts as a pure state machine over (spec, state, per-version reports, now).
//
// A version change in the spec starts a rollout: the new version (the canary) is placed beside
// the stable one (pre-warmed, at weight 0); when enough canary replicas serve, each step sets
// the canary's traffic weight and holds it for the step's pause. Throughout the step the
// analysis compares the canary with the stable version from the agents' reports, over the
// requests since the step began: once at least `minRequests` reached the canary, an error
// rate over `maxErrorRate` or a p99 latency over `maxLatencyP99Ratio` times the stable one
// fails the rollout at once. The error rate is also judged over the last kAnalysisWindow
// (when at least `minRequests` fell in it), so a canary that turns bad late in a long step
// is caught within a status report or two instead of being diluted by its good past; either
// judgement (weight back to 0, canary drained, condition Degraded, and the
// same version is not tried again until the spec changes). At the end of a step's pause,
// with enough requests and no failure, it passes to the next step; after the last the canary
// is promoted, make before break: it grows to the deployment's replica count while the stable
// set gives up one replica for each canary replica that serves (never more than
// maxUnavailable short in all), the split following the serving counts, with no analysis (the
// decision is made); when all serve it becomes stable and the rest of the old version drains.
// A promotion, once begun, completes: an abort is refused, and a spec naming another version
// waits for it (then rolls out from the promoted version). Before that, a spec that changes version
// again mid-rollout supersedes the canary; a spec set back to the stable version aborts it.
// By hand (`kilnctl rollout ...`): pause holds the current step (failures still roll back),
// or, before a step has begun, keeps its weight from taking effect; resume continues (and
// passes a `pause: {}` step that has begun: a resume that begins one does not also pass it);
// abort rolls back as a failure would; promote makes the canary stable at once. Between steps
// (the next step's replicas coming up, or paused before it began) the last step's weight still
// takes traffic and is judged from that step's start.

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "controller/model_deployment.h"
#include "nlohmann/json.hpp"

namespace kiln {

// Sums over a version's SERVING replicas (counters are cumulative since each replica started).
struct VersionStats {
  int64_t ready = 0;
  uint64_t requests = 0;
  uint64_t errors = 0;
  double p99_micros = 0;  // the worst replica's
};

inline constexpr absl::Duration kAnalysisWindow = absl::Seconds(5);

struct RolloutState {
  std::string phase;           // "", Stable, Progressing, Degraded
  std::string stable_version;
  std::string canary_version;  // empty when no rollout runs
  std::string failed_version;  // not tried again until the spec names another version
  int64_t step = 0;            // the step being held (index into spec.rollout.steps)
  int64_t weight = 0;          // the canary's traffic share now, percent
  absl::Time step_started = absl::InfinitePast();
  uint64_t stable_requests0 = 0, stable_errors0 = 0;  // counters when the step began
  uint64_t canary_requests0 = 0, canary_errors0 = 0;
  std::string message;  // the last analysis or transition, for status and `kilnctl`
  // BlueGreen keeps the old set (at weight 0) for spec.rollout.scaleDownDelay after the switch.
  std::string draining_version;
  absl::Time drain_until = absl::InfinitePast();
  bool paused = false;  // held by hand
  // Promoted (by its last step or by hand) while fewer canary replicas serve than the
  // deployment has: the canary grows to the full count as the stable set shrinks by the canary
  // replicas that serve, and becomes stable only when all of them serve (make before break).
  bool promoting = false;
  // The canary's counters at each analysis of the current step, for the recent window (kept
  // in memory only: after a controller restart the window starts again).
  struct Sample {
    absl::Time at;
    uint64_t requests = 0, errors = 0;
  };
  std::deque<Sample> recent = {};

  nlohmann::json ToJson() const;
  static RolloutState FromJson(const nlohmann::json& j);
};

struct RolloutPlan {
  RolloutState state;
  // Replicas to run per version (the stable one first) and the traffic split.
  std::string stable_version;
  int64_t stable_replicas = 0;
  std::string canary_version;  // empty: none
  int64_t canary_replicas = 0;
  int64_t canary_weight = 0;
  std::string old_version;  // BlueGreen's previous set, kept ready for a while; empty: none
  int64_t old_replicas = 0;
  std::vector<std::string> events;  // transitions to log ("canary 2 step 1: weight 10")
  // The action asked of it was not carried out, and why (empty: carried out, or none asked).
  std::string action_refused;
};

enum class RolloutAction { kNone, kPause, kResume, kAbort, kPromote };
// "pause" -> kPause ...; INVALID_ARGUMENT naming the action otherwise.
absl::StatusOr<RolloutAction> ParseRolloutAction(const std::string& text);

RolloutPlan PlanRollout(const ModelDeploymentSpec& spec, const RolloutState& state,
                        const VersionStats& stable, const VersionStats& canary, absl::Time now,
                        RolloutAction action = RolloutAction::kNone);

// Canary replicas a step of `weight` percent needs: ceil(replicas * weight / 100), at least 1.
int64_t CanaryReplicasFor(int64_t replicas, int64_t weight);

}  // namespace kiln
