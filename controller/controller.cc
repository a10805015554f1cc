#include "controller/controller.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <sstream>
#include <unordered_map>

#include <google/protobuf/io/coded_stream.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include "common/grpc_tls.h"
#include "common/logging.h"
#include "controller/model_deployment.h"
#include "controller/placement.h"
#include "controller/rollout.h"
#include "nlohmann/json.hpp"

namespace kiln {

namespace {

using ConditionsBefore = Controller::ConditionsBefore;

// The conditions of a stored status: type -> (status, lastTransitionTime).
ConditionsBefore ParseConditions(const std::string& status) {
  ConditionsBefore before;
  auto previous = nlohmann::json::parse(status, nullptr, false);
  if (previous.is_object() && previous.contains("conditions") && previous["conditions"].is_array()) {
    for (const auto& p : previous["conditions"]) {
      if (p.is_object() && p.contains("lastTransitionTime") && p["lastTransitionTime"].is_string()) {
        before[p.value("type", "")] = {p.value("status", ""), p["lastTransitionTime"].get<std::string>()};
      }
    }
  }
  return before;
}

// Kubernetes' condition shape: each condition gets observedGeneration and a lastTransitionTime
// that it keeps, from the status written before, until its own status changes.
void StampConditions(nlohmann::json& conditions, const ConditionsBefore& before,
                     const std::string& now, int64_t generation) {
  for (auto& c : conditions) {
    auto it = before.find(c["type"].get<std::string>());
    bool unchanged = it != before.end() && it->second.first == c["status"].get<std::string>();
    c["lastTransitionTime"] = unchanged ? it->second.second : now;
    c["observedGeneration"] = generation;
  }
}

// `specs` serialized into `out` (its capacity reused), each followed by '|'.
void Serialize(const std::vector<v1::ReplicaSpec>& specs, std::string* out) {
  out->clear();
  for (const auto& s : specs) {
    s.AppendToString(out);
    out->push_back('|');
  }
}

// Above what this controller sent, what the node applied, and the wall clock in microseconds:
// generations only grow, also across controller restarts.
int64_t NextGeneration(int64_t sent, int64_t applied, absl::Time now) {
  return std::max({sent + 1, applied + 1, absl::ToUnixMicros(now)});
}

// Per version of a deployment, for status.versions: its traffic share now and what its SERVING
// replicas report (counters since each replica started; p99 the worst replica's).
nlohmann::json VersionsJson(const RolloutPlan& plan,
                            const std::map<std::string, VersionStats>& stats) {
  std::map<std::string, int64_t> weights;
  if (!plan.stable_version.empty()) weights[plan.stable_version] = 100 - plan.canary_weight;
  if (!plan.canary_version.empty()) weights[plan.canary_version] = plan.canary_weight;
  for (const auto& [version, v] : stats) weights.emplace(version, 0);
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [version, weight] : weights) {
    auto it = stats.find(version);
    VersionStats v = it == stats.end() ? VersionStats() : it->second;
    double rate = v.requests > 0 ? static_cast<double>(v.errors) / v.requests : 0.0;
    out.push_back({{"version", version},
                   {"weight", weight},
                   {"readyReplicas", v.ready},
                   {"requests", v.requests},
                   {"errors", v.errors},
                   {"errorRate", std::round(rate * 1e6) / 1e6},
                   {"latencyP99Ms", std::round(v.p99_micros) / 1000.0}});
  }
  return out;
}

// `m` as the bytes a stream writes (a fresh buffer each time: serializing needs an empty one).
// Only a message over 2 GiB fails.
grpc::Status ToBytes(const v1::ControllerMessage& m, grpc::ByteBuffer* bytes) {
  bool own = false;
  return grpc::SerializationTraits<v1::ControllerMessage>::Serialize(m, bytes, &own);
}

// A deployment's status less the numbers that move with every report.
nlohmann::json WithoutCounters(nlohmann::json status) {
  if (status.contains("versions") && status["versions"].is_array()) {
    for (auto& v : status["versions"]) {
      for (const char* key : {"requests", "errors", "errorRate", "latencyP99Ms"}) v.erase(key);
    }
  }
  return status;
}

// What a rollout action asked of deployment `name` hears when no spec of it was ever valid.
std::string NotRunReason(const std::string& name, const std::string& reason) {
  return "deployment '" + name + "' is not run: its spec is refused (" + reason +
         ") and no earlier one was valid; fix the spec, then ask again";
}

std::string ZoneOf(const v1::Register& r) {
  for (const char* key : {"topology.kubernetes.io/zone", "zone"}) {
    auto it = r.labels().find(key);
    if (it != r.labels().end()) return it->second;
  }
  return "";
}

}  // namespace

void CutShort(std::string* text, size_t max_bytes) {
  if (text->size() <= max_bytes) return;
  size_t cut = max_bytes;
  // Not inside a UTF-8 sequence: back to the byte that starts one.
  while (cut > 0 && (static_cast<unsigned char>((*text)[cut]) & 0xC0) == 0x80) --cut;
  text->resize(cut);
  text->append("...");
}

absl::Duration NextPassIn(absl::Duration tick, absl::Duration to_lease, absl::Duration pass) {
  // At the lease's end a millisecond late: it ends at that instant.
  if (to_lease < tick + pass) return std::max(to_lease, absl::ZeroDuration()) + absl::Milliseconds(1);
  return tick;
}

Controller::Controller(ControllerOptions options, Store* store, Clock* clock)
    : options_(options),
      store_(store),
      clock_(clock),
      started_(clock->Now()),
      registry_(options.leases) {
  groups_.resize(std::max(1, options_.routing.groups));
}

Controller::~Controller() { Stop(); }

void Controller::Start() {
  leading_ = true;
  started_ = clock_->Now();  // before the loop's thread reads it
  loop_ = std::thread([this]() {
    // The last passes (by the controller's clock): the longest is how long a pass started now
    // may run (the longest, not a typical one: a lease that ends inside a pass waits for two),
    // taken as at most a second (one long pass, the first after a start or a burst of
    // registrations, would otherwise hold passes back until a lease ends).
    std::deque<absl::Duration> passes;
    absl::Time start = clock_->Now();  // the last pass's
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
        const absl::Time now = clock_->Now();
        absl::Duration longest = absl::ZeroDuration();
        for (absl::Duration p : passes) longest = std::max(longest, p);
        // Leases that ended since the last pass began count (one that ended while it ran was
        // not acted on: the next pass comes at once, not a tick later).
        const absl::Duration wait =
            NextPassIn(options_.tick, registry_.NextTransition(start) - now,
                       std::min(longest, absl::Seconds(1)));
        if (mu_.AwaitWithTimeout(absl::Condition(&stop), wait)) return;
      }
      start = clock_->Now();
      Tick();
      passes.push_back(clock_->Now() - start);
      if (passes.size() > 8) passes.pop_front();
    }
  });
}

class Controller::Stream final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  Stream(Controller* controller, grpc::CallbackServerContext* context)
      : controller_(controller), context_(context) {}

  // Held by itself until gRPC is done with it, and by the controller's map while registered.
  static Stream* Start(Controller* controller, grpc::CallbackServerContext* context) {
    auto s = std::make_shared<Stream>(controller, context);
    s->self_ = s;
    bool open = false;
    {
      absl::MutexLock lock(&controller->mu_);
      if (!controller->stopping_) controller->streams_[s.get()] = s;
      open = !controller->stopping_;
    }
    if (open) {
      s->StartRead(&s->in_bytes_);
    } else {
      s->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "controller stopping"));
    }
    return s.get();
  }

  const std::string& node() const { return node_; }

  // From the loop: the newest whole-state message of its kind (a serialized
  // ControllerMessage), written once the agent has taken the one before.
  void Offer(bool assignment, const grpc::ByteBuffer& m) {
    absl::MutexLock lock(&mu_);
    if (ending_ || broken_) return;
    (assignment ? assignment_ : routing_) = m;  // shares the bytes
    if (!writing_) WriteNextLocked();
  }

  // The newest NodeStatus not yet taken, and when it came, swapped into `status`; what
  // `status` held stays here, its memory reused by the next report parsed.
  bool TakeStatus(v1::NodeStatus* status, absl::Time* at) {
    absl::MutexLock lock(&mu_);
    if (!has_status_) return false;
    status->Swap(&status_);
    *at = status_at_;
    has_status_ = false;
    return true;
  }

  // Ends the stream with `s` (once; after a write in flight completes).
  void End(grpc::Status s) {
    absl::MutexLock lock(&mu_);
    if (ending_) return;
    ending_ = true;
    assignment_.reset();
    routing_.reset();
    if (writing_) {
      end_status_ = std::move(s);
    } else {
      Finish(std::move(s));
    }
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the agent closed its side, went away, or the call was cancelled
      End(grpc::Status::OK);
      return;
    }
    if (!node_.empty() && ParseStatusOnly()) {  // most of what an agent sends
      {
        absl::MutexLock lock(&mu_);
        status_.Swap(&parsing_);
        Reported();
        if (ending_) return;
      }
      StartRead(&in_bytes_);
      return;
    }
    grpc::Status refused =
        grpc::SerializationTraits<v1::AgentMessage>::Deserialize(&in_bytes_, &in_);
    if (!refused.ok()) {
      refused = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                             "the message is not a kiln.v1.AgentMessage: " +
                                 refused.error_message());
    } else if (node_.empty()) {
      refused = First();
    } else {
      switch (in_.message_case()) {
        case v1::AgentMessage::kStatus: {
          absl::MutexLock lock(&mu_);
          status_.Swap(in_.mutable_status());
          Reported();
          break;
        }
        case v1::AgentMessage::kRegister:
          {
            absl::MutexLock lock(&mu_);
            has_status_ = false;  // from before the node registered again
          }
          refused = controller_->Registered(self_, in_.register_(), /*first=*/false);
          break;
        case v1::AgentMessage::kAck:
        case v1::AgentMessage::kNack:
          controller_->Acked(self_, in_);
          break;
        default:
          break;
      }
    }
    if (!refused.ok()) {
      GetLogger("controller")
          ->warn("stream from {}{}: ended: {}", context_->peer(),
                 node_.empty() ? "" : " (node " + node_ + ")", refused.error_message());
      End(refused);
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      if (ending_) return;  // Stop() or a cancel ended it meanwhile
    }
    StartRead(&in_bytes_);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (end_status_) {  // End came while this write was in flight
      Finish(*end_status_);
      end_status_.reset();
      return;
    }
    if (!ok) {  // the agent is gone: no more writes; its read side ends the stream
      broken_ = true;
      return;
    }
    if (!ending_) WriteNextLocked();
  }

  void OnCancel() override {
    GetLogger("controller")->debug("stream from {} cancelled", context_->peer());
    End(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    if (!node_.empty()) controller_->Ended(node_, this);
    {
      absl::MutexLock lock(&controller_->mu_);
      controller_->streams_.erase(this);
    }
    self_.reset();  // the last owner may be this: nothing after it
  }

 private:
  // The first message: a Register under a name the client certificate carries (with node
  // identity required).
  grpc::Status First() {
    auto log = GetLogger("controller");
    if (in_.message_case() != v1::AgentMessage::kRegister) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "the first message on the stream must be Register");
    }
    const std::string& node = in_.register_().node_name();
    if (controller_->options_.require_node_identity) {
      std::vector<std::string> names = PeerCertificateNames(*context_->auth_context());
      if (std::find(names.begin(), names.end(), node) == names.end()) {
        std::string have;
        for (const auto& n : names) have += (have.empty() ? "" : ", ") + n;
        log->warn("refused a Register as node '{}' from {}: its certificate names {}", node,
                  context_->peer(), have.empty() ? "nothing" : have);
        return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                            "register.node_name: '" + node +
                                "' is not a name in the client certificate (it carries: " +
                                (have.empty() ? "none" : have) + ")");
      }
    }
    grpc::Status s = controller_->Registered(self_, in_.register_(), /*first=*/true);
    if (s.ok()) node_ = node;
    return s;
  }

  // An AgentMessage that is one NodeStatus and nothing else, parsed into parsing_ (whose
  // memory, a report taken earlier, protobuf reuses: no allocation per replica per report).
  // False for anything else (another kind, more fields, bad bytes): the general parse decides.
  bool ParseStatusOnly() {
    namespace io = google::protobuf::io;
    constexpr uint32_t kStatusTag = (v1::AgentMessage::kStatusFieldNumber << 3) | 2;  // LEN
    grpc::ProtoBufferReader reader(&in_bytes_);
    io::CodedInputStream in(&reader);
    uint32_t length = 0;
    if (in.ReadTag() != kStatusTag || !in.ReadVarint32(&length)) return false;
    io::CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
    parsing_.Clear();
    if (!parsing_.MergeFromCodedStream(&in) || !in.ConsumedEntireMessage() ||
        in.BytesUntilLimit() != 0) {
      return false;
    }
    in.PopLimit(limit);
    if (in.ReadTag() != 0 || !in.ConsumedEntireMessage()) return false;  // more than a status
    in_bytes_.Clear();
    return true;
  }

  // A report was just put in status_: the controller learns of the stream once until it takes
  // the report (the controller's lock is never taken here: a pass holds it for long).
  void Reported() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    status_at_ = controller_->clock_->Now();
    if (has_status_) return;  // listed already
    has_status_ = true;
    absl::MutexLock lock(&controller_->reports_mu_);
    controller_->reported_.push_back(self_);
  }

  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // The assignment first: the routing table may name replicas it starts.
    std::optional<grpc::ByteBuffer>& next = assignment_ ? assignment_ : routing_;
    if (!next) return;
    out_ = std::move(*next);
    next.reset();
    writing_ = true;
    StartWrite(&out_);  // its reaction runs on gRPC's executor, never inline here
  }

  Controller* const controller_;
  grpc::CallbackServerContext* const context_;
  std::shared_ptr<Stream> self_;
  // Touched by the reactions only (one at a time per direction).
  grpc::ByteBuffer in_bytes_;
  v1::AgentMessage in_;
  v1::NodeStatus parsing_;  // a report being parsed
  std::string node_;  // set once registered

  absl::Mutex mu_;
  std::optional<grpc::ByteBuffer> assignment_ ABSL_GUARDED_BY(mu_);
  std::optional<grpc::ByteBuffer> routing_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer out_ ABSL_GUARDED_BY(mu_);  // being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ending_ ABSL_GUARDED_BY(mu_) = false;  // End was called: no more writes
  bool broken_ ABSL_GUARDED_BY(mu_) = false;  // a write failed
  std::optional<grpc::Status> end_status_ ABSL_GUARDED_BY(mu_);  // once the write completes
  v1::NodeStatus status_ ABSL_GUARDED_BY(mu_);  // the newest report when has_status_
  bool has_status_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time status_at_ ABSL_GUARDED_BY(mu_);
};

void Controller::Stop() {
  std::vector<std::shared_ptr<Stream>> streams;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (const auto& [ptr, weak] : streams_) {
      if (auto stream = weak.lock()) streams.push_back(std::move(stream));
    }
  }
  if (loop_.joinable()) loop_.join();
  {
    absl::MutexLock lock(&mu_);
    loop_done_ = true;  // its waiters hear that no pass will take their action now
  }
  for (const auto& s : streams) {
    s->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "controller stopping"));
  }
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Controller::Connect(
    grpc::CallbackServerContext* context) {
  return Stream::Start(this, context);
}

grpc::Status Controller::Registered(const std::shared_ptr<Stream>& stream, const v1::Register& r,
                                    bool first) {
  auto log = GetLogger("controller");
  const std::string& node = r.node_name();
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "shutting down");
    if (!first && node != stream->node()) {
      // A stream speaks for the node it registered (and, with mutual TLS, the node its
      // certificate names): another name would take over that node's entry and routes.
      log->warn("node {} tried to re-register as '{}': stream ended", stream->node(), node);
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          "register.node_name: this stream registered '" + stream->node() +
                              "'; it cannot register '" + node + "'");
    }
    absl::Status s = registry_.Register(r, clock_->Now());
    if (!s.ok()) {
      if (!first) return grpc::Status::OK;  // as before: a bad repeat changes nothing
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(s.message()));
    }
    if (first) {
      sessions_[node] = stream;
      registrations_++;
      // A forgotten node is back: what it runs is reported again, its ids in use as such.
      // (One entry at most: a node is forgotten once between registrations.)
      auto retired = std::find_if(retired_.begin(), retired_.end(),
                                  [&node](const auto& e) { return e.first == node; });
      if (retired != retired_.end()) Unretire(retired);
      // What this node was sent before is unknown to it now (or it is new): send it all again.
      Sent& sent = sent_[node];
      int64_t gen = sent.assignment_generation;
      int64_t rgen = sent.routing_generation;
      sent = Sent();
      sent.assignment_generation = gen;
      sent.routing_generation = rgen;
    }
  }
  if (first) {
    log->info("node {} registered: {} cpus, {} gpus, {} replica(s) running", node,
              r.cpu_capacity(), r.gpus_size(), r.replicas_size());
  }
  return grpc::Status::OK;
}

void Controller::Acked(const std::shared_ptr<Stream>& stream, v1::AgentMessage m) {
  if (m.has_nack()) {
    // A reason goes into events and status conditions (the API caps their size): kept short.
    CutShort(m.mutable_nack()->mutable_reason(), kMaxNackReason);
    GetLogger("controller")
        ->warn("node {} refused generation {}: {}", stream->node(), m.nack().generation(),
               m.nack().reason());
  }
  // Kept for the next pass (or read of the nodes): the stream's thread never waits for the
  // controller's lock, which a pass holds for long at 10,000 nodes (Acks waiting for it held
  // every stream's reads, so reports came late and nodes went NotReady). Bounded: an agent
  // that floods them between two passes loses the rest, said once a pass.
  absl::MutexLock lock(&reports_mu_);
  size_t& from_this = acks_per_stream_[stream.get()];
  if (acks_.size() >= kMaxQueuedAcks || from_this >= kMaxQueuedAcksPerStream) {
    if (acks_dropped_++ == 0) {
      GetLogger("controller")
          ->warn("more than {} Acks and Nacks before a pass ({} from node {}); the rest dropped",
                 acks_.size(), from_this, stream->node());
    }
    return;
  }
  ++from_this;
  acks_.push_back({stream, std::move(m)});
}

size_t Controller::QueuedAcksForTest() {
  absl::MutexLock lock(&reports_mu_);
  return acks_.size();
}

void Controller::TakeAcks() {
  std::vector<std::pair<std::shared_ptr<Stream>, v1::AgentMessage>> acks;
  {
    absl::MutexLock lock(&reports_mu_);
    acks.swap(acks_);
    acks_dropped_ = 0;
    acks_per_stream_.clear();
  }
  for (const auto& [stream, m] : acks) {  // in the order they came
    // Only the node's current stream speaks for it: a node that registered again since (an
    // agent restart) was sent its assignment afresh, and an old Nack says nothing of it.
    const std::string& node = stream->node();
    auto session = sessions_.find(node);
    if (session == sessions_.end() || session->second != stream) continue;
    auto sent = sent_.find(node);
    if (sent == sent_.end()) continue;  // forgotten meanwhile
    if (m.has_ack()) {
      if (m.ack().kind() == v1::Ack::ASSIGNMENT &&
          m.ack().generation() == sent->second.assignment_generation) {
        sent->second.nack.clear();
      }
      continue;
    }
    // Only a Nack of the assignment in force counts: a late one for an older generation says
    // nothing about the one the node has now.
    if (m.nack().kind() == v1::Ack::ASSIGNMENT &&
        m.nack().generation() == sent->second.assignment_generation) {
      sent->second.nack = m.nack().reason();
      new_nacks_[node] = m.nack().reason();
    }
  }
}

void Controller::Ended(const std::string& node, const Stream* stream) {
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(node);
    if (it == sessions_.end() || it->second.get() != stream) return;  // replaced by a newer one
    sessions_.erase(it);
    registry_.Disconnected(node);
  }
  GetLogger("controller")->info("node {} disconnected", node);
}

void Controller::TakeStatuses() {
  TakeAcks();
  // Reports change hands by swaps: a node's previous report goes back to a stream to be
  // parsed into again (freeing 50,000 replicas' reports a pass was a tenth of it).
  std::vector<std::shared_ptr<Stream>> reported;
  {
    absl::MutexLock lock(&reports_mu_);
    reported.swap(reported_);
  }
  absl::Time at;
  for (const auto& stream : reported) {
    // Only a node's current stream speaks for it (a replaced one's last report is stale).
    auto session = sessions_.find(stream->node());
    if (session == sessions_.end() || session->second != stream) {
      (void)stream->TakeStatus(&spare_status_, &at);  // and the stream may report again
      continue;
    }
    if (stream->TakeStatus(&spare_status_, &at)) {
      (void)registry_.SwapStatus(session->first, &spare_status_, at);
    }
  }
}

void Controller::Send(const std::string& node, const v1::ControllerMessage& m) {
  auto it = sessions_.find(node);
  if (it == sessions_.end()) return;
  grpc::ByteBuffer bytes;
  grpc::Status s = ToBytes(m, &bytes);
  if (!s.ok()) {
    GetLogger("controller")->error("node {}: cannot serialize its message: {}", node, s.error_message());
    return;
  }
  it->second->Offer(m.has_assignment(), bytes);
}

void Controller::SendRouting(const std::string& node, const grpc::ByteBuffer& table) {
  auto it = sessions_.find(node);
  if (it != sessions_.end()) it->second->Offer(/*assignment=*/false, table);
}

std::string Controller::Overloaded(const v1::GpuStatus& gpu, const v1::NodeStatus& status,
                                   const Sent& sent) const {
  if (options_.overload_utilization_pct <= 0) return "";
  std::string throttled;
  for (const auto& reason : gpu.reasons()) {
    if (reason.rfind("throttled:", 0) == 0) throttled = reason;
  }
  if (throttled.empty() &&
      static_cast<int>(gpu.utilization_pct()) < options_.overload_utilization_pct) {
    return "";
  }
  // Busy or throttled is not overloaded while its replicas keep up: requests must be waiting.
  int64_t queued = 0;
  for (const auto& r : status.replicas()) {
    if (r.state() != v1::SERVING || r.load().queue_depth() <= 0) continue;
    for (const auto& spec : sent.replicas) {
      if (spec.replica_id() == r.replica_id() && spec.gpu() == gpu.index()) {
        queued += r.load().queue_depth();
      }
    }
  }
  if (queued == 0) return "";
  const std::string waiting = std::to_string(queued) + " requests queued";
  if (!throttled.empty()) return throttled + ", " + waiting;
  return "busy: " + std::to_string(gpu.utilization_pct()) + "% utilised, " + waiting;
}

void Controller::Tick() {
  leading_ = true;  // whoever runs the decisions holds the nodes (Start, or a test by hand)
  auto log = GetLogger("controller");
  const absl::Time now = clock_->Now();
  // Every pass is timed, whichever way it ends.
  struct Timer {
    Controller* c;
    absl::Time start;
    ~Timer() { c->tick_seconds_.Record(absl::ToDoubleSeconds(c->clock_->Now() - start)); }
  } timer{this, now};
  if (now - started_ < options_.observe_for) return;  // agents are still re-registering
  auto objects = store_->List(kModelDeploymentKind);
  if (!objects.ok()) {
    log->error("store: {}", objects.status().ToString());
    return;
  }
  struct Dep {
    StoredObject object;
    const ModelDeployment& d;  // decoded_'s, which keeps it for the whole pass
  };
  std::vector<Dep> deps;
  deps.reserve(objects->size());
  std::vector<PlacementDemand> demands;
  demands.reserve(objects->size());
  std::set<std::string> stored;  // every deployment's name, valid or not
  for (auto& o : *objects) {
    stored.insert(o.name);
    // Parsed again only when its stored text changed (parsing every deployment on every
    // pass was a third of a pass at 1,000 deployments).
    auto cached = decoded_.find(o.name);
    // Another object of the same name (deleted and made again): what the old one ran is not it.
    if (cached != decoded_.end() && cached->second.uid != o.uid) {
      decoded_.erase(cached);
      cached = decoded_.end();
    }
    auto bad = invalid_.find(o.name);
    if (bad != invalid_.end() && bad->second.spec != o.spec) {
      invalid_.erase(bad);
      bad = invalid_.end();
    }
    if (bad == invalid_.end() && (cached == decoded_.end() || cached->second.spec != o.spec)) {
      auto parsed = DecodeFromStore(o.name, o.spec);
      if (parsed.ok()) {
        cached = decoded_
                     .insert_or_assign(o.name,
                                       Decoded{o.spec, std::move(*parsed), o.generation, o.uid})
                     .first;
      } else {
        // Refused, and nothing of it run since this controller started (it was refused while
        // the controller was down, or before a restart): the spec its status says ran last.
        if (cached == decoded_.end()) {
          if (auto last = LastAppliedOf(o); last.has_value()) {
            cached = decoded_.insert_or_assign(o.name, std::move(*last)).first;
          }
        }
        // A spec the store took and kiln refuses (a looser schema, a newer kiln's checks) is no
        // deletion: the deployment goes on as last applied, with the reason in its status.
        // Said once per text, not every pass.
        log->error("{}; {}", parsed.status().ToString(),
                   cached != decoded_.end() ? "it runs as last applied" : "it is not run");
        std::string reason(parsed.status().message());
        CutShort(&reason, kMaxNackReason);  // it may quote the spec: a condition's message is capped
        invalid_[o.name] = {o.spec, std::move(reason)};
      }
    }
    if (cached == decoded_.end()) continue;  // never valid: nothing to run
    // The same valid text again at a later generation (changed away and back): that one runs.
    if (bad == invalid_.end() && cached->second.spec == o.spec) {
      cached->second.generation = std::max(cached->second.generation, o.generation);
    }
    const ModelDeployment* d = &cached->second.d;
    PlacementDemand pd;
    pd.deployment = d->name;
    pd.model = d->spec.model.name;
    pd.version = d->spec.model.version;
    pd.repository = RepositoryOf(d->spec.model);
    pd.serving = d->spec.replicas;
    pd.warm = d->spec.warm_pool;
    pd.gpus = d->spec.resources.gpus;
    pd.gpu_memory_bytes = d->spec.resources.gpu_memory_bytes;
    pd.cpus = d->spec.resources.cpus;
    pd.max_surge = d->spec.rollout.surge();
    pd.max_unavailable = d->spec.rollout.unavailable();
    demands.push_back(pd);
    deps.push_back({std::move(o), *d});
  }
  deployments_ = static_cast<int64_t>(deps.size());
  std::set<std::string> live;  // the deployments there are now: what is kept for others goes
  for (const auto& dep : deps) live.insert(dep.d.name);
  std::erase_if(decoded_, [&live](const auto& e) { return !live.count(e.first); });
  std::erase_if(invalid_, [&stored](const auto& e) { return !stored.count(e.first); });
  std::map<std::string, std::string> not_run;  // stored, never valid: nothing runs them
  for (const auto& [name, bad] : invalid_) {
    if (!live.count(name)) not_run[name] = NotRunReason(name, bad.reason);
  }

  std::vector<std::pair<std::string, nlohmann::json>> statuses;
  // Actions taken, waiting for their deployment's status to be written (deployment -> tickets).
  std::map<std::string, std::vector<uint64_t>> unwritten;
  // Events for operators (Kubernetes Events on that store), recorded once the lock is released.
  struct PendingEvent {
    std::string name, type, reason, message;
  };
  std::vector<PendingEvent> events;
  std::map<std::string, std::vector<std::string>> refused_by;  // deployment -> "node: why"
  {
    // Streams of forgotten nodes, ended once the lock below is released (declared first, so
    // destroyed last).
    struct EndStreams {
      std::vector<std::shared_ptr<Stream>> streams;
      ~EndStreams() {
        for (const auto& s : streams) {
          s->End(grpc::Status(grpc::StatusCode::NOT_FOUND, "this node was forgotten"));
        }
      }
    } forgotten_streams;
    absl::MutexLock lock(&mu_);
    TakeStatuses();
    // Actions asked of a deployment deleted since, or of one whose spec is refused with none
    // valid before it: nothing will take them.
    not_run_ = std::move(not_run);
    for (auto pa = pending_actions_.begin(); pa != pending_actions_.end();) {
      if (!stored.count(pa->first)) {
        EndAction(pa->second.ticket,
                  absl::NotFoundError("deployment '" + pa->first + "' is gone"));
      } else if (auto why = not_run_.find(pa->first); why != not_run_.end()) {
        EndAction(pa->second.ticket, absl::FailedPreconditionError(why->second));
      } else {
        ++pa;
        continue;
      }
      pa = pending_actions_.erase(pa);
    }
    if (options_.forget_lost_after > absl::ZeroDuration()) {
      for (const auto& [name, record] : registry_.Forget(now, options_.forget_lost_after)) {
        Retire(name, record,
               "Lost for " + absl::FormatDuration(options_.forget_lost_after) +
                   " past its lease",
               &forgotten_streams.streams);
      }
    }
    // Refused assignments: an event for each deployment they held replicas of (said once, as the
    // Nack came), and a condition while the refusal stands (below). Not sent again until the
    // assignment changes: a refusal is not retried in a loop.
    for (const auto& [node, sent] : sent_) {
      if (sent.nack.empty()) continue;
      std::set<std::string> deps_here;
      for (const auto& spec : sent.replicas) {
        deps_here.insert(DeploymentOfReplica(spec.replica_id()));
      }
      const bool fresh = new_nacks_.count(node) > 0;
      for (const auto& dep : deps_here) {
        refused_by[dep].push_back(node + ": " + sent.nack);
        if (fresh) {
          events.push_back({dep, "Warning", "AssignmentRefused",
                            "node " + node + " refused its assignment (generation " +
                                std::to_string(sent.assignment_generation) + "): " + sent.nack});
        }
      }
    }
    new_nacks_.clear();
    // One deployment per model name: a node's router routes requests by model name (and
    // refuses a routing table that names a model twice). The deployment that serves a model
    // keeps it while it names it (an edit elsewhere cannot take it away); a model without one
    // goes to the deployment created first (then by name). The others are neither placed nor
    // routed, and say why.
    std::map<std::string, std::string> conflicts;  // deployment -> why
    {
      std::map<std::string, const Dep*> owner;  // model name -> its deployment
      for (const auto& dep : deps) {
        auto kept = model_owner_.find(dep.d.spec.model.name);
        if (kept != model_owner_.end() && kept->second == dep.d.name) {
          owner[dep.d.spec.model.name] = &dep;
        }
      }
      for (const auto& dep : deps) {
        const std::string& model = dep.d.spec.model.name;
        auto kept = model_owner_.find(model);
        const bool sticky = kept != model_owner_.end() && owner.count(model) &&
                            owner[model]->d.name == kept->second;
        auto [it, fresh] = owner.emplace(model, &dep);
        if (!fresh && !sticky &&
            std::tie(dep.object.created_unix_micros, dep.d.name) <
                std::tie(it->second->object.created_unix_micros, it->second->d.name)) {
          it->second = &dep;
        }
      }
      model_owner_.clear();
      for (const auto& [model, dep] : owner) model_owner_[model] = dep->d.name;
      for (const auto& dep : deps) {
        const Dep* first = owner[dep.d.spec.model.name];
        if (first == &dep) continue;
        conflicts[dep.d.name] = "model '" + dep.d.spec.model.name +
                                "' is already served by deployment '" + first->d.name +
                                "'; requests are routed by model name, so this deployment is "
                                "neither placed nor routed";
      }
      for (const auto& [name, why] : conflicts) {
        if (name_conflicts_.insert(name).second) {
          log->warn("deployment {}: {}", name, why);
          events.push_back({name, "Warning", "ModelNameConflict", why});
        }
      }
      for (auto it = name_conflicts_.begin(); it != name_conflicts_.end();) {
        it = conflicts.count(*it) ? std::next(it) : name_conflicts_.erase(it);
      }
    }
    std::vector<PlacementNode> nodes;
    std::set<std::string> lost_ids;  // replicas on Lost nodes, placed again elsewhere
    nodes.reserve(registry_.nodes().size());
    std::vector<const v1::Register*> registrations;  // nodes[i]'s
    std::vector<Sent*> sent_to;                      // nodes[i]'s (a map's nodes stay put)
    registrations.reserve(registry_.nodes().size());
    sent_to.reserve(registry_.nodes().size());
    std::vector<std::pair<std::string, absl::Time>> newly_lost;  // and when their lease ended
    std::set<std::string> lost;
    // sent_ walked beside the registry (both in name order): a lookup per node cost more.
    auto sent_at = sent_.begin();
    for (const auto& [name, rec] : registry_.nodes()) {
      NodeHealth health = registry_.Health(rec, now);
      while (sent_at != sent_.end() && sent_at->first < name) ++sent_at;
      if (sent_at == sent_.end() || sent_at->first != name) {
        sent_at = sent_.emplace_hint(sent_at, name, Sent());
      }
      Sent& sent = sent_at->second;
      if (health == NodeHealth::kLost) {  // its replicas are placed again elsewhere
        lost.insert(name);
        const absl::Time lease_end = rec.last_heard + options_.leases.lost_after;
        // (Not while the controller observed after its start: that held the decision back.)
        if (!lost_.count(name) && lease_end >= started_ + options_.observe_for) {
          newly_lost.emplace_back(name, lease_end);
        }
        for (const auto& r : rec.status.replicas()) lost_ids.insert(r.replica_id());
        for (const auto& r : sent.replicas) lost_ids.insert(r.replica_id());
        continue;
      }
      PlacementNode n;
      n.name = name;
      n.schedulable = health == NodeHealth::kReady;
      n.zone = ZoneOf(rec.registration);
      n.cpu_capacity = rec.registration.cpu_capacity();
      for (const auto& g : rec.registration.gpus()) {
        PlacementNode::Gpu pg{g.index(), g.memory_bytes(), true, {}};
        for (const auto& gs : rec.status.gpus()) {
          if (gs.index() != g.index()) continue;
          if (!gs.healthy()) pg.healthy = false;
          pg.overloaded = Overloaded(gs, rec.status, sent);
        }
        n.gpus.push_back(pg);
      }
      // The registry's and sent_'s records themselves: nothing below changes them this tick.
      n.assignment_known = sent.assignment_sent;
      for (const auto& spec : sent.replicas) n.assigned.push_back(&spec);
      for (const auto& r : rec.status.replicas()) {
        n.reported.push_back(&r);
        n.load += static_cast<double>(r.load().in_flight());
        if (r.crash_loop() || r.state() == v1::FAILED) {
          crash_sites_[name][DeploymentOfReplica(r.replica_id())] = now;
        }
      }
      if (auto sites = crash_sites_.find(name); sites != crash_sites_.end()) {
        std::erase_if(sites->second, [&](const auto& e) { return now - e.second > kCrashMemory; });
        for (const auto& [dep, at] : sites->second) n.crashed.push_back(dep);
        if (sites->second.empty()) crash_sites_.erase(sites);
      }
      nodes.push_back(std::move(n));
      registrations.push_back(&rec.registration);
      sent_to.push_back(&sent);
    }
    // Each deployment's reported replicas (node order), found once instead of per deployment.
    struct Seen {
      const PlacementNode* node;
      const v1::ReplicaStatus* replica;
    };
    // Keyed by views into the reports' and assignments' ids, which the lock keeps this pass.
    std::unordered_map<std::string_view, std::vector<Seen>> reported_by_dep;
    std::unordered_map<std::string_view, int64_t> assigned_by_dep;
    for (const auto& n : nodes) {
      for (const v1::ReplicaStatus* r : n.reported) {
        reported_by_dep[DeploymentView(r->replica_id())].push_back({&n, r});
      }
    }
    auto reported_of = [&reported_by_dep](const std::string& dep) -> const std::vector<Seen>& {
      static const std::vector<Seen> kNone;
      auto it = reported_by_dep.find(dep);
      return it == reported_by_dep.end() ? kNone : it->second;
    };
    // Autoscaled deployments: SERVING count from the in-flight requests their replicas report.
    for (size_t i = 0; i < deps.size(); ++i) {
      const ModelDeployment& d = deps[i].d;
      if (!d.spec.autoscale) {
        autoscale_.erase(d.name);
        autoscaled_to_.erase(d.name);
        continue;
      }
      double in_flight = 0;
      bool reports = false;
      for (const Seen& seen : reported_of(d.name)) {
        if (seen.replica->state() != v1::SERVING) continue;
        in_flight += static_cast<double>(seen.replica->load().in_flight());
        reports = true;
      }
      auto current = autoscaled_to_.find(d.name);
      int64_t now_count = d.spec.autoscale->floor();
      if (current != autoscaled_to_.end()) {
        now_count = current->second;
      } else {
        // First sight (this controller just started, or the deployment just turned to
        // autoscaling): the count its status last recorded, so a restart neither drops
        // replicas that are serving load nor skips the scale-down window.
        auto status = nlohmann::json::parse(deps[i].object.status, nullptr, false);
        if (status.is_object() && status.contains("desiredReplicas") &&
            status["desiredReplicas"].is_number_integer()) {
          now_count = status["desiredReplicas"].get<int64_t>();
        }
      }
      int64_t next = autoscale_[d.name].Recommend(*d.spec.autoscale, in_flight, reports, now_count,
                                                  now, options_.scale_down_stabilization);
      if (next != now_count) {
        log->info("autoscale {}: {} -> {} replicas ({} requests in flight, target {} each)", d.name,
                  now_count, next, in_flight, d.spec.autoscale->target_in_flight);
      }
      autoscaled_to_[d.name] = next;
      demands[i].serving = next;
    }

    // Rollouts: per deployment, the versions to run and the split, from the reports.
    std::map<std::string, RolloutPlan> plans;
    std::map<std::string, std::map<std::string, VersionStats>> version_stats;  // by deployment
    std::vector<PlacementDemand> all_demands;
    // Forget deployments that are gone (or were deleted and created again under the name).
    std::unordered_map<std::string_view, std::string_view> uid_of;  // deployment -> its uid
    uid_of.reserve(deps.size());
    for (const auto& dep : deps) uid_of.emplace(dep.object.name, dep.object.uid);
    for (auto it = rollouts_.begin(); it != rollouts_.end();) {
      auto uid = uid_of.find(it->first);  // the very object the state was kept for
      if (uid != uid_of.end() && uid->second == rollout_uids_[it->first]) {
        ++it;
      } else {
        rollout_uids_.erase(it->first);
        linger_.erase(it->first);
        autoscale_.erase(it->first);
        autoscaled_to_.erase(it->first);
        it = rollouts_.erase(it);
      }
    }
    for (size_t i = 0; i < deps.size(); ++i) {
      const ModelDeployment& d = deps[i].d;
      auto known = rollouts_.find(d.name);
      if (known == rollouts_.end()) {
        rollout_uids_[d.name] = deps[i].object.uid;
        auto status = nlohmann::json::parse(deps[i].object.status, nullptr, false);
        RolloutState seeded;
        if (!status.is_discarded() && status.is_object() && status.contains("rollout")) {
          seeded = RolloutState::FromJson(status["rollout"]);
        }
        known = rollouts_.emplace(d.name, seeded).first;
      }
      std::map<std::string, VersionStats> stats;  // by version, from the SERVING replicas
      for (const Seen& seen : reported_of(d.name)) {
        const v1::ReplicaStatus& r = *seen.replica;
        if (r.state() != v1::SERVING) continue;
        VersionStats& v = stats[r.version()];
        if (r.healthy()) v.ready++;
        v.requests += r.load().requests();
        v.errors += r.load().errors();
        v.p99_micros = std::max(v.p99_micros, r.load().latency_p99_micros());
      }
      version_stats[d.name] = stats;
      if (conflicts.count(d.name)) {  // not placed: no rollout moves, actions wait
        RolloutPlan held;
        held.state = known->second;
        held.stable_version = known->second.stable_version;
        plans[d.name] = held;
        continue;
      }
      ModelDeploymentSpec spec = d.spec;
      spec.replicas = demands[i].serving;
      const RolloutState& st = known->second;
      RolloutAction action = RolloutAction::kNone;
      uint64_t action_ticket = 0;
      if (auto pa = pending_actions_.find(d.name); pa != pending_actions_.end()) {
        // For the rollout it was asked of: one superseded since (another version applied)
        // is not promoted, aborted or paused by an action meant for the one before.
        if (pa->second.canary == st.canary_version && pa->second.canary == spec.model.version) {
          action = pa->second.action;
          action_ticket = pa->second.ticket;
        } else {
          log->info("rollout {}: the action asked of version {} dropped: the rollout is now of "
                    "version {}",
                    d.name, pa->second.canary, spec.model.version);
          EndAction(pa->second.ticket,
                    absl::FailedPreconditionError(
                        "dropped: it was asked of version " + pa->second.canary +
                        "'s rollout, and the rollout is now of version " + spec.model.version));
        }
        pending_actions_.erase(pa);
      }
      RolloutPlan plan = PlanRollout(spec, st, stats[st.stable_version],
                                     stats[st.canary_version.empty() ? spec.model.version
                                                                     : st.canary_version],
                                     now, action);
      if (action_ticket != 0 && !plan.action_refused.empty()) {
        EndAction(action_ticket, absl::FailedPreconditionError("refused: " + plan.action_refused));
      } else if (action_ticket != 0) {
        // Answered once the status that records it is written (below).
        actions_unwritten_[d.name].push_back(action_ticket);
      }
      const bool rolled_back = plan.state.phase == "Degraded" && known->second.phase != "Degraded";
      if (rolled_back) rollbacks_++;
      for (const auto& e : plan.events) {
        log->info("rollout {}: {}", d.name, e);
        events.push_back({d.name, rolled_back ? "Warning" : "Normal",
                          rolled_back ? "RolledBack" : "RolloutStep", e});
      }
      known->second = plan.state;
      PlacementDemand stable = demands[i];
      stable.version = plan.stable_version;
      stable.serving = plan.stable_replicas;
      // The deployment's own count (a promotion shrinking the old version is not a
      // scale-down).
      stable.linger =
          LingerFor(d.name, stable.version, demands[i].serving, now, deps[i].object.status);
      all_demands.push_back(stable);
      if (!plan.old_version.empty() && plan.old_version != plan.stable_version) {
        PlacementDemand old = demands[i];  // BlueGreen's previous set, ready but unrouted
        old.version = plan.old_version;
        old.serving = plan.old_replicas;
        old.warm = 0;
        all_demands.push_back(old);
      }
      if (!plan.canary_version.empty()) {
        PlacementDemand canary = demands[i];
        canary.version = plan.canary_version;
        canary.serving = plan.canary_replicas;
        canary.warm = 0;
        all_demands.push_back(canary);
      }
      plans[d.name] = plan;
    }
    std::map<std::string, std::string> moves;
    for (const auto& [id, r] : rebalancing_) moves[id] = r.reason;
    std::set<std::string> evicted;
    for (const auto& [id, e] : evicted_) evicted.insert(id);
    // Ids not to give new replicas: forgotten nodes' (kept as one set) and Lost nodes'.
    std::set<std::string> merged;
    const std::set<std::string>* retired = &retired_ids_;
    if (!lost_ids.empty()) {
      merged = retired_ids_;
      merged.insert(lost_ids.begin(), lost_ids.end());
      retired = &merged;
    }
    // Nodes whose assignment stays as sent come back by name only (most of them, each pass).
    PlacementResult placed =
        Place(all_demands, nodes, *retired, moves, evicted, /*omit_unchanged=*/true);
    // Replicas left WARM by a scale-down hold their room only while nobody needs it: when
    // something found no room, placement runs again without them (they drain).
    if (!placed.unplaced.empty() &&
        std::any_of(all_demands.begin(), all_demands.end(),
                    [](const PlacementDemand& d) { return d.linger > 0; })) {
      for (auto& d : all_demands) d.linger = 0;
      placed = Place(all_demands, nodes, *retired, moves, evicted, /*omit_unchanged=*/true);
      for (auto& [name, l] : linger_) l.Clear();  // they are gone for good
    }
    auto still_reported = [&](const std::string& id) {
      for (const Seen& seen : reported_of(DeploymentOfReplica(id))) {
        if (seen.replica->replica_id() == id) return true;
      }
      return false;
    };
    // Kept at least 30 s (a node may still start it from an assignment older than the
    // eviction and report it late), then until no node reports it.
    for (auto it = evicted_.begin(); it != evicted_.end();) {
      const bool keep = now - it->second.since < absl::Seconds(30) || still_reported(it->first);
      it = keep ? std::next(it) : evicted_.erase(it);
    }
    for (const auto& [id, line] : placed.evicted) {
      log->warn("evicted: {}", line);
      events.push_back({DeploymentOfReplica(id), "Warning", "WarmReplicaEvicted", line});
      evicted_[id] = Rebalance{line, now};
    }
    // Moves under way end when their replica is gone; skew that lasts starts one.
    if (!rebalancing_.empty()) {
      std::set<std::string> assigned;
      for (const auto& [node, specs] : placed.nodes) {
        for (const auto& spec : specs) assigned.insert(spec.replica_id());
      }
      for (const auto& node : placed.unchanged) {
        for (const auto& spec : sent_[node].replicas) assigned.insert(spec.replica_id());
      }
      for (auto it = rebalancing_.begin(); it != rebalancing_.end();) {
        // Done once no node runs it: unassigned, and no longer reported either (until its node
        // reports again the old replica would otherwise count as staying).
        const bool reported = still_reported(it->first);
        if (!assigned.count(it->first) && !reported) {
          log->info("rebalancing: {} moved ({})", it->first, it->second.reason);
          it = rebalancing_.erase(it);
        } else if (now - it->second.since >= options_.move_deadline) {
          log->warn("rebalancing: gave up moving {} after {} ({}): its replacement never served",
                    it->first, absl::FormatDuration(options_.move_deadline), it->second.reason);
          it = rebalancing_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto it = skew_seen_.begin(); it != skew_seen_.end();) {
      it = placed.skewed.count(it->first) ? std::next(it) : skew_seen_.erase(it);
    }
    for (const auto& [id, reason] : placed.skewed) {
      const std::string dep = DeploymentOfReplica(id);
      auto plan = plans.find(dep);
      if (plan != plans.end() && !plan->second.canary_version.empty()) continue;  // a rollout
      bool busy = false;
      for (const auto& [moving, r] : rebalancing_) busy |= DeploymentOfReplica(moving) == dep;
      if (busy) continue;
      auto [seen, fresh] = skew_seen_.emplace(id, Rebalance{reason, now});
      if (now - seen->second.since < options_.rebalance_after) continue;
      log->info("rebalancing: moving {} ({}) after {}", id, reason,
                absl::FormatDuration(now - seen->second.since));
      rebalancing_[id] = Rebalance{reason, now};
      skew_seen_.erase(seen);
    }
    // The assignments below replace sent_'s records these point at.
    for (auto& n : nodes) n.assigned.clear();
    if (placed.unplaced != last_unplaced_) {  // said once per change, not every tick
      for (const auto& line : placed.unplaced) {
        log->warn("unplaced: {}", line);
        if (std::find(last_unplaced_.begin(), last_unplaced_.end(), line) == last_unplaced_.end()) {
          events.push_back({line.substr(0, line.find(':')), "Warning", "FailedPlacement", line});
        }
      }
      last_unplaced_ = placed.unplaced;
    }
    if (placed.moves != last_moves_) {  // each move said when it starts, not every tick
      for (const auto& line : placed.moves) {
        if (std::find(last_moves_.begin(), last_moves_.end(), line) == last_moves_.end()) {
          log->warn("rebalancing: {}", line);
          events.push_back({line.substr(0, line.find(':')), "Warning", "Rebalancing", line});
        }
      }
      last_moves_ = placed.moves;
    }

    // An unchanged assignment is sent only to a node not sent one since it registered.
    for (const auto& node : placed.unchanged) {
      Sent& s = sent_[node];
      if (s.assignment_sent || !sessions_.count(node)) continue;
      placed.nodes[node] = s.replicas;
    }
    std::string ser;
    for (auto& [node, specs] : placed.nodes) {
      Sent& s = sent_[node];
      Serialize(specs, &ser);
      if (s.assignment_sent && ser == s.assignment) continue;
      if (!sessions_.count(node)) continue;  // sent once it reconnects
      const auto& rec = registry_.nodes().at(node);
      int64_t gen = NextGeneration(s.assignment_generation, rec.status.assignment_generation(), now);
      v1::ControllerMessage m;
      m.mutable_assignment()->set_generation(gen);
      for (const auto& spec : specs) *m.mutable_assignment()->add_replicas() = spec;
      s.assignment = ser;
      s.assignment_sent = true;
      s.replicas = std::move(specs);  // placed.nodes is not read after this
      s.assignment_generation = gen;
      log->info("node {}: assignment generation {}: {} replica(s)", node, gen, s.replicas.size());
      Send(node, m);
    }
    lost_ = std::move(lost);
    if (!newly_lost.empty()) {
      const absl::Time decided = clock_->Now();
      for (const auto& [name, lease_end] : newly_lost) {
        node_loss_seconds_.Record(absl::ToDoubleSeconds(decided - lease_end));
        log->warn("node {} lost: its replicas were placed again {} after its lease ended", name,
                  absl::FormatDuration(decided - lease_end));
      }
    }

    // Routing (routing.h): each node learns which other nodes serve each version, reached
    // through their routers; its own replicas it routes to itself (the agent leaves itself
    // out). A deployment's group routes are made again only when what it is built from changed,
    // a group's table is serialized once for its nodes and sent only when it changed.
    bool routes_changed = false;
    std::vector<const Dep*> routed;  // the deployments in the routing tables, in order
    for (const auto& dep : deps) {
      if (!conflicts.count(dep.d.name)) routed.push_back(&dep);
    }
    for (const Dep* routed_dep : routed) {
      const Dep& dep = *routed_dep;
      RouteInput in;
      in.head.set_model(dep.d.spec.model.name);
      const RolloutPlan& plan = plans[dep.d.name];
      auto* v = in.head.add_versions();
      v->set_version(plan.stable_version);
      v->set_weight(static_cast<int32_t>(100 - plan.canary_weight));
      if (!plan.canary_version.empty() && plan.canary_weight > 0) {
        auto* c = in.head.add_versions();
        c->set_version(plan.canary_version);
        c->set_weight(static_cast<int32_t>(plan.canary_weight));
      }
      in.head.set_sticky_key(dep.d.spec.rollout.sticky_key);
      std::string input = in.head.SerializeAsString();
      std::set<std::pair<const PlacementNode*, std::string>> listed;  // (node, version)
      for (const Seen& seen : reported_of(dep.d.name)) {
        const PlacementNode& other = *seen.node;
        const v1::ReplicaStatus& r = *seen.replica;
        if (!other.schedulable) continue;  // NotReady: not routed to
        if (r.state() != v1::SERVING || !r.healthy() ||
            (r.version() != plan.stable_version && r.version() != plan.canary_version)) {
          continue;
        }
        const v1::Register& reg = *registrations[&other - nodes.data()];
        if (reg.ingress_grpc_address().empty()) continue;
        if (!listed.insert({&other, r.version()}).second) continue;
        in.serving.push_back({other.name, r.version(), reg.ingress_grpc_address(),
                              reg.ingress_http_address()});
        input += "\n" + other.name + "\t" + r.version() + "\t" + reg.ingress_grpc_address() +
                 "\t" + reg.ingress_http_address();
      }
      RouteCache& cache = route_cache_[dep.d.name];
      if (cache.groups.empty() || cache.input != input) {
        cache.input = std::move(input);
        cache.groups = GroupRoutes(in, options_.routing);
        routes_changed = true;
      }
    }
    for (auto it = route_cache_.begin(); it != route_cache_.end();) {
      if (live.count(it->first) && !conflicts.count(it->first)) {
        ++it;
      } else {
        it = route_cache_.erase(it);
        routes_changed = true;
      }
    }
    if (routes_changed) {
      for (size_t g = 0; g < groups_.size(); ++g) {
        std::string serialized;
        for (const Dep* dep : routed) {
          serialized += route_cache_[dep->d.name].groups[g].SerializeAsString() + "|";
        }
        if (serialized != groups_[g].serialized) {
          groups_[g].serialized = std::move(serialized);
          groups_[g].version++;
        }
      }
    }
    int64_t applied = -1;  // the highest routing generation any node applied, when needed
    for (const auto& n : nodes) {
      Sent& s = *sent_to[&n - nodes.data()];
      const int g = RoutingGroupOf(n.name, static_cast<int>(groups_.size()));
      GroupTable& group = groups_[g];
      if (s.routing_group == g && s.routes_version == group.version) continue;
      if (!sessions_.count(n.name)) continue;  // sent once it reconnects
      if (group.bytes_version != group.version) {
        if (applied < 0) {
          applied = 0;
          for (const auto& [name, rec] : registry_.nodes()) {
            applied = std::max(applied, rec.status.routing_generation());
          }
        }
        // One generation above what every node applied (the agents keep theirs).
        routing_generation_ = NextGeneration(routing_generation_, applied, now);
        v1::ControllerMessage m;
        v1::RoutingTable* t = m.mutable_routing_table();
        t->set_generation(routing_generation_);
        for (const Dep* dep : routed) *t->add_routes() = route_cache_[dep->d.name].groups[g];
        grpc::ByteBuffer bytes;
        grpc::Status ser = ToBytes(m, &bytes);
        if (!ser.ok()) {
          log->error("routing table of group {}: cannot serialize: {}", g, ser.error_message());
          continue;
        }
        group.bytes = bytes;  // the streams holding the previous one keep it
        group.bytes_version = group.version;
        group.generation = routing_generation_;
        log->debug("routing group {}: generation {}, {} route(s), {} bytes", g,
                   routing_generation_, t->routes_size(), m.ByteSizeLong());
      }
      s.routing_group = g;
      s.routes_version = group.version;
      s.routing_generation = group.generation;
      SendRouting(n.name, group.bytes);
    }

    // Status per deployment, from what the nodes report.
    for (size_t i = 0; i < nodes.size(); ++i) {
      for (const auto& spec : sent_to[i]->replicas) {
        assigned_by_dep[DeploymentView(spec.replica_id())]++;
      }
    }
    const std::string now_text = FormatRfc3339(clock_->Now());
    for (const auto& dep : deps) {
      int64_t ready = 0, warm = 0;
      int64_t assigned = assigned_by_dep[dep.d.name];
      for (const Seen& seen : reported_of(dep.d.name)) {
        const v1::ReplicaStatus& r = *seen.replica;
        if (!r.healthy()) continue;
        if (r.state() == v1::SERVING) ready++;
        if (r.state() == v1::WARM) warm++;
      }
      std::string unplaced;
      for (const auto& line : placed.unplaced) {
        if (line.rfind(dep.d.name + ":", 0) == 0) unplaced = line;
      }
      int64_t desired = dep.d.spec.replicas;
      if (auto it = autoscaled_to_.find(dep.d.name); it != autoscaled_to_.end()) desired = it->second;
      bool available = ready >= desired;
      nlohmann::json conditions = nlohmann::json::array();
      conditions.push_back({{"type", "Available"},
                            {"status", available ? "True" : "False"},
                            {"reason", available ? "ReplicasReady" : "ReplicasNotReady"},
                            {"message", std::to_string(ready) + " of " +
                                            std::to_string(desired) + " replicas serving"}});
      const RolloutPlan& plan = plans[dep.d.name];
      conditions.push_back({{"type", "Progressing"},
                            {"status", plan.state.canary_version.empty() ? "False" : "True"},
                            {"reason", plan.state.canary_version.empty() ? "Stable" : "Rollout"},
                            {"message", plan.state.message}});
      if (plan.state.phase == "Degraded") {
        conditions.push_back({{"type", "Degraded"},
                              {"status", "True"},
                              {"reason", "RolledBack"},
                              {"message", plan.state.message}});
      }
      if (auto conflict = conflicts.find(dep.d.name); conflict != conflicts.end()) {
        conditions.push_back({{"type", "Schedulable"},
                              {"status", "False"},
                              {"reason", "ModelNameConflict"},
                              {"message", conflict->second}});
      } else if (!unplaced.empty()) {
        conditions.push_back({{"type", "Schedulable"},
                              {"status", "False"},
                              {"reason", "NoRoom"},
                              {"message", unplaced}});
      }
      if (auto refused = refused_by.find(dep.d.name); refused != refused_by.end()) {
        // Every refusing node, up to what a condition's message may hold.
        std::string why;
        size_t said = 0;
        for (const auto& r : refused->second) {
          if (why.size() + r.size() > kMaxConditionMessage) break;
          why += (why.empty() ? "" : "; ") + r;
          ++said;
        }
        if (said < refused->second.size()) {
          why += "; and " + std::to_string(refused->second.size() - said) + " more node(s)";
        }
        conditions.push_back({{"type", "AssignmentsApplied"},
                              {"status", "False"},
                              {"reason", "Refused"},
                              {"message", why}});
      }
      // The stored status is parsed again only when its text changed (each pass parsed all).
      StoredConditions& stored = stored_conditions_[dep.d.name];
      if (stored.status != dep.object.status) {
        stored.status = dep.object.status;
        stored.before = ParseConditions(stored.status);
      }
      // Refused as stored: what runs is the generation last applied.
      int64_t observed = dep.object.generation;
      if (auto bad = invalid_.find(dep.d.name); bad != invalid_.end()) {
        conditions.push_back({{"type", "SpecValid"},
                              {"status", "False"},
                              {"reason", "InvalidSpec"},
                              {"message", bad->second.reason + "; running generation " +
                                              std::to_string(decoded_.at(dep.d.name).generation) +
                                              " as last applied"}});
        observed = decoded_.at(dep.d.name).generation;
      }
      // What runs, as stored: a spec refused later, even across a restart, runs as this.
      const Decoded& runs = decoded_.at(dep.d.name);
      StampConditions(conditions, stored.before, now_text, observed);
      nlohmann::json st = {{"observedGeneration", observed},
                           {"selector", std::string(kDeploymentLabel) + "=" + dep.d.name},
                           {"desiredReplicas", desired},
                           {"replicas", assigned},
                           {"readyReplicas", ready},
                           {"warmReplicas", warm},
                           {"conditions", conditions},
                           {"rollout", plan.state.ToJson()},
                           {"versions", VersionsJson(plan, version_stats[dep.d.name])},
                           {"lastApplied", {{"generation", runs.generation}, {"stored", runs.spec}}}};
      if (nlohmann::json lingering = LingerJson(dep.d.name); !lingering.is_null()) {
        st["scaleDownWarm"] = std::move(lingering);
      }
      statuses.emplace_back(dep.object.name, st);
    }
    unwritten.swap(actions_unwritten_);
  }
  for (const auto& e : events) {
    store_->RecordEvent(kModelDeploymentKind, e.name, e.type, e.reason, e.message);
  }
  // One status per deployment, in the same order.
  for (size_t i = 0; i < deps.size() && i < statuses.size(); ++i) {
    const auto& dep = deps[i];
    auto& [name, st] = statuses[i];
    std::string text = st.dump();
    // The rollout actions this status records are written down once it is (or already was).
    auto ended = [&, name = name]() {
      auto taken = unwritten.find(name);
      if (taken == unwritten.end()) return;
      absl::MutexLock lock(&mu_);
      for (uint64_t t : taken->second) EndAction(t, absl::OkStatus());
      unwritten.erase(taken);
    };
    if (text == dep.object.status) {
      ended();
      continue;
    }
    std::string without = WithoutCounters(std::move(st)).dump();
    auto written = status_written_.find(name);
    if (written != status_written_.end() && written->second.without_counters == without &&
        now - written->second.at < options_.status_counters_every) {
      ended();  // all but the counters is written as it is now
      continue;  // only the counters moved, and they were written a moment ago
    }
    absl::Status s =
        store_->UpdateStatus(kModelDeploymentKind, name, text, dep.object.resource_version)
            .status();
    if (s.ok()) {
      status_written_[name] = {std::move(without), now};
      ended();
    } else if (s.code() != absl::StatusCode::kAborted) {
      log->warn("status of {}: {}", name, s.ToString());
    }
  }
  if (!unwritten.empty()) {
    // Not written this pass (a conflict, the store down, a deployment gone): the next pass's
    // status carries them. A deployment gone has nobody to write for: its actions end.
    absl::MutexLock lock(&mu_);
    for (auto& [name, tickets] : unwritten) {
      if (!live.count(name)) {
        for (uint64_t t : tickets) EndAction(t, absl::NotFoundError("deployment '" + name + "' is gone"));
        continue;
      }
      auto& again = actions_unwritten_[name];
      again.insert(again.end(), tickets.begin(), tickets.end());
    }
  }
  std::erase_if(status_written_, [&live](const auto& e) { return !live.count(e.first); });
  std::erase_if(stored_conditions_, [&live](const auto& e) { return !live.count(e.first); });
}

std::optional<Controller::Decoded> Controller::LastAppliedOf(const StoredObject& o) {
  auto status = nlohmann::json::parse(o.status, nullptr, /*allow_exceptions=*/false);
  if (!status.is_object()) return std::nullopt;
  auto last = status.find("lastApplied");
  if (last == status.end() || !last->is_object()) return std::nullopt;
  auto stored = last->find("stored");
  auto generation = last->find("generation");
  if (stored == last->end() || !stored->is_string() || generation == last->end() ||
      !generation->is_number_integer()) {
    return std::nullopt;
  }
  auto parsed = DecodeFromStore(o.name, stored->get<std::string>());
  if (!parsed.ok()) return std::nullopt;
  return Decoded{stored->get<std::string>(), std::move(*parsed), generation->get<int64_t>(), o.uid};
}

absl::StatusOr<uint64_t> Controller::RequestRolloutAction(const std::string& name, const std::string& action) {
  auto a = ParseRolloutAction(action);
  if (!a.ok()) return a.status();
  if (!leading_) {
    return absl::UnavailableError(
        "this controller is not the leader and runs no rollouts; ask the leader (the "
        "kiln-controller-leader Service)");
  }
  absl::MutexLock lock(&mu_);
  auto it = rollouts_.find(name);
  if (it == rollouts_.end()) {
    if (auto why = not_run_.find(name); why != not_run_.end()) {
      return absl::FailedPreconditionError(why->second);
    }
    // It is stored (the API checked): this controller has not read it yet (it observes after a
    // start, or follows another), so the answer is "later", not "no such deployment".
    return absl::UnavailableError("deployment '" + name +
                                  "' is not in this controller's loop yet (it observes for a "
                                  "while after a start): try again");
  }
  if (it->second.canary_version.empty()) {
    return absl::FailedPreconditionError("deployment '" + name + "' has no rollout in progress (" +
                                         it->second.phase + ": " + it->second.message + ")");
  }
  const uint64_t ticket = ++action_tickets_;
  if (auto before = pending_actions_.find(name); before != pending_actions_.end()) {
    EndAction(before->second.ticket,
              absl::AbortedError("replaced by a later action (" + action +
                                 ") before the controller took it"));
  }
  pending_actions_[name] = {*a, it->second.canary_version, ticket};
  GetLogger("controller")->info("rollout {}: {} requested", name, action);
  return ticket;
}

void Controller::EndAction(uint64_t ticket, absl::Status result) {
  action_results_[ticket] = std::move(result);
  // Past the bound, the answers whose waiter gave up go first, then the oldest.
  while (action_results_.size() > kKeptActionResults) {
    auto gone = action_results_.begin();
    for (auto a = abandoned_actions_.begin(); a != abandoned_actions_.end(); ++a) {
      if (auto r = action_results_.find(*a); r != action_results_.end()) {
        gone = r;
        abandoned_actions_.erase(a);
        break;
      }
    }
    action_results_.erase(gone);
  }
}

absl::Status Controller::AwaitRolloutAction(uint64_t ticket, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  abandoned_actions_.erase(ticket);  // waited for (again)
  auto ended = [this, ticket]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return loop_done_ || action_results_.count(ticket) > 0;
  };
  mu_.AwaitWithTimeout(absl::Condition(&ended), timeout);
  auto it = action_results_.find(ticket);
  if (it == action_results_.end()) {
    abandoned_actions_.insert(ticket);
    while (abandoned_actions_.size() > kKeptActionResults) {
      abandoned_actions_.erase(abandoned_actions_.begin());
    }
    if (loop_done_) {
      return absl::UnavailableError(
          "the controller stopped before it wrote the action down (it was not taken)");
    }
    return absl::DeadlineExceededError(
        "the action is not written to the deployment's status yet (it may still be): look at "
        "`kilnctl rollout status`");
  }
  absl::Status result = std::move(it->second);
  action_results_.erase(it);
  return result;
}

void Controller::Retire(const std::string& node, const NodeRecord& record, const std::string& why,
                        std::vector<std::shared_ptr<Stream>>* to_end) {
  if (auto session = sessions_.find(node); session != sessions_.end()) {
    to_end->push_back(session->second);  // its end then finds no session: nothing more to do
    sessions_.erase(session);
  }
  std::vector<std::string> ids;
  for (const auto& r : record.status.replicas()) ids.push_back(r.replica_id());
  if (auto sent = sent_.find(node); sent != sent_.end()) {
    for (const auto& r : sent->second.replicas) ids.push_back(r.replica_id());
    sent_.erase(sent);
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  GetLogger("controller")
      ->warn("node {} forgotten ({}); its {} replica id(s) stay retired", node, why, ids.size());
  nodes_forgotten_++;
  new_nacks_.erase(node);
  crash_sites_.erase(node);
  if (ids.empty()) return;
  retired_ids_.insert(ids.begin(), ids.end());
  retired_.emplace_back(node, std::move(ids));
  while (retired_ids_.size() > kMaxRetiredIds && retired_.size() > 1) Unretire(retired_.begin());
}

void Controller::Unretire(
    std::deque<std::pair<std::string, std::vector<std::string>>>::iterator it) {
  for (const auto& id : it->second) retired_ids_.erase(id);
  retired_.erase(it);
}

absl::Status Controller::ForgetNode(const std::string& name) {
  if (!leading_) {
    return absl::UnavailableError(
        "this controller is not the leader and holds no nodes; ask the leader (the "
        "kiln-controller-leader Service)");
  }
  std::vector<std::shared_ptr<Stream>> to_end;
  {
    absl::MutexLock lock(&mu_);
    TakeStatuses();
    auto record = registry_.Remove(name, clock_->Now());
    if (!record.ok()) return record.status();
    Retire(name, *record, "removed by hand", &to_end);
  }
  for (const auto& s : to_end) {
    s->End(grpc::Status(grpc::StatusCode::NOT_FOUND, "node '" + name + "' was removed"));
  }
  return absl::OkStatus();
}

std::string Controller::MetricsText() {
  std::ostringstream m;
  auto gauge = [&m](const char* name, const char* help) {
    m << "# HELP " << name << " " << help << "\n# TYPE " << name << " gauge\n";
  };
  {
    absl::MutexLock lock(&mu_);
    TakeStatuses();
    const absl::Time now = clock_->Now();
    std::map<std::string, int> by_health = {{"Ready", 0}, {"NotReady", 0}, {"Lost", 0}};
    int refusing = 0;
    int64_t assigned = 0;
    for (const auto& [name, rec] : registry_.nodes()) {
      const NodeHealth health = registry_.Health(name, now);
      by_health[NodeHealthName(health)]++;
      // A Lost node's last assignment is history: its replicas were placed again elsewhere.
      auto sent = sent_.find(name);
      if (health == NodeHealth::kLost || sent == sent_.end()) continue;
      if (!sent->second.nack.empty()) refusing++;
      assigned += static_cast<int64_t>(sent->second.replicas.size());
    }
    gauge("kiln_controller_nodes", "Registered nodes by health.");
    for (const auto& [health, n] : by_health) {
      m << "kiln_controller_nodes{health=\"" << health << "\"} " << n << "\n";
    }
    gauge("kiln_controller_nodes_refusing_assignment",
          "Nodes whose last assignment was refused (Nack).");
    m << "kiln_controller_nodes_refusing_assignment " << refusing << "\n";
    gauge("kiln_controller_replicas_assigned",
          "Replicas in the assignments sent to nodes that are not Lost.");
    m << "kiln_controller_replicas_assigned " << assigned << "\n";
    gauge("kiln_controller_deployments_short",
          "Deployments the last placement could not give all their replicas.");
    std::set<std::string> short_of;  // a line per demand ("dep: ..."); a canary is a second one
    for (const auto& line : last_unplaced_) short_of.insert(line.substr(0, line.find(':')));
    m << "kiln_controller_deployments_short " << short_of.size() << "\n";
    gauge("kiln_controller_replicas_moving",
          "Replicas being moved make-before-break, or dropped ahead of their replacement.");
    m << "kiln_controller_replicas_moving " << last_moves_.size() << "\n";
  }
  gauge("kiln_controller_leader",
        "1 when this controller makes the decisions (it holds the Lease, or runs without "
        "election); a follower's other series are empty.");
  m << "kiln_controller_leader " << (leading_.load() ? 1 : 0) << "\n";
  gauge("kiln_controller_deployments", "ModelDeployments the last pass of the loop read.");
  m << "kiln_controller_deployments " << deployments_.load() << "\n";
  m << "# HELP kiln_controller_rollbacks_total Rollouts rolled back (by their analysis, or "
       "aborted by hand).\n"
    << "# TYPE kiln_controller_rollbacks_total counter\n"
    << "kiln_controller_rollbacks_total " << rollbacks_.load() << "\n";
  m << "# HELP kiln_controller_nodes_forgotten_total Nodes forgotten: Lost past "
       "--forget-lost-node-seconds, or removed by hand.\n"
    << "# TYPE kiln_controller_nodes_forgotten_total counter\n"
    << "kiln_controller_nodes_forgotten_total " << nodes_forgotten_.load() << "\n";
  m << "# HELP kiln_controller_registrations_total Agent streams that registered their node "
       "(each reconnect counts again).\n"
    << "# TYPE kiln_controller_registrations_total counter\n"
    << "kiln_controller_registrations_total " << registrations_.load() << "\n";
  m << node_loss_seconds_.Take().Prometheus(
      "kiln_controller_node_loss_decision_seconds",
      "From a node's lease ending (Lost) to its replicas' new places sent to the nodes.");
  m << tick_seconds_.Take().Prometheus(
      "kiln_controller_loop_duration_seconds",
      "How long each pass of the decision loop took (placement, rollouts, routing, status).");
  return m.str();
}

int64_t Controller::LingerFor(const std::string& name, const std::string& version,
                              int64_t serving, absl::Time now, const std::string& stored_status) {
  if (options_.scale_down_warm_for <= absl::ZeroDuration()) return 0;
  auto [it, first_sight] = linger_.try_emplace(name);
  WarmAfterScaleDown& l = it->second;
  if (first_sight) {
    // After a restart: what the controller before this one recorded, so replicas a scale-down
    // left WARM neither drain early nor stay past their window. Anything unreadable is
    // ignored (they drain, as before this was kept).
    auto status = nlohmann::json::parse(stored_status, nullptr, false);
    const nlohmann::json* kept = nullptr;
    if (status.is_object() && status.contains("scaleDownWarm")) kept = &status["scaleDownWarm"];
    if (kept && kept->is_object() && kept->contains("version") &&
        (*kept)["version"].is_string() && (*kept)["version"].get<std::string>() == version &&
        kept->contains("lastServing") && (*kept)["lastServing"].is_number_integer() &&
        kept->contains("until") && (*kept)["until"].is_array()) {
      std::deque<std::pair<absl::Time, int64_t>> batches;
      for (const auto& batch : (*kept)["until"]) {
        if (!batch.is_object() || !batch.contains("time") || !batch["time"].is_string() ||
            !batch.contains("replicas") || !batch["replicas"].is_number_integer()) {
          continue;
        }
        auto until = ParseRfc3339(batch["time"].get<std::string>(), "scaleDownWarm.until.time");
        const int64_t count = batch["replicas"].get<int64_t>();
        // Never past a window from now (one written under a longer window, or a clock ahead).
        if (until.ok() && count > 0) {
          batches.emplace_back(std::min(*until, now + options_.scale_down_warm_for), count);
        }
      }
      l.Restore(version, (*kept)["lastServing"].get<int64_t>(), std::move(batches));
    }
  }
  return l.Update(version, serving, now, options_.scale_down_warm_for);
}

nlohmann::json Controller::LingerJson(const std::string& name) const {
  auto it = linger_.find(name);
  if (it == linger_.end() || it->second.batches().empty()) return nullptr;
  nlohmann::json until = nlohmann::json::array();
  for (const auto& [at, count] : it->second.batches()) {
    until.push_back({{"time", FormatRfc3339(at)}, {"replicas", count}});
  }
  return {{"version", it->second.version()},
          {"lastServing", it->second.last_serving()},
          {"until", until}};
}

std::string Controller::NodesJson() {
  absl::MutexLock lock(&mu_);
  TakeStatuses();
  const absl::Time now = clock_->Now();
  nlohmann::json nodes = nlohmann::json::array();
  for (const auto& [name, rec] : registry_.nodes()) {
    nlohmann::json replicas = nlohmann::json::array();
    for (const auto& r : rec.status.replicas()) {
      replicas.push_back({{"id", r.replica_id()},
                          {"model", r.model()},
                          {"version", r.version()},
                          {"state", v1::LifecycleState_Name(r.state())},
                          {"healthy", r.healthy()},
                          {"healthReason", r.health_reason()},
                          {"device", r.device()},
                          {"restarts", r.restarts()},
                          {"crashLoop", r.crash_loop()},
                          {"inFlight", r.load().in_flight()},
                          {"pid", r.pid()},
                          {"cpus", r.cpus()},
                          {"qps", r.load().qps()},
                          {"p99Ms", r.load().latency_p99_micros() / 1000.0},
                          {"gpuMemoryBytes", r.measured_gpu_memory_bytes()},
                          {"idleSeconds", r.idle_ms() / 1000}});
    }
    nlohmann::json labels = nlohmann::json::object();
    for (const auto& [k, v] : rec.registration.labels()) labels[k] = v;
    auto sent_at = sent_.find(name);
    const Sent* sent = sent_at == sent_.end() ? nullptr : &sent_at->second;
    nodes.push_back({{"name", name},
                     {"health", NodeHealthName(registry_.Health(name, now))},
                     {"zone", ZoneOf(rec.registration)},
                     {"labels", labels},
                     {"connected", rec.connected},
                     {"cpus", rec.registration.cpu_capacity()},
                     {"gpus", rec.registration.gpus_size()},
                     {"lastHeardSecondsAgo", absl::ToInt64Seconds(now - rec.last_heard)},
                     {"assignmentGeneration", rec.status.assignment_generation()},
                     // The generation last sent (the node applies it, or refuses it).
                     {"sentGeneration", sent ? sent->assignment_generation : int64_t{0}},
                     {"refused", sent ? sent->nack : ""},
                     {"replicas", replicas}});
  }
  return nlohmann::json{{"kind", "NodeList"}, {"items", nodes}}.dump();
}

}  // namespace kiln
