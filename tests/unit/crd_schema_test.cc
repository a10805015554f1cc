// manifests/crd.yaml against the controller's own parser: both accept every example in
// examples/deployments and both refuse each broken spec below, naming the same field.
#include "controller/crd_schema.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "controller/model_deployment.h"
#include "controller/rollout.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

CrdSchema LoadSchema() {
  auto docs = YamlDocumentsToJson(ReadFile(fs::path(KILN_SOURCE_DIR) / "manifests/crd.yaml"), "crd.yaml");
  EXPECT_TRUE(docs.ok()) << docs.status();
  EXPECT_EQ(docs->size(), 1u);
  auto schema = CrdSchema::FromCrd(docs->at(0), "v1alpha1");
  EXPECT_TRUE(schema.ok()) << schema.status();
  return *schema;
}

std::string Joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += s + "\n";
  return out;
}

TEST(CrdSchemaTest, CrdHasTheNamesAndSubresourcesKubectlNeeds) {
  auto docs = YamlDocumentsToJson(ReadFile(fs::path(KILN_SOURCE_DIR) / "manifests/crd.yaml"), "crd.yaml");
  ASSERT_TRUE(docs.ok());
  const auto& crd = docs->at(0);
  EXPECT_EQ(crd["metadata"]["name"], "modeldeployments.serving.kiln.dev");
  EXPECT_EQ(crd["spec"]["group"], "serving.kiln.dev");
  EXPECT_EQ(crd["spec"]["names"]["kind"], kModelDeploymentKind);
  EXPECT_EQ(crd["spec"]["names"]["shortNames"], nlohmann::json::array({"md"}));
  const auto& v = crd["spec"]["versions"][0];
  EXPECT_EQ(std::string(kModelDeploymentApiVersion), "serving.kiln.dev/" + v["name"].get<std::string>());
  EXPECT_TRUE(v["subresources"].contains("status"));
  EXPECT_EQ(v["subresources"]["scale"]["specReplicasPath"], ".spec.replicas");
  EXPECT_EQ(v["subresources"]["scale"]["statusReplicasPath"], ".status.replicas");
  EXPECT_EQ(v["subresources"]["scale"]["labelSelectorPath"], ".status.selector");
  std::vector<std::string> columns;
  for (const auto& c : v["additionalPrinterColumns"]) columns.push_back(c["name"]);
  EXPECT_EQ(columns, (std::vector<std::string>{"Desired", "Ready", "Warm", "Version", "Rollout", "Age"}));
}

TEST(CrdSchemaTest, EveryExampleIsAcceptedByTheSchemaAndTheController) {
  CrdSchema schema = LoadSchema();
  int seen = 0;
  for (const auto& entry : fs::directory_iterator(fs::path(KILN_SOURCE_DIR) / "examples/deployments")) {
    if (entry.path().extension() != ".yaml") continue;
    std::string text = ReadFile(entry.path());
    auto docs = YamlDocumentsToJson(text, entry.path().filename());
    ASSERT_TRUE(docs.ok()) << docs.status();
    for (auto& doc : *docs) {
      auto errs = schema.Validate(doc);
      EXPECT_TRUE(errs.empty()) << entry.path() << ":\n" << Joined(errs);
      ++seen;
    }
    EXPECT_TRUE(ParseModelDeployments(text, entry.path().filename()).ok()) << entry.path();
  }
  EXPECT_GE(seen, 2);
}

// An AOTInductor package (model.pt2) is taken by both, as a TorchScript file (model.pt) is.
TEST(CrdSchemaTest, AnAotInductorDeploymentIsAcceptedByBoth) {
  CrdSchema schema = LoadSchema();
  const std::string text =
      "apiVersion: serving.kiln.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {name: m}\n"
      "spec:\n  model: {name: m, version: \"1\", uri: \"file:///r/m/1/model.pt2\", format: aotinductor}\n";
  auto docs = YamlDocumentsToJson(text, "case");
  ASSERT_TRUE(docs.ok());
  auto errs = schema.Validate(docs->at(0));
  EXPECT_TRUE(errs.empty()) << Joined(errs);
  EXPECT_TRUE(ParseModelDeployment(text, "case").ok()) << ParseModelDeployment(text, "case").status();
}

TEST(CrdSchemaTest, TheCanonicalSpecAndTheStatusTheControllerWritesAreValid) {
  CrdSchema schema = LoadSchema();
  // Every field the controller stores, filled in.
  ModelDeploymentSpec s;
  s.model = {"m", "1", "file:///models/m/1/model.pt", "torchscript", std::string(64, 'a')};
  s.warm_pool = 2;
  s.resources = {1, 4LL << 30, 4};
  s.runtime.precision = "fp16";
  s.runtime.max_batch_size = 64;
  s.runtime.preferred_batch_sizes = {8, 16};
  s.runtime.response_cache_max_bytes = 1 << 20;
  s.rollout.steps = {{10, absl::Seconds(30), false}, {50, absl::ZeroDuration(), true}};
  s.rollout.sticky_key = "header:x-user";
  RolloutState rs;
  rs.phase = "Progressing";
  rs.stable_version = "1";
  rs.canary_version = "2";
  rs.weight = 10;
  rs.step_started = absl::FromUnixSeconds(1);
  rs.draining_version = "0";
  nlohmann::json object = {
      {"apiVersion", kModelDeploymentApiVersion},
      {"kind", kModelDeploymentKind},
      {"metadata", {{"name", "m"}}},
      {"spec", SpecToJson(s)},
      {"status",
       {{"observedGeneration", 3},
        {"desiredReplicas", 2},
        {"replicas", 2},
        {"readyReplicas", 1},
        {"warmReplicas", 2},
        {"selector", "serving.kiln.dev/deployment=m"},
        {"conditions",
         {{{"type", "Available"}, {"status", "False"}, {"reason", "ReplicasNotReady"},
           {"message", "1 of 2"}, {"lastTransitionTime", "2026-11-22T10:00:00Z"}}}},
        {"rollout", rs.ToJson()}}}};
  auto errs = schema.Validate(object);
  EXPECT_TRUE(errs.empty()) << Joined(errs);
  // An autoscaled spec has no replicas.
  s.autoscale = Autoscale{1, 4, 8};
  object["spec"] = SpecToJson(s);
  errs = schema.Validate(object);
  EXPECT_TRUE(errs.empty()) << Joined(errs);
}

struct Broken {
  std::string spec_yaml;  // the spec: block, indented by two
  std::string field;      // the path both must name
};

TEST(CrdSchemaTest, BrokenSpecsAreRefusedByBothNamingTheField) {
  CrdSchema schema = LoadSchema();
  const std::string model = "  model: {name: m, version: \"1\", uri: \"file:///r/m/1/model.pt\"}\n";
  const std::vector<Broken> cases = {
      {model + "  replicas: -1\n", "spec.replicas"},
      {model + "  replicas: 10001\n", "spec.replicas"},
      {model + "  replicas: two\n", "spec.replicas"},
      {model + "  replica: 2\n", "spec.replica"},
      {"  model: {name: m, version: \"1\"}\n", "spec.model.uri"},
      {"  model: {name: m, version: \"1\", uri: \"http://x/m/1/model.pt\"}\n", "spec.model.uri"},
      {"  model: {name: m, version: \"v 1\", uri: \"file:///r/m/v 1/model.pt\"}\n", "spec.model.version"},
      {"  model: {name: m, version: \"1\", uri: \"file:///r/m/1/model.pt\", format: onnx}\n", "spec.model.format"},
      {"  model: {name: m, version: \"1\", uri: \"file:///r/m/1/model.pt\", sha256: abc}\n", "spec.model.sha256"},
      {model + "  autoscale: {min: 1}\n", "spec.autoscale.max"},
      {model + "  autoscale: {max: 3, targetInFlight: 0}\n", "spec.autoscale.targetInFlight"},
      {model + "  warmPool: 1001\n", "spec.warmPool"},
      {model + "  resources: {gpus: 2, gpuMemory: 1Gi}\n", "spec.resources.gpus"},
      {model + "  resources: {gpus: 1, gpuMemory: 4GB}\n", "spec.resources.gpuMemory"},
      {model + "  resources: {cpus: 0}\n", "spec.resources.cpus"},
      {model + "  runtime: {precision: fp8}\n", "spec.runtime.precision"},
      {model + "  runtime: {priorityLevels: 0}\n", "spec.runtime.priorityLevels"},
      {model + "  runtime: {preferredBatchSizes: [0]}\n", "spec.runtime.preferredBatchSizes[0]"},
      {model + "  runtime: {maxQueueDelayMicros: 60000001}\n", "spec.runtime.maxQueueDelayMicros"},
      {model + "  runtime: {responseCache: {maxBytes: lots}}\n", "spec.runtime.responseCache.maxBytes"},
      {model + "  rollout: {strategy: Linear}\n", "spec.rollout.strategy"},
      {model + "  rollout: {steps: [{weight: 101}]}\n", "spec.rollout.steps[0].weight"},
      {model + "  rollout: {steps: [{pause: 30s}]}\n", "spec.rollout.steps[0].weight"},
      {model + "  rollout: {analysis: {maxErrorRate: 2}}\n", "spec.rollout.analysis.maxErrorRate"},
      {model + "  rollout: {analysis: {maxLatencyP99Ratio: 0.5}}\n", "spec.rollout.analysis.maxLatencyP99Ratio"},
      {model + "  rollout: {stickyKey: \"cookie:x\"}\n", "spec.rollout.stickyKey"},
      {model + "  rollout: {maxSurge: -1}\n", "spec.rollout.maxSurge"},
      {model + "  rollout: {steps: [{weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}, {weight: 1}]}\n", "spec.rollout.steps"},
      {"  model: {name: m, version: \"1\", uri: \"file:///r/m/1/model.pt3\"}\n", "spec.model.uri"},
      {model + "  rollout: {scaleDownDelay: soon}\n", "spec.rollout.scaleDownDelay"},
  };
  for (const auto& c : cases) {
    std::string text = "apiVersion: serving.kiln.dev/v1alpha1\nkind: ModelDeployment\n"
                       "metadata: {name: m}\nspec:\n" + c.spec_yaml;
    auto docs = YamlDocumentsToJson(text, "case");
    ASSERT_TRUE(docs.ok()) << text;
    auto errs = schema.Validate(docs->at(0));
    ASSERT_FALSE(errs.empty()) << "schema accepted:\n" << text;
    EXPECT_EQ(errs[0].rfind(c.field + ":", 0), 0u) << "schema named " << errs[0] << " for\n" << text;
    auto parsed = ParseModelDeployment(text, "case");
    ASSERT_FALSE(parsed.ok()) << "controller accepted:\n" << text;
    EXPECT_NE(std::string(parsed.status().message()).find(c.field), std::string::npos)
        << parsed.status() << " for\n" << text;
  }
}

TEST(CrdSchemaTest, NullsArePrunedAndDefaultsFilled) {
  CrdSchema schema = LoadSchema();
  nlohmann::json o = {{"apiVersion", kModelDeploymentApiVersion}, {"kind", kModelDeploymentKind},
                      {"metadata", {{"name", "m"}}},
                      {"spec", {{"model", {{"name", "m"}, {"version", "1"}, {"uri", "file:///r/m/1/model.pt"}}},
                                {"replicas", nullptr}}}};
  EXPECT_TRUE(schema.Validate(o).empty());
  EXPECT_FALSE(o["spec"].contains("replicas"));
  EXPECT_EQ(o["spec"]["model"]["format"], "torchscript");
}

TEST(CrdSchemaTest, AnUntypedFieldIsNotStructural) {
  nlohmann::json crd = {
      {"kind", "CustomResourceDefinition"},
      {"spec", {{"versions", {{{"name", "v1"},
                               {"schema", {{"openAPIV3Schema",
                                            {{"type", "object"},
                                             {"properties", {{"spec", {{"description", "no type"}}}}}}}}}}}}}}};
  auto s = CrdSchema::FromCrd(crd, "v1");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(std::string(s.status().message()).find("properties[spec].type"), std::string::npos) << s.status();
  EXPECT_EQ(CrdSchema::FromCrd(crd, "v2").status().code(), absl::StatusCode::kNotFound);
}

TEST(CrdSchemaTest, YamlScalarsBecomeJsonTypes) {
  auto docs = YamlDocumentsToJson("a: 1\nb: \"1\"\nc: 1.5\nd: true\ne: ~\nf: 1Gi\ng: [x, 2]\n", "t");
  ASSERT_TRUE(docs.ok());
  const auto& j = docs->at(0);
  EXPECT_EQ(j["a"], 1);
  EXPECT_EQ(j["b"], "1");
  EXPECT_EQ(j["c"], 1.5);
  EXPECT_EQ(j["d"], true);
  EXPECT_TRUE(j["e"].is_null());
  EXPECT_EQ(j["f"], "1Gi");
  EXPECT_EQ(j["g"], nlohmann::json::array({"x", 2}));
  EXPECT_FALSE(YamlDocumentsToJson("a: [", "t").ok());
}

}  // namespace
}  // namespace kiln
