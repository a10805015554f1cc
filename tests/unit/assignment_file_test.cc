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
    endpoints: [{node: b, version: "2", grpc: "10.0.0.2:8001"}]
)";

TEST(AssignmentFileTest, ParsesReplicasPoolsAndRoutes) {
  auto f = ParseAssignmentFile(kGood, "a.yaml");
  ASSERT_TRUE(f.ok()) << f.status();
  const auto& a = f->assignment;
  ASSERT_EQ(a.replicas_size(), 4);
  EXPECT_EQ(a.replicas(0).replica_id(), "enc-a");
  EXPECT_EQ(a.replicas(0).gpu(), 0);
  EXPECT_EQ(a.replicas(1).replica_id(), "encoder-2-1");
  EXPECT_EQ(a.replicas(1).gpu(), -1);
  EXPECT_EQ(a.replicas(1).state(), v1::WARM);
  EXPECT_EQ(a.replicas(1).gpu_memory_bytes(), 2LL << 30);
  EXPECT_EQ(a.replicas(3).replica_id(), "encoder-3-warm-0-1");
  EXPECT_EQ(a.replicas(3).state(), v1::WARM);
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
      {"routes: [{model: e, versions: [{version: '1', weight: 0}]}]", "every weight is 0"},
      {"routes: [{model: e, versions: []}]", "routes[0].versions"},
      {"routes: [{model: e, versions: [{version: '1'}], stickyKey: cookie:x}]", "routes[0].stickyKey"},
      {"routes: [{model: e, versions: [{version: '1', weight: -1}]}]", "weight"},
      {"routes: [{model: e, versions: [{version: '1'}]}, {model: e, versions: [{version: '1'}]}]", "routes[1].model"},
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
