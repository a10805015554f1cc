#include "controller/model_deployment.h"

#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace kiln {
namespace {

const char* kFull = R"(apiVersion: serving.kiln.dev/v1alpha1
kind: ModelDeployment
metadata:
  name: embedder
  labels: {team: search}
spec:
  model: {name: embedder, version: "2", uri: "file:///models/embedder/2/model.pt",
          format: torchscript, sha256: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}
  replicas: 3
  warmPool: 1
  resources: {gpus: 1, gpuMemory: 4Gi, cpus: 4}
  runtime: {precision: fp16, maxBatchSize: 32, preferredBatchSizes: [8, 16, 32],
            maxQueueDelayMicros: 2000, priorityLevels: 2, responseCache: {maxBytes: 64Mi}}
  rollout:
    strategy: Canary
    steps: [{weight: 10, pause: 30s}, {weight: 50, pause: 1m30s}, {weight: 80, pause: {}}]
    analysis: {maxErrorRate: 0.01, maxLatencyP99Ratio: 1.25, minRequests: 200}
)";

std::string Replace(std::string s, const std::string& from, const std::string& to) {
  size_t at = s.find(from);
  EXPECT_NE(at, std::string::npos) << "no '" << from << "' in the fixture";
  if (at != std::string::npos) s.replace(at, from.size(), to);
  return s;
}

TEST(ModelDeploymentTest, ParsesTheDesignsExample) {
  auto d = ParseModelDeployment(kFull, "embedder.yaml");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->name, "embedder");
  EXPECT_EQ(d->labels.at("team"), "search");
  EXPECT_EQ(d->spec.model.version, "2");
  EXPECT_EQ(d->spec.replicas, 3);
  EXPECT_EQ(d->spec.warm_pool, 1);
  EXPECT_EQ(d->spec.resources.gpu_memory_bytes, 4LL << 30);
  EXPECT_EQ(d->spec.runtime.response_cache_max_bytes, 64LL << 20);
  EXPECT_EQ(d->spec.runtime.preferred_batch_sizes, (std::vector<int64_t>{8, 16, 32}));
  ASSERT_EQ(d->spec.rollout.steps.size(), 3u);
  EXPECT_EQ(d->spec.rollout.steps[0].pause, absl::Seconds(30));
  EXPECT_EQ(d->spec.rollout.steps[1].pause, absl::Seconds(90));
  EXPECT_TRUE(d->spec.rollout.steps[2].pause_until_resumed);
  EXPECT_FALSE(d->spec.autoscale.has_value());
}

TEST(ModelDeploymentTest, MinimalDocumentTakesDefaults) {
  auto d = ParseModelDeployment(R"({"apiVersion": "serving.kiln.dev/v1alpha1",
      "kind": "ModelDeployment", "metadata": {"name": "enc"},
      "spec": {"model": {"name": "encoder", "version": "1", "uri": "file:///m/encoder/1/model.pt"}}})",
                                "request body");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->spec.replicas, 1);
  EXPECT_EQ(d->spec.resources.gpus, 0);
  EXPECT_EQ(d->spec.resources.cpus, 1);
  EXPECT_EQ(d->spec.model.format, "torchscript");
  EXPECT_EQ(d->spec.rollout.strategy, "Canary");
  EXPECT_EQ(d->spec.rollout.max_surge, 1);
  EXPECT_EQ(d->spec.rollout.max_unavailable, 0);
}

TEST(ModelDeploymentTest, AnAotInductorPackageIsAModelPt2) {
  auto d = ParseModelDeployment(R"({"apiVersion": "serving.kiln.dev/v1alpha1",
      "kind": "ModelDeployment", "metadata": {"name": "enc"},
      "spec": {"model": {"name": "encoder", "version": "1", "format": "aotinductor",
                         "uri": "file:///m/encoder/1/model.pt2"}}})",
                                "request body");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(RepositoryOf(d->spec.model), "/m");
}

TEST(ModelDeploymentTest, CanonicalJsonRoundTripsAndIgnoresSpelling) {
  auto a = ParseModelDeployment(kFull, "a.yaml");
  ASSERT_TRUE(a.ok()) << a.status();
  nlohmann::json doc = {{"apiVersion", kModelDeploymentApiVersion},
                        {"kind", kModelDeploymentKind},
                        {"metadata", {{"name", "embedder"}}},
                        {"spec", SpecToJson(a->spec)}};
  auto b = ParseModelDeployment(doc.dump(), "b.json");
  ASSERT_TRUE(b.ok()) << b.status() << "\n" << doc.dump(2);
  EXPECT_EQ(SpecToJson(b->spec), SpecToJson(a->spec));
  // The same meaning spelled differently stores the same bytes.
  auto c = ParseModelDeployment(
      Replace(Replace(kFull, "gpuMemory: 4Gi", "gpuMemory: 4294967296"), "1m30s", "90s"), "c");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(SpecToJson(c->spec).dump(), SpecToJson(a->spec).dump());
}

TEST(ModelDeploymentTest, MultiDocumentStreams) {
  std::string two = std::string(kFull) + "---\n" + Replace(kFull, "name: embedder\n  labels", "name: other\n  labels");
  auto ds = ParseModelDeployments(two, "both.yaml");
  ASSERT_TRUE(ds.ok()) << ds.status();
  ASSERT_EQ(ds->size(), 2u);
  EXPECT_EQ((*ds)[1].name, "other");
  auto bad = ParseModelDeployments(std::string(kFull) + "---\n" + Replace(kFull, "replicas: 3", "replicas: -1"),
                                   "both.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("both.yaml (document 2): spec.replicas"), std::string::npos)
      << bad.status();
  EXPECT_FALSE(ParseModelDeployments("---\n", "empty.yaml").ok());
}

TEST(ModelDeploymentTest, AutoscaleInsteadOfReplicas) {
  auto d = ParseModelDeployment(
      Replace(kFull, "replicas: 3", "autoscale: {min: 2, max: 8, targetInFlight: 4}"), "a");
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->spec.autoscale.has_value());
  EXPECT_EQ(d->spec.autoscale->max, 8);
  EXPECT_EQ(d->spec.replicas, 2);  // starts at min
  EXPECT_FALSE(SpecToJson(d->spec).contains("replicas"));
}

TEST(ModelDeploymentTest, Durations) {
  EXPECT_EQ(*ParseDurationString("45", "f"), absl::Seconds(45));
  EXPECT_EQ(*ParseDurationString("500ms", "f"), absl::Milliseconds(500));
  EXPECT_EQ(*ParseDurationString("2h", "f"), absl::Hours(2));
  for (const char* bad : {"", "-1s", "soon", "1y", "inf", "10000000000"}) {
    auto d = ParseDurationString(bad, "spec.rollout.steps[0].pause");
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_NE(d.status().message().find("spec.rollout.steps[0].pause"), std::string::npos);
  }
}

struct BadCase {
  std::string from, to, expect;
};

class ModelDeploymentBadTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(ModelDeploymentBadTest, ErrorNamesTheField) {
  const BadCase& b = GetParam();
  auto d = ParseModelDeployment(Replace(kFull, b.from, b.to), "embedder.yaml");
  ASSERT_FALSE(d.ok()) << "accepted: " << b.to;
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find(b.expect), std::string::npos) << d.status().message();
  EXPECT_NE(d.status().message().find("embedder.yaml"), std::string::npos) << d.status();
}

INSTANTIATE_TEST_SUITE_P(
    Fields, ModelDeploymentBadTest,
    ::testing::Values(
        BadCase{"apiVersion: serving.kiln.dev/v1alpha1", "apiVersion: v1", "apiVersion: must be serving.kiln.dev/v1alpha1"},
        BadCase{"kind: ModelDeployment", "kind: Deployment", "kind: must be ModelDeployment"},
        BadCase{"name: embedder\n  labels", "name: Embedder_1\n  labels", "metadata.name: 'Embedder_1' must be"},
        BadCase{"name: embedder\n  labels", "name: -x\n  labels", "metadata.name"},
        BadCase{"  labels: {team: search}\n", "  labels: {team: search}\n  namespace: x\n", "metadata.namespace: unknown field"},
        BadCase{"model: {name: embedder,", "model: {name: '',", "spec.model.name: must not be empty"},
        BadCase{"version: \"2\"", "version: \"2/3\"", "spec.model.version"},
        BadCase{"uri: \"file:///models/embedder/2/model.pt\"", "uri: \"s3://bucket/model.pt\"", "spec.model.uri"},
        BadCase{"uri: \"file:///models/embedder/2/model.pt\"", "uri: \"file:///models/embedder/3/model.pt\"", "spec.model.uri: 'file:///models/embedder/3/model.pt' must name REPOSITORY/embedder/2/model.pt"},
        BadCase{"format: torchscript", "format: onnx", "spec.model.format: must be torchscript or aotinductor"},
        BadCase{"format: torchscript", "format: aotinductor", "spec.model.uri: 'file:///models/embedder/2/model.pt' must name REPOSITORY/embedder/2/model.pt2"},
        BadCase{"sha256: \"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\"", "sha256: \"xyz\"", "spec.model.sha256: must be 64 hex digits"},
        BadCase{"replicas: 3", "replicas: -1", "spec.replicas: must be in 0..10000"},
        BadCase{"replicas: 3", "replicas: three", "spec.replicas"},
        BadCase{"replicas: 3", "replicas: 3\n  autoscale: {max: 4}", "spec.autoscale: give either spec.replicas or spec.autoscale"},
        BadCase{"replicas: 3", "autoscale: {min: 5, max: 4}", "spec.autoscale.max"},
        BadCase{"replicas: 3", "autoscale: {min: 1}", "spec.autoscale.max: required"},
        BadCase{"replicas: 3", "autoscale: {max: 4, targetInFlight: 0}", "spec.autoscale.targetInFlight: must be > 0"},
        BadCase{"warmPool: 1", "warmPool: 5000", "spec.warmPool: must be in 0..1000"},
        BadCase{"gpus: 1,", "gpus: 2,", "spec.resources.gpus: must be 0 (a CPU replica) or 1"},
        BadCase{"gpuMemory: 4Gi", "gpuMemory: 0", "spec.resources.gpuMemory: required when gpus is 1"},
        BadCase{"gpuMemory: 4Gi", "gpuMemory: lots", "spec.resources.gpuMemory"},
        BadCase{"gpuMemory: 4Gi", "gpuMemory: 2000000Gi", "spec.resources.gpuMemory: must be in 0..1048576Gi (1 PiB)"},
        BadCase{"cpus: 4}", "cpus: 0}", "spec.resources.cpus: must be in 1..256"},
        BadCase{"precision: fp16", "precision: int8", "spec.runtime.precision: must be fp32, fp16 or bf16"},
        BadCase{"gpus: 1, gpuMemory: 4Gi", "gpus: 0", "spec.runtime.precision: fp16 needs a GPU replica"},
        BadCase{"preferredBatchSizes: [8, 16, 32]", "preferredBatchSizes: [8, 64]", "spec.runtime.preferredBatchSizes[1]: must be in 1..maxBatchSize"},
        BadCase{"preferredBatchSizes: [8, 16, 32]", "preferredBatchSizes: [16, 8]", "spec.runtime.preferredBatchSizes[1]: must be ascending"},
        BadCase{"priorityLevels: 2", "priorityLevels: 17", "spec.runtime.priorityLevels: must be in 1..16"},
        BadCase{"maxQueueDelayMicros: 2000", "maxQueueDelayMicros: -1", "spec.runtime.maxQueueDelayMicros"},
        BadCase{"responseCache: {maxBytes: 64Mi}", "responseCache: {size: 64Mi}", "spec.runtime.responseCache.size: unknown field"},
        BadCase{"strategy: Canary", "strategy: Linear", "spec.rollout.strategy: must be Canary, BlueGreen or ABTest"},
        BadCase{"{weight: 10, pause: 30s}", "{weight: 110, pause: 30s}", "spec.rollout.steps[0].weight: must be in 0..100"},
        BadCase{"{weight: 50, pause: 1m30s}", "{weight: 5, pause: 1m30s}", "spec.rollout.steps[1].weight: must not go down"},
        BadCase{"{weight: 10, pause: 30s}", "{weight: 10, pause: soon}", "spec.rollout.steps[0].pause: 'soon' is not a duration"},
        BadCase{"{weight: 10, pause: 30s}", "{weight: 10, wait: 30s}", "spec.rollout.steps[0].wait: unknown field"},
        BadCase{"{weight: 80, pause: {}}", "{weight: 80, pause: {until: x}}", "spec.rollout.steps[2].pause.until: unknown field"},
        BadCase{"strategy: Canary", "strategy: BlueGreen", "spec.rollout.steps: BlueGreen switches all traffic at once"},
        BadCase{"strategy: Canary", "strategy: ABTest", "spec.rollout.steps: ABTest takes exactly one step"},
        BadCase{"maxErrorRate: 0.01", "maxErrorRate: 2", "spec.rollout.analysis.maxErrorRate: must be in 0..1"},
        BadCase{"maxLatencyP99Ratio: 1.25", "maxLatencyP99Ratio: 0.5", "spec.rollout.analysis.maxLatencyP99Ratio: must be >= 1"},
        BadCase{"minRequests: 200}", "minRequests: -3}", "spec.rollout.analysis.minRequests: must be >= 0"},
        BadCase{"    strategy: Canary\n", "    strategy: Canary\n    maxSurge: 0\n", "spec.rollout.maxSurge: maxSurge and maxUnavailable cannot both be 0"},
        BadCase{"    strategy: Canary\n", "    strategy: Canary\n    stickyKey: cookie\n", "spec.rollout.stickyKey: must be header:NAME"},
        BadCase{"  warmPool: 1\n", "  warmPool: 1\n  replicaz: 2\n", "spec.replicaz: unknown field"},
        BadCase{"spec:\n", "spec: 3\nx:\n", "x: unknown field"},
        BadCase{"  model: {", "  model: [", "not valid YAML"}));

TEST(ModelDeploymentTest, AbTestNeedsOneStepAndAStickyHeader) {
  std::string ab = Replace(
      Replace(kFull, "strategy: Canary", "strategy: ABTest\n    stickyKey: header:x-user-id"),
      "[{weight: 10, pause: 30s}, {weight: 50, pause: 1m30s}, {weight: 80, pause: {}}]",
      "[{weight: 30}]");
  auto d = ParseModelDeployment(ab, "ab.yaml");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->spec.rollout.sticky_key, "header:x-user-id");
  auto no_key = ParseModelDeployment(Replace(ab, "    stickyKey: header:x-user-id\n", ""), "ab.yaml");
  ASSERT_FALSE(no_key.ok());
  EXPECT_NE(no_key.status().message().find("spec.rollout.stickyKey: ABTest needs a sticky key"),
            std::string::npos)
      << no_key.status();
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// The shipped examples stay valid.
TEST(ModelDeploymentTest, ExamplesParse) {
  for (const char* name : {"encoder.yaml", "embedder-gpu.yaml"}) {
    std::string path = std::string(KILN_SOURCE_DIR) + "/examples/deployments/" + name;
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    ASSERT_TRUE(in.good() || in.eof()) << path;
    auto d = ParseModelDeployments(text.str(), path);
    EXPECT_TRUE(d.ok()) << d.status();
  }
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

TEST(Rfc3339Test, FormatsAndParsesKubernetesTimes) {
  absl::Time t = absl::FromUnixMicros(1795000000123456);
  EXPECT_EQ(FormatRfc3339(t), "2026-11-18T11:06:40Z");
  EXPECT_EQ(FormatRfc3339Micros(t), "2026-11-18T11:06:40.123456Z");
  auto back = ParseRfc3339(FormatRfc3339Micros(t), "renewTime");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, t);
  auto bad = ParseRfc3339("yesterday", "spec.renewTime");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("spec.renewTime"), std::string::npos);
}

}  // namespace
}  // namespace kiln
