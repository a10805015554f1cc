// The agent's pure policies: restart backoff and crash loops, GPU health, the warm pool plan,
// the router's choices, its busy-polling windows and the GPU power plan.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>

#include "absl/strings/str_join.h"
#include "agent/agent.h"
#include "agent/busy_poll.h"
#include "agent/fake_gpu_driver.h"
#include "agent/gpu_monitor.h"
#include "agent/gpu_power.h"
#include "agent/router.h"
#include "agent/router_policy.h"
#include "common/clock.h"
#include "gtest/gtest.h"
#include "health/gpu_health.h"
#include "health/probe_verdict.h"
#include "health/restart_policy.h"
#include "nlohmann/json.hpp"
#include "warm_pool/pool_plan.h"

namespace kiln {
namespace {

TEST(RestartPolicyTest, BackoffDoublesToTheCapAndResetsAfterHealthyTime) {
  SimulatedClock clock;
  RestartPolicy p;
  CrashHistory h;
  std::vector<int64_t> seconds;
  for (int i = 0; i < 8; ++i) {
    OnStart(h, clock.Now());
    clock.Advance(absl::Minutes(3));  // 8 crashes, 3 minutes apart: never >5 in 10 minutes
    RestartDecision d = OnCrash(h, clock.Now(), p);
    EXPECT_FALSE(d.crash_loop) << i;
    seconds.push_back(absl::ToInt64Seconds(d.backoff));
    EXPECT_EQ(d.restart_at, clock.Now() + d.backoff);
  }
  EXPECT_EQ(seconds, (std::vector<int64_t>{1, 2, 4, 8, 16, 32, 60, 60}));
  OnStart(h, clock.Now());
  clock.Advance(absl::Minutes(10));  // healthy for ten minutes
  EXPECT_EQ(OnCrash(h, clock.Now(), p).backoff, absl::Seconds(1));
}

// After a long healthy run, relaunches that fail (no start between them: the binary gone
// during an upgrade, fork refused) back off 1, 2, 4 s, not 1 s each.
TEST(RestartPolicyTest, FailedLaunchesAfterALongRunStillDoubleTheBackoff) {
  SimulatedClock clock;
  RestartPolicy p;
  CrashHistory h;
  OnStart(h, clock.Now());
  clock.Advance(absl::Hours(2));
  std::vector<int64_t> seconds;
  for (int i = 0; i < 4; ++i) {
    RestartDecision d = OnCrash(h, clock.Now(), p);  // the crash, then each failed launch
    seconds.push_back(absl::ToInt64Seconds(d.backoff));
    clock.Advance(d.backoff);
  }
  EXPECT_EQ(seconds, (std::vector<int64_t>{1, 2, 4, 8}));
}

TEST(RestartPolicyTest, MoreThanFiveCrashesInTenMinutesIsACrashLoop) {
  SimulatedClock clock;
  RestartPolicy p;
  CrashHistory h;
  RestartDecision d;
  for (int i = 0; i < 6; ++i) {
    OnStart(h, clock.Now());
    clock.Advance(absl::Seconds(30));
    d = OnCrash(h, clock.Now(), p);
    EXPECT_EQ(d.crash_loop, i == 5) << i;
  }
  EXPECT_EQ(d.crashes_in_window, 6);
  EXPECT_EQ(d.backoff, p.max_backoff);  // never restarted hot
  // Once the window has passed the early crashes no longer count.
  OnStart(h, clock.Now());
  clock.Advance(absl::Minutes(10));
  d = OnCrash(h, clock.Now(), p);
  EXPECT_FALSE(d.crash_loop);
  EXPECT_EQ(d.crashes_in_window, 2);  // the last old crash, exactly ten minutes ago, and this
}

TEST(GpuHealthTest, XidClassesAndThrottling) {
  EXPECT_EQ(ClassifyXid(13).action, XidAction::kApplication);
  EXPECT_EQ(ClassifyXid(31).action, XidAction::kApplication);
  EXPECT_EQ(ClassifyXid(48).action, XidAction::kDrainGpu);
  EXPECT_EQ(ClassifyXid(79).action, XidAction::kDrainGpu);
  EXPECT_EQ(ClassifyXid(95).action, XidAction::kDrainGpu);
  EXPECT_EQ(ClassifyXid(63).action, XidAction::kInformational);
  EXPECT_EQ(ClassifyXid(8).action, XidAction::kApplication);   // RESTART_APP in the catalogue
  EXPECT_EQ(ClassifyXid(154).action, XidAction::kDrainGpu);    // a reset or reboot is pending
  EXPECT_EQ(ClassifyXid(99999).action, XidAction::kInformational);

  GpuHealthInput ok;
  EXPECT_TRUE(EvaluateGpuHealth(ok).healthy);
  EXPECT_FALSE(EvaluateGpuHealth(ok).degraded);

  GpuHealthInput hot;
  hot.clock_event_reasons = kClockEventHwThermalSlowdown | kClockEventGpuIdle;
  hot.temperature_c = 91;
  GpuHealth h = EvaluateGpuHealth(hot);
  EXPECT_TRUE(h.healthy);
  EXPECT_TRUE(h.degraded);
  EXPECT_NE(h.reasons[0].find("hw_thermal"), std::string::npos);
  EXPECT_FALSE(IsThermalOrPowerThrottle(kClockEventGpuIdle | kClockEventSwPowerCap));

  GpuHealthInput ecc;
  ecc.ecc_uncorrected = 3;
  ecc.ecc_uncorrected_baseline = 1;
  EXPECT_FALSE(EvaluateGpuHealth(ecc).healthy);

  GpuHealthInput xid;
  xid.xids = {13};
  EXPECT_TRUE(EvaluateGpuHealth(xid).healthy);  // the application's fault
  xid.xids = {13, 79};
  h = EvaluateGpuHealth(xid);
  EXPECT_FALSE(h.healthy);
  EXPECT_NE(h.reasons[1].find("fallen off the bus"), std::string::npos);
}

TEST(ProbeVerdictTest, OnlyWhatSaysTheReplicaIsBrokenCountsTowardsARestart) {
  EXPECT_EQ(JudgeProbe(absl::OkStatus(), false), ProbeVerdict::kHealthy);
  // Out of time or queue room: busy while the model executes, broken when nothing does.
  for (auto s : {absl::DeadlineExceededError("timed out in the queue"),
                 absl::ResourceExhaustedError("the request queue is full")}) {
    EXPECT_EQ(JudgeProbe(s, true), ProbeVerdict::kBusy) << s;
    EXPECT_EQ(JudgeProbe(s, false), ProbeVerdict::kBroken) << s;
  }
  // The model failed, or the replica refused: broken whatever it executed.
  for (auto s : {absl::InternalError("CUDA error"), absl::UnavailableError("connection refused"),
                 absl::UnknownError("?"), absl::DataLossError("?"), absl::AbortedError("?"),
                 absl::CancelledError("?")}) {
    EXPECT_EQ(JudgeProbe(s, true), ProbeVerdict::kBroken) << s;
  }
  // The probe itself does not fit what serves there.
  for (auto s : {absl::InvalidArgumentError("input 'x': expected shape"),
                 absl::NotFoundError("unknown model"), absl::FailedPreconditionError("?"),
                 absl::UnimplementedError("?")}) {
    EXPECT_EQ(JudgeProbe(s, false), ProbeVerdict::kUnfit) << s;
  }
  EXPECT_STREQ(ProbeVerdictName(ProbeVerdict::kBusy), "busy");
}

TEST(GpuMonitorTest, XidsAndNewEccErrorsMakeAGpuUnhealthy) {
  FakeGpuDriver driver(FakeGpuDriver::MakeGpus(3, 16LL << 30));
  GpuTelemetry t = *driver.Read(2);
  t.ecc_uncorrected = 4;  // present before the agent started: the baseline
  driver.SetTelemetry(2, t);
  GpuMonitor m(&driver, {0, 1, 2});
  m.Poll();
  EXPECT_TRUE(m.Healthy(0) && m.Healthy(1) && m.Healthy(2));
  driver.InjectXid(1, 13);  // the application's fault: degraded, still takes replicas
  driver.InjectXid(0, 79);
  m.Poll();
  EXPECT_FALSE(m.Healthy(0));
  EXPECT_TRUE(m.Healthy(1));
  EXPECT_TRUE(m.health().at(1).degraded);
  m.Poll();
  EXPECT_FALSE(m.Healthy(0));  // stays unhealthy: it needs a reset
  t.ecc_uncorrected = 5;
  driver.SetTelemetry(2, t);
  m.Poll();
  EXPECT_FALSE(m.Healthy(2));
  EXPECT_NE(m.health().at(2).reasons[0].find("1 new uncorrectable"), std::string::npos);
}

// An application Xid is handed to the loop once (its GPU's replicas are probed) and keeps the
// GPU degraded for a while, not for ever.
TEST(GpuMonitorTest, AnApplicationXidIsReportedOnceAndAgesOut) {
  FakeGpuDriver driver(FakeGpuDriver::MakeGpus(2, 16LL << 30));
  SimulatedClock clock;
  GpuMonitor m(&driver, {0, 1}, {}, &clock);
  m.Poll();
  EXPECT_TRUE(m.TakeApplicationXids().empty());
  driver.InjectXid(1, 31);
  driver.InjectXid(1, 92);  // informational: degraded too, but no replica to probe for it
  driver.InjectXid(0, 79);  // the GPU's own: unhealthy, handled as such
  m.Poll();
  EXPECT_EQ(m.TakeApplicationXids(), (std::vector<std::pair<int, uint64_t>>{{1, 31}}));
  EXPECT_TRUE(m.TakeApplicationXids().empty());
  EXPECT_TRUE(m.Healthy(1));
  EXPECT_TRUE(m.health().at(1).degraded);
  clock.Advance(GpuMonitor::kApplicationXidWindow - absl::Seconds(1));
  m.Poll();
  EXPECT_TRUE(m.health().at(1).degraded);
  clock.Advance(absl::Seconds(1));
  m.Poll();
  EXPECT_FALSE(m.health().at(1).degraded) << m.health().at(1).reasons.size();
  EXPECT_FALSE(m.Healthy(0));  // a reset-class Xid does not age out
}

// One failed telemetry read (a busy driver) does not make a GPU unhealthy; three in a row do,
// and a good read ends it.
TEST(GpuMonitorTest, AGpuIsUnhealthyOnlyAfterReadsFailThreeTimesInARow) {
  FakeGpuDriver driver(FakeGpuDriver::MakeGpus(1, 16LL << 30));
  GpuMonitor m(&driver, {0});
  m.Poll();
  ASSERT_TRUE(m.Healthy(0));
  driver.SetReadError(0, absl::UnavailableError("NVML busy"));
  m.Poll();
  m.Poll();
  EXPECT_TRUE(m.Healthy(0));
  EXPECT_TRUE(m.health().at(0).degraded);
  EXPECT_NE(m.health().at(0).reasons.back().find("2 of 3"), std::string::npos);
  m.Poll();
  EXPECT_FALSE(m.Healthy(0));
  EXPECT_NE(m.health().at(0).reasons.back().find("3 times in a row"), std::string::npos);
  driver.SetReadError(0, absl::OkStatus());
  m.Poll();
  EXPECT_TRUE(m.Healthy(0));
  driver.SetReadError(0, absl::UnavailableError("NVML busy"));
  m.Poll();
  m.Poll();
  EXPECT_TRUE(m.Healthy(0));  // counted afresh
}

// A health file whose boot id is not a string is not the agent's: it starts afresh, not with an
// exception at start-up.
TEST(GpuMonitorTest, AHealthFileWithABadBootIdIsIgnored) {
  const std::string file = ::testing::TempDir() + "/gpu_health_bad_" + std::to_string(getpid()) + ".json";
  FakeGpuDriver driver(FakeGpuDriver::MakeGpus(1, 16LL << 30));
  const std::string uuid = driver.Identify(0)->uuid;
  std::ofstream(file) << nlohmann::json({{"boot_id", 7}, {"gpus", {{uuid, {{"xids", {79}}}}}}}).dump();
  GpuMonitor m(&driver, {0}, {file, "7"});
  m.Poll();
  EXPECT_TRUE(m.Healthy(0));  // the Xid 79 it holds is not taken
  std::remove(file.c_str());
}

// What needs a GPU reset outlives the agent on the same boot (a restarted agent keeps such a
// GPU out of placement), not a reboot; application Xids stay bounded.
TEST(GpuMonitorTest, AGpuThatNeedsAResetStaysUnhealthyAcrossARestartUntilAReboot) {
  const std::string file = ::testing::TempDir() + "/gpu_health_" + std::to_string(getpid()) + ".json";
  std::remove(file.c_str());
  FakeGpuDriver driver(FakeGpuDriver::MakeGpus(3, 16LL << 30));
  GpuTelemetry t = *driver.Read(2);
  t.ecc_uncorrected = 4;
  driver.SetTelemetry(2, t);
  {
    GpuMonitor m(&driver, {0, 1, 2}, {file, "boot-a"});
    m.Poll();
    for (int i = 0; i < 20; ++i) driver.InjectXid(0, 79);  // a storm says no more than one
    for (int i = 0; i < 50; ++i) driver.InjectXid(1, 13);
    t.ecc_uncorrected = 6;  // two new since the baseline of 4
    driver.SetTelemetry(2, t);
    m.Poll();
    EXPECT_FALSE(m.Healthy(0));
    EXPECT_EQ(m.health().at(0).reasons.size(), 1u);
    EXPECT_TRUE(m.Healthy(1));
    EXPECT_LE(m.health().at(1).reasons.size(), GpuMonitor::kRecentApplicationXids);
    EXPECT_FALSE(m.Healthy(2));
  }
  {
    // The agent restarts on the same boot: GPU 0 and GPU 2 are still unhealthy (GPU 2 against
    // the baseline it had, not the count it reads now); GPU 1's application faults are gone.
    GpuMonitor m(&driver, {0, 1, 2}, {file, "boot-a"});
    m.Poll();
    EXPECT_FALSE(m.Healthy(0));
    EXPECT_NE(m.health().at(0).reasons.at(0).find("fallen off the bus"), std::string::npos);
    EXPECT_TRUE(m.Healthy(1));
    EXPECT_FALSE(m.health().at(1).degraded);
    EXPECT_FALSE(m.Healthy(2));
  }
  {
    // A monitor of GPU 1 alone keeps the others' records when it writes the file.
    GpuMonitor m(&driver, {1}, {file, "boot-a"});
    driver.InjectXid(1, 48);
    m.Poll();
    EXPECT_FALSE(m.Healthy(1));
  }
  {
    GpuMonitor m(&driver, {0, 1, 2}, {file, "boot-a"});
    m.Poll();
    EXPECT_FALSE(m.Healthy(0));
    EXPECT_FALSE(m.Healthy(1));
  }
  {
    // After a reboot every GPU starts afresh.
    GpuMonitor m(&driver, {0, 1, 2}, {file, "boot-b"});
    m.Poll();
    EXPECT_TRUE(m.Healthy(0) && m.Healthy(1) && m.Healthy(2));
  }
  {
    // Without a boot id nothing is kept (a reboot could not be told apart).
    std::remove(file.c_str());
    GpuMonitor m(&driver, {0, 1, 2}, {file, ""});
    driver.InjectXid(0, 79);
    m.Poll();
    EXPECT_FALSE(m.Healthy(0));
    EXPECT_FALSE(std::ifstream(file).good());
  }
  // A file that is not the monitor's is ignored, not fatal.
  std::ofstream(file) << "{not json";
  GpuMonitor m(&driver, {0, 1, 2}, {file, "boot-b"});
  m.Poll();
  EXPECT_TRUE(m.Healthy(0));
  std::remove(file.c_str());
}

PoolRunning Running(const std::string& id, const std::string& shape, bool member, bool loaded,
                int64_t used_s = 0) {
  return {id, shape, member, loaded, false, absl::FromUnixSeconds(used_s)};
}

PoolSpec Pool(const std::string& shape, int size, int gpu = -1, int64_t mem = 0) {
  return {shape, size, shape + "-pool-", gpu, mem};
}

TEST(PoolPlanTest, ScaleUpTakesTheMostRecentlyUsedLoadedMembersAndRefills) {
  std::vector<PoolWanted> wanted = {{"s0", "A"}, {"s1", "A"}, {"s2", "A"}};
  std::vector<PoolRunning> running = {Running("s0", "A", false, true),
                                      Running("A-pool-0", "A", true, true, 10),
                                      Running("A-pool-1", "A", true, true, 20),
                                      Running("A-pool-2", "A", true, false, 30)};
  PoolPlan plan = PlanNodePools(wanted, {Pool("A", 3)}, running, {});
  // Loaded before still starting; the most recently used first.
  EXPECT_EQ(plan.renames, (std::map<std::string, std::string>{{"A-pool-1", "s1"}, {"A-pool-0", "s2"}}));
  // The starting one stays a member; two new ones refill the pool, skipping used ids.
  EXPECT_EQ(plan.members["A"], (std::vector<std::string>{"A-pool-2", "A-pool-3", "A-pool-4"}));
  EXPECT_TRUE(plan.evicted.empty());
  // Only a member still starting: taken all the same (it is further along than a cold start).
  plan = PlanNodePools({{"s0", "A"}, {"s1", "A"}}, {Pool("A", 1)},
                       {Running("s0", "A", false, true), Running("A-pool-2", "A", true, false)}, {});
  EXPECT_EQ(plan.renames, (std::map<std::string, std::string>{{"A-pool-2", "s1"}}));
  EXPECT_EQ(plan.members["A"], std::vector<std::string>{"A-pool-0"});
  // A crash-looping member is never taken (the new replica would wait out its backoff).
  PoolRunning looping = Running("A-pool-0", "A", true, false);
  looping.crash_loop = true;
  plan = PlanNodePools({{"s1", "A"}}, {Pool("A", 1)}, {looping}, {});
  EXPECT_TRUE(plan.renames.empty());
  // A member of another shape is never taken.
  plan = PlanNodePools({{"s1", "B"}}, {Pool("A", 1)}, {Running("A-pool-0", "A", true, true)}, {});
  EXPECT_TRUE(plan.renames.empty());
}

TEST(PoolPlanTest, ScaleDownJoinsAShortPoolElseDrains) {
  std::vector<PoolRunning> running = {Running("s0", "A", false, true), Running("s2", "A", false, true),
                                      Running("s1", "A", false, true)};
  PoolPlan plan = PlanNodePools({{"s0", "A"}}, {Pool("A", 1)}, running, {});
  // s1 (by id) joins the empty pool under a pool id; s2 is not wanted and drains.
  EXPECT_EQ(plan.renames, (std::map<std::string, std::string>{{"s1", "A-pool-0"}}));
  EXPECT_EQ(plan.members["A"], std::vector<std::string>{"A-pool-0"});
  // A crash-looping one does not join (it could never be taken over): the next one does.
  running[2].crash_loop = true;  // s1
  plan = PlanNodePools({{"s0", "A"}}, {Pool("A", 1)}, running, {});
  EXPECT_EQ(plan.renames, (std::map<std::string, std::string>{{"s2", "A-pool-0"}}));
  running[2].crash_loop = false;
  // A negative size (a caller's mistake) takes nobody.
  plan = PlanNodePools({{"s0", "A"}}, {Pool("A", -1)}, running, {});
  EXPECT_TRUE(plan.renames.empty());
  // A full pool takes nobody.
  running.push_back(Running("A-pool-0", "A", true, true));
  plan = PlanNodePools({{"s0", "A"}}, {Pool("A", 1)}, running, {});
  EXPECT_TRUE(plan.renames.empty());
  EXPECT_EQ(plan.members["A"], std::vector<std::string>{"A-pool-0"});
}

TEST(PoolPlanTest, APoolIsTrimmedStartingThenLeastRecentlyUsedFirstAndSteadyStateIsANoOp) {
  std::vector<PoolRunning> running = {Running("A-pool-0", "A", true, true, 10),
                                      Running("A-pool-1", "A", true, true, 20),
                                      Running("A-pool-2", "A", true, false, 30)};
  PoolPlan plan = PlanNodePools({}, {Pool("A", 1)}, running, {});
  EXPECT_EQ(plan.members["A"], std::vector<std::string>{"A-pool-1"});
  EXPECT_TRUE(plan.renames.empty());
  plan = PlanNodePools({}, {Pool("A", 0)}, running, {});
  EXPECT_TRUE(plan.members["A"].empty());
  // No pool for the shape any more: none is a member.
  plan = PlanNodePools({}, {}, running, {});
  EXPECT_TRUE(plan.members.empty());
  plan = PlanNodePools({}, {Pool("A", 3)}, running, {});
  EXPECT_EQ(plan.members["A"].size(), 3u);
  EXPECT_TRUE(plan.renames.empty());
}

TEST(PoolPlanTest, IdsOfDrainingReplicasAreNeitherNewNorReused) {
  // s1 was removed and drains; the file wants it again: not taken from the pool. A draining
  // member's id is not given to a new one.
  PoolPlan plan = PlanNodePools({{"s1", "A"}}, {Pool("A", 2)},
                                {Running("A-pool-1", "A", true, true)}, {}, {"s1", "A-pool-0"});
  EXPECT_TRUE(plan.renames.empty());
  EXPECT_EQ(plan.members["A"], (std::vector<std::string>{"A-pool-1", "A-pool-2"}));
}

TEST(PoolPlanTest, PoolMembersGiveWayOnAGpuTheFilesReplicasNeed) {
  const int64_t gi = int64_t{1} << 30;
  std::vector<PoolWanted> wanted = {{"s0", "A", 0, 8 * gi}};
  std::vector<PoolRunning> running = {Running("s0", "A", false, true),
                                      Running("B-pool-0", "B", true, true, 20),
                                      Running("B-pool-1", "B", true, true, 10)};
  // 8 + 2 x 2 GiB on a 10 GiB GPU: the least recently used member goes.
  PoolPlan plan = PlanNodePools(wanted, {Pool("B", 2, 0, 2 * gi)}, running, {{0, 10 * gi}});
  EXPECT_EQ(plan.evicted, std::vector<std::string>{"B-pool-1"});
  EXPECT_EQ(plan.members["B"], std::vector<std::string>{"B-pool-0"});
  // Room for both: nothing evicted. Another GPU's pool is not touched.
  plan = PlanNodePools(wanted, {Pool("B", 2, 0, 2 * gi)}, running, {{0, 12 * gi}});
  EXPECT_TRUE(plan.evicted.empty());
  plan = PlanNodePools(wanted, {Pool("B", 2, 1, 2 * gi)}, running, {{0, 10 * gi}, {1, 2 * gi}});
  EXPECT_EQ(plan.evicted, std::vector<std::string>{"B-pool-1"});
  // A new member (not loaded yet) goes before a loaded one; a replica that was to join the
  // pool under an evicted id drains instead.
  plan = PlanNodePools({{"s0", "A", 0, 8 * gi}}, {Pool("A", 2, 0, 2 * gi)},
                       {Running("s0", "A", false, true), Running("s1", "A", false, true, 5)},
                       {{0, 10 * gi}});
  EXPECT_EQ(plan.evicted, std::vector<std::string>{"A-pool-1"});
  EXPECT_EQ(plan.renames, (std::map<std::string, std::string>{{"s1", "A-pool-0"}}));
  plan = PlanNodePools({{"s0", "A", 0, 8 * gi}}, {Pool("A", 1, 0, 2 * gi)},
                       {Running("s0", "A", false, true), Running("s1", "A", false, true, 5)},
                       {{0, 9 * gi}});
  EXPECT_EQ(plan.evicted, std::vector<std::string>{"A-pool-0"});
  EXPECT_TRUE(plan.renames.empty());
  EXPECT_TRUE(plan.members["A"].empty());
}

TEST(RouterPolicyTest, WeightsAndStickyKeys) {
  std::vector<WeightedVersion> v = {{"1", 90}, {"2", 10}};
  std::map<std::string, int> counts;
  for (uint64_t r = 0; r < 1000; ++r) counts[*PickVersion(v, std::nullopt, r)]++;
  EXPECT_EQ(counts["1"], 900);
  EXPECT_EQ(counts["2"], 100);
  // The same key always gets the same version; different keys spread by weight.
  std::map<std::string, int> sticky;
  for (int u = 0; u < 2000; ++u) {
    std::string key = "user-" + std::to_string(u);
    std::string first = *PickVersion(v, key, 1);
    EXPECT_EQ(*PickVersion(v, key, 999), first);
    sticky[first]++;
  }
  EXPECT_GT(sticky["2"], 100);
  EXPECT_LT(sticky["2"], 320);
  EXPECT_EQ(StickyHash("abc"), StickyHash("abc"));
  EXPECT_EQ(StickyHash(""), 1469598103934665603ULL);
  EXPECT_EQ(*PickVersion({{"1", 0}, {"2", 5}}, std::nullopt, 3), "2");
  EXPECT_EQ(PickVersion({{"1", 0}}, std::nullopt, 0).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(RouterPolicyTest, LocalFirstThenFewestOutstandingThenRetryElsewhere) {
  std::vector<RouteEndpoint> e = {{"r-remote", "1", false, true, 0},
                                  {"r-busy", "1", true, true, 5},
                                  {"r-idle", "1", true, true, 1},
                                  {"r-sick", "1", true, false, 0},
                                  {"r-v2", "2", true, true, 0}};
  EXPECT_EQ(e[*PickEndpoint(e, "1", {})].id, "r-idle");
  EXPECT_EQ(e[*PickEndpoint(e, "1", {"r-idle"})].id, "r-busy");
  EXPECT_EQ(e[*PickEndpoint(e, "1", {"r-idle", "r-busy"})].id, "r-remote");
  EXPECT_EQ(PickEndpoint(e, "1", {"r-idle", "r-busy", "r-remote"}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(e[*PickEndpoint(e, "2", {})].id, "r-v2");
}

TEST(RouterPolicyTest, TheSharedTableLeavesOutTheNodesOwnEndpoints) {
  // The controller sends every node one table; a node reaches its own replicas directly.
  v1::RoutingTable t;
  auto* route = t.add_routes();
  route->set_model("enc");
  auto* v = route->add_versions();
  v->set_version("1");
  v->set_weight(100);
  for (const char* node : {"n1", "n2"}) {
    auto* e = route->add_endpoints();
    e->set_replica_id(std::string("enc.") + node);
    e->set_version("1");
    e->set_node_name(node);
    e->set_grpc_address(std::string(node) + ":9000");
  }
  ReplicaView local;
  local.spec.set_replica_id("enc.local");
  local.spec.set_model("enc");
  local.spec.set_version("1");
  local.state = v1::SERVING;
  local.healthy = true;
  local.grpc_port = 4000;
  local.http_port = 4001;
  RouterTable mine = BuildRouterTable(t, {local}, "n1");
  std::vector<std::string> ids;
  for (const auto& e : mine.routes["enc"].endpoints) ids.push_back(e.id);
  EXPECT_EQ(ids, (std::vector<std::string>{"enc.n2", "enc.local"}));
  RouterTable other = BuildRouterTable(t, {}, "n3");
  EXPECT_EQ(other.routes["enc"].endpoints.size(), 2u);
}

TEST(GpuPowerTest, PlanClampsAndSkipsWhatIsAlreadySet) {
  GpuIdentity card;
  card.power_limit_min_mw = 200000;
  card.power_limit_max_mw = 700000;
  GpuTelemetry now;
  now.power_limit_mw = 700000;
  now.persistence_mode = true;
  PowerKnobs want;
  want.persistence = true;
  want.power_limit_mw = 100000;  // below the card's minimum
  want.locked_sm_clocks = std::make_pair(1980u, 1980u);
  auto plan = PlanPowerChanges(card, now, std::nullopt, want);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].Describe(), "power limit 200 W");
  EXPECT_EQ(plan[1].Describe(), "lock SM clocks 1980-1980 MHz");
  EXPECT_TRUE(PlanPowerChanges(card, now, std::make_pair(1980u, 1980u),
                               PowerKnobs{true, 700000, std::make_pair(1980u, 1980u)})
                  .empty());
  PowerKnobs unlock;
  unlock.unlock_clocks = true;
  EXPECT_EQ(PlanPowerChanges(card, now, std::make_pair(1u, 2u), unlock)[0].kind,
            PowerChange::kUnlockClocks);
}

// The agent's policy names each card's own minimum and default limits, not one card's.
TEST(GpuPowerTest, ACardLimitIsEachCardsOwn) {
  GpuIdentity small, big;
  small.power_limit_min_mw = 100000;
  small.power_limit_default_mw = 300000;
  small.power_limit_max_mw = 350000;
  big.power_limit_min_mw = 200000;
  big.power_limit_default_mw = 700000;
  big.power_limit_max_mw = 700000;
  GpuTelemetry now;
  now.power_limit_mw = 500000;
  PowerKnobs idle;
  idle.card_limit = PowerKnobs::CardLimit::kMinimum;
  PowerKnobs serving;
  serving.card_limit = PowerKnobs::CardLimit::kDefault;
  EXPECT_EQ(PlanPowerChanges(small, now, std::nullopt, idle).at(0).Describe(), "power limit 100 W");
  EXPECT_EQ(PlanPowerChanges(big, now, std::nullopt, idle).at(0).Describe(), "power limit 200 W");
  EXPECT_EQ(PlanPowerChanges(small, now, std::nullopt, serving).at(0).Describe(),
            "power limit 300 W");
  EXPECT_EQ(PlanPowerChanges(big, now, std::nullopt, serving).at(0).Describe(),
            "power limit 700 W");
  // A card that reports no bounds is left as it is.
  EXPECT_TRUE(PlanPowerChanges(GpuIdentity{}, now, std::nullopt, idle).empty());
}

TEST(GpuPowerTest, WhatHoldsAGpuSetsItsLoad) {
  // GPU 0: nothing; 1: a WARM replica; 2: a pre-started runtime only; 3: a WARM replica and a
  // SERVING one. A holder of an unknown GPU (7) or of none (-1, a CPU replica) changes nothing.
  const std::map<int, GpuLoad> load = ClassifyGpuLoads(
      {0, 1, 2, 3}, {{1, false}, {2, false}, {3, false}, {3, true}, {7, true}, {-1, true}});
  EXPECT_EQ(load, (std::map<int, GpuLoad>{{0, GpuLoad::kIdle},
                                          {1, GpuLoad::kWarmOnly},
                                          {2, GpuLoad::kWarmOnly},
                                          {3, GpuLoad::kServing}}));
  // Serving first, then a warm holder: still serving (order does not matter).
  EXPECT_EQ(ClassifyGpuLoads({0}, {{0, true}, {0, false}}).at(0), GpuLoad::kServing);
  EXPECT_EQ(ClassifyGpuLoads({}, {{0, true}}).size(), 0u);
}

PowerPolicy TestPolicy() {
  PowerPolicy p;
  p.warm_only.power_limit_mw = 250000;
  p.serving.power_limit_mw = 700000;
  p.idle.power_limit_mw = 250000;
  return p;
}

// A failed power change waits 30 s, then twice as long each time the same load fails again,
// up to 10 minutes; another load starts from 30 s. Only a new load or a new error is logged.
TEST(GpuPowerTest, AFailedChangeIsRetriedWithBackoff) {
  PowerRetry r;
  const absl::Time t0 = absl::FromUnixSeconds(1000000);
  EXPECT_TRUE(r.Due(GpuLoad::kIdle, t0));
  EXPECT_TRUE(r.Failed(GpuLoad::kIdle, "not permitted", t0));
  EXPECT_FALSE(r.Due(GpuLoad::kIdle, t0 + absl::Seconds(29)));
  EXPECT_TRUE(r.Due(GpuLoad::kServing, t0 + absl::Seconds(1)));  // another load: at once
  EXPECT_TRUE(r.Due(GpuLoad::kIdle, t0 + absl::Seconds(30)));
  std::vector<int64_t> waits;
  absl::Time now = t0;
  for (int i = 0; i < 7; ++i) {
    now = r.next();
    EXPECT_FALSE(r.Failed(GpuLoad::kIdle, "not permitted", now)) << i;  // same error: quiet
    waits.push_back(absl::ToInt64Seconds(r.next() - now));
  }
  EXPECT_EQ(waits, (std::vector<int64_t>{60, 120, 240, 480, 600, 600, 600}));
  EXPECT_TRUE(r.Failed(GpuLoad::kIdle, "unknown error", now));  // a new error is logged
  EXPECT_TRUE(r.Failed(GpuLoad::kWarmOnly, "unknown error", now));
  EXPECT_EQ(r.next() - now, absl::Seconds(30));
}

TEST(GpuPowerTest, DryRunLogsAndChangesNothing) {
  FakeGpuDriver driver(FakeGpuDriver::MakeGpus(1, 80LL << 30));
  std::vector<std::string> log;
  GpuPowerManager m(&driver, PowerMode::kDryRun, TestPolicy(),
                    [&](const std::string& s) { log.push_back(s); });
  auto plan = m.Apply(0, GpuLoad::kWarmOnly);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->size(), 1u);
  EXPECT_TRUE(driver.calls().empty());
  ASSERT_EQ(log.size(), 1u);
  EXPECT_NE(log[0].find("would set power limit 250 W (dry-run)"), std::string::npos) << log[0];
  EXPECT_EQ(m.changes_applied(), 0u);
  EXPECT_TRUE(m.RestoreAll().ok());
  EXPECT_TRUE(driver.calls().empty());
}

TEST(GpuPowerTest, EnforceAppliesReadsBackAndRestoresOnExit) {
  FakeGpuDriver driver(FakeGpuDriver::MakeGpus(2, 80LL << 30));
  std::vector<std::string> log;
  GpuPowerManager m(&driver, PowerMode::kEnforce, TestPolicy(),
                    [&](const std::string& s) { log.push_back(s); });
  ASSERT_TRUE(m.Apply(1, GpuLoad::kWarmOnly).ok());
  EXPECT_EQ(driver.Read(1)->power_limit_mw, 250000u);
  EXPECT_NE(log.back().find("enforced limit now 250 W"), std::string::npos) << log.back();
  ASSERT_TRUE(m.Apply(1, GpuLoad::kServing).ok());
  ASSERT_TRUE(m.Apply(1, GpuLoad::kServing).ok());  // already there: no change
  EXPECT_EQ(m.changes_applied(), 2u);
  ASSERT_TRUE(m.Apply(1, GpuLoad::kIdle).ok());
  ASSERT_TRUE(m.RestoreAll().ok());
  EXPECT_EQ(driver.Read(1)->power_limit_mw, 700000u);  // as found
  EXPECT_EQ(driver.calls(),
            (std::vector<std::string>{"power_limit 1 250000", "power_limit 1 700000",
                                      "power_limit 1 250000", "power_limit 1 700000"}));
  EXPECT_EQ(ParsePowerMode("enforce").value(), PowerMode::kEnforce);
  EXPECT_FALSE(ParsePowerMode("yes").ok());
}

// A card may enforce a lower limit than the one set on it (an out-of-band limit, say): kiln
// compares against and restores the limit set, never writes the enforced one back as the
// card's own.
TEST(GpuPowerTest, ALowerLimitSetOutsideKilnIsNeitherFoughtNorRestoredAsTheCardsOwn) {
  FakeGpuDriver driver(FakeGpuDriver::MakeGpus(1, 80LL << 30));
  driver.SetExternalPowerCap(0, 400000);  // enforced 400 W, set 700 W
  ASSERT_EQ(driver.Read(0)->power_limit_mw, 400000u);
  std::vector<std::string> log;
  GpuPowerManager m(&driver, PowerMode::kEnforce, TestPolicy(),
                    [&](const std::string& s) { log.push_back(s); });
  auto plan = m.Apply(0, GpuLoad::kServing);  // wants 700 W: already set
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->empty());
  ASSERT_TRUE(m.Apply(0, GpuLoad::kWarmOnly).ok());
  EXPECT_EQ(driver.Read(0)->power_limit_mw, 250000u);
  ASSERT_TRUE(m.Apply(0, GpuLoad::kServing).ok());
  EXPECT_NE(log.back().find("enforced limit now 400 W (another limit on the card is lower)"),
            std::string::npos)
      << log.back();
  ASSERT_TRUE(m.Apply(0, GpuLoad::kIdle).ok());
  ASSERT_TRUE(m.RestoreAll().ok());
  EXPECT_EQ(driver.Read(0)->power_management_limit_mw, 700000u);  // as set, not 400 W
  EXPECT_EQ(driver.calls(),
            (std::vector<std::string>{"power_limit 0 250000", "power_limit 0 700000",
                                      "power_limit 0 250000", "power_limit 0 700000"}));
}

// An agent that dies without restoring (killed, crashed) leaves the cards' own settings in its
// file: the next one restores those, not the caps the first one left.
TEST(GpuPowerTest, ACardsOwnSettingsOutliveAnAgentThatDiedWithoutRestoring) {
  const std::string file = ::testing::TempDir() + "/kiln_power_" + std::to_string(getpid()) + ".json";
  std::remove(file.c_str());
  FakeGpuDriver driver(FakeGpuDriver::MakeGpus(2, 80LL << 30));
  auto quiet = [](const std::string&) {};
  {
    GpuPowerManager first(&driver, PowerMode::kEnforce, TestPolicy(), quiet, file);
    ASSERT_TRUE(first.Apply(1, GpuLoad::kWarmOnly).ok());
    EXPECT_EQ(driver.Read(1)->power_limit_mw, 250000u);
    // Dies here: no RestoreAll.
  }
  GpuPowerManager next(&driver, PowerMode::kEnforce, TestPolicy(), quiet, file);
  ASSERT_TRUE(next.Apply(1, GpuLoad::kWarmOnly).ok());  // finds the card capped at 250 W
  ASSERT_TRUE(next.RestoreAll().ok());
  EXPECT_EQ(driver.Read(1)->power_limit_mw, 700000u);  // the card's own, not the cap
  // Restored: nothing left for a third agent to restore.
  GpuPowerManager third(&driver, PowerMode::kEnforce, TestPolicy(), quiet, file);
  ASSERT_TRUE(third.Apply(1, GpuLoad::kServing).ok());
  ASSERT_TRUE(third.RestoreAll().ok());
  EXPECT_EQ(driver.Read(1)->power_limit_mw, 700000u);
  std::remove(file.c_str());
}

// An originals file with fields of the wrong type (hand-edited, or not kiln's) does not stop the
// agent: each bad entry is left out, its field named.
TEST(GpuPowerTest, AnOriginalsFileWithBadFieldsIsReadEntryByEntry) {
  const std::string file = ::testing::TempDir() + "/kiln_power_bad_" + std::to_string(getpid()) + ".json";
  FakeGpuDriver driver(FakeGpuDriver::MakeGpus(3, 80LL << 30));
  const std::string u0 = driver.Identify(0)->uuid, u1 = driver.Identify(1)->uuid,
                    u2 = driver.Identify(2)->uuid;
  nlohmann::json doc = {{"gpus",
                         {{u0, {{"power_limit_mw", 500000}, {"persistence", "yes"}}},
                          {u1, {{"power_limit_mw", 1ULL << 40}}},
                          {u2, {{"power_limit_mw", 600000}, {"clocks_locked", false}}}}}};
  std::ofstream(file) << doc.dump();
  std::vector<std::string> said;
  GpuPowerManager m(&driver, PowerMode::kEnforce, TestPolicy(),
                    [&](const std::string& line) { said.push_back(line); }, file);
  const std::string all = absl::StrJoin(said, "\n");
  EXPECT_NE(all.find("gpus." + u0 + ": persistence: not true or false"), std::string::npos) << all;
  EXPECT_NE(all.find("gpus." + u1 + ": power_limit_mw"), std::string::npos) << all;
  EXPECT_NE(all.find("1 GPU(s) still hold settings"), std::string::npos) << all;
  // The good entry is kept: GPU 2's own limit is taken to be 600 W and restored as such.
  ASSERT_TRUE(m.Apply(2, GpuLoad::kWarmOnly).ok());
  ASSERT_TRUE(m.RestoreAll().ok());
  EXPECT_EQ(driver.Read(2)->power_limit_mw, 600000u);
  std::remove(file.c_str());
}

// A replica's idle time counts from its last request; with no earlier sample (the agent just
// restarted) from when it was last seen SERVING, never from the restart itself.
TEST(LastActiveTest, IdleTimeSurvivesAnAgentRestart) {
  const absl::Time now = absl::FromUnixSeconds(1'000'000);
  const absl::Time served = now - absl::Minutes(40);
  // First sample after a restart: a WARM replica last SERVING 40 minutes ago is that idle.
  EXPECT_EQ(LastActive(std::nullopt, 7, now, served), served);
  // A clock that went back (last_used in the future) never makes it negative.
  EXPECT_EQ(LastActive(std::nullopt, 7, now, now + absl::Minutes(1)), now);
  // Later samples: no new requests keep the earlier time; new ones, or a count that went
  // down (its runtime restarted), are activity now.
  ActivitySample before{7, served};
  EXPECT_EQ(LastActive(before, 7, now, now), served);
  EXPECT_EQ(LastActive(before, 9, now, served), now);
  EXPECT_EQ(LastActive(before, 2, now, served), now);
}

// --label: Kubernetes label syntax, each error naming the flag, the value and the reason.
TEST(NodeLabelsTest, ParsedAndCheckedLikeKubernetesLabels) {
  auto ok = ParseNodeLabels({"topology.kubernetes.io/zone=eu-west-1a", "rack=r12", "spare="});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->at("topology.kubernetes.io/zone"), "eu-west-1a");
  EXPECT_EQ(ok->at("rack"), "r12");
  EXPECT_EQ(ok->at("spare"), "");
  EXPECT_TRUE(ParseNodeLabels({})->empty());
  auto says = [](std::vector<std::string> flags, const std::string& what) {
    auto r = ParseNodeLabels(flags);
    ASSERT_FALSE(r.ok()) << flags[0];
    EXPECT_NE(r.status().message().find("--label '" + flags.back() + "': " + what),
              std::string::npos)
        << r.status();
  };
  says({"zone"}, "must be KEY=VALUE");
  says({"=a"}, "the key's name must be 1..63");
  says({"-zone=a"}, "the key's name must be 1..63");
  says({std::string(64, 'k') + "=a"}, "the key's name must be 1..63");
  says({"Bad_Prefix/zone=a"}, "the key's prefix must be a DNS subdomain");
  says({"/zone=a"}, "the key's prefix must be a DNS subdomain");
  says({"zone=a b"}, "the value must be at most 63");
  says({"zone=" + std::string(64, 'v')}, "the value must be at most 63");
  says({"zone=a", "zone=b"}, "the key 'zone' is given twice");
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// The router's reader sleeps until a window around the expected answer, spins through it,
// then sleeps again.
TEST(BusyPollTest, TheSpinWindowIsCentredOnTheExpectedAnswer) {
  // Sent at 1000, answers take 400 µs: a 200 µs window from 1300 to 1500.
  SpinWindow w = PlanSpin(/*now=*/1010, /*oldest_sent=*/1000, /*typical=*/400, /*window=*/200);
  EXPECT_EQ(w.from, 1300);
  EXPECT_EQ(w.until, 1500);
  // Inside the window: spin from now.
  w = PlanSpin(1350, 1000, 400, 200);
  EXPECT_EQ(w.from, 1350);
  EXPECT_EQ(w.until, 1500);
  // A window wider than the answer time starts at once.
  w = PlanSpin(1000, 1000, 100, 600);
  EXPECT_EQ(w.from, 1000);
  EXPECT_EQ(w.until, 1400);
  // Not known yet: spin at once, half a window.
  w = PlanSpin(1000, 1000, 0, 200);
  EXPECT_EQ(w.from, 1000);
  EXPECT_EQ(w.until, 1100);
}

TEST(BusyPollTest, NoWindowWhenOffIdleOrLate) {
  EXPECT_EQ(PlanSpin(1000, 1000, 400, 0).until, 0);   // off
  EXPECT_EQ(PlanSpin(1000, 0, 400, 200).until, 0);    // no call waits
  EXPECT_EQ(PlanSpin(1500, 1000, 400, 200).until, 0); // the window ended: the answer is late
  EXPECT_EQ(PlanSpin(9000, 1000, 400, 200).until, 0);
  EXPECT_EQ(PlanSpin(1000, 1000, -5, 200).until, 1100);  // a bad estimate counts as none
}

TEST(BusyPollTest, TheTypicalAnswerTimeFollowsObservationsSlowly) {
  EXPECT_EQ(NextTypical(0, 480), 480);  // the first is taken as is
  EXPECT_EQ(NextTypical(400, 480), 410);
  EXPECT_EQ(NextTypical(400, 320), 390);
  EXPECT_EQ(NextTypical(400, -7), 400);  // a clock step is ignored
  int64_t t = 0;
  for (int i = 0; i < 100; ++i) t = NextTypical(t, i % 2 ? 300 : 500);
  EXPECT_GE(t, 350);
  EXPECT_LE(t, 450);
}

TEST(BusyPollTest, SpinSlotsBoundTheSpinners) {
  SpinSlots slots(2);
  EXPECT_TRUE(slots.TryAcquire());
  EXPECT_TRUE(slots.TryAcquire());
  EXPECT_FALSE(slots.TryAcquire());
  slots.Release();
  EXPECT_EQ(slots.free(), 1);
  EXPECT_TRUE(slots.TryAcquire());
  SpinSlots none(0);
  EXPECT_FALSE(none.TryAcquire());
}

}  // namespace
}  // namespace kiln
