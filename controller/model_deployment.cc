#include "controller/model_deployment.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "common/config_node.h"
#include "common/status.h"
#include "yaml-cpp/yaml.h"

namespace kiln {

namespace {

bool IsDnsLabel(const std::string& s) {
  if (s.empty() || s.size() > 63) return false;
  for (char c : s) {
    if (!(std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) ||
          c == '-')) {
      return false;
    }
  }
  return s.front() != '-' && s.back() != '-';
}

absl::StatusOr<int64_t> ByteSizeField(const ConfigNode& parent, const std::string& key,
                                      int64_t def) {
  auto child = parent.OptionalChild(key);
  if (!child) return def;
  KILN_ASSIGN_OR_RETURN(std::string text, child->AsString());
  return ParseByteSize(text, child->path());
}

absl::StatusOr<double> DoubleField(const ConfigNode& parent, const std::string& key, double def) {
  auto child = parent.OptionalChild(key);
  if (!child) return def;
  KILN_ASSIGN_OR_RETURN(double v, child->AsDouble());
  if (!std::isfinite(v)) return child->Error("must be a finite number");
  return v;
}

absl::StatusOr<absl::Duration> DurationField(const ConfigNode& node) {
  KILN_ASSIGN_OR_RETURN(std::string text, node.AsString());
  return ParseDurationString(text, node.path());
}

absl::StatusOr<RolloutStep> ParseStep(const ConfigNode& item) {
  KILN_RETURN_IF_ERROR(item.CheckKeys({"weight", "pause"}));
  RolloutStep step;
  KILN_ASSIGN_OR_RETURN(ConfigNode w, item.Child("weight"));
  KILN_ASSIGN_OR_RETURN(step.weight, w.AsInt());
  if (auto pause = item.OptionalChild("pause")) {
    if (pause->IsMap()) {
      // Argo's forms: `pause: {}` waits for a resume, `pause: {duration: 30s}` does not.
      KILN_RETURN_IF_ERROR(pause->CheckKeys({"duration"}));
      if (auto d = pause->OptionalChild("duration")) {
        KILN_ASSIGN_OR_RETURN(step.pause, DurationField(*d));
      } else {
        step.pause_until_resumed = true;
      }
    } else {
      KILN_ASSIGN_OR_RETURN(step.pause, DurationField(*pause));
    }
  }
  return step;
}

absl::StatusOr<ModelDeployment> FromNode(const ConfigNode& root) {
  KILN_RETURN_IF_ERROR(root.ExpectMap());
  KILN_RETURN_IF_ERROR(root.CheckKeys({"apiVersion", "kind", "metadata", "spec", "status"}));
  KILN_ASSIGN_OR_RETURN(ConfigNode api, root.Child("apiVersion"));
  KILN_ASSIGN_OR_RETURN(std::string api_version, api.AsString());
  if (api_version != kModelDeploymentApiVersion) {
    return api.Error(std::string("must be ") + kModelDeploymentApiVersion + ", got '" +
                     api_version + "'");
  }
  KILN_ASSIGN_OR_RETURN(ConfigNode kind_node, root.Child("kind"));
  KILN_ASSIGN_OR_RETURN(std::string kind, kind_node.AsString());
  if (kind != kModelDeploymentKind) {
    return kind_node.Error(std::string("must be ") + kModelDeploymentKind + ", got '" + kind + "'");
  }
  ModelDeployment d;
  KILN_ASSIGN_OR_RETURN(ConfigNode meta, root.Child("metadata"));
  KILN_RETURN_IF_ERROR(meta.ExpectMap());
  // The server-set fields may come back from a client that edits what it read; resourceVersion,
  // generation and uid are kept (for optimistic concurrency), the others are ignored.
  KILN_RETURN_IF_ERROR(meta.CheckKeys({"name", "labels", "annotations", "resourceVersion", "uid",
                                       "generation", "creationTimestamp"}));
  if (auto rv = meta.OptionalChild("resourceVersion")) {
    KILN_ASSIGN_OR_RETURN(std::string text, rv->AsString());
    if (text.empty() || text.size() > 18 ||
        !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return rv->Error("must be a resourceVersion this server returned, got '" + text + "'");
    }
    d.resource_version = std::stoll(text);
  }
  if (auto u = meta.OptionalChild("uid")) {
    KILN_ASSIGN_OR_RETURN(d.uid, u->AsString());
  }
  if (auto g = meta.OptionalChild("generation")) {
    KILN_ASSIGN_OR_RETURN(d.generation, g->AsInt());
    if (d.generation < 0) return g->Error("must be >= 0");
  }
  KILN_ASSIGN_OR_RETURN(ConfigNode name, meta.Child("name"));
  KILN_ASSIGN_OR_RETURN(d.name, name.AsString());
  if (auto labels = meta.OptionalChild("labels")) {
    KILN_ASSIGN_OR_RETURN(auto entries, labels->Entries());
    for (const auto& [k, v] : entries) {
      KILN_ASSIGN_OR_RETURN(d.labels[k], v.AsString());
    }
  }

  KILN_ASSIGN_OR_RETURN(ConfigNode spec, root.Child("spec"));
  KILN_RETURN_IF_ERROR(spec.ExpectMap());
  KILN_RETURN_IF_ERROR(spec.CheckKeys(
      {"model", "replicas", "autoscale", "warmPool", "resources", "runtime", "rollout"}));
  ModelDeploymentSpec& s = d.spec;
  KILN_ASSIGN_OR_RETURN(ConfigNode model, spec.Child("model"));
  KILN_RETURN_IF_ERROR(model.ExpectMap());
  KILN_RETURN_IF_ERROR(model.CheckKeys({"name", "version", "uri", "format", "sha256"}));
  KILN_ASSIGN_OR_RETURN(ConfigNode mname, model.Child("name"));
  KILN_ASSIGN_OR_RETURN(s.model.name, mname.AsString());
  KILN_ASSIGN_OR_RETURN(ConfigNode mversion, model.Child("version"));
  KILN_ASSIGN_OR_RETURN(s.model.version, mversion.AsString());
  KILN_ASSIGN_OR_RETURN(ConfigNode muri, model.Child("uri"));
  KILN_ASSIGN_OR_RETURN(s.model.uri, muri.AsString());
  KILN_ASSIGN_OR_RETURN(s.model.format, model.GetString("format", "torchscript"));
  KILN_ASSIGN_OR_RETURN(s.model.sha256, model.GetString("sha256", ""));

  if (spec.Has("replicas") && spec.Has("autoscale")) {
    return absl::InvalidArgumentError(
        "spec.autoscale: give either spec.replicas or spec.autoscale, not both");
  }
  KILN_ASSIGN_OR_RETURN(s.replicas, spec.GetInt("replicas", 1));
  if (auto as = spec.OptionalChild("autoscale")) {
    KILN_RETURN_IF_ERROR(as->ExpectMap());
    KILN_RETURN_IF_ERROR(as->CheckKeys({"min", "max", "targetInFlight"}));
    Autoscale a;
    KILN_ASSIGN_OR_RETURN(a.min, as->GetInt("min", 1));
    KILN_ASSIGN_OR_RETURN(ConfigNode mx, as->Child("max"));
    KILN_ASSIGN_OR_RETURN(a.max, mx.AsInt());
    KILN_ASSIGN_OR_RETURN(a.target_in_flight, DoubleField(*as, "targetInFlight", 1.0));
    s.autoscale = a;
    s.replicas = a.floor();
  }
  KILN_ASSIGN_OR_RETURN(s.warm_pool, spec.GetInt("warmPool", 0));
  if (auto r = spec.OptionalChild("resources")) {
    KILN_RETURN_IF_ERROR(r->ExpectMap());
    KILN_RETURN_IF_ERROR(r->CheckKeys({"gpus", "gpuMemory", "cpus"}));
    KILN_ASSIGN_OR_RETURN(s.resources.gpus, r->GetInt("gpus", 0));
    KILN_ASSIGN_OR_RETURN(s.resources.gpu_memory_bytes, ByteSizeField(*r, "gpuMemory", 0));
    KILN_ASSIGN_OR_RETURN(s.resources.cpus, r->GetInt("cpus", 1));
  }
  if (auto rt = spec.OptionalChild("runtime")) {
    KILN_RETURN_IF_ERROR(rt->ExpectMap());
    KILN_RETURN_IF_ERROR(rt->CheckKeys({"precision", "maxBatchSize", "preferredBatchSizes",
                                        "maxQueueDelayMicros", "priorityLevels",
                                        "responseCache"}));
    RuntimeSettings& x = s.runtime;
    KILN_ASSIGN_OR_RETURN(x.precision, rt->GetString("precision", "fp32"));
    KILN_ASSIGN_OR_RETURN(x.max_batch_size, rt->GetInt("maxBatchSize", 0));
    if (rt->Has("preferredBatchSizes")) {
      KILN_ASSIGN_OR_RETURN(x.preferred_batch_sizes, rt->GetIntList("preferredBatchSizes"));
    }
    KILN_ASSIGN_OR_RETURN(x.max_queue_delay_micros, rt->GetInt("maxQueueDelayMicros", 0));
    KILN_ASSIGN_OR_RETURN(x.priority_levels, rt->GetInt("priorityLevels", 1));
    if (auto rc = rt->OptionalChild("responseCache")) {
      KILN_RETURN_IF_ERROR(rc->ExpectMap());
      KILN_RETURN_IF_ERROR(rc->CheckKeys({"maxBytes"}));
      KILN_ASSIGN_OR_RETURN(x.response_cache_max_bytes, ByteSizeField(*rc, "maxBytes", 0));
    }
  }
  if (auto ro = spec.OptionalChild("rollout")) {
    KILN_RETURN_IF_ERROR(ro->ExpectMap());
    KILN_RETURN_IF_ERROR(ro->CheckKeys({"strategy", "steps", "analysis", "stickyKey",
                                        "maxSurge", "maxUnavailable", "scaleDownDelay"}));
    RolloutSpec& r = s.rollout;
    KILN_ASSIGN_OR_RETURN(r.strategy, ro->GetString("strategy", "Canary"));
    if (auto steps = ro->OptionalChild("steps")) {
      KILN_ASSIGN_OR_RETURN(auto items, steps->Items());
      for (const auto& item : items) {
        KILN_RETURN_IF_ERROR(item.ExpectMap());
        KILN_ASSIGN_OR_RETURN(RolloutStep step, ParseStep(item));
        r.steps.push_back(step);
      }
    }
    if (auto an = ro->OptionalChild("analysis")) {
      KILN_RETURN_IF_ERROR(an->ExpectMap());
      KILN_RETURN_IF_ERROR(an->CheckKeys({"maxErrorRate", "maxLatencyP99Ratio", "minRequests"}));
      KILN_ASSIGN_OR_RETURN(r.analysis.max_error_rate, DoubleField(*an, "maxErrorRate", 0.01));
      KILN_ASSIGN_OR_RETURN(r.analysis.max_latency_p99_ratio,
                            DoubleField(*an, "maxLatencyP99Ratio", 1.25));
      KILN_ASSIGN_OR_RETURN(r.analysis.min_requests, an->GetInt("minRequests", 200));
    }
    KILN_ASSIGN_OR_RETURN(r.sticky_key, ro->GetString("stickyKey", ""));
    KILN_ASSIGN_OR_RETURN(r.max_surge, ro->GetInt("maxSurge", 1));
    KILN_ASSIGN_OR_RETURN(r.max_unavailable, ro->GetInt("maxUnavailable", 0));
    if (auto sd = ro->OptionalChild("scaleDownDelay")) {
      KILN_ASSIGN_OR_RETURN(r.scale_down_delay, DurationField(*sd));
    }
  }
  KILN_RETURN_IF_ERROR(ValidateModelDeployment(d));
  return d;
}

absl::Status Bad(const std::string& field, const std::string& reason) {
  return absl::InvalidArgumentError(field + ": " + reason);
}

std::string Num(int64_t v) { return std::to_string(v); }

}  // namespace

std::string RepositoryOf(const ModelRef& m) {
  if (m.uri.rfind("file://", 0) != 0) return "";
  std::string path = m.uri.substr(7);
  std::string tail = "/" + m.name + "/" + m.version + "/" + ModelFileName(m.format);
  if (path.size() <= tail.size() + 1 || path.compare(path.size() - tail.size(), tail.size(), tail) != 0) {
    return "";
  }
  return path.substr(0, path.size() - tail.size());
}

absl::StatusOr<absl::Duration> ParseDurationString(const std::string& text,
                                                   const std::string& field) {
  auto bad = [&]() {
    return Bad(field, "'" + text + "' is not a duration (e.g. 30s, 1m30s, 500ms, 2h)");
  };
  if (text.empty()) return bad();
  // A bare number is seconds.
  if (std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    if (text.size() > 9) return bad();
    return absl::Seconds(std::stoll(text));
  }
  absl::Duration d;
  if (!absl::ParseDuration(text, &d) || d < absl::ZeroDuration() || d == absl::InfiniteDuration()) {
    return bad();
  }
  if (d > absl::Hours(24 * 365)) return Bad(field, "at most a year, got " + text);
  return d;
}

std::string FormatDurationString(absl::Duration d) { return absl::FormatDuration(d); }

std::string FormatRfc3339(absl::Time t) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", t, absl::UTCTimeZone());
}

std::string FormatRfc3339Micros(absl::Time t) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", t, absl::UTCTimeZone());
}

absl::StatusOr<absl::Time> ParseRfc3339(const std::string& text, const std::string& field) {
  absl::Time t;
  std::string err;
  if (!absl::ParseTime(absl::RFC3339_full, text, &t, &err)) {
    return Bad(field, "'" + text + "' is not an RFC 3339 time: " + err);
  }
  return t;
}

absl::Status ValidateModelDeployment(const ModelDeployment& d) {
  if (!IsDnsLabel(d.name)) {
    return Bad("metadata.name", "'" + d.name +
                                    "' must be 1-63 lowercase letters, digits or '-', starting "
                                    "and ending with a letter or digit");
  }
  const ModelDeploymentSpec& s = d.spec;
  if (s.model.name.empty()) return Bad("spec.model.name", "must not be empty");
  if (s.model.name.size() > 253) {
    return Bad("spec.model.name",
               "at most 253 characters, got " + Num(static_cast<int64_t>(s.model.name.size())));
  }
  if (s.model.version.empty() || s.model.version.size() > 64 ||
      !std::all_of(s.model.version.begin(), s.model.version.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
      })) {
    return Bad("spec.model.version",
               "'" + s.model.version + "' must be 1-64 letters, digits, '.', '_' or '-'");
  }
  if (s.model.uri.rfind("file:///", 0) != 0 || s.model.uri.size() <= 8) {
    return Bad("spec.model.uri", "'" + s.model.uri +
                                     "' must be a file:/// path on the nodes (the only scheme "
                                     "supported)");
  }
  if (s.model.format != "torchscript" && s.model.format != "aotinductor") {
    return Bad("spec.model.format", "must be torchscript or aotinductor, got '" + s.model.format + "'");
  }
  if (RepositoryOf(s.model).empty()) {
    return Bad("spec.model.uri", "'" + s.model.uri + "' must name REPOSITORY/" + s.model.name +
                                     "/" + s.model.version + "/" + ModelFileName(s.model.format) +
                                     " (the runtime's model repository layout for format " +
                                     s.model.format + ")");
  }
  if (!s.model.sha256.empty() &&
      (s.model.sha256.size() != 64 ||
       !std::all_of(s.model.sha256.begin(), s.model.sha256.end(),
                    [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); }))) {
    return Bad("spec.model.sha256", "must be 64 hex digits");
  }
  if (s.replicas < 0 || s.replicas > 10000) {
    return Bad("spec.replicas", "must be in 0..10000, got " + Num(s.replicas));
  }
  if (s.autoscale) {
    const Autoscale& a = *s.autoscale;
    if (a.min < 0 || a.min > 10000) return Bad("spec.autoscale.min", "must be in 0..10000, got " + Num(a.min));
    if (a.max < 1 || a.max > 10000 || a.max < a.min) {
      return Bad("spec.autoscale.max", "must be in max(1, min)..10000, got " + Num(a.max));
    }
    if (!(a.target_in_flight > 0)) return Bad("spec.autoscale.targetInFlight", "must be > 0");
  }
  if (s.warm_pool < 0 || s.warm_pool > 1000) {
    return Bad("spec.warmPool", "must be in 0..1000, got " + Num(s.warm_pool));
  }
  if (s.resources.gpus < 0 || s.resources.gpus > 1) {
    return Bad("spec.resources.gpus", "must be 0 (a CPU replica) or 1, got " + Num(s.resources.gpus));
  }
  if (s.resources.gpus == 1 && s.resources.gpu_memory_bytes <= 0) {
    return Bad("spec.resources.gpuMemory",
               "required when gpus is 1 (placement needs the replica's GPU memory)");
  }
  // Bounded, so that placement's sums of it cannot overflow (a GPU holds far less than 1Pi).
  if (s.resources.gpu_memory_bytes < 0 || s.resources.gpu_memory_bytes > (int64_t{1} << 50)) {
    return Bad("spec.resources.gpuMemory", "must be in 0..1048576Gi (1 PiB)");
  }
  if (s.resources.cpus < 1 || s.resources.cpus > 256) {
    return Bad("spec.resources.cpus", "must be in 1..256, got " + Num(s.resources.cpus));
  }
  const RuntimeSettings& rt = s.runtime;
  if (rt.precision != "fp32" && rt.precision != "fp16" && rt.precision != "bf16") {
    return Bad("spec.runtime.precision", "must be fp32, fp16 or bf16, got '" + rt.precision + "'");
  }
  if (rt.precision == "fp16" && s.resources.gpus == 0) {
    return Bad("spec.runtime.precision", "fp16 needs a GPU replica (resources.gpus: 1)");
  }
  if (rt.max_batch_size < 0 || rt.max_batch_size > 1048576) {
    return Bad("spec.runtime.maxBatchSize", "must be in 0..1048576, got " + Num(rt.max_batch_size));
  }
  if (rt.preferred_batch_sizes.size() > 64) {
    return Bad("spec.runtime.preferredBatchSizes",
               "at most 64, got " + Num(static_cast<int64_t>(rt.preferred_batch_sizes.size())));
  }
  for (size_t i = 0; i < rt.preferred_batch_sizes.size(); ++i) {
    int64_t p = rt.preferred_batch_sizes[i];
    std::string f = "spec.runtime.preferredBatchSizes[" + Num(static_cast<int64_t>(i)) + "]";
    if (p < 1 || (rt.max_batch_size > 0 && p > rt.max_batch_size)) {
      return Bad(f, "must be in 1..maxBatchSize, got " + Num(p));
    }
    if (i > 0 && p <= rt.preferred_batch_sizes[i - 1]) return Bad(f, "must be ascending");
  }
  if (rt.max_queue_delay_micros < 0 || rt.max_queue_delay_micros > 60'000'000) {
    return Bad("spec.runtime.maxQueueDelayMicros", "must be in 0..60000000");
  }
  if (rt.priority_levels < 1 || rt.priority_levels > 16) {
    return Bad("spec.runtime.priorityLevels", "must be in 1..16, got " + Num(rt.priority_levels));
  }
  if (rt.response_cache_max_bytes < 0) {
    return Bad("spec.runtime.responseCache.maxBytes", "must be >= 0");
  }
  const RolloutSpec& r = s.rollout;
  if (r.strategy != "Canary" && r.strategy != "BlueGreen" && r.strategy != "ABTest") {
    return Bad("spec.rollout.strategy", "must be Canary, BlueGreen or ABTest, got '" + r.strategy + "'");
  }
  if (r.steps.size() > 100) {
    return Bad("spec.rollout.steps", "at most 100, got " + Num(static_cast<int64_t>(r.steps.size())));
  }
  for (size_t i = 0; i < r.steps.size(); ++i) {
    std::string f = "spec.rollout.steps[" + Num(static_cast<int64_t>(i)) + "]";
    if (r.steps[i].weight < 0 || r.steps[i].weight > 100) {
      return Bad(f + ".weight", "must be in 0..100, got " + Num(r.steps[i].weight));
    }
    if (i > 0 && r.steps[i].weight < r.steps[i - 1].weight) {
      return Bad(f + ".weight", "must not go down (" + Num(r.steps[i - 1].weight) + " then " +
                                    Num(r.steps[i].weight) + ")");
    }
  }
  if (r.strategy == "BlueGreen" && !r.steps.empty()) {
    return Bad("spec.rollout.steps", "BlueGreen switches all traffic at once; it takes no steps");
  }
  if (r.strategy == "ABTest") {
    if (r.steps.size() != 1 || r.steps[0].weight < 1 || r.steps[0].weight > 99) {
      return Bad("spec.rollout.steps",
                 "ABTest takes exactly one step whose weight (1..99) is the new version's share");
    }
    if (r.sticky_key.rfind("header:", 0) != 0 || r.sticky_key.size() <= 7) {
      return Bad("spec.rollout.stickyKey",
                 "ABTest needs a sticky key header:NAME, got '" + r.sticky_key + "'");
    }
  } else if (!r.sticky_key.empty() && (r.sticky_key.rfind("header:", 0) != 0 || r.sticky_key.size() <= 7)) {
    return Bad("spec.rollout.stickyKey", "must be header:NAME, got '" + r.sticky_key + "'");
  }
  const Analysis& a = r.analysis;
  if (a.max_error_rate < 0 || a.max_error_rate > 1) {
    return Bad("spec.rollout.analysis.maxErrorRate", "must be in 0..1");
  }
  if (a.max_latency_p99_ratio < 1) {
    return Bad("spec.rollout.analysis.maxLatencyP99Ratio", "must be >= 1");
  }
  if (a.min_requests < 0) return Bad("spec.rollout.analysis.minRequests", "must be >= 0");
  if (r.max_surge < 0) return Bad("spec.rollout.maxSurge", "must be >= 0");
  if (r.max_unavailable < 0) return Bad("spec.rollout.maxUnavailable", "must be >= 0");
  if (r.max_surge == 0 && r.max_unavailable == 0) {
    return Bad("spec.rollout.maxSurge",
               "maxSurge and maxUnavailable cannot both be 0 (no replica could ever move)");
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelDeployment> ParseModelDeployment(const std::string& text,
                                                     const std::string& source) {
  KILN_ASSIGN_OR_RETURN(ConfigNode root, ConfigNode::Parse(text, source));
  auto d = FromNode(root);
  if (!d.ok()) return Annotate(d.status(), source);
  return d;
}

absl::StatusOr<std::vector<ModelDeployment>> ParseModelDeployments(const std::string& text,
                                                                   const std::string& source) {
  KILN_ASSIGN_OR_RETURN(std::vector<YAML::Node> docs, LoadYamlDocuments(text, source));
  std::vector<ModelDeployment> out;
  for (size_t i = 0; i < docs.size(); ++i) {
    if (docs[i].IsNull()) continue;  // an empty document between separators
    std::string where = docs.size() > 1 ? source + " (document " + std::to_string(i + 1) + ")"
                                        : source;
    auto d = FromNode(ConfigNode(docs[i], ""));
    if (!d.ok()) return Annotate(d.status(), where);
    out.push_back(std::move(*d));
  }
  if (out.empty()) return absl::InvalidArgumentError(source + ": no ModelDeployment in it");
  return out;
}

nlohmann::json SpecToJson(const ModelDeploymentSpec& s) {
  nlohmann::json j;
  j["model"] = {{"name", s.model.name}, {"version", s.model.version}, {"uri", s.model.uri},
                {"format", s.model.format}};
  if (!s.model.sha256.empty()) j["model"]["sha256"] = s.model.sha256;
  if (s.autoscale) {
    j["autoscale"] = {{"min", s.autoscale->min},
                      {"max", s.autoscale->max},
                      {"targetInFlight", s.autoscale->target_in_flight}};
  } else {
    j["replicas"] = s.replicas;
  }
  j["warmPool"] = s.warm_pool;
  j["resources"] = {{"gpus", s.resources.gpus},
                    {"gpuMemory", s.resources.gpu_memory_bytes},
                    {"cpus", s.resources.cpus}};
  j["runtime"] = {{"precision", s.runtime.precision},
                  {"maxBatchSize", s.runtime.max_batch_size},
                  {"preferredBatchSizes", s.runtime.preferred_batch_sizes},
                  {"maxQueueDelayMicros", s.runtime.max_queue_delay_micros},
                  {"priorityLevels", s.runtime.priority_levels},
                  {"responseCache", {{"maxBytes", s.runtime.response_cache_max_bytes}}}};
  nlohmann::json steps = nlohmann::json::array();
  for (const auto& st : s.rollout.steps) {
    nlohmann::json step = {{"weight", st.weight}};
    if (st.pause_until_resumed) {
      step["pause"] = nlohmann::json::object();
    } else if (st.pause > absl::ZeroDuration()) {
      step["pause"] = FormatDurationString(st.pause);
    }
    steps.push_back(step);
  }
  j["rollout"] = {{"strategy", s.rollout.strategy},
                  {"steps", steps},
                  {"analysis",
                   {{"maxErrorRate", s.rollout.analysis.max_error_rate},
                    {"maxLatencyP99Ratio", s.rollout.analysis.max_latency_p99_ratio},
                    {"minRequests", s.rollout.analysis.min_requests}}},
                  {"maxSurge", s.rollout.max_surge},
                  {"maxUnavailable", s.rollout.max_unavailable},
                  {"scaleDownDelay", FormatDurationString(s.rollout.scale_down_delay)}};
  if (!s.rollout.sticky_key.empty()) j["rollout"]["stickyKey"] = s.rollout.sticky_key;
  return j;
}

std::string EncodeForStore(const ModelDeployment& d) {
  nlohmann::json labels = nlohmann::json::object();
  for (const auto& [k, v] : d.labels) labels[k] = v;
  return nlohmann::json{{"labels", labels}, {"spec", SpecToJson(d.spec)}}.dump();
}

absl::StatusOr<ModelDeployment> DecodeFromStore(const std::string& name, const std::string& text) {
  auto env = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (env.is_discarded() || !env.is_object()) {
    return absl::DataLossError("stored " + name + ": not a JSON object");
  }
  nlohmann::json doc = {{"apiVersion", kModelDeploymentApiVersion},
                        {"kind", kModelDeploymentKind},
                        {"metadata",
                         {{"name", name}, {"labels", env.value("labels", nlohmann::json::object())}}},
                        {"spec", env.value("spec", nlohmann::json::object())}};
  return ParseModelDeployment(doc.dump(), "stored " + name);
}

}  // namespace kiln
