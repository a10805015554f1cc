#pragma once

// The controller's admin API over the Store, Kubernetes-shaped so kubectl habits carry over:
//
//   GET    /apis/serving.kiln.dev/v1alpha1/modeldeployments            list
//   POST   /apis/serving.kiln.dev/v1alpha1/modeldeployments            create (YAML or JSON)
//   GET    /apis/serving.kiln.dev/v1alpha1/modeldeployments/NAME       get
//   PUT    /apis/serving.kiln.dev/v1alpha1/modeldeployments/NAME       replace (optimistic when
//                                                                     metadata.resourceVersion
//                                                                     is given)
//   DELETE /apis/serving.kiln.dev/v1alpha1/modeldeployments/NAME       delete
//   GET|PUT .../modeldeployments/NAME/scale                            {"spec": {"replicas": N}}
//   GET    .../modeldeployments/NAME/events                           its newest 100 events
//   POST   .../modeldeployments/NAME/rollout                          {"action": "..."}
//   GET    /apis/serving.kiln.dev/v1alpha1/nodes                      the controller's nodes
//   DELETE /apis/serving.kiln.dev/v1alpha1/nodes/NAME                 forget a node whose agent
//                                                                     is gone (409 while it is
//                                                                     connected)
//   GET    /apis/serving.kiln.dev/v1alpha1/replicas                   every node's replicas
//   GET    /apis/serving.kiln.dev/v1alpha1/events                     the newest 500 events
//   GET    /healthz
//
// Errors are Kubernetes Status objects: 400 Invalid (the field named), 401 Unauthorized, 404
// NotFound, 409 AlreadyExists / Conflict, 410 Gone. The HTTP listener (admin_server) only
// moves bytes; everything here is testable without a socket.

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "controller/store.h"
#include "nlohmann/json.hpp"

namespace kiln {

inline constexpr char kDeploymentsPath[] = "/apis/serving.kiln.dev/v1alpha1/modeldeployments";
inline constexpr char kNodesPath[] = "/apis/serving.kiln.dev/v1alpha1/nodes";
inline constexpr char kReplicasPath[] = "/apis/serving.kiln.dev/v1alpha1/replicas";
inline constexpr char kEventsPath[] = "/apis/serving.kiln.dev/v1alpha1/events";

struct ApiRequest {
  std::string method;         // GET, POST, PUT, DELETE
  std::string path;           // without the query
  std::string body;
  std::string authorization;  // the Authorization header
};

struct ApiResponse {
  int code = 200;
  std::string body;
  std::string content_type = "application/json";
};

class AdminApi {
 public:
  // `token` empty: no authentication; otherwise every request but /healthz needs
  // `Authorization: Bearer <token>`.
  AdminApi(Store* store, std::string token);
  ApiResponse Handle(const ApiRequest& request);
  // GET /apis/serving.kiln.dev/v1alpha1/nodes answers with this (the controller's view), and
  // GET .../replicas with its nodes' replicas, each naming its node.
  void SetNodesSource(std::function<std::string()> nodes) { nodes_ = std::move(nodes); }
  // DELETE .../nodes/NAME calls this.
  void SetNodeRemover(std::function<absl::Status(const std::string&)> f) {
    forget_node_ = std::move(f);
  }
  // GET /metrics answers with this (Prometheus text; behind the bearer token like the rest).
  void SetMetricsSource(std::function<std::string()> metrics) { metrics_ = std::move(metrics); }
  // POST .../modeldeployments/NAME/rollout {"action": "pause|resume|abort|promote"}. `f`
  // answers true once the action is written down (200), false when it is only accepted (202).
  using RolloutActionFn =
      std::function<absl::StatusOr<bool>(const std::string&, const std::string&)>;
  void SetRolloutActions(RolloutActionFn f) { rollout_action_ = std::move(f); }

  // An EventList of `events` (each with its object, type, reason, message and time).
  static nlohmann::json RenderEvents(const std::vector<ObjectEvent>& events);

  // The object as the API shows it (apiVersion, kind, metadata, spec, status).
  static nlohmann::json Render(const StoredObject& o);

 private:
  ApiResponse Create(const std::string& body);
  ApiResponse Replace(const std::string& name, const std::string& body);
  ApiResponse Scale(const std::string& name, const std::string& body);

  Store* store_;
  const std::string token_;
  std::function<std::string()> nodes_;
  std::function<std::string()> metrics_;
  std::function<absl::Status(const std::string&)> forget_node_;
  RolloutActionFn rollout_action_;
};

// How the admin API answers a rollout action: true ("applied", 200) once the controller has
// written it down, false ("requested", 202) when `max_waiting` callers wait already (the admin
// server has few threads, and its health probes must get through), or the ticket's error.
// `request` queues the action and gives its ticket; `await` waits up to the given time for the
// ticket (a zero wait, for an action nobody waits for, marks it as nobody's). Thread-safe.
class RolloutActionAnswers {
 public:
  using Request = std::function<absl::StatusOr<uint64_t>()>;
  using Await = std::function<absl::Status(uint64_t, absl::Duration)>;
  RolloutActionAnswers(int max_waiting, absl::Duration timeout)
      : max_waiting_(max_waiting), timeout_(timeout) {}
  absl::StatusOr<bool> Answer(const Request& request, const Await& await);

 private:
  const int max_waiting_;
  const absl::Duration timeout_;
  std::atomic<int> waiting_{0};
};

// A Kubernetes Status object for an error; `code` is the HTTP status it maps to.
ApiResponse ErrorResponse(const absl::Status& status);
int HttpCodeFor(absl::StatusCode code);

}  // namespace kiln
