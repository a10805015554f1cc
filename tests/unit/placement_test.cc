// The controller's pure decisions: node leases and placement.
#include "controller/placement.h"

#include <deque>
#include <limits>
#include <map>
#include <random>

#include "controller/controller.h"
#include "controller/node_registry.h"
#include "gtest/gtest.h"

namespace kiln {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1800000000);

TEST(NodeRegistryTest, LeasesGoNotReadyThenLost) {
  NodeRegistry reg({absl::Seconds(10), absl::Seconds(30)});
  v1::Register r;
  r.set_node_name("n1");
  r.set_cpu_capacity(8);
  ASSERT_TRUE(reg.Register(r, kT0).ok());
  EXPECT_EQ(reg.Health("n1", kT0 + absl::Seconds(9)), NodeHealth::kReady);
  EXPECT_EQ(reg.Health("n1", kT0 + absl::Seconds(10)), NodeHealth::kNotReady);
  ASSERT_TRUE(reg.ReportStatus("n1", v1::NodeStatus(), kT0 + absl::Seconds(12)).ok());
  EXPECT_EQ(reg.Health("n1", kT0 + absl::Seconds(13)), NodeHealth::kReady);
  EXPECT_EQ(reg.Health("n1", kT0 + absl::Seconds(42)), NodeHealth::kLost);
  EXPECT_EQ(reg.Health("never", kT0), NodeHealth::kLost);
  EXPECT_EQ(reg.ReportStatus("never", v1::NodeStatus(), kT0).code(), absl::StatusCode::kNotFound);
  // Its stream still open (a machine that died without closing it) changes nothing.
  EXPECT_TRUE(reg.Forget(kT0 + absl::Seconds(100), absl::Seconds(60)).empty());
  EXPECT_EQ(reg.nodes().size(), 1u);
  auto gone = reg.Forget(kT0 + absl::Seconds(103), absl::Seconds(60));
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].first, "n1");
  EXPECT_EQ(gone[0].second.registration.cpu_capacity(), 8);
  EXPECT_TRUE(reg.nodes().empty());
  EXPECT_STREQ(NodeHealthName(NodeHealth::kNotReady), "NotReady");
}

TEST(NodeRegistryTest, TheNextTransitionIsTheNearestLeaseToEnd) {
  NodeRegistry reg({absl::Seconds(10), absl::Seconds(30)});
  EXPECT_EQ(reg.NextTransition(kT0), absl::InfiniteFuture());
  v1::Register r;
  r.set_node_name("a");
  ASSERT_TRUE(reg.Register(r, kT0).ok());
  r.set_node_name("b");
  ASSERT_TRUE(reg.Register(r, kT0 + absl::Seconds(4)).ok());
  EXPECT_EQ(reg.NextTransition(kT0), kT0 + absl::Seconds(10));  // a goes NotReady
  EXPECT_EQ(reg.NextTransition(kT0 + absl::Seconds(10)), kT0 + absl::Seconds(14));  // then b
  EXPECT_EQ(reg.NextTransition(kT0 + absl::Seconds(14)), kT0 + absl::Seconds(30));  // a Lost
  ASSERT_TRUE(reg.ReportStatus("a", v1::NodeStatus(), kT0 + absl::Seconds(20)).ok());
  EXPECT_EQ(reg.NextTransition(kT0 + absl::Seconds(20)), kT0 + absl::Seconds(30));  // a again
  EXPECT_EQ(reg.NextTransition(kT0 + absl::Seconds(30)), kT0 + absl::Seconds(34));  // b Lost
  EXPECT_EQ(reg.NextTransition(kT0 + absl::Seconds(50)), absl::InfiniteFuture());
}

TEST(NodeRegistryTest, APassThatWouldRunOverALeaseEndWaitsForIt) {
  const absl::Duration tick = absl::Milliseconds(200), pass = absl::Milliseconds(150);
  // No lease ends soon: a tick after the last pass.
  EXPECT_EQ(NextPassIn(tick, absl::InfiniteDuration(), pass), tick);
  EXPECT_EQ(NextPassIn(tick, absl::Seconds(9), pass), tick);
  // A lease ends before the tick: at its end (a millisecond after).
  EXPECT_EQ(NextPassIn(tick, absl::Milliseconds(50), pass), absl::Milliseconds(51));
  // It ends while a pass started at the tick would run: the pass waits for it.
  EXPECT_EQ(NextPassIn(tick, absl::Milliseconds(300), pass), absl::Milliseconds(301));
  // It ends once that pass would be over: the tick as usual.
  EXPECT_EQ(NextPassIn(tick, absl::Milliseconds(350), pass), tick);
  // Passes not measured yet (or a simulated clock that stands still): the tick or the lease.
  EXPECT_EQ(NextPassIn(tick, absl::Milliseconds(300), absl::ZeroDuration()), tick);
  EXPECT_EQ(NextPassIn(tick, absl::ZeroDuration(), pass), absl::Milliseconds(1));
  // One that ended while the last pass ran (the loop counts from that pass's start): at once.
  EXPECT_EQ(NextPassIn(tick, absl::Milliseconds(-40), pass), absl::Milliseconds(1));
}

TEST(NodeRegistryTest, RemovingANodeByHandNeedsItsStreamClosed) {
  NodeRegistry reg({});
  v1::Register r;
  r.set_node_name("n1");
  ASSERT_TRUE(reg.Register(r, kT0).ok());
  EXPECT_EQ(reg.Remove("nope", kT0).status().code(), absl::StatusCode::kNotFound);
  auto connected = reg.Remove("n1", kT0 + absl::Seconds(5));
  EXPECT_EQ(connected.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(connected.status().message().find("connected"), std::string::npos);
  reg.Disconnected("n1");
  auto removed = reg.Remove("n1", kT0 + absl::Seconds(5));
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(removed->registration.node_name(), "n1");
  EXPECT_TRUE(reg.nodes().empty());
  // Connected but Lost (its lease ended): a dead machine's stream, removable.
  ASSERT_TRUE(reg.Register(r, kT0).ok());
  EXPECT_TRUE(reg.Remove("n1", kT0 + absl::Seconds(30)).ok());
}

TEST(NodeRegistryTest, BadRegistrationsNameTheField) {
  NodeRegistry reg({});
  v1::Register r;
  EXPECT_NE(reg.Register(r, kT0).message().find("register.node_name"), std::string::npos);
  r.set_node_name("n1");
  r.add_gpus()->set_index(0);
  r.add_gpus()->set_index(0);
  EXPECT_NE(reg.Register(r, kT0).message().find("register.gpus[1].index"), std::string::npos);
}

TEST(NodeRegistryTest, ReRegisteringReportsTheAdoptedReplicas) {
  NodeRegistry reg({});
  v1::Register r;
  r.set_node_name("n1");
  auto* rep = r.add_replicas();
  rep->set_replica_id("enc.0");
  rep->set_state(v1::SERVING);
  ASSERT_TRUE(reg.Register(r, kT0).ok());
  const NodeRecord& n = reg.nodes().at("n1");
  EXPECT_TRUE(n.has_status);
  ASSERT_EQ(n.status.replicas_size(), 1);
  EXPECT_EQ(n.status.replicas(0).replica_id(), "enc.0");
}

PlacementNode CpuNode(const std::string& name, int cpus, const std::string& zone = "") {
  PlacementNode n;
  n.name = name;
  n.cpu_capacity = cpus;
  n.zone = zone;
  return n;
}

PlacementNode GpuNode(const std::string& name, std::vector<int64_t> gpu_memory, int cpus = 32) {
  PlacementNode n = CpuNode(name, cpus);
  for (size_t i = 0; i < gpu_memory.size(); ++i) {
    n.gpus.push_back({static_cast<int>(i), gpu_memory[i], true});
  }
  return n;
}

PlacementDemand Cpu(const std::string& dep, int64_t serving, int64_t warm, int64_t cpus = 1) {
  PlacementDemand d;
  d.deployment = dep;
  d.model = "encoder";
  d.version = "1";
  d.repository = "/models";
  d.serving = serving;
  d.warm = warm;
  d.cpus = cpus;
  return d;
}

v1::ReplicaStatus Reported(const std::string& id, v1::LifecycleState state,
                           const std::string& version = "1", bool crash_loop = false) {
  v1::ReplicaStatus s;
  s.set_replica_id(id);
  s.set_model("encoder");
  s.set_version(version);
  s.set_state(state);
  s.set_healthy(!crash_loop);
  s.set_crash_loop(crash_loop);
  s.set_device("cpu");
  s.set_cpus("3");  // one CPU
  return s;
}

// Placement reads the caller's replica records where they lie; these keep a test's alive for
// the whole run.
template <typename T>
std::vector<const T*> Keep(const std::vector<T>& items) {
  static std::deque<T> kept;
  std::vector<const T*> out;
  for (const auto& i : items) out.push_back(&kept.emplace_back(i));
  return out;
}
template <typename T>
std::vector<const T*> Keep(std::initializer_list<T> items) {
  return Keep(std::vector<T>(items));
}

std::vector<std::string> Ids(const std::vector<v1::ReplicaSpec>& specs) {
  std::vector<std::string> out;
  for (const auto& s : specs) out.push_back(s.replica_id() + ":" + v1::LifecycleState_Name(s.state()));
  return out;
}

TEST(PlacementTest, SpreadsNewReplicasAcrossNodesAndZones) {
  std::vector<PlacementNode> nodes = {CpuNode("a", 4, "z1"), CpuNode("b", 4, "z1"),
                                      CpuNode("c", 4, "z2")};
  auto p = Place({Cpu("enc", 3, 0)}, nodes);
  EXPECT_TRUE(p.unplaced.empty());
  // One per node; the second goes to the other zone first.
  EXPECT_EQ(p.nodes["a"].size(), 1u);
  EXPECT_EQ(p.nodes["b"].size(), 1u);
  EXPECT_EQ(p.nodes["c"].size(), 1u);
  EXPECT_EQ(p.nodes["c"][0].replica_id(), "enc.1");
  EXPECT_EQ(p.nodes["a"][0].repository(), "/models");
  // Deterministic: the same input, the same output.
  auto again = Place({Cpu("enc", 3, 0)}, nodes);
  for (const auto& [n, specs] : p.nodes) EXPECT_EQ(Ids(specs), Ids(again.nodes[n]));
}

// When nodes tie on spread and fit, the one with fewer requests in flight takes the replica.
TEST(PlacementTest, TheLessLoadedOfEqualNodesWins) {
  std::vector<PlacementNode> nodes = {CpuNode("a", 4), CpuNode("b", 4), CpuNode("c", 4)};
  nodes[0].load = 9;
  nodes[1].load = 2;
  nodes[2].load = 5;
  auto p = Place({Cpu("enc", 1, 0)}, nodes);
  ASSERT_EQ(p.nodes["b"].size(), 1u) << "a:" << p.nodes["a"].size() << " c:" << p.nodes["c"].size();
  // Two replicas: the two least loaded, spread.
  p = Place({Cpu("enc", 2, 0)}, nodes);
  EXPECT_EQ(p.nodes["b"].size(), 1u);
  EXPECT_EQ(p.nodes["c"].size(), 1u);
  EXPECT_EQ(p.nodes["a"].size(), 0u);
  // Fit comes before load: a node the replica fills exactly wins over an idle larger one.
  std::vector<PlacementNode> fit = {CpuNode("big", 8), CpuNode("small", 1)};
  fit[0].load = 0;
  fit[1].load = 50;
  p = Place({Cpu("enc", 1, 0)}, fit);
  EXPECT_EQ(p.nodes["small"].size(), 1u);
}

TEST(PlacementTest, NodesWhoseAssignmentStaysAreNamedNotCopiedWhenAsked) {
  std::vector<PlacementNode> nodes = {CpuNode("a", 8), CpuNode("b", 8), CpuNode("c", 8)};
  PlacementResult first = Place({Cpu("enc", 2, 0)}, nodes);
  ASSERT_EQ(first.nodes.size(), 3u);
  EXPECT_TRUE(first.unchanged.empty());  // not asked: every node's assignment is in `nodes`
  for (auto& n : nodes) n.assigned = Keep(first.nodes.at(n.name));
  const std::vector<std::string> on_a = Ids(first.nodes.at("a"));
  ASSERT_EQ(on_a.size(), 1u);

  // Nothing changes: every node named, none copied; without asking, the same as before.
  PlacementResult same = Place({Cpu("enc", 2, 0)}, nodes, {}, {}, {}, /*omit_unchanged=*/true);
  EXPECT_TRUE(same.nodes.empty());
  EXPECT_EQ(same.unchanged, (std::vector<std::string>{"a", "b", "c"}));
  PlacementResult full = Place({Cpu("enc", 2, 0)}, nodes);
  EXPECT_EQ(Ids(full.nodes.at("a")), on_a);
  EXPECT_TRUE(full.unchanged.empty());

  // One more replica: only the node it goes to is copied (with what it had).
  PlacementResult more = Place({Cpu("enc", 3, 0)}, nodes, {}, {}, {}, true);
  ASSERT_EQ(more.nodes.size(), 1u);
  EXPECT_EQ(more.nodes.begin()->second.size(), 1u);
  EXPECT_EQ(more.unchanged.size(), 2u);
  EXPECT_EQ(more.nodes.count(more.unchanged[0]) + more.nodes.count(more.unchanged[1]), 0u);

  // A spec that changes (its repository) makes its node's assignment new, with the change.
  PlacementDemand moved = Cpu("enc", 2, 0);
  moved.repository = "/other";
  PlacementResult changed = Place({moved}, nodes, {}, {}, {}, true);
  EXPECT_EQ(changed.nodes.size(), 2u);  // the two nodes running one each
  for (const auto& [node, specs] : changed.nodes) {
    ASSERT_EQ(specs.size(), 1u) << node;
    EXPECT_EQ(specs[0].repository(), "/other");
  }
  EXPECT_EQ(changed.unchanged.size(), 1u);

  // Scaled down to one: the node that loses its replica gets an empty assignment.
  PlacementResult fewer = Place({Cpu("enc", 1, 0)}, nodes, {}, {}, {}, true);
  ASSERT_EQ(fewer.nodes.size(), 1u);
  EXPECT_TRUE(fewer.nodes.begin()->second.empty());
  EXPECT_EQ(fewer.unchanged.size(), 2u);
}

TEST(PlacementTest, HealthyReplicasStayAndWarmOnesArePromotedFirst) {
  PlacementNode a = CpuNode("a", 8);
  a.reported = Keep<v1::ReplicaStatus>({Reported("enc.0", v1::SERVING), Reported("enc.1", v1::WARM)});
  PlacementNode b = CpuNode("b", 8);
  // Scale 1 -> 2 serving with a warm pool of 1: enc.1 (warm) is promoted in place, and a new
  // warm replica refills the pool on the other node.
  auto p = Place({Cpu("enc", 2, 1)}, {a, b});
  EXPECT_EQ(Ids(p.nodes["a"]), (std::vector<std::string>{"enc.0:SERVING", "enc.1:SERVING"}));
  EXPECT_EQ(Ids(p.nodes["b"]), (std::vector<std::string>{"enc.2:WARM"}));
}

TEST(PlacementTest, ScaleDownDropsWarmThenExtraServing) {
  PlacementNode a = CpuNode("a", 8);
  a.reported = Keep<v1::ReplicaStatus>({Reported("enc.0", v1::SERVING), Reported("enc.1", v1::SERVING),
                Reported("enc.2", v1::WARM)});
  auto p = Place({Cpu("enc", 1, 0)}, {a});
  EXPECT_EQ(Ids(p.nodes["a"]), (std::vector<std::string>{"enc.0:SERVING"}));
  auto none = Place({}, {a});
  EXPECT_TRUE(none.nodes["a"].empty());
}

TEST(PlacementTest, CrashLoopingFailedOrOtherVersionReplicasAreReplacedWithNewIds) {
  PlacementNode a = CpuNode("a", 8);
  a.reported = Keep<v1::ReplicaStatus>({Reported("enc.0", v1::SERVING, "1", /*crash_loop=*/true),
                Reported("enc.1", v1::SERVING, "0"), Reported("enc.2", v1::FAILED)});
  auto p = Place({Cpu("enc", 1, 0)}, {a});
  EXPECT_EQ(Ids(p.nodes["a"]), (std::vector<std::string>{"enc.3:SERVING"}));
}

TEST(PlacementTest, AReplicaStillLoadingIsKeptNotReplaced) {
  PlacementNode a = CpuNode("a", 2);
  v1::ReplicaStatus loading = Reported("enc.1", v1::LOADING);
  loading.set_healthy(false);  // not routable yet
  a.reported = Keep<v1::ReplicaStatus>({Reported("enc.0", v1::SERVING), loading});
  auto p = Place({Cpu("enc", 1, 1)}, {a});
  EXPECT_EQ(Ids(p.nodes["a"]), (std::vector<std::string>{"enc.0:SERVING", "enc.1:WARM"}));
}

TEST(PlacementTest, AssignedButNotYetReportedReplicasAreNotPlacedTwice) {
  PlacementNode a = CpuNode("a", 8);
  v1::ReplicaSpec spec;
  spec.set_replica_id("enc.0");
  spec.set_model("encoder");
  spec.set_version("1");
  spec.set_gpu(-1);
  spec.set_cpus(1);
  spec.set_state(v1::SERVING);
  a.assigned = Keep<v1::ReplicaSpec>({spec});
  auto p = Place({Cpu("enc", 1, 0)}, {a, CpuNode("b", 8)});
  EXPECT_EQ(Ids(p.nodes["a"]), (std::vector<std::string>{"enc.0:SERVING"}));
  EXPECT_TRUE(p.nodes["b"].empty());
}

TEST(PlacementTest, CpuCapacityAndUnplacedReasons) {
  auto p = Place({Cpu("big", 3, 0, /*cpus=*/3)}, {CpuNode("a", 4), CpuNode("b", 4)});
  EXPECT_EQ(p.nodes["a"].size() + p.nodes["b"].size(), 2u);
  ASSERT_EQ(p.unplaced.size(), 1u);
  EXPECT_NE(p.unplaced[0].find("big: 1 of 3 replicas have no node with room"), std::string::npos)
      << p.unplaced[0];
}

TEST(PlacementTest, GpuReplicasBestFitByFreeMemoryAndSkipUnhealthyGpus) {
  PlacementDemand d = Cpu("emb", 1, 0, 2);
  d.gpus = 1;
  d.gpu_memory_bytes = 10LL << 30;
  PlacementNode n = GpuNode("g", {80LL << 30, 24LL << 30, 16LL << 30});
  n.gpus[2].healthy = false;
  auto p = Place({d}, {n});
  ASSERT_EQ(p.nodes["g"].size(), 1u);
  EXPECT_EQ(p.nodes["g"][0].gpu(), 1);  // 24 GiB leaves the least; GPU 2 is unhealthy
  EXPECT_EQ(p.nodes["g"][0].gpu_memory_bytes(), 10LL << 30);
  // Memory already used counts the larger of reservation and measured use.
  PlacementNode used = GpuNode("g", {24LL << 30});
  v1::ReplicaStatus r = Reported("other.0", v1::SERVING);
  r.set_device("cuda:0");
  r.set_gpu_memory_bytes(4LL << 30);
  r.set_measured_gpu_memory_bytes(20LL << 30);
  used.reported = Keep<v1::ReplicaStatus>({r});
  auto full = Place({d, [] {
                       PlacementDemand o = Cpu("other", 1, 0);
                       o.gpus = 1;
                       o.gpu_memory_bytes = 4LL << 30;
                       return o;
                     }()},
                    {used});
  ASSERT_EQ(full.unplaced.size(), 1u);
  EXPECT_NE(full.unplaced[0].find("emb:"), std::string::npos) << full.unplaced[0];
}

// What the nodes report after applying `p`: every replica in the state its spec asks for,
// except those in `loading`, which report LOADING (unhealthy, not yet serving).
// Those in `unreported` are assigned but not reported yet (the agent has not started them).
void Apply(const PlacementResult& p, std::vector<PlacementNode>* nodes,
           const std::set<std::string>& loading = {},
           const std::set<std::string>& unreported = {}) {
  for (PlacementNode& n : *nodes) {
    n.assigned = Keep(p.nodes.at(n.name));
    std::vector<v1::ReplicaStatus> reported;
    for (const auto* assigned : n.assigned) {
      const v1::ReplicaSpec& spec = *assigned;
      if (unreported.count(spec.replica_id())) continue;
      v1::ReplicaStatus r = Reported(spec.replica_id(), loading.count(spec.replica_id())
                                                            ? v1::LOADING
                                                            : spec.state());
      r.set_device(spec.gpu() >= 0 ? "cuda:" + std::to_string(spec.gpu()) : "cpu");
      r.set_cpus(std::to_string(spec.cpus() - 1 + 3) == "3" ? "3" : "3-" + std::to_string(2 + spec.cpus()));
      reported.push_back(r);
    }
    n.reported = Keep(reported);
  }
}

std::vector<std::string> All(const PlacementResult& p) {
  std::vector<std::string> out;
  for (const auto& [node, specs] : p.nodes) {
    for (const auto& s : specs) {
      out.push_back(node + "/" + std::to_string(s.gpu()) + ":" + s.replica_id() + ":" +
                    v1::LifecycleState_Name(s.state()));
    }
  }
  return out;
}

PlacementDemand GpuDemand(int64_t serving, int64_t surge, int64_t unavailable) {
  PlacementDemand d = Cpu("emb", serving, 0, 2);
  d.gpus = 1;
  d.gpu_memory_bytes = 10LL << 30;
  d.max_surge = surge;
  d.max_unavailable = unavailable;
  return d;
}

PlacementDemand GpuOf(const std::string& dep, int64_t serving, int64_t warm, int64_t gib) {
  PlacementDemand d = Cpu(dep, serving, warm, 2);
  d.gpus = 1;
  d.gpu_memory_bytes = gib << 30;
  return d;
}

// A deployment on many nodes: past a few hundred of its nodes skipped in one search, a demand
// searches its own index of the nodes free of it (kept in step as replicas land). What lands
// where is the same rule: one per node while a node is free of it, zones evened out, then a
// second per node; a later deployment does the same around it.
TEST(PlacementTest, ADeploymentOnManyNodesSpreadsLikeASmallOne) {
  std::vector<PlacementNode> nodes;
  for (int i = 0; i < 60; ++i) {
    char name[16];
    std::snprintf(name, sizeof(name), "n%02d", i);
    PlacementNode n = GpuNode(name, std::vector<int64_t>(8, 80LL << 30), 64);
    n.zone = i % 2 ? "b" : "a";
    nodes.push_back(n);
  }
  // 8 GPU slots a node: 33 nodes run it after 33 replicas, 264 slots to skip.
  const PlacementResult p = Place({GpuOf("big", 70, 0, 10), GpuOf("other", 60, 0, 10)}, nodes);
  EXPECT_TRUE(p.unplaced.empty());
  std::map<std::string, int> big, other;  // replicas per node
  for (const auto& [node, specs] : p.nodes) {
    for (const auto& spec : specs) (spec.replica_id().rfind("big.", 0) == 0 ? big : other)[node]++;
  }
  ASSERT_EQ(big.size(), 60u);  // every node, before any runs two
  int twice = 0;
  for (const auto& [node, n] : big) {
    EXPECT_LE(n, 2) << node;
    twice += n == 2;
  }
  EXPECT_EQ(twice, 10);
  int in_a = 0, in_b = 0;  // the ten second replicas evened out across the zones
  for (const auto& [node, n] : big) {
    if (n == 2) ((node.back() - '0') % 2 ? in_b : in_a)++;  // odd nodes are in zone b
  }
  EXPECT_EQ(in_a, 5);
  EXPECT_EQ(in_b, 5);
  ASSERT_EQ(other.size(), 60u);
  for (const auto& [node, n] : other) EXPECT_EQ(n, 1) << node;
  // Deterministic: the same again.
  const PlacementResult again = Place({GpuOf("big", 70, 0, 10), GpuOf("other", 60, 0, 10)}, nodes);
  for (const auto& [node, specs] : p.nodes) EXPECT_EQ(Ids(again.nodes.at(node)), Ids(specs));
}

// The index a demand makes of the nodes free of its deployment changes how fast a node is
// found, never which: the same result with it made at once and never made, over random fleets
// (zones, unlabelled and NotReady nodes, an overloaded GPU, CPU and GPU demands, a rollout's two
// versions), from scratch and again after nodes are lost.
TEST(PlacementTest, ADemandsOwnIndexPicksWhatTheFullSearchPicks) {
  struct Restore {
    size_t before = PlacementFreshIndexAfter();
    ~Restore() { PlacementFreshIndexAfter() = before; }
  } restore;
  auto all = [](const PlacementResult& p) {
    std::string out;
    for (const auto& [node, specs] : p.nodes) {
      out += node + ":";
      for (const auto& spec : specs) {
        out += " " + spec.replica_id() + "/" + v1::LifecycleState_Name(spec.state()) + "/" +
               std::to_string(spec.gpu());
      }
      out += "\n";
    }
    for (const auto& line : p.unplaced) out += "unplaced " + line + "\n";
    for (const auto& [id, why] : p.skewed) out += "skewed " + id + " " + why + "\n";
    for (const auto& [id, why] : p.evicted) out += "evicted " + id + " " + why + "\n";
    return out;
  };
  for (uint32_t seed = 1; seed <= 24; ++seed) {
    std::mt19937 rng(seed);
    auto pick = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    std::vector<PlacementNode> nodes;
    const int count = pick(12, 48);
    for (int i = 0; i < count; ++i) {
      char name[16];
      std::snprintf(name, sizeof(name), "n%02d", i);
      PlacementNode n = pick(0, 3) == 0 ? CpuNode(name, 16)
                                        : GpuNode(name, std::vector<int64_t>(4, 40LL << 30), 24);
      const int zone = pick(0, 3);
      n.zone = zone == 3 ? "" : std::string(1, static_cast<char>('a' + zone));
      n.schedulable = pick(0, 9) != 0;
      if (!n.gpus.empty() && pick(0, 7) == 0) n.gpus[0].overloaded = "busy";
      n.load = pick(0, 4);
      nodes.push_back(n);
    }
    std::vector<PlacementDemand> demands;
    for (int d = 0; d < pick(2, 5); ++d) {
      const std::string dep = "d" + std::to_string(d);
      PlacementDemand demand = pick(0, 2) == 0 ? Cpu(dep, pick(1, 30), pick(0, 3), pick(1, 2))
                                               : GpuOf(dep, pick(1, 40), pick(0, 3), pick(5, 20));
      demands.push_back(demand);
      if (d == 0) {  // a rollout: its canary beside it
        PlacementDemand canary = demand;
        canary.version = "2";
        canary.serving = pick(1, 5);
        canary.warm = 0;
        demands.push_back(canary);
      }
    }
    PlacementFreshIndexAfter() = 0;
    const PlacementResult own = Place(demands, nodes);
    PlacementFreshIndexAfter() = std::numeric_limits<size_t>::max();
    const PlacementResult full = Place(demands, nodes);
    ASSERT_EQ(all(own), all(full)) << "seed " << seed;
    // Applied, then a few nodes lost: their replicas placed again elsewhere.
    Apply(full, &nodes);
    std::set<std::string> retired;
    for (int lost = 0; lost < 3 && nodes.size() > 4; ++lost) {
      const size_t at = static_cast<size_t>(pick(0, static_cast<int>(nodes.size()) - 1));
      for (const auto* spec : nodes[at].assigned) retired.insert(spec->replica_id());
      nodes.erase(nodes.begin() + static_cast<long>(at));
    }
    PlacementFreshIndexAfter() = 0;
    const PlacementResult own_again = Place(demands, nodes, retired);
    PlacementFreshIndexAfter() = std::numeric_limits<size_t>::max();
    const PlacementResult full_again = Place(demands, nodes, retired);
    ASSERT_EQ(all(own_again), all(full_again)) << "seed " << seed << ", after the loss";
  }
}

// Sets what each listed replica reports as its idle time.
void SetIdle(std::vector<PlacementNode>* nodes, const std::map<std::string, int64_t>& idle_ms) {
  for (PlacementNode& n : *nodes) {
    std::vector<v1::ReplicaStatus> reported;
    for (const auto* r : n.reported) {
      reported.push_back(*r);
      auto it = idle_ms.find(r->replica_id());
      if (it != idle_ms.end()) reported.back().set_idle_ms(it->second);
    }
    n.reported = Keep(reported);
  }
}

TEST(PlacementTest, AServingReplicaEvictsTheLeastRecentlyUsedWarmReplicasOfOthers) {
  std::vector<PlacementNode> nodes = {GpuNode("g", {24LL << 30})};
  PlacementDemand cold = GpuOf("cold", 0, 2, 10);
  auto p = Place({cold}, nodes);
  ASSERT_EQ(All(p), (std::vector<std::string>{"g/0:cold.0:WARM", "g/0:cold.1:WARM"}));
  Apply(p, &nodes);
  SetIdle(&nodes, {{"cold.0", 5000}, {"cold.1", 90000}});

  // 4 GiB free, 10 needed: cold.1, idle longest, makes room.
  PlacementDemand hot = GpuOf("hot", 1, 0, 10);
  p = Place({cold, hot}, nodes);
  EXPECT_EQ(All(p), (std::vector<std::string>{"g/0:cold.0:WARM", "g/0:hot.0:SERVING"}));
  ASSERT_EQ(p.evicted.size(), 1u);
  EXPECT_NE(p.evicted["cold.1"].find("cold.1 (WARM, idle 90 s) on g GPU 0 makes room for a "
                                     "SERVING replica of hot"),
            std::string::npos)
      << p.evicted["cold.1"];
  ASSERT_EQ(p.unplaced.size(), 1u);
  EXPECT_EQ(p.unplaced[0].rfind("cold: 1 of 2", 0), 0u) << p.unplaced[0];

  // The node still reports cold.1 until it has drained it: passed back as evicted it is not
  // kept again (which would overcommit the GPU), and nothing more is evicted.
  std::vector<v1::ReplicaStatus> stale;
  for (const auto* r : nodes[0].reported) stale.push_back(*r);
  Apply(p, &nodes);
  for (const auto* r : nodes[0].reported) {
    if (r->replica_id() == "hot.0") stale.push_back(*r);
  }
  nodes[0].reported = Keep(stale);
  auto next = Place({cold, hot}, nodes, {}, {}, {"cold.1"});
  EXPECT_EQ(All(next), (std::vector<std::string>{"g/0:cold.0:WARM", "g/0:hot.0:SERVING"}));
  EXPECT_TRUE(next.evicted.empty());
  ASSERT_EQ(next.unplaced.size(), 1u);
  EXPECT_EQ(next.unplaced[0].rfind("cold: 1 of 2", 0), 0u);
}

// A WARM replica placed by the same call that then evicts it for a SERVING one never ran: it
// is not reported as evicted (no event names a replica no node ever had).
TEST(PlacementTest, AWarmReplicaPlacedAndEvictedInOneCallIsNotReported) {
  std::vector<PlacementNode> nodes = {GpuNode("g", {16LL << 30})};
  // "a" (its pool of one) is placed first, then "b" needs the whole GPU to serve.
  auto p = Place({GpuOf("a", 0, 1, 10), GpuOf("b", 1, 0, 10)}, nodes);
  EXPECT_EQ(All(p), (std::vector<std::string>{"g/0:b.0:SERVING"}));
  EXPECT_TRUE(p.evicted.empty()) << p.evicted.begin()->second;
  ASSERT_EQ(p.unplaced.size(), 1u);
  EXPECT_EQ(p.unplaced[0].rfind("a: 1 of 1", 0), 0u) << p.unplaced[0];
}

// Scale-down to WARM first: replicas beyond the new count (and the pool) stay WARM up to
// `linger`; none is started for it; and a lingering one evicted for room is not refilled.
TEST(PlacementTest, ScaledDownReplicasLingerWarmAndAreEvictedWithoutRefill) {
  std::vector<PlacementNode> on_a = {CpuNode("a", 8)};
  Apply(Place({Cpu("enc", 3, 0)}, on_a), &on_a);  // three assigned and serving
  const PlacementNode& a = on_a[0];
  PlacementDemand d = Cpu("enc", 1, 0);
  d.linger = 2;
  auto p = Place({d}, {a});
  EXPECT_EQ(Ids(p.nodes["a"]),
            (std::vector<std::string>{"enc.0:SERVING", "enc.1:WARM", "enc.2:WARM"}));
  EXPECT_TRUE(p.unplaced.empty());
  d.linger = 5;  // more than there are: nothing new for it
  EXPECT_EQ(Place({d}, {a}).nodes["a"].size(), 3u);
  d.linger = 1;
  EXPECT_EQ(Ids(Place({d}, {a}).nodes["a"]),
            (std::vector<std::string>{"enc.0:SERVING", "enc.1:WARM"}));
  // One the node only still reports (taken off it already) is never taken back.
  PlacementNode stale = CpuNode("a", 8);
  stale.reported = a.reported;
  d.linger = 2;
  EXPECT_EQ(Ids(Place({d}, {stale}).nodes["a"]), (std::vector<std::string>{"enc.0:SERVING"}));
  // Scaled up again: the lingering ones are promoted first, nothing starts.
  d.serving = 3;
  d.linger = 0;
  EXPECT_EQ(Ids(Place({d}, {a}).nodes["a"]),
            (std::vector<std::string>{"enc.0:SERVING", "enc.1:SERVING", "enc.2:SERVING"}));

  // On a full GPU a SERVING replica of another deployment evicts a lingering one, which is
  // not placed again elsewhere (the pool's WARM replicas would be).
  std::vector<PlacementNode> nodes = {GpuNode("g", {24LL << 30})};
  PlacementDemand cold = GpuOf("cold", 2, 0, 10);
  auto g = Place({cold}, nodes);
  ASSERT_EQ(All(g), (std::vector<std::string>{"g/0:cold.0:SERVING", "g/0:cold.1:SERVING"}));
  Apply(g, &nodes);
  cold.serving = 1;
  cold.linger = 1;
  g = Place({cold}, nodes);
  ASSERT_EQ(All(g), (std::vector<std::string>{"g/0:cold.0:SERVING", "g/0:cold.1:WARM"}));
  Apply(g, &nodes);
  PlacementDemand hot = GpuOf("hot", 1, 0, 10);
  g = Place({cold, hot}, nodes);
  EXPECT_EQ(g.evicted.count("cold.1"), 1u);
  EXPECT_EQ(All(g), (std::vector<std::string>{"g/0:cold.0:SERVING", "g/0:hot.0:SERVING"}));
  EXPECT_TRUE(g.unplaced.empty());
}

TEST(PlacementTest, EvictionPicksTheSpotThatEvictsFewestAndNeverHelpsWarmOrHopelessDemands) {
  // n1: two 10 GiB WARM replicas (4 free); n2: three 6 GiB ones (6 free). 14 GiB needed:
  // one eviction on n1, two on n2.
  std::vector<PlacementNode> nodes = {GpuNode("n1", {24LL << 30}), GpuNode("n2", {24LL << 30})};
  PlacementDemand a = GpuOf("a", 0, 2, 10);
  PlacementDemand b = GpuOf("b", 0, 3, 6);
  PlacementResult layout;
  auto warm = [](const std::string& id, int64_t gib) {
    v1::ReplicaSpec spec;
    spec.set_replica_id(id);
    spec.set_model("encoder");
    spec.set_version("1");
    spec.set_gpu(0);
    spec.set_cpus(2);
    spec.set_state(v1::WARM);
    spec.set_gpu_memory_bytes(gib << 30);
    return spec;
  };
  layout.nodes["n1"] = {warm("a.0", 10), warm("a.1", 10)};
  layout.nodes["n2"] = {warm("b.0", 6), warm("b.1", 6), warm("b.2", 6)};
  Apply(layout, &nodes);
  auto p = Place({a, b}, nodes);
  ASSERT_EQ(All(p), All(layout));
  ASSERT_TRUE(p.unplaced.empty());
  const std::string a_node = "n1";

  // A WARM demand never evicts; a SERVING one that no eviction can fit evicts nothing.
  auto warm_only = Place({a, b, GpuOf("w", 0, 1, 14)}, nodes);
  EXPECT_TRUE(warm_only.evicted.empty());
  auto hopeless = Place({a, b, GpuOf("huge", 1, 0, 30)}, nodes);
  EXPECT_TRUE(hopeless.evicted.empty());
  EXPECT_EQ(hopeless.unplaced.size(), 1u);

  auto q = Place({a, b, GpuOf("c", 1, 0, 14)}, nodes);
  ASSERT_EQ(q.evicted.size(), 1u);
  EXPECT_EQ(DeploymentOfReplica(q.evicted.begin()->first), "a");
  bool placed_beside_a = false;
  for (const auto& s : q.nodes[a_node]) placed_beside_a |= s.replica_id() == "c.0";
  EXPECT_TRUE(placed_beside_a);

  // A CPU replica never evicts (the agent could not hand it CPUs a draining replica holds).
  std::vector<PlacementNode> cpu_nodes = {CpuNode("c", 4)};
  PlacementResult cpu_layout;
  v1::ReplicaSpec idle_cpu = warm("idle.0", 0);
  idle_cpu.set_gpu(-1);
  idle_cpu.set_cpus(4);
  cpu_layout.nodes["c"] = {idle_cpu};
  Apply(cpu_layout, &cpu_nodes);
  auto cpu = Place({Cpu("idle", 0, 1, 4), Cpu("busy", 1, 0, 2)}, cpu_nodes);
  EXPECT_TRUE(cpu.evicted.empty());
  EXPECT_EQ(cpu.unplaced.size(), 1u);

  // A deployment's own WARM replicas are promoted, never evicted for it.
  auto own = Place({GpuOf("a", 1, 2, 10), b}, nodes);
  EXPECT_TRUE(own.evicted.empty());
}

TEST(PlacementTest, ReplicasLeaveAnUnhealthyGpuMakeBeforeBreak) {
  std::vector<PlacementNode> nodes = {GpuNode("a", {80LL << 30, 80LL << 30}),
                                      GpuNode("b", {80LL << 30})};
  PlacementDemand d = GpuDemand(2, /*surge=*/1, /*unavailable=*/0);
  auto p = Place({d}, nodes);
  ASSERT_EQ(All(p), (std::vector<std::string>{"a/0:emb.0:SERVING", "b/0:emb.1:SERVING"}));
  Apply(p, &nodes);
  // GPU 0 of node a goes bad: emb.0 keeps serving while a replacement starts beside it.
  nodes[0].gpus[0].healthy = false;
  p = Place({d}, nodes);
  EXPECT_EQ(All(p), (std::vector<std::string>{"a/0:emb.0:SERVING", "a/1:emb.2:SERVING",
                                              "b/0:emb.1:SERVING"}));
  ASSERT_EQ(p.moves.size(), 1u);
  EXPECT_NE(p.moves[0].find("emb.0 on a GPU 0 (unhealthy) serves until its replacement does"),
            std::string::npos)
      << p.moves[0];
  EXPECT_TRUE(p.unplaced.empty());
  // Assigned but not reported yet, then loading: nothing changes (and no second replacement).
  Apply(p, &nodes, {}, {"emb.2"});
  EXPECT_EQ(All(Place({d}, nodes)), All(p));
  Apply(p, &nodes, {"emb.2"});
  auto loading = Place({d}, nodes);
  EXPECT_EQ(All(loading), All(p));
  // It serves: the old replica is dropped (the agent drains it).
  Apply(p, &nodes);
  p = Place({d}, nodes);
  EXPECT_EQ(All(p), (std::vector<std::string>{"a/1:emb.2:SERVING", "b/0:emb.1:SERVING"}));
  EXPECT_TRUE(p.moves.empty());
}

TEST(PlacementTest, MaxSurgeBoundsHowManyMoveAtOnce) {
  std::vector<PlacementNode> nodes = {GpuNode("a", {80LL << 30}), GpuNode("b", {80LL << 30})};
  PlacementDemand d = GpuDemand(4, /*surge=*/1, /*unavailable=*/0);
  auto p = Place({d}, nodes);
  Apply(p, &nodes);
  nodes[0].gpus[0].healthy = false;  // two of the four replicas are on it
  p = Place({d}, nodes);
  int serving = 0;
  for (const auto& line : All(p)) serving += line.find(":SERVING") != std::string::npos;
  EXPECT_EQ(serving, 5) << ::testing::PrintToString(All(p));  // four kept + one replacement
  EXPECT_EQ(p.moves.size(), 2u);
  // The replacement serves: one old replica leaves and the next replacement starts.
  Apply(p, &nodes);
  p = Place({d}, nodes);
  serving = 0;
  int on_bad = 0;
  for (const auto& line : All(p)) {
    serving += line.find(":SERVING") != std::string::npos;
    on_bad += line.rfind("a/0:", 0) == 0;
  }
  EXPECT_EQ(serving, 5);
  EXPECT_EQ(on_bad, 1);
  Apply(p, &nodes);
  p = Place({d}, nodes);
  for (const auto& line : All(p)) EXPECT_NE(line.rfind("a/0:", 0), 0u) << line;
  EXPECT_EQ(All(p).size(), 4u);
}

TEST(PlacementTest, MaxUnavailableDropsFirstButNeverBelowItsBound) {
  std::vector<PlacementNode> nodes = {GpuNode("a", {80LL << 30}), GpuNode("b", {80LL << 30})};
  PlacementDemand d = GpuDemand(2, /*surge=*/0, /*unavailable=*/1);
  auto p = Place({d}, nodes);
  Apply(p, &nodes);
  // Both GPUs go bad: one replica may go at once, the other serves until a replacement does.
  nodes[0].gpus[0].healthy = false;
  nodes[1].gpus[0].healthy = false;
  nodes.push_back(GpuNode("c", {80LL << 30, 80LL << 30}));
  nodes.back().assigned = {};
  p = Place({d}, nodes);
  EXPECT_EQ(All(p), (std::vector<std::string>{"a/0:emb.0:SERVING", "c/0:emb.2:SERVING"}))
      << ::testing::PrintToString(All(p));
  Apply(p, &nodes, {}, {"emb.2"});
  EXPECT_EQ(All(Place({d}, nodes)), All(p));  // emb.2 not even reported: emb.0 may not go
  Apply(p, &nodes, {"emb.2"});
  auto waiting = Place({d}, nodes);  // emb.2 still loading: emb.0 may not go yet
  EXPECT_EQ(All(waiting), All(p));
  Apply(p, &nodes);
  p = Place({d}, nodes);
  // emb.0 goes now; its replacement takes the id emb.1 left free (best fit: beside emb.2).
  EXPECT_EQ(All(p), (std::vector<std::string>{"c/0:emb.1:SERVING", "c/0:emb.2:SERVING"}))
      << ::testing::PrintToString(All(p));
}

TEST(PlacementTest, AWarmReplicaIsTheFirstReplacementAndOneOnABadGpuGoesAtOnce) {
  std::vector<PlacementNode> start = {GpuNode("a", {80LL << 30}), GpuNode("b", {12LL << 30})};
  PlacementDemand d = GpuDemand(1, 1, 0);
  d.warm = 1;
  auto p = Place({d}, start);
  // Best fit puts the serving replica on b (2 GiB left), spread the warm one on a.
  ASSERT_EQ(All(p), (std::vector<std::string>{"a/0:emb.1:WARM", "b/0:emb.0:SERVING"}));
  Apply(p, &start);

  // b's GPU goes bad: the WARM replica is promoted as the replacement (no cold start), the
  // pool is refilled, and emb.0 serves until emb.1 does.
  std::vector<PlacementNode> nodes = start;
  nodes[1].gpus[0].healthy = false;
  auto moved = Place({d}, nodes);
  EXPECT_EQ(All(moved), (std::vector<std::string>{"a/0:emb.1:SERVING", "a/0:emb.2:WARM",
                                                  "b/0:emb.0:SERVING"}));
  Apply(moved, &nodes);
  EXPECT_EQ(All(Place({d}, nodes)),
            (std::vector<std::string>{"a/0:emb.1:SERVING", "a/0:emb.2:WARM"}));

  // a's GPU goes bad instead: the WARM replica there is dropped at once, and with no other GPU
  // room for the pool the shortfall is reported.
  nodes = start;
  nodes[0].gpus[0].healthy = false;
  auto dropped = Place({d}, nodes);
  EXPECT_EQ(All(dropped), (std::vector<std::string>{"b/0:emb.0:SERVING"}));
  ASSERT_EQ(dropped.unplaced.size(), 1u);
  EXPECT_NE(dropped.unplaced[0].find("emb: 1 of 2 replicas have no node with room"),
            std::string::npos)
      << dropped.unplaced[0];
  EXPECT_TRUE(dropped.moves.empty());
}

TEST(PlacementTest, ASkewedDeploymentIsEvenedOutOneMakeBeforeBreakMoveAtATime) {
  // Three replicas on a (it was the only node when they were placed), then b and c join.
  std::vector<PlacementNode> nodes = {CpuNode("a", 8)};
  PlacementDemand d = Cpu("enc", 3, 0);
  Apply(Place({d}, nodes), &nodes);
  nodes.push_back(CpuNode("b", 8));
  nodes.push_back(CpuNode("c", 8));
  for (auto& n : nodes) n.zone = "z1";
  auto p = Place({d}, nodes);
  EXPECT_EQ(All(p), (std::vector<std::string>{"a/-1:enc.0:SERVING", "a/-1:enc.1:SERVING",
                                               "a/-1:enc.2:SERVING"}));
  // Placement only names a candidate (the highest id on the fullest node).
  ASSERT_EQ(p.skewed.size(), 1u);
  EXPECT_EQ(p.skewed.begin()->first, "enc.2");
  EXPECT_EQ(p.skewed.begin()->second, "spread: a runs 3 of enc, b 0");
  // The caller moves it: it serves until its replacement on b does.
  std::map<std::string, std::string> moves = {{"enc.2", "spread"}};
  auto moving = Place({d}, nodes, {}, moves);
  EXPECT_EQ(All(moving), (std::vector<std::string>{"a/-1:enc.0:SERVING", "a/-1:enc.1:SERVING",
                                                    "a/-1:enc.2:SERVING", "b/-1:enc.3:SERVING"}));
  ASSERT_EQ(moving.moves.size(), 1u);
  EXPECT_EQ(moving.moves[0], "enc: enc.2 on a (spread) serves until its replacement does");
  EXPECT_TRUE(moving.skewed.empty());  // one move at a time
  // While the replacement loads the skew is gone (2 vs 1), yet nothing is undone.
  Apply(moving, &nodes, /*loading=*/{"enc.3"});
  EXPECT_EQ(All(Place({d}, nodes, {}, moves)), All(moving));
  // Once it serves the old one goes; then a still runs 2 against c's 0: the next candidate.
  Apply(moving, &nodes);
  auto done = Place({d}, nodes, {}, moves);
  EXPECT_EQ(All(done), (std::vector<std::string>{"a/-1:enc.0:SERVING", "a/-1:enc.1:SERVING",
                                                  "b/-1:enc.3:SERVING"}));
  // Until a's agent reports again it still lists enc.2: that does not win its slot back from
  // the replacement, with the move still named or not.
  std::vector<PlacementNode> stale = nodes;
  for (auto& n : stale) n.assigned = Keep(done.nodes.at(n.name));
  EXPECT_EQ(All(Place({d}, stale, {}, moves)), All(done));
  EXPECT_EQ(All(Place({d}, stale)), All(done));
  Apply(done, &nodes);
  auto next = Place({d}, nodes);
  ASSERT_EQ(next.skewed.size(), 1u);
  EXPECT_EQ(next.skewed.begin()->second, "spread: a runs 2 of enc, c 0");
  Apply(Place({d}, nodes, {}, {{next.skewed.begin()->first, "spread"}}), &nodes);
  auto even = Place({d}, nodes, {}, {{next.skewed.begin()->first, "spread"}});
  Apply(even, &nodes);
  auto settled = Place({d}, nodes);
  EXPECT_EQ(All(settled), (std::vector<std::string>{"a/-1:enc.0:SERVING", "b/-1:enc.3:SERVING",
                                                     "c/-1:enc.2:SERVING"}));  // ids are reused once free
  EXPECT_TRUE(settled.skewed.empty());  // 1, 1, 1: nothing to even out
}

TEST(PlacementTest, AnOverloadedGpuTakesNewReplicasLastAndOneReplicaAtATimeMovesOff) {
  std::vector<PlacementNode> nodes = {GpuNode("a", {40LL << 30, 40LL << 30})};
  PlacementDemand d = GpuOf("emb", 2, 0, 10);
  Apply(Place({d}, nodes), &nodes);
  EXPECT_EQ(All(Place({d}, nodes)),
            (std::vector<std::string>{"a/0:emb.0:SERVING", "a/0:emb.1:SERVING"}));  // best fit
  nodes[0].gpus[0].overloaded = "busy: 98% utilised, 7 requests queued";
  auto p = Place({d}, nodes);
  EXPECT_EQ(All(p), (std::vector<std::string>{"a/0:emb.0:SERVING", "a/0:emb.1:SERVING"}));
  ASSERT_EQ(p.skewed.size(), 1u);
  EXPECT_EQ(p.skewed.begin()->first, "emb.1");
  EXPECT_EQ(p.skewed.begin()->second,
            "overloaded: a GPU 0 (busy: 98% utilised, 7 requests queued); room on a GPU 1");
  // The caller moves it make-before-break, as skew; nothing else is named meanwhile.
  std::map<std::string, std::string> moves = {{"emb.1", "overloaded"}};
  auto moving = Place({d}, nodes, {}, moves);
  EXPECT_EQ(All(moving), (std::vector<std::string>{"a/0:emb.0:SERVING", "a/0:emb.1:SERVING",
                                                    "a/1:emb.2:SERVING"}));
  EXPECT_TRUE(moving.skewed.empty());
  // A move's replacement never goes to an overloaded GPU: with GPU 1 overloaded too, it waits.
  std::vector<PlacementNode> both_hot = nodes;
  both_hot[0].gpus[1].overloaded = "busy";
  EXPECT_EQ(All(Place({d}, both_hot, {}, moves)),
            (std::vector<std::string>{"a/0:emb.0:SERVING", "a/0:emb.1:SERVING"}));
  Apply(moving, &nodes);
  auto moved = Place({d}, nodes, {}, moves);
  EXPECT_EQ(All(moved), (std::vector<std::string>{"a/0:emb.0:SERVING", "a/1:emb.2:SERVING"}));
  Apply(moved, &nodes);
  // GPU 0 still overloaded, but emb.0 is its only replica now: moving it cannot ease it (the
  // load would go along), so nothing more moves.
  EXPECT_TRUE(Place({d}, nodes).skewed.empty());
  // A new replica goes to GPU 1 although GPU 0 ties on fit (30 GiB left on each).
  d.serving = 3;
  EXPECT_EQ(All(Place({d}, nodes)), (std::vector<std::string>{"a/0:emb.0:SERVING",
                                                              "a/1:emb.1:SERVING",
                                                              "a/1:emb.2:SERVING"}));
  nodes[0].gpus[0].overloaded.clear();
  EXPECT_EQ(All(Place({d}, nodes))[1], "a/0:emb.1:SERVING");
}

TEST(PlacementTest, AnOverloadedGpuIsALastResortAndNamesOneMovePerGpu) {
  // Only overloaded GPUs have room: a new replica still gets one; nothing can move.
  std::vector<PlacementNode> nodes = {GpuNode("a", {24LL << 30})};
  nodes[0].gpus[0].overloaded = "throttled: hw_thermal";
  PlacementDemand d = GpuOf("emb", 1, 0, 10);
  auto p = Place({d}, nodes);
  EXPECT_EQ(All(p), std::vector<std::string>{"a/0:emb.0:SERVING"});
  EXPECT_TRUE(p.unplaced.empty());
  Apply(p, &nodes);
  EXPECT_TRUE(Place({d}, nodes).skewed.empty());
  // Two deployments on one overloaded GPU, room elsewhere: one move named per GPU per call.
  // (A GPU with one SERVING replica names none: see the test above.)
  PlacementDemand e = GpuOf("enc", 1, 0, 10);
  nodes[0].gpus[0].overloaded.clear();
  Apply(Place({d, e}, nodes), &nodes);
  nodes[0].gpus[0].overloaded = "throttled: hw_thermal";
  nodes.push_back(GpuNode("b", {80LL << 30}));
  p = Place({d, e}, nodes);
  ASSERT_EQ(p.skewed.size(), 1u);
  EXPECT_EQ(p.skewed.begin()->first, "emb.0");
  // While that move runs, the GPU names nothing more.
  p = Place({d, e}, nodes, {}, {{"emb.0", "overloaded"}});
  EXPECT_TRUE(p.skewed.empty());
  // A CPU demand is never moved for it; a WARM-only replica is not either.
  PlacementDemand c = Cpu("cpu", 1, 0);
  std::vector<PlacementNode> cpu_nodes = {GpuNode("c", {24LL << 30}, 4), CpuNode("d", 4)};
  Apply(Place({c}, cpu_nodes), &cpu_nodes);
  cpu_nodes[0].gpus[0].overloaded = "busy";
  EXPECT_TRUE(Place({c}, cpu_nodes).skewed.empty());
}

TEST(PlacementTest, AVoluntaryMoveNeverLeavesASlotEmpty) {
  std::vector<PlacementNode> nodes = {CpuNode("a", 8, "z1")};
  PlacementDemand d = Cpu("enc", 2, 0);
  d.max_unavailable = 1;  // allowed for forced moves, not for these
  Apply(Place({d}, nodes), &nodes);
  nodes.push_back(CpuNode("b", 8, "z1"));
  std::map<std::string, std::string> moves = {{"enc.1", "spread"}};
  EXPECT_EQ(All(Place({d}, nodes, {}, moves)),
            (std::vector<std::string>{"a/-1:enc.0:SERVING", "a/-1:enc.1:SERVING",
                                      "b/-1:enc.2:SERVING"}));
  // The moving replica briefly fails its probe: it stays, and nothing is started for it.
  std::vector<v1::ReplicaStatus> reported;
  for (const auto* r : nodes[0].reported) reported.push_back(*r);
  reported[1].set_healthy(false);
  nodes[0].reported = Keep(reported);
  EXPECT_EQ(All(Place({d}, nodes, {}, moves)),
            (std::vector<std::string>{"a/-1:enc.0:SERVING", "a/-1:enc.1:SERVING"}));
}

TEST(PlacementTest, NoSkewMoveWithoutRoomOrSurge) {
  std::vector<PlacementNode> nodes = {CpuNode("a", 8, "z1")};
  PlacementDemand d = Cpu("enc", 3, 0);
  Apply(Place({d}, nodes), &nodes);
  // b has no room for one more; c, in another zone, has none either.
  nodes.push_back(CpuNode("b", 0, "z1"));
  nodes.push_back(CpuNode("c", 0, "z2"));
  EXPECT_TRUE(Place({d}, nodes).skewed.empty());
  nodes[1].cpu_capacity = 8;
  EXPECT_EQ(Place({d}, nodes).skewed.size(), 1u);
  d.max_surge = 0;  // no room to move make-before-break
  EXPECT_TRUE(Place({d}, nodes).skewed.empty());
  // Nodes without zone labels are one zone for this.
  d.max_surge = 1;
  for (auto& n : nodes) n.zone.clear();
  nodes[1].cpu_capacity = 0;
  nodes[2].cpu_capacity = 8;
  auto p = Place({d}, nodes);
  ASSERT_EQ(p.skewed.size(), 1u);
  EXPECT_EQ(p.skewed.begin()->second, "spread: a runs 3 of enc, c 0");
}

TEST(PlacementTest, ZonesAreEvenedOutToo) {
  // Three replicas in z1 (z2's node joined later); each on its own node, so no node is skewed.
  std::vector<PlacementNode> nodes = {CpuNode("a", 8, "z1"), CpuNode("b", 8, "z1"),
                                      CpuNode("x", 8, "z1")};
  PlacementDemand d = Cpu("enc", 3, 0);
  Apply(Place({d}, nodes), &nodes);
  nodes.push_back(CpuNode("c", 8, "z2"));
  auto p = Place({d}, nodes);
  ASSERT_EQ(p.skewed.size(), 1u);
  // The highest id in the fullest zone.
  EXPECT_EQ(p.skewed.begin()->first, "enc.2");
  EXPECT_EQ(p.skewed.begin()->second, "zones: z1 runs 3 of enc, z2 0 (room on c)");
  // Moved make-before-break: the replacement goes to z2, then the old one goes.
  std::map<std::string, std::string> moves = {{"enc.2", "zones"}};
  auto moving = Place({d}, nodes, {}, moves);
  Apply(moving, &nodes);
  auto done = Place({d}, nodes, {}, moves);
  Apply(done, &nodes);
  auto settled = Place({d}, nodes);
  EXPECT_EQ(All(settled), (std::vector<std::string>{"a/-1:enc.0:SERVING", "b/-1:enc.1:SERVING",
                                                     "c/-1:enc.3:SERVING"}))
      << ::testing::PrintToString(All(settled));
  EXPECT_TRUE(settled.skewed.empty());  // 2 against 1: even enough
}

TEST(PlacementTest, NoZoneMoveWithoutAFreeNodeThereOrWithoutLabels) {
  std::vector<PlacementNode> nodes = {CpuNode("a", 8, "z1"), CpuNode("b", 8, "z1"),
                                      CpuNode("x", 8, "z1")};
  PlacementDemand d = Cpu("enc", 4, 0);
  Apply(Place({d}, nodes), &nodes);  // a 2, b 1, x 1
  // z2's only node already runs one: a replacement would land in z1 again (on a node free of
  // the deployment), so the move would swing back and forth. Not named.
  PlacementNode c = CpuNode("c", 8, "z2");
  v1::ReplicaStatus there = Reported("enc.9", v1::SERVING);
  c.reported = Keep<v1::ReplicaStatus>({there});
  nodes.push_back(c);
  d.serving = 5;
  auto p = Place({d}, nodes);
  EXPECT_TRUE(p.skewed.empty()) << p.skewed.begin()->second;
  // With a node free of it in z2, the zone move is named.
  nodes.push_back(CpuNode("d", 8, "z2"));
  p = Place({d}, nodes);
  ASSERT_EQ(p.skewed.size(), 1u);
  EXPECT_EQ(p.skewed.begin()->second.rfind("zones: z1 runs 4 of enc, z2 1", 0), 0u)
      << p.skewed.begin()->second;
  // Nodes without labels are no zones to even out.
  std::vector<PlacementNode> plain = {CpuNode("a", 8), CpuNode("b", 8)};
  Apply(Place({Cpu("enc", 2, 0)}, plain), &plain);
  plain.push_back(CpuNode("c", 8));
  EXPECT_TRUE(Place({Cpu("enc", 2, 0)}, plain).skewed.empty());
}

TEST(PlacementTest, ACrashLoopingReplicasReplacementGoesToAnotherNode) {
  PlacementNode a = CpuNode("a", 8);
  a.reported = Keep<v1::ReplicaStatus>({Reported("enc.1", v1::SERVING, "1", /*crash_loop=*/true)});
  PlacementNode c = CpuNode("c", 8);
  c.reported = Keep<v1::ReplicaStatus>({Reported("enc.0", v1::SERVING)});
  // a and b are both free of enc; a would win (best fit), but enc.1 crash-loops there.
  auto p = Place({Cpu("enc", 2, 0)}, {a, CpuNode("b", 16), c});
  EXPECT_EQ(All(p), (std::vector<std::string>{"b/-1:enc.2:SERVING", "c/-1:enc.0:SERVING"}))
      << ::testing::PrintToString(All(p));
  // The caller's memory does the same once the crashed replica is gone from the reports.
  PlacementNode remembered = CpuNode("a", 8);
  remembered.crashed = {"enc"};
  p = Place({Cpu("enc", 2, 0)}, {remembered, CpuNode("b", 16), c});
  EXPECT_EQ(All(p), (std::vector<std::string>{"b/-1:enc.1:SERVING", "c/-1:enc.0:SERVING"}))
      << ::testing::PrintToString(All(p));
  // Nor is it where a skew move goes: c runs 3, a (remembered) 0 and full otherwise.
  PlacementNode piled = CpuNode("c", 8);
  piled.reported = Keep<v1::ReplicaStatus>({Reported("enc.0", v1::SERVING),
                                            Reported("enc.1", v1::SERVING),
                                            Reported("enc.2", v1::SERVING)});
  EXPECT_TRUE(Place({Cpu("enc", 3, 0)}, {remembered, piled}).skewed.empty());
  EXPECT_EQ(Place({Cpu("enc", 3, 0)}, {CpuNode("a", 8), piled}).skewed.size(), 1u);
  a.reported = Keep<v1::ReplicaStatus>(
      {Reported("enc.0", v1::SERVING), Reported("enc.1", v1::SERVING, "1", /*crash_loop=*/true)});
  // The same for a FAILED one, and for new replicas of another version.
  PlacementNode failed = CpuNode("a", 8);
  failed.reported = Keep<v1::ReplicaStatus>({Reported("enc.0", v1::FAILED, "0")});
  p = Place({Cpu("enc", 1, 0)}, {failed, CpuNode("b", 16)});
  EXPECT_EQ(All(p), (std::vector<std::string>{"b/-1:enc.1:SERVING"}));
  // With no other node with room it goes back where it was (better than not serving).
  p = Place({Cpu("enc", 2, 0)}, {a, CpuNode("b", 0)});
  EXPECT_EQ(All(p), (std::vector<std::string>{"a/-1:enc.0:SERVING", "a/-1:enc.2:SERVING"}));
  // Other deployments are not kept off the node.
  p = Place({Cpu("enc", 2, 0), Cpu("other", 1, 0)}, {a, CpuNode("b", 16)});
  EXPECT_EQ(p.nodes["a"].size(), 2u) << ::testing::PrintToString(All(p));
}

TEST(PlacementTest, ACrashLoopingGpuReplicaEvictsElsewhereFirst) {
  // Two nodes, each GPU full of another deployment's WARM replicas; emb crash-loops on a.
  std::vector<PlacementNode> nodes = {GpuNode("a", {20LL << 30}), GpuNode("b", {20LL << 30})};
  Apply(Place({GpuOf("pool", 0, 8, 5)}, nodes), &nodes);
  std::vector<v1::ReplicaStatus> reported;
  for (const auto* r : nodes[0].reported) reported.push_back(*r);
  v1::ReplicaStatus crashing = Reported("emb.0", v1::SERVING, "1", /*crash_loop=*/true);
  crashing.set_device("cuda:0");
  reported.push_back(crashing);
  nodes[0].reported = Keep(reported);
  auto p = Place({GpuOf("pool", 0, 8, 5), GpuOf("emb", 1, 0, 10)}, nodes);
  bool on_b = false;
  for (const auto& line : All(p)) on_b |= line.find("b/0:emb.") == 0;
  EXPECT_TRUE(on_b) << ::testing::PrintToString(All(p));
  ASSERT_FALSE(p.evicted.empty());
  for (const auto& [id, why] : p.evicted) EXPECT_NE(why.find(" on b "), std::string::npos) << why;
}

TEST(PlacementTest, MaxSurgeIsTheDeploymentsAcrossItsVersions) {
  // A canary in progress: two stable and two canary replicas serve on a's GPU, which goes bad.
  std::vector<PlacementNode> nodes = {GpuNode("a", {80LL << 30}), GpuNode("b", {80LL << 30}, 2)};
  PlacementDemand stable = GpuDemand(2, /*surge=*/1, /*unavailable=*/0);
  PlacementDemand canary = stable;
  canary.version = "2";
  nodes[1].cpu_capacity = 0;  // everything lands on a
  Apply(Place({stable, canary}, nodes), &nodes);
  ASSERT_EQ(All(Place({stable, canary}, nodes)).size(), 4u);
  nodes[1].cpu_capacity = 32;
  nodes[0].gpus[0].healthy = false;
  auto p = Place({stable, canary}, nodes);
  // One replacement for the whole deployment (the stable version's first), not one per
  // version.
  int serving = 0;
  for (const auto& line : All(p)) serving += line.find(":SERVING") != std::string::npos;
  EXPECT_EQ(serving, 5) << ::testing::PrintToString(All(p));
  EXPECT_EQ(p.nodes["b"].size(), 1u);
  EXPECT_EQ(p.nodes["b"][0].version(), "1");
  // maxUnavailable too: with 1, one replica of the deployment may go before its replacement
  // serves, not one per version.
  stable.max_surge = canary.max_surge = 0;
  stable.max_unavailable = canary.max_unavailable = 1;
  p = Place({stable, canary}, nodes);
  // The stable version drops one and starts one; both canary replicas serve on until then.
  EXPECT_EQ(All(p).size(), 4u) << ::testing::PrintToString(All(p));
  EXPECT_EQ(p.nodes["b"].size(), 1u) << ::testing::PrintToString(All(p));
}

// One node with one GPU of `gib` GiB, `serving` replicas of GpuDemand placed and applied, then
// its GPU gone bad.
std::vector<PlacementNode> OneBadGpu(int64_t gib, int64_t serving) {
  std::vector<PlacementNode> nodes = {GpuNode("a", {gib << 30})};
  Apply(Place({GpuDemand(serving, 1, 0)}, nodes), &nodes);
  nodes[0].gpus[0].healthy = false;
  return nodes;
}

TEST(PlacementTest, AShortfallIsReportedEvenWhileReplicasMove) {
  // Three wanted; two serve on a GPU gone bad, the third is gone; no room anywhere else.
  std::vector<PlacementNode> nodes = OneBadGpu(24, 2);
  PlacementDemand d = GpuDemand(3, 1, 0);
  auto p = Place({d}, nodes);
  EXPECT_EQ(All(p).size(), 2u);  // both keep serving
  ASSERT_EQ(p.unplaced.size(), 1u) << ::testing::PrintToString(p.moves);
  EXPECT_NE(p.unplaced[0].find("emb: 1 of 3 replicas have no node with room"), std::string::npos)
      << p.unplaced[0];
}

TEST(PlacementTest, AMoveWithNoRoomForItsReplacementKeepsServing) {
  std::vector<PlacementNode> nodes = OneBadGpu(12, 1);
  auto p = Place({GpuDemand(1, 1, 0)}, nodes);
  EXPECT_EQ(All(p), (std::vector<std::string>{"a/0:emb.0:SERVING"}));
  EXPECT_EQ(p.moves.size(), 1u);
  EXPECT_TRUE(p.unplaced.empty());  // the wanted count is met; only the move waits
}

TEST(PlacementTest, AReplicaWhoseShapeChangedIsReplacedNotReshaped) {
  PlacementNode a = CpuNode("a", 8);
  v1::ReplicaStatus r = Reported("enc.0", v1::SERVING);
  r.set_cpus("4-5");  // two CPUs, the spec now wants one
  a.reported = Keep<v1::ReplicaStatus>({r});
  auto p = Place({Cpu("enc", 1, 0)}, {a});
  EXPECT_EQ(Ids(p.nodes["a"]), (std::vector<std::string>{"enc.1:SERVING"}));
  r.set_cpus("4-5,9");
  a.reported = Keep<v1::ReplicaStatus>({r});
  auto three = Place({Cpu("enc", 1, 0, 3)}, {a});
  EXPECT_EQ(Ids(three.nodes["a"]), (std::vector<std::string>{"enc.0:SERVING"}));
}

TEST(PlacementTest, ANotReadyNodeKeepsItsReplicasButTakesNoNewOnes) {
  PlacementNode a = CpuNode("a", 8);
  a.reported = Keep<v1::ReplicaStatus>({Reported("enc.0", v1::SERVING)});
  a.schedulable = false;
  auto p = Place({Cpu("enc", 3, 0)}, {a, CpuNode("b", 8)});
  EXPECT_EQ(Ids(p.nodes["a"]), (std::vector<std::string>{"enc.0:SERVING"}));
  EXPECT_EQ(Ids(p.nodes["b"]), (std::vector<std::string>{"enc.1:SERVING", "enc.2:SERVING"}));
  // Once it is Lost (left out), its replica is placed again on the others.
  // Its id is not reused: the lost node may come back with it.
  auto lost = Place({Cpu("enc", 3, 0)}, {CpuNode("b", 8)}, {"enc.0"});
  EXPECT_EQ(Ids(lost.nodes["b"]),
            (std::vector<std::string>{"enc.1:SERVING", "enc.2:SERVING", "enc.3:SERVING"}));
}

TEST(PlacementTest, TwoVersionsOfADeploymentDuringARollout) {
  PlacementNode a = CpuNode("a", 8);
  a.reported = Keep<v1::ReplicaStatus>({Reported("enc.0", v1::SERVING), Reported("enc.1", v1::SERVING)});
  PlacementDemand canary = Cpu("enc", 1, 0);
  canary.version = "2";
  auto p = Place({Cpu("enc", 2, 0), canary}, {a});
  EXPECT_EQ(Ids(p.nodes["a"]),
            (std::vector<std::string>{"enc.0:SERVING", "enc.1:SERVING", "enc.2:SERVING"}));
  EXPECT_EQ(p.nodes["a"][2].version(), "2");
  // Promoted: version 2 at full count, version 1 drained; the canary replica stays.
  a.reported.push_back(Keep<v1::ReplicaStatus>({Reported("enc.2", v1::SERVING, "2")})[0]);
  PlacementDemand promoted = Cpu("enc", 2, 0);
  promoted.version = "2";
  auto q = Place({promoted}, {a});
  EXPECT_EQ(Ids(q.nodes["a"]), (std::vector<std::string>{"enc.2:SERVING", "enc.3:SERVING"}));
}

TEST(PlacementTest, ReplicaIdsNameTheirDeployment) {
  EXPECT_EQ(DeploymentOfReplica("encoder.12"), "encoder");
  EXPECT_EQ(DeploymentOfReplica("legacy"), "");
  EXPECT_EQ(DeploymentOfReplica(".3"), "");
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// Random clusters: whatever the input, no CPU or GPU is over-committed, every replica that is
// not reported unplaced is placed exactly once, a deployment never stacks a second replica on
// a node while another node of the same zone with room has none of it, and the same input
// gives the same output.
TEST(PlacementPropertyTest, RandomClustersKeepTheRules) {
  std::mt19937 rng(20261122);
  for (int round = 0; round < 60; ++round) {
    std::vector<PlacementNode> nodes;
    int n = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) {
      PlacementNode node = CpuNode("n" + std::to_string(i), 2 + static_cast<int>(rng() % 8),
                                   "z" + std::to_string(rng() % 3));
      int gpus = static_cast<int>(rng() % 3);
      for (int g = 0; g < gpus; ++g) node.gpus.push_back({g, (8 + static_cast<int64_t>(rng() % 24)) << 30, true});
      node.load = static_cast<double>(rng() % 5);
      nodes.push_back(node);
    }
    std::vector<PlacementDemand> demands;
    int deps = 1 + static_cast<int>(rng() % 5);
    for (int k = 0; k < deps; ++k) {
      PlacementDemand d = Cpu("d" + std::to_string(k), rng() % 5, rng() % 2, 1 + rng() % 3);
      if (rng() % 2) {
        d.gpus = 1;
        d.gpu_memory_bytes = (2 + static_cast<int64_t>(rng() % 10)) << 30;
      }
      demands.push_back(d);
    }
    auto p = Place(demands, nodes);
    auto again = Place(demands, nodes);
    std::map<std::string, int> placed;
    std::map<std::string, std::map<std::string, int>> per_node;  // dep -> node -> count
    for (const auto& node : nodes) {
      int cpus = 0;
      std::map<int, int64_t> gpu;
      const auto& specs = p.nodes[node.name];
      EXPECT_EQ(Ids(specs), Ids(again.nodes[node.name])) << "not deterministic";
      for (const auto& s : specs) {
        cpus += s.cpus();
        if (s.gpu() >= 0) gpu[s.gpu()] += s.gpu_memory_bytes();
        placed[DeploymentOfReplica(s.replica_id())]++;
        per_node[DeploymentOfReplica(s.replica_id())][node.name]++;
      }
      EXPECT_LE(cpus, node.cpu_capacity) << node.name;
      for (const auto& g : node.gpus) EXPECT_LE(gpu[g.index], g.memory_bytes) << node.name;
    }
    for (const auto& d : demands) {
      bool short_of_room = false;
      for (const auto& line : p.unplaced) short_of_room |= line.rfind(d.deployment + ":", 0) == 0;
      if (!short_of_room) {
        EXPECT_EQ(placed[d.deployment], d.serving + d.warm) << d.deployment;
      }
      if (d.gpus == 0) {
        // Spread: a node holding 2+ replicas of d means every schedulable node of its zone
        // with room for one more had one already (CPU replicas, where room is just CPUs).
        for (const auto& [node_name, count] : per_node[d.deployment]) {
          if (count < 2) continue;
          const PlacementNode* stacked = nullptr;
          for (const auto& nd : nodes) if (nd.name == node_name) stacked = &nd;
          for (const auto& other : nodes) {
            if (other.zone != stacked->zone || other.name == node_name) continue;
            int used = 0;
            for (const auto& s : p.nodes[other.name]) used += s.cpus();
            if (per_node[d.deployment][other.name] == 0) {
              EXPECT_LT(other.cpu_capacity - used, d.cpus)
                  << d.deployment << " stacked on " << node_name << " while " << other.name
                  << " had room and none";
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kiln
