// kiln-agent with real kiln-runtime processes on loopback: an assignment file brings replicas
// up, SIGHUP scales by promoting WARM replicas, a killed replica is restarted, a restarted
// agent adopts the running replicas, a bad file keeps the old assignment.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cpprest/http_client.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <atomic>
#include <map>
#include <set>
#include <thread>
#include <sstream>

#include <grpcpp/create_channel.h>
#include <grpcpp/server_builder.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/cpu_list.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "kiln/v1/control_plane.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/support/eventually.h"
#include "tests/support/raw_http_client.h"
#include "tests/support/requests.h"
#include "tests/support/shell.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string kRepo = KILN_MODEL_REPO;

using kiln::testing::ReadFile;

class AgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Short: control sockets live under the state directory.
    dir_ = "/tmp/kat" + std::to_string(getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    StopAgent(SIGKILL);
    // Replicas (and pre-started runtimes) outlive agents by design: kill every one this test
    // saw or the agent's state file names.
    json state = json::parse(ReadFile(dir_ + "/s/replicas.json"), nullptr, false);
    if (!state.is_discarded()) {
      for (const char* list : {"replicas", "prestarted"}) {
        for (const auto& e : state.value(list, json::array())) {
          if (e.contains("pid") && e["pid"].is_number_integer()) seen_pids_.insert(e["pid"].get<int>());
        }
      }
    }
    for (pid_t p : seen_pids_) kill(p, SIGKILL);
    fs::remove_all(dir_);
  }

  void WriteAssignment(const std::string& text) { std::ofstream(dir_ + "/assign.yaml") << text; }

  std::string Replica(const std::string& id, const std::string& state, int gpu = -1) {
    return "  - {id: " + id + ", model: encoder, version: \"2\", repository: " + kRepo +
           ", gpu: " + std::to_string(gpu) + ", cpus: 1, state: " + state + "}\n";
  }

  void StartAgent(const std::string& controller = "", bool journal = false) {
    log_ = dir_ + "/agent" + std::to_string(++agents_) + ".log";
    std::vector<std::string> args = {KILN_AGENT_BIN,
                                     controller.empty() ? "--assignment-file" : "--controller",
                                     controller.empty() ? dir_ + "/assign.yaml" : controller,
                                     "--state-dir",        dir_ + "/s",
                                     "--runtime-binary",   KILN_RUNTIME_BIN,
                                     "--admin-bind",       "127.0.0.1",
                                     "--admin-port",       "0",
                                     "--fake-gpus",        "1:16Gi",
                                     "--reserved-cpus",    "0",
                                     "--tick-ms",          tick_ms_,
                                     "--ingress-bind",     "127.0.0.1",
                                     "--grpc-port",        "0",
                                     "--http-port",        "0",
                                     "--stop-timeout-ms",  "5000"};
    args.insert(args.end(), extra_args_.begin(), extra_args_.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      int fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      if (!listen_fds_.empty()) {  // as systemd's socket units hand them over: fds 3, 4, ...
        std::vector<int> high;
        for (int l : listen_fds_) high.push_back(fcntl(l, F_DUPFD_CLOEXEC, 100));
        for (size_t i = 0; i < high.size(); ++i) dup2(high[i], 3 + static_cast<int>(i));
        setenv("LISTEN_FDS", std::to_string(high.size()).c_str(), 1);
        setenv("LISTEN_PID", std::to_string(getpid()).c_str(), 1);
        setenv("LISTEN_FDNAMES", "grpc:http", 1);
      }
      for (const auto& [name, value] : extra_env_) setenv(name.c_str(), value.c_str(), 1);
      if (journal) {  // as systemd does: stderr "is" the journal stream
        struct stat st;
        fstat(2, &st);
        std::string js = std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
        setenv("JOURNAL_STREAM", js.c_str(), 1);
      }
      execv(argv[0], argv.data());
      _exit(127);
    }
    // Bounded poll for the admin port in the log.
    admin_port_ = 0;
    for (int i = 0; i < 3000 && admin_port_ == 0; ++i) {
      std::string text = ReadFile(log_);
      size_t at = text.find("admin_port=");
      if (at != std::string::npos) admin_port_ = std::atoi(text.c_str() + at + 11);
      if (admin_port_ == 0) absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_GT(admin_port_, 0) << ReadFile(log_);
    router_grpc_ = router_http_ = 0;
    for (int i = 0; i < 3000 && router_grpc_ == 0; ++i) {
      std::string text = ReadFile(log_);
      size_t at = text.find("router listening grpc_port=");
      if (at != std::string::npos) {
        router_grpc_ = std::atoi(text.c_str() + at + 27);
        router_http_ = std::atoi(text.c_str() + text.find("http_port=", at) + 10);
      }
      if (router_grpc_ == 0) absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_GT(router_grpc_, 0) << ReadFile(log_);
  }

  void StopAgent(int sig) {
    if (pid_ <= 0) return;
    kill(pid_, sig);
    int status;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

  void Hup() { kill(pid_, SIGHUP); }

  std::pair<int, std::string> Get(const std::string& path) {
    web::http::client::http_client_config cfg;
    cfg.set_timeout(std::chrono::seconds(10));
    web::http::client::http_client c("http://127.0.0.1:" + std::to_string(admin_port_), cfg);
    try {
      auto r = c.request(web::http::methods::GET, path).get();
      return {r.status_code(), r.extract_utf8string(true).get()};
    } catch (const std::exception& e) {
      return {0, std::string("request failed: ") + e.what()};  // pollers retry; asserts fail
    }
  }

  json Replicas() {
    auto [code, text] = Get("/v1/replicas");
    json j = json::parse(text, nullptr, false);
    if (code != 200 || j.is_discarded()) return json{{"replicas", json::array()}, {"error", text}};
    for (const auto& r : j["replicas"]) {
      if (r["pid"].get<int>() > 0) seen_pids_.insert(r["pid"].get<int>());
    }
    for (const auto& p : j.value("prestarted", json::array())) {
      if (p["pid"].get<int>() > 0) seen_pids_.insert(p["pid"].get<int>());
    }
    return j;
  }

  json Find(const json& j, const std::string& id) {
    for (const auto& r : j["replicas"]) {
      if (r["id"] == id) return r;
    }
    return json();
  }

  // Bounded poll until `pred` holds on /v1/replicas.
  template <typename Pred>
  json WaitFor(Pred pred, const std::string& what) {
    json j;
    for (int i = 0; i < 1200; ++i) {
      j = Replicas();
      if (pred(j)) return j;
      absl::SleepFor(absl::Milliseconds(25));
    }
    ADD_FAILURE() << "timed out waiting for " << what << ": " << j.dump() << "\n" << ReadFile(log_);
    return j;
  }

  bool Ready() { return Get("/readyz").first == 200; }

  // A real inference through the replica's own gRPC port (or the router's).
  grpc::Status Infer(int port, std::string* version = nullptr, const std::string& user = "",
                     int deadline_s = 10) {
    auto stub = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
    inference::ModelInferRequest req = kiln::testing::EncoderRequest();
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_s));
    if (!user.empty()) ctx.AddMetadata("x-user-id", user);
    inference::ModelInferResponse resp;
    grpc::Status s = stub->ModelInfer(&ctx, req, &resp);
    if (version) {
      auto it = resp.parameters().find("kiln-version");
      *version = it == resp.parameters().end() ? "" : it->second.string_param();
      auto md = ctx.GetServerInitialMetadata().find("kiln-version");
      if (md == ctx.GetServerInitialMetadata().end() ||
          std::string(md->second.data(), md->second.size()) != *version) {
        *version += " (metadata differs)";
      }
    }
    return s;
  }

  std::string dir_;
  std::string log_;
  pid_t pid_ = -1;
  int admin_port_ = 0;
  int router_grpc_ = 0;
  int router_http_ = 0;
  int agents_ = 0;
  std::set<int> seen_pids_;
  std::vector<std::string> extra_args_;
  std::string tick_ms_ = "50";
  std::vector<std::pair<std::string, std::string>> extra_env_;  // set in the agent's process
  std::vector<int> listen_fds_;  // handed to the agent as LISTEN_FDS (grpc, http)
};

// A listening socket on a free loopback port, as a socket unit would hold it.
int ListenOnLoopback() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 1024) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

int PortOf(int fd) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return ntohs(addr.sin_port);
}

// The ready pre-started runtime for `gpu` (-1 = CPU replicas) in /v1/replicas, or null.
json Prestarted(const json& j, int gpu) {
  for (const auto& p : j.value("prestarted", json::array())) {
    if (p["gpu"] == gpu && p["ready"] == true && p["stopping"] == false) return p;
  }
  return json();
}

// Every thread of `pid` may run only on `cpus` (the agent's "2-3" form).
std::string ThreadAffinities(int pid) {
  std::set<std::string> lists;
  std::error_code ec;
  for (const auto& t : fs::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::string status = ReadFile(t.path().string() + "/status");
    size_t at = status.find("Cpus_allowed_list:");
    if (at == std::string::npos) continue;
    size_t start = status.find_first_not_of(" \t", at + 18);
    lists.insert(status.substr(start, status.find('\n', start) - start));
  }
  std::string out;
  for (const auto& l : lists) out += (out.empty() ? "" : " | ") + l;
  return out;
}

TEST_F(AgentTest, AssignmentBringsUpReplicasAndScaleUpPromotesTheWarmOne) {
  WriteAssignment("replicas:\n" + Replica("s0", "SERVING", 0) + Replica("w0", "WARM"));
  StartAgent();
  json j = WaitFor(
      [&](const json& j) {
        return Find(j, "s0")["state"] == "SERVING" && Find(j, "w0")["state"] == "WARM";
      },
      "SERVING + WARM");
  EXPECT_TRUE(Ready());
  EXPECT_EQ(Find(j, "s0")["device"], "cpu");  // a fake GPU: runs on cpu
  EXPECT_TRUE(Infer(Find(j, "s0")["grpc_port"]).ok());
  EXPECT_EQ(Infer(Find(j, "w0")["grpc_port"]).error_code(), grpc::StatusCode::UNAVAILABLE);
  int warm_pid = Find(j, "w0")["pid"];
  // Replicas start with malloc's heap on huge pages (the agent's default), the agent's own
  // environment otherwise.
  if (getenv("GLIBC_TUNABLES") == nullptr) {
    std::string environ_of = kiln::testing::ReadFile("/proc/" + std::to_string(warm_pid) + "/environ");
    std::replace(environ_of.begin(), environ_of.end(), '\0', '\n');
    EXPECT_NE(("\n" + environ_of).find("\nGLIBC_TUNABLES=glibc.malloc.hugetlb=1\n"),
              std::string::npos)
        << environ_of;
  }

  // Scale up: the WARM replica becomes SERVING in place (same process), then answers.
  WriteAssignment("replicas:\n" + Replica("s0", "SERVING", 0) + Replica("w0", "SERVING"));
  Hup();
  j = WaitFor([&](const json& j) { return Find(j, "w0")["state"] == "SERVING"; }, "promotion");
  EXPECT_EQ(Find(j, "w0")["pid"], warm_pid);
  EXPECT_TRUE(Infer(Find(j, "w0")["grpc_port"]).ok());

  auto metrics = Get("/metrics");
  EXPECT_EQ(metrics.first, 200);
  EXPECT_NE(metrics.second.find("kiln_replica_state{node="), std::string::npos);
  EXPECT_NE(metrics.second.find("state=\"SERVING\"} 1"), std::string::npos);
  EXPECT_NE(metrics.second.find("fake=\"true\""), std::string::npos);
  // Per-replica load: s0 has answered at least the one request above.
  size_t at = metrics.second.find("kiln_replica_requests_total{node=");
  at = metrics.second.find("replica=\"s0\"", at);
  ASSERT_NE(at, std::string::npos) << metrics.second;
  size_t value = metrics.second.find("} ", at);
  EXPECT_GE(std::atoi(metrics.second.c_str() + value + 2), 1) << metrics.second;
  // The exposition is clean by Prometheus's own linter (names, types, HELP, suffixes, units).
  const std::string promtool = kiln::testing::FindPromtool(KILN_PROMTOOL_FALLBACK);
  ASSERT_FALSE(promtool.empty())
      << "promtool not found: on the PATH or at " KILN_PROMTOOL_FALLBACK
         " (scripts/fetch-promtool.sh puts it there)";
  auto lint = kiln::testing::PromtoolCheck(promtool, metrics.second, dir_ + "/metrics.txt");
  EXPECT_EQ(lint.rc, 0) << lint.out << "\n" << metrics.second;
  EXPECT_EQ(lint.out, "") << metrics.second;
  EXPECT_EQ(Get("/healthz").first, 200);
}

TEST_F(AgentTest, KilledReplicaIsRestartedAndABadFileKeepsTheOldAssignment) {
  WriteAssignment("replicas:\n" + Replica("s0", "SERVING"));
  StartAgent();
  json j = WaitFor([&](const json& j) { return Find(j, "s0")["state"] == "SERVING"; }, "SERVING");
  struct stat sockets;
  ASSERT_EQ(stat((dir_ + "/s/sockets").c_str(), &sockets), 0);
  EXPECT_EQ(sockets.st_mode & 0777, 0700u);
  int first = Find(j, "s0")["pid"];
  kill(first, SIGKILL);
  j = WaitFor(
      [&](const json& j) {
        auto r = Find(j, "s0");
        return r["pid"] != first && r["pid"] != 0 && r["state"] == "SERVING";
      },
      "restart");
  EXPECT_EQ(Find(j, "s0")["restarts"], 1);
  EXPECT_TRUE(Infer(Find(j, "s0")["grpc_port"]).ok());
  int second = Find(j, "s0")["pid"];

  WriteAssignment("replicas:\n  - {id: s0, model: encoder, version: two, repository: /x}\n");
  Hup();
  for (int i = 0; i < 400 && ReadFile(log_).find("assignment file rejected") == std::string::npos; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  std::string log = ReadFile(log_);
  EXPECT_NE(log.find("assignment file rejected, keeping generation 1"), std::string::npos) << log;
  EXPECT_NE(log.find("replicas[0].version"), std::string::npos) << log;
  j = Replicas();
  EXPECT_EQ(Find(j, "s0")["pid"], second);
  EXPECT_EQ(Find(j, "s0")["state"], "SERVING");
  const std::string metrics = Get("/metrics").second;
  EXPECT_NE(metrics.find("kiln_agent_assignment_reloads_rejected_total{node="), std::string::npos);
  // The power policy (dry-run) planned the fake GPU's persistence and limit: counted.
  const std::string planned = "kiln_agent_gpu_power_changes_total{node=\"" ;
  size_t at = metrics.find(",outcome=\"planned\"} ");
  ASSERT_NE(at, std::string::npos) << metrics;
  EXPECT_GE(std::atoi(metrics.c_str() + at + std::strlen(",outcome=\"planned\"} ")), 1) << metrics;
  EXPECT_NE(metrics.find(",outcome=\"applied\"} 0\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find(planned), std::string::npos);
  EXPECT_NE(metrics.find("kiln_agent_converged{node="), std::string::npos);
}

// A reload is taken when SIGHUP comes, not at the loop's next tick (the longest allowed, 10 s,
// here; each reload below is given 3 s): a scale-up waits for no timer.
// An application Xid on a GPU gets its SERVING replicas probed at once, by a real inference,
// instead of at their interval (an hour here); the replica passes and stays in routing.
TEST_F(AgentTest, AnApplicationXidGetsTheGpusReplicasProbedAtOnce) {
  extra_args_ = {"--inference-probe-interval-ms", "3600000"};
  WriteAssignment("replicas:\n" + Replica("g0", "SERVING", 0));
  StartAgent();
  WaitFor([&](const json& j) { return Find(j, "g0")["state"] == "SERVING" && Find(j, "g0")["healthy"] == true; },
          "SERVING");
  web::http::client::http_client c("http://127.0.0.1:" + std::to_string(admin_port_));
  auto resp = c.request(web::http::methods::POST, "/v1/fake-gpus/0/xid/31").get();
  ASSERT_EQ(resp.status_code(), 200) << resp.extract_utf8string(true).get();
  ASSERT_TRUE(kiln::testing::Eventually(
      [&] { return ReadFile(log_).find("replica g0: probed now (Xid 31: GPU memory page fault on gpu 0)") != std::string::npos; },
      absl::Seconds(30)))
      << ReadFile(log_);
  json j = WaitFor([&](const json& j) { return Find(j, "g0")["healthy"] == true; }, "healthy");
  EXPECT_EQ(Find(j, "g0")["state"], "SERVING");
  EXPECT_EQ(ReadFile(log_).find("inference probe failed"), std::string::npos) << ReadFile(log_);
}

TEST_F(AgentTest, ASighupIsTakenAtOnceWhateverTheTick) {
  tick_ms_ = "10000";
  WriteAssignment("replicas: []\n");
  StartAgent();
  auto wait_log = [&](const std::string& line, int seconds = 3) {
    for (int i = 0; i < seconds * 100 && ReadFile(log_).find(line) == std::string::npos; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    return ReadFile(log_).find(line) != std::string::npos;
  };
  ASSERT_TRUE(wait_log("serving the assignment (generation 1)", 30)) << ReadFile(log_);
  WriteAssignment("replicas:\n  - {id: s0, model: encoder, version: two, repository: /x}\n");
  Hup();
  EXPECT_TRUE(wait_log("assignment file rejected, keeping generation 1")) << ReadFile(log_);
  WriteAssignment("replicas:\n" + Replica("s0", "WARM"));
  Hup();
  EXPECT_TRUE(wait_log("assignment file reloaded: generation 2")) << ReadFile(log_);
  EXPECT_FALSE(Find(Replicas(), "s0").is_null());
}

// A replica's exit is seen when it happens (SIGCHLD wakes the loop), not at the loop's next
// tick (the longest allowed, 10 s, here; the exit is given 3 s).
TEST_F(AgentTest, AReplicasExitIsSeenAtOnceWhateverTheTick) {
  tick_ms_ = "10000";
  WriteAssignment("replicas:\n" + Replica("s0", "WARM"));
  StartAgent();
  const std::string started = "replica s0: started pid ";
  std::string log;
  for (int i = 0; i < 3000 && (log = ReadFile(log_)).find(started) == std::string::npos; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  size_t at = log.find(started);
  ASSERT_NE(at, std::string::npos) << log;
  const pid_t pid = std::atoi(log.c_str() + at + started.size());
  ASSERT_GT(pid, 0) << log;
  seen_pids_.insert(pid);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  const std::string seen = "replica s0: killed by signal 9";
  for (int i = 0; i < 300 && (log = ReadFile(log_)).find(seen) == std::string::npos; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_NE(log.find(seen), std::string::npos) << log;
}

// The agent's own threads keep off the CPUs its replicas hold, so a replica's set is exclusive
// of the router's and the loop's work too: listed in /v1/replicas and applied to every thread.
TEST_F(AgentTest, TheAgentsThreadsKeepOffItsReplicasCpus) {
  cpu_set_t mine;
  ASSERT_EQ(sched_getaffinity(0, sizeof(mine), &mine), 0);
  if (CPU_COUNT(&mine) < 2) GTEST_SKIP() << "needs two CPUs: one for the replica, one left";
  WriteAssignment("replicas:\n" + Replica("s0", "WARM"));
  StartAgent();
  json j = WaitFor([&](const json& j) { return Find(j, "s0")["state"] == "WARM"; }, "WARM");
  auto replica_cpus = ParseCpuList(Find(j, "s0")["cpus"].get<std::string>(), "cpus");
  ASSERT_TRUE(replica_cpus.ok()) << j.dump();
  j = WaitFor([&](const json& j) { return !j["agent_cpus"].get<std::string>().empty(); },
              "agent cpus");
  auto agent_cpus = ParseCpuList(j["agent_cpus"].get<std::string>(), "agent_cpus");
  ASSERT_TRUE(agent_cpus.ok()) << j.dump();
  for (int c : *replica_cpus) {
    EXPECT_EQ(std::count(agent_cpus->begin(), agent_cpus->end(), c), 0)
        << "the agent runs on its replica's cpu " << c << ": " << j.dump();
  }
  // Every thread of the agent's (bounded poll: the log line comes after the last one is set).
  auto all_pinned = [&]() {
    std::error_code ec;
    int threads = 0;
    for (const auto& t : fs::directory_iterator("/proc/" + std::to_string(pid_) + "/task", ec)) {
      std::string status = ReadFile(t.path().string() + "/status");
      size_t at = status.find("Cpus_allowed_list:");
      if (at == std::string::npos) continue;  // the thread ended meanwhile
      size_t end = status.find('\n', at);
      std::string list(absl::StripAsciiWhitespace(status.substr(at + 18, end - at - 18)));
      auto cpus = ParseCpuList(list, "Cpus_allowed_list");
      if (!cpus.ok() || *cpus != *agent_cpus) return false;
      threads++;
    }
    return threads > 0;
  };
  bool pinned = false;
  for (int i = 0; i < 500 && !(pinned = all_pinned()); ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(pinned) << "a thread of the agent's is not on cpus " << j["agent_cpus"];
}

// A replica adopted from an earlier agent is not this agent's child (no SIGCHLD): its exit is
// still seen when it happens, through the launcher's watch on its pidfd, not at the next tick
// (10 s here; the exit is given 3 s).
TEST_F(AgentTest, AnAdoptedReplicasExitIsSeenAtOnceWhateverTheTick) {
  WriteAssignment("replicas:\n" + Replica("s0", "WARM"));
  StartAgent();
  json before = WaitFor([&](const json& j) { return Find(j, "s0")["state"] == "WARM"; }, "WARM");
  const int pid = Find(before, "s0")["pid"];
  seen_pids_.insert(pid);
  StopAgent(SIGTERM);  // the replica keeps running
  tick_ms_ = "10000";
  StartAgent();
  WaitFor([&](const json& j) { return Find(j, "s0")["adopted"] == true; }, "adoption");
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  const std::string seen = "replica s0: exited";
  std::string log;
  for (int i = 0; i < 300 && (log = ReadFile(log_)).find(seen) == std::string::npos; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_NE(log.find(seen), std::string::npos) << log;
}

// Under systemd (Type=notify, WatchdogSec=): READY=1 with a STATUS once the assignment is
// applied, the STATUS again when its replica is SERVING, WATCHDOG=1 at half of WATCHDOG_USEC,
// and STOPPING=1 on the way out, all on the notify socket.
TEST_F(AgentTest, UnderSystemdItNotifiesReadyStatusWatchdogAndStopping) {
  const std::string path = dir_ + "/notify.sock";
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << strerror(errno);
  std::vector<std::string> got;
  // Bounded: reads what arrives for up to `seconds`, until `until` holds.
  auto read_until = [&](auto until, int seconds) {
    for (int i = 0; i < seconds * 20 && !until(); ++i) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      char buf[4096];
      ssize_t n = recv(fd, buf, sizeof(buf), 0);
      if (n > 0) got.emplace_back(buf, static_cast<size_t>(n));
    }
  };
  auto count = [&](const std::string& what) {
    return std::count_if(got.begin(), got.end(),
                         [&](const std::string& m) { return m.find(what) != std::string::npos; });
  };
  extra_env_ = {{"NOTIFY_SOCKET", path}, {"WATCHDOG_USEC", "400000"}};
  WriteAssignment("replicas:\n" + Replica("s0", "SERVING"));
  StartAgent();
  read_until([&] { return count("every replica in its assigned state") > 0 && count("WATCHDOG=1") >= 3; }, 60);
  ASSERT_EQ(count("READY=1"), 1) << absl::StrJoin(got, " | ");
  for (const auto& m : got) {
    if (m.find("READY=1") != std::string::npos) {
      EXPECT_NE(m.find("STATUS=serving generation 1"), std::string::npos) << m;
    }
  }
  EXPECT_GE(count("STATUS=serving generation 1, every replica in its assigned state"), 1)
      << absl::StrJoin(got, " | ");
  EXPECT_GE(count("WATCHDOG=1"), 3) << absl::StrJoin(got, " | ");
  // Until READY=1 the start timeout is pushed on (a model may load for minutes), never after.
  const auto ready = std::find_if(got.begin(), got.end(), [](const std::string& m) {
    return m.find("READY=1") != std::string::npos;
  });
  EXPECT_GE(std::count(got.begin(), ready, std::string("EXTEND_TIMEOUT_USEC=30000000")), 1)
      << absl::StrJoin(got, " | ");
  EXPECT_EQ(std::count_if(ready, got.end(),
                          [](const std::string& m) { return m.find("EXTEND_TIMEOUT") != std::string::npos; }),
            0)
      << absl::StrJoin(got, " | ");
  EXPECT_EQ(Find(Replicas(), "s0")["state"], "SERVING");
  StopAgent(SIGTERM);
  read_until([&] { return count("STOPPING=1") > 0; }, 5);
  EXPECT_EQ(count("STOPPING=1"), 1) << absl::StrJoin(got, " | ");
  close(fd);
}

TEST_F(AgentTest, ARestartedAgentAdoptsItsReplicasWithoutRestartingThem) {
  WriteAssignment("replicas:\n" + Replica("s0", "SERVING") + Replica("w0", "WARM"));
  StartAgent();
  json before = WaitFor(
      [&](const json& j) {
        return Find(j, "s0")["state"] == "SERVING" && Find(j, "w0")["state"] == "WARM";
      },
      "SERVING + WARM");
  int s0 = Find(before, "s0")["pid"], w0 = Find(before, "w0")["pid"];
  int port = Find(before, "s0")["grpc_port"];
  StopAgent(SIGTERM);  // replicas keep running and keep serving
  EXPECT_EQ(kill(s0, 0), 0);
  EXPECT_TRUE(Infer(port).ok());
  StartAgent();
  json after = WaitFor([&](const json& j) { return Find(j, "s0")["adopted"] == true; }, "adoption");
  EXPECT_EQ(Find(after, "s0")["pid"], s0);
  EXPECT_EQ(Find(after, "w0")["pid"], w0);
  EXPECT_EQ(Find(after, "w0")["state"], "WARM");
  EXPECT_EQ(Find(after, "s0")["restarts"], 0);
  EXPECT_TRUE(Infer(Find(after, "s0")["grpc_port"]).ok());
  EXPECT_NE(ReadFile(log_).find("adopted pid " + std::to_string(s0)), std::string::npos);
}

// The warm pool's member in /v1/replicas (its id is the agent's: pool-...), or null.
json PoolMember(const json& j, const std::set<int>& not_pids = {}) {
  for (const auto& r : j["replicas"]) {
    if (r["id"].get<std::string>().rfind("pool-", 0) == 0 && r["state"] == "WARM" &&
        r["removing"] == false && !not_pids.count(r["pid"].get<int>())) {
      return r;
    }
  }
  return json();
}

TEST_F(AgentTest, AFilesWarmPoolServesScaleUpInPlaceAndTakesBackAScaledDownReplica) {
  // Two replicas at most at any time: CI machines have two CPUs.
  auto pool = [&](int size) {
    return "warmPools:\n  - {model: encoder, version: \"2\", repository: " + kRepo +
           ", cpus: 1, size: " + std::to_string(size) + "}\n";
  };
  WriteAssignment(pool(1));
  StartAgent();
  json j = WaitFor([&](const json& j) { return !PoolMember(j).is_null(); }, "a WARM pool member");
  const int member = PoolMember(j)["pid"];
  const std::string member_id = PoolMember(j)["id"];

  // Scale-up: s1 is the pool member, promoted in place; a new member refills the pool.
  WriteAssignment("replicas:\n" + Replica("s1", "SERVING") + pool(1));
  Hup();
  j = WaitFor([&](const json& j) { return Find(j, "s1")["state"] == "SERVING"; }, "s1 SERVING");
  EXPECT_EQ(Find(j, "s1")["pid"], member);
  EXPECT_EQ(Find(j, "s1")["restarts"], 0);
  EXPECT_TRUE(Infer(Find(j, "s1")["grpc_port"]).ok());
  EXPECT_NE(ReadFile(log_).find("replica " + member_id + ": goes on as s1 (pid " +
                                std::to_string(member) + ")"),
            std::string::npos)
      << ReadFile(log_);
  j = WaitFor([&](const json& j) { return !PoolMember(j, {member}).is_null(); }, "the pool refilled");
  const int refill = PoolMember(j, {member})["pid"];

  // Scale-down with a bigger pool: s1 joins it (demoted, same process) instead of draining.
  WriteAssignment(pool(2));
  Hup();
  j = WaitFor([&](const json& j) {
    return Find(j, "s1").is_null() && !PoolMember(j, {refill}).is_null();
  }, "s1 back in the pool");
  EXPECT_EQ(PoolMember(j, {refill})["pid"], member);
  EXPECT_EQ(PoolMember(j, {member})["pid"], refill);

  // No pool at all: its members drain.
  WriteAssignment("replicas: []\n");
  Hup();
  WaitFor([&](const json& j) { return j["replicas"].empty(); }, "the pool gone");
}

TEST_F(AgentTest, APrestartedRuntimeBecomesTheStartingReplicaPinnedAndThePoolRefills) {
  WriteAssignment("replicas: []\n");
  extra_args_ = {"--prestart-cpu", "1", "--prestart-per-gpu", "1"};
  StartAgent();
  json j = WaitFor([&](const json& j) { return !Prestarted(j, -1).is_null() && !Prestarted(j, 0).is_null(); },
                   "a ready pre-started runtime for cpu and for gpu 0");
  const int for_cpu = Prestarted(j, -1)["pid"], for_gpu = Prestarted(j, 0)["pid"];
  EXPECT_NE(ReadFile(dir_ + "/s/logs/" + Prestarted(j, -1)["name"].get<std::string>() + ".log")
                .find("waiting for Load"),
            std::string::npos);

  WriteAssignment("replicas:\n" + Replica("s0", "SERVING") + Replica("g0", "WARM", 0));
  Hup();
  j = WaitFor([&](const json& j) {
    return Find(j, "s0")["state"] == "SERVING" && Find(j, "g0")["state"] == "WARM";
  }, "s0 SERVING and g0 WARM");
  // No cold start: each replica is the process that was waiting for it.
  EXPECT_EQ(Find(j, "s0")["pid"], for_cpu);
  EXPECT_EQ(Find(j, "g0")["pid"], for_gpu);
  EXPECT_NE(ReadFile(log_).find("replica s0: handed pre-started pid " + std::to_string(for_cpu)),
            std::string::npos) << ReadFile(log_);
  EXPECT_TRUE(Infer(Find(j, "s0")["grpc_port"]).ok());
  // Pinned to its own CPUs on every thread, as a cold start would be.
  EXPECT_EQ(ThreadAffinities(for_cpu), Find(j, "s0")["cpus"].get<std::string>());
  EXPECT_EQ(ThreadAffinities(for_gpu), Find(j, "g0")["cpus"].get<std::string>());
  // Its output goes on in the replica's own log.
  std::string replica_log = ReadFile(dir_ + "/s/logs/s0.log");
  EXPECT_NE(replica_log.find("Load accepted"), std::string::npos) << replica_log;
  EXPECT_NE(replica_log.find("replica=s0"), std::string::npos) << replica_log;  // named at the Load
  // The pool refills with new processes.
  j = WaitFor([&](const json& j) { return !Prestarted(j, -1).is_null() && !Prestarted(j, 0).is_null(); },
              "the pool refilled");
  EXPECT_NE(Prestarted(j, -1)["pid"], for_cpu);
  std::string metrics = Get("/metrics").second;
  EXPECT_NE(metrics.find("kiln_agent_prestarted_runtimes{node="), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("gpu=\"-1\",ready=\"true\"} 1"), std::string::npos) << metrics;

  // A restarted agent adopts both the replicas handed from the pool and the pool.
  const int refill = Prestarted(j, -1)["pid"];
  StopAgent(SIGTERM);
  StartAgent();
  j = WaitFor([&](const json& j) {
    return Find(j, "s0")["adopted"] == true && !Prestarted(j, -1).is_null();
  }, "adoption");
  EXPECT_EQ(Find(j, "s0")["pid"], for_cpu);
  EXPECT_EQ(Find(j, "s0")["restarts"], 0);
  EXPECT_EQ(Prestarted(j, -1)["pid"], refill);
  EXPECT_EQ(Prestarted(j, -1)["adopted"], true);
  EXPECT_TRUE(Infer(Find(j, "s0")["grpc_port"]).ok());

  // An agent told to stop its replicas on exit stops the pre-started ones too.
  std::set<int> pids = {for_cpu, for_gpu, refill};
  for (const auto& p : j["prestarted"]) pids.insert(p["pid"].get<int>());
  StopAgent(SIGTERM);
  extra_args_.push_back("--stop-replicas-on-exit");
  StartAgent();
  WaitFor([&](const json& j) { return Find(j, "s0")["adopted"] == true; }, "adoption");
  StopAgent(SIGTERM);
  for (int pid : pids) {
    for (int i = 0; i < 400 && kiln::testing::Running(pid); ++i) {
      absl::SleepFor(absl::Milliseconds(25));
    }
    EXPECT_FALSE(kiln::testing::Running(pid)) << pid;
  }
}

// A pre-started runtime that hangs (stopped: it never answers its Load) does not hold up the
// agent's loop: another replica is promoted while the new one waits for the answer, and the new
// one starts cold once it has waited 2 s. The hung runtime is killed when its Load's deadline
// passes.
TEST_F(AgentTest, AHungPrestartedRuntimeDoesNotHoldUpTheAgent) {
  WriteAssignment("replicas:\n" + Replica("w0", "WARM"));
  extra_args_ = {"--prestart-cpu", "1"};
  StartAgent();
  json j = WaitFor([&](const json& j) {
    return Find(j, "w0")["state"] == "WARM" && !Prestarted(j, -1).is_null();
  }, "w0 WARM and a ready pre-started runtime");
  const int hung = Prestarted(j, -1)["pid"];
  ASSERT_EQ(kill(hung, SIGSTOP), 0);
  struct Unhang {  // whatever fails below
    int pid;
    ~Unhang() { kill(pid, SIGKILL); }
  } unhang{hung};
  WriteAssignment("replicas:\n" + Replica("s1", "SERVING") + Replica("w0", "SERVING"));
  Hup();
  j = WaitFor([&](const json& j) {
    bool loading = false;
    for (const auto& p : j["prestarted"]) loading |= p["pid"] == hung && p["loading_for"] == "s1";
    return Find(j, "w0")["state"] == "SERVING" && Find(j, "s1")["phase"] == "PENDING" && loading;
  }, "w0 promoted while s1 waits (PENDING) for the hung runtime's answer");
  j = WaitFor([&](const json& j) { return Find(j, "s1")["state"] == "SERVING"; }, "s1 SERVING");
  EXPECT_NE(Find(j, "s1")["pid"], hung);
  EXPECT_NE(ReadFile(log_).find("has not answered replica s1's Load in 2s; the replica starts "
                                "cold"),
            std::string::npos) << ReadFile(log_);
  EXPECT_TRUE(Infer(Find(j, "s1")["grpc_port"]).ok());
  // Its Load's deadline (10 s) passes: killed, and gone from the pool.
  WaitFor([&](const json& j) {
    for (const auto& p : j["prestarted"]) {
      if (p["pid"] == hung) return false;
    }
    return !kiln::testing::Running(hung);
  }, "the hung runtime killed");
  EXPECT_NE(ReadFile(log_).find("failed replica s1's Load"), std::string::npos) << ReadFile(log_);
}

TEST_F(AgentTest, RestartingTheAgentUnderLoadFailsNoRequestThroughItsRouter) {
  // The router's sockets are held outside the agent, as kiln-agent-grpc.socket and
  // kiln-agent-http.socket hold them under systemd.
  const int grpc_socket = ListenOnLoopback(), http_socket = ListenOnLoopback();
  ASSERT_GE(grpc_socket, 0);
  ASSERT_GE(http_socket, 0);
  listen_fds_ = {grpc_socket, http_socket};
  WriteAssignment("replicas:\n" + Replica("s0", "SERVING"));
  StartAgent();
  EXPECT_EQ(router_grpc_, PortOf(grpc_socket));
  EXPECT_EQ(router_http_, PortOf(http_socket));
  json j = WaitFor([&](const json& j) { return Find(j, "s0")["state"] == "SERVING"; }, "SERVING");
  const int s0 = Find(j, "s0")["pid"];
  for (int i = 0; i < 400 && !Infer(router_grpc_).ok(); ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_TRUE(Infer(router_grpc_).ok());

  // Phases: 0 the first agent serves, 1 it is stopping, 2 no agent runs, 3 the second one
  // serves. A call is counted in the phase it started in.
  std::atomic<int> phase{0};
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, failed{0};
  absl::Mutex mu;
  std::string first_failure;
  std::vector<std::string> raced_goaway;  // ABSL_GUARDED_BY(mu)
  auto count = [&](int started_in, bool success, bool grpc_cancelled, const std::string& what) {
    if (success) {
      ok++;
      return;
    }
    // gRPC 1.51 (Debian's) sends its shutdown GOAWAY in one step: a call that reaches the
    // stopping agent after its shutdown began and before the client read the GOAWAY is
    // cancelled. Only that is allowed, only for calls made while it stopped.
    if (grpc_cancelled && started_in == 1) {
      absl::MutexLock lock(&mu);
      raced_goaway.push_back(what);
      return;
    }
    failed++;
    absl::MutexLock lock(&mu);
    if (first_failure.empty()) first_failure = what + " (phase " + std::to_string(started_in) + ")";
  };
  const std::string rest_body =
      R"({"inputs":[{"name":"input_ids","datatype":"INT64","shape":[1,3],"data":[1,2,3]},)"
      R"({"name":"attention_mask","datatype":"INT64","shape":[1,3],"data":[1,1,1]}]})";
  std::vector<std::thread> load;
  // gRPC on one kept channel (it gets GOAWAY and reconnects), and on a new channel per call.
  load.emplace_back([&]() {
    auto stub = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(router_grpc_), grpc::InsecureChannelCredentials()));
    while (!stop) {
      const int started_in = phase;
      grpc::ClientContext ctx;
      // Up to 60 s, as a call made while no agent runs waits for the next one (below).
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      inference::ModelInferResponse resp;
      grpc::Status st = stub->ModelInfer(&ctx, kiln::testing::EncoderRequest(), &resp);
      count(started_in, st.ok(), st.error_code() == grpc::StatusCode::CANCELLED,
            "grpc (kept channel): " + st.error_message());
    }
  });
  load.emplace_back([&]() {
    while (!stop) {
      const int started_in = phase;
      grpc::Status st = Infer(router_grpc_, nullptr, "", 60);
      count(started_in, st.ok(), st.error_code() == grpc::StatusCode::CANCELLED,
            "grpc (new channel): " + st.error_message());
    }
  });
  // REST, a connection per request. Reads wait up to 60 s: a request made while no agent runs
  // waits in the socket's queue until the next one has started and adopted its replicas.
  load.emplace_back([&]() {
    while (!stop) {
      const int started_in = phase;
      kiln::testing::RawHttpClient c(router_http_, 60);
      bool sent = c.connected() &&
                  c.Send(kiln::testing::Post("/v2/models/encoder/infer", rest_body, "Connection: close\r\n"));
      auto r = sent ? c.Read() : kiln::testing::RawHttpClient::Response{};
      count(started_in, r.code == 200, false, "rest: " + std::to_string(r.code) + " " + r.body);
    }
  });
  // Bounded polls: until the clients have had some answers in this phase.
  auto answered = [&](int more) {
    const int until = ok.load() + more;
    for (int i = 0; i < 2000 && ok.load() < until; ++i) absl::SleepFor(absl::Milliseconds(5));
  };
  answered(15);
  phase = 1;
  StopAgent(SIGTERM);
  phase = 2;
  // Made while no agent runs: they wait in the sockets' queues for the next one.
  grpc::Status grpc_while_down;
  kiln::testing::RawHttpClient::Response rest_while_down;
  std::thread down_probe([&]() { grpc_while_down = Infer(router_grpc_, nullptr, "", 60); });
  std::atomic<bool> rest_sent{false};
  std::thread down_rest([&]() {
    kiln::testing::RawHttpClient c(router_http_, 60);
    if (c.connected() && c.Send(kiln::testing::Post("/v2/models/encoder/infer", rest_body,
                                                     "Connection: close\r\n"))) {
      rest_sent = true;
      rest_while_down = c.Read();
    }
  });
  // Bounded poll: the REST request is in the socket's queue before the next agent starts.
  for (int i = 0; i < 2000 && !rest_sent; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_TRUE(rest_sent);
  StartAgent();
  j = WaitFor([&](const json& j) { return Find(j, "s0")["adopted"] == true; }, "adoption");
  phase = 3;
  answered(15);
  stop = true;
  for (auto& t : load) t.join();
  down_probe.join();
  down_rest.join();
  EXPECT_TRUE(grpc_while_down.ok()) << grpc_while_down.error_message();
  EXPECT_EQ(rest_while_down.code, 200) << rest_while_down.body;
  EXPECT_EQ(failed.load(), 0) << first_failure << "\nthe agent that stopped:\n"
                              << ReadFile(dir_ + "/agent1.log") << "\nthe next one:\n"
                              << ReadFile(log_);
  // A handful at most: each gRPC client's calls on a connection the stopping agent still held
  // (seen: up to 3 of the two clients together, in about one run of ten).
  EXPECT_LE(raced_goaway.size(), 4u) << absl::StrJoin(raced_goaway, "\n");
  EXPECT_GT(ok.load(), 30);
  EXPECT_EQ(Find(j, "s0")["pid"], s0);
  close(grpc_socket);
  close(http_socket);
}

// The router with busy-polling on (off by default) serves through the data socket as it does
// without it: lone calls and several at once, every one answered, none by a gRPC hop.
TEST_F(AgentTest, ABusyPollingRouterServesEveryCall) {
  extra_args_ = {"--router-busy-poll-us", "1000"};
  WriteAssignment("replicas:\n" + Replica("s0", "SERVING"));
  StartAgent();
  WaitFor([&](const json& j) { return Find(j, "s0")["state"] == "SERVING"; }, "SERVING");
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(Infer(router_grpc_).ok()) << i;
  std::vector<std::thread> clients;
  std::atomic<int> failed{0};
  for (int t = 0; t < 4; ++t) {
    clients.emplace_back([&] {
      for (int i = 0; i < 10; ++i) failed += Infer(router_grpc_).ok() ? 0 : 1;
    });
  }
  for (auto& c : clients) c.join();
  EXPECT_EQ(failed.load(), 0);
  std::string metrics = Get("/metrics").second;
  EXPECT_NE(metrics.find("protocol=\"grpc\",transport=\"data_socket\"} 60\n"), std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("protocol=\"grpc\",transport=\"grpc\"} 0\n"), std::string::npos) << metrics;
}

// The value of kiln_router_forwarded_total{protocol, transport} in `metrics`, -1 when absent.
long ForwardedCount(const std::string& metrics, const std::string& protocol,
                    const std::string& transport) {
  const std::string series =
      "protocol=\"" + protocol + "\",transport=\"" + transport + "\"} ";
  size_t at = metrics.find("kiln_router_forwarded_total{");
  if (at == std::string::npos) return -1;
  at = metrics.find(series, at);
  if (at == std::string::npos) return -1;
  return std::atol(metrics.c_str() + at + series.size());
}

TEST_F(AgentTest, RouterSplitsByWeightSticksByKeyAndFailsOverWhenAReplicaDies) {
  std::string v1 = "  - {id: a1, model: encoder, version: \"1\", repository: " + kRepo +
                   ", cpus: 1, state: SERVING}\n";
  std::string v2a = "  - {id: b1, model: encoder, version: \"2\", repository: " + kRepo +
                    ", cpus: 1, state: SERVING}\n";
  WriteAssignment("replicas:\n" + v1 + v2a +
                  "routes:\n  - model: encoder\n    versions: [{version: \"1\", weight: 50}, "
                  "{version: \"2\", weight: 50}]\n    stickyKey: header:x-user-id\n");
  StartAgent();
  WaitFor([&](const json& j) {
    return Find(j, "a1")["state"] == "SERVING" && Find(j, "b1")["state"] == "SERVING";
  }, "two versions SERVING");
  // Weighted split without a key; the same key always lands on the same version.
  std::map<std::string, int> seen;
  for (int i = 0; i < 40; ++i) {
    std::string v;
    ASSERT_TRUE(Infer(router_grpc_, &v).ok());
    seen[v]++;
  }
  EXPECT_GT(seen["1"], 5);
  EXPECT_GT(seen["2"], 5);
  for (const char* user : {"alice", "bob", "carol"}) {
    std::string first;
    ASSERT_TRUE(Infer(router_grpc_, &first, user).ok());
    for (int i = 0; i < 5; ++i) {
      std::string again;
      ASSERT_TRUE(Infer(router_grpc_, &again, user).ok());
      EXPECT_EQ(again, first) << user;
    }
  }
  // Local replicas are reached through their data sockets, not a second gRPC hop.
  {
    json j = WaitFor([&](const json& j) { return !Find(j, "a1").is_null(); }, "a1 listed");
    EXPECT_NE(Find(j, "a1")["data_socket"].get<std::string>(), "");
    EXPECT_NE(Find(j, "b1")["data_socket"].get<std::string>(), "");
    std::string metrics = Get("/metrics").second;
    EXPECT_GE(ForwardedCount(metrics, "grpc", "data_socket"), 55) << metrics;  // 40 + 3 x 6 above
    EXPECT_EQ(ForwardedCount(metrics, "grpc", "grpc"), 0) << metrics;
  }
  // REST through the router says which version served.
  web::http::client::http_client c("http://127.0.0.1:" + std::to_string(router_http_));
  json body = {{"inputs",
                {{{"name", "input_ids"}, {"datatype", "INT64"}, {"shape", {1, 3}}, {"data", {1, 2, 3}}},
                 {{"name", "attention_mask"}, {"datatype", "INT64"}, {"shape", {1, 3}}, {"data", {1, 1, 1}}}}}};
  web::http::http_request req(web::http::methods::POST);
  req.set_request_uri("/v2/models/encoder/versions/2/infer");
  req.set_body(body.dump(), "application/json");
  auto resp = c.request(req).get();
  EXPECT_EQ(resp.status_code(), 200);
  EXPECT_EQ(resp.headers().find("kiln-version")->second, "2");
  json out = json::parse(resp.extract_utf8string(true).get());
  EXPECT_EQ(out["parameters"]["kiln-version"], "2");
  EXPECT_EQ(out["model_version"], "2");
  {
    // Through the replica's data socket too, not a second HTTP hop.
    std::string metrics = Get("/metrics").second;
    EXPECT_EQ(ForwardedCount(metrics, "rest", "data_socket"), 1) << metrics;
    EXPECT_EQ(ForwardedCount(metrics, "rest", "http"), 0) << metrics;
  }

  // Only version 2 from now on, with two replicas; then one of them is killed under load.
  std::string v2b = "  - {id: b2, model: encoder, version: \"2\", repository: " + kRepo +
                    ", cpus: 1, state: SERVING}\n";
  // Two CPUs on this machine: a1 goes first, then b2 takes its CPU.
  std::string route2 = "routes:\n  - model: encoder\n    versions: [{version: \"2\", weight: 1}]\n";
  WriteAssignment("replicas:\n" + v2a + route2);
  Hup();
  WaitFor([&](const json& j) { return Find(j, "a1").is_null(); }, "a1 gone");
  WriteAssignment("replicas:\n" + v2a + v2b + route2);
  Hup();
  json j = WaitFor([&](const json& j) { return Find(j, "b2")["state"] == "SERVING"; },
                   "b1 + b2 SERVING");
  int victim = Find(j, "b1")["pid"];
  std::atomic<int> ok{0}, failed{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> load;
  for (int t = 0; t < 3; ++t) {
    load.emplace_back([&]() {
      for (int i = 0; i < 400 && !stop.load(); ++i) {
        (Infer(router_grpc_).ok() ? ok : failed)++;
      }
    });
  }
  // Bounded poll until the load is flowing, then kill a replica under it.
  for (int i = 0; i < 1000 && ok.load() < 20; ++i) absl::SleepFor(absl::Milliseconds(5));
  kill(victim, SIGKILL);
  j = WaitFor([&](const json& j) {
    auto r = Find(j, "b1");
    return r["pid"] != victim && r["state"] == "SERVING";
  }, "b1 restarted");
  stop = true;
  for (auto& t : load) t.join();
  EXPECT_GT(ok.load(), 50);
  EXPECT_EQ(failed.load(), 0) << "requests failed while a replica died";
  EXPECT_EQ(Find(j, "b1")["restarts"], 1);
}

// A controller that lives in the test: records what the agent says, sends what the test says.
class FakeController final : public v1::ControlPlane::Service {
 public:
  grpc::Status Connect(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<v1::ControllerMessage, v1::AgentMessage>* stream)
      override {
    {
      absl::MutexLock lock(&mu_);
      stream_ = stream;
      sessions_++;
    }
    v1::AgentMessage m;
    while (stream->Read(&m)) {
      absl::MutexLock lock(&mu_);
      if (m.has_register_()) registers_.push_back(m.register_());
      if (m.has_status()) statuses_.push_back(m.status());
      if (m.has_ack()) acks_.push_back(m.ack());
      if (m.has_nack()) nacks_.push_back(m.nack());
    }
    absl::MutexLock lock(&mu_);
    stream_ = nullptr;
    return grpc::Status::OK;
  }
  bool Send(const v1::ControllerMessage& m) {
    absl::MutexLock lock(&mu_);
    return stream_ != nullptr && stream_->Write(m);
  }
  template <typename F>
  bool WaitFor(F pred, absl::Duration timeout = absl::Seconds(60)) {
    absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      {
        absl::MutexLock lock(&mu_);
        if (pred(*this)) return true;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }
  // Read under WaitFor's lock.
  std::vector<v1::Register> registers_;
  std::vector<v1::NodeStatus> statuses_;
  std::vector<v1::Ack> acks_;
  std::vector<v1::Nack> nacks_;
  int sessions_ = 0;

 private:
  absl::Mutex mu_;
  grpc::ServerReaderWriter<v1::ControllerMessage, v1::AgentMessage>* stream_ = nullptr;
};

std::unique_ptr<grpc::Server> ServeController(FakeController* c, int* port) {
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:" + std::to_string(*port), grpc::InsecureServerCredentials(), port);
  b.RegisterService(c);
  return b.BuildAndStart();
}

TEST_F(AgentTest, ControllerAssignsAgentAcksReportsAndServesThroughOutages) {
  auto controller = std::make_unique<FakeController>();
  int port = 0;
  auto server = ServeController(controller.get(), &port);
  ASSERT_GT(port, 0);
  std::string address = "127.0.0.1:" + std::to_string(port);
  StartAgent(address);
  ASSERT_TRUE(controller->WaitFor([](FakeController& c) { return !c.registers_.empty(); }));
  v1::ControllerMessage m;
  auto* a = m.mutable_assignment();
  a->set_generation(1);
  auto* r = a->add_replicas();
  r->set_replica_id("c0");
  r->set_model("encoder");
  r->set_version("2");
  r->set_repository(kRepo);
  r->set_gpu(-1);
  r->set_cpus(1);
  r->set_state(v1::SERVING);
  ASSERT_TRUE(controller->Send(m));
  v1::ControllerMessage rt;
  rt.mutable_routing_table()->set_generation(7);
  auto* route = rt.mutable_routing_table()->add_routes();
  route->set_model("encoder");
  auto* rv = route->add_versions();
  rv->set_version("2");
  rv->set_weight(1);
  ASSERT_TRUE(controller->Send(rt));
  ASSERT_TRUE(controller->WaitFor([](FakeController& c) {
    int got = 0;
    for (const auto& ack : c.acks_) {
      if ((ack.kind() == v1::Ack::ASSIGNMENT && ack.generation() == 1) ||
          (ack.kind() == v1::Ack::ROUTING_TABLE && ack.generation() == 7)) {
        got++;
      }
    }
    return got == 2;
  }));
  // Status every second: the replica SERVING, with its load, and the generations applied.
  ASSERT_TRUE(controller->WaitFor([](FakeController& c) {
    if (c.statuses_.empty()) return false;
    const auto& s = c.statuses_.back();
    return s.replicas_size() == 1 && s.replicas(0).state() == v1::SERVING &&
           s.replicas(0).healthy() && s.assignment_generation() == 1 && s.routing_generation() == 7;
  })) << ReadFile(log_);
  EXPECT_TRUE(Infer(router_grpc_).ok());
  {
    ASSERT_TRUE(controller->WaitFor([](FakeController& c) {
      return !c.statuses_.empty() && c.statuses_.back().replicas(0).load().requests() >= 1;
    }));
  }
  // A bad assignment is Nack'd with the reason; the old one stays.
  v1::ControllerMessage bad = m;
  bad.mutable_assignment()->set_generation(2);
  bad.mutable_assignment()->mutable_replicas(0)->set_version("two");
  ASSERT_TRUE(controller->Send(bad));
  // The last Nack is of `generation`, its reason holding `text`.
  auto nacked = [](int64_t generation, std::string text) {
    return [generation, text](FakeController& c) {
      return !c.nacks_.empty() && c.nacks_.back().generation() == generation &&
             c.nacks_.back().reason().find(text) != std::string::npos;
    };
  };
  ASSERT_TRUE(controller->WaitFor(nacked(2, "replicas[0].version")));
  // One that cannot be saved (the disk refuses the file) is not applied and not Acked: a
  // restart would not find it. The agent tries it again by itself (the controller does not
  // resend it): once the disk takes it, it is applied and Acked.
  fs::create_directories(dir_ + "/s/assignment.pb.tmp");
  v1::ControllerMessage unsaved = m;
  unsaved.mutable_assignment()->set_generation(3);
  ASSERT_TRUE(controller->Send(unsaved));
  ASSERT_TRUE(controller->WaitFor(nacked(3, "cannot be saved"))) << ReadFile(log_);
  auto acked = [](int64_t generation) {
    return [generation](FakeController& c) {
      for (const auto& ack : c.acks_) {
        if (ack.kind() == v1::Ack::ASSIGNMENT && ack.generation() == generation) return true;
      }
      return false;
    };
  };
  EXPECT_FALSE(controller->WaitFor(acked(3), absl::Milliseconds(1500)));  // not while unsaved
  fs::remove_all(dir_ + "/s/assignment.pb.tmp");
  ASSERT_TRUE(controller->WaitFor(acked(3))) << ReadFile(log_);
  EXPECT_NE(ReadFile(log_).find("assignment generation 3 saved and applied after all"),
            std::string::npos);
  // The controller goes away: the node keeps serving what it had.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  server.reset();
  // Bounded poll until the agent has noticed.
  for (int i = 0; i < 1000 && ReadFile(log_).find("disconnected; retrying") == std::string::npos; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_NE(ReadFile(log_).find("serving the last assignment meanwhile"), std::string::npos);
  EXPECT_TRUE(Infer(router_grpc_).ok());
  EXPECT_TRUE(Ready());
  // It comes back on the same port: the agent reconnects and re-registers with its replicas.
  controller = std::make_unique<FakeController>();
  server = ServeController(controller.get(), &port);
  ASSERT_TRUE(server != nullptr);
  ASSERT_TRUE(controller->WaitFor([](FakeController& c) {
    return !c.registers_.empty() && c.registers_.back().replicas_size() == 1;
  })) << ReadFile(log_);
  EXPECT_EQ(controller->registers_.back().replicas(0).replica_id(), "c0");
  // The agent restarts while the controller is gone: it serves the last assignment it was
  // given (persisted), with its replica adopted.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  server.reset();
  int pid = Find(Replicas(), "c0")["pid"];
  StopAgent(SIGTERM);
  StartAgent(address);
  json j = WaitFor([&](const json& j) { return Find(j, "c0")["adopted"] == true; }, "adoption");
  EXPECT_EQ(Find(j, "c0")["pid"], pid);
  for (int i = 0; i < 200 && !Ready(); ++i) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(Ready());
  EXPECT_TRUE(Infer(router_grpc_).ok());
}

TEST_F(AgentTest, UnderSystemdReplicaEventsGoToTheJournalWithFields) {
  // A stand-in journald: the datagram socket sd_journal_send writes to.
  const std::string path = "/run/systemd/journal/socket";
  if (fs::exists(path)) GTEST_SKIP() << "a real journald is running here";
  fs::create_directories("/run/systemd/journal");
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  timeval tv{0, 200 * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  WriteAssignment("replicas:\n" + Replica("j0", "SERVING", 0));
  StartAgent("", /*journal=*/true);
  WaitFor([&](const json& j) { return Find(j, "j0")["state"] == "SERVING"; }, "SERVING");
  std::string seen;
  char buf[65536];
  for (int i = 0; i < 100; ++i) {  // bounded: what has been sent is already queued
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    seen.append(buf, static_cast<size_t>(n));
    if (seen.find("promoted to SERVING") != std::string::npos) break;
  }
  close(fd);
  fs::remove(path);
  EXPECT_NE(seen.find("REPLICA=j0\n"), std::string::npos) << seen;
  EXPECT_NE(seen.find("MODEL=encoder\n"), std::string::npos) << seen;
  EXPECT_NE(seen.find("VERSION=2\n"), std::string::npos) << seen;
  EXPECT_NE(seen.find("GPU_UUID=GPU-fake"), std::string::npos) << seen;
  EXPECT_NE(seen.find("SYSLOG_IDENTIFIER=kiln-agent"), std::string::npos) << seen;
  // Not also written to stderr.
  EXPECT_EQ(ReadFile(log_).find("replica j0: promoted to SERVING"), std::string::npos);
}

TEST(AgentFlagsTest, BadFlagsAndFilesAreClearErrors) {
  struct Case {
    std::vector<std::string> args;
    std::string expect;
  };
  std::string dir = "/tmp/kaf" + std::to_string(getpid());
  fs::create_directories(dir);
  std::ofstream(dir + "/bad.yaml") << "replicas: [{model: e, version: '1', repository: /m, state: HOT}]\n";
  std::vector<Case> cases = {
      {{"--gpu-power", "maybe"}, "--gpu-power"},
      {{"--fake-gpus", "lots"}, "--fake-gpus"},
      {{"--state-dir", "relative"}, "--state-dir"},
      {{"--runtime-binary", "/nonexistent"}, "--runtime-binary"},
      {{"--assignment-file", dir + "/missing.yaml"}, "missing.yaml"},
      {{"--assignment-file", dir + "/bad.yaml"}, "replicas[0].state"},
      {{"--sysfs-root", "/nonexistent"}, "--sysfs-root"},
      {{"--assignment-file", dir + "/bad.yaml", "--controller", "127.0.0.1:1"}, "--controller"},
      {{"--prestart-per-gpu", "17"}, "--prestart-per-gpu: must be in 0..16"},
      {{"--prestart-cpu", "-1"}, "--prestart-cpu: must be in 0..16"},
      {{"--router-busy-poll-us", "-5"}, "--router-busy-poll-us: must be in 0..100000"},
      {{"--router-busy-poll-us", "200000"}, "--router-busy-poll-us: must be in 0..100000"},
      {{"--router-busy-poll-threads", "65"}, "--router-busy-poll-threads: must be in 0..64"},
      {{"--router-http-threads", "0"}, "--router-http-threads: must be in 1..64"},
      {{"--router-http-threads", "65"}, "--router-http-threads: must be in 1..64"},
      {{"--start-timeout-ms", "-1"}, "--start-timeout-ms: must be in 0..86400000"},
      {{"--inference-probe-interval-ms", "50"},
       "--inference-probe-interval-ms: must be 0 (off) or in 100..3600000, got 50"},
      {{"--inference-probe-interval-ms", "-1"}, "--inference-probe-interval-ms: must be 0"},
      {{"--inference-probe-timeout-ms", "0"}, "--inference-probe-timeout-ms: must be in 10..60000"},
      {{"--inference-probe-timeout-ms", "60001"}, "--inference-probe-timeout-ms: must be in 10..60000"},
      {{"--inference-probe-failures", "101"}, "--inference-probe-failures: must be in 0..100"},
      {{"--inference-probe-failures", "-1"}, "--inference-probe-failures: must be in 0..100"},
      {{"--stop-timeout-ms", "-5"}, "--stop-timeout-ms: must be in 0..3600000, got -5"},
      {{"--stop-timeout-ms", "3600001"}, "--stop-timeout-ms: must be in 0..3600000"},
      {{"--runtime-log-level", "verbose"}, "--runtime-log-level: log level 'verbose'"},
      {{"--runtime-malloc-huge-pages", "maybe"}, "--runtime-malloc-huge-pages = maybe"},
      {{"--runtime-idle-spin-us", "-1"}, "--runtime-idle-spin-us: must be in 0..10000, got -1"},
      {{"--runtime-idle-spin-us", "10001"}, "--runtime-idle-spin-us: must be in 0..10000"},
      {{"--runtime-model-cpus", "-1"}, "--runtime-model-cpus: must be in 0..1024, got -1"},
  };
  for (const auto& c : cases) {
    std::string cmd = std::string(KILN_AGENT_BIN) + " --runtime-binary " + KILN_RUNTIME_BIN +
                      " --state-dir " + dir + "/s --admin-port 0";
    for (const auto& a : c.args) cmd += " '" + a + "'";
    cmd += " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    std::string out;
    char buf[512];
    while (fgets(buf, sizeof(buf), p)) out += buf;
    int status = pclose(p);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << c.expect << ": " << out;
    EXPECT_NE(out.find(c.expect), std::string::npos) << c.expect << ": " << out;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kiln
