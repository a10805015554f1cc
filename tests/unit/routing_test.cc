#include "controller/routing.h"

#include <set>

#include "gtest/gtest.h"

namespace kiln {
namespace {

RouteInput Route(int nodes, const std::string& version = "1") {
  RouteInput in;
  in.head.set_model("enc");
  auto* v = in.head.add_versions();
  v->set_version(version);
  v->set_weight(100);
  for (int i = 0; i < nodes; ++i) {
    std::string n = "node-" + std::to_string(i);
    in.serving.push_back({n, version, n + ":8001", n + ":8000"});
  }
  return in;
}

std::set<std::string> Nodes(const v1::Route& r) {
  std::set<std::string> out;
  for (const auto& e : r.endpoints()) out.insert(e.node_name());
  return out;
}

TEST(RoutingTest, GroupsComeFromTheNodeNameAlone) {
  std::set<int> seen;
  for (int i = 0; i < 2000; ++i) {
    int g = RoutingGroupOf("node-" + std::to_string(i), 64);
    ASSERT_GE(g, 0);
    ASSERT_LT(g, 64);
    EXPECT_EQ(g, RoutingGroupOf("node-" + std::to_string(i), 64));
    seen.insert(g);
  }
  EXPECT_EQ(seen.size(), 64u);  // 2,000 names reach every group
  EXPECT_EQ(RoutingGroupOf("anything", 1), 0);
}

TEST(RoutingTest, FewServingNodesAreAllListedEverywhere) {
  auto groups = GroupRoutes(Route(5), {4, 8});
  ASSERT_EQ(groups.size(), 4u);
  for (const auto& r : groups) {
    EXPECT_EQ(r.model(), "enc");
    ASSERT_EQ(r.endpoints_size(), 5);
    EXPECT_EQ(r.endpoints(0).replica_id(), "node-0/1");
    EXPECT_EQ(r.endpoints(0).grpc_address(), "node-0:8001");
    EXPECT_EQ(r.endpoints(0).http_address(), "node-0:8000");
    EXPECT_EQ(r.versions(0).weight(), 100);
  }
}

TEST(RoutingTest, ManyServingNodesAreSpreadOverTheGroupsAndStayPut) {
  RoutingOptions o{64, 8};
  auto groups = GroupRoutes(Route(200), o);
  std::set<std::string> covered;
  std::set<std::set<std::string>> distinct;
  for (const auto& r : groups) {
    ASSERT_EQ(r.endpoints_size(), 8);
    auto nodes = Nodes(r);
    covered.insert(nodes.begin(), nodes.end());
    distinct.insert(nodes);
  }
  EXPECT_GT(distinct.size(), 60u);   // each group its own choice
  EXPECT_GT(covered.size(), 150u);   // and together nearly every node gets traffic
  // A node that leaves changes only the groups that had chosen it.
  RouteInput less = Route(200);
  less.serving.erase(less.serving.begin() + 17);  // node-17
  auto after = GroupRoutes(less, o);
  int changed = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    bool had = Nodes(groups[g]).count("node-17") > 0;
    if (had) {
      changed++;
      EXPECT_EQ(Nodes(after[g]).count("node-17"), 0u);
      EXPECT_EQ(after[g].endpoints_size(), 8);
    } else {
      EXPECT_EQ(Nodes(after[g]), Nodes(groups[g])) << "group " << g;
    }
  }
  EXPECT_LT(changed, 10);
}

TEST(RoutingTest, EachVersionGetsItsOwnChoice) {
  RouteInput in = Route(20, "1");
  RouteInput canary = Route(3, "2");
  in.serving.insert(in.serving.end(), canary.serving.begin(), canary.serving.end());
  for (const auto& r : GroupRoutes(in, {8, 4})) {
    int v1 = 0, v2 = 0;
    for (const auto& e : r.endpoints()) (e.version() == "1" ? v1 : v2)++;
    EXPECT_EQ(v1, 4);
    EXPECT_EQ(v2, 3);  // all three canary nodes, in every group
  }
}

}  // namespace
}  // namespace kiln
