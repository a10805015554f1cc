#include "agent/assignment_file.h"

#include "gtest/gtest.h"

namespace kiln {
namespace {

const char* kGood = R"(replicas:
  - {id: enc-a, model: encoder, version: "2", repository: /models, gpu: 0, cpus: 2, state: SERVING}
  - {model: encoder, version: "2", repository: /models, cpus: 1, state: WARM, gpuMemory: 2Gi}
warmPools:
  - {model: encoder, version: "3", repository: /models, size: 2, cpus: 1}
routes:
  - model: encoder
    versions: [{version: "2", weight: 90}, {version: "3", weight: 10}]
    stickyKey: header:x-user-id
    endpoints: [{node: b, version: "2", grpc: "10.0.0.2:8001"}, {node: c, version: "3", grpc: "[fd00::3]:8001", http: "[fd00::3]:8000"}]
)";

TEST(AssignmentFileTest, ParsesReplicasPoolsAndRoutes) {
  auto f = ParseAssignmentFile(kGood, "a.yaml");
  ASSERT_TRUE(f.ok()) << f.status();
  const auto& a = f->assignment;
  ASSERT_EQ(a.replicas_size(), 2);
  EXPECT_EQ(a.replicas(0).replica_id(), "enc-a");
  EXPECT_EQ(a.replicas(0).gpu(), 0);
  EXPECT_EQ(a.replicas(1).replica_id(), "encoder-2-1");
  EXPECT_EQ(a.replicas(1).gpu(), -1);
  EXPECT_EQ(a.replicas(1).state(), v1::WARM);
  EXPECT_EQ(a.replicas(1).gpu_memory_bytes(), 2LL << 30);
  // A warm pool is a pool, not replicas: the agent names and keeps its members.
  ASSERT_EQ(f->pools.size(), 1u);
  EXPECT_EQ(f->pools[0].size, 2);
  EXPECT_EQ(f->pools[0].spec.version(), "3");
  EXPECT_EQ(f->pools[0].spec.state(), v1::WARM);
  EXPECT_EQ(f->pools[0].spec.replica_id(), "");
  const std::string prefix = PoolIdPrefix(f->pools[0].spec);
  EXPECT_EQ(prefix.rfind("pool-encoder-", 0), 0u) << prefix;
  EXPECT_TRUE(IsPoolMemberId(prefix + "0"));
  EXPECT_FALSE(IsPoolMemberId("enc-a"));
  // Shapes: the same replica with another state is the same shape; another version is not.
  v1::ReplicaSpec warm = a.replicas(0);
  warm.set_state(v1::WARM);
  warm.set_replica_id("x");
  EXPECT_EQ(ReplicaShape(warm), ReplicaShape(a.replicas(0)));
  warm.set_version("3");
  EXPECT_NE(ReplicaShape(warm), ReplicaShape(a.replicas(0)));
  EXPECT_NE(PoolIdPrefix(warm), PoolIdPrefix(a.replicas(0)));
  const auto& r = f->routing.routes(0);
  EXPECT_EQ(r.versions(1).weight(), 10);
  EXPECT_EQ(r.sticky_key(), "header:x-user-id");
  EXPECT_EQ(r.endpoints(0).grpc_address(), "10.0.0.2:8001");
}

TEST(AssignmentFileTest, EmptyFileRunsNothing) {
  auto f = ParseAssignmentFile("", "a.yaml");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->assignment.replicas_size(), 0);
}

TEST(AssignmentFileTest, BadFieldsAreNamed) {
  struct Case {
    std::string yaml;
    std::string expect;
  };
  std::vector<Case> cases = {
      {"replicas: [{model: e, version: '1', repository: /m, state: HOT}]", "replicas[0].state"},
      {"replicas: [{model: e, version: v1, repository: /m}]", "replicas[0].version"},
      {"replicas: [{model: e, version: '1', repository: m}]", "replicas[0].repository"},
      {"replicas: [{model: 'a/b', version: '1', repository: /m}]", "replicas[0].model"},
      {"replicas: [{version: '1', repository: /m}]", "replicas[0].model: required"},
      {"replicas: [{model: e, version: '1', repository: /m, cpus: 0}]", "replicas[0].cpus"},
      {"replicas: [{model: e, version: '1', repository: /m, gpu: -2}]", "replicas[0].gpu"},
      {"replicas: [{model: e, version: '1', repository: /m, colour: red}]", "replicas[0].colour: unknown field"},
      {"replicas: [{id: x, model: e, version: '1', repository: /m}, {id: x, model: e, version: '1', repository: /m}]", "replicas[1].id"},
      {"warmPools: [{model: e, version: '1', repository: /m, size: 99}]", "warmPools[0].size"},
      {"warmPools: [{model: e, version: '1', repository: m}]", "warmPools[0].repository"},
      {"warmPools: [{model: e, version: '1', repository: /m, size: 1}, {model: e, version: '1', repository: /m, size: 2}]",
       "warmPools[1]: the same replicas as warmPools[0]"},
      {"replicas: [{id: pool-x, model: e, version: '1', repository: /m}]", "replicas[0].id: 'pool-x' starts with 'pool-'"},
      {"replicas: [{model: pool, version: '1', repository: /m}]", "replicas[0].id: 'pool-1-0'"},
      {"replicas: [{id: prestart-3, model: e, version: '1', repository: /m}]",
       "replicas[0].id: 'prestart-3' is reserved for the agent's pre-started runtimes"},
      {"routes: [{model: e, versions: [{version: '1', weight: 0}]}]", "every weight is 0"},
      {"routes: [{model: e, versions: []}]", "routes[0].versions"},
      {"routes: [{model: e, versions: [{version: '1'}], stickyKey: cookie:x}]", "routes[0].stickyKey"},
      {"routes: [{model: e, versions: [{version: '1', weight: -1}]}]", "weight"},
      {"routes: [{model: e, versions: [{version: '1'}]}, {model: e, versions: [{version: '1'}]}]", "routes[1].model"},
      {"routes: [{model: e, versions: [{version: '1'}], endpoints: [{node: b, version: '2', grpc: 'h:8001'}]}]",
       "routes[0].endpoints[0].version: '2' is not one of the route's versions"},
      {"routes: [{model: e, versions: [{version: '1'}], endpoints: [{node: b, version: '1', grpc: 'h'}]}]",
       "routes[0].endpoints[0].grpc: must be HOST:PORT, got 'h'"},
      {"routes: [{model: e, versions: [{version: '1'}], endpoints: [{node: b, version: '1', grpc: ':8001'}]}]",
       "endpoints[0].grpc"},
      {"routes: [{model: e, versions: [{version: '1'}], endpoints: [{node: b, version: '1', grpc: 'h:0'}]}]",
       "endpoints[0].grpc"},
      {"routes: [{model: e, versions: [{version: '1'}], endpoints: [{node: b, version: '1', grpc: 'h:8001', http: 'h:x'}]}]",
       "routes[0].endpoints[0].http: must be HOST:PORT"},
      {"replicas: [{model: e, version: '1', repository: /m, gpuMemory: 2000000Gi}]", "replicas[0].gpuMemory: must be in 0..1048576Gi (1 PiB)"},
      {"replica: []", "replica: unknown field"},
      {"replicas: [", "not valid YAML"},
  };
  for (const auto& c : cases) {
    auto f = ParseAssignmentFile(c.yaml, "assign.yaml");
    ASSERT_FALSE(f.ok()) << c.yaml;
    EXPECT_NE(f.status().message().find(c.expect), std::string::npos)
        << c.yaml << " -> " << f.status().message();
    EXPECT_NE(f.status().message().find("assign.yaml"), std::string::npos);
  }
  EXPECT_EQ(LoadAssignmentFile("/nonexistent/a.yaml").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kiln
