#include "controller/admin_api.h"

#include "absl/time/time.h"
#include "common/status.h"
#include "common/uri.h"
#include "controller/model_deployment.h"

namespace kiln {

namespace {

nlohmann::json ParseOr(const std::string& text, nlohmann::json def) {
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  return j.is_discarded() ? def : j;
}

ApiResponse Json(int code, const nlohmann::json& j) {
  ApiResponse r;
  r.code = code;
  r.body = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return r;
}

const char* ReasonFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
      return "Invalid";
    case absl::StatusCode::kNotFound:
      return "NotFound";
    case absl::StatusCode::kAlreadyExists:
      return "AlreadyExists";
    case absl::StatusCode::kAborted:
      return "Conflict";
    case absl::StatusCode::kUnauthenticated:
      return "Unauthorized";
    case absl::StatusCode::kOutOfRange:
      return "Gone";
    case absl::StatusCode::kUnavailable:
      return "ServiceUnavailable";
    case absl::StatusCode::kUnimplemented:
      return "MethodNotAllowed";
    case absl::StatusCode::kDeadlineExceeded:
      return "Timeout";
    default:
      return "InternalError";
  }
}

// A request refused for the state of what it names (a node still connected, no rollout in
// progress) is a conflict with that state, 409, as Kubernetes answers.
absl::Status AsConflict(absl::Status s) {
  if (s.code() == absl::StatusCode::kFailedPrecondition) return absl::AbortedError(s.message());
  return s;
}

}  // namespace

int HttpCodeFor(absl::StatusCode code) {
  // Kubernetes' choices where they differ from the REST frontends' mapping: a watch too far
  // behind is 410 Gone, an unsupported method 405.
  if (code == absl::StatusCode::kOutOfRange) return 410;
  if (code == absl::StatusCode::kUnimplemented) return 405;
  return HttpStatusFromCode(code);
}

ApiResponse ErrorResponse(const absl::Status& status) {
  int code = HttpCodeFor(status.code());
  return Json(code, {{"apiVersion", "v1"},
                     {"kind", "Status"},
                     {"status", "Failure"},
                     {"message", std::string(status.message())},
                     {"reason", ReasonFor(status.code())},
                     {"code", code}});
}

AdminApi::AdminApi(Store* store, std::string token) : store_(store), token_(std::move(token)) {}

nlohmann::json AdminApi::Render(const StoredObject& o) {
  nlohmann::json env = ParseOr(o.spec, nlohmann::json::object());
  nlohmann::json meta = {{"name", o.name},
                         {"uid", o.uid},
                         {"generation", o.generation},
                         {"resourceVersion", std::to_string(o.resource_version)},
                         {"creationTimestamp",
                          absl::FormatTime("%Y-%m-%dT%H:%M:%SZ",
                                           absl::FromUnixMicros(o.created_unix_micros),
                                           absl::UTCTimeZone())}};
  if (env.contains("labels") && !env["labels"].empty()) meta["labels"] = env["labels"];
  return {{"apiVersion", kModelDeploymentApiVersion},
          {"kind", kModelDeploymentKind},
          {"metadata", meta},
          {"spec", env.value("spec", nlohmann::json::object())},
          {"status", ParseOr(o.status, nlohmann::json::object())}};
}

ApiResponse AdminApi::Handle(const ApiRequest& r) {
  if (r.path == "/healthz") {
    ApiResponse ok;
    ok.body = "ok\n";
    ok.content_type = "text/plain";
    return ok;
  }
  if (!token_.empty() && r.authorization != "Bearer " + token_) {
    return ErrorResponse(absl::UnauthenticatedError(
        r.authorization.empty() ? "this server needs Authorization: Bearer <token>"
                                : "the bearer token is not valid"));
  }
  if (r.path == "/metrics" && metrics_) {
    if (r.method != "GET") {
      return ErrorResponse(absl::UnimplementedError(r.method + " is not allowed on " + r.path));
    }
    ApiResponse out;
    out.body = metrics_();
    out.content_type = "text/plain; version=0.0.4";
    return out;
  }
  if (r.path == kNodesPath && nodes_) {
    if (r.method != "GET") {
      return ErrorResponse(absl::UnimplementedError(r.method + " is not allowed on " + r.path));
    }
    ApiResponse out;
    out.body = nodes_();
    return out;
  }
  if (r.path.rfind(std::string(kNodesPath) + "/", 0) == 0 && forget_node_) {
    const std::string segment = r.path.substr(std::string(kNodesPath).size() + 1);
    if (r.method != "DELETE") {
      return ErrorResponse(absl::UnimplementedError(r.method + " is not allowed on " + r.path));
    }
    if (segment.empty() || segment.find('/') != std::string::npos) {
      return ErrorResponse(absl::NotFoundError("no such path: " + r.path));
    }
    const std::string name = PercentDecode(segment);  // kilnctl escapes what a path cannot hold
    absl::Status s = AsConflict(forget_node_(name));  // a node still connected: 409
    if (!s.ok()) return ErrorResponse(s);
    return Json(200, {{"kind", "Status"},
                      {"apiVersion", "v1"},
                      {"status", "Success"},
                      {"details", {{"name", name}, {"kind", "nodes"}}}});
  }
  if (r.path == kReplicasPath && nodes_) {
    if (r.method != "GET") {
      return ErrorResponse(absl::UnimplementedError(r.method + " is not allowed on " + r.path));
    }
    auto nodes = nlohmann::json::parse(nodes_(), nullptr, false);
    nlohmann::json items = nlohmann::json::array();
    if (nodes.is_object() && nodes.contains("items")) {
      for (const auto& n : nodes["items"]) {
        for (const auto& rep : n.value("replicas", nlohmann::json::array())) {
          nlohmann::json one = rep;
          one["node"] = n.value("name", "");
          items.push_back(std::move(one));
        }
      }
    }
    return Json(200, {{"kind", "ReplicaList"}, {"items", items}});
  }
  if (r.path == kEventsPath) {
    if (r.method != "GET") {
      return ErrorResponse(absl::UnimplementedError(r.method + " is not allowed on " + r.path));
    }
    auto events = store_->ListEvents(kModelDeploymentKind, "", 500);
    if (!events.ok()) return ErrorResponse(events.status());
    return Json(200, RenderEvents(*events));
  }
  const std::string prefix = kDeploymentsPath;
  if (r.path.rfind(prefix, 0) != 0) {
    return ErrorResponse(absl::NotFoundError("no such path: " + r.path));
  }
  std::string rest = r.path.substr(prefix.size());
  if (rest.empty() || rest == "/") {
    if (r.method == "GET") {
      auto list = store_->List(kModelDeploymentKind);
      if (!list.ok()) return ErrorResponse(list.status());
      auto rv = store_->CurrentResourceVersion();
      nlohmann::json items = nlohmann::json::array();
      for (const auto& o : *list) items.push_back(Render(o));
      return Json(200, {{"apiVersion", kModelDeploymentApiVersion},
                        {"kind", "ModelDeploymentList"},
                        {"metadata", {{"resourceVersion", std::to_string(rv.ok() ? *rv : 0)}}},
                        {"items", items}});
    }
    if (r.method == "POST") return Create(r.body);
    return ErrorResponse(absl::UnimplementedError(r.method + " is not allowed on " + r.path));
  }
  if (rest[0] != '/') return ErrorResponse(absl::NotFoundError("no such path: " + r.path));
  rest = rest.substr(1);
  std::string name = rest;
  std::string sub;
  if (size_t slash = rest.find('/'); slash != std::string::npos) {
    name = rest.substr(0, slash);
    sub = rest.substr(slash + 1);
  }
  if (name.empty()) return ErrorResponse(absl::NotFoundError("no such path: " + r.path));
  if (sub == "scale") {
    if (r.method == "PUT") return Scale(name, r.body);
    if (r.method != "GET") {
      return ErrorResponse(absl::UnimplementedError(r.method + " is not allowed on " + r.path));
    }
    auto o = store_->Get(kModelDeploymentKind, name);
    if (!o.ok()) return ErrorResponse(o.status());
    nlohmann::json obj = Render(*o);
    return Json(200, {{"kind", "Scale"},
                      {"metadata", {{"name", name}, {"resourceVersion", obj["metadata"]["resourceVersion"]}}},
                      {"spec", {{"replicas", obj["spec"].value("replicas", 0)}}},
                      {"status", {{"replicas", obj["status"].value("replicas", 0)}}}});
  }
  if (sub == "rollout" && rollout_action_) {
    if (r.method != "POST") {
      return ErrorResponse(absl::UnimplementedError(r.method + " is not allowed on " + r.path));
    }
    auto j = nlohmann::json::parse(r.body, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("action") || !j["action"].is_string()) {
      return ErrorResponse(absl::InvalidArgumentError(
          "action: the body must be {\"action\": \"pause|resume|abort|promote\"}"));
    }
    if (auto o = store_->Get(kModelDeploymentKind, name); !o.ok()) return ErrorResponse(o.status());
    // No rollout in progress, or the action dropped or replaced: 409. OK once the action is
    // taken and written down in the deployment's status.
    absl::StatusOr<bool> written = rollout_action_(name, j["action"].get<std::string>());
    if (!written.ok()) return ErrorResponse(AsConflict(written.status()));
    return Json(*written ? 200 : 202,
                {{"kind", "Status"},
                 {"status", "Success"},
                 {"message", j["action"].get<std::string>() + (*written ? " applied" : " requested")}});
  }
  if (sub == "events") {
    if (r.method != "GET") {
      return ErrorResponse(absl::UnimplementedError(r.method + " is not allowed on " + r.path));
    }
    if (auto o = store_->Get(kModelDeploymentKind, name); !o.ok()) return ErrorResponse(o.status());
    auto events = store_->ListEvents(kModelDeploymentKind, name, 100);
    if (!events.ok()) return ErrorResponse(events.status());
    return Json(200, RenderEvents(*events));
  }
  if (!sub.empty()) return ErrorResponse(absl::NotFoundError("no such path: " + r.path));
  if (r.method == "GET") {
    auto o = store_->Get(kModelDeploymentKind, name);
    if (!o.ok()) return ErrorResponse(o.status());
    return Json(200, Render(*o));
  }
  if (r.method == "PUT") return Replace(name, r.body);
  if (r.method == "DELETE") {
    auto o = store_->Get(kModelDeploymentKind, name);
    if (!o.ok()) return ErrorResponse(o.status());
    absl::Status s = store_->Delete(kModelDeploymentKind, name, o->resource_version);
    if (!s.ok()) return ErrorResponse(s);
    return Json(200, {{"apiVersion", "v1"}, {"kind", "Status"}, {"status", "Success"},
                      {"details", {{"name", name}, {"kind", "modeldeployments"}}}});
  }
  return ErrorResponse(absl::UnimplementedError(r.method + " is not allowed on " + r.path));
}

nlohmann::json AdminApi::RenderEvents(const std::vector<ObjectEvent>& events) {
  nlohmann::json items = nlohmann::json::array();
  for (const auto& e : events) {
    items.push_back({{"involvedObject", {{"kind", e.kind}, {"name", e.name}}},
                     {"type", e.type},
                     {"reason", e.reason},
                     {"message", e.message},
                     {"lastTimestamp", absl::FormatTime("%Y-%m-%dT%H:%M:%SZ",
                                                        absl::FromUnixMicros(e.unix_micros),
                                                        absl::UTCTimeZone())}});
  }
  return {{"apiVersion", "v1"}, {"kind", "EventList"}, {"items", items}};
}

ApiResponse AdminApi::Create(const std::string& body) {
  auto d = ParseModelDeployment(body, "request body");
  if (!d.ok()) return ErrorResponse(d.status());
  auto o = store_->Create(kModelDeploymentKind, d->name, EncodeForStore(*d));
  if (!o.ok()) return ErrorResponse(o.status());
  return Json(201, Render(*o));
}

ApiResponse AdminApi::Replace(const std::string& name, const std::string& body) {
  auto d = ParseModelDeployment(body, "request body");
  if (!d.ok()) return ErrorResponse(d.status());
  if (d->name != name) {
    return ErrorResponse(absl::InvalidArgumentError(
        "metadata.name: '" + d->name + "' does not match the name in the path '" + name + "'"));
  }
  auto o = store_->Update(kModelDeploymentKind, name, EncodeForStore(*d), d->resource_version);
  if (!o.ok()) return ErrorResponse(o.status());
  return Json(200, Render(*o));
}

ApiResponse AdminApi::Scale(const std::string& name, const std::string& body) {
  auto j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("spec") || !j["spec"].is_object() ||
      !j["spec"].contains("replicas") || !j["spec"]["replicas"].is_number_integer()) {
    return ErrorResponse(absl::InvalidArgumentError(
        "spec.replicas: the body must be {\"spec\": {\"replicas\": N}} with an integer N"));
  }
  // Read, change, write; again when the controller wrote the status in between (a conflict
  // on the resourceVersion that says nothing about the spec), a few times at most.
  absl::StatusOr<StoredObject> updated;
  absl::StatusOr<ModelDeployment> d;
  for (int attempt = 0; attempt < 5; ++attempt) {
    auto o = store_->Get(kModelDeploymentKind, name);
    if (!o.ok()) return ErrorResponse(o.status());
    d = DecodeFromStore(o->name, o->spec);
    if (!d.ok()) return ErrorResponse(d.status());
    if (d->spec.autoscale) {
      return ErrorResponse(absl::InvalidArgumentError(
          "spec.replicas: '" + name + "' autoscales (spec.autoscale); change its min and max instead"));
    }
    d->spec.replicas = j["spec"]["replicas"].get<int64_t>();
    if (absl::Status s = ValidateModelDeployment(*d); !s.ok()) return ErrorResponse(s);
    updated = store_->Update(kModelDeploymentKind, name, EncodeForStore(*d), o->resource_version);
    if (updated.ok() || updated.status().code() != absl::StatusCode::kAborted) break;
  }
  if (!updated.ok()) return ErrorResponse(updated.status());
  return Json(200, {{"kind", "Scale"},
                    {"metadata", {{"name", name}, {"resourceVersion", std::to_string(updated->resource_version)}}},
                    {"spec", {{"replicas", d->spec.replicas}}}});
}

absl::StatusOr<bool> RolloutActionAnswers::Answer(const Request& request, const Await& await) {
  auto ticket = request();
  if (!ticket.ok()) return ticket.status();
  if (waiting_.fetch_add(1) >= max_waiting_) {
    waiting_.fetch_sub(1);
    // Nobody waits for its answer: a look that finds none marks it so (forgotten first).
    (void)await(*ticket, absl::ZeroDuration());
    return false;
  }
  absl::Status s = await(*ticket, timeout_);
  waiting_.fetch_sub(1);
  if (!s.ok()) return s;
  return true;
}

}  // namespace kiln
