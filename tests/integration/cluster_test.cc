// A one-node cluster from real binaries on loopback: kiln-controller (SQLite store), a
// kiln-agent connected to it (replicas are real kiln-runtime processes on the demo encoder),
// and kilnctl. Deploy and serve through the node's router, scale 1 -> 2 from the warm pool
// (the warm replica is promoted, not restarted), kill the controller with SIGKILL and
// restart it: nothing is lost and no replica is restarted.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cpprest/http_client.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <atomic>
#include <mutex>
#include <thread>

#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/support/requests.h"
#include "tests/support/test_ca.h"
#include "tests/support/shell.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using kiln::testing::ReadFile;
using kiln::testing::SpawnLogged;

// Bounded poll (30 s) of a log for `key` followed by a number; -1 when it never shows.
int64_t WaitForNumber(const std::string& log, const std::string& key, size_t from = 0) {
  for (int i = 0; i < 1500; ++i) {
    std::string text = ReadFile(log);
    size_t at = text.find(key, from);
    if (at != std::string::npos) return std::strtoll(text.c_str() + at + key.size(), nullptr, 10);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

// A network namespace joined to this one by a veth pair, 10.231.N.1 on this side and
// 10.231.N.2 on the other: a second machine whose link a test can cut. Needs root and `ip`.
class VethNamespace {
 public:
  static bool Possible() {
    return geteuid() == 0 && kiln::testing::Shell("ip netns list").rc == 0;
  }
  VethNamespace()
      : name_("kiln-t" + std::to_string(getpid())),
        host_if_("kh" + std::to_string(getpid())),
        ns_if_("kn" + std::to_string(getpid())),
        net_("10.231." + std::to_string(20 + getpid() % 200) + ".") {
    Remove();  // one a killed run of the same pid left
    // Those killed runs of other pids left (their pid is gone): their addresses could clash.
    std::istringstream names(kiln::testing::Shell("ip netns list").out);
    for (std::string line; std::getline(names, line);) {
      if (line.rfind("kiln-t", 0) != 0) continue;
      const std::string name = line.substr(0, line.find(' '));
      const pid_t pid = static_cast<pid_t>(std::atol(name.c_str() + 6));
      if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
        kiln::testing::Shell("ip netns pids " + name + " | xargs -r kill -9");
        kiln::testing::Shell("ip netns del " + name);
      }
    }
    for (const std::string& cmd :
         {"ip netns add " + name_,
          "ip link add " + host_if_ + " type veth peer name " + ns_if_,
          "ip link set " + ns_if_ + " netns " + name_,
          "ip addr add " + here() + "/30 dev " + host_if_, "ip link set " + host_if_ + " up",
          In("ip addr add " + there() + "/30 dev " + ns_if_), In("ip link set " + ns_if_ + " up"),
          In("ip link set lo up")}) {
      auto r = kiln::testing::Shell(cmd);
      if (r.rc != 0) {
        error_ = cmd + ": " + r.out;
        return;
      }
    }
  }
  ~VethNamespace() { Remove(); }
  const std::string& error() const { return error_; }  // empty when it was made
  std::string here() const { return net_ + "1"; }
  std::string there() const { return net_ + "2"; }
  std::string path() const { return "/run/netns/" + name_; }
  // The far side's link goes down (no FIN, no RST reach anyone: a dead switch port), or up.
  bool SetLink(bool up) {
    return kiln::testing::Shell(In("ip link set " + ns_if_ + (up ? " up" : " down"))).rc == 0;
  }

 private:
  std::string In(const std::string& cmd) const { return "ip netns exec " + name_ + " " + cmd; }
  void Remove() {
    // Whatever still runs in it goes first (a failed test's agent or replicas).
    kiln::testing::Shell("ip netns pids " + name_ + " 2>/dev/null | xargs -r kill -9");
    kiln::testing::Shell("ip netns del " + name_ + " 2>/dev/null");
    kiln::testing::Shell("ip link del " + host_if_ + " 2>/dev/null");
  }
  std::string name_, host_if_, ns_if_, net_, error_;
};

std::pair<int, std::string> Http(const std::string& method, int port, const std::string& path,
                                 const std::string& body = "") {
  web::http::client::http_client_config cfg;
  cfg.set_timeout(std::chrono::seconds(10));
  web::http::client::http_client c("http://127.0.0.1:" + std::to_string(port), cfg);
  try {
    web::http::http_request req(method);
    req.set_request_uri(path);
    if (!body.empty()) req.set_body(body, "application/json");
    auto r = c.request(req).get();
    return {r.status_code(), r.extract_utf8string(true).get()};
  } catch (const std::exception& e) {
    return {0, e.what()};
  }
}

// What runs of this binary that were killed mid-test (by ctest's timeout, say: no TearDown)
// left: their directories (kiln-cluster-PID, that PID gone, or this process's own PID reused
// before any test here started something) and the kiln processes whose command line names one
// (controllers, agents, and the runtimes an agent keeps running across its own exit). Passes
// repeat until one kills nothing: a dying agent may have started a runtime meanwhile.
void SweepKilledRuns() {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(fs::temp_directory_path(), ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("kiln-cluster-", 0) != 0) continue;
    const pid_t owner = static_cast<pid_t>(std::atol(name.c_str() + 13));
    // A killed run nobody has reaped yet is a zombie: gone all the same.
    if (owner <= 0 || (owner != getpid() && kiln::testing::Running(owner))) continue;
    const std::string dir = entry.path().string() + "/";
    for (int pass = 0; pass < 20; ++pass) {
      int killed = 0;
      for (const auto& proc : fs::directory_iterator("/proc", ec)) {
        const pid_t pid = static_cast<pid_t>(std::atol(proc.path().filename().c_str()));
        if (pid <= 0 || pid == getpid()) continue;
        std::string cmdline = ReadFile(proc.path().string() + "/cmdline");
        const std::string program = cmdline.substr(0, cmdline.find('\0'));
        if (program != KILN_CONTROLLER_BIN && program != KILN_AGENT_BIN &&
            program != KILN_RUNTIME_BIN) {
          continue;
        }
        std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
        if (cmdline.find(dir) != std::string::npos && kill(pid, SIGKILL) == 0) ++killed;
      }
      if (killed == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    fs::remove_all(entry.path(), ec);
  }
}

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SweepKilledRuns();
    dir_ = (fs::temp_directory_path() / ("kiln-cluster-" + std::to_string(getpid()))).string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    Kill(&agent_, SIGTERM);  // --stop-replicas-on-exit: drains and stops the runtimes
    for (pid_t& pid : others_) {
      if (pid > 0 && kill(pid, 0) == 0) Kill(&pid, SIGTERM);  // those a test left running
    }
    Kill(&controller_, SIGKILL);
    fs::remove_all(dir_);
  }
  static void Kill(pid_t* pid, int sig) {
    if (*pid <= 0) return;
    kill(*pid, sig);
    int status;
    waitpid(*pid, &status, 0);
    *pid = -1;
  }

  void StartController(const std::string& listen, std::vector<std::string> extra = {}) {
    clog_ = dir_ + "/controller" + std::to_string(++controllers_) + ".log";
    std::vector<std::string> args = {KILN_CONTROLLER_BIN, "--state-dir", dir_ + "/state",
                                     "--admin-port", "0", "--listen", listen};
    if (std::find(extra.begin(), extra.end(), "--observe-seconds") == extra.end()) {
      args.insert(args.end(), {"--observe-seconds", "0.3"});  // quick, where nothing restarts
    }
    args.insert(args.end(), extra.begin(), extra.end());
    controller_ = SpawnLogged(args, clog_);
    control_host_ = listen.substr(0, listen.rfind(':'));
    admin_ = WaitForNumber(clog_, "admin=http://127.0.0.1:");
    control_ = WaitForNumber(clog_, "control=" + control_host_ + ":");
    ASSERT_GT(admin_, 0) << ReadFile(clog_);
  }
  struct Agent {
    pid_t pid = -1;
    std::string log;
    int admin = 0, router_grpc = 0;
  };
  // A second node on the same machine (its own state, ports and replicas), or in the network
  // namespace `netns` (a path), where it binds `bind`.
  Agent StartAnotherAgent(const std::string& name, const std::vector<std::string>& extra = {},
                          const std::string& netns = "", const std::string& bind = "127.0.0.1") {
    Agent a;
    a.log = dir_ + "/agent-" + name + ".log";
    std::vector<std::string> args = {
        KILN_AGENT_BIN, "--controller", control_host_ + ":" + std::to_string(control_),
        "--node-name", name, "--state-dir", dir_ + "/agent-" + name,
        "--runtime-binary", KILN_RUNTIME_BIN, "--admin-bind", bind,
        "--admin-port", "0", "--reserved-cpus", "0", "--tick-ms", "50",
        "--ingress-bind", bind, "--grpc-port", "0", "--http-port", "0",
        "--stop-timeout-ms", "5000", "--stop-replicas-on-exit"};
    args.insert(args.end(), extra.begin(), extra.end());
    a.pid = SpawnLogged(args, a.log, netns);
    others_.push_back(a.pid);
    a.admin = WaitForNumber(a.log, "admin_port=");
    a.router_grpc = WaitForNumber(a.log, "router listening grpc_port=");
    return a;
  }
  void StartAgent() {
    alog_ = dir_ + "/agent.log";
    const std::string controller = control_host_ + ":" + std::to_string(control_);
    agent_ = SpawnLogged({KILN_AGENT_BIN, "--controller", controller,
                    "--node-name", "n1", "--state-dir", dir_ + "/agent", "--runtime-binary",
                    KILN_RUNTIME_BIN, "--admin-bind", "127.0.0.1", "--admin-port", "0",
                    "--fake-gpus", "1:16Gi", "--reserved-cpus", "0", "--tick-ms", "50",
                    "--ingress-bind", "127.0.0.1", "--grpc-port", "0", "--http-port", "0",
                    "--stop-timeout-ms", "5000", "--stop-replicas-on-exit"},
                   alog_);
    agent_admin_ = WaitForNumber(alog_, "admin_port=");
    router_grpc_ = WaitForNumber(alog_, "router listening grpc_port=");
    ASSERT_GT(agent_admin_, 0) << ReadFile(alog_);
    ASSERT_GT(router_grpc_, 0) << ReadFile(alog_);
  }
  std::string Ctl(const std::string& args) {
    std::string cmd = std::string(KILNCTL_BIN) + " --server http://127.0.0.1:" +
                      std::to_string(admin_) + " " + args + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    std::string out;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
    last_rc_ = WEXITSTATUS(pclose(p));
    return out;
  }
  json Deployment(const std::string& name) {
    auto [code, text] = Http("GET", admin_, "/apis/serving.kiln.dev/v1alpha1/modeldeployments/" + name);
    json j = json::parse(text, nullptr, false);
    return code == 200 && !j.is_discarded() ? j : json::object();
  }
  // Bounded poll of the deployment's status.
  bool WaitForStatus(const std::string& name, int ready, int warm) {
    for (int i = 0; i < 1200; ++i) {
      json d = Deployment(name);
      if (d.contains("status") && d["status"].value("readyReplicas", -1) == ready &&
          d["status"].value("warmReplicas", -1) == warm) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    ADD_FAILURE() << "status never reached ready=" << ready << " warm=" << warm << ": "
                  << Deployment(name).dump() << "\n" << ReadFile(alog_) << ReadFile(clog_);
    return false;
  }
  // Replica id -> pid on the node whose admin port is `admin` (0: n1), and on `also`'s.
  std::map<std::string, int> Pids(int admin = 0, int also = 0) {
    std::map<std::string, int> out;
    for (int port : {admin ? admin : agent_admin_, also}) {
      if (port == 0) continue;
      auto [code, text] = Http("GET", port, "/v1/replicas");
      json j = json::parse(text, nullptr, false);
      if (code != 200 || j.is_discarded()) continue;
      for (const auto& r : j["replicas"]) out[r["id"].get<std::string>()] = r["pid"].get<int>();
    }
    return out;
  }
  // A controller and two nodes, n1 and the returned n2.
  Agent StartTwoNodes(std::vector<std::string> controller_flags = {}) {
    StartController("127.0.0.1:0", std::move(controller_flags));
    StartAgent();
    Agent n2 = StartAnotherAgent("n2");
    EXPECT_GT(n2.admin, 0) << ReadFile(n2.log);
    EXPECT_GT(n2.router_grpc, 0) << ReadFile(n2.log);
    return n2;
  }
  grpc::Status Infer(int router = 0, std::string* version = nullptr, int64_t first_token = 1) {
    auto stub = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(router ? router : router_grpc_),
        grpc::InsecureChannelCredentials()));
    inference::ModelInferRequest req = kiln::testing::EncoderRequest(first_token);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    inference::ModelInferResponse resp;
    grpc::Status s = stub->ModelInfer(&ctx, req, &resp);
    if (s.ok() && (resp.outputs_size() != 1 || resp.outputs(0).name() != "embedding")) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "unexpected response");
    }
    if (version) *version = resp.model_version();
    return s;
  }

  // Applies ModelDeployment `name` of version 1 of `model` (from the test repository) with
  // `spec_tail` (more spec lines, two-space indented) through kilnctl; the exit code is
  // last_rc_.
  std::string ApplySpec(const std::string& name, const std::string& model,
                        const std::string& spec_tail) {
    std::string path = dir_ + "/" + name + ".yaml";
    std::ofstream(path) << "apiVersion: serving.kiln.dev/v1alpha1\nkind: ModelDeployment\n"
                           "metadata: {name: " << name << "}\nspec:\n  model: {name: " << model
                        << ", version: \"1\", uri: \"file://" << KILN_MODEL_REPO << "/" << model
                        << "/1/model.pt\"}\n" << spec_tail;
    return Ctl("apply -f " + path);
  }

  // Deployment `enc` of the encoder VERSION from REPO, 2 replicas, with `rollout` appended.
  static std::string EncoderSpec(const std::string& version, const std::string& repo,
                                 const std::string& rollout) {
    return "apiVersion: serving.kiln.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {name: enc}\n"
           "spec:\n  model: {name: encoder, version: \"" + version + "\", uri: \"file://" + repo +
           "/encoder/" + version + "/model.pt\"}\n  replicas: 2\n" + rollout;
  }
  // Two nodes (n1 and the returned n2) and deployment enc (2 replicas, `rollout` appended) at
  // version 1, serving; FILE.yaml for `next` (version 2 unless given, from `repo`) written
  // beside it for the test to apply.
  Agent StartRolloutCluster(const std::string& rollout, const std::string& next = "v2",
                            const std::string& next_version = "2",
                            const std::string& repo = KILN_MODEL_REPO,
                            std::vector<std::string> controller_flags = {}) {
    Agent n2 = StartTwoNodes(std::move(controller_flags));
    std::ofstream(dir_ + "/v1.yaml") << EncoderSpec("1", KILN_MODEL_REPO, rollout);
    std::ofstream(dir_ + "/" + next + ".yaml") << EncoderSpec(next_version, repo, rollout);
    std::string out = Ctl("apply -f " + dir_ + "/v1.yaml");
    EXPECT_EQ(last_rc_, 0) << out;
    EXPECT_TRUE(WaitForStatus("enc", 2, 0));
    return n2;
  }
  // The versions of `name`'s replicas, as `kilnctl get replicas NAME -o json` lists them.
  std::multiset<std::string> ReplicaVersions(const std::string& name) {
    std::multiset<std::string> out;
    const std::string text = Ctl("get replicas " + name + " -o json");
    const json list = json::parse(text, nullptr, false);
    EXPECT_TRUE(list.is_object()) << text;
    if (!list.is_object()) return out;
    for (const auto& r : list.value("items", json::array())) out.insert(r.value("version", ""));
    return out;
  }
  // Bounded poll until n1 and `other_admin`'s node run `n` replicas together.
  void WaitForReplicasOnBothNodes(size_t n, int other_admin) {
    for (int i = 0; i < 800; ++i) {
      auto all = Pids();
      auto more = Pids(other_admin);
      all.insert(more.begin(), more.end());
      if (all.size() == n) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
  }

  // Requests through a node's router every 5 ms on a thread of its own until Stop().
  class Traffic {
   public:
    Traffic(ClusterTest* test, int router)
        : thread_([this, test, router] {
            while (!stop_) {
              grpc::Status st = test->Infer(router);
              if (st.ok()) {
                ok++;
              } else if (failed++ == 0) {
                first_error = st.error_message();
              }
              std::this_thread::sleep_for(std::chrono::milliseconds(5));
            }
          }) {}
    ~Traffic() { Stop(); }
    void Stop() {
      stop_ = true;
      if (thread_.joinable()) thread_.join();
    }
    std::atomic<int> ok{0}, failed{0};
    std::string first_error;  // read after Stop()

   private:
    std::atomic<bool> stop_{false};
    std::thread thread_;  // last: it starts once the counters exist
  };

  std::string dir_, clog_, alog_;
  pid_t controller_ = -1, agent_ = -1;
  std::vector<pid_t> others_;  // every StartAnotherAgent, stopped at the end if still running
  int controllers_ = 0;
  std::string control_host_ = "127.0.0.1";  // where the controller's ControlPlane listens
  int admin_ = 0, control_ = 0, agent_admin_ = 0, router_grpc_ = 0;
  int last_rc_ = -1;
};

TEST_F(ClusterTest, DeployServeScaleFromWarmPoolAndSurviveAControllerKill) {
  StartController("127.0.0.1:0");
  StartAgent();
  std::ofstream(dir_ + "/enc.yaml")
      << "apiVersion: serving.kiln.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {name: enc}\n"
         "spec:\n  model: {name: encoder, version: \"1\", uri: \"file://"
      << KILN_MODEL_REPO << "/encoder/1/model.pt\"}\n  replicas: 1\n  warmPool: 1\n";
  std::string out = Ctl("apply -f " + dir_ + "/enc.yaml");
  ASSERT_EQ(last_rc_, 0) << out;
  ASSERT_TRUE(WaitForStatus("enc", 1, 1));
  grpc::Status s = Infer();
  ASSERT_TRUE(s.ok()) << s.error_message();
  auto before = Pids();
  ASSERT_EQ(before.size(), 2u);
  out = Ctl("get nodes");
  EXPECT_EQ(last_rc_, 0) << out;
  EXPECT_NE(out.find("n1     Ready    "), std::string::npos) << out;
  EXPECT_NE(out.find("1 serving, 1 warm"), std::string::npos) << out;

  // Scale 1 -> 2: the warm replica is promoted in place (same process).
  out = Ctl("scale enc --replicas 2");
  ASSERT_EQ(last_rc_, 0) << out;
  ASSERT_TRUE(WaitForStatus("enc", 2, 0));
  auto scaled = Pids();
  for (const auto& [id, pid] : before) EXPECT_EQ(scaled[id], pid) << id << " was restarted";
  EXPECT_TRUE(Infer().ok());

  // The controller is killed and comes back on the same store and address: the deployment
  // is there, the node re-registers with its replicas, and none of them is restarted.
  Kill(&controller_, SIGKILL);
  int control = control_;
  EXPECT_TRUE(Infer().ok());  // the node serves without its controller
  StartController("127.0.0.1:" + std::to_string(control));
  out = Ctl("get deployments");
  EXPECT_NE(out.find("enc"), std::string::npos) << out;
  // The agent reconnects (with backoff) and re-registers with its two replicas; the new
  // controller, having observed, sends the node its assignment again: the same replicas.
  ASSERT_EQ(WaitForNumber(clog_, " gpus, "), 2) << ReadFile(clog_);
  ASSERT_GT(WaitForNumber(clog_, "node n1: assignment generation "), 0) << ReadFile(clog_);
  ASSERT_TRUE(WaitForStatus("enc", 2, 0));
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // a few more ticks
  EXPECT_EQ(Pids(), scaled);
  EXPECT_TRUE(Infer().ok());
}

// Scale 1 -> 3 from a warm pool of 2 across two nodes: both WARM replicas are promoted in
// place (the same processes serve), and requests succeed right after.
TEST_F(ClusterTest, ScalesOneToThreeFromTheWarmPool) {
  Agent n2 = StartTwoNodes();
  ASSERT_FALSE(HasFailure());
  std::string out = ApplySpec("enc", "encoder", "  replicas: 1\n  warmPool: 2\n");
  ASSERT_EQ(last_rc_, 0) << out;
  ASSERT_TRUE(WaitForStatus("enc", 1, 2));
  auto all_pids = [&]() { return Pids(0, n2.admin); };
  const auto before = all_pids();
  ASSERT_EQ(before.size(), 3u);
  out = Ctl("scale enc --replicas 3");
  ASSERT_EQ(last_rc_, 0) << out;
  bool ready = false;
  for (int i = 0; i < 1200 && !ready; ++i) {  // bounded poll
    ready = Deployment("enc")["status"].value("readyReplicas", 0) == 3;
    if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_TRUE(ready) << Deployment("enc").dump() << ReadFile(clog_);
  const auto after = all_pids();
  for (const auto& [id, pid] : before) {
    ASSERT_TRUE(after.count(id)) << id << " is gone";
    EXPECT_EQ(after.at(id), pid) << id << " was restarted, not promoted";
  }
  for (int i = 0; i < 6; ++i) {
    grpc::Status st = Infer(i % 2 ? n2.router_grpc : 0);
    EXPECT_TRUE(st.ok()) << st.error_message();
  }
}

// The controller killed and restarted while two nodes serve steady traffic: no request
// fails, no replica is restarted or moved, and the new controller takes the nodes back.
TEST_F(ClusterTest, AControllerKilledUnderLoadCostsNoRequestAndNoReplica) {
  Agent n2 = StartTwoNodes();
  ASSERT_FALSE(HasFailure());
  std::string out = ApplySpec("enc", "encoder", "  replicas: 2\n");
  ASSERT_EQ(last_rc_, 0) << out;
  ASSERT_TRUE(WaitForStatus("enc", 2, 0));
  WaitForReplicasOnBothNodes(2, n2.admin);
  auto all_pids = [&]() { return Pids(0, n2.admin); };
  const auto before = all_pids();
  ASSERT_EQ(before.size(), 2u);
  Traffic on_n1(this, router_grpc_), on_n2(this, n2.router_grpc);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int control = control_;
  Kill(&controller_, SIGKILL);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // nodes serve on alone
  // Observing longer than the agents' reconnect backoff takes (1 s, then 2 s: this VM may
  // miss the first), as the defaults do (10 s against at most 5 s): a node that is only
  // reconnecting is heard before anything is placed.
  StartController("127.0.0.1:" + std::to_string(control), {"--observe-seconds", "4"});
  // Both nodes re-register and the new controller, having observed, assigns them again.
  bool back = false;
  for (int i = 0; i < 1200 && !back; ++i) {  // bounded poll
    auto [code, text] = Http("GET", admin_, "/apis/serving.kiln.dev/v1alpha1/nodes");
    json j = json::parse(text, nullptr, false);
    int ready = 0;
    if (code == 200 && !j.is_discarded()) {
      for (const auto& n : j["items"]) ready += n.value("health", "") == "Ready";
    }
    back = ready == 2 && Deployment("enc")["status"].value("readyReplicas", 0) == 2 &&
           ReadFile(clog_).find("assignment generation") != std::string::npos;
    if (!back) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_TRUE(back) << ReadFile(clog_);
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // a few more passes
  on_n1.Stop();
  on_n2.Stop();
  EXPECT_EQ(on_n1.failed.load(), 0) << on_n1.first_error;
  EXPECT_EQ(on_n2.failed.load(), 0) << on_n2.first_error;
  EXPECT_GT(on_n1.ok.load() + on_n2.ok.load(), 100);
  EXPECT_EQ(all_pids(), before) << "a replica was restarted or moved";
}

// Two nodes; one is killed outright (agent and its runtime): after the NotReady and Lost
// graces its replica is placed again on the other node, under a new id, and serving goes on.
TEST_F(ClusterTest, ALostNodesReplicasComeBackElsewhere) {
  StartController("127.0.0.1:0", {"--node-not-ready-seconds", "2", "--node-lost-seconds", "3"});
  StartAgent();
  Agent n2 = StartAnotherAgent("n2");
  ASSERT_GT(n2.router_grpc, 0) << ReadFile(n2.log);
  std::string out = ApplySpec("enc", "encoder", "  replicas: 2\n");
  ASSERT_EQ(last_rc_, 0) << out;
  ASSERT_TRUE(WaitForStatus("enc", 2, 0));
  auto on_n1 = Pids();
  auto on_n2 = Pids(n2.admin);
  ASSERT_EQ(on_n1.size(), 1u);  // spread: one per node
  ASSERT_EQ(on_n2.size(), 1u);
  EXPECT_TRUE(Infer().ok());
  EXPECT_TRUE(Infer(n2.router_grpc).ok());

  // n2 dies with its replica.
  kill(n2.pid, SIGKILL);
  waitpid(n2.pid, nullptr, 0);
  for (const auto& [id, pid] : on_n2) kill(pid, SIGKILL);
  // NotReady after 2 s of silence (agents report every second), Lost after 3 s: then n1
  // runs both.
  for (int i = 0; i < 1200 && Pids().size() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  auto after = Pids();
  ASSERT_EQ(after.size(), 2u) << ReadFile(clog_);
  EXPECT_EQ(after.count(on_n2.begin()->first), 0u) << "a lost node's id was reused";
  ASSERT_TRUE(WaitForStatus("enc", 2, 0));
  EXPECT_TRUE(Infer().ok());
  out = Ctl("get nodes");
  EXPECT_NE(out.find("Lost"), std::string::npos) << out;
}

// Two machines: n2 runs in a network namespace of its own, joined to the controller's by a
// veth pair. Its link is cut under steady traffic at n1: its stream stays open but silent, as
// a dead switch port leaves it. n2 goes NotReady, then Lost, and its replica comes back on n1
// under a new id while n1 (whose router prefers its own replica) serves every request. When the link is mended, n2 is Ready again
// with the replica it kept, and the deployment is spread again: one replica serving on each
// node (the one n1 no longer needs stays WARM for the scale-down window).
TEST_F(ClusterTest, ANodeCutOffTheNetworkIsLostAndItsReplicaComesBackElsewhere) {
  if (!VethNamespace::Possible()) GTEST_SKIP() << "needs root and ip netns";
  VethNamespace ns;
  // Root without the capabilities (a container's root, say) cannot make one either.
  if (!ns.error().empty()) GTEST_SKIP() << ns.error();
  StartController(ns.here() + ":0", {"--node-not-ready-seconds", "2", "--node-lost-seconds", "3"});
  ASSERT_GT(control_, 0) << ReadFile(clog_);
  StartAgent();
  Agent n2 = StartAnotherAgent("n2", {}, ns.path(), ns.there());
  ASSERT_GT(n2.router_grpc, 0) << ReadFile(n2.log);
  std::string out = ApplySpec("enc", "encoder", "  replicas: 2\n");
  ASSERT_EQ(last_rc_, 0) << out;
  ASSERT_TRUE(WaitForStatus("enc", 2, 0));
  // Replica ids by node, SERVING ones only, as the controller lists them.
  auto serving_on = [&](const std::string& node) {
    std::set<std::string> ids;
    const json list = json::parse(Ctl("get replicas enc -o json"), nullptr, false);
    if (!list.is_object()) return ids;
    for (const auto& r : list.value("items", json::array())) {
      if (r.value("node", "") == node && r.value("state", "") == "SERVING") {
        ids.insert(r.value("id", ""));
      }
    }
    return ids;
  };
  const std::set<std::string> on_n2 = serving_on("n2");
  ASSERT_EQ(on_n2.size(), 1u) << Ctl("get replicas enc -o wide");  // spread: one per node
  ASSERT_EQ(serving_on("n1").size(), 1u);
  auto node_health = [&](const std::string& node) {
    const json list = json::parse(Ctl("get nodes -o json"), nullptr, false);
    if (list.is_object()) {
      for (const auto& n : list.value("items", json::array())) {
        if (n.value("name", "") == node) return n.value("health", std::string());
      }
    }
    return std::string();
  };
  ASSERT_EQ(node_health("n2"), "Ready");

  Traffic traffic(this, router_grpc_);
  ASSERT_TRUE(ns.SetLink(false));
  std::string health;
  for (int i = 0; i < 600 && (health = node_health("n2")) != "Lost"; ++i) {  // bounded
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_EQ(health, "Lost") << ReadFile(clog_);
  std::set<std::string> on_n1;
  for (int i = 0; i < 1200 && (on_n1 = serving_on("n1")).size() < 2; ++i) {  // bounded
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_EQ(on_n1.size(), 2u) << Ctl("get replicas enc -o wide") << ReadFile(clog_);
  EXPECT_EQ(on_n1.count(*on_n2.begin()), 0u) << "a lost node's id was reused";
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // traffic on the two
  traffic.Stop();
  EXPECT_EQ(traffic.failed.load(), 0) << traffic.first_error;
  EXPECT_GT(traffic.ok.load(), 20);
  EXPECT_NE(ReadFile(clog_).find("node n2 lost: its replicas were placed again"),
            std::string::npos)
      << ReadFile(clog_);

  // The link comes back: n2 reports again, with the replica it kept.
  ASSERT_TRUE(ns.SetLink(true));
  for (int i = 0; i < 1200 && (health = node_health("n2")) != "Ready"; ++i) {  // bounded
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_EQ(health, "Ready") << ReadFile(clog_) << ReadFile(n2.log);
  std::set<std::string> now_n1, now_n2;
  for (int i = 0; i < 400; ++i) {  // bounded: until one serves on each node
    now_n1 = serving_on("n1");
    now_n2 = serving_on("n2");
    if (now_n1.size() == 1 && now_n2.size() == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_EQ(now_n1.size(), 1u) << Ctl("get replicas enc -o wide");
  EXPECT_EQ(now_n2, on_n2) << Ctl("get replicas enc -o wide");  // the one it kept
  EXPECT_TRUE(now_n1.count(*on_n2.begin()) == 0);
  EXPECT_TRUE(WaitForStatus("enc", 2, 0));
}

// A router that forwards to another node whose agent hangs mid-call (stopped: its connections
// stay open, nothing answers) fails the call UNAVAILABLE once its keepalive pings go
// unanswered, instead of holding it until the caller's deadline (a minute here).
TEST_F(ClusterTest, AForwardToAHungNodeFailsInsteadOfWaitingOutItsDeadline) {
  Agent n2 = StartTwoNodes();
  ASSERT_FALSE(HasFailure());
  std::string out = ApplySpec("enc", "encoder", "  replicas: 1\n");
  ASSERT_EQ(last_rc_, 0) << out;
  ASSERT_TRUE(WaitForStatus("enc", 1, 0));
  // The node without the replica forwards to the one with it.
  const bool on_n1 = Pids().size() == 1;
  const pid_t holder = on_n1 ? agent_ : n2.pid;
  const int forwarder = on_n1 ? n2.router_grpc : router_grpc_;
  grpc::Status st;
  for (int i = 0; i < 400 && !(st = Infer(forwarder)).ok(); ++i) {  // bounded: its table comes
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(kill(holder, SIGSTOP), 0);
  auto stub = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(forwarder), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  inference::ModelInferResponse resp;
  st = stub->ModelInfer(&ctx, kiln::testing::EncoderRequest(1), &resp);
  kill(holder, SIGCONT);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  // The hung node comes back: requests through the forwarder succeed again.
  for (int i = 0; i < 800 && !(st = Infer(forwarder)).ok(); ++i) {  // bounded
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_TRUE(st.ok()) << st.error_message();
}

// Mutual TLS between the real binaries: the agent whose certificate names it registers; one
// holding another node's certificate, or none, does not, and its log says why.
TEST_F(ClusterTest, AgentsAndTheControllerSpeakMutualTls) {
  kiln::testing::TestCa ca(dir_, "kiln-ca");
  auto server = ca.Issue("controller", "kiln-controller", {"DNS:localhost", "IP:127.0.0.1"});
  auto cert_a = ca.Issue("tls-a", "tls-a", {"DNS:tls-a"});
  ASSERT_TRUE(ca.ok()) << ca.error();
  StartController("127.0.0.1:0", {"--tls-cert", server.cert, "--tls-key", server.key,
                                  "--tls-client-ca", ca.ca()});
  EXPECT_NE(ReadFile(clog_).find("tls=mutual"), std::string::npos) << ReadFile(clog_);
  auto with = [&](const kiln::testing::CertFiles& c) {
    return std::vector<std::string>{"--controller-ca", ca.ca(), "--controller-cert", c.cert,
                                    "--controller-key", c.key};
  };
  Agent a = StartAnotherAgent("tls-a", with(cert_a));
  Agent b = StartAnotherAgent("tls-b", with(cert_a));  // tls-a's certificate
  Agent plain = StartAnotherAgent("plain");
  std::string out;
  for (int i = 0; i < 400; ++i) {
    out = Ctl("get nodes");
    if (out.find("tls-a") != std::string::npos &&
        ReadFile(b.log).find("PERMISSION_DENIED") != std::string::npos &&
        ReadFile(plain.log).find("UNAVAILABLE") != std::string::npos) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_NE(out.find("tls-a"), std::string::npos) << out << ReadFile(a.log);
  EXPECT_EQ(out.find("tls-b"), std::string::npos) << out;
  EXPECT_EQ(out.find("plain"), std::string::npos) << out;
  std::string b_log = ReadFile(b.log);
  EXPECT_NE(b_log.find("register.node_name: 'tls-b'"), std::string::npos) << b_log;
  // The plaintext agent was turned away at the handshake, not registered.
  EXPECT_NE(ReadFile(plain.log).find("UNAVAILABLE"), std::string::npos) << ReadFile(plain.log);
  for (Agent* x : {&a, &b, &plain}) Kill(&x->pid, SIGTERM);
}

// A GPU fails under traffic: its replica keeps serving until a replacement on a healthy GPU
// does, then leaves; no request fails.
TEST_F(ClusterTest, AReplicaLeavesAFailedGpuWithoutAFailedRequest) {
  StartController("127.0.0.1:0");
  Agent g = StartAnotherAgent("g1", {"--fake-gpus", "2:16Gi"});
  ASSERT_GT(g.router_grpc, 0) << ReadFile(g.log);
  std::string out =
      ApplySpec("emb", "encoder", "  replicas: 1\n  resources: {gpus: 1, gpuMemory: 2Gi, cpus: 1}\n");
  ASSERT_EQ(last_rc_, 0) << out;
  alog_ = g.log;
  ASSERT_TRUE(WaitForStatus("emb", 1, 0));
  auto replicas = [&]() {
    auto [code, text] = Http("GET", g.admin, "/v1/replicas");
    json j = json::parse(text, nullptr, false);
    return code == 200 && !j.is_discarded() ? j["replicas"] : json::array();
  };
  json before = replicas();
  ASSERT_EQ(before.size(), 1u) << before.dump();
  const std::string old_id = before[0]["id"];
  const int bad_gpu = before[0]["gpu"];

  Traffic traffic(this, g.router_grpc);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto [code, text] = Http("POST", g.admin, "/v1/fake-gpus/" + std::to_string(bad_gpu) + "/xid/79");
  EXPECT_EQ(code, 200) << text;
  // The replacement comes up on the other GPU and the old replica goes (bounded poll, 30 s).
  bool moved = false;
  for (int i = 0; i < 1200 && !moved; ++i) {
    json now = replicas();
    moved = now.size() == 1 && now[0]["id"] != old_id && now[0]["gpu"] != bad_gpu &&
            now[0]["state"] == "SERVING";
    if (!moved) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  traffic.Stop();
  EXPECT_TRUE(moved) << replicas().dump() << ReadFile(clog_);
  EXPECT_GT(traffic.ok.load(), 20);
  EXPECT_EQ(traffic.failed.load(), 0) << traffic.first_error;
  EXPECT_NE(ReadFile(clog_).find("rebalancing: emb: " + old_id + " on g1 GPU " +
                                 std::to_string(bad_gpu) + " (unhealthy)"),
            std::string::npos)
      << ReadFile(clog_);
  // The endpoint is only for fake GPUs and checks its input.
  EXPECT_EQ(Http("POST", g.admin, "/v1/fake-gpus/7/xid/79").first, 404);
  EXPECT_EQ(Http("POST", g.admin, "/v1/fake-gpus/x/xid/79").first, 400);
  Kill(&g.pid, SIGTERM);
}

TEST_F(ClusterTest, AWarmReplicaMakesRoomOnAFullGpuForAServingOne) {
  StartController("127.0.0.1:0");
  Agent g = StartAnotherAgent("g1", {"--fake-gpus", "1:16Gi"});
  ASSERT_GT(g.router_grpc, 0) << ReadFile(g.log);
  alog_ = g.log;
  // cold: a warm pool of one 12 GiB replica on the one 16 GiB GPU (and one of the node's two
  // CPUs; an eviction frees GPU memory only, so the newcomer needs the other CPU free).
  std::string out = ApplySpec("cold", "encoder",
                              "  replicas: 0\n  warmPool: 1\n"
                              "  resources: {gpus: 1, gpuMemory: 12Gi, cpus: 1}\n");
  ASSERT_EQ(last_rc_, 0) << out;
  ASSERT_TRUE(WaitForStatus("cold", 0, 1));
  // hot needs 6 GiB where 4 are free: cold's WARM replica gives way. (Another model: a node's
  // routes are per model name.)
  out = ApplySpec("hot", "slow", "  replicas: 1\n  resources: {gpus: 1, gpuMemory: 6Gi, cpus: 1}\n");
  ASSERT_EQ(last_rc_, 0) << out;
  ASSERT_TRUE(WaitForStatus("hot", 1, 0));
  ASSERT_TRUE(WaitForStatus("cold", 0, 0));
  const std::string log = ReadFile(clog_);
  EXPECT_NE(log.find("evicted: cold."), std::string::npos) << log;
  EXPECT_NE(log.find("makes room for a SERVING replica of hot"), std::string::npos) << log;
  EXPECT_NE(log.find("unplaced: cold: 1 of 1 replicas have no node with room"), std::string::npos)
      << log;
  // The node ends up running just hot's SERVING replica (bounded poll: the evicted one drains
  // first), and cold says its pool is short.
  std::vector<std::string> states;
  std::string text;
  for (int i = 0; i < 1200; ++i) {
    auto [code, body] = Http("GET", g.admin, "/v1/replicas");
    text = body;
    json j = json::parse(body, nullptr, false);
    states.clear();
    if (code == 200 && !j.is_discarded()) {
      for (const auto& r : j["replicas"]) states.push_back(r["state"].get<std::string>());
    }
    if (states == std::vector<std::string>{"SERVING"}) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_EQ(states, (std::vector<std::string>{"SERVING"})) << text;
  Kill(&g.pid, SIGTERM);
}

TEST_F(ClusterTest, ADeploymentPiledOnOneNodeSpreadsWhenAnotherJoins) {
  StartController("127.0.0.1:0", {"--rebalance-after-seconds", "0.5"});
  Agent a = StartAnotherAgent("a1");
  ASSERT_GT(a.router_grpc, 0) << ReadFile(a.log);
  std::string out = ApplySpec("enc", "encoder", "  replicas: 2\n  resources: {cpus: 1}\n");
  ASSERT_EQ(last_rc_, 0) << out;
  alog_ = a.log;
  ASSERT_TRUE(WaitForStatus("enc", 2, 0));
  ASSERT_EQ(Pids(a.admin).size(), 2u);

  Traffic traffic(this, a.router_grpc);
  // A second node joins: after the skew lasted half a second one replica moves there, its
  // replacement serving before the old one drains (bounded poll, 30 s).
  Agent b = StartAnotherAgent("a2");
  bool spread = false;
  for (int i = 0; i < 1200 && !spread; ++i) {
    spread = Pids(a.admin).size() == 1 && Pids(b.admin).size() == 1 &&
             Deployment("enc")["status"].value("readyReplicas", 0) == 2;
    if (!spread) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  traffic.Stop();
  EXPECT_TRUE(spread) << ReadFile(clog_);
  EXPECT_GT(traffic.ok.load(), 20);
  EXPECT_EQ(traffic.failed.load(), 0) << traffic.first_error;
  // The controller calls the move done once a1 no longer reports the old replica (its next
  // status): a bounded poll.
  for (int i = 0; i < 400 && ReadFile(clog_).find("rebalancing: enc.1 moved") == std::string::npos;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  const std::string log = ReadFile(clog_);
  EXPECT_NE(log.find("(spread: a1 runs 2 of enc, a2 0) serves until its replacement does"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("rebalancing: enc.1 moved"), std::string::npos) << log;
  // Even now (1 and 1): nothing else moves.
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  EXPECT_EQ(Pids(a.admin).size(), 1u) << Http("GET", a.admin, "/v1/replicas").second << ReadFile(clog_);
  EXPECT_EQ(Pids(b.admin).size(), 1u) << Http("GET", b.admin, "/v1/replicas").second;
  Kill(&b.pid, SIGTERM);
  Kill(&a.pid, SIGTERM);
}

// Zones come from the agents' --label flags: of three nodes, two in zone a and one in zone
// b, a deployment of two replicas puts one in each zone (by name alone both would go to zone
// a's nodes). `kilnctl get nodes -o wide` shows each node's zone; a bad label stops the agent
// with the reason.
TEST_F(ClusterTest, ReplicasSpreadAcrossTheZonesTheAgentsReport) {
  StartController("127.0.0.1:0");
  Agent a1 = StartAnotherAgent("a1", {"--label", "topology.kubernetes.io/zone=a"});
  Agent a2 = StartAnotherAgent("a2", {"--label", "topology.kubernetes.io/zone=a"});
  Agent b1 = StartAnotherAgent("b1", {"--label", "topology.kubernetes.io/zone=b", "--label",
                                      "rack=r7"});
  for (const Agent* a : {&a1, &a2, &b1}) ASSERT_GT(a->admin, 0) << ReadFile(a->log);
  bool registered = false;
  for (int i = 0; i < 800 && !registered; ++i) {  // bounded: all three registered
    auto [code, text] = Http("GET", admin_, "/apis/serving.kiln.dev/v1alpha1/nodes");
    json j = json::parse(text, nullptr, false);
    registered = code == 200 && !j.is_discarded() && j["items"].size() == 3;
    if (!registered) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_TRUE(registered) << ReadFile(clog_);
  std::string out = ApplySpec("enc", "encoder", "  replicas: 2\n");
  ASSERT_EQ(last_rc_, 0) << out;
  ASSERT_TRUE(WaitForStatus("enc", 2, 0));
  const size_t in_a = Pids(a1.admin).size() + Pids(a2.admin).size();
  const size_t in_b = Pids(b1.admin).size();
  EXPECT_EQ(in_a, 1u);
  EXPECT_EQ(in_b, 1u);
  out = Ctl("get nodes -o wide");
  EXPECT_EQ(last_rc_, 0) << out;
  EXPECT_NE(out.find("ZONE"), std::string::npos) << out;
  std::istringstream lines(out);
  std::string line;
  int zone_a = 0, zone_b = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("a", 0) == 0 && line.find(" a ") != std::string::npos) zone_a++;
    if (line.rfind("b1", 0) == 0 && line.find(" b ") != std::string::npos) zone_b++;
  }
  EXPECT_EQ(zone_a, 2) << out;
  EXPECT_EQ(zone_b, 1) << out;
  auto [code, text] = Http("GET", admin_, "/apis/serving.kiln.dev/v1alpha1/nodes");
  json nodes = json::parse(text, nullptr, false);
  ASSERT_FALSE(nodes.is_discarded()) << text;
  for (const auto& n : nodes["items"]) {
    if (n.value("name", "") == "b1") {
      EXPECT_EQ(n["labels"].value("rack", ""), "r7") << n.dump();
    }
  }
  // A label that is not one: the agent does not start, and says why.
  kiln::testing::ShellResult bad = kiln::testing::Shell(
      std::string(KILN_AGENT_BIN) + " --controller 127.0.0.1:1 --state-dir " + dir_ +
      "/agent-bad --runtime-binary " + KILN_RUNTIME_BIN + " --label 'zone=not ok'");
  EXPECT_EQ(bad.rc, 2) << bad.out;
  EXPECT_NE(bad.out.find("--label 'zone=not ok': the value must be"), std::string::npos)
      << bad.out;
}

TEST_F(ClusterTest, TlsFlagsAreCheckedAtStartup) {
  kiln::testing::TestCa ca(dir_, "kiln-ca");
  auto server = ca.Issue("controller", "kiln-controller", {"IP:127.0.0.1"});
  ASSERT_TRUE(ca.ok()) << ca.error();
  using kiln::testing::Shell;
  std::string ctl = std::string(KILN_CONTROLLER_BIN) + " --state-dir " + dir_ + "/s --listen 127.0.0.1:0 ";
  auto r = Shell(ctl + "--tls-cert " + server.cert);
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--tls-key: required with --tls-cert"), std::string::npos) << r.out;
  r = Shell(ctl + "--tls-cert " + server.cert + " --tls-key " + server.key + " --tls-client-ca " +
            dir_ + "/none.pem");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--tls-client-ca: " + dir_ + "/none.pem: cannot be read"), std::string::npos)
      << r.out;
  std::string agent = std::string(KILN_AGENT_BIN) + " --runtime-binary " + KILN_RUNTIME_BIN +
                      " --state-dir " + dir_ + "/a --admin-port 0 ";
  r = Shell(agent + "--controller 127.0.0.1:1 --controller-ca " + server.key);
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("--controller-ca: " + server.key + ": no PEM CERTIFICATE"), std::string::npos)
      << r.out;
  r = Shell(agent + "--assignment-file " + dir_ + "/x.yaml --controller-ca " + ca.ca());
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("--controller-ca: only with --controller"), std::string::npos) << r.out;
}

// A canary under steady traffic: version 2 is pre-warmed beside version 1, takes 50% after its
// replica serves, passes the analysis and is promoted; version 1 is drained. No request fails.
TEST_F(ClusterTest, AGoodCanaryIsPromotedWithoutAFailedRequest) {
  Agent n2 = StartRolloutCluster(
      "  rollout:\n    steps: [{weight: 50, pause: 1s}]\n"
      "    analysis: {minRequests: 20, maxErrorRate: 0.01, maxLatencyP99Ratio: 100}\n",
      "v2", "2", KILN_MODEL_REPO, {"--status-counters-seconds", "0"});
  ASSERT_FALSE(HasFailure());
  std::string out;

  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, failed{0}, served_by_2{0};
  std::string first_error;
  std::mutex mu;
  std::thread traffic([&]() {
    while (!stop) {
      std::string version;
      grpc::Status s = Infer(0, &version);
      if (s.ok()) {
        ok++;
        if (version == "2") served_by_2++;
      } else {
        failed++;
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.empty()) first_error = s.error_message();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  out = Ctl("apply -f " + dir_ + "/v2.yaml");
  EXPECT_EQ(last_rc_, 0) << out;
  // An operator follows it live.
  const std::string watch_log = dir_ + "/watch.log";
  pid_t watch = SpawnLogged({KILNCTL_BIN, "--server", "http://127.0.0.1:" + std::to_string(admin_),
                             "rollout", "status", "enc", "-w", "--timeout-seconds", "60"},
                            watch_log);
  // Bounded poll until version 2 is stable.
  json d;
  for (int i = 0; i < 1600; ++i) {
    d = Deployment("enc");
    if (d.contains("status") && d["status"].contains("rollout") &&
        d["status"]["rollout"].value("stableVersion", "") == "2") {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_EQ(d["status"]["rollout"].value("stableVersion", ""), "2")
      << d.dump() << "\n" << ReadFile(clog_);
  // Version 1 drains away; traffic goes on.
  WaitForReplicasOnBothNodes(2, n2.admin);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  stop = true;
  traffic.join();
  EXPECT_EQ(failed.load(), 0) << first_error;
  EXPECT_GT(ok.load(), 20);
  EXPECT_GT(served_by_2.load(), 0);
  // The old stable set is gone: only version 2's two replicas are left.
  std::multiset<std::string> versions;
  for (int i = 0; i < 400; ++i) {  // bounded: the nodes report the drained ones gone
    versions = ReplicaVersions("enc");
    if (versions == std::multiset<std::string>{"2", "2"}) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_EQ(versions, (std::multiset<std::string>{"2", "2"}));
  out = Ctl("rollout status enc -w --timeout-seconds 30");
  EXPECT_EQ(last_rc_, 0) << out;
  EXPECT_NE(out.find("deployment \"enc\" serves version 2"), std::string::npos) << out;
  EXPECT_NE(out.find("  version 2: weight 100%, "), std::string::npos) << out;
  // The live watch saw the step, its weight and the analysis' numbers, then the end (it exits
  // by itself: bounded by its own --timeout-seconds).
  int watch_status = 0;
  ASSERT_EQ(waitpid(watch, &watch_status, 0), watch);
  const std::string watched = ReadFile(watch_log);
  EXPECT_TRUE(WIFEXITED(watch_status) && WEXITSTATUS(watch_status) == 0) << watched;
  EXPECT_NE(watched.find("Progressing: canary 2 step 1/1 at 50%: "), std::string::npos) << watched;
  EXPECT_NE(watched.find(" requests, error rate "), std::string::npos) << watched;
  EXPECT_NE(watched.find("  version 2: weight 50%, "), std::string::npos) << watched;
  EXPECT_NE(watched.find("deployment \"enc\" serves version 2"), std::string::npos) << watched;
  // Per-version numbers in status: version 2 took the traffic after the switch.
  json v2;
  const json now = Deployment("enc");
  for (const auto& v : now["status"]["versions"]) {
    if (v.value("version", "") == "2") v2 = v;
  }
  ASSERT_TRUE(v2.is_object()) << now.dump();
  EXPECT_EQ(v2.value("weight", -1), 100);
  EXPECT_GT(v2.value("requests", 0), 0) << v2.dump();
  EXPECT_EQ(v2.value("errors", -1), 0) << v2.dump();
  EXPECT_GT(v2.value("latencyP99Ms", 0.0), 0.0) << v2.dump();
  std::string log = ReadFile(clog_);
  EXPECT_NE(log.find("rollout enc: canary 2 step 1/1: weight 50%"), std::string::npos) << log;
  EXPECT_NE(log.find("rollout enc: canary 2 promoted"), std::string::npos) << log;
}

// An A/B test run by the controller: 30% of distinct users (a sticky header) reach version 2,
// within 2 points over 2,000 users, and each user stays on the version it first saw.
TEST_F(ClusterTest, AnAbTestSplitsUsersByItsWeightAndKeepsThemThere) {
  Agent n2 = StartRolloutCluster(
      "  rollout:\n    strategy: ABTest\n    steps: [{weight: 30}]\n"
      "    stickyKey: header:x-user-id\n",
      "v2", "2", KILN_MODEL_REPO, {"--status-counters-seconds", "0"});
  ASSERT_FALSE(HasFailure());
  ASSERT_EQ((Ctl("apply -f " + dir_ + "/v2.yaml"), last_rc_), 0);
  json d;
  for (int i = 0; i < 1200; ++i) {  // bounded: version 2 serves and takes its 30%
    d = Deployment("enc");
    if (d["status"].value("rollout", json::object()).value("canaryWeight", 0) == 30) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_EQ(d["status"]["rollout"].value("canaryWeight", 0), 30) << d.dump();
  // The routing table reaches the node a moment after the status says so: bounded poll until
  // the router sends some user to version 2.
  auto stub = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(router_grpc_), grpc::InsecureChannelCredentials()));
  auto version_for = [&](const std::string& user) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    ctx.AddMetadata("x-user-id", user);
    inference::ModelInferResponse resp;
    grpc::Status st = stub->ModelInfer(&ctx, kiln::testing::EncoderRequest(1), &resp);
    return st.ok() ? resp.model_version() : "error: " + st.error_message();
  };
  bool split = false;
  for (int i = 0; i < 400 && !split; ++i) {
    for (int u = 0; u < 20 && !split; ++u) split = version_for("probe-" + std::to_string(u)) == "2";
    if (!split) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_TRUE(split) << ReadFile(clog_);
  constexpr int kUsers = 2000;
  std::vector<std::string> first(kUsers);
  int on_2 = 0;
  for (int u = 0; u < kUsers; ++u) {
    first[u] = version_for("user-" + std::to_string(u));
    ASSERT_TRUE(first[u] == "1" || first[u] == "2") << first[u];
    on_2 += first[u] == "2";
  }
  const double share = static_cast<double>(on_2) / kUsers;
  EXPECT_NEAR(share, 0.30, 0.02) << on_2 << " of " << kUsers << " users on version 2";
  // Sticky: every user again, in another order, sees the same version.
  for (int u = kUsers - 1; u >= 0; u -= 7) {
    EXPECT_EQ(version_for("user-" + std::to_string(u)), first[u]) << "user-" << u;
  }
  // An A/B test is never ended by itself: still running, both versions served.
  EXPECT_EQ(Deployment("enc")["status"]["rollout"].value("phase", ""), "Progressing");
  // Each version's numbers in the status: both took requests (bounded poll: the nodes report
  // every second).
  auto requests_of = [](const json& dep, const std::string& version) {
    for (const auto& v : dep["status"].value("versions", json::array())) {
      if (v.value("version", "") == version) return v.value("requests", int64_t{0});
    }
    return int64_t{0};
  };
  for (int i = 0; i < 400; ++i) {
    d = Deployment("enc");
    if (requests_of(d, "1") > 0 && requests_of(d, "2") > 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_GT(requests_of(d, "1"), 0) << d["status"].dump();
  EXPECT_GT(requests_of(d, "2"), 0) << d["status"].dump();
  // Ended by hand: promote makes version 2 the stable one, and version 1 drains away.
  std::string out = Ctl("rollout promote enc");
  EXPECT_EQ(last_rc_, 0) << out;
  out = Ctl("rollout status enc -w --timeout-seconds 60");
  EXPECT_EQ(last_rc_, 0) << out;
  EXPECT_NE(out.find("serves version 2"), std::string::npos) << out;
  std::multiset<std::string> versions;
  for (int i = 0; i < 400; ++i) {  // bounded
    versions = ReplicaVersions("enc");
    if (versions == std::multiset<std::string>{"2", "2"}) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_EQ(versions, (std::multiset<std::string>{"2", "2"}));
  EXPECT_EQ(version_for("user-1"), "2");
}

// Autoscaling from the in-flight requests the replicas report: three clients keeping slow
// requests in flight against a target of one per replica scale 1 -> 2 (the max); when the load
// stops, it scales back to 1 after the stabilisation window (2 s here).
TEST_F(ClusterTest, AutoscalesOnRequestsInFlight) {
  StartController("127.0.0.1:0", {"--scale-down-stabilization-seconds", "2"});
  StartAgent();
  std::string out = ApplySpec("slow", "slow", "  autoscale: {min: 1, max: 2, targetInFlight: 1}\n");
  ASSERT_EQ(last_rc_, 0) << out;
  ASSERT_TRUE(WaitForStatus("slow", 1, 0));
  auto slow_request = [this]() {
    auto stub = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(router_grpc_), grpc::InsecureChannelCredentials()));
    inference::ModelInferRequest req = kiln::testing::SlowRequest(2000);  // about a third of a second
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    inference::ModelInferResponse resp;
    return stub->ModelInfer(&ctx, req, &resp);
  };
  std::atomic<bool> stop{false};
  std::atomic<int> failed{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 3; ++c) {
    clients.emplace_back([&]() {
      while (!stop) {
        if (!slow_request().ok()) failed++;
      }
    });
  }
  bool scaled_up = false;
  for (int i = 0; i < 1200 && !scaled_up; ++i) {
    json d = Deployment("slow");
    scaled_up = d["status"].value("desiredReplicas", 0) == 2 &&
                d["status"].value("readyReplicas", 0) == 2;
    if (!scaled_up) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  stop = true;
  for (auto& t : clients) t.join();
  ASSERT_TRUE(scaled_up) << Deployment("slow").dump() << ReadFile(clog_);
  EXPECT_NE(ReadFile(clog_).find("autoscale slow: 1 -> 2 replicas"), std::string::npos);
  // Idle now: back to the minimum once the window has passed.
  bool scaled_down = false;
  for (int i = 0; i < 1200 && !scaled_down; ++i) {
    scaled_down = Deployment("slow")["status"].value("desiredReplicas", 0) == 1;
    if (!scaled_down) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_TRUE(scaled_down) << Deployment("slow").dump() << ReadFile(clog_);
  EXPECT_EQ(failed.load(), 0);
}

// By hand: a rollout whose step waits for a resume is promoted with `kilnctl rollout promote`;
// actions on a deployment without a rollout say so.
TEST_F(ClusterTest, ARolloutIsPromotedByHand) {
  Agent n2 = StartRolloutCluster("  rollout:\n    steps: [{weight: 50, pause: {}}]\n");
  ASSERT_FALSE(HasFailure());
  std::string out = Ctl("rollout promote enc");
  EXPECT_EQ(last_rc_, 1) << out;
  EXPECT_NE(out.find("no rollout in progress"), std::string::npos) << out;
  ASSERT_EQ((Ctl("apply -f " + dir_ + "/v2.yaml"), last_rc_), 0);
  json d;
  for (int i = 0; i < 1200; ++i) {  // bounded: the canary serves and takes its 50%
    d = Deployment("enc");
    if (d["status"].value("rollout", json::object()).value("canaryWeight", 0) == 50) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_EQ(d["status"]["rollout"].value("canaryWeight", 0), 50) << d.dump();
  out = Ctl("rollout promote enc");
  EXPECT_EQ(last_rc_, 0) << out;
  out = Ctl("rollout status enc -w --timeout-seconds 30");
  EXPECT_EQ(last_rc_, 0) << out;
  EXPECT_NE(out.find("serves version 2"), std::string::npos) << out;
  // One canary replica of two served at 50%: the second comes up before version 1 drains.
  std::string log = ReadFile(clog_);
  const size_t promoting = log.find("rollout enc: canary 2 promoting (by hand)");
  const size_t promoted = log.find("rollout enc: canary 2 promoted: all 2 replica(s) serve");
  EXPECT_NE(promoting, std::string::npos) << log;
  EXPECT_NE(promoted, std::string::npos) << log;
  EXPECT_LT(promoting, promoted);
}

// A bad canary under steady traffic: version 3 fails every request holding token 13 (a third
// of the traffic). As soon as the analysis has its minimum of requests the rollout is rolled
// back (weight 0, canary drained, Degraded); no request that version 1 served failed, and
// after the rollback nothing fails at all.
TEST_F(ClusterTest, ABadCanaryIsRolledBackByItself) {
  Agent n2 = StartRolloutCluster(
      "  rollout:\n    steps: [{weight: 50, pause: 1m}]\n"
      "    analysis: {minRequests: 15, maxErrorRate: 0.05, maxLatencyP99Ratio: 100}\n",
      "v3", "3", std::string(KILN_MODEL_REPO) + "-faulty");
  ASSERT_FALSE(HasFailure());
  std::string out;

  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, canary_failed{0}, other_failed{0};
  std::string other_error;
  std::mutex mu;
  std::thread traffic([&]() {
    for (int i = 0; !stop; ++i) {
      grpc::Status s = Infer(0, nullptr, i % 3 == 0 ? 13 : 1);
      if (s.ok()) {
        ok++;
      } else if (s.error_message().find("faulty release") != std::string::npos) {
        canary_failed++;
      } else {
        other_failed++;
        std::lock_guard<std::mutex> lock(mu);
        if (other_error.empty()) other_error = s.error_message();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  out = Ctl("apply -f " + dir_ + "/v3.yaml");
  EXPECT_EQ(last_rc_, 0) << out;
  json d;
  for (int i = 0; i < 1600; ++i) {
    d = Deployment("enc");
    if (d.contains("status") && d["status"].contains("rollout") &&
        d["status"]["rollout"].value("phase", "") == "Degraded") {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_EQ(d["status"]["rollout"].value("phase", ""), "Degraded") << d.dump() << ReadFile(clog_);
  EXPECT_EQ(d["status"]["rollout"].value("failedVersion", ""), "3");
  EXPECT_EQ(d["status"]["rollout"].value("stableVersion", ""), "1");
  json degraded;
  for (const auto& c : d["status"].value("conditions", json::array())) {
    if (c.value("type", "") == "Degraded") degraded = c;
  }
  ASSERT_TRUE(degraded.is_object()) << d["status"].dump();
  EXPECT_EQ(degraded.value("status", ""), "True");
  EXPECT_EQ(degraded.value("reason", ""), "RolledBack");
  // The canary replica drains; then nothing fails any more.
  WaitForReplicasOnBothNodes(2, n2.admin);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  int failed_before = canary_failed.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  stop = true;
  traffic.join();
  EXPECT_GT(failed_before, 0);  // the canary did take traffic, and failed it
  EXPECT_EQ(canary_failed.load(), failed_before) << "requests still reach the rolled-back canary";
  EXPECT_EQ(other_failed.load(), 0) << other_error;
  EXPECT_GT(ok.load(), 30);
  EXPECT_NE(ReadFile(clog_).find("failed analysis"), std::string::npos);
  out = Ctl("rollout status enc -w");
  EXPECT_EQ(last_rc_, 1) << out;
  EXPECT_NE(out.find("rollout of version 3 failed and was rolled back"), std::string::npos) << out;
  // Still rolled back on later ticks (the spec names version 3 still).
  EXPECT_EQ(Deployment("enc")["status"]["rollout"].value("phase", ""), "Degraded");
  // What an operator looks at afterwards: the events (kept in the store), the replicas, and
  // all of it together in `describe`.
  out = Ctl("get events enc");
  EXPECT_EQ(last_rc_, 0) << out;
  EXPECT_NE(out.find("RolledBack"), std::string::npos) << out;
  EXPECT_NE(out.find("failed analysis"), std::string::npos) << out;
  out = Ctl("get replicas enc -o wide");
  EXPECT_EQ(last_rc_, 0) << out;
  EXPECT_NE(out.find("NODE"), std::string::npos) << out;
  EXPECT_NE(out.find("DEVICE"), std::string::npos) << out;
  EXPECT_NE(out.find("n1"), std::string::npos) << out;
  EXPECT_NE(out.find("n2"), std::string::npos) << out;
  for (const char* column : {"CPUS", "PID", "QPS", "P99", "GPU-MEM", "IDLE"}) {
    EXPECT_NE(out.find(column), std::string::npos) << column << " missing: " << out;
  }
  out = Ctl("get replicas enc -o json");
  EXPECT_EQ(last_rc_, 0) << out;
  for (const auto& r : nlohmann::json::parse(out)["items"]) {
    EXPECT_NE(r.value("version", ""), "3") << "a version 3 replica is left: " << out;
    if (r.value("state", "") == "SERVING") {
      EXPECT_GT(r.value("pid", 0), 0) << out;
    }
  }
  out = Ctl("get replicas enc -o yaml");
  EXPECT_EQ(last_rc_, 0) << out;
  EXPECT_NE(out.find("kind: ReplicaList"), std::string::npos) << out;
  out = Ctl("describe deployment enc");
  EXPECT_EQ(last_rc_, 0) << out;
  for (const char* part : {"Name:", "enc", "Phase:", "Degraded", "Versions:", "Replicas:",
                           "Events:", "RolledBack", "SERVING"}) {
    EXPECT_NE(out.find(part), std::string::npos) << part << " missing in:\n" << out;
  }
  out = Ctl("describe deployment nope");
  EXPECT_EQ(last_rc_, 1) << out;
  EXPECT_NE(out.find("NotFound"), std::string::npos) << out;
  out = Ctl("describe pod enc");
  EXPECT_EQ(last_rc_, 1) << out;
}

}  // namespace
