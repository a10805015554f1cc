#pragma once

// The controller's loop and the agents' side of kiln.v1.ControlPlane.
//
// Each agent keeps one Connect stream open: Register first, then NodeStatus every second,
// Ack/Nack for what it is sent. Every tick the controller reads the ModelDeployments from the
// store, places their replicas on the Ready nodes (placement.h), and sends each node whose
// assignment or routing table changed the whole new one. Generations only grow, also across
// controller restarts (they start above what the node reports and above the wall clock in
// microseconds), so an agent never mistakes a new assignment for one it applied. After a
// start the controller observes for `observe_for` (agents re-register with the replicas they
// run) before it sends anything, so a controller restart does not churn replicas. A Nack'd
// generation is reported in the log, in one AssignmentRefused event per deployment it held
// replicas of, and in their status (condition AssignmentsApplied False, naming the node and
// why, until the node acks an assignment); it is not re-sent in a loop: the next change makes
// a new one. Deployment status (replicas, ready, warm, conditions) is
// written back to the store.

#include <atomic>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/histogram.h"
#include "controller/autoscale.h"
#include "controller/model_deployment.h"
#include "controller/node_registry.h"
#include "controller/rollout.h"
#include "controller/routing.h"
#include "controller/store.h"
#include "grpcpp/support/byte_buffer.h"
#include "kiln/v1/control_plane.grpc.pb.h"
#include "nlohmann/json.hpp"

namespace kiln {

struct ControllerOptions {
  absl::Duration tick = absl::Milliseconds(200);
  absl::Duration observe_for = absl::Seconds(10);
  // Autoscaled deployments scale down only after their load has stayed low this long.
  absl::Duration scale_down_stabilization = absl::Minutes(5);
  // Scale-down to WARM first: replicas a deployment no longer needs (its count went down) stay
  // WARM this long (loaded, not routed: a scale-up within it promotes them in milliseconds),
  // then drain. WARM replicas are the first to go when a GPU needs room. 0 = drain at once.
  absl::Duration scale_down_warm_for = absl::Minutes(5);
  NodeRegistry::Options leases;
  // A node Lost this much longer (its lease's second grace passed; a stream a dead machine
  // left open is ended) is forgotten: gone from the node list and the metrics. Its replicas' ids stay retired (never
  // given to new replicas) in case it comes back with them running. 0 = never.
  absl::Duration forget_lost_after = absl::Hours(1);
  // A deployment whose replicas pile up on a node (placement.h, skew) for this long gets one
  // moved, make-before-break; a move whose replacement never serves is given up after
  // `move_deadline`.
  absl::Duration rebalance_after = absl::Seconds(30);
  // A GPU is overloaded when its node reports it throttling (thermal, power brake, hardware
  // slowdown) or at least this busy (percent) with requests queued in its replicas; replicas
  // then move off it one at a time (placement.h). 0 = never.
  int overload_utilization_pct = 95;
  absl::Duration move_deadline = absl::Minutes(10);
  RoutingOptions routing;
  // Status counters that move with every report (per-version requests, errors, error rate,
  // p99) are written at most this often when nothing else in the status changed: each status
  // write is a store transaction (on Kubernetes, an API request).
  absl::Duration status_counters_every = absl::Seconds(10);
  // Mutual TLS: a node registers only under a name its verified client certificate carries.
  bool require_node_identity = false;
};

// When the decision loop's next pass starts, from the end of the last one: a tick later, or
// when a node's lease ends (`to_lease` from now) if that comes sooner, so a lost node's
// replicas are placed again at once instead of up to a tick and a pass later. A pass that would
// still run when a lease ends (`pass`: how long one may take) waits for it instead, at most a
// pass longer than a tick: the lost node's replicas then wait for that one pass, not for the
// rest of a running one and another. (A lease read from reports not yet taken ends no sooner
// than it says: a wake for a node that did report costs one early pass.)
absl::Duration NextPassIn(absl::Duration tick, absl::Duration to_lease, absl::Duration pass);

// Cuts `text` to at most `max_bytes` (at a UTF-8 character's start) and marks it with "...".
void CutShort(std::string* text, size_t max_bytes);

class Controller
    : public v1::ControlPlane::WithRawCallbackMethod_Connect<v1::ControlPlane::Service> {
 public:
  Controller(ControllerOptions options, Store* store, Clock* clock);
  ~Controller() override;

  void Start();  // the loop thread
  void Stop();   // ends the loop and every agent stream

  // One agent's stream, served without a thread of its own (gRPC's callback API): tens of
  // thousands of agents cost no more threads than a few. The messages are kiln.v1's
  // AgentMessage and ControllerMessage; the stream moves their bytes so that one routing
  // table, serialized once, goes to every node without a copy.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Connect(
      grpc::CallbackServerContext* context) override;

  // One pass of the loop (public for tests).
  void Tick();
  // Nodes with their health, for the admin API ({"nodes": [...]}).
  std::string NodesJson();
  // The controller's own metrics, Prometheus text (the admin API's /metrics): nodes by health,
  // deployments, replicas assigned, nodes refusing their assignment, deployments short of
  // replicas, replicas moving, rollbacks, and how long each pass of the decision loop takes.
  std::string MetricsText();
  // pause | resume | abort | promote the deployment's rollout on the next tick; the ticket is
  // for AwaitRolloutAction. NOT_FOUND for an unknown deployment, FAILED_PRECONDITION when no
  // rollout is in progress.
  absl::StatusOr<uint64_t> RequestRolloutAction(const std::string& name, const std::string& action);
  // Waits up to `timeout` for the action of `ticket` to be taken by a pass and written down in
  // its deployment's status, so that it outlives a controller killed right after: OK then.
  // FAILED_PRECONDITION when the pass dropped it (the rollout it was asked of was superseded),
  // ABORTED when a later action replaced it before a pass took it, DEADLINE_EXCEEDED when it is
  // not written yet (it still may be), UNAVAILABLE when the controller stopped first.
  absl::Status AwaitRolloutAction(uint64_t ticket, absl::Duration timeout);
  // Forgets a node now (an operator removing a dead node, like `kubectl delete node`): its
  // replicas are placed elsewhere on the next pass without waiting out the lease. NOT_FOUND for
  // an unknown node, FAILED_PRECONDITION while its agent is connected and reporting,
  // UNAVAILABLE on a controller that is not the leader (it holds no nodes).
  absl::Status ForgetNode(const std::string& name);
  // Agent streams that registered a node (a reconnect counts again): the
  // kiln_controller_registrations_total counter.
  uint64_t Registrations() const { return registrations_.load(); }
  // For tests: Acks and Nacks received and not yet taken by a pass (or a read of the nodes).
  size_t QueuedAcksForTest();
  // A stored status's conditions: type -> (status, lastTransitionTime).
  using ConditionsBefore = std::map<std::string, std::pair<std::string, std::string>>;

  // A Nack's reason is cut to this many bytes; a deployment's AssignmentsApplied message lists
  // refusing nodes up to this many (the API caps a condition's message at 32768).
  static constexpr size_t kMaxNackReason = 1024;
  static constexpr size_t kMaxConditionMessage = 8192;
  // Acks and Nacks kept between two passes, in all and from one stream (one node flooding
  // them cannot crowd the others out); more are dropped.
  static constexpr size_t kMaxQueuedAcks = 100000;
  static constexpr size_t kMaxQueuedAcksPerStream = 1000;
 private:
  // One agent's stream (controller.cc). The controller's loop never writes to it: it leaves
  // the latest Assignment and RoutingTable (each whole state, so a newer one replaces one not
  // yet sent) and the stream writes them as the agent takes them, so a slow or stuck agent
  // holds up nobody else. A NodeStatus waits in the stream until the loop takes it (a newer one
  // replaces it): reading an agent never waits for the loop.
  class Stream;
  struct Sent {
    int64_t assignment_generation = 0;
    std::string assignment;  // serialised replicas of the last assignment sent
    bool assignment_sent = false;  // to this stream (an empty assignment is one too)
    std::vector<v1::ReplicaSpec> replicas;
    int64_t routing_generation = 0;
    int routing_group = -1;       // the group whose table it was last sent
    uint64_t routes_version = 0;  // that table's version then
    std::string nack;  // the last Nack's reason, if the last assignment was refused
  };
  // Why GPU `gpu` of a node reporting `status` is overloaded (ControllerOptions), or "".
  std::string Overloaded(const v1::GpuStatus& gpu, const v1::NodeStatus& status,
                         const Sent& sent) const;

  void Send(const std::string& node, const v1::ControllerMessage& m)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendRouting(const std::string& node, const grpc::ByteBuffer& table)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The stream's side: a Register (first or again), an Ack or Nack, its end.
  grpc::Status Registered(const std::shared_ptr<Stream>& stream, const v1::Register& r,
                          bool first);
  void Acked(const std::shared_ptr<Stream>& stream, v1::AgentMessage m);
  void Ended(const std::string& node, const Stream* stream);
  // Moves each stream's newest NodeStatus into the registry, after the Acks and Nacks that came
  // (TakeAcks).
  void TakeStatuses() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TakeAcks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps a forgotten node's replica ids retired and drops what was sent to it.
  // A stream the node still has open is handed to `to_end` (ended outside the lock).
  void Retire(const std::string& node, const NodeRecord& record, const std::string& why,
              std::vector<std::shared_ptr<Stream>>* to_end) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ControllerOptions options_;
  Store* store_;
  Clock* clock_;
  // When it began to lead (Start; construction for a loop driven by hand): it observes from
  // here, so a follower that wins the lease an hour after it started still waits for agents.
  absl::Time started_;
  // For /metrics: each pass of the loop (seconds, by the controller's clock), rollbacks, and
  // the deployments the last pass read.
  Histogram tick_seconds_{Histogram::ExponentialBounds(0.001, 2, 13)};
  // From a node's lease ending (Lost) to its replicas' new places handed to the other nodes'
  // streams: the decision after a node loss.
  Histogram node_loss_seconds_{Histogram::ExponentialBounds(0.001, 2, 13)};
  std::atomic<uint64_t> rollbacks_{0};
  std::atomic<uint64_t> nodes_forgotten_{0};
  std::atomic<uint64_t> registrations_{0};
  std::atomic<int64_t> deployments_{0};
  std::atomic<bool> leading_{false};  // Start() was called: this one runs the loop

  absl::Mutex mu_;
  NodeRegistry registry_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<Stream>> sessions_ ABSL_GUARDED_BY(mu_);
  // Every open stream, registered or not (Stop ends them all).
  std::map<const Stream*, std::weak_ptr<Stream>> streams_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Sent> sent_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> lost_ ABSL_GUARDED_BY(mu_);  // the nodes Lost at the last pass
  // Per node, the deployments a replica of which crash-looped or FAILED there, and when last
  // seen: placement keeps their new replicas off the node for kCrashMemory (placement.h).
  static constexpr absl::Duration kCrashMemory = absl::Minutes(10);
  std::map<std::string, std::map<std::string, absl::Time>> crash_sites_ ABSL_GUARDED_BY(mu_);
  // Forgotten nodes' replica ids until the node registers again: per node, oldest first, and
  // all of them in one set that placement reads as it is (not rebuilt every pass); at most
  // kMaxRetiredIds (the oldest node's go first).
  static constexpr size_t kMaxRetiredIds = 200000;
  std::deque<std::pair<std::string, std::vector<std::string>>> retired_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> retired_ids_ ABSL_GUARDED_BY(mu_);
  // Drops one node's entry of retired_ and its ids from retired_ids_.
  void Unretire(std::deque<std::pair<std::string, std::vector<std::string>>>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A node's previous report, on its way back to a stream to be parsed into (TakeStatuses).
  v1::NodeStatus spare_status_ ABSL_GUARDED_BY(mu_);
  // Streams holding a report not taken yet, each once: a pass takes these instead of asking
  // every stream (at 10,000 nodes most have nothing new between two passes).
  absl::Mutex reports_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::vector<std::shared_ptr<Stream>> reported_ ABSL_GUARDED_BY(reports_mu_);
  // Acks and Nacks as they came (the node's stream, message), taken in order by the next pass.
  std::vector<std::pair<std::shared_ptr<Stream>, v1::AgentMessage>> acks_
      ABSL_GUARDED_BY(reports_mu_);
  size_t acks_dropped_ ABSL_GUARDED_BY(reports_mu_) = 0;  // since the last pass took them
  std::map<const Stream*, size_t> acks_per_stream_ ABSL_GUARDED_BY(reports_mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Routing (routing.h): per deployment, what its route was built from and each group's
  // route; per group, its table, a count of its changes, and its message serialized once for
  // all the group's streams.
  struct RouteCache {
    std::string input;
    std::vector<v1::Route> groups;
  };
  std::map<std::string, RouteCache> route_cache_ ABSL_GUARDED_BY(mu_);
  struct GroupTable {
    std::string serialized;  // its routes
    uint64_t version = 1;
    uint64_t bytes_version = 0;
    int64_t generation = 0;
    grpc::ByteBuffer bytes;
  };
  std::vector<GroupTable> groups_ ABSL_GUARDED_BY(mu_);
  int64_t routing_generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> last_unplaced_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> last_moves_ ABSL_GUARDED_BY(mu_);
  // Skew: candidates since when, and the moves under way (passed to placement each tick until
  // the replica is gone).
  struct Rebalance {
    std::string reason;
    absl::Time since;
  };
  std::map<std::string, Rebalance> skew_seen_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Rebalance> rebalancing_ ABSL_GUARDED_BY(mu_);
  // WARM replicas evicted to make room for SERVING ones, until no node runs them (placement
  // must not keep them again from a node's stale report).
  std::map<std::string, Rebalance> evicted_ ABSL_GUARDED_BY(mu_);
  // Deployments refused because another one serves their model name (said once each).
  std::set<std::string> name_conflicts_ ABSL_GUARDED_BY(mu_);
  // Model name -> the deployment serving it (kept across ticks: an owner keeps its name).
  std::map<std::string, std::string> model_owner_ ABSL_GUARDED_BY(mu_);
  // Per deployment: its last status written, without the counters, and when.
  struct StatusWritten {
    std::string without_counters;
    absl::Time at;
  };
  std::map<std::string, StatusWritten> status_written_;  // the loop's own
  // Per deployment: the stored status last seen and its conditions (the loop's own).
  struct StoredConditions {
    std::string status;
    ConditionsBefore before;
  };
  std::map<std::string, StoredConditions> stored_conditions_;
  // Per deployment: its stored spec text and what it decodes to (the loop's own).
  struct Decoded {
    std::string spec;
    ModelDeployment d;
    int64_t generation = 0;  // the stored object's, when this spec was read
    std::string uid;         // the stored object's
  };
  std::map<std::string, Decoded> decoded_;
  // The spec `o`'s status says ran last (status.lastApplied), decoded; none when it has none
  // or kiln refuses that one too.
  static std::optional<Decoded> LastAppliedOf(const StoredObject& o);
  // Stored specs kiln refuses (name -> the text, and why); the last valid one (decoded_) runs.
  struct Invalid {
    std::string spec;
    std::string reason;
  };
  std::map<std::string, Invalid> invalid_;
  // Stored deployments not run because no spec of theirs was ever valid (name -> why), as of
  // the last pass: a rollout action asked of one is refused with the reason.
  std::map<std::string, std::string> not_run_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, AutoscaleHistory> autoscale_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> autoscaled_to_ ABSL_GUARDED_BY(mu_);
  // Per deployment: its stable version's SERVING count last tick, and the replicas its
  // scale-downs left WARM, each batch until it expires (scale_down_warm_for). Kept in the
  // deployment's status (scaleDownWarm) and taken from there after a restart.
  std::map<std::string, WarmAfterScaleDown> linger_ ABSL_GUARDED_BY(mu_);
  // How many replicas of `name` beyond `serving` stay WARM now (placement.h, linger);
  // `stored_status` seeds what this controller has not seen yet.
  int64_t LingerFor(const std::string& name, const std::string& version, int64_t serving,
                    absl::Time now, const std::string& stored_status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The scaleDownWarm status field of `name` (null when nothing lingers).
  nlohmann::json LingerJson(const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rollout state per deployment; seeded from the stored status after a restart.
  std::map<std::string, RolloutState> rollouts_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> rollout_uids_ ABSL_GUARDED_BY(mu_);
  // Rollout actions asked for, with the canary version they were asked of.
  struct PendingAction {
    RolloutAction action = RolloutAction::kNone;
    std::string canary;
    uint64_t ticket = 0;
  };
  std::map<std::string, PendingAction> pending_actions_ ABSL_GUARDED_BY(mu_);
  uint64_t action_tickets_ ABSL_GUARDED_BY(mu_) = 0;
  // Actions a pass took whose deployment's status is not written yet (deployment -> tickets).
  std::map<std::string, std::vector<uint64_t>> actions_unwritten_ ABSL_GUARDED_BY(mu_);
  // Actions ended (ticket -> how), until their waiter takes the answer; the oldest are
  // forgotten past kKeptActionResults (a waiter that gave up takes none). The marks of those
  // nobody waits for are bounded the same.
  static constexpr size_t kKeptActionResults = 1024;
  std::map<uint64_t, absl::Status> action_results_ ABSL_GUARDED_BY(mu_);
  // Actions whose waiter gave up: their answers are the first forgotten past the bound.
  std::set<uint64_t> abandoned_actions_ ABSL_GUARDED_BY(mu_);
  bool loop_done_ ABSL_GUARDED_BY(mu_) = false;  // Stop() joined the loop: nothing more is written
  void EndAction(uint64_t ticket, absl::Status result) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Nodes that refused an assignment since the last pass (node -> the reason): each deployment
  // with replicas in it gets an AssignmentRefused event.
  std::map<std::string, std::string> new_nacks_ ABSL_GUARDED_BY(mu_);
  std::thread loop_;
};

}  // namespace kiln
