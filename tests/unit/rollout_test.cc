#include "controller/rollout.h"

#include "gtest/gtest.h"

namespace kiln {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1800000000);

ModelDeploymentSpec Spec(const std::string& version, std::vector<RolloutStep> steps,
                         int64_t replicas = 4) {
  ModelDeploymentSpec s;
  s.model.name = "encoder";
  s.model.version = version;
  s.replicas = replicas;
  s.rollout.steps = std::move(steps);
  s.rollout.analysis = {0.01, 1.25, 100};
  return s;
}

VersionStats Stats(int64_t ready, uint64_t requests, uint64_t errors, double p99 = 1000) {
  return {ready, requests, errors, p99};
}

// An A/B test at `version`: 30% to the other version, held until promoted or aborted.
ModelDeploymentSpec AbTestSpec(const std::string& version) {
  auto spec = Spec(version, {{30, absl::ZeroDuration(), false}});
  spec.rollout.strategy = "ABTest";
  return spec;
}

const std::vector<RolloutStep> kTwoSteps = {{25, absl::Seconds(30), false},
                                            {50, absl::Seconds(30), false}};

TEST(RolloutTest, TheFirstVersionIsStableAtOnce) {
  auto p = PlanRollout(Spec("1", kTwoSteps), {}, {}, {}, kT0);
  EXPECT_EQ(p.state.phase, "Stable");
  EXPECT_EQ(p.stable_version, "1");
  EXPECT_EQ(p.stable_replicas, 4);
  EXPECT_TRUE(p.canary_version.empty());
}

TEST(RolloutTest, AGoodCanaryWalksTheStepsAndIsPromoted) {
  auto spec1 = Spec("1", kTwoSteps);
  RolloutState s = PlanRollout(spec1, {}, {}, {}, kT0).state;
  auto spec2 = Spec("2", kTwoSteps);
  // Pre-warm: one canary replica (25% of 4) placed at weight 0 until it serves.
  auto p = PlanRollout(spec2, s, Stats(4, 1000, 0), Stats(0, 0, 0), kT0);
  EXPECT_EQ(p.state.phase, "Progressing");
  EXPECT_EQ(p.canary_version, "2");
  EXPECT_EQ(p.canary_replicas, 1);
  EXPECT_EQ(p.canary_weight, 0);
  EXPECT_EQ(p.stable_replicas, 4);  // the stable set stays whole during the rollout
  ASSERT_EQ(p.events.size(), 1u);
  // It serves: step 1 takes 25%.
  p = PlanRollout(spec2, p.state, Stats(4, 1000, 0), Stats(1, 0, 0), kT0 + absl::Seconds(1));
  EXPECT_EQ(p.canary_weight, 25);
  // Within the pause: held even with clean traffic.
  p = PlanRollout(spec2, p.state, Stats(4, 2000, 0), Stats(1, 300, 1), kT0 + absl::Seconds(20));
  EXPECT_EQ(p.canary_weight, 25);
  EXPECT_EQ(p.state.step, 0);
  // Pause over, analysis passes: step 2 needs 2 canary replicas first.
  p = PlanRollout(spec2, p.state, Stats(4, 3000, 0), Stats(1, 400, 1), kT0 + absl::Seconds(31));
  EXPECT_EQ(p.state.step, 1);
  EXPECT_EQ(p.canary_replicas, 2);
  p = PlanRollout(spec2, p.state, Stats(4, 3000, 0), Stats(1, 400, 1), kT0 + absl::Seconds(32));
  EXPECT_EQ(p.canary_weight, 25);  // not ready yet
  p = PlanRollout(spec2, p.state, Stats(4, 3000, 0), Stats(2, 400, 1), kT0 + absl::Seconds(33));
  EXPECT_EQ(p.canary_weight, 50);
  // The last step passes: promoted, make before break, replica by replica. 2 of 4 canary
  // replicas serve: the stable set keeps 2, the canary grows to 4, the split follows (50%).
  p = PlanRollout(spec2, p.state, Stats(4, 4000, 0), Stats(2, 900, 2), kT0 + absl::Seconds(64));
  EXPECT_EQ(p.state.phase, "Progressing");
  EXPECT_TRUE(p.state.promoting);
  EXPECT_EQ(p.stable_version, "1");
  EXPECT_EQ(p.stable_replicas, 2);
  EXPECT_EQ(p.canary_version, "2");
  EXPECT_EQ(p.canary_replicas, 3);  // one more at a time (maxSurge 1)
  EXPECT_EQ(p.canary_weight, 50);
  EXPECT_NE(p.events.back().find("promoting"), std::string::npos);
  EXPECT_NE(p.state.message.find("2/4 replica(s) serving"), std::string::npos) << p.state.message;
  // A third serves: the stable set gives up another, 75% to the canary. Bad numbers no longer
  // matter: the decision is made.
  p = PlanRollout(spec2, RolloutState::FromJson(p.state.ToJson()), Stats(2, 5000, 0),
                  Stats(3, 2000, 900), kT0 + absl::Seconds(65));
  EXPECT_TRUE(p.state.promoting);
  EXPECT_EQ(p.stable_replicas, 1);
  EXPECT_EQ(p.canary_replicas, 4);
  EXPECT_EQ(p.canary_weight, 75);
  EXPECT_TRUE(p.events.empty());
  // With maxUnavailable 1 the stable set may run one short of the count.
  auto loose = spec2;
  loose.rollout.max_unavailable = 1;
  EXPECT_EQ(PlanRollout(loose, p.state, Stats(1, 5000, 0), Stats(3, 2000, 900),
                        kT0 + absl::Seconds(65))
                .stable_replicas,
            0);
  p = PlanRollout(spec2, p.state, Stats(1, 5000, 0), Stats(4, 2000, 900), kT0 + absl::Seconds(66));
  EXPECT_EQ(p.state.phase, "Stable");
  EXPECT_FALSE(p.state.promoting);
  EXPECT_EQ(p.state.stable_version, "2");
  EXPECT_EQ(p.stable_version, "2");
  EXPECT_EQ(p.stable_replicas, 4);
  EXPECT_TRUE(p.canary_version.empty());
  EXPECT_TRUE(p.old_version.empty());  // version 1 drains now
  ASSERT_FALSE(p.events.empty());
  EXPECT_NE(p.events.back().find("promoted: all 4 replica(s) serve"), std::string::npos)
      << p.events.back();
}

// A promotion, once begun, completes: an abort is refused (said in an event), and a spec that
// names another version waits for it, then rolls out from the promoted version.
TEST(RolloutTest, APromotionCompletesWhateverComes) {
  RolloutState s = PlanRollout(Spec("1", kTwoSteps), {}, {}, {}, kT0).state;
  auto spec2 = Spec("2", kTwoSteps);
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(1, 0, 0), kT0);
  p = PlanRollout(spec2, p.state, Stats(4, 0, 0), Stats(1, 0, 0), kT0 + absl::Seconds(1),
                  RolloutAction::kPromote);
  ASSERT_TRUE(p.state.promoting);
  EXPECT_EQ(p.canary_weight, 25);  // 1 serving beside 3
  EXPECT_EQ(p.stable_replicas, 3);
  EXPECT_EQ(p.canary_replicas, 2);
  // Pause changes nothing.
  auto again = PlanRollout(spec2, p.state, Stats(3, 0, 0), Stats(2, 0, 0), kT0 + absl::Seconds(2),
                           RolloutAction::kPause);
  EXPECT_TRUE(again.state.promoting);
  EXPECT_FALSE(again.state.paused);
  EXPECT_EQ(again.canary_replicas, 3);
  EXPECT_EQ(again.stable_replicas, 2);
  EXPECT_EQ(again.canary_weight, 50);
  // An abort is refused: dropping the new version now would leave too few serving.
  auto aborted = PlanRollout(spec2, again.state, Stats(2, 0, 0), Stats(2, 0, 0),
                             kT0 + absl::Seconds(3), RolloutAction::kAbort);
  EXPECT_TRUE(aborted.state.promoting);
  EXPECT_EQ(aborted.canary_version, "2");
  ASSERT_FALSE(aborted.events.empty());
  EXPECT_NE(aborted.events.back().find("abort refused"), std::string::npos);
  // A new version in the spec waits for the promotion...
  auto spec3 = Spec("3", kTwoSteps);
  auto next = PlanRollout(spec3, again.state, Stats(2, 0, 0), Stats(3, 0, 0), kT0 + absl::Seconds(3));
  EXPECT_TRUE(next.state.promoting);
  EXPECT_EQ(next.canary_version, "2");
  EXPECT_EQ(next.canary_weight, 75);
  EXPECT_NE(next.state.message.find("version 3 waits for it"), std::string::npos)
      << next.state.message;
  next = PlanRollout(spec3, next.state, Stats(1, 0, 0), Stats(4, 0, 0), kT0 + absl::Seconds(4));
  EXPECT_EQ(next.state.stable_version, "2");
  EXPECT_FALSE(next.state.promoting);
  // ...then rolls out from it.
  next = PlanRollout(spec3, next.state, Stats(4, 0, 0), Stats(0, 0, 0), kT0 + absl::Seconds(5));
  EXPECT_EQ(next.stable_version, "2");
  EXPECT_EQ(next.canary_version, "3");
  EXPECT_EQ(next.canary_weight, 0);  // pre-warming
}

TEST(RolloutTest, ABadCanaryIsRolledBackAssoonAsTheNumbersSaySo) {
  RolloutState s = PlanRollout(Spec("1", kTwoSteps), {}, {}, {}, kT0).state;
  auto spec2 = Spec("2", kTwoSteps);
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(1, 0, 0), kT0);
  ASSERT_EQ(p.canary_weight, 25);
  // Too few requests to judge: nothing happens yet.
  p = PlanRollout(spec2, p.state, Stats(4, 500, 0), Stats(1, 50, 25), kT0 + absl::Seconds(1));
  EXPECT_EQ(p.state.phase, "Progressing");
  // Enough: 5% errors over the 1% limit, mid-pause -> rolled back at once.
  p = PlanRollout(spec2, p.state, Stats(4, 1000, 0), Stats(1, 200, 10), kT0 + absl::Seconds(2));
  EXPECT_EQ(p.state.phase, "Degraded");
  EXPECT_EQ(p.canary_weight, 0);
  EXPECT_TRUE(p.canary_version.empty());
  EXPECT_EQ(p.stable_version, "1");
  EXPECT_NE(p.state.message.find("failed analysis"), std::string::npos) << p.state.message;
  // Not retried while the spec still names it; a new version starts a new rollout.
  p = PlanRollout(spec2, p.state, Stats(4, 1000, 0), Stats(0, 0, 0), kT0 + absl::Seconds(60));
  EXPECT_EQ(p.state.phase, "Degraded");
  EXPECT_TRUE(p.canary_version.empty());
  p = PlanRollout(Spec("3", kTwoSteps), p.state, Stats(4, 1000, 0), Stats(0, 0, 0),
                  kT0 + absl::Seconds(61));
  EXPECT_EQ(p.state.phase, "Progressing");
  EXPECT_EQ(p.canary_version, "3");
}

TEST(RolloutTest, ACanaryThatTurnsBadLateIsCaughtByTheRecentWindow) {
  const std::vector<RolloutStep> long_step = {{10, absl::Minutes(30), false}};
  RolloutState s = PlanRollout(Spec("1", long_step), {}, {}, {}, kT0).state;
  auto spec2 = Spec("2", long_step);
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(1, 0, 0), kT0);
  ASSERT_EQ(p.canary_weight, 10);
  // Ten clean minutes at 100 requests a second, reported each second.
  uint64_t req = 0, err = 0;
  absl::Time t = kT0;
  for (int i = 0; i < 600; ++i) {
    t += absl::Seconds(1);
    req += 100;
    p = PlanRollout(spec2, p.state, Stats(4, 10 * req, 0), Stats(1, req, err), t);
    ASSERT_EQ(p.state.phase, "Progressing") << p.state.message;
  }
  EXPECT_LE(p.state.recent.size(), 7u);  // the window, not the whole step
  // Then half its requests fail: the next report rolls it back, although over the whole step
  // the error rate is still under 1% (50 of 60,100).
  t += absl::Seconds(1);
  req += 100;
  err += 50;
  p = PlanRollout(spec2, p.state, Stats(4, 10 * req, 0), Stats(1, req, err), t);
  EXPECT_EQ(p.state.phase, "Degraded") << p.state.message;
  EXPECT_EQ(p.canary_weight, 0);
  EXPECT_NE(p.state.message.find("over the last 5s: 500 requests, error rate 10.00%"),
            std::string::npos)
      << p.state.message;
}

TEST(RolloutTest, TheRecentWindowNeedsMinRequestsToo) {
  const std::vector<RolloutStep> long_step = {{10, absl::Minutes(30), false}};
  RolloutState s = PlanRollout(Spec("1", long_step), {}, {}, {}, kT0).state;
  auto spec2 = Spec("2", long_step);
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(1, 0, 0), kT0);
  // A trickle (5 requests a second, 25 in any window) with one failure now and then: the
  // window never holds 100 requests, and the step as a whole stays under 1%.
  uint64_t req = 0, err = 0;
  absl::Time t = kT0;
  for (int i = 1; i <= 120; ++i) {
    t += absl::Seconds(1);
    req += 5;
    if (i % 40 == 0) err++;
    p = PlanRollout(spec2, p.state, Stats(4, 10 * req, 0), Stats(1, req, err), t);
  }
  EXPECT_EQ(p.state.phase, "Progressing") << p.state.message;
}

TEST(RolloutTest, ACounterThatGoesBackRestartsTheWindowInsteadOfFailingIt) {
  const std::vector<RolloutStep> long_step = {{10, absl::Minutes(30), false}};
  RolloutState s = PlanRollout(Spec("1", long_step), {}, {}, {}, kT0).state;
  auto spec2 = Spec("2", long_step);
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(2, 0, 0), kT0);
  // 0.5% errors for a while (under the 1% limit).
  uint64_t req = 0, err = 0;
  absl::Time t = kT0;
  for (int i = 0; i < 100; ++i) {
    t += absl::Seconds(1);
    req += 1000;
    err += 5;
    p = PlanRollout(spec2, p.state, Stats(4, 10 * req, 0), Stats(2, req, err), t);
  }
  ASSERT_EQ(p.state.phase, "Progressing") << p.state.message;
  // One canary replica stops serving: the sums lose its errors while the other one's requests
  // still grow. Not a burst of errors.
  t += absl::Seconds(1);
  p = PlanRollout(spec2, p.state, Stats(4, 10 * req, 0), Stats(1, req + 500, err - 200), t);
  EXPECT_EQ(p.state.phase, "Progressing") << p.state.message;
  EXPECT_EQ(p.state.recent.size(), 1u);
}

TEST(RolloutTest, SlowCanaryFailsOnTheLatencyRatio) {
  RolloutState s = PlanRollout(Spec("1", kTwoSteps), {}, {}, {}, kT0).state;
  auto spec2 = Spec("2", kTwoSteps);
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0, 1000), Stats(1, 0, 0, 1000), kT0);
  p = PlanRollout(spec2, p.state, Stats(4, 900, 0, 1000), Stats(1, 150, 0, 1400),
                  kT0 + absl::Seconds(5));
  EXPECT_EQ(p.state.phase, "Degraded");
  EXPECT_NE(p.state.message.find("p99 ratio 1.40"), std::string::npos) << p.state.message;
}

TEST(RolloutTest, SupersededAndAbortedBySpecChanges) {
  RolloutState s = PlanRollout(Spec("1", kTwoSteps), {}, {}, {}, kT0).state;
  auto p = PlanRollout(Spec("2", kTwoSteps), s, {}, Stats(1, 0, 0), kT0);
  ASSERT_EQ(p.canary_version, "2");
  p = PlanRollout(Spec("3", kTwoSteps), p.state, {}, Stats(0, 0, 0), kT0 + absl::Seconds(1));
  EXPECT_EQ(p.canary_version, "3");
  EXPECT_EQ(p.canary_weight, 0);  // starts over, pre-warming
  EXPECT_NE(p.events[0].find("superseded"), std::string::npos);
  p = PlanRollout(Spec("1", kTwoSteps), p.state, {}, {}, kT0 + absl::Seconds(2));
  EXPECT_EQ(p.state.phase, "Stable");
  EXPECT_TRUE(p.canary_version.empty());
  EXPECT_NE(p.events[0].find("aborted"), std::string::npos);
}

TEST(RolloutTest, BlueGreenSwitchesOnceTheWholeNewSetServes) {
  auto spec1 = Spec("1", {});
  spec1.rollout.strategy = "BlueGreen";
  RolloutState s = PlanRollout(spec1, {}, {}, {}, kT0).state;
  auto spec2 = spec1;
  spec2.model.version = "2";
  spec2.rollout.analysis.min_requests = 0;
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(3, 0, 0), kT0);
  EXPECT_EQ(p.canary_replicas, 4);
  EXPECT_EQ(p.canary_weight, 0);
  p = PlanRollout(spec2, p.state, Stats(4, 0, 0), Stats(4, 0, 0), kT0 + absl::Seconds(1));
  EXPECT_EQ(p.state.phase, "Stable");
  EXPECT_EQ(p.stable_version, "2");
  // The old set stays ready (no traffic) for scaleDownDelay (30 s by default), then drains.
  EXPECT_EQ(p.old_version, "1");
  EXPECT_EQ(p.old_replicas, 4);
  p = PlanRollout(spec2, RolloutState::FromJson(p.state.ToJson()), Stats(4, 0, 0), {},
                  kT0 + absl::Seconds(20));
  EXPECT_EQ(p.old_version, "1");
  p = PlanRollout(spec2, p.state, Stats(4, 0, 0), {}, kT0 + absl::Seconds(32));
  EXPECT_TRUE(p.old_version.empty());
  EXPECT_TRUE(p.state.draining_version.empty());
  EXPECT_NE(p.events.back().find("version 1 drained"), std::string::npos);
}

TEST(RolloutTest, AbTestHoldsItsSplit) {
  RolloutState s = PlanRollout(AbTestSpec("1"), {}, {}, {}, kT0).state;
  auto spec2 = AbTestSpec("2");
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(2, 0, 0), kT0);
  p = PlanRollout(spec2, p.state, Stats(4, 5000, 0), Stats(2, 2000, 0), kT0 + absl::Hours(5));
  EXPECT_EQ(p.canary_weight, 30);
  EXPECT_EQ(p.state.phase, "Progressing");
  EXPECT_NE(p.state.message.find("A/B test running"), std::string::npos);
  // Worse numbers on one side are shown, not acted on: people end an A/B test.
  p = PlanRollout(spec2, p.state, Stats(4, 6000, 0), Stats(2, 3000, 500), kT0 + absl::Hours(6));
  EXPECT_EQ(p.state.phase, "Progressing");
  EXPECT_EQ(p.canary_weight, 30);
  EXPECT_NE(p.state.message.find("error rate"), std::string::npos) << p.state.message;
}

TEST(RolloutTest, StateRoundTripsThroughJson) {
  RolloutState s = PlanRollout(Spec("1", kTwoSteps), {}, {}, {}, kT0).state;
  auto p = PlanRollout(Spec("2", kTwoSteps), s, Stats(4, 77, 1), Stats(1, 5, 0), kT0);
  RolloutState back = RolloutState::FromJson(p.state.ToJson());
  EXPECT_EQ(back.ToJson(), p.state.ToJson());
  EXPECT_EQ(back.step_started, kT0);
  EXPECT_EQ(back.stable_requests0, 77u);
  EXPECT_EQ(RolloutState::FromJson(nlohmann::json("junk")).phase, "");
}

TEST(RolloutTest, CanaryReplicaCounts) {
  EXPECT_EQ(CanaryReplicasFor(4, 25), 1);
  EXPECT_EQ(CanaryReplicasFor(4, 26), 2);
  EXPECT_EQ(CanaryReplicasFor(10, 5), 1);
  EXPECT_EQ(CanaryReplicasFor(0, 50), 1);
  EXPECT_EQ(CanaryReplicasFor(3, 100), 3);
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

TEST(RolloutActionTest, PauseHoldsResumeContinues) {
  RolloutState s = PlanRollout(Spec("1", kTwoSteps), {}, {}, {}, kT0).state;
  auto spec2 = Spec("2", kTwoSteps);
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(1, 0, 0), kT0);
  ASSERT_EQ(p.canary_weight, 25);
  p = PlanRollout(spec2, p.state, Stats(4, 0, 0), Stats(1, 0, 0), kT0 + absl::Seconds(1),
                  RolloutAction::kPause);
  EXPECT_TRUE(p.state.paused);
  // Past the pause with good numbers: still held.
  p = PlanRollout(spec2, p.state, Stats(4, 900, 0), Stats(1, 300, 0), kT0 + absl::Seconds(40));
  EXPECT_EQ(p.state.step, 0);
  EXPECT_NE(p.state.message.find("paused by hand"), std::string::npos);
  // A failure still rolls back while paused.
  auto failing = PlanRollout(spec2, p.state, Stats(4, 900, 0), Stats(1, 400, 100),
                             kT0 + absl::Seconds(41));
  EXPECT_EQ(failing.state.phase, "Degraded");
  p = PlanRollout(spec2, p.state, Stats(4, 900, 0), Stats(1, 300, 0), kT0 + absl::Seconds(42),
                  RolloutAction::kResume);
  EXPECT_FALSE(p.state.paused);
  EXPECT_EQ(p.state.step, 1);
}

// Paused before a step takes traffic (its replicas still coming up): they come up, but the
// weight stays where it was until a resume.
TEST(RolloutActionTest, APauseBeforeAStepBeginsHoldsItsWeight) {
  RolloutState s = PlanRollout(Spec("1", kTwoSteps), {}, {}, {}, kT0).state;
  auto spec2 = Spec("2", kTwoSteps);
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(0, 0, 0), kT0);  // pre-warming
  p = PlanRollout(spec2, p.state, Stats(4, 0, 0), Stats(0, 0, 0), kT0 + absl::Seconds(1),
                  RolloutAction::kPause);
  EXPECT_TRUE(p.state.paused);
  EXPECT_EQ(p.canary_replicas, 1);  // still placed
  EXPECT_NE(p.state.message.find("waiting for 1 canary replica(s) (0 ready); paused by hand"),
            std::string::npos)
      << p.state.message;
  // Its replica serves: no traffic while paused.
  p = PlanRollout(spec2, p.state, Stats(4, 0, 0), Stats(1, 0, 0), kT0 + absl::Seconds(2));
  EXPECT_EQ(p.canary_weight, 0);
  EXPECT_NE(p.state.message.find("1 canary replica(s) ready; paused by hand"), std::string::npos)
      << p.state.message;
  p = PlanRollout(spec2, p.state, Stats(4, 0, 0), Stats(1, 0, 0), kT0 + absl::Seconds(3),
                  RolloutAction::kResume);
  EXPECT_FALSE(p.state.paused);
  EXPECT_EQ(p.canary_weight, 25);
}

// An A/B test paused while its replicas come up: the resume begins it (its split), and does
// not also end it as a resume at a gated last step would.
TEST(RolloutActionTest, AResumeThatBeginsAGatedStepDoesNotPassIt) {
  RolloutState s = PlanRollout(AbTestSpec("1"), {}, {}, {}, kT0).state;
  auto spec2 = AbTestSpec("2");
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(0, 0, 0), kT0, RolloutAction::kPause);
  p = PlanRollout(spec2, p.state, Stats(4, 0, 0), Stats(2, 0, 0), kT0 + absl::Seconds(1));
  EXPECT_EQ(p.canary_weight, 0);  // ready, but paused
  p = PlanRollout(spec2, p.state, Stats(4, 0, 0), Stats(2, 0, 0), kT0 + absl::Seconds(2),
                  RolloutAction::kResume);
  EXPECT_EQ(p.state.phase, "Progressing");
  EXPECT_EQ(p.canary_weight, 30);
  EXPECT_FALSE(p.state.promoting);
  EXPECT_NE(p.state.message.find("A/B test running"), std::string::npos) << p.state.message;
  // A second resume is the gate's: at the last step it promotes.
  p = PlanRollout(spec2, p.state, Stats(4, 900, 0), Stats(2, 400, 0), kT0 + absl::Seconds(3),
                  RolloutAction::kResume);
  EXPECT_TRUE(p.state.promoting);
}

// Between steps (the next one's replicas coming up, or paused before it began) the canary
// still takes the last step's weight, and a failure there still rolls it back.
TEST(RolloutActionTest, ACanaryHeldBetweenStepsIsStillJudged) {
  RolloutState s = PlanRollout(Spec("1", kTwoSteps), {}, {}, {}, kT0).state;
  auto spec2 = Spec("2", kTwoSteps);
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(1, 0, 0), kT0);
  ASSERT_EQ(p.canary_weight, 25);
  p = PlanRollout(spec2, p.state, Stats(4, 900, 0), Stats(1, 300, 0), kT0 + absl::Seconds(31));
  ASSERT_EQ(p.state.step, 1);  // passed; step 2 needs 2 replicas
  p = PlanRollout(spec2, p.state, Stats(4, 900, 0), Stats(1, 300, 0), kT0 + absl::Seconds(32),
                  RolloutAction::kPause);
  EXPECT_EQ(p.canary_weight, 25);
  EXPECT_NE(p.state.message.find("waiting for 2 canary replica(s) (1 ready); paused by hand; at "
                                 "25%"),
            std::string::npos)
      << p.state.message;
  // Its replicas serve, still paused: held at 25%, judged.
  p = PlanRollout(spec2, p.state, Stats(4, 900, 0), Stats(2, 350, 0), kT0 + absl::Seconds(33));
  EXPECT_EQ(p.canary_weight, 25);
  EXPECT_EQ(p.state.phase, "Progressing");
  auto failing = PlanRollout(spec2, p.state, Stats(4, 900, 0), Stats(2, 500, 120),
                             kT0 + absl::Seconds(34));
  EXPECT_EQ(failing.state.phase, "Degraded");
  EXPECT_EQ(failing.canary_weight, 0);
  // Resumed: step 2 begins at 50%.
  p = PlanRollout(spec2, p.state, Stats(4, 900, 0), Stats(2, 360, 0), kT0 + absl::Seconds(35),
                  RolloutAction::kResume);
  EXPECT_EQ(p.canary_weight, 50);
  EXPECT_FALSE(p.state.paused);
}

// Held between steps, the canary is judged from the last step's start: a controller restart
// there (its state back from the stored status) must not judge the replicas' lifetime totals.
TEST(RolloutTest, AHeldCanarysCountersSurviveARestart) {
  RolloutState s = PlanRollout(Spec("1", kTwoSteps), {}, {}, {}, kT0).state;
  auto spec2 = Spec("2", kTwoSteps);
  // The canary replica failed a tenth of 1,000 requests before the step began.
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(1, 1000, 100), kT0);
  ASSERT_EQ(p.canary_weight, 25);
  p = PlanRollout(spec2, p.state, Stats(4, 900, 0), Stats(1, 1300, 100), kT0 + absl::Seconds(31));
  ASSERT_EQ(p.state.step, 1);  // 300 clean requests in the step: passed, step 2 coming up
  const RolloutState restored = RolloutState::FromJson(p.state.ToJson());
  p = PlanRollout(spec2, restored, Stats(4, 950, 0), Stats(1, 1350, 100), kT0 + absl::Seconds(32));
  EXPECT_EQ(p.state.phase, "Progressing") << p.state.message;
  EXPECT_EQ(p.canary_weight, 25);
  // Failing now, it is rolled back, naming the step whose weight it had.
  p = PlanRollout(spec2, restored, Stats(4, 950, 0), Stats(1, 1500, 200), kT0 + absl::Seconds(33));
  EXPECT_EQ(p.state.phase, "Degraded");
  EXPECT_EQ(p.state.message.rfind("canary 2 step 1/2 failed analysis", 0), 0u) << p.state.message;
}

TEST(RolloutActionTest, AbortAndPromoteByHand) {
  RolloutState s = PlanRollout(Spec("1", kTwoSteps), {}, {}, {}, kT0).state;
  auto spec2 = Spec("2", kTwoSteps);
  auto running = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(0, 0, 0), kT0);  // pre-warming
  auto aborted = PlanRollout(spec2, running.state, {}, {}, kT0 + absl::Seconds(1),
                             RolloutAction::kAbort);
  EXPECT_EQ(aborted.state.phase, "Degraded");
  EXPECT_EQ(aborted.state.failed_version, "2");
  EXPECT_NE(aborted.state.message.find("aborted by hand"), std::string::npos);
  EXPECT_TRUE(aborted.canary_version.empty());
  // Promoted by hand while pre-warming: the new replicas come one more at a time, and no
  // traffic moves while none serves.
  auto promoted = PlanRollout(spec2, running.state, Stats(4, 0, 0), Stats(0, 0, 0),
                              kT0 + absl::Seconds(1), RolloutAction::kPromote);
  EXPECT_EQ(promoted.state.phase, "Progressing");
  EXPECT_EQ(promoted.stable_version, "1");
  EXPECT_EQ(promoted.stable_replicas, 4);
  EXPECT_EQ(promoted.canary_replicas, 1);
  EXPECT_EQ(promoted.canary_weight, 0);
  promoted = PlanRollout(spec2, promoted.state, {}, Stats(4, 0, 0), kT0 + absl::Seconds(2));
  EXPECT_EQ(promoted.state.phase, "Stable");
  EXPECT_EQ(promoted.stable_version, "2");
  // With the whole new set already serving, a promote is immediate.
  auto full = PlanRollout(spec2, running.state, {}, Stats(4, 0, 0), kT0 + absl::Seconds(1),
                          RolloutAction::kPromote);
  EXPECT_EQ(full.state.phase, "Stable");
  EXPECT_EQ(full.stable_version, "2");
}

TEST(RolloutActionTest, ResumePassesAnIndefinitePause) {
  std::vector<RolloutStep> steps = {{50, absl::ZeroDuration(), true}};
  RolloutState s = PlanRollout(Spec("1", steps), {}, {}, {}, kT0).state;
  auto spec2 = Spec("2", steps);
  auto p = PlanRollout(spec2, s, Stats(4, 0, 0), Stats(2, 0, 0), kT0);
  p = PlanRollout(spec2, p.state, Stats(4, 0, 0), Stats(2, 500, 0), kT0 + absl::Hours(1));
  EXPECT_EQ(p.canary_weight, 50);
  EXPECT_NE(p.state.message.find("paused until resumed"), std::string::npos);
  p = PlanRollout(spec2, p.state, Stats(4, 0, 0), Stats(2, 500, 0), kT0 + absl::Hours(1),
                  RolloutAction::kResume);
  EXPECT_TRUE(p.state.promoting);  // 2 of 4 serve: the rest come up first
  EXPECT_EQ(p.canary_replicas, 3);  // one more than serve
  p = PlanRollout(spec2, p.state, Stats(4, 0, 0), Stats(4, 500, 0), kT0 + absl::Hours(1));
  EXPECT_EQ(p.state.phase, "Stable");
  EXPECT_EQ(p.stable_version, "2");
}

TEST(RolloutActionTest, ActionsParse) {
  EXPECT_EQ(*ParseRolloutAction("promote"), RolloutAction::kPromote);
  auto bad = ParseRolloutAction("undo");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("action: must be pause, resume, abort or promote"),
            std::string::npos);
}

}  // namespace
}  // namespace kiln
