// The agent's pure policies: restart backoff and crash loops, GPU health, the warm pool plan,
// the router's choices and the GPU power plan.
#include <map>

#include "agent/fake_gpu_driver.h"
#include "agent/gpu_monitor.h"
#include "agent/gpu_power.h"
#include "agent/router.h"
#include "agent/router_policy.h"
#include "common/clock.h"
#include "gtest/gtest.h"
#include "health/gpu_health.h"
#include "health/restart_policy.h"
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

PoolReplica R(const std::string& id, const std::string& key, PoolState s, int64_t used_s = 0,
              int gpu = 0, int64_t mem = 0) {
  PoolReplica r;
  r.id = id;
  r.key = key;
  r.state = s;
  r.last_used = absl::FromUnixSeconds(used_s);
  r.gpu = gpu;
  r.gpu_memory_bytes = mem;
  return r;
}

std::vector<std::string> Describe(const std::vector<PoolAction>& actions) {
  std::vector<std::string> out;
  for (const auto& a : actions) {
    std::string s = std::string(PoolActionName(a.kind)) + " " + a.key;
    if (!a.replica_id.empty()) s += " " + a.replica_id;
    if (a.kind == PoolActionKind::kStart) s += std::string(" as ") + PoolStateName(a.start_as);
    out.push_back(s);
  }
  return out;
}

TEST(PoolPlanTest, ScaleUpPromotesWarmFirstThenRefills) {
  std::vector<PoolReplica> rs = {R("a", "m@1", PoolState::kServing),
                                 R("w1", "m@1", PoolState::kWarm, 10),
                                 R("w2", "m@1", PoolState::kWarm, 20)};
  auto plan = PlanPool({{"m@1", 3, 1}}, rs);
  // w2 is the most recently used WARM replica; the pool is refilled by one cold start.
  EXPECT_EQ(Describe(plan), (std::vector<std::string>{"promote m@1 w2", "promote m@1 w1",
                                                      "start m@1 as WARM"}));
  plan = PlanPool({{"m@1", 5, 1}}, rs);
  EXPECT_EQ(Describe(plan),
            (std::vector<std::string>{"promote m@1 w2", "promote m@1 w1", "start m@1 as SERVING",
                                      "start m@1 as SERVING", "start m@1 as WARM"}));
}

TEST(PoolPlanTest, ScaleDownDemotesIntoAShortPoolElseDrains) {
  std::vector<PoolReplica> rs = {R("s1", "m@1", PoolState::kServing, 30),
                                 R("s2", "m@1", PoolState::kServing, 10),
                                 R("s3", "m@1", PoolState::kServing, 20)};
  auto plan = PlanPool({{"m@1", 1, 1}}, rs);
  // Least recently used first: s2 goes to the pool, s3 drains.
  EXPECT_EQ(Describe(plan), (std::vector<std::string>{"demote m@1 s2", "drain m@1 s3"}));
}

TEST(PoolPlanTest, StartingReplicasCountAndStableStateIsANoOp) {
  PoolReplica starting = R("n", "m@1", PoolState::kStarting);
  starting.start_as = PoolState::kWarm;
  std::vector<PoolReplica> rs = {R("s1", "m@1", PoolState::kServing), starting};
  EXPECT_TRUE(PlanPool({{"m@1", 1, 1}}, rs).empty());
  rs.push_back(R("w", "m@1", PoolState::kWarm, 5));
  // One WARM too many: the idle one drains (not the one still starting).
  EXPECT_EQ(Describe(PlanPool({{"m@1", 1, 1}}, rs)), std::vector<std::string>{"drain m@1 w"});
}

TEST(PoolPlanTest, KeysWithoutATargetAreDrainedAndNewKeysStart) {
  std::vector<PoolReplica> rs = {R("old", "m@1", PoolState::kServing),
                                 R("gone", "m@1", PoolState::kDraining)};
  auto plan = PlanPool({{"m@2", 1, 0}}, rs);
  EXPECT_EQ(Describe(plan),
            (std::vector<std::string>{"drain m@1 old", "start m@2 as SERVING"}));
}

TEST(PoolPlanTest, EvictsLeastRecentlyUsedWarmReplicasUnderMemoryPressure) {
  std::vector<PoolReplica> rs = {R("w1", "a@1", PoolState::kWarm, 30, 0, 4 << 20),
                                 R("w2", "b@1", PoolState::kWarm, 10, 0, 2 << 20),
                                 R("w3", "c@1", PoolState::kWarm, 20, 0, 2 << 20),
                                 R("s", "a@1", PoolState::kServing, 0, 0, 8 << 20),
                                 R("other", "a@1", PoolState::kWarm, 0, 1, 8 << 20)};
  EXPECT_TRUE(PlanEvictions(rs, 0, 10 << 20, 5 << 20)->empty());
  EXPECT_EQ(*PlanEvictions(rs, 0, 1 << 20, 5 << 20), (std::vector<std::string>{"w2", "w3"}));
  auto too_much = PlanEvictions(rs, 0, 1 << 20, 64 << 20);
  EXPECT_EQ(too_much.status().code(), absl::StatusCode::kResourceExhausted);
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

PowerPolicy TestPolicy() {
  PowerPolicy p;
  p.warm_only.power_limit_mw = 250000;
  p.serving.power_limit_mw = 700000;
  p.idle.power_limit_mw = 250000;
  return p;
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

}  // namespace
}  // namespace kiln
