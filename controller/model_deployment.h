#pragma once

// ModelDeployment: the desired state of one served model (../shared/DESIGN.md). The same
// schema arrives as YAML (`kilnctl apply -f`), REST JSON and, later, the Kubernetes CRD
// `modeldeployments.serving.kiln.dev`. Parsing maps the document onto typed structs and
// validation names the field and the reason for every error; unknown fields are errors.

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace kiln {

inline constexpr char kModelDeploymentApiVersion[] = "serving.kiln.dev/v1alpha1";
inline constexpr char kModelDeploymentKind[] = "ModelDeployment";
// The label selector in status (the scale subresource's labelSelectorPath) uses this key.
inline constexpr char kDeploymentLabel[] = "serving.kiln.dev/deployment";

struct ModelRef {
  std::string name;
  std::string version;
  std::string uri;                    // file:///models/NAME/V/model.pt
  std::string format = "torchscript";  // torchscript | aotinductor
  std::string sha256;                 // optional: 64 hex digits
};

struct Autoscale {
  int64_t min = 1;
  int64_t max = 1;
  double target_in_flight = 1;
  // The fewest replicas it runs: min, but never 0 (at 0 no replica would report the load that
  // scales it up again), and the most: max, never below that.
  int64_t floor() const { return std::max<int64_t>(1, min); }
  int64_t ceiling() const { return std::max(floor(), max); }
};

struct Resources {
  int64_t gpus = 0;  // 0 = a CPU replica
  int64_t gpu_memory_bytes = 0;
  int64_t cpus = 1;
};

struct RuntimeSettings {
  std::string precision = "fp32";  // fp32 | fp16 | bf16
  int64_t max_batch_size = 0;      // 0 = the model's config
  std::vector<int64_t> preferred_batch_sizes;
  int64_t max_queue_delay_micros = 0;
  int64_t priority_levels = 1;
  int64_t response_cache_max_bytes = 0;  // 0 = off
};

struct RolloutStep {
  int64_t weight = 0;                               // percent of traffic to the new version
  absl::Duration pause = absl::ZeroDuration();      // how long to hold this step
  bool pause_until_resumed = false;                 // `pause: {}`: wait for `rollout resume`
};

struct Analysis {
  double max_error_rate = 0.01;
  double max_latency_p99_ratio = 1.25;
  int64_t min_requests = 200;
};

struct RolloutSpec {
  std::string strategy = "Canary";  // Canary | BlueGreen | ABTest
  std::vector<RolloutStep> steps;
  Analysis analysis;
  std::string sticky_key;  // header:NAME (ABTest)
  int64_t max_surge = 1;
  int64_t max_unavailable = 0;
  // As they are used: past any deployment's size (10000 replicas) they mean no limit, and are
  // taken as 10000 so that counts plus them cannot overflow.
  int64_t surge() const { return std::min<int64_t>(max_surge, 10000); }
  int64_t unavailable() const { return std::min<int64_t>(max_unavailable, 10000); }
  absl::Duration scale_down_delay = absl::Seconds(30);  // BlueGreen: old set drained after
};

struct ModelDeploymentSpec {
  ModelRef model;
  int64_t replicas = 1;
  std::optional<Autoscale> autoscale;
  int64_t warm_pool = 0;
  Resources resources;
  RuntimeSettings runtime;
  RolloutSpec rollout;
};

struct ModelDeployment {
  std::string name;
  std::map<std::string, std::string> labels;
  ModelDeploymentSpec spec;
  // metadata.resourceVersion as sent back by a client that read the object first (0 when
  // absent): an update then succeeds only if nobody wrote in between.
  int64_t resource_version = 0;
  // metadata.generation and metadata.uid as read back with it (0 and "" when absent): which
  // object, and which spec of it, the client saw.
  int64_t generation = 0;
  std::string uid;
};

// Parses one ModelDeployment from YAML or JSON text (JSON is YAML). `source` names the
// document in errors ("embedder.yaml", "request body").
absl::StatusOr<ModelDeployment> ParseModelDeployment(const std::string& text,
                                                     const std::string& source);
// Every document of a multi-document YAML stream ("---" separated).
absl::StatusOr<std::vector<ModelDeployment>> ParseModelDeployments(const std::string& text,
                                                                   const std::string& source);
absl::Status ValidateModelDeployment(const ModelDeployment& d);

// The spec as stored and served: canonical JSON with every default filled in, so that two
// documents meaning the same thing store the same bytes.
nlohmann::json SpecToJson(const ModelDeploymentSpec& spec);
// What the store keeps of a ModelDeployment (labels and canonical spec, as JSON text) and back.
std::string EncodeForStore(const ModelDeployment& d);
absl::StatusOr<ModelDeployment> DecodeFromStore(const std::string& name, const std::string& text);

// The file a version directory holds for a model format: model.pt (torchscript) or model.pt2
// (aotinductor).
inline std::string ModelFileName(const std::string& format) {
  return format == "aotinductor" ? "model.pt2" : "model.pt";
}

// The model repository on the nodes a file:///REPO/NAME/VERSION/model.pt(2) uri names ("" when the
// uri does not have that shape).
std::string RepositoryOf(const ModelRef& m);
// "30s", "1m30s", "500ms", "2h" (Argo Rollouts' duration strings) and their formatting.
absl::StatusOr<absl::Duration> ParseDurationString(const std::string& text,
                                                   const std::string& field);
std::string FormatDurationString(absl::Duration d);
// Kubernetes' time forms: "2026-11-22T10:00:00Z" (Time) and "2026-11-22T10:00:00.123456Z"
// (MicroTime), and parsing either back.
std::string FormatRfc3339(absl::Time t);
std::string FormatRfc3339Micros(absl::Time t);
absl::StatusOr<absl::Time> ParseRfc3339(const std::string& text, const std::string& field);

}  // namespace kiln
