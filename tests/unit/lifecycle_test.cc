#include "runtime/lifecycle.h"

#include "gtest/gtest.h"

namespace kiln {
namespace {

using S = RuntimeState;

TEST(LifecycleTest, NormalPathAndCounts) {
  SimulatedClock clock;
  Lifecycle l(&clock);
  EXPECT_EQ(l.state(), S::kLoading);
  clock.Advance(absl::Seconds(1));
  ASSERT_TRUE(l.Transition(S::kWarm, "loaded").ok());
  EXPECT_EQ(l.since(), clock.Now());
  ASSERT_TRUE(l.Transition(S::kServing, "promote").ok());
  ASSERT_TRUE(l.Transition(S::kWarm, "demote").ok());
  ASSERT_TRUE(l.Transition(S::kServing, "promote").ok());
  ASSERT_TRUE(l.Transition(S::kDraining, "drain").ok());
  ASSERT_TRUE(l.Transition(S::kStopped, "stop").ok());
  auto counts = l.transition_counts();
  EXPECT_EQ(counts[static_cast<int>(S::kServing)], 2u);
  EXPECT_EQ(counts[static_cast<int>(S::kWarm)], 2u);
  EXPECT_EQ(counts[static_cast<int>(S::kStopped)], 1u);
}

TEST(LifecycleTest, RejectsDisallowedTransitions) {
  SimulatedClock clock;
  Lifecycle l(&clock);
  EXPECT_EQ(l.Transition(S::kServing, "skip warm").code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(l.Transition(S::kWarm, "").ok());
  EXPECT_EQ(l.Transition(S::kStopped, "").code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(l.Transition(S::kDraining, "").ok());
  EXPECT_EQ(l.Transition(S::kServing, "").code(), absl::StatusCode::kFailedPrecondition);
}

TEST(LifecycleTest, FailedFromAnyStateIsTerminal) {
  SimulatedClock clock;
  Lifecycle l(&clock);
  l.Fail("corrupt model");
  EXPECT_EQ(l.state(), S::kFailed);
  EXPECT_EQ(l.failure_reason(), "corrupt model");
  EXPECT_FALSE(l.Transition(S::kWarm, "").ok());
  EXPECT_FALSE(IsAllowedTransition(S::kStopped, S::kFailed));
  EXPECT_TRUE(IsAllowedTransition(S::kServing, S::kFailed));
}

}  // namespace
}  // namespace kiln
