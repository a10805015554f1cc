// The controller's loop, in process and driven by hand (Tick) with a simulated clock, against
// a real SQLite store and a node speaking kiln.v1.ControlPlane over loopback gRPC.
#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "common/clock.h"
#include "controller/controller.h"
#include "controller/model_deployment.h"
#include "controller/sqlite_store.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kiln {
namespace {

namespace fs = std::filesystem;

class ControllerLoopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("kiln-loop-" + std::to_string(getpid()))).string();
    fs::remove_all(dir_);
    SqliteStore::Options so;
    so.state_dir = dir_;
    auto store = SqliteStore::Open(so, &clock_);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    StartController();
    ASSERT_TRUE(stub_);
  }
  // A controller on the fixture's store, serving its ControlPlane (stub_ null on failure).
  void StartController() {
    controller_ = std::make_unique<Controller>(Options(), store_.get(), &clock_);
    stub_ = Serve(controller_.get(), &server_);
  }
  // Stops it as a restart would (the store stays).
  void StopController() {
    server_->Shutdown();
    controller_.reset();
  }
  // `status` has condition SpecValid False, reason InvalidSpec, its message naming `text`.
  static bool SaysInvalidSpec(const nlohmann::json& status, const std::string& text) {
    bool said = false;
    for (const auto& c : status["conditions"]) {
      if (c["type"] == "SpecValid") {
        said = c["status"] == "False" && c["reason"] == "InvalidSpec" &&
               c["message"].get<std::string>().find(text) != std::string::npos;
      }
    }
    return said;
  }
  // The loop's options here: no observing after a start, leases the simulated clock's jumps
  // stay inside.
  static ControllerOptions Options() {
    ControllerOptions co;
    co.observe_for = absl::ZeroDuration();
    co.leases.not_ready_after = absl::Hours(1);
    co.leases.lost_after = absl::Hours(2);
    return co;
  }
  // Serves `c`'s ControlPlane on a loopback port (in `*server`); a stub to it, null on failure.
  static std::unique_ptr<v1::ControlPlane::Stub> Serve(Controller* c,
                                                      std::unique_ptr<grpc::Server>* server) {
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(c);
    *server = b.BuildAndStart();
    if (!*server || port == 0) return nullptr;
    return v1::ControlPlane::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }
  // One more node's agent on its own stream (the fixture's own is n1's, Connect()).
  struct Agent {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::AgentMessage, v1::ControllerMessage>> stream;
    int64_t mark = 100;  // its reports' marks: give each agent its own range
    v1::Assignment assigned;
  };
  // Registers `name` (4 CPUs) on `a`; bounded poll until the controller lists it.
  void ConnectAgent(Agent& a, const std::string& name) {
    a.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));  // no hang
    a.stream = stub_->Connect(&a.ctx);
    v1::AgentMessage reg;
    reg.mutable_register_()->set_node_name(name);
    reg.mutable_register_()->set_cpu_capacity(4);
    ASSERT_TRUE(a.stream->Write(reg));
    for (int i = 0; i < 400 && controller_->NodesJson().find("\"" + name + "\"") == std::string::npos;
         ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  // `a` reports what it was assigned, running; bounded poll until the controller has it.
  void ReportAssigned(Agent& a) {
    v1::AgentMessage m;
    auto* st = m.mutable_status();
    st->set_assignment_generation(++a.mark);
    for (const auto& spec : a.assigned.replicas()) AddReported(st, spec, spec.state());
    ASSERT_TRUE(a.stream->Write(m));
    const std::string seen = "\"assignmentGeneration\":" + std::to_string(a.mark);
    for (int i = 0; i < 400 && controller_->NodesJson().find(seen) == std::string::npos; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  // Reads until an assignment comes (the stream's deadline bounds the wait); its replica ids.
  static std::vector<std::string> ReadAssignment(Agent& a) {
    v1::ControllerMessage m;
    while (a.stream->Read(&m)) {
      if (!m.has_assignment()) continue;
      a.assigned = m.assignment();
      std::vector<std::string> ids;
      for (const auto& r : a.assigned.replicas()) ids.push_back(r.replica_id());
      return ids;
    }
    ADD_FAILURE() << "no assignment came";
    return {};
  }
  // The agent goes away: its stream ends from its side.
  static void Hangup(Agent& a) {
    a.ctx.TryCancel();
    v1::ControllerMessage drained;
    while (a.stream->Read(&drained)) {
    }
    a.stream->Finish();
  }
  void TearDown() override {
    if (stream_) {
      ctx_.TryCancel();
      v1::ControllerMessage m;
      while (stream_->Read(&m)) {
      }
      stream_->Finish();
    }
    server_->Shutdown(std::chrono::system_clock::now());
    controller_->Stop();
    server_.reset();
    controller_.reset();
    fs::remove_all(dir_);
  }

  // Node n1 with replica enc.0 of `enc` version 1, SERVING, having served `requests`; the
  // report is marked with `mark` (its assignment generation) so the test can see it arrived.
  void Report(int64_t requests, int64_t mark) {
    v1::AgentMessage m;
    auto* st = m.mutable_status();
    st->set_assignment_generation(mark);
    auto* r = st->add_replicas();
    r->set_replica_id("enc.0");
    r->set_model("encoder");
    r->set_version("1");
    r->set_device("cpu");
    r->set_cpus("1");
    r->set_state(v1::SERVING);
    r->set_healthy(true);
    r->mutable_load()->set_requests(requests);
    r->mutable_load()->set_latency_p99_micros(3000);
    ASSERT_TRUE(stream_->Write(m));
    // Bounded poll until the controller has it.
    const std::string seen = "\"assignmentGeneration\":" + std::to_string(mark);
    for (int i = 0; i < 400; ++i) {
      if (controller_->NodesJson().find(seen) != std::string::npos) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    FAIL() << "the report never arrived: " << controller_->NodesJson();
  }
  void Connect() {
    stream_ = stub_->Connect(&ctx_);
    v1::AgentMessage reg;
    reg.mutable_register_()->set_node_name("n1");
    reg.mutable_register_()->set_cpu_capacity(4);
    ASSERT_TRUE(stream_->Write(reg));
  }
  // `spec`'s replica as n1 reports it: encoder version 1, healthy, in `state`.
  static v1::ReplicaStatus* AddReported(v1::NodeStatus* st, const v1::ReplicaSpec& spec,
                                        v1::LifecycleState state) {
    auto* r = st->add_replicas();
    r->set_replica_id(spec.replica_id());
    r->set_model("encoder");
    r->set_version("1");
    r->set_state(state);
    r->set_healthy(true);
    return r;
  }
  // Sends a status report marked `mark` (its assignment generation); bounded poll until the
  // controller has it.
  void SendReport(const v1::AgentMessage& m) {
    ASSERT_TRUE(stream_->Write(m));
    const std::string seen =
        "\"assignmentGeneration\":" + std::to_string(m.status().assignment_generation());
    for (int i = 0; i < 400 && controller_->NodesJson().find(seen) == std::string::npos; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  // Bounded poll until node n1 has registered.
  void WaitRegistered() {
    for (int i = 0; i < 400 && controller_->NodesJson().find("\"n1\"") == std::string::npos; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  // One pass of the loop, and the assignment it sent n1 (read until one comes: the stream's
  // deadline bounds the wait).
  v1::Assignment TickAndRead() {
    controller_->Tick();
    v1::ControllerMessage m;
    while (stream_->Read(&m)) {
      if (m.has_assignment()) return m.assignment();
    }
    return {};
  }
  // Stores deployment `name` of the encoder, version 1, with `spec_tail` (more spec lines,
  // two-space indented); returns it as parsed.
  ModelDeployment CreateEncoder(const std::string& name, const std::string& spec_tail) {
    auto d = ParseModelDeployment(
        "apiVersion: serving.kiln.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {name: " + name +
            "}\nspec:\n  model: {name: encoder, version: \"1\", uri: "
            "\"file:///m/encoder/1/model.pt\"}\n" + spec_tail,
        "test");
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return {};
    EXPECT_TRUE(store_->Create(kModelDeploymentKind, name, EncodeForStore(*d)).ok());
    return *d;
  }
  // Node n1 connects, runs the 3 replicas of `d` (deployment "enc", stored with replicas: 3)
  // and reports them SERVING (marked `mark`); then `d` is scaled to 1. Returns the assignment
  // of the tick after the scale-down.
  v1::Assignment ScaleDownThreeToOne(const ModelDeployment& d, int64_t mark) {
    Connect();
    WaitRegistered();
    v1::Assignment assigned = TickAndRead();
    EXPECT_EQ(assigned.replicas_size(), 3);
    v1::AgentMessage m;
    m.mutable_status()->set_assignment_generation(mark);
    for (const auto& spec : assigned.replicas()) AddReported(m.mutable_status(), spec, v1::SERVING);
    SendReport(m);
    ModelDeployment one = d;
    one.spec.replicas = 1;
    EXPECT_TRUE(store_->Update(kModelDeploymentKind, "enc", EncodeForStore(one), 0).ok());
    clock_.Advance(absl::Seconds(1));
    return TickAndRead();
  }
  // Deployment "enc" of one replica; n1 connects, is assigned it and Nacks the assignment
  // ("device cuda:7 is not on this node"). Returns the assignment.
  v1::Assignment AssignOneAndRefuseIt() {
    CreateEncoder("enc", "  replicas: 1\n");
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // no hang
    Connect();
    WaitRegistered();
    const v1::Assignment assigned = TickAndRead();
    v1::AgentMessage nack;
    nack.mutable_nack()->set_kind(v1::Ack::ASSIGNMENT);
    nack.mutable_nack()->set_generation(assigned.generation());
    nack.mutable_nack()->set_reason("replica enc.0: device cuda:7 is not on this node");
    EXPECT_TRUE(stream_->Write(nack));
    return assigned;
  }
  // The stored status's request count of version 1.
  int64_t StoredRequests() {
    auto o = store_->Get(kModelDeploymentKind, "enc");
    if (!o.ok()) return -1;
    auto st = nlohmann::json::parse(o->status, nullptr, false);
    if (!st.is_object() || !st.contains("versions")) return -1;
    for (const auto& v : st["versions"]) {
      if (v.value("version", "") == "1") return v.value("requests", int64_t{-1});
    }
    return -1;
  }

  std::string dir_;
  SimulatedClock clock_;
  std::unique_ptr<SqliteStore> store_;
  std::unique_ptr<Controller> controller_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::ControlPlane::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AgentMessage, v1::ControllerMessage>> stream_;
};

// A controller observes from when it starts to lead, not from when it was made: a follower that
// wins the lease an hour after it started still lets the agents re-register before it acts.
TEST_F(ControllerLoopTest, ObservingCountsFromTheStartToLead) {
  CreateEncoder("enc", "  replicas: 1\n");
  ControllerOptions co = Options();
  co.observe_for = absl::Seconds(10);
  co.tick = absl::Hours(1);  // the loop's own passes wait: this test runs them by hand
  Controller follower(co, store_.get(), &clock_);
  clock_.Advance(absl::Hours(1));  // a follower for an hour
  follower.Start();
  auto status = [&] {
    auto o = store_->Get(kModelDeploymentKind, "enc");
    return o.ok() ? o->status : std::string();
  };
  follower.Tick();
  EXPECT_EQ(status().find("observedGeneration"), std::string::npos) << status();
  clock_.Advance(absl::Seconds(10));
  follower.Tick();
  EXPECT_NE(status().find("observedGeneration"), std::string::npos) << status();
  follower.Stop();
}

// A stored spec kiln refuses (the store's schema looser than kiln's checks, or a newer kiln's)
// is not a deletion: the deployment keeps running as last applied, and its status says why
// (SpecValid False) and which generation runs. A valid spec after it is taken at once.
TEST_F(ControllerLoopTest, ARefusedStoredSpecKeepsTheLastAppliedOneRunning) {
  CreateEncoder("enc", "  replicas: 2\n");
  ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // no hang
  Connect();
  WaitRegistered();
  ASSERT_EQ(TickAndRead().replicas_size(), 2);
  auto sent_generation = [&] {
    auto nodes = nlohmann::json::parse(controller_->NodesJson());
    return nodes["items"][0]["sentGeneration"].get<int64_t>();
  };
  const int64_t sent = sent_generation();
  auto stored = store_->Get(kModelDeploymentKind, "enc");
  ASSERT_TRUE(stored.ok());
  nlohmann::json doc = nlohmann::json::parse(stored->spec);
  doc["spec"]["replicas"] = -3;
  ASSERT_TRUE(store_->Update(kModelDeploymentKind, "enc", doc.dump(), 0).ok());
  const int64_t bad_generation = store_->Get(kModelDeploymentKind, "enc")->generation;
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  controller_->Tick();
  auto status = nlohmann::json::parse(store_->Get(kModelDeploymentKind, "enc")->status);
  EXPECT_EQ(status["desiredReplicas"], 2) << status.dump();
  EXPECT_EQ(status["observedGeneration"], stored->generation) << status.dump();
  EXPECT_TRUE(SaysInvalidSpec(status, "replicas")) << status.dump();
  EXPECT_EQ(sent_generation(), sent);  // nothing new sent: its replicas stay
  // Fixed: taken at once, the condition gone.
  doc["spec"]["replicas"] = 1;
  ASSERT_TRUE(store_->Update(kModelDeploymentKind, "enc", doc.dump(), 0).ok());
  clock_.Advance(absl::Seconds(1));
  const v1::Assignment fixed = TickAndRead();
  int serving = 0;
  for (const auto& r : fixed.replicas()) serving += r.state() == v1::SERVING;
  EXPECT_EQ(serving, 1);  // the other left WARM for a while, as any scale-down
  status = nlohmann::json::parse(store_->Get(kModelDeploymentKind, "enc")->status);
  EXPECT_GT(status["observedGeneration"].get<int64_t>(), bad_generation);
  EXPECT_EQ(status.dump().find("SpecValid"), std::string::npos) << status.dump();
}

// The spec that runs is kept in the status, so a spec refused by a controller that was not
// running when it was stored (a restart, or a bad edit while it was down) still runs as last
// applied, and says so; the deployment is not dropped.
TEST_F(ControllerLoopTest, ARefusedSpecFoundAfterARestartRunsAsLastApplied) {
  CreateEncoder("enc", "  replicas: 2\n");
  controller_->Tick();
  auto stored = store_->Get(kModelDeploymentKind, "enc");
  ASSERT_TRUE(stored.ok());
  auto status = nlohmann::json::parse(stored->status);
  ASSERT_EQ(status["lastApplied"]["generation"], stored->generation) << status.dump();
  EXPECT_EQ(status["lastApplied"]["stored"], stored->spec) << status.dump();
  // The controller stops; meanwhile a spec kiln refuses is stored.
  StopController();
  nlohmann::json doc = nlohmann::json::parse(stored->spec);
  doc["spec"]["replicas"] = -3;
  ASSERT_TRUE(store_->Update(kModelDeploymentKind, "enc", doc.dump(), 0).ok());
  StartController();
  ASSERT_TRUE(stub_);
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  status = nlohmann::json::parse(store_->Get(kModelDeploymentKind, "enc")->status);
  EXPECT_EQ(status["desiredReplicas"], 2) << status.dump();
  EXPECT_EQ(status["observedGeneration"], stored->generation) << status.dump();
  EXPECT_EQ(status["lastApplied"]["stored"], stored->spec) << status.dump();
  EXPECT_TRUE(SaysInvalidSpec(status, "as last applied")) << status.dump();
  EXPECT_NE(controller_->MetricsText().find("\nkiln_controller_deployments 1\n"), std::string::npos)
      << controller_->MetricsText();
  // A last applied spec that is itself refused (a hand-edited status) runs nothing.
  StopController();
  auto now = store_->Get(kModelDeploymentKind, "enc");
  ASSERT_TRUE(now.ok());
  status["lastApplied"]["stored"] = doc.dump();
  ASSERT_TRUE(store_->UpdateStatus(kModelDeploymentKind, "enc", status.dump(), now->resource_version).ok());
  StartController();
  ASSERT_TRUE(stub_);
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  EXPECT_NE(controller_->MetricsText().find("\nkiln_controller_deployments 0\n"), std::string::npos)
      << controller_->MetricsText();
}

// A rollout action is for the rollout it was asked of: `promote` of version 2's canary, with
// version 3 applied before the next pass, does not promote version 3 unjudged.
TEST_F(ControllerLoopTest, AnActionForASupersededRolloutIsDropped) {
  CreateEncoder("enc", "  replicas: 1\n  rollout: {steps: [{weight: 10}, {weight: 50}]}\n");
  controller_->Tick();
  auto to_version = [&](const std::string& v) {
    auto o = store_->Get(kModelDeploymentKind, "enc");
    ASSERT_TRUE(o.ok());
    nlohmann::json doc = nlohmann::json::parse(o->spec);
    doc["spec"]["model"]["version"] = v;
    doc["spec"]["model"]["uri"] = "file:///m/encoder/" + v + "/model.pt";
    ASSERT_TRUE(store_->Update(kModelDeploymentKind, "enc", doc.dump(), 0).ok());
  };
  auto rollout = [&] {
    return nlohmann::json::parse(store_->Get(kModelDeploymentKind, "enc")->status)["rollout"];
  };
  to_version("2");
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  ASSERT_EQ(rollout()["canaryVersion"], "2") << rollout().dump();
  auto dropped = controller_->RequestRolloutAction("enc", "promote");
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  to_version("3");
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  EXPECT_EQ(rollout()["canaryVersion"], "3") << rollout().dump();
  EXPECT_EQ(rollout()["stableVersion"], "1") << rollout().dump();
  EXPECT_FALSE(rollout().contains("promoting")) << rollout().dump();
  // Its asker hears why.
  absl::Status heard = controller_->AwaitRolloutAction(*dropped, absl::ZeroDuration());
  EXPECT_EQ(heard.code(), absl::StatusCode::kFailedPrecondition) << heard;
  EXPECT_NE(heard.message().find("now of version 3"), std::string::npos) << heard;
  // Asked of version 3, it is taken; its asker hears only once the status that records it
  // is written.
  auto replaced = controller_->RequestRolloutAction("enc", "pause");
  ASSERT_TRUE(replaced.ok());
  auto taken = controller_->RequestRolloutAction("enc", "promote");
  ASSERT_TRUE(taken.ok());
  heard = controller_->AwaitRolloutAction(*replaced, absl::ZeroDuration());
  EXPECT_EQ(heard.code(), absl::StatusCode::kAborted) << heard;
  heard = controller_->AwaitRolloutAction(*taken, absl::ZeroDuration());
  EXPECT_EQ(heard.code(), absl::StatusCode::kDeadlineExceeded) << heard;
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  EXPECT_EQ(rollout().value("promoting", false), true) << rollout().dump();
  heard = controller_->AwaitRolloutAction(*taken, absl::ZeroDuration());
  EXPECT_TRUE(heard.ok()) << heard;
  // A promotion under way completes: an abort is refused, and its asker hears so (not
  // "applied").
  auto refused = controller_->RequestRolloutAction("enc", "abort");
  ASSERT_TRUE(refused.ok()) << refused.status();
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  heard = controller_->AwaitRolloutAction(*refused, absl::ZeroDuration());
  EXPECT_EQ(heard.code(), absl::StatusCode::kFailedPrecondition) << heard;
  EXPECT_NE(heard.message().find("is being promoted"), std::string::npos) << heard;
  EXPECT_EQ(rollout().value("promoting", false), true) << rollout().dump();
  // One asked of a deployment deleted before the next pass: nothing will take it.
  auto orphan = controller_->RequestRolloutAction("enc", "pause");
  ASSERT_TRUE(orphan.ok()) << orphan.status();
  ASSERT_TRUE(store_->Delete(kModelDeploymentKind, "enc", 0).ok());
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  heard = controller_->AwaitRolloutAction(*orphan, absl::ZeroDuration());
  EXPECT_EQ(heard.code(), absl::StatusCode::kNotFound) << heard;
}

// A deployment stored with a spec kiln refuses, and no valid one before it, is not run: an
// action asked of it is refused with the reason (not "try again", and not left waiting out
// its asker's deadline), whether it was asked before the pass that found the spec or after.
TEST_F(ControllerLoopTest, AnActionOnADeploymentNeverValidIsRefusedWithTheReason) {
  CreateEncoder("enc", "  replicas: 1\n  rollout: {steps: [{weight: 10}, {weight: 50}]}\n");
  controller_->Tick();
  auto stored = store_->Get(kModelDeploymentKind, "enc");
  ASSERT_TRUE(stored.ok());
  nlohmann::json doc = nlohmann::json::parse(stored->spec);
  doc["spec"]["model"]["version"] = "2";
  doc["spec"]["model"]["uri"] = "file:///m/encoder/2/model.pt";
  ASSERT_TRUE(store_->Update(kModelDeploymentKind, "enc", doc.dump(), 0).ok());
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  auto asked = controller_->RequestRolloutAction("enc", "promote");
  ASSERT_TRUE(asked.ok()) << asked.status();
  // Deleted and made again, refused, before the next pass.
  ASSERT_TRUE(store_->Delete(kModelDeploymentKind, "enc", 0).ok());
  doc["spec"]["replicas"] = -3;
  ASSERT_TRUE(store_->Create(kModelDeploymentKind, "enc", doc.dump()).ok());
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  absl::Status heard = controller_->AwaitRolloutAction(*asked, absl::ZeroDuration());
  EXPECT_EQ(heard.code(), absl::StatusCode::kFailedPrecondition) << heard;
  EXPECT_NE(heard.message().find("'enc' is not run"), std::string::npos) << heard;
  EXPECT_NE(heard.message().find("replicas"), std::string::npos) << heard;
  auto again = controller_->RequestRolloutAction("enc", "abort");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  EXPECT_NE(again.status().message().find("replicas"), std::string::npos) << again.status();
  // Fixed: it runs, and the answer is about its rollout again.
  doc["spec"]["replicas"] = 1;
  ASSERT_TRUE(store_->Update(kModelDeploymentKind, "enc", doc.dump(), 0).ok());
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  again = controller_->RequestRolloutAction("enc", "abort");
  EXPECT_EQ(again.status().message().find("is not run"), std::string::npos) << again.status();
}

TEST_F(ControllerLoopTest, CountersAloneAreWrittenAtMostEveryTenSeconds) {
  const ModelDeployment d = CreateEncoder("enc", "  replicas: 1\n");
  Connect();
  Report(100, 1);
  controller_->Tick();
  EXPECT_EQ(StoredRequests(), 100);
  // A second later only the counters moved: not written yet.
  clock_.Advance(absl::Seconds(1));
  Report(200, 2);
  controller_->Tick();
  EXPECT_EQ(StoredRequests(), 100);
  // Ten seconds after the last write they are.
  clock_.Advance(absl::Seconds(9));
  Report(300, 3);
  controller_->Tick();
  EXPECT_EQ(StoredRequests(), 300);
  // Anything else that changes is written at once, with the counters of the moment.
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(store_->Update(kModelDeploymentKind, "enc",
                             EncodeForStore([&] {
                               ModelDeployment two = d;
                               two.spec.replicas = 2;
                               return two;
                             }()),
                             0)
                  .ok());
  Report(400, 4);
  controller_->Tick();
  EXPECT_EQ(StoredRequests(), 400);
}

// A restarted controller takes an autoscaled deployment's count from its stored status: an
// idle moment right after the restart neither drops it to the minimum at once nor skips the
// scale-down window.
TEST_F(ControllerLoopTest, AnAutoscaledCountSurvivesAControllerRestart) {
  CreateEncoder("enc", "  autoscale: {min: 1, max: 4, targetInFlight: 1}\n");
  // What the controller before this one left: scaled to 3.
  ASSERT_TRUE(store_->UpdateStatus(kModelDeploymentKind, "enc",
                                   R"({"desiredReplicas": 3, "readyReplicas": 3})", 0)
                  .ok());
  auto desired = [&]() {
    auto o = store_->Get(kModelDeploymentKind, "enc");
    if (!o.ok()) return int64_t{-1};
    auto st = nlohmann::json::parse(o->status, nullptr, false);
    return st.is_object() ? st.value("desiredReplicas", int64_t{-1}) : int64_t{-1};
  };
  Connect();
  Report(0, 1);  // serving, nothing in flight: the raw recommendation is the minimum
  controller_->Tick();
  EXPECT_EQ(desired(), 3);
  clock_.Advance(absl::Minutes(4));
  Report(0, 2);
  controller_->Tick();
  EXPECT_EQ(desired(), 3);  // still inside the 5-minute window
  clock_.Advance(absl::Minutes(2));
  Report(0, 3);
  controller_->Tick();
  EXPECT_EQ(desired(), 1);  // idle for the whole window: down
}

// Scale-down to WARM first: 3 -> 1 leaves two replicas WARM (not drained) for
// scale_down_warm_for; a scale-up inside it promotes them; after it they drain.
TEST_F(ControllerLoopTest, AScaleDownLeavesReplicasWarmForAWhile) {
  const ModelDeployment d = CreateEncoder("enc", "  replicas: 3\n");
  ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // no hang
  Connect();
  WaitRegistered();
  v1::Assignment assigned;
  auto tick_and_read = [&]() { assigned = TickAndRead(); };
  int64_t mark = 10;
  auto report_as_assigned = [&]() {  // the node runs what it was told
    v1::AgentMessage m;
    auto* st = m.mutable_status();
    st->set_assignment_generation(++mark);
    for (const auto& spec : assigned.replicas()) AddReported(st, spec, spec.state());
    SendReport(m);
  };
  auto states = [&]() {
    std::vector<std::string> out;
    for (const auto& r : assigned.replicas()) {
      out.push_back(r.replica_id() + ":" + v1::LifecycleState_Name(r.state()));
    }
    return out;
  };
  auto set_replicas = [&](int64_t n) {
    ModelDeployment changed = d;
    changed.spec.replicas = n;
    ASSERT_TRUE(store_->Update(kModelDeploymentKind, "enc", EncodeForStore(changed), 0).ok());
  };
  tick_and_read();
  ASSERT_EQ(assigned.replicas_size(), 3);
  report_as_assigned();
  set_replicas(1);
  clock_.Advance(absl::Seconds(1));
  tick_and_read();
  EXPECT_EQ(states(), (std::vector<std::string>{"enc.0:SERVING", "enc.1:WARM", "enc.2:WARM"}));
  report_as_assigned();
  // Up to 2 within the window: a WARM one is promoted, nothing new starts.
  set_replicas(2);
  clock_.Advance(absl::Minutes(1));
  tick_and_read();
  EXPECT_EQ(states(), (std::vector<std::string>{"enc.0:SERVING", "enc.1:SERVING", "enc.2:WARM"}));
  report_as_assigned();
  // The window of the 3 -> 1 scale-down ends: what is left over drains.
  clock_.Advance(absl::Minutes(5));
  tick_and_read();
  EXPECT_EQ(states(), (std::vector<std::string>{"enc.0:SERVING", "enc.1:SERVING"}));
}

// The replicas a scale-down left WARM keep their window across a controller restart: the
// next controller takes it from the deployment's status instead of draining them at once.
TEST_F(ControllerLoopTest, ReplicasLeftWarmKeepTheirWindowAcrossARestart) {
  const ModelDeployment d = CreateEncoder("enc", "  replicas: 3\n");
  ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // no hang
  v1::Assignment assigned = ScaleDownThreeToOne(d, 7);
  ASSERT_EQ(assigned.replicas_size(), 3);  // two of them WARM now
  auto stored = nlohmann::json::parse(store_->Get(kModelDeploymentKind, "enc")->status);
  ASSERT_TRUE(stored.contains("scaleDownWarm")) << stored.dump();
  EXPECT_EQ(stored["scaleDownWarm"]["until"][0]["replicas"], 2);
  EXPECT_EQ(stored["scaleDownWarm"]["lastServing"], 1);

  // A new controller on the same store; the node re-registers with what it runs.
  Controller second(Options(), store_.get(), &clock_);
  std::unique_ptr<grpc::Server> server;
  auto stub = Serve(&second, &server);
  ASSERT_TRUE(stub);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->Connect(&ctx);
  v1::AgentMessage reg;
  reg.mutable_register_()->set_node_name("n1");
  reg.mutable_register_()->set_cpu_capacity(4);
  for (const auto& spec : assigned.replicas()) {
    auto* r = reg.mutable_register_()->add_replicas();
    r->set_replica_id(spec.replica_id());
    r->set_model("encoder");
    r->set_version("1");
    r->set_state(spec.state());
    r->set_healthy(true);
    r->set_device("cpu");
    r->set_cpus(std::to_string(r->replica_id().back() - '0'));  // one CPU each
  }
  ASSERT_TRUE(stream->Write(reg));
  for (int i = 0; i < 400 && second.NodesJson().find("\"n1\"") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto tick_and_read = [&]() {
    second.Tick();
    v1::ControllerMessage msg;
    std::vector<std::string> out;
    while (stream->Read(&msg)) {
      if (!msg.has_assignment()) continue;
      for (const auto& r : msg.assignment().replicas()) {
        out.push_back(r.replica_id() + ":" + v1::LifecycleState_Name(r.state()));
      }
      return out;
    }
    ADD_FAILURE() << "no assignment came";
    return out;
  };
  clock_.Advance(absl::Minutes(1));
  EXPECT_EQ(tick_and_read(),
            (std::vector<std::string>{"enc.0:SERVING", "enc.1:WARM", "enc.2:WARM"}));
  // The window (5 minutes from the scale-down) ends as it would have.
  clock_.Advance(absl::Minutes(4));
  EXPECT_EQ(tick_and_read(), (std::vector<std::string>{"enc.0:SERVING"}));
  ctx.TryCancel();
  v1::ControllerMessage drained;
  while (stream->Read(&drained)) {
  }
  stream->Finish();
  server->Shutdown(std::chrono::system_clock::now());
  second.Stop();
}

// Replicas left WARM by a scale-down give way when another deployment needs the room.
TEST_F(ControllerLoopTest, ReplicasLeftWarmGiveWayToOnesThatNeedTheRoom) {
  const ModelDeployment d = CreateEncoder("enc", "  replicas: 3\n");
  ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // no hang
  v1::Assignment assigned = ScaleDownThreeToOne(d, 21);  // n1 has 4 CPUs
  ASSERT_EQ(assigned.replicas_size(), 3);  // 1 SERVING, 2 left WARM
  // Another deployment of two replicas: 1 CPU is free, so the WARM ones make room.
  auto other = ParseModelDeployment(
      "apiVersion: serving.kiln.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {name: oth}\n"
      "spec:\n  model: {name: other, version: \"1\", uri: \"file:///m/other/1/model.pt\"}\n"
      "  replicas: 2\n",
      "test");
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_TRUE(store_->Create(kModelDeploymentKind, "oth", EncodeForStore(*other)).ok());
  clock_.Advance(absl::Seconds(1));
  assigned = TickAndRead();
  std::vector<std::string> ids;
  for (const auto& r : assigned.replicas()) {
    ids.push_back(r.replica_id() + ":" + v1::LifecycleState_Name(r.state()));
  }
  EXPECT_EQ(ids, (std::vector<std::string>{"enc.0:SERVING", "oth.0:SERVING", "oth.1:SERVING"}));
  // The node still reports the two it is stopping: they are not taken back a tick later.
  clock_.Advance(absl::Seconds(1));
  v1::AgentMessage again;
  again.mutable_status()->set_assignment_generation(22);
  for (const char* id : {"enc.0", "enc.1", "enc.2"}) {
    v1::ReplicaSpec spec;
    spec.set_replica_id(id);
    AddReported(again.mutable_status(), spec, std::string(id) == "enc.0" ? v1::SERVING : v1::WARM);
  }
  SendReport(again);
  controller_->Tick();
  auto stored = store_->Get(kModelDeploymentKind, "enc");
  ASSERT_TRUE(stored.ok());
  auto st = nlohmann::json::parse(stored->status);
  EXPECT_EQ(st.value("desiredReplicas", 0), 1);
  EXPECT_NE(controller_->NodesJson().find("enc.2"), std::string::npos);  // still reported
  // ...but assigned nowhere: 3 replicas in the node's assignment (enc.0, oth.0, oth.1).
  EXPECT_NE(controller_->MetricsText().find("kiln_controller_replicas_assigned 3\n"),
            std::string::npos)
      << controller_->MetricsText();
}

// A node that refuses (Nacks) its assignment: the refusal shows in the deployment's status
// (condition AssignmentsApplied False, naming the node and why) and in one Warning event; an
// Ack of a later assignment clears it.
TEST_F(ControllerLoopTest, ARefusedAssignmentShowsInTheDeploymentsStatus) {
  const v1::Assignment assigned = AssignOneAndRefuseIt();
  ASSERT_EQ(assigned.replicas_size(), 1);
  for (int i = 0; i < 400 && controller_->NodesJson().find("cuda:7") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // bounded: until it arrives
  }
  auto condition = [&]() {
    auto o = store_->Get(kModelDeploymentKind, "enc");
    auto st = nlohmann::json::parse(o.ok() ? o->status : "", nullptr, false);
    if (st.is_object()) {
      for (const auto& c : st.value("conditions", nlohmann::json::array())) {
        if (c.value("type", "") == "AssignmentsApplied") return c;
      }
    }
    return nlohmann::json();
  };
  for (int pass = 0; pass < 2; ++pass) {
    clock_.Advance(absl::Seconds(1));
    controller_->Tick();
  }
  nlohmann::json c = condition();
  ASSERT_TRUE(c.is_object()) << store_->Get(kModelDeploymentKind, "enc")->status;
  EXPECT_EQ(c.value("status", ""), "False");
  EXPECT_EQ(c.value("reason", ""), "Refused");
  EXPECT_EQ(c.value("message", ""), "n1: replica enc.0: device cuda:7 is not on this node");
  auto events = store_->ListEvents(kModelDeploymentKind, "enc", 100);
  ASSERT_TRUE(events.ok());
  int refused_events = 0;
  for (const auto& e : *events) {
    if (e.reason != "AssignmentRefused") continue;
    refused_events++;
    EXPECT_EQ(e.type, "Warning");
    EXPECT_NE(e.message.find("node n1 refused its assignment"), std::string::npos) << e.message;
  }
  EXPECT_EQ(refused_events, 1);  // once, as it came: not every pass
  // Not retried in a loop: passes that change nothing send no new generation.
  for (int pass = 0; pass < 3; ++pass) {
    clock_.Advance(absl::Seconds(1));
    controller_->Tick();
  }
  const std::string sent = "\"sentGeneration\":" + std::to_string(assigned.generation());
  EXPECT_NE(controller_->NodesJson().find(sent), std::string::npos) << controller_->NodesJson();
  // The node takes it after all (an Ack of that generation): the condition goes.
  v1::AgentMessage ack;
  ack.mutable_ack()->set_kind(v1::Ack::ASSIGNMENT);
  ack.mutable_ack()->set_generation(assigned.generation());
  ASSERT_TRUE(stream_->Write(ack));
  for (int i = 0; i < 400 && controller_->NodesJson().find("cuda:7") != std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // bounded
  }
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  EXPECT_FALSE(condition().is_object());
}

// A Nack's reason from the wire is cut short (at a character's edge): the status that carries it
// is still written, and stays valid UTF-8.
TEST_F(ControllerLoopTest, AHugeNackReasonIsCutShort) {
  CreateEncoder("enc", "  replicas: 1\n");
  ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // no hang
  Connect();
  WaitRegistered();
  const v1::Assignment assigned = TickAndRead();
  std::string reason = "x";
  while (reason.size() < 40000) reason += "\u00e9";  // two bytes each, after one: odd edges
  v1::AgentMessage nack;
  nack.mutable_nack()->set_kind(v1::Ack::ASSIGNMENT);
  nack.mutable_nack()->set_generation(assigned.generation());
  nack.mutable_nack()->set_reason(reason);
  ASSERT_TRUE(stream_->Write(nack));
  for (int i = 0; i < 400 && controller_->QueuedAcksForTest() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // bounded
  }
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  auto status = nlohmann::json::parse(store_->Get(kModelDeploymentKind, "enc")->status, nullptr,
                                      /*allow_exceptions=*/false);
  ASSERT_TRUE(status.is_object());
  std::string message;
  for (const auto& c : status["conditions"]) {
    if (c["type"] == "AssignmentsApplied") message = c["message"];
  }
  ASSERT_FALSE(message.empty()) << status.dump();
  EXPECT_LE(message.size(), Controller::kMaxNackReason + 16) << message.size();
  EXPECT_EQ(message.substr(message.size() - 3), "...");
  EXPECT_EQ(message.rfind("n1: x\u00e9", 0), 0u);
}

// One node flooding Nacks between two passes is cut off at its own bound: another node's Nack
// still gets in.
TEST_F(ControllerLoopTest, ANodeFloodingNacksDoesNotCrowdOutOthers) {
  ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // no hang
  Connect();
  WaitRegistered();
  Agent other;
  ConnectAgent(other, "n2");
  v1::AgentMessage nack;
  nack.mutable_nack()->set_kind(v1::Ack::ASSIGNMENT);
  nack.mutable_nack()->set_generation(1);
  nack.mutable_nack()->set_reason("no");
  for (size_t i = 0; i < Controller::kMaxQueuedAcksPerStream + 200; ++i) {
    ASSERT_TRUE(stream_->Write(nack));
  }
  ASSERT_TRUE(other.stream->Write(nack));
  for (int i = 0; i < 400 && controller_->QueuedAcksForTest() < Controller::kMaxQueuedAcksPerStream + 1;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // bounded
  }
  EXPECT_EQ(controller_->QueuedAcksForTest(), Controller::kMaxQueuedAcksPerStream + 1);
  Hangup(other);
}

// An agent Nacks its assignment and restarts before the next pass: the Nack came on the
// stream it left, so it says nothing about the new session (which is sent its assignment
// afresh). Nothing is marked refused.
TEST_F(ControllerLoopTest, ANackFromAStreamTheNodeLeftIsIgnored) {
  const v1::Assignment assigned = AssignOneAndRefuseIt();
  ASSERT_EQ(assigned.replicas_size(), 1);
  // Bounded poll until it waits for a pass (nothing here takes it: no pass, no read of nodes).
  for (int i = 0; i < 400 && controller_->QueuedAcksForTest() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(controller_->QueuedAcksForTest(), 1u);
  // The agent comes back on a new stream (the old one still open, as a restart can leave it).
  const uint64_t registrations = controller_->Registrations();
  Agent again;
  again.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  again.stream = stub_->Connect(&again.ctx);
  v1::AgentMessage reg;
  reg.mutable_register_()->set_node_name("n1");
  reg.mutable_register_()->set_cpu_capacity(4);
  ASSERT_TRUE(again.stream->Write(reg));
  for (int i = 0; i < 400 && controller_->Registrations() == registrations; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // bounded
  }
  ASSERT_EQ(controller_->Registrations(), registrations + 1);
  ASSERT_EQ(controller_->QueuedAcksForTest(), 1u);  // still not taken
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  EXPECT_EQ(controller_->QueuedAcksForTest(), 0u);
  EXPECT_NE(controller_->MetricsText().find("kiln_controller_nodes_refusing_assignment 0\n"),
            std::string::npos);
  EXPECT_NE(controller_->MetricsText().find("kiln_controller_registrations_total 2\n"),
            std::string::npos);
  auto o = store_->Get(kModelDeploymentKind, "enc");
  ASSERT_TRUE(o.ok());
  auto st = nlohmann::json::parse(o->status, nullptr, false);
  ASSERT_TRUE(st.is_object()) << o->status;
  for (const auto& c : st.value("conditions", nlohmann::json::array())) {
    EXPECT_NE(c.value("type", ""), "AssignmentsApplied") << c.dump();
  }
  auto events = store_->ListEvents(kModelDeploymentKind, "enc", 100);
  ASSERT_TRUE(events.ok());
  for (const auto& e : *events) EXPECT_NE(e.reason, "AssignmentRefused") << e.message;
  // The new session is sent its assignment again, the same replica.
  EXPECT_EQ(ReadAssignment(again), std::vector<std::string>{assigned.replicas(0).replica_id()});
  Hangup(again);
}

TEST_F(ControllerLoopTest, ASecondDeploymentOfTheSameModelIsRefusedUntilTheFirstGoes) {
  auto apply = [&](const std::string& name) { CreateEncoder(name, "  replicas: 1\n"); };
  auto other = ParseModelDeployment(
      "apiVersion: serving.kiln.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {name: old}\n"
      "spec:\n  model: {name: other, version: \"1\", uri: \"file:///m/other/1/model.pt\"}\n"
      "  replicas: 1\n",
      "test");
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(store_->Create(kModelDeploymentKind, "old", EncodeForStore(*other)).ok());
  clock_.Advance(absl::Seconds(1));
  // "zeta" first, then "alpha": creation order decides, not the name.
  apply("zeta");
  clock_.Advance(absl::Seconds(1));
  apply("alpha");
  Connect();
  WaitRegistered();
  auto status = [&](const std::string& name) {
    auto o = store_->Get(kModelDeploymentKind, name);
    return o.ok() ? nlohmann::json::parse(o->status, nullptr, false) : nlohmann::json();
  };
  auto reason = [&](const std::string& name) {
    for (const auto& c : status(name).value("conditions", nlohmann::json::array())) {
      if (c.value("type", "") == "Schedulable") return c.value("reason", "");
    }
    return std::string();
  };
  controller_->Tick();
  EXPECT_EQ(status("zeta").value("replicas", -1), 1);
  EXPECT_EQ(reason("zeta"), "");
  EXPECT_EQ(status("alpha").value("replicas", -1), 0);
  EXPECT_EQ(reason("alpha"), "ModelNameConflict");
  EXPECT_NE(status("alpha").dump().find("already served by deployment 'zeta'"), std::string::npos)
      << status("alpha").dump();
  // Once the first is gone, the second serves the model.
  ASSERT_TRUE(store_->Delete(kModelDeploymentKind, "zeta", 0).ok());
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  EXPECT_EQ(status("alpha").value("replicas", -1), 1);
  EXPECT_EQ(reason("alpha"), "");
  // A serving deployment keeps its model: "old", created before everything else for another
  // model, is refused once edited to name this one.
  EXPECT_EQ(status("old").value("replicas", -1), 1);
  ModelDeployment edited = *other;
  edited.spec.model.name = "encoder";
  edited.spec.model.uri = "file:///m/encoder/1/model.pt";
  ASSERT_TRUE(store_->Update(kModelDeploymentKind, "old", EncodeForStore(edited), 0).ok());
  clock_.Advance(absl::Seconds(1));
  controller_->Tick();
  EXPECT_EQ(status("alpha").value("replicas", -1), 1);
  EXPECT_EQ(reason("alpha"), "");
  EXPECT_EQ(reason("old"), "ModelNameConflict");
  EXPECT_EQ(status("old").value("replicas", -1), 0);
}

TEST_F(ControllerLoopTest, AnOverloadedGpuHasOneReplicaMovedOffAfterTheRebalanceDelay) {
  CreateEncoder("emb", "  replicas: 2\n  resources: {gpus: 1, gpuMemory: 10Gi, cpus: 1}\n");
  ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));  // no hang
  stream_ = stub_->Connect(&ctx_);
  v1::AgentMessage reg;
  reg.mutable_register_()->set_node_name("n1");
  reg.mutable_register_()->set_cpu_capacity(8);
  for (int g = 0; g < 2; ++g) {
    auto* gpu = reg.mutable_register_()->add_gpus();
    gpu->set_index(g);
    gpu->set_memory_bytes(40LL << 30);
  }
  ASSERT_TRUE(stream_->Write(reg));
  WaitRegistered();
  // The node's assignment as last sent (bounded reads).
  v1::Assignment assigned;
  auto tick_and_read = [&]() { assigned = TickAndRead(); };
  tick_and_read();
  ASSERT_EQ(assigned.replicas_size(), 2);
  for (const auto& r : assigned.replicas()) EXPECT_EQ(r.gpu(), 0);  // best fit: both on GPU 0
  // GPU 0 reports 98% busy with requests queued behind its replicas.
  int64_t mark = 100;
  auto report = [&](uint32_t utilization, int64_t queued) {
    v1::AgentMessage m;
    auto* st = m.mutable_status();
    st->set_assignment_generation(++mark);
    for (const auto& spec : assigned.replicas()) {
      AddReported(st, spec, v1::SERVING)
          ->mutable_load()
          ->set_queue_depth(spec.gpu() == 0 ? queued : 0);
    }
    for (int g = 0; g < 2; ++g) {
      auto* gs = st->add_gpus();
      gs->set_index(g);
      gs->set_healthy(true);
      gs->set_utilization_pct(g == 0 ? utilization : 5);
    }
    SendReport(m);
  };
  // Busy but keeping up (nothing queued): not overloaded.
  report(98, 0);
  clock_.Advance(absl::Seconds(31));
  controller_->Tick();
  report(98, 0);
  controller_->Tick();
  // Busy with requests waiting: overloaded, and after --rebalance-after-seconds one replica
  // moves make-before-break to GPU 1.
  report(98, 4);
  controller_->Tick();
  clock_.Advance(absl::Seconds(29));
  report(98, 4);
  controller_->Tick();
  clock_.Advance(absl::Seconds(2));
  report(98, 4);
  controller_->Tick();  // decides the move; the next tick places its replacement
  tick_and_read();
  ASSERT_EQ(assigned.replicas_size(), 3) << assigned.DebugString();
  int on_gpu1 = 0;
  for (const auto& r : assigned.replicas()) on_gpu1 += r.gpu() == 1;
  EXPECT_EQ(on_gpu1, 1);
  // The controller's /metrics say so: one node, one deployment, three replicas assigned, one
  // moving; seven passes of the loop so far (each taking no simulated time).
  const std::string metrics = controller_->MetricsText();
  for (const char* line :
       {"kiln_controller_nodes{health=\"Ready\"} 1\n", "kiln_controller_nodes{health=\"Lost\"} 0\n",
        "kiln_controller_deployments 1\n", "kiln_controller_replicas_assigned 3\n",
        "kiln_controller_replicas_moving 1\n", "kiln_controller_deployments_short 0\n",
        "kiln_controller_nodes_refusing_assignment 0\n", "kiln_controller_rollbacks_total 0\n",
        "kiln_controller_loop_duration_seconds_bucket{le=\"0.001\"} 7\n",
        "kiln_controller_loop_duration_seconds_count 7\n"}) {
    EXPECT_NE(metrics.find(line), std::string::npos) << line << "in:\n" << metrics;
  }
  // Once the replacement serves, the moved replica goes: one on each GPU.
  report(98, 4);
  tick_and_read();
  ASSERT_EQ(assigned.replicas_size(), 2) << assigned.DebugString();
  EXPECT_NE(assigned.replicas(0).gpu(), assigned.replicas(1).gpu());
  // The node falls silent past the lost grace: its replicas have nowhere to go, and what it
  // was last sent no longer counts as assigned.
  clock_.Advance(absl::Hours(2) + absl::Minutes(30));  // (forgotten only an hour after that)
  controller_->Tick();
  const std::string lost = controller_->MetricsText();
  for (const char* line :
       {"kiln_controller_nodes{health=\"Lost\"} 1\n", "kiln_controller_nodes{health=\"Ready\"} 0\n",
        "kiln_controller_replicas_assigned 0\n", "kiln_controller_deployments_short 1\n"}) {
    EXPECT_NE(lost.find(line), std::string::npos) << line << "in:\n" << lost;
  }
}

TEST_F(ControllerLoopTest, EachReportReplacesTheLastOneWhole) {
  // Reports are parsed into the memory of earlier ones (the controller reuses it): whatever a
  // report leaves out must be gone, and a message that is more than a status still counts as
  // protobuf reads it.
  Connect();
  auto status_of = [](const std::vector<std::string>& ids, int64_t mark) {
    v1::NodeStatus st;
    st.set_assignment_generation(mark);
    for (const auto& id : ids) {
      auto* r = st.add_replicas();
      r->set_replica_id(id);
      r->set_model("encoder");
      r->set_version("1");
      r->set_state(v1::SERVING);
      r->set_healthy(true);
      r->mutable_load()->set_requests(mark);
    }
    return st;
  };
  auto reported = [&](int64_t mark) -> std::vector<std::string> {
    const std::string seen = "\"assignmentGeneration\":" + std::to_string(mark);
    for (int i = 0; i < 400; ++i) {
      std::string text = controller_->NodesJson();
      if (text.find(seen) != std::string::npos) {
        std::vector<std::string> ids;
        const nlohmann::json nodes = nlohmann::json::parse(text);
        for (const auto& r : nodes["items"][0]["replicas"]) {
          ids.push_back(r["id"].get<std::string>());
        }
        return ids;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ADD_FAILURE() << "report " << mark << " never arrived: " << controller_->NodesJson();
    return {};
  };
  const std::vector<std::vector<std::string>> rounds = {
      {"a.0", "b.0", "c.0"}, {"a.0"}, {"b.0", "c.0"}, {}, {"d.0", "a.0", "b.0", "c.0"}, {"c.0"}};
  int64_t mark = 0;
  for (const auto& ids : rounds) {
    v1::AgentMessage m;
    *m.mutable_status() = status_of(ids, ++mark);
    ASSERT_TRUE(stream_->Write(m));
    EXPECT_EQ(reported(mark), ids) << "report " << mark;
    controller_->Tick();  // the loop takes reports too
  }
  // A status followed by a field this controller does not know: the status counts.
  {
    v1::AgentMessage m;
    *m.mutable_status() = status_of({"e.0"}, ++mark);
    m.GetReflection()->MutableUnknownFields(&m)->AddVarint(99, 7);
    ASSERT_TRUE(stream_->Write(m));
    EXPECT_EQ(reported(mark), std::vector<std::string>({"e.0"}));
  }
  // The status field twice in one message: protobuf merges the two (repeated fields append).
  {
    v1::AgentMessage m;
    *m.mutable_status() = status_of({"f.0"}, 1);
    m.GetReflection()->MutableUnknownFields(&m)->AddLengthDelimited(
        v1::AgentMessage::kStatusFieldNumber, status_of({"g.0"}, ++mark).SerializeAsString());
    ASSERT_TRUE(stream_->Write(m));
    EXPECT_EQ(reported(mark), std::vector<std::string>({"f.0", "g.0"}));
  }
  // And a plain report after those is whole again.
  {
    v1::AgentMessage m;
    *m.mutable_status() = status_of({"h.0", "a.0"}, ++mark);
    ASSERT_TRUE(stream_->Write(m));
    EXPECT_EQ(reported(mark), std::vector<std::string>({"h.0", "a.0"}));
  }
}

TEST_F(ControllerLoopTest, ANodeThatReconnectsIsToldAgainToRunNothing) {
  // A node runs a replica no deployment wants: it is told so, also after it reconnects (the
  // controller cannot know the node kept what it was told on the stream before).
  for (int round = 0; round < 2; ++round) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto stream = stub_->Connect(&ctx);
    v1::AgentMessage reg;
    reg.mutable_register_()->set_node_name("n1");
    reg.mutable_register_()->set_cpu_capacity(4);
    auto* r = reg.mutable_register_()->add_replicas();
    r->set_replica_id("orphan.0");
    r->set_model("encoder");
    r->set_version("1");
    r->set_state(v1::SERVING);
    r->set_healthy(true);
    ASSERT_TRUE(stream->Write(reg));
    for (int i = 0; i < 400 && controller_->NodesJson().find("\"connected\":true") == std::string::npos;
         ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    clock_.Advance(absl::Seconds(1));
    controller_->Tick();
    v1::ControllerMessage m;
    bool assigned = false;
    while (!assigned && stream->Read(&m)) {  // the routing table may come too
      if (m.has_assignment()) {
        assigned = true;
        EXPECT_EQ(m.assignment().replicas_size(), 0) << "round " << round;
      }
    }
    EXPECT_TRUE(assigned) << "round " << round;
    ctx.TryCancel();
    while (stream->Read(&m)) {
    }
    stream->Finish();
    // Bounded poll until the controller saw it go.
    for (int i = 0; i < 400 && controller_->NodesJson().find("\"connected\":true") != std::string::npos;
         ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
}


// A node whose agent never comes back: Lost (its replica placed elsewhere), then forgotten an
// hour later; its replica's id stays retired, and a node still connected cannot be removed.
TEST_F(ControllerLoopTest, ALostNodeIsForgottenLaterAndItsReplicaIdsStayRetired) {
  const ModelDeployment d = CreateEncoder("enc", "  replicas: 1\n");
  Agent n1, n2;
  n2.mark = 200;  // each node's reports are told apart by their marks
  ConnectAgent(n1, "n1");
  ConnectAgent(n2, "n2");
  controller_->Tick();
  ASSERT_EQ(ReadAssignment(n1), (std::vector<std::string>{"enc.0"}));  // name order breaks the tie
  ReadAssignment(n2);
  ReportAssigned(n1);
  EXPECT_EQ(controller_->ForgetNode("n1").code(), absl::StatusCode::kFailedPrecondition);
  Hangup(n1);  // n1's agent goes away for good
  auto connected = [&](const std::string& name) {
    for (const auto& n : nlohmann::json::parse(controller_->NodesJson())["items"]) {
      if (n["name"] == name) return n["connected"].get<bool>();
    }
    return false;
  };
  for (int i = 0; i < 400 && connected("n1"); ++i) {  // bounded poll: the stream's end is seen
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_FALSE(connected("n1"));
  // Lost (the lease's 2 h): its replica is placed again on n2, under a new id.
  clock_.Advance(absl::Hours(2) + absl::Seconds(1));
  ReportAssigned(n2);
  controller_->Tick();
  EXPECT_EQ(ReadAssignment(n2), (std::vector<std::string>{"enc.1"}));
  // The decision is timed from the lease's end (1 s before this pass, on the simulated clock).
  const std::string metrics = controller_->MetricsText();
  EXPECT_NE(metrics.find("kiln_controller_node_loss_decision_seconds_count 1\n"),
            std::string::npos);
  EXPECT_NE(metrics.find("kiln_controller_node_loss_decision_seconds_sum 1\n"), std::string::npos)
      << metrics;
  ReportAssigned(n2);
  EXPECT_NE(controller_->NodesJson().find("\"n1\""), std::string::npos);  // Lost, still listed
  // An hour more: forgotten.
  clock_.Advance(absl::Hours(1));
  ReportAssigned(n2);
  controller_->Tick();
  EXPECT_EQ(controller_->NodesJson().find("\"n1\""), std::string::npos) << controller_->NodesJson();
  EXPECT_NE(controller_->MetricsText().find("kiln_controller_nodes_forgotten_total 1\n"),
            std::string::npos);
  // enc.0 may still run on n1 if it comes back: a scale-up does not reuse its id.
  ModelDeployment two = d;
  two.spec.replicas = 2;
  ASSERT_TRUE(store_->Update(kModelDeploymentKind, "enc", EncodeForStore(two), 0).ok());
  clock_.Advance(absl::Seconds(1));
  ReportAssigned(n2);
  controller_->Tick();
  EXPECT_EQ(ReadAssignment(n2), (std::vector<std::string>{"enc.1", "enc.2"}));
  // By hand: an unknown node is not found, a connected one refused.
  EXPECT_EQ(controller_->ForgetNode("n1").code(), absl::StatusCode::kNotFound);
  absl::Status refused = controller_->ForgetNode("n2");
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("connected"), std::string::npos) << refused;
  Hangup(n2);
}

// Removing a dead node by hand places its replicas elsewhere at once, without waiting out the
// lease.
TEST_F(ControllerLoopTest, ANodeRemovedByHandHasItsReplicasPlacedAgainAtOnce) {
  CreateEncoder("enc", "  replicas: 1\n");
  Agent n1, n2;
  n2.mark = 200;
  ConnectAgent(n1, "n1");
  ConnectAgent(n2, "n2");
  controller_->Tick();
  ASSERT_EQ(ReadAssignment(n1), (std::vector<std::string>{"enc.0"}));
  ASSERT_TRUE(ReadAssignment(n2).empty());
  Hangup(n1);
  absl::Status removed = absl::UnknownError("not tried");
  for (int i = 0; i < 400; ++i) {  // bounded poll until the controller saw the stream end
    removed = controller_->ForgetNode("n1");
    if (removed.code() != absl::StatusCode::kFailedPrecondition) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(removed.ok()) << removed;
  clock_.Advance(absl::Seconds(1));  // well inside the lease
  controller_->Tick();
  EXPECT_EQ(ReadAssignment(n2), (std::vector<std::string>{"enc.1"}));
  Hangup(n2);
}

}  // namespace
}  // namespace kiln
