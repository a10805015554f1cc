#include "agent/router.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <grpcpp/create_channel.h>

#include <cerrno>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/strings/str_split.h"
#include "common/data_frames.h"
#include "common/grpc_h2_server.h"
#include "common/grpc_status.h"
#include "common/http_client.h"
#include "common/http_server.h"
#include "common/oip_parameters.h"
#include "common/uri.h"
#include "common/logging.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace kiln {

using nlohmann::json;

RouterTable BuildRouterTable(const v1::RoutingTable& routing,
                             const std::vector<ReplicaView>& replicas, const std::string& node) {
  RouterTable t;
  for (const auto& r : routing.routes()) {
    RouterTable::Route route;
    route.model = r.model();
    for (const auto& v : r.versions()) route.versions.push_back({v.version(), v.weight()});
    const std::string& sticky = r.sticky_key();
    if (sticky.rfind("header:", 0) == 0) route.sticky_header = absl::AsciiStrToLower(sticky.substr(7));
    if (sticky.rfind("parameter:", 0) == 0) route.sticky_parameter = sticky.substr(10);
    for (const auto& e : r.endpoints()) {
      if (!node.empty() && e.node_name() == node) continue;
      route.endpoints.push_back(
          {e.replica_id(), e.version(), e.grpc_address(), e.http_address(), false, ""});
    }
    t.routes[route.model] = std::move(route);
  }
  for (const auto& v : replicas) {
    // Not one on its way out either: assigned WARM while it still serves. (One no longer
    // assigned is not healthy: its phase is STOPPING.)
    if (v.state != v1::SERVING || !v.healthy || v.grpc_port == 0 || v.spec.state() == v1::WARM) {
      continue;
    }
    RouterTable::Route& route = t.routes[v.spec.model()];
    route.model = v.spec.model();
    route.endpoints.push_back({v.spec.replica_id(), v.spec.version(),
                               "127.0.0.1:" + std::to_string(v.grpc_port),
                               "127.0.0.1:" + std::to_string(v.http_port), true, v.data_socket});
  }
  // Models served here without a route: every serving version, equal weights.
  for (auto& [model, route] : t.routes) {
    if (!route.versions.empty()) continue;
    std::set<std::string> versions;
    for (const auto& e : route.endpoints) versions.insert(e.version);
    for (const auto& v : versions) route.versions.push_back({v, 1});
  }
  return t;
}

Router::Router(Options options)
    : options_(std::move(options)),
      spin_slots_(std::make_shared<SpinSlots>(options_.busy_poll.on() ? options_.busy_poll.slots
                                                                      : 0)) {}

void Router::SetTable(std::shared_ptr<const RouterTable> table) {
  std::vector<std::shared_ptr<DataChannel>> gone;  // destroyed below, outside the lock
  std::vector<std::shared_ptr<inference::GRPCInferenceService::Stub>> stubs_gone;  // likewise
  {
    absl::MutexLock lock(&mu_);
    table_ = std::move(table);
    std::set<std::string> sockets;
    std::set<std::string> addresses;
    if (table_) {
      for (const auto& [model, route] : table_->routes) {
        for (const auto& e : route.endpoints) {
          if (!e.data_socket.empty()) sockets.insert(e.data_socket);
          addresses.insert(e.grpc_address);
        }
      }
    }
    // gRPC channels to addresses no longer routed to (a restarted replica's old port, a node
    // gone): dropped here; a call still out on one keeps it until it ends.
    for (auto it = stubs_.begin(); it != stubs_.end();) {
      if (addresses.count(it->first)) {
        ++it;
      } else {
        stubs_retired_.push_back(std::move(it->second));
        it = stubs_.erase(it);
      }
    }
    // A call's callback runs on one of gRPC's threads and drops its reference to the stub
    // there. Were it the last one, the channel would be torn down on that thread, which
    // Debian's gRPC 1.51 gets wrong: its callback thread pool then joins itself and frees its
    // completion queue while still in use (an abort in grpc_cq_internal_unref). So a dropped
    // stub is kept until nothing else holds it, and let go here, on the caller's thread.
    for (auto it = stubs_retired_.begin(); it != stubs_retired_.end();) {
      if (it->use_count() == 1) {
        stubs_gone.push_back(std::move(*it));  // a channel's teardown: not under mu_
        it = stubs_retired_.erase(it);
      } else {
        ++it;
      }
    }
    // Only a channel no call is on, and nobody holds (a caller between ChannelFor and its
    // Call is on its way to one).
    for (auto it = channels_.begin(); it != channels_.end();) {
      if (!sockets.count(it->first) && it->second.use_count() == 1 && it->second->Idle()) {
        retired_.push_back(std::move(it->second));
        it = channels_.erase(it);
      } else {
        ++it;
      }
    }
    // Destroyed only here, once nothing else holds them: a reader of another channel holding
    // one for a moment (a retry) must never be left with its last reference, whose
    // destructor would wait on that channel's readers (which might be waiting on it).
    for (auto it = retired_.begin(); it != retired_.end();) {
      if (it->use_count() == 1 && (*it)->Idle()) {
        gone.push_back(std::move(*it));
        it = retired_.erase(it);
      } else {
        ++it;
      }
    }
  }
  gone.clear();  // outside the lock: a channel's reader may be finishing a call that takes it
  stubs_gone.clear();
}

absl::StatusOr<Router::Choice> Router::Choose(const std::string& model, const std::string& version,
                                              const std::string& sticky_value, bool sticky_given,
                                              const std::set<std::string>& exclude,
                                              bool local_only) const {
  absl::MutexLock lock(&mu_);
  if (!table_) return absl::UnavailableError("the router has no routing table yet");
  auto it = table_->routes.find(model);
  if (it == table_->routes.end()) return absl::NotFoundError("unknown model '" + model + "'");
  const RouterTable::Route& route = it->second;
  std::string chosen = version;
  if (chosen.empty()) {
    thread_local std::mt19937_64 rng(std::random_device{}());
    auto v = PickVersion(route.versions,
                         sticky_given ? std::optional<std::string>(sticky_value) : std::nullopt,
                         rng());
    if (!v.ok()) return absl::UnavailableError(std::string(v.status().message()));
    chosen = *v;
  }
  std::vector<RouteEndpoint> eps;
  for (const auto& e : route.endpoints) {
    auto o = outstanding_.find(e.id);
    eps.push_back({e.id, e.version, e.local, e.local || !local_only,
                   o == outstanding_.end() ? 0 : o->second});
  }
  auto idx = PickEndpoint(eps, chosen, exclude);
  if (!idx.ok() && version.empty()) {
    // The weighted version has no serving replica here (a canary being drained while the
    // new routing table is on its way, say): serve from another routed version, heaviest
    // first, rather than fail the request.
    std::vector<WeightedVersion> others = route.versions;
    std::stable_sort(others.begin(), others.end(),
                     [](const auto& a, const auto& b) { return a.weight > b.weight; });
    for (const auto& o : others) {
      if (o.version == chosen || o.weight <= 0) continue;
      auto alt = PickEndpoint(eps, o.version, exclude);
      if (alt.ok()) return Choice{route.endpoints[*alt], o.version};
    }
  }
  if (!idx.ok()) {
    return absl::UnavailableError("model '" + model + "' version " + chosen +
                                  ": no serving replica");
  }
  return Choice{route.endpoints[*idx], chosen};
}

void Router::ExcludeNode(const std::string& model, const RouterTable::Endpoint& failed,
                         std::set<std::string>* exclude) const {
  absl::MutexLock lock(&mu_);
  if (!table_) return;
  auto it = table_->routes.find(model);
  if (it == table_->routes.end()) return;
  for (const auto& e : it->second.endpoints) {
    if (e.local) continue;
    if ((!failed.grpc_address.empty() && e.grpc_address == failed.grpc_address) ||
        (!failed.http_address.empty() && e.http_address == failed.http_address)) {
      exclude->insert(e.id);
    }
  }
}

std::pair<std::string, std::string> Router::StickyKey(const std::string& model) const {
  absl::MutexLock lock(&mu_);
  if (!table_) return {};
  auto it = table_->routes.find(model);
  if (it == table_->routes.end()) return {};
  return {it->second.sticky_header, it->second.sticky_parameter};
}

std::string Router::AnsweredBy(const std::string& model) const {
  if (stopping() || options_.node_name.empty()) return "";
  absl::MutexLock lock(&mu_);
  if (!table_) return "";
  auto it = table_->routes.find(model);
  if (it == table_->routes.end()) return "";
  for (const auto& e : it->second.endpoints) {
    if (e.local) return options_.node_name;
  }
  return "";
}

bool Router::Ready(const std::string& model, const std::string& version) const {
  absl::MutexLock lock(&mu_);
  if (!table_) return false;
  for (const auto& [name, route] : table_->routes) {
    if (!model.empty() && name != model) continue;
    for (const auto& e : route.endpoints) {
      if (version.empty() || e.version == version) return true;
    }
  }
  return false;
}

void Router::Begin(const std::string& id) {
  absl::MutexLock lock(&mu_);
  outstanding_[id]++;
}

void Router::End(const std::string& id) {
  absl::MutexLock lock(&mu_);
  if (--outstanding_[id] <= 0) outstanding_.erase(id);
}

std::shared_ptr<DataChannel> Router::ChannelFor(const std::string& path) {
  absl::MutexLock lock(&mu_);
  if (channels_closed_) return nullptr;
  auto& channel = channels_[path];
  if (!channel) {
    channel = std::make_shared<DataChannel>(
        path, options_.busy_poll.on() ? options_.busy_poll.window_micros : 0, spin_slots_);
  }
  return channel;
}

std::shared_ptr<inference::GRPCInferenceService::Stub> Router::StubFor(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& stub = stubs_[address];
  if (!stub) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(INT32_MAX);
    args.SetMaxSendMessageSize(INT32_MAX);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    // A peer that stops answering mid-call (a hung agent, a dead machine or link: no FIN, no
    // RST) is found by pings while calls are in flight: they fail UNAVAILABLE, and are tried
    // elsewhere, in about 4 s instead of waiting out their deadline. (Peers' routers accept
    // the pings: see Start.)
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 2000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    stub = inference::GRPCInferenceService::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  }
  return stub;
}

namespace {

std::string ParamText(const inference::InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kStringParam:
      return p.string_param();
    case inference::InferParameter::kInt64Param:
      return std::to_string(p.int64_param());
    case inference::InferParameter::kUint64Param:
      return std::to_string(p.uint64_param());
    case inference::InferParameter::kBoolParam:
      return p.bool_param() ? "true" : "false";
    case inference::InferParameter::kDoubleParam:
      return json(p.double_param()).dump();  // as a REST body's number is read
    default:
      return "";
  }
}

// One forwarded ModelInfer: the first try and at most one retry elsewhere when the replica
// went away (UNAVAILABLE, or CANCELLED by its shutdown).
struct ForwardCall {
  Router* router;
  std::shared_ptr<GrpcH2Server::Call> call;
  inference::ModelInferRequest request;
  // The request as it came, sent as it is on the first try to a data socket.
  std::string raw;
  inference::ModelInferResponse response;
  std::string sticky;
  bool sticky_given = false;
  bool forwarded = false;  // from another node's router: served here or not at all
  // The request with the chosen version, for another node's router.
  std::unique_ptr<inference::ModelInferRequest> pinned;
  std::set<std::string> exclude;
  // Before the context: destroyed after it. The context holds the channel too, and the stub's
  // reference must be the call's last one to go (the router lets a retired stub go once it
  // holds the only one: see SetTable). A retry replaces the context before the stub.
  std::shared_ptr<inference::GRPCInferenceService::Stub> stub;
  std::unique_ptr<grpc::ClientContext> client_ctx;
  int attempts = 0;

  // The caller gave up (or the router's server did, at the end of its stop grace): the try
  // under way over gRPC is cancelled, and none is made after. (A try on a local replica's data
  // socket runs on to its answer or the caller's deadline: the frame has no cancel.)
  void CallerGone() {
    absl::MutexLock lock(&mu);
    caller_gone = true;
    if (live) live->TryCancel();
  }
  // Makes the try's context the one CallerGone cancels; false if the caller is gone already.
  bool Track(grpc::ClientContext* ctx) {
    absl::MutexLock lock(&mu);
    live = ctx;
    return !caller_gone;
  }
  // The try ended; true if the caller is gone.
  bool Untrack() {
    absl::MutexLock lock(&mu);
    live = nullptr;
    return caller_gone;
  }

  absl::Mutex mu;
  bool caller_gone ABSL_GUARDED_BY(mu) = false;
  grpc::ClientContext* live ABSL_GUARDED_BY(mu) = nullptr;
};

// A replica that went away under a call (refused it, or cancelled it as its server stopped)
// is UNAVAILABLE to the caller, the code clients retry, never CANCELLED, which they take as
// their own doing.
grpc::Status AsReplicaGone(const grpc::Status& s) {
  if (s.error_code() != grpc::StatusCode::CANCELLED) return s;
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the replica went away: " + s.error_message());
}

// Whether a failed call's answer is another node's router's saying only the version asked
// failed there (kAnsweredByHeader; a failure comes Trailers-Only, the header with the status).
bool AnsweredByRouter(const grpc::ClientContext& ctx) {
  return ctx.GetServerTrailingMetadata().count(kAnsweredByHeader) > 0;
}

// Marks a forwarded call's failure with kAnsweredByHeader where the router says so.
void MarkAnswered(const ForwardCall& c) {
  if (!c.forwarded) return;
  const std::string by = c.router->AnsweredBy(c.request.model_name());
  if (!by.empty()) c.call->AddInitialMetadata(kAnsweredByHeader, by);
}

// `parameters[kiln-version] = version` as serialized ModelInferResponse bytes: appended to an
// answer, it sets that parameter (a map entry parsed later replaces an earlier one).
std::string VersionParameterBytes(const std::string& version) {
  inference::ModelInferResponse r;
  (*r.mutable_parameters())[kVersionParameter].set_string_param(version);
  return r.SerializeAsString();
}

// Sends the call to a replica chosen now. `previous`: the first try's failure, when this is
// the retry (answered instead, should there be no other replica).
void Attempt(std::shared_ptr<ForwardCall> c, const grpc::Status& previous = grpc::Status::OK) {
  auto choice = c->router->Choose(c->request.model_name(), c->request.model_version(), c->sticky,
                                  c->sticky_given, c->exclude, c->forwarded);
  if (!choice.ok()) {
    MarkAnswered(*c);
    c->call->Finish(previous.ok() ? ToGrpcStatus(choice.status()) : previous);
    return;
  }
  if (!previous.ok()) c->router->CountRetry();
  c->attempts++;
  c->client_ctx = std::make_unique<grpc::ClientContext>();
  // The caller's deadline, when it set one.
  const absl::Time deadline = c->call->deadline();
  const bool has_deadline = deadline != absl::InfiniteFuture();
  if (has_deadline) c->client_ctx->set_deadline(absl::ToChronoTime(deadline));
  // Its cancellation too (GrpcH2Server::Call::OnCancel), so that a call sent on over gRPC that
  // the router's server gives up on ends where it was sent.
  if (!c->Track(c->client_ctx.get())) {
    c->call->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the caller cancelled the call"));
    return;
  }
  const RouterTable::Endpoint endpoint = choice->endpoint;
  const std::string& id = endpoint.id;
  std::string version = choice->version;
  c->router->Begin(id);
  // `answer`: a data socket's answer, serialized (otherwise c->response holds it).
  auto finished = [c, version, endpoint](const grpc::Status& s, std::string* answer) {
    const std::string& id = endpoint.id;
    c->router->End(id);
    const bool caller_gone = c->Untrack();
    if (caller_gone) {
      c->call->Finish(s);  // goes nowhere
      return;
    }
    // The replica went away under the call: refused (UNAVAILABLE), or cancelled by its
    // server shutting down at the end of a drain (CANCELLED while the caller was not).
    // Inference has no side effects, so one retry elsewhere is safe, unless the router is
    // stopping.
    const bool replica_gone = s.error_code() == grpc::StatusCode::UNAVAILABLE ||
                              s.error_code() == grpc::StatusCode::CANCELLED;
    if (replica_gone && c->attempts == 1 && !c->router->stopping()) {
      c->exclude.insert(id);
      // Another node that did not answer: none of its endpoints (other versions) either.
      if (!endpoint.local && !AnsweredByRouter(*c->client_ctx)) {
        c->router->ExcludeNode(c->request.model_name(), endpoint, &c->exclude);
      }
      c->response.Clear();
      Attempt(c, AsReplicaGone(s));
      return;
    }
    if (!s.ok()) {
      if (replica_gone) MarkAnswered(*c);
      c->call->Finish(replica_gone ? AsReplicaGone(s) : s);
      return;
    }
    std::string out;
    if (answer != nullptr) {
      // Checked whole, then sent on as it came with the version added.
      if (!c->response.ParseFromString(*answer)) {
        c->call->Finish(grpc::Status(grpc::StatusCode::INTERNAL,
                                     "the replica's answer is not an inference.ModelInferResponse"));
        return;
      }
      out = std::move(*answer);
      out += VersionParameterBytes(version);
    } else {
      (*c->response.mutable_parameters())[kVersionParameter].set_string_param(version);
      out = c->response.SerializeAsString();
    }
    c->call->AddInitialMetadata(kVersionParameter, version);
    c->call->Finish(grpc::Status::OK, std::move(out));
  };
  if (!choice->endpoint.data_socket.empty()) {
    // A local replica: its data socket, without a second gRPC hop. (The callback must not hold
    // the channel: it may run on the channel's reader, which a last owner would join.)
    std::shared_ptr<DataChannel> channel = c->router->ChannelFor(choice->endpoint.data_socket);
    if (!channel) {
      c->router->End(id);
      c->call->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the router is stopping"));
      return;
    }
    const int64_t deadline_micros = has_deadline ? absl::ToUnixMicros(deadline) : 0;
    c->router->CountForward(/*data_socket=*/true);
    // The first try sends the caller's bytes; a retry frames the parsed request again.
    std::string body = c->attempts == 1 && !c->raw.empty() ? std::move(c->raw)
                                                           : c->request.SerializeAsString();
    channel->CallRaw(kInferFrame, std::move(body), deadline_micros, deadline_micros,
                     [finished](const grpc::Status& s, std::string* answer) {
                       finished(s, s.ok() ? answer : nullptr);
                     });
    return;
  }
  c->router->CountForward(/*data_socket=*/false);
  const inference::ModelInferRequest* request = &c->request;
  if (!choice->endpoint.local) {
    // Another node's router: it serves the version chosen here, from its own replicas.
    c->client_ctx->AddMetadata(kForwardedHeader, c->router->node_name());
    if (request->model_version() != version) {
      c->pinned = std::make_unique<inference::ModelInferRequest>(*request);
      c->pinned->set_model_version(version);
      request = c->pinned.get();
    }
  }
  c->stub = c->router->StubFor(choice->endpoint.grpc_address);  // kept while the call is out
  Router* router = c->router;
  router->GrpcCallStarted();
  c->stub->async()->ModelInfer(c->client_ctx.get(), request, &c->response,
                               [finished, router](grpc::Status s) {
                                 finished(s, nullptr);
                                 router->GrpcCallEnded();  // the last use of the router
                               });
}

// The node's OIP gRPC service on the router's HTTP/2 server (common/grpc_h2_server.h): each
// call comes whole to Serve on the server's thread, which must not block.
class RouterGrpcService {
 public:
  explicit RouterGrpcService(Router* router) : router_(router) {}

  void Serve(std::shared_ptr<GrpcH2Server::Call> call) {
    try {
      Dispatch(call);
    } catch (const std::exception& e) {
      call->Finish(grpc::Status(grpc::StatusCode::INTERNAL, std::string("internal error: ") + e.what()));
    }
  }

 private:
  static constexpr char kService[] = "/inference.GRPCInferenceService/";

  void Dispatch(const std::shared_ptr<GrpcH2Server::Call>& call) {
    const std::string& path = call->method();
    const std::string method =
        path.rfind(kService, 0) == 0 ? path.substr(sizeof(kService) - 1) : std::string();
    const bool forwarded = call->Metadata(kForwardedHeader) != nullptr;
    if (method == "ModelInfer") {
      ModelInfer(call, forwarded);
    } else if (method == "ServerLive") {
      inference::ServerLiveRequest req;
      if (!ParseRequest(*call, &req)) return;
      inference::ServerLiveResponse resp;
      resp.set_live(true);
      AnswerCall(*call, grpc::Status::OK, resp);
    } else if (method == "ServerReady") {
      inference::ServerReadyRequest req;
      if (!ParseRequest(*call, &req)) return;
      inference::ServerReadyResponse resp;
      resp.set_ready(router_->Ready("", ""));
      AnswerCall(*call, grpc::Status::OK, resp);
    } else if (method == "ModelReady") {
      inference::ModelReadyRequest req;
      if (!ParseRequest(*call, &req)) return;
      inference::ModelReadyResponse resp;
      resp.set_ready(router_->Ready(req.name(), req.version()));
      AnswerCall(*call, grpc::Status::OK, resp);
    } else if (method == "ServerMetadata") {
      inference::ServerMetadataRequest req;
      if (!ParseRequest(*call, &req)) return;
      inference::ServerMetadataResponse resp;
      resp.set_name("kiln-agent");
      resp.set_version("0.1.0");
      resp.add_extensions("model_repository_layout");
      AnswerCall(*call, grpc::Status::OK, resp);
    } else if (method == "ModelMetadata") {
      ModelMetadata(call, forwarded);
    } else {
      call->Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                                "unknown method " + path + ": the node's router serves "
                                "inference.GRPCInferenceService"));
    }
  }

  void ModelMetadata(const std::shared_ptr<GrpcH2Server::Call>& call, bool forwarded) {
    // Asked without blocking the server's thread: the answer finishes the call from the
    // client's callback.
    struct Pending {
      // Kept while the call is out; first, so destroyed after the context (see ForwardCall).
      std::shared_ptr<inference::GRPCInferenceService::Stub> stub;
      grpc::ClientContext cc;
      inference::ModelMetadataRequest req;
      inference::ModelMetadataResponse resp;
    };
    auto pending = std::make_shared<Pending>();
    if (!ParseRequest(*call, &pending->req)) return;
    auto choice = router_->Choose(pending->req.name(), pending->req.version(), "", false, {},
                                  forwarded);
    if (!choice.ok()) {
      call->Finish(ToGrpcStatus(choice.status()));
      return;
    }
    pending->cc.set_deadline(absl::ToChronoTime(
        std::min(call->deadline(), absl::Now() + absl::Seconds(5))));
    if (!choice->endpoint.local) {
      // Another node's router: the version chosen here, from its own replicas.
      pending->cc.AddMetadata(kForwardedHeader, router_->node_name());
      pending->req.set_version(choice->version);
    }
    pending->stub = router_->StubFor(choice->endpoint.grpc_address);
    Router* router = router_;
    router->GrpcCallStarted();
    pending->stub->async()->ModelMetadata(
        &pending->cc, &pending->req, &pending->resp, [pending, call, router](grpc::Status s) {
          call->Finish(s, s.ok() ? pending->resp.SerializeAsString() : std::string());
          router->GrpcCallEnded();
        });
  }

  void ModelInfer(const std::shared_ptr<GrpcH2Server::Call>& call, bool forwarded) {
    auto c = std::make_shared<ForwardCall>();
    c->router = router_;
    c->call = call;
    if (!ParseRequest(*call, &c->request)) return;
    c->raw = std::move(call->message());
    c->forwarded = forwarded;
    auto [header, param] = router_->StickyKey(c->request.model_name());
    if (!header.empty()) {
      if (const std::string* v = call->Metadata(header)) {
        c->sticky = *v;
        c->sticky_given = true;
      }
    } else if (!param.empty()) {
      auto it = c->request.parameters().find(param);
      if (it != c->request.parameters().end()) {
        c->sticky = ParamText(it->second);
        c->sticky_given = true;
      }
    }
    // The caller going away (or its deadline passing) cancels the try under way over gRPC.
    // Held weakly: the call's cancel callback lives as long as the call.
    std::weak_ptr<ForwardCall> weak = c;
    call->OnCancel([weak] {
      if (auto f = weak.lock()) f->CallerGone();
    });
    Attempt(c);
  }

  Router* router_;
};

// `answered_by`: this node's name when the call was forwarded to it (kAnsweredByHeader).
void Reply(const HttpReply& request, int code, std::string body, const std::string& version = "",
           const std::string& answered_by = "") {
  HttpResponse r;
  r.code = code;
  r.body = std::move(body);
  r.content_type = "application/json";
  if (!version.empty()) r.headers.emplace_back(kVersionParameter, version);
  if (!answered_by.empty()) r.headers.emplace_back(kAnsweredByHeader, answered_by);
  request.Send(std::move(r));
}

}  // namespace

class Router::Impl {
 public:
  Impl(Router* router, const Options& o) : router_(router), grpc_service_(router) {
    (void)o;
  }

  absl::Status Start(const Options& o) {
    GrpcH2Server::Options g;
    g.bind_address = o.bind_address;
    g.port = o.grpc_port;
    g.flag = "--grpc-port/--ingress-bind";
    g.thread_name = "router-grpc";
    // A request may be as large as REST's, plus its framing.
    g.max_message_bytes = o.max_request_bytes + 65536;
    if (o.grpc_listen_fd >= 0) {
      auto fd = DupListener(o.grpc_listen_fd, "LISTEN_FDS (grpc)");
      if (!fd.ok()) return fd.status();
      listen_fd_ = *fd;
      g.listen_fd = listen_fd_;
    }
    // Other nodes' routers ping while their calls run here (a long inference sends no data
    // meanwhile): nghttp2 answers pings, and ends a connection that floods it with frames to
    // acknowledge while reading none of the answers.
    auto grpc = GrpcH2Server::Start(
        g, [this](std::shared_ptr<GrpcH2Server::Call> call) { grpc_service_.Serve(std::move(call)); });
    if (!grpc.ok()) return grpc.status();
    grpc_server_ = std::move(*grpc);
    grpc_port_ = grpc_server_->port();
    HttpServer::Options h;
    h.bind_address = o.bind_address;
    h.port = o.http_port;
    h.max_body_bytes = o.max_request_bytes;
    h.flags = "--http-port/--ingress-bind";
    h.threads = o.http_threads;
    h.listen_fd = o.http_listen_fd;
    auto server = HttpServer::Start(
        h, [this](HttpRequest request, HttpReply reply) { Handle(std::move(request), reply); });
    if (!server.ok()) return server.status();
    http_server_ = std::move(*server);
    http_port_ = http_server_->port();
    return absl::OkStatus();
  }

  void Stop() {
    // First stop taking connections (they queue on a handed-over socket for the next agent),
    // then drain what was accepted: REST and gRPC at once, each with its 5 s grace.
    std::thread grpc_stop;
    if (grpc_server_) {
      // GOAWAY: clients move new calls to a new connection; calls in flight get 5 s, and are
      // then cancelled, with what they sent on over gRPC (ForwardCall::CallerGone).
      grpc_stop = std::thread([this] { grpc_server_->Stop(absl::Seconds(5)); });
    }
    if (http_server_) {
      // REST calls still out (to data sockets or over HTTP) when the grace is nearly over, or
      // made after that, are answered 503 here while their connections are open; their
      // replicas' late answers go nowhere.
      absl::Notification server_stopped;
      std::thread answer_late([this, &server_stopped] {
        server_stopped.WaitForNotificationWithTimeout(kRestStopGrace);
        CloseRest();
      });
      http_server_->Stop(absl::Seconds(5));
      server_stopped.Notify();
      answer_late.join();
      http_server_.reset();
    }
    CloseRest();
    // HTTP forwards still out (their callbacks use this object) fail, and are waited for.
    http_client_->Stop();
    if (grpc_stop.joinable()) grpc_stop.join();
    grpc_server_.reset();
    if (listen_fd_ >= 0) {
      close(listen_fd_);
      listen_fd_ = -1;
    }
  }

  int grpc_port_ = 0;
  int http_port_ = 0;
  int listen_fd_ = -1;  // our duplicate of the handed-over gRPC socket

 private:
  void Handle(HttpRequest request, const HttpReply& reply) {
    try {
      Route(request, reply);
    } catch (const std::exception& e) {
      Reply(reply, 500, JsonError(std::string("internal error: ") + e.what()));
    }
  }

  void Route(HttpRequest& request, const HttpReply& reply) {
    const std::string& path = request.path;
    std::vector<std::string> parts = absl::StrSplit(path, '/', absl::SkipEmpty());
    if (parts.size() == 3 && parts[0] == "v2" && parts[1] == "health" &&
        (parts[2] == "live" || parts[2] == "ready")) {
      bool ok = parts[2] == "live" || router_->Ready("", "");
      // 200 for true, a 4xx for false, as the protocol says (and the runtime answers).
      Reply(reply, ok ? 200 : 400, json{{parts[2], ok}}.dump());
      return;
    }
    if (parts.size() >= 3 && parts[0] == "v2" && parts[1] == "models") {
      std::string model = PercentDecode(parts[2]);
      std::string version;
      size_t next = 3;
      if (parts.size() >= 5 && parts[3] == "versions") {
        version = PercentDecode(parts[4]);
        next = 5;
      }
      if (parts.size() == next + 1 && parts[next] == "ready") {
        bool ok = router_->Ready(model, version);
        // The name as the path gave it, which need not be UTF-8.
        Reply(reply, ok ? 200 : 400,
              json{{"name", model}, {"ready", ok}}.dump(-1, ' ', false,
                                                         json::error_handler_t::replace));
        return;
      }
      if (parts.size() == next + 1 && parts[next] == "infer" && request.method == "POST") {
        // Whole and within the limit (a declared size over it was refused from the header, a
        // chunked body cut at it, both 413); forwarded with its length. An empty one would go
        // on as a GET.
        if (request.body.empty()) {
          Reply(reply, 400, JsonError("the inference request has no body (expected a JSON "
                                      "object with \"inputs\")"));
          return;
        }
        if (request.Header("Inference-Header-Content-Length")) {
          // Its header is not passed on, and a replica answers it as its REST port does.
          Reply(reply, 400, JsonError("the binary data extension is not supported; send JSON "
                                      "data or use gRPC raw_input_contents"));
          return;
        }
        Sticky sticky = StickyOf(request, model);
        Forward(std::make_shared<RestCall>(RestCall{reply, model, version, path,
                                                    std::move(request.body), std::move(sticky),
                                                    Forwarded(request)}));
        return;
      }
      if (parts.size() == next && request.method == "GET") {
        Forward(std::make_shared<RestCall>(
            RestCall{reply, model, version, path, "", StickyOf(request, model), Forwarded(request)}));
        return;
      }
    }
    Reply(reply, 404, JsonError("no such endpoint: " + path));
  }

  struct Sticky {
    std::string key;
    bool given = false;
  };
  // The request's sticky key: the model's header, else its `parameters` entry.
  Sticky StickyOf(const HttpRequest& request, const std::string& model) {
    Sticky out;
    auto [header, param] = router_->StickyKey(model);
    if (!header.empty()) {
      if (auto v = request.Header(header)) return {std::string(*v), true};
    }
    if (!param.empty() && !request.body.empty()) {
      json doc = json::parse(request.body, nullptr, false);
      if (doc.is_object() && doc.contains("parameters") && doc["parameters"].is_object() &&
          doc["parameters"].contains(param)) {
        const json& v = doc["parameters"][param];
        out.key = v.is_string() ? v.get<std::string>() : v.dump();
        out.given = true;
      }
    }
    return out;
  }

  static bool Forwarded(const HttpRequest& request) {
    return request.Header(kForwardedHeader).has_value();
  }

  // One REST call being forwarded: what the client asked, and where it was tried.
  struct RestCall {
    HttpReply reply;
    std::string model;
    std::string version;  // as the path gave it (empty: the router picks)
    std::string path;
    std::string body;     // empty: a GET; kept for a retry
    Sticky sticky;
    // The call came from another node's router (Router::Choose's local_only).
    bool forwarded = false;
    std::set<std::string> exclude = {};  // endpoints tried already
    int attempt = 0;
    RouterTable::Endpoint last;  // the endpoint of the try under way
  };

  // Forwards to the chosen replica; on 503 or a connection failure, once more elsewhere.
  // `previous`: the first try's answer, when this is the retry (given back instead, should
  // there be no other replica).
  void Forward(std::shared_ptr<RestCall> call,
               std::optional<std::pair<int, std::string>> previous = std::nullopt) {
    auto choice = router_->Choose(call->model, call->version, call->sticky.key,
                                  call->sticky.given, call->exclude, call->forwarded);
    if (!choice.ok()) {
      if (previous) {
        Reply(call->reply, previous->first, std::move(previous->second), "",
              AnsweredBy(*call, previous->first));
      } else {
        const int code = HttpStatusFromCode(choice.status().code());
        Reply(call->reply, code, JsonError(std::string(choice.status().message())), "",
              AnsweredBy(*call, code));
      }
      return;
    }
    if (previous) router_->CountRetry();
    call->last = choice->endpoint;
    if (!call->body.empty() && !choice->endpoint.data_socket.empty()) {
      // A local replica: its data socket, without a second HTTP hop, unless it is a runtime
      // older than this router (then over HTTP, below).
      std::shared_ptr<DataChannel> channel = router_->ChannelFor(choice->endpoint.data_socket);
      if (!channel) {
        Reply(call->reply, 503, JsonError("the router is stopping"));
        return;
      }
      if (!channel->json_refused()) {
        ForwardToDataSocket(*channel, std::move(call), *choice);
        return;
      }
    }
    ForwardHttp(std::move(call), *choice);
  }

  // The answer `code`/`text` from endpoint `id` for `call`: a 503 on the first attempt is
  // tried once more elsewhere; anything else goes back to the client, with the version that
  // served when it succeeded.
  // `node_answered`: another node's router answered (kAnsweredByHeader), so only that endpoint
  // is ruled out for the retry, not the node's other versions.
  void Answer(std::shared_ptr<RestCall> call, const std::string& id, const std::string& chosen,
              int code, std::string text, bool node_answered = false) {
    if (code == 503 && call->attempt == 0 && !router_->stopping()) {
      call->exclude.insert(id);
      if (!call->last.local && !node_answered) {
        router_->ExcludeNode(call->model, call->last, &call->exclude);
      }
      call->attempt = 1;
      Forward(std::move(call), std::make_pair(code, std::move(text)));
      return;
    }
    Reply(call->reply, code, std::move(text), code == 200 ? chosen : "", AnsweredBy(*call, code));
  }

  // kAnsweredByHeader's value for `call` answered `code`: Router::AnsweredBy's for a 503 (the
  // answer a sender retries) to a forwarded call, else "".
  std::string AnsweredBy(const RestCall& call, int code) const {
    return call.forwarded && code == 503 ? router_->AnsweredBy(call.model) : "";
  }

  // Forward's call over HTTP to `choice`.
  void ForwardHttp(std::shared_ptr<RestCall> call, const Choice& choice) {
    const std::optional<uint64_t> key = OpenRestCall(call->reply);
    if (!key) return;  // stopping: answered 503
    router_->CountRestForward(/*data_socket=*/false);
    HttpClientRequest out;
    out.method = call->body.empty() ? "GET" : "POST";
    if (choice.endpoint.local || !call->version.empty()) {
      out.target = call->path;
    } else {
      // Another node's router: it serves the version chosen here, from its own replicas.
      out.target = "/v2/models/" + PercentEncodeSegment(call->model) + "/versions/" +
                   PercentEncodeSegment(choice.version);
      if (!call->body.empty()) out.target += "/infer";
    }
    if (!choice.endpoint.local) out.headers.emplace_back(kForwardedHeader, router_->node_name());
    if (!call->body.empty()) {
      out.body = call->body;  // the call's kept for a retry
      out.content_type = "application/json";
    }
    std::string id = choice.endpoint.id;
    std::string chosen = choice.version;
    router_->Begin(id);
    // The callback runs on the client's thread (or inline, once it is stopping).
    http_client_->Send(
        choice.endpoint.http_address, std::move(out),
        [this, key, call = std::move(call), id, chosen](absl::StatusOr<HttpClientResponse> r) {
          router_->End(id);
          CloseRestCall(*key);
          int code = 0;
          std::string text;
          bool versioned = false;  // the answer names the chosen version already
          bool node_answered = false;
          if (r.ok()) {
            code = r->code;
            node_answered = r->Header(kAnsweredByHeader).has_value();
            // Another node's router says which version served, in its body too.
            versioned = r->Header(kVersionParameter) == chosen;
            text = std::move(r->body);
          } else if (r.status().code() == absl::StatusCode::kUnavailable ||
                     r.status().code() == absl::StatusCode::kInvalidArgument) {
            // Connection refused or reset (the replica is gone), or an endpoint whose address
            // is not one: tried elsewhere.
            code = 503;
            text = JsonError("replica unreachable: " + std::string(r.status().message()));
          } else {
            // No answer in time (504), or one that is not HTTP or too large (502).
            code = r.status().code() == absl::StatusCode::kDeadlineExceeded ? 504 : 502;
            text = JsonError("replica " + std::string(r.status().message()));
          }
          if (code == 200 && !call->body.empty() && !versioned) {
            json doc = json::parse(text, nullptr, false);
            if (doc.is_object()) {
              doc["parameters"][kVersionParameter] = chosen;
              text = doc.dump(-1, ' ', false, json::error_handler_t::replace);
            }
          }
          Answer(call, id, chosen, code, std::move(text), node_answered);
        });
  }

  // One REST inference to a local replica's data socket (common/data_frames.h): the replica
  // answers what its REST port would, with parameters.kiln-version added; a 503 or a replica
  // gone (UNAVAILABLE) is tried once more elsewhere, as over HTTP.
  void ForwardToDataSocket(DataChannel& channel, std::shared_ptr<RestCall> call,
                           const Choice& choice) {
    const std::optional<uint64_t> key = OpenRestCall(call->reply);
    if (!key) return;  // stopping: answered 503
    const std::string id = choice.endpoint.id;
    const std::string chosen = choice.version;
    router_->Begin(id);
    // The call's body is kept for a retry.
    std::string frame = EncodeJsonInferBody(call->body, call->model, call->version);
    // Given up after as long as an HTTP forward waits (the client's timeout, below). The frame
    // carries no deadline: the model's default queue timeout applies, as on its REST port.
    const int64_t expire = absl::ToUnixMicros(absl::Now() + kRestForwardTimeout);
    // The callback runs on the channel's reader (or inline here), while the channel lives: a
    // plain pointer, since a reference it held could make the reader join itself.
    channel.CallRaw(
        kJsonInferFrame, std::move(frame), /*deadline_unix_micros=*/0, expire,
        [this, ch = &channel, key, call = std::move(call), id, chosen,
         choice](const grpc::Status& s, std::string* answer) {
          router_->End(id);
          CloseRestCall(*key);
          int code = 0;
          std::string text;
          // Counted once it is known which way it went: a refused frame goes over HTTP, and is
          // counted there (a counter never goes back).
          const bool refused = s.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
                               absl::StartsWith(s.error_message(), "frame code ");
          if (!refused) router_->CountRestForward(/*data_socket=*/true);
          if (s.ok()) {
            text = std::move(*answer);
            if (absl::Status d = DecodeJsonAnswer(&text, &code); !d.ok()) {
              Reply(call->reply, 502,
                    JsonError("the replica's answer: " + std::string(d.message())));
              return;
            }
          } else if (refused) {
            // A runtime older than this router: over HTTP from now on (not a retry), to the
            // same replica. (Not through Forward: choosing again could hand this reader its
            // own channel, whose last reference it might then drop and so join itself.)
            ch->set_json_refused();
            ForwardHttp(call, choice);
            return;
          } else {
            code = HttpStatusFromCode(static_cast<absl::StatusCode>(s.error_code()));
            text = JsonError(s.error_message());
          }
          Answer(call, id, chosen, code, std::move(text));
        });
  }

  // A REST call going out to a replica (or another router), answered by Stop if nothing
  // answers it first; nullopt, and answered 503 now, once Stop has closed them.
  std::optional<uint64_t> OpenRestCall(const HttpReply& reply) {
    {
      absl::MutexLock lock(&forwards_mu_);
      if (!rest_closed_) {
        const uint64_t key = next_rest_call_++;
        rest_calls_.emplace(key, reply);
        return key;
      }
    }
    Reply(reply, 503, JsonError("the router is stopping"));
    return std::nullopt;
  }
  void CloseRestCall(uint64_t key) {
    absl::MutexLock lock(&forwards_mu_);
    rest_calls_.erase(key);
  }
  // Stop: every REST call still out is answered 503, and every later one at once.
  void CloseRest() {
    std::map<uint64_t, HttpReply> late;
    {
      absl::MutexLock lock(&forwards_mu_);
      rest_closed_ = true;
      late.swap(rest_calls_);
    }
    for (auto& [key, reply] : late) Reply(reply, 503, JsonError("the router is stopping"));
  }

  static constexpr absl::Duration kRestForwardTimeout = absl::Seconds(300);
  // How long Stop lets REST calls on data sockets run before answering them 503 itself: within
  // the REST server's own grace (5 s), so that the answer is written before it closes.
  static constexpr absl::Duration kRestStopGrace = absl::Seconds(4);

  Router* router_;
  RouterGrpcService grpc_service_;
  std::unique_ptr<GrpcH2Server> grpc_server_;
  std::unique_ptr<HttpServer> http_server_;
  absl::Mutex forwards_mu_;
  bool rest_closed_ ABSL_GUARDED_BY(forwards_mu_) = false;  // stopping: no more of them
  // REST calls out to replicas and other routers, unanswered.
  std::map<uint64_t, HttpReply> rest_calls_ ABSL_GUARDED_BY(forwards_mu_);
  uint64_t next_rest_call_ ABSL_GUARDED_BY(forwards_mu_) = 0;
  // REST forwards over HTTP: to other nodes' routers, metadata, and replicas older than the
  // router. Connections are kept alive per address. Last: stopped (its callbacks joined) before
  // the members they use go.
  const std::unique_ptr<HttpClient> http_client_ = std::make_unique<HttpClient>([] {
    HttpClient::Options o;
    o.timeout = kRestForwardTimeout;
    return o;
  }());
};

absl::StatusOr<std::unique_ptr<Router>> Router::Start(Options options,
                                                     std::shared_ptr<const RouterTable> table) {
  std::unique_ptr<Router> r(new Router(options));
  // Before the first request: a restarted agent's queued connections are served at once.
  if (table) r->SetTable(std::move(table));
  r->impl_ = std::make_unique<Impl>(r.get(), options);
  KILN_RETURN_IF_ERROR(r->impl_->Start(options));
  GetLogger("agent.router")
      ->info("router listening grpc_port={} http_port={}", r->impl_->grpc_port_,
             r->impl_->http_port_);
  return r;
}

Router::~Router() { Stop(); }

void Router::Stop() {
  stopping_ = true;  // no retries from now on
  // Calls in flight on data sockets get the servers' grace to finish; then whatever is left
  // fails (UNAVAILABLE), so that no server waits on a replica that never answers.
  absl::Notification stopped;
  std::thread fail_late([this, &stopped] {
    if (!stopped.WaitForNotificationWithTimeout(absl::Seconds(6))) FailChannels();
  });
  if (impl_) impl_->Stop();
  stopped.Notify();
  fail_late.join();
  FailChannels();
  ReleaseStubs();
}

void Router::ReleaseStubs() {
  // The server has stopped and cancelled what it still had (each call sent on over gRPC with
  // it): their callbacks come soon. Bounded: one that never comes is not waited for forever.
  for (int i = 0; i < 10000 && grpc_calls_out_.load() > 0; ++i) absl::SleepFor(absl::Milliseconds(1));
  std::vector<std::shared_ptr<inference::GRPCInferenceService::Stub>> stubs;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [address, stub] : stubs_) stubs.push_back(std::move(stub));
    stubs_.clear();
    for (auto& stub : stubs_retired_) stubs.push_back(std::move(stub));
    stubs_retired_.clear();
  }
  // A callback's copy of its call goes after its last use of the router: the stub is let go
  // here once that has happened, never on one of gRPC's threads (see SetTable).
  for (auto& stub : stubs) {
    for (int i = 0; i < 1000 && stub.use_count() > 1; ++i) absl::SleepFor(absl::Milliseconds(1));
    stub.reset();
  }
}

void Router::FailChannels() {
  std::vector<std::shared_ptr<DataChannel>> channels;
  {
    absl::MutexLock lock(&mu_);
    channels_closed_ = true;  // a retry now finds none
    for (auto& [path, channel] : channels_) channels.push_back(std::move(channel));
    channels_.clear();
    for (auto& channel : retired_) channels.push_back(std::move(channel));
    retired_.clear();
  }
  for (auto& channel : channels) channel->FailAll();
  // Destroyed here (joining their readers, outside the lock: they finish calls into this),
  // each once no reader of another channel holds it any more (see SetTable). Bounded: a
  // failed call's callback lets go in microseconds.
  for (auto& channel : channels) {
    for (int i = 0; i < 10000 && channel.use_count() > 1; ++i) absl::SleepFor(absl::Milliseconds(1));
    channel.reset();
  }
}

int Router::grpc_port() const { return impl_ ? impl_->grpc_port_ : 0; }
int Router::http_port() const { return impl_ ? impl_->http_port_ : 0; }

}  // namespace kiln
