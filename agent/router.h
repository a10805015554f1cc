#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/data_channel.h"
#include "agent/router_policy.h"
#include "agent/supervisor.h"
#include "inference/grpc_service.grpc.pb.h"
#include "kiln/v1/control_plane.pb.h"

namespace kiln {

// What the router routes by: per model, weighted versions, a sticky key and endpoints.
struct RouterTable {
  struct Endpoint {
    std::string id;
    std::string version;
    std::string grpc_address;  // host:port
    std::string http_address;  // host:port
    bool local = false;
    // A local replica's data socket (common/data_frames.h): gRPC ModelInfer and REST
    // inference go there instead of through a second loopback hop. Empty: the gRPC and HTTP
    // addresses.
    std::string data_socket;
  };
  struct Route {
    std::string model;
    std::vector<WeightedVersion> versions;
    std::string sticky_header;     // lower-case header name, or empty
    std::string sticky_parameter;  // request parameter name, or empty
    std::vector<Endpoint> endpoints;
  };
  std::map<std::string, Route> routes;
};

// Builds the table from the routing table (file or controller) and the node's replicas: a
// local replica is an endpoint only while it is SERVING, healthy and not assigned WARM. The
// routing table's endpoints on `node` itself are left out (the controller sends every node the
// same table; its own replicas are reached directly, never through its own ingress). A model
// with SERVING replicas but no route gets one: its serving versions, equal weights.
RouterTable BuildRouterTable(const v1::RoutingTable& routing,
                             const std::vector<ReplicaView>& replicas, const std::string& node);

// The header (gRPC metadata and HTTP) a router puts on a call it sends on to another node's
// router, naming itself. That router serves the call from its own replicas only, with the
// version the first one chose (set in the request), so a version picked by weight or sticky
// key is the version that serves.
inline constexpr char kForwardedHeader[] = "kiln-forwarded-by";
// The header (gRPC metadata and HTTP) a router puts on a forwarded call's failure, naming
// itself, when it is not stopping and still serves other versions of the model: the version
// asked is what failed there (no serving replica of it, its routing table being newer than the
// sender's), so the sender's retry rules out that endpoint only, not the node's other versions.
// Without it (a node stopping, or serving none of the model) the whole node is ruled out.
inline constexpr char kAnsweredByHeader[] = "kiln-answered-by";

// Node ingress: the Open Inference Protocol over gRPC and REST in front of the node's
// replicas. Picks the version (weight or sticky key), then the endpoint with the fewest
// outstanding requests, local first; retries once elsewhere when the replica went away
// (UNAVAILABLE, or CANCELLED by its server's shutdown); tells which
// version served (gRPC: parameter and metadata `kiln-version`; REST: header `kiln-version`
// and parameter). Channels to replicas are pooled and kept alive.
class Router {
 public:
  struct Options {
    std::string bind_address = "0.0.0.0";
    int grpc_port = 8001;
    int http_port = 8000;
    int64_t max_request_bytes = 64LL * 1024 * 1024;
    // Listening sockets handed over (systemd socket activation) to serve instead of binding
    // the ports: the kernel queues connections on them while the agent restarts, so clients
    // see no refused connection. -1 = bind the port.
    int grpc_listen_fd = -1;
    int http_listen_fd = -1;
    // This node's name, sent in kForwardedHeader on calls passed to another node.
    std::string node_name = "kiln-agent";
    // Busy-polling local replicas' data sockets for answers (agent/busy_poll.h).
    BusyPollPolicy busy_poll;
    int http_threads = 1;  // the REST server's
  };
  // Serves `table` (when given) from the first request on.
  static absl::StatusOr<std::unique_ptr<Router>> Start(
      Options options, std::shared_ptr<const RouterTable> table = nullptr);
  ~Router();

  void SetTable(std::shared_ptr<const RouterTable> table);
  int grpc_port() const;
  int http_port() const;
  void Stop();

  // Routing decisions, public for the servers (and tests).
  struct Choice {
    RouterTable::Endpoint endpoint;
    std::string version;
  };
  // `local_only`: the call came from another node's router, which chose its version; it is
  // served here or not at all (never sent on, so it cannot go round between nodes).
  absl::StatusOr<Choice> Choose(const std::string& model, const std::string& version,
                                const std::string& sticky_value, bool sticky_given,
                                const std::set<std::string>& exclude,
                                bool local_only = false) const;
  // Adds to `exclude` every endpoint of `model` on the other node `failed` is on (its other
  // versions): a retry after that node did not answer goes to another.
  void ExcludeNode(const std::string& model, const RouterTable::Endpoint& failed,
                   std::set<std::string>* exclude) const;
  // Stop() has begun: no call is retried.
  bool stopping() const { return stopping_.load(); }
  // The sticky key configured for `model` ("" when none): {header, parameter}.
  std::pair<std::string, std::string> StickyKey(const std::string& model) const;
  bool Ready(const std::string& model, const std::string& version) const;
  // This node's name for kAnsweredByHeader on a failure of a call forwarded here for `model`,
  // or "" when the header is not to be sent (see there).
  std::string AnsweredBy(const std::string& model) const;

  // Outstanding-request accounting around each forwarded call.
  void Begin(const std::string& endpoint_id);
  void End(const std::string& endpoint_id);
  // Around each call sent on over a gRPC stub, until its callback is done with the router:
  // Stop waits for them (their callbacks run on gRPC's threads and use this object).
  void GrpcCallStarted() { grpc_calls_out_++; }
  void GrpcCallEnded() { grpc_calls_out_--; }
  int64_t grpc_calls_out() const { return grpc_calls_out_.load(); }
  // The gRPC client for `address`, shared by the calls to it; one the table no longer routes
  // to is dropped by SetTable (a call out on it keeps it).
  std::shared_ptr<inference::GRPCInferenceService::Stub> StubFor(const std::string& address);
  size_t stubs() const {
    absl::MutexLock lock(&mu_);
    return stubs_.size();
  }
  // The channel to a local replica's data socket (kept while calls are in flight on it);
  // null once the router is stopping.
  std::shared_ptr<DataChannel> ChannelFor(const std::string& path);
  const std::string& node_name() const { return options_.node_name; }
  uint64_t retries() const { return retries_.load(); }
  void CountRetry() { retries_++; }
  // gRPC ModelInfer calls forwarded (tries, retries included): to local replicas' data
  // sockets, and over gRPC.
  uint64_t forwarded_data_socket() const { return forwarded_data_socket_.load(); }
  uint64_t forwarded_grpc() const { return forwarded_grpc_.load(); }
  void CountForward(bool data_socket) { (data_socket ? forwarded_data_socket_ : forwarded_grpc_)++; }
  // REST inference calls forwarded (tries, retries included): to local replicas' data
  // sockets, and over HTTP.
  uint64_t forwarded_rest_data_socket() const { return forwarded_rest_data_socket_.load(); }
  uint64_t forwarded_rest_http() const { return forwarded_rest_http_.load(); }
  void CountRestForward(bool data_socket) {
    (data_socket ? forwarded_rest_data_socket_ : forwarded_rest_http_)++;
  }

 private:
  class Impl;
  explicit Router(Options options);
  // Fails the calls on every data socket and closes them (Stop).
  void FailChannels();
  // Waits (bounded) for the calls out over gRPC stubs to be done with the router, then lets
  // every stub go on this thread once no call holds it (Stop).
  void ReleaseStubs();

  const Options options_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const RouterTable> table_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> outstanding_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<inference::GRPCInferenceService::Stub>> stubs_
      ABSL_GUARDED_BY(mu_);
  // Stubs of addresses no longer routed, kept until no call holds them (SetTable).
  std::vector<std::shared_ptr<inference::GRPCInferenceService::Stub>> stubs_retired_
      ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> retries_{0};
  std::atomic<int64_t> grpc_calls_out_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> forwarded_data_socket_{0};
  std::atomic<uint64_t> forwarded_grpc_{0};
  std::atomic<uint64_t> forwarded_rest_data_socket_{0};
  std::atomic<uint64_t> forwarded_rest_http_{0};
  const std::shared_ptr<SpinSlots> spin_slots_;  // shared by every data channel's readers
  std::unique_ptr<Impl> impl_;
  // Data sockets of local replicas; one that left the table goes once no call is on it.
  // Last: destroyed first (their readers finish calls into the members above).
  std::map<std::string, std::shared_ptr<DataChannel>> channels_ ABSL_GUARDED_BY(mu_);
  bool channels_closed_ ABSL_GUARDED_BY(mu_) = false;  // stopping: no new channels
  // Channels that left the table, kept until nothing else holds them (SetTable).
  std::vector<std::shared_ptr<DataChannel>> retired_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln
