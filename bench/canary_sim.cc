// kiln-canary-sim: how long a bad canary takes to be rolled back, end to end through a running
// kiln-controller, with simulated agents speaking the real kiln.v1.ControlPlane protocol.
//
//   kiln-canary-sim --controller 127.0.0.1:7071 --admin http://127.0.0.1:PORT
//       --nodes 1000 --replicas-per-node 5 --samples 5
//
// Each node registers with its replicas (version 1 of deployment m<k>, k = node % --samples,
// each deployment its own model), then reports a NodeStatus every --period-seconds as
// kiln-agent does: every replica's request counter grows; the nodes apply the Assignments they
// are sent (a canary replica they are given reports SERVING at once) and watch the
// RoutingTables. Then, one deployment after the other: its spec moves to version 2 (a Canary
// rollout: one step of 10% held for an hour, maxErrorRate 1%, minRequests 100); once the
// routing tables give version 2 traffic and it has served cleanly for --clean-seconds, half of
// the canary's requests start to fail. Measured: from the first report that carries the
// failures to the first routing table that takes version 2's traffic away ("seen"), and the
// same plus one status period (the failures may begin just after a report: the worst case).
// Prints one JSON line.
//
// With --lose-nodes K it measures the decision after a node loss instead: once the deployments
// are placed, the first K nodes that run a replica fall silent (no report, no Ack; their
// streams stay open, as a machine that died without closing its connections), and the time is
// taken from the end
// of their lease (their last report sent plus --node-lost-seconds, which must match the
// controller's) to the first Assignment that gives another node one of their replicas' new
// places, and to the one that completes them. The lease is counted from the report's sending,
// so a report the controller read late makes the figure larger, never smaller. The run counts
// only when every node is Ready before the loss and only the silenced ones are Lost after it
// (the controller's kiln_controller_nodes gauge); otherwise it says so and exits 1. Nodes report
// from the moment they register, so a fleet that takes longer to register than the lease
// stays valid.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/synchronization/mutex.h"
#include "bench/admin_client.h"
#include "kiln/v1/control_plane.grpc.pb.h"
#include "nlohmann/json.hpp"

namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = kiln::v1;


nlohmann::json Spec(const std::string& model, const std::string& version, int replicas) {
  return {{"model",
           {{"name", model},
            {"version", version},
            {"uri", "file:///models/" + model + "/" + version + "/model.pt"}}},
          {"replicas", replicas},
          {"warmPool", 0},
          {"resources", {{"gpus", 0}, {"cpus", 1}}},
          {"rollout",
           {{"strategy", "Canary"},
            {"steps", nlohmann::json::array({{{"weight", 10}, {"pause", "1h"}}})},
            {"analysis", {{"maxErrorRate", 0.01}, {"minRequests", 100}}}}}};
}

// What the simulated nodes saw of one model's route: when version 2 first got traffic (in
// which table generation) and when a later table took it away. Nodes get each table at
// slightly different times, so one still reading an older table is not news.
struct RouteSeen {
  Clock::time_point canary_routed{};
  int64_t routed_generation = 0;
  Clock::time_point canary_dropped{};
};

class Node {
 public:
  Node(int index, int replicas, int groups) : name_("sim-" + std::to_string(index)) {
    for (int k = 0; k < replicas; ++k) {
      Replica r;
      r.id = "m" + std::to_string(index % groups) + "." + std::to_string(index * 64 + k);
      r.model = "m" + std::to_string(index % groups);
      r.version = "1";
      replicas_.push_back(r);
    }
  }
  const std::string& name() const { return name_; }
  int Running() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(replicas_.size());
  }

  v1::AgentMessage Register() {
    absl::MutexLock lock(&mu_);
    v1::AgentMessage m;
    auto* r = m.mutable_register_();
    r->set_node_name(name_);
    r->set_cpu_capacity(64);
    r->set_ingress_grpc_address(name_ + ":7000");
    r->set_ingress_http_address(name_ + ":7001");
    for (const auto& rep : replicas_) *r->add_replicas() = Status(rep, 0, 0);
    return m;
  }

  // This period's report: each replica served `per_period` more requests; a version-2 replica
  // of a model in `failing` failed half of them.
  v1::AgentMessage Report(uint64_t per_period, const std::map<std::string, bool>& failing) {
    absl::MutexLock lock(&mu_);
    v1::AgentMessage m;
    auto* st = m.mutable_status();
    st->set_assignment_generation(assignment_generation_);
    st->set_routing_generation(routing_generation_);
    for (auto& rep : replicas_) {
      rep.requests += per_period;
      auto it = failing.find(rep.model);
      if (rep.version == "2" && it != failing.end() && it->second) rep.errors += per_period / 2;
      *st->add_replicas() = Status(rep, rep.requests, rep.errors);
    }
    return m;
  }

  // An Assignment: its replicas are what this node runs now (each SERVING at once, counters
  // kept for those it ran before). The Ack to send back.
  // `added`: how many of its replicas this node did not run before.
  v1::AgentMessage Apply(const v1::Assignment& a, int* added) {
    absl::MutexLock lock(&mu_);
    std::vector<Replica> next;
    *added = 0;
    for (const auto& spec : a.replicas()) {
      Replica r;
      bool known = false;
      for (const auto& old : replicas_) {
        if (old.id == spec.replica_id()) {
          r = old;
          known = true;
        }
      }
      *added += known ? 0 : 1;
      r.id = spec.replica_id();
      r.model = spec.model();
      r.version = spec.version();
      next.push_back(r);
    }
    replicas_ = std::move(next);
    assignment_generation_ = a.generation();
    v1::AgentMessage ack;
    ack.mutable_ack()->set_kind(v1::Ack::ASSIGNMENT);
    ack.mutable_ack()->set_generation(a.generation());
    return ack;
  }
  void Routed(int64_t generation) {
    absl::MutexLock lock(&mu_);
    routing_generation_ = generation;
  }

 private:
  struct Replica {
    std::string id, model, version;
    uint64_t requests = 0, errors = 0;
  };
  static v1::ReplicaStatus Status(const Replica& r, uint64_t requests, uint64_t errors) {
    v1::ReplicaStatus s;
    s.set_replica_id(r.id);
    s.set_model(r.model);
    s.set_version(r.version);
    s.set_device("cpu");
    s.set_cpus("1");
    s.set_state(v1::SERVING);
    s.set_healthy(true);
    s.mutable_load()->set_requests(requests);
    s.mutable_load()->set_errors(errors);
    s.mutable_load()->set_latency_p99_micros(4000);
    return s;
  }

  const std::string name_;
  absl::Mutex mu_;
  std::vector<Replica> replicas_ ABSL_GUARDED_BY(mu_);
  int64_t assignment_generation_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t routing_generation_ ABSL_GUARDED_BY(mu_) = 0;
};

// One simulated agent's stream on gRPC's callback API: its reads and writes run on gRPC's own
// threads. (A thread per stream, blocking in Read, cost this simulator more CPU at 10,000 nodes
// than the controller it measures, on a two-core machine the two share.)
class Stream final : public grpc::ClientBidiReactor<v1::AgentMessage, v1::ControllerMessage> {
 public:
  using OnMessage = std::function<void(Stream*, const v1::ControllerMessage&)>;
  Stream(v1::ControlPlane::Stub* stub, OnMessage on_message)
      : on_message_(std::move(on_message)) {
    stub->async()->Connect(&ctx_, this);
    StartRead(&in_);
    AddHold();  // writes start from other threads (Send): the call lives until the read ends
    StartCall();
  }
  // Sends `m` after what is queued; a report replaces one still queued (only the newest
  // matters). When: the time it was queued (it leaves no sooner).
  void Send(v1::AgentMessage m) {
    absl::MutexLock lock(&mu_);
    if (closing_ || broken_) return;
    if (m.has_status()) {
      for (auto& queued : queue_) {
        if (queued.has_status()) {
          queued = std::move(m);
          return;
        }
      }
    }
    queue_.push_back(std::move(m));
    if (!writing_) WriteNextLocked();
  }
  void Cancel() { ctx_.TryCancel(); }
  // The stream's end, once gRPC is done with it (nullopt while it runs); then it may go.
  std::optional<grpc::Status> Ended() {
    if (!done_) return std::nullopt;
    absl::MutexLock lock(&mu_);
    return status_;
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      broken_ = true;  // the stream is over: OnDone follows
      return;
    }
    WriteNextLocked();
  }
  void OnReadDone(bool ok) override {
    if (!ok) {  // the call is ending: no more writes, and the hold goes
      {
        absl::MutexLock lock(&mu_);
        closing_ = true;
      }
      RemoveHold();
      return;
    }
    on_message_(this, in_);
    StartRead(&in_);
  }
  void OnDone(const grpc::Status& s) override {
    {
      absl::MutexLock lock(&mu_);
      status_ = s;
    }
    done_ = true;  // the last thing: the owner may destroy it from here on
  }

 private:
  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (queue_.empty()) return;
    out_ = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    StartWrite(&out_);
  }

  const OnMessage on_message_;
  grpc::ClientContext ctx_;
  v1::ControllerMessage in_;  // read by one reaction at a time
  absl::Mutex mu_;
  std::deque<v1::AgentMessage> queue_ ABSL_GUARDED_BY(mu_);
  v1::AgentMessage out_ ABSL_GUARDED_BY(mu_);  // being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;  // the read ended: the call is going
  std::atomic<bool> done_{false};
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

int main(int argc, char** argv) {
  std::string address, admin;
  int nodes = 1000, replicas = 5, samples = 5, channels = 64;
  double period_s = 1.0, clean_s = 3.0, timeout_s = 60.0;
  uint64_t per_period = 100;
  int lose_nodes = 0;
  double lost_after_s = 30.0;
  CLI::App app{"kiln-canary-sim: bad-canary rollback latency through a running kiln-controller"};
  app.add_option("--controller", address, "ControlPlane HOST:PORT (loopback)")->required();
  app.add_option("--admin", admin, "Admin API http://127.0.0.1:PORT")->required();
  app.add_option("--nodes", nodes, "Simulated agents")->check(CLI::Range(1, 20000));
  app.add_option("--replicas-per-node", replicas, "Replicas each runs")->check(CLI::Range(1, 32));
  app.add_option("--samples", samples, "Deployments rolled out, one after the other")
      ->check(CLI::Range(1, 100));
  app.add_option("--channels", channels, "Connections the streams share")
      ->check(CLI::Range(1, 4096));
  app.add_option("--period-seconds", period_s, "Status period of each agent")
      ->check(CLI::Range(0.05, 60.0));
  app.add_option("--clean-seconds", clean_s, "Clean serving of the canary before it fails")
      ->check(CLI::Range(0.0, 600.0));
  app.add_option("--requests-per-period", per_period, "Requests each replica serves a period")
      ->check(CLI::Range(2, 1000000));
  app.add_option("--timeout-seconds", timeout_s, "Give up on a sample after this")
      ->check(CLI::Range(1.0, 3600.0));
  app.add_option("--lose-nodes", lose_nodes,
                 "Measure the decision after these nodes fall silent instead of canaries")
      ->check(CLI::Range(0, 100000));
  app.add_option("--node-lost-seconds", lost_after_s,
                 "The controller's --node-lost-seconds (with --lose-nodes)")
      ->check(CLI::Range(0.1, 3600.0));
  CLI11_PARSE(app, argc, argv);
  if (address.rfind("127.", 0) != 0 || admin.rfind("http://127.", 0) != 0) {
    std::cerr << "--controller, --admin: loopback addresses only\n";
    return 2;
  }
  if (samples > nodes) {
    std::cerr << "--samples: at most --nodes (" << nodes << ")\n";
    return 2;
  }

  std::vector<std::shared_ptr<grpc::Channel>> chans;
  for (int i = 0; i < channels; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("grpc.channel_id", i);
    chans.push_back(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  }
  struct Agent {
    std::unique_ptr<Node> node;
    std::unique_ptr<Stream> stream;
    std::atomic<bool> silent{false};    // a lost node: sends nothing
    std::atomic<bool> assigned{false};  // given an Assignment
    absl::Mutex sent_mu;
    Clock::time_point last_sent ABSL_GUARDED_BY(sent_mu){};  // its last report, when queued
  };
  // --lose-nodes: replicas newly given to the nodes that stay, from when the others fell
  // silent; the first such Assignment's time and the one that completed the count.
  std::atomic<bool> counting_added{false};
  // What the silenced nodes ran (the deployments' placement decides, not --replicas-per-node:
  // the nodes drop what they registered with when their first, empty, assignment comes).
  absl::Mutex added_mu;
  int lost_replicas = 0;  // under added_mu
  int added_total = 0;
  Clock::time_point first_added{}, all_added{};
  absl::Mutex seen_mu;
  std::map<std::string, RouteSeen> seen;  // by model, the first node to see it wins
  // Registered agents, reported for from the moment they registered: with thousands of them
  // registration outlasts a short lease, and the first would go Lost before the last was in.
  absl::Mutex agents_mu;
  std::vector<std::unique_ptr<Agent>> agents;  // written under agents_mu
  std::atomic<int> assigned_nodes{0};  // agents given their first Assignment
  int exit_code = 0;

  // Reports every period from here on, with the current failures.
  absl::Mutex failing_mu;
  std::map<std::string, bool> failing;
  std::map<std::string, Clock::time_point> first_failing_report;
  std::atomic<bool> stop{false};
  std::thread reporter([&] {
    for (auto next = Clock::now(); !stop; next += std::chrono::microseconds(
                                               static_cast<int64_t>(period_s * 1e6))) {
      std::map<std::string, bool> now_failing;
      {
        absl::MutexLock lock(&failing_mu);
        now_failing = failing;
        for (const auto& [model, on] : failing) {
          if (on && !first_failing_report.count(model)) first_failing_report[model] = Clock::now();
        }
      }
      std::vector<Agent*> registered;
      {
        absl::MutexLock lock(&agents_mu);
        for (const auto& a : agents) registered.push_back(a.get());
      }
      for (Agent* a : registered) {
        absl::MutexLock lock(&a->sent_mu);
        if (a->silent) continue;
        a->stream->Send(a->node->Report(per_period, now_failing));
        a->last_sent = Clock::now();
      }
      std::this_thread::sleep_until(next);
    }
  });

  std::vector<std::unique_ptr<v1::ControlPlane::Stub>> stubs;
  for (const auto& c : chans) stubs.push_back(v1::ControlPlane::NewStub(c));
  auto on_message = [&](Agent* self, Stream* stream, const v1::ControllerMessage& m) {
    if (self->silent) return;
    if (m.has_assignment()) {
      if (!self->assigned.exchange(true)) assigned_nodes++;
      int added = 0;
      v1::AgentMessage ack = self->node->Apply(m.assignment(), &added);
      if (added > 0 && counting_added) {
        const auto now = Clock::now();
        absl::MutexLock lock(&added_mu);
        if (added_total == 0) first_added = now;
        added_total += added;
        if (added_total >= lost_replicas && all_added == Clock::time_point{}) {
          all_added = now;
        }
      }
      stream->Send(std::move(ack));
    } else if (m.has_routing_table()) {
      self->node->Routed(m.routing_table().generation());
      const auto now = Clock::now();
      absl::MutexLock lock(&seen_mu);
      for (const auto& route : m.routing_table().routes()) {
        bool canary = false;
        for (const auto& v : route.versions()) canary |= v.version() == "2" && v.weight() > 0;
        RouteSeen& s = seen[route.model()];
        const int64_t generation = m.routing_table().generation();
        if (canary && s.canary_routed == Clock::time_point{}) {
          s.canary_routed = now;
          s.routed_generation = generation;
        }
        if (!canary && s.canary_routed != Clock::time_point{} &&
            generation > s.routed_generation && s.canary_dropped == Clock::time_point{}) {
          s.canary_dropped = now;
        }
      }
    }
  };
  for (int i = 0; i < nodes; ++i) {
    auto a = std::make_unique<Agent>();
    a->node = std::make_unique<Node>(i, replicas, samples);
    Agent* self = a.get();
    a->stream = std::make_unique<Stream>(
        stubs[i % channels].get(),
        [&on_message, self](Stream* stream, const v1::ControllerMessage& m) {
          on_message(self, stream, m);
        });
    a->stream->Send(a->node->Register());
    absl::MutexLock lock(&agents_mu);
    agents.push_back(std::move(a));
  }

  auto wait_for = [&](auto pred) {
    auto until = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6));
    while (Clock::now() < until) {
      if (pred()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  };
  nlohmann::json results = nlohmann::json::array();
  std::vector<double> seen_ms;
  // Deployment d at `version`: created (POST) or changed (PUT).
  auto apply = [&](int d, const std::string& version, bool create) {
    const std::string model = "m" + std::to_string(d);
    const int members = nodes / samples + (d < nodes % samples ? 1 : 0);
    nlohmann::json md = {{"apiVersion", "serving.kiln.dev/v1alpha1"},
                         {"kind", "ModelDeployment"},
                         {"metadata", {{"name", model}}},
                         {"spec", Spec(model, version, members * replicas)}};
    const std::string path = create ? std::string(kiln::bench::kDeploymentsPath)
                                    : std::string(kiln::bench::kDeploymentsPath) + "/" + model;
    return !kiln::bench::AdminCall(admin, create ? web::http::methods::POST
                                                 : web::http::methods::PUT,
                                   path, md.dump())
                .is_null();
  };
  // What the nodes saw of a model's route.
  auto seen_of = [&](const std::string& model) {
    absl::MutexLock lock(&seen_mu);
    return seen[model];
  };
  const Clock::time_point kNever{};
  for (int d = 0; d < samples && exit_code == 0; ++d) {
    if (!apply(d, "1", /*create=*/true)) exit_code = 1;
  }
  if (exit_code == 0 && lose_nodes > 0 && !wait_for([&] { return assigned_nodes == nodes; })) {
    std::cerr << "only " << assigned_nodes << " of " << nodes
              << " nodes were given an assignment within --timeout-seconds\n";
    exit_code = 1;
  }
  for (const auto& a : agents) {  // a stream the controller ended: the run is not what it says
    if (auto ended = a->stream->Ended(); ended && exit_code == 0) {
      std::cerr << a->node->name() << ": stream ended: " << ended->error_message() << "\n";
      exit_code = 1;
    }
  }
  if (exit_code == 0) {
    std::this_thread::sleep_for(
        std::chrono::milliseconds(static_cast<int64_t>(2 * period_s * 1e3)));
  }
  // The controller's count of its nodes by health ("" when it could not be read).
  auto nodes_by_health = [&](const char* health) {
    const std::string text = kiln::bench::AdminText(admin, "/metrics");
    const double n = kiln::bench::MetricValue(
        text, std::string("kiln_controller_nodes{health=\"") + health + "\"}");
    return text.empty() ? -1 : std::max(0, static_cast<int>(n));
  };
  nlohmann::json loss;
  if (lose_nodes > 0 && exit_code == 0) {
    const int ready = nodes_by_health("Ready");
    if (lose_nodes >= nodes) {
      std::cerr << "--lose-nodes: fewer than --nodes (" << nodes << ")\n";
      exit_code = 2;
    } else if (ready != nodes) {
      // Nodes that are not Ready before the loss (registered late, reports read late) would be
      // lost with the others and their replicas counted as the loss's: not a valid run.
      std::cerr << "not a valid run: " << ready << " of " << nodes
                << " nodes Ready before the loss (" << nodes_by_health("NotReady")
                << " NotReady, " << nodes_by_health("Lost")
                << " Lost: a lease shorter than this machine needs?)\n";
      exit_code = 1;
    } else {
      Clock::time_point last{};
      int running = 0;
      // The first nodes (by number) that run something: placement may leave a node empty.
      int silenced = 0;
      for (size_t i = 0; i < agents.size() && silenced < lose_nodes; ++i) {
        const int here = agents[i]->node->Running();
        if (here == 0) continue;
        absl::MutexLock lock(&agents[i]->sent_mu);  // no report of theirs is being queued
        agents[i]->silent = true;
        last = std::max(last, agents[i]->last_sent);
        running += here;
        silenced++;
      }
      {
        absl::MutexLock lock(&added_mu);
        lost_replicas = running;
      }
      counting_added = true;  // (their lease ends --node-lost-seconds from now: nothing missed)
      if (running == 0) {
        std::cerr << "not a valid run: the silenced nodes ran no replicas\n";
        exit_code = 1;
      }
      const auto lease_end =
          last + std::chrono::microseconds(static_cast<int64_t>(lost_after_s * 1e6));
      const bool done = exit_code == 0 && wait_for([&] {
        absl::MutexLock lock(&added_mu);
        return all_added != Clock::time_point{};
      });
      absl::MutexLock lock(&added_mu);
      if (!done) {
        if (running > 0) {
          std::cerr << "the lost nodes' replicas were not all placed again within "
                       "--timeout-seconds ("
                    << added_total << " of " << lost_replicas << ")\n";
        }
        exit_code = 1;
      } else {
        auto ms = [&](Clock::time_point t) {
          return std::chrono::duration<double, std::milli>(t - lease_end).count();
        };
        // Only the silenced nodes were lost (no other node's replicas were counted).
        const int lost = nodes_by_health("Lost");
        if (lost != lose_nodes) {
          std::cerr << "not a valid run: the controller counts " << lost << " Lost nodes, not "
                    << lose_nodes << "\n";
          exit_code = 1;
        }
        loss = {{"lost_nodes", lose_nodes},
                {"lost_nodes_counted", lost},
                {"replicas_placed_again", added_total},
                {"first_new_place_after_lease_ms", ms(first_added)},
                {"all_new_places_after_lease_ms", ms(all_added)}};
      }
    }
  }
  for (int d = 0; d < samples && exit_code == 0 && lose_nodes == 0; ++d) {
    const std::string model = "m" + std::to_string(d);
    if (!apply(d, "2", /*create=*/false)) {
      exit_code = 1;
      break;
    }
    if (!wait_for([&] { return seen_of(model).canary_routed != kNever; })) {
      std::cerr << model << ": version 2 never got traffic\n";
      exit_code = 1;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(clean_s * 1e3)));
    if (seen_of(model).canary_dropped != kNever) {
      std::cerr << model << ": rolled back before it failed\n";
      exit_code = 1;
      break;
    }
    {
      absl::MutexLock lock(&failing_mu);
      failing[model] = true;
    }
    if (!wait_for([&] { return seen_of(model).canary_dropped != kNever; })) {
      std::cerr << model << ": the bad canary was not rolled back within --timeout-seconds\n";
      exit_code = 1;
      break;
    }
    Clock::time_point first, gone = seen_of(model).canary_dropped;
    {
      absl::MutexLock lock(&failing_mu);
      first = first_failing_report[model];
    }
    double ms = std::chrono::duration<double, std::milli>(gone - first).count();
    seen_ms.push_back(ms);
    results.push_back({{"model", model},
                       {"from_first_failing_report_ms", ms},
                       {"worst_case_from_failure_ms", ms + period_s * 1e3}});
  }
  stop = true;
  reporter.join();
  for (auto& a : agents) a->stream->Cancel();
  // gRPC finishes every stream before it may be destroyed (bounded: cancelled streams end).
  for (auto& a : agents) {
    while (!a->stream->Ended()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  double worst = seen_ms.empty() ? 0 : *std::max_element(seen_ms.begin(), seen_ms.end());
  nlohmann::json out = {{"nodes", nodes},
                        {"replicas", nodes * replicas},
                        {"period_s", period_s},
                        {"samples", results},
                        {"max_from_first_failing_report_ms", worst},
                        {"max_worst_case_from_failure_ms", worst + period_s * 1e3}};
  if (!loss.is_null()) out["node_loss"] = loss;
  std::cout << out.dump() << std::endl;
  return exit_code;
}
