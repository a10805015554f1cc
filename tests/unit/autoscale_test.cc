#include "controller/autoscale.h"

#include "gtest/gtest.h"

namespace kiln {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1800000000);

Autoscale Spec(int64_t min, int64_t max, double target) {
  Autoscale a;
  a.min = min;
  a.max = max;
  a.target_in_flight = target;
  return a;
}

TEST(AutoscaleTest, RawRecommendationIsCeilOfLoadOverTargetWithinBounds) {
  EXPECT_EQ(RawRecommendation(Spec(1, 8, 4), 0), 1);
  EXPECT_EQ(RawRecommendation(Spec(1, 8, 4), 4), 1);
  EXPECT_EQ(RawRecommendation(Spec(1, 8, 4), 4.5), 2);
  EXPECT_EQ(RawRecommendation(Spec(1, 8, 4), 1000), 8);
  EXPECT_EQ(RawRecommendation(Spec(0, 8, 4), 0), 1);  // min 0 is 1: nothing could scale up from 0
  EXPECT_EQ(RawRecommendation(Spec(2, 8, 4), -3), 2);
}

// A min of 0 never takes a deployment to 0 replicas: none would be left to report the load
// that scales it up again.
TEST(AutoscaleTest, AMinOfZeroKeepsOneReplica) {
  AutoscaleHistory h;
  const absl::Duration window = absl::Minutes(5);
  auto spec = Spec(0, 4, 4);
  int64_t n = h.Recommend(spec, 0, true, 2, kT0, window);
  n = h.Recommend(spec, 0, true, n, kT0 + window + absl::Seconds(1), window);
  EXPECT_EQ(n, 1);
  EXPECT_EQ(h.Recommend(spec, 0, false, 0, kT0 + window * 2, window), 1);  // no reports
  EXPECT_EQ(h.Recommend(spec, 9, true, 1, kT0 + window * 3, window), 3);  // and it scales up
}

TEST(AutoscaleTest, UpAtOnceDownOnlyAfterTheWindow) {
  AutoscaleHistory h;
  const absl::Duration window = absl::Minutes(5);
  auto spec = Spec(1, 10, 4);
  int64_t n = h.Recommend(spec, 4, true, 1, kT0, window);
  EXPECT_EQ(n, 1);
  n = h.Recommend(spec, 20, true, n, kT0 + absl::Seconds(1), window);  // spike: up at once
  EXPECT_EQ(n, 5);
  // Load falls: held at 5 for the whole window.
  n = h.Recommend(spec, 4, true, n, kT0 + absl::Seconds(2), window);
  EXPECT_EQ(n, 5);
  n = h.Recommend(spec, 4, true, n, kT0 + absl::Seconds(1) + window - absl::Seconds(1), window);
  EXPECT_EQ(n, 5);
  // The spike leaves the window: down to what the window still holds.
  n = h.Recommend(spec, 4, true, n, kT0 + absl::Seconds(2) + window, window);
  EXPECT_EQ(n, 1);
}

TEST(AutoscaleTest, NothingScalesDownInTheFirstWindow) {
  AutoscaleHistory h;
  auto spec = Spec(1, 10, 4);
  EXPECT_EQ(h.Recommend(spec, 0, true, 6, kT0, absl::Minutes(5)), 6);
  EXPECT_EQ(h.Recommend(spec, 0, true, 6, kT0 + absl::Minutes(4), absl::Minutes(5)), 6);
  EXPECT_EQ(h.Recommend(spec, 0, true, 6, kT0 + absl::Minutes(6), absl::Minutes(5)), 1);
}

TEST(AutoscaleTest, AShortDipChangesNothing) {
  AutoscaleHistory h;
  const absl::Duration window = absl::Seconds(60);
  auto spec = Spec(1, 10, 1);
  int64_t n = 3;
  for (int s = 0; s < 120; ++s) {
    double load = (s % 30 == 0) ? 0 : 3;  // a one-tick dip every 30 s
    n = h.Recommend(spec, load, true, n, kT0 + absl::Seconds(s), window);
    ASSERT_EQ(n, 3) << "at " << s << " s";
  }
}

TEST(AutoscaleTest, NoReportsKeepsTheCountWithinBounds) {
  AutoscaleHistory h;
  EXPECT_EQ(h.Recommend(Spec(2, 4, 1), 0, false, 7, kT0, absl::Minutes(5)), 4);
  EXPECT_EQ(h.Recommend(Spec(2, 4, 1), 0, false, 0, kT0, absl::Minutes(5)), 2);
}

TEST(WarmAfterScaleDownTest, EachScaleDownLeavesItsReplicasWarmForTheWindow) {
  const absl::Time t0 = absl::FromUnixSeconds(1800000000);
  const absl::Duration w = absl::Minutes(5);
  WarmAfterScaleDown l;
  EXPECT_EQ(l.Update("1", 3, t0, w), 0);
  EXPECT_EQ(l.Update("1", 1, t0 + absl::Seconds(1), w), 2);  // 3 -> 1
  EXPECT_EQ(l.Update("1", 1, t0 + absl::Minutes(2), w), 2);
  EXPECT_EQ(l.Update("1", 0, t0 + absl::Minutes(3), w), 3);  // 1 -> 0: a second batch
  EXPECT_EQ(l.Update("1", 0, t0 + absl::Minutes(5) + absl::Seconds(1), w), 1);  // the first ends
  EXPECT_EQ(l.Update("1", 0, t0 + absl::Minutes(8), w), 0);
  // A new stable version starts afresh.
  EXPECT_EQ(l.Update("1", 4, t0 + absl::Minutes(9), w), 0);
  EXPECT_EQ(l.Update("2", 1, t0 + absl::Minutes(10), w), 0);
  EXPECT_EQ(l.version(), "2");
}

TEST(WarmAfterScaleDownTest, AScaleUpTakesReplicasBackFromTheNewestBatchFirst) {
  const absl::Time t0 = absl::FromUnixSeconds(1800000000);
  const absl::Duration w = absl::Minutes(5);
  WarmAfterScaleDown l;
  l.Update("1", 4, t0, w);
  EXPECT_EQ(l.Update("1", 2, t0 + absl::Minutes(1), w), 2);  // until t0+6
  EXPECT_EQ(l.Update("1", 1, t0 + absl::Minutes(2), w), 3);  // until t0+7
  // Up by 2: the newest batch (1) and one of the older one are promoted back.
  EXPECT_EQ(l.Update("1", 3, t0 + absl::Minutes(3), w), 1);
  ASSERT_EQ(l.batches().size(), 1u);
  EXPECT_EQ(l.batches().front().first, t0 + absl::Minutes(6));
  // Down again: a new batch beside what is left; nothing counts a replica twice.
  EXPECT_EQ(l.Update("1", 2, t0 + absl::Minutes(4), w), 2);
  EXPECT_EQ(l.Update("1", 2, t0 + absl::Minutes(6), w), 1);
  // Up past everything left over: nothing lingers, and the count goes on from there.
  EXPECT_EQ(l.Update("1", 9, t0 + absl::Minutes(7), w), 0);
  EXPECT_TRUE(l.batches().empty());
  EXPECT_EQ(l.Update("1", 8, t0 + absl::Minutes(8), w), 1);
}

TEST(WarmAfterScaleDownTest, RestoredStateGoesOnWhereItWas) {
  const absl::Time t0 = absl::FromUnixSeconds(1800000000);
  WarmAfterScaleDown l;
  l.Restore("1", 1, {{t0 + absl::Minutes(5), 2}});
  EXPECT_EQ(l.Update("1", 1, t0 + absl::Minutes(1), absl::Minutes(5)), 2);
  EXPECT_EQ(l.Update("1", 1, t0 + absl::Minutes(5), absl::Minutes(5)), 0);
  WarmAfterScaleDown other;
  other.Restore("1", 1, {{t0 + absl::Minutes(5), 2}});
  EXPECT_EQ(other.Update("2", 1, t0, absl::Minutes(5)), 0);  // restored for another version
}

}  // namespace
}  // namespace kiln
