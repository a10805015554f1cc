// Two real kiln-controller processes on the Kubernetes store and a Lease, against the in-test
// API server: one leads, the follower serves the admin API, spec.replicas set through the scale
// subresource is obeyed, and when the leader is killed the other takes over within the lease.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/time/clock.h"
#include "controller/kube_client.h"
#include "controller/model_deployment.h"
#include "tests/support/eventually.h"
#include "tests/support/fake_kube_api.h"
#include "tests/support/shell.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::FakeKubeApi;

using testing::ReadFile;
using testing::Shell;

template <typename F>
bool Eventually(F pred, absl::Duration limit = absl::Seconds(20)) {
  return testing::Eventually(pred, limit, absl::Milliseconds(20));
}

class KubeControllerTest : public ::testing::Test {
 protected:
  struct Proc {
    pid_t pid = -1;
    std::string log;
    int admin_port = 0;
  };

  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("kiln-kctl-" + std::to_string(getpid()))).string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    api_ = std::make_unique<FakeKubeApi>();
    kubeconfig_ = dir_ + "/kubeconfig";
    std::ofstream(kubeconfig_) << "apiVersion: v1\nkind: Config\ncurrent-context: t\n"
                                  "clusters: [{name: c, cluster: {server: \"" << api_->url() << "\"}}]\n"
                                  "users: [{name: u, user: {token: test-token}}]\n"
                                  "contexts: [{name: t, context: {cluster: c, user: u, namespace: kiln}}]\n";
    KubeConfig c;
    c.server = api_->url();
    c.token = "test-token";
    c.ns = "kiln";
    client_ = std::make_unique<KubeClient>(c);
  }
  void TearDown() override {
    for (auto& [id, p] : procs_) Kill(p, SIGKILL);
    fs::remove_all(dir_);
  }

  void Start(const std::string& id) {
    Proc p;
    p.log = dir_ + "/" + id + ".log";
    std::ofstream(p.log, std::ios::trunc).close();
    // Each candidate runs "in" a Pod of its name (the fake API keeps the Pod for its label).
    api_->AddPod("kiln", id);
    setenv("POD_NAME", id.c_str(), 1);
    setenv("POD_NAMESPACE", "kiln", 1);
    p.pid = testing::SpawnLogged(
        {KILN_CONTROLLER_BIN, "--store", "kubernetes", "--kubeconfig", kubeconfig_, "--leader-elect",
         "--identity", id, "--lease-duration-seconds", "2", "--renew-deadline-seconds", "1.5",
         "--retry-period-seconds", "0.2", "--observe-seconds", "0", "--admin-port", "0", "--listen",
         "127.0.0.1:0"},
        p.log);
    unsetenv("POD_NAME");
    unsetenv("POD_NAMESPACE");
    ASSERT_GE(p.pid, 0);
    ASSERT_TRUE(Eventually([&] { return ReadFile(p.log).find("admin=http://127.0.0.1:") != std::string::npos; }))
        << ReadFile(p.log);
    std::string text = ReadFile(p.log);
    p.admin_port = std::stoi(text.substr(text.find("admin=http://127.0.0.1:") + 23));
    procs_[id] = p;
  }
  int Kill(Proc& p, int sig) {
    if (p.pid <= 0) return -1;
    kill(p.pid, sig);
    int status = 0;
    waitpid(p.pid, &status, 0);
    p.pid = -1;
    return status;
  }
  // The leader label on candidate `id`'s Pod ("" when absent).
  std::string LeaderLabel(const std::string& id) {
    json pod = api_->Get(FakeKubeApi::Pods("kiln"), id);
    return pod.is_object() ? pod["metadata"]["labels"].value("serving.kiln.dev/leader", "") : "";
  }
  std::string Holder() {
    json lease = api_->Get(FakeKubeApi::Leases("kiln"), "kiln-controller");
    return lease.is_object() ? lease["spec"].value("holderIdentity", "") : "";
  }
  json Status() {
    json o = api_->Get(FakeKubeApi::ModelDeployments("kiln"), "embedder");
    return o.is_object() ? o.value("status", json::object()) : json::object();
  }
  void Scale(int replicas) {
    json scale = {{"apiVersion", "autoscaling/v1"}, {"kind", "Scale"},
                  {"metadata", {{"name", "embedder"}}}, {"spec", {{"replicas", replicas}}}};
    auto r = client_->Call("PUT", FakeKubeApi::ModelDeployments("kiln") + "/embedder/scale", &scale);
    ASSERT_TRUE(r.ok() && r->code == 200) << (r.ok() ? r->body.dump() : r.status().ToString());
  }

  std::string dir_, kubeconfig_;
  std::unique_ptr<FakeKubeApi> api_;
  std::unique_ptr<KubeClient> client_;
  std::map<std::string, Proc> procs_;
};

TEST_F(KubeControllerTest, OneLeaderActsAndTheOtherTakesOverWhenItIsKilled) {
  Start("a");
  Start("b");
  ASSERT_TRUE(Eventually([&] { return !Holder().empty(); }));
  const std::string leader = Holder();
  const std::string follower = leader == "a" ? "b" : "a";
  ASSERT_TRUE(Eventually([&] { return ReadFile(procs_[leader].log).find("control=") != std::string::npos; }));
  EXPECT_EQ(ReadFile(procs_[follower].log).find("control="), std::string::npos)
      << "the follower must not take agent streams";
  // Only the leader's Pod carries the label the agents' Service selects.
  EXPECT_TRUE(Eventually([&] { return LeaderLabel(leader) == "true"; })) << ReadFile(procs_[leader].log);
  EXPECT_EQ(LeaderLabel(follower), "");
  // /metrics says which one leads (alerts select the leader's series by it).
  auto leader_gauge = [&](const std::string& id) {
    auto m = Shell("curl -s http://127.0.0.1:" + std::to_string(procs_[id].admin_port) +
                   "/metrics | grep '^kiln_controller_leader '");
    return m.out;
  };
  EXPECT_EQ(leader_gauge(leader), "kiln_controller_leader 1\n");
  EXPECT_EQ(leader_gauge(follower), "kiln_controller_leader 0\n");

  // The follower's admin API writes through the Kubernetes API.
  std::string spec = dir_ + "/emb.yaml";
  std::ofstream(spec) << "apiVersion: serving.kiln.dev/v1alpha1\nkind: ModelDeployment\n"
                         "metadata: {name: embedder}\nspec:\n"
                         "  model: {name: encoder, version: \"1\", uri: \"file:///models/encoder/1/model.pt\"}\n"
                         "  replicas: 2\n";
  auto r = Shell(std::string(KILNCTL_BIN) + " --server http://127.0.0.1:" +
                 std::to_string(procs_[follower].admin_port) + " apply -f " + spec);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(api_->Get(FakeKubeApi::ModelDeployments("kiln"), "embedder").is_object());
  // The leader reports status (the deployment cannot be placed: no agents).
  EXPECT_TRUE(Eventually([&] { return Status().value("observedGeneration", 0) == 1 && Status().value("desiredReplicas", 0) == 2; }))
      << Status().dump();
  EXPECT_EQ(Status().value("selector", ""), "serving.kiln.dev/deployment=embedder");
  // No agents: a Warning Event says why the replicas are not placed.
  EXPECT_TRUE(Eventually([&] {
    for (const auto& e : api_->EventsRecorded()) {
      if (e["reason"] == "FailedPlacement" && e["involvedObject"]["name"] == "embedder" && e["type"] == "Warning") return true;
    }
    return false;
  }));
  auto available_since = [&]() -> std::string {
    for (const auto& c : Status().value("conditions", json::array())) {
      if (c.value("type", "") == "Available") return c.value("status", "") + " " + c.value("lastTransitionTime", "");
    }
    return "";
  };
  const std::string since = available_since();
  ASSERT_EQ(since.rfind("False 20", 0), 0u) << Status().dump();
  // Let the wall clock pass that second, so a re-stamped condition would show.
  ASSERT_TRUE(Eventually([&] { return "False " + FormatRfc3339(absl::Now()) > since; }));
  // kubectl scale (the scale subresource) is obeyed.
  Scale(3);
  EXPECT_TRUE(Eventually([&] { return Status().value("desiredReplicas", 0) == 3 && Status().value("observedGeneration", 0) == 2; }))
      << Status().dump();
  // Still not available: the condition keeps the time it became so.
  EXPECT_EQ(available_since(), since);

  // The leader dies without a word: the follower takes the lease once it runs out (2 s).
  Kill(procs_[leader], SIGKILL);
  ASSERT_TRUE(Eventually([&] { return Holder() == follower; }, absl::Seconds(10))) << Holder();
  EXPECT_TRUE(Eventually([&] { return ReadFile(procs_[follower].log).find("control=") != std::string::npos; }));
  EXPECT_TRUE(Eventually([&] { return LeaderLabel(follower) == "true"; }));
  json lease = api_->Get(FakeKubeApi::Leases("kiln"), "kiln-controller");
  EXPECT_EQ(lease["spec"]["leaseTransitions"], 1);
  Scale(1);
  EXPECT_TRUE(Eventually([&] { return Status().value("desiredReplicas", 0) == 1; })) << Status().dump();

  // A leader stopped cleanly hands the lease back at once.
  int status = Kill(procs_[follower], SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << ReadFile(procs_[follower].log);
  EXPECT_EQ(Holder(), "");
  EXPECT_EQ(LeaderLabel(follower), "");  // cleared on the way out
  // A candidate that starts again in the killed leader's Pod clears the label it left there.
  ASSERT_EQ(LeaderLabel(leader), "true");
  Start(leader);
  EXPECT_TRUE(Eventually([&] {
    return ReadFile(procs_[leader].log).find("pod kiln/" + leader + ": unlabelled") != std::string::npos;
  })) << ReadFile(procs_[leader].log);
}

TEST_F(KubeControllerTest, BadFlagsAreRefusedNamingTheFlag) {
  auto r = Shell(std::string(KILN_CONTROLLER_BIN) + " --store sqlite --leader-elect --state-dir " + dir_);
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--leader-elect: needs --store=kubernetes"), std::string::npos) << r.out;
  r = Shell(std::string(KILN_CONTROLLER_BIN) + " --store kubernetes --kubeconfig " + kubeconfig_ +
            " --leader-elect --lease-duration-seconds 5 --renew-deadline-seconds 6");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("renew deadline"), std::string::npos) << r.out;
  r = Shell(std::string(KILN_CONTROLLER_BIN) + " --store kubernetes --kubeconfig " + dir_ + "/missing");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("kubeconfig"), std::string::npos) << r.out;
  r = Shell(std::string(KILN_CONTROLLER_BIN) + " --store etcd");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("--store"), std::string::npos) << r.out;
  r = Shell(std::string(KILN_CONTROLLER_BIN));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--state-dir: required"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace kiln
