// The supervisor with a fake launcher, fake runtimes and simulated time.
#include "agent/supervisor.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "agent/fake_runtime_client.h"
#include "agent/router.h"
#include "gtest/gtest.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "tests/support/eventually.h"
#include "tests/support/held_runtime_control.h"
#include "tests/support/shell.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

Topology TwoNodeTopology() {
  Topology t;
  for (int c = 0; c < 16; ++c) t.online_cpus.push_back(c);
  t.allowed_cpus = t.online_cpus;
  t.numa_nodes = {{0, {0, 1, 2, 3, 4, 5, 6, 7}, 0}, {1, {8, 9, 10, 11, 12, 13, 14, 15}, 0}};
  GpuTopology g0;
  g0.identity.uuid = "GPU-0";
  g0.numa_node = 0;
  g0.local_cpus = t.numa_nodes[0].cpus;
  GpuTopology g1 = g0;
  g1.identity.uuid = "GPU-1";
  g1.numa_node = 1;
  g1.local_cpus = t.numa_nodes[1].cpus;
  t.gpus = {g0, g1};
  return t;
}

v1::ReplicaSpec Spec(const std::string& id, int gpu, int cpus, v1::LifecycleState state,
                     const std::string& version = "1") {
  v1::ReplicaSpec s;
  s.set_replica_id(id);
  s.set_model("enc");
  s.set_version(version);
  s.set_repository("/models");
  s.set_gpu(gpu);
  s.set_cpus(cpus);
  s.set_state(state);
  return s;
}

class SupervisorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Short: control sockets live under it (at most 107 bytes for a unix socket path).
    dir_ = fs::temp_directory_path() /
           ("kiln_sup_" + std::to_string(getpid()) + "_" +
            std::to_string(std::hash<std::string>()(
                               ::testing::UnitTest::GetInstance()->current_test_info()->name()) %
                           1000000));
    fs::remove_all(dir_);
    options_.runtime_binary = "/usr/bin/kiln-runtime";
    options_.state_dir = dir_.string();
    options_.stop_timeout = absl::Seconds(10);
    options_.probe_threads = 0;  // probes run inside the tick that sends them
    sup_ = MakeSupervisor();
  }
  void TearDown() override {
    prober_.Hold(false);  // a probe left held would keep the supervisor's probe thread
    sup_.reset();
    fs::remove_all(dir_);
  }
  std::unique_ptr<Supervisor> MakeSupervisor() {
    return std::make_unique<Supervisor>(options_, TwoNodeTopology(), &launcher_, &runtimes_,
                                        &clock_, [this](const std::string& s) { log_.push_back(s); },
                                        &prober_);
  }
  std::string Socket(const std::string& id) { return dir_.string() + "/sockets/" + id + ".sock"; }
  const ReplicaView* View(const std::string& id) {
    snapshot_ = sup_->Snapshot();
    for (const auto& v : *snapshot_) {
      if (v.spec.replica_id() == id) return &v;
    }
    return nullptr;
  }
  std::string Arg(const LaunchRequest& r, const std::string& flag) {
    for (size_t i = 0; i + 1 < r.argv.size(); ++i) {
      if (r.argv[i] == flag) return r.argv[i + 1];
    }
    return "";
  }
  // The GLIBC_TUNABLES entries of a launch, joined; what the agent adds by default.
  static std::string TunablesOf(const LaunchRequest& r) {
    std::string out;
    for (const auto& e : r.env) {
      if (e.rfind("GLIBC_TUNABLES=", 0) == 0) out += (out.empty() ? "" : ";") + e;
    }
    return out;
  }
  static std::string ExpectedTunables() { return MallocHugePagesTunable(getenv("GLIBC_TUNABLES")); }
  // Bounded: advances the clock in 1 s steps, ticking, until something is launched (at most
  // 120 s); returns how long that took.
  absl::Duration AdvanceUntilALaunch() {
    const size_t before = launcher_.launches().size();
    absl::Duration waited;
    for (int s = 0; s < 120 && launcher_.launches().size() == before; ++s) {
      clock_.Advance(absl::Seconds(1));
      waited += absl::Seconds(1);
      sup_->Tick();
    }
    return waited;
  }
  // Replica "a" SERVING at port 6001 under a supervisor with a probe thread, its first probe
  // sent and held by the prober.
  void StartWithAHeldProbe() {
    options_.probe_threads = 1;
    sup_ = MakeSupervisor();
    ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
    sup_->Tick();
    runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 6001);
    prober_.Hold(true);
    sup_->Tick();
    ASSERT_TRUE(kiln::testing::Eventually([&] { return prober_.probes("127.0.0.1:6001") == 1; },
                                          absl::Seconds(10)));
  }
  // Replicas a (GPU 0) and b (on `b_gpu`) SERVING, then the supervisor gone: the state file it
  // left, and their pids.
  nlohmann::json TwoServingThenGone(int b_gpu, pid_t* a, pid_t* b) {
    EXPECT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", b_gpu, 1, v1::SERVING)})).ok());
    sup_->Tick();
    *a = View("a")->pid;
    *b = View("b")->pid;
    runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 7001);
    runtimes_.Set(Socket("b"), v1::SERVING, "enc", "1", 7002);
    sup_->Tick();
    sup_.reset();
    return nlohmann::json::parse(kiln::testing::ReadFile(dir_.string() + "/replicas.json"));
  }
  v1::Assignment Assignment(std::vector<v1::ReplicaSpec> specs, int64_t generation = 1) {
    v1::Assignment a;
    a.set_generation(generation);
    for (auto& s : specs) *a.add_replicas() = s;
    return a;
  }

  fs::path dir_;
  SupervisorOptions options_;
  SimulatedClock clock_;
  FakeProcessLauncher launcher_;
  FakeRuntimeClientFactory runtimes_;
  FakeInferenceProber prober_;
  std::vector<std::string> log_;
  std::unique_ptr<Supervisor> sup_;
  std::shared_ptr<const std::vector<ReplicaView>> snapshot_;
};

TEST_F(SupervisorTest, StartsReplicasPinnedAndPromotesToTheirState) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING), Spec("b", -1, 1, v1::WARM)})).ok());
  sup_->Tick();
  auto launches = launcher_.launches();
  ASSERT_EQ(launches.size(), 2u);
  const LaunchRequest& a = launches[0];
  EXPECT_EQ(Arg(a, "--initial-state"), "warm");
  EXPECT_EQ(Arg(a, "--device"), "cuda:0");
  EXPECT_EQ(Arg(a, "--threads"), "2");
  EXPECT_EQ(Arg(a, "--replica-id"), "a");
  EXPECT_EQ(Arg(a, "--control-socket"), Socket("a"));
  EXPECT_EQ(a.cpus, (std::vector<int>{8, 9}));  // local to GPU 1
  EXPECT_EQ(a.memory_node, 1);
  EXPECT_NE(std::find(a.env.begin(), a.env.end(), "CUDA_VISIBLE_DEVICES=GPU-1"), a.env.end());
  EXPECT_EQ(Arg(launches[1], "--device"), "cpu");
  for (const LaunchRequest& l : launches) EXPECT_EQ(TunablesOf(l), ExpectedTunables()) << l.env.size();
  // Node 0 has 7 free CPUs (CPU 0 is the agent's), node 1 has 6 after a: node 0.
  EXPECT_EQ(launches[1].cpus, (std::vector<int>{1}));
  EXPECT_EQ(View("a")->phase, "STARTING");
  EXPECT_FALSE(sup_->Converged());

  runtimes_.Set(Socket("a"), v1::WARM, "enc", "1", 5001);
  runtimes_.Set(Socket("b"), v1::WARM, "enc", "1", 5002);
  sup_->Tick();
  EXPECT_EQ(runtimes_.Get(Socket("a")).promotes, 1);
  EXPECT_EQ(runtimes_.Get(Socket("b")).promotes, 0);
  EXPECT_EQ(View("a")->state, v1::SERVING);
  EXPECT_EQ(View("a")->grpc_port, 5001);
  EXPECT_EQ(View("b")->state, v1::WARM);
  EXPECT_TRUE(sup_->Converged());
  EXPECT_EQ(sup_->applied_generation(), 1);

  // The same assignment with b now SERVING: a promote, no restart.
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING), Spec("b", -1, 1, v1::SERVING)}, 2)).ok());
  sup_->Tick();
  EXPECT_EQ(runtimes_.Get(Socket("b")).promotes, 1);
  EXPECT_EQ(launcher_.launches().size(), 2u);
}

// The agent's loop does not wait on a wedged runtime: with the agent's real control client,
// a GetState the runtime holds leaves Tick at once (the call's own timeout is a minute here),
// the replica stays in routing (one unanswered call is no verdict), and the answer is taken
// on a later pass once it comes.

// --runtime-idle-spin-us: each runtime is started with its --idle-spin-us; off (0, the
// default), the flag is not given at all.
TEST_F(SupervisorTest, AnIdleSpinIsGivenToEachRuntime) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING)})).ok());
  sup_->Tick();
  ASSERT_EQ(launcher_.launches().size(), 1u);
  const std::vector<std::string> off = launcher_.launches()[0].argv;
  EXPECT_EQ(std::find(off.begin(), off.end(), "--idle-spin-us"), off.end());

  options_.runtime_idle_spin_us = 150;
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("b", -1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  auto launches = launcher_.launches();
  ASSERT_EQ(launches.size(), 2u);
  EXPECT_EQ(Arg(launches[1], "--idle-spin-us"), "150");
}

// --runtime-model-cpus: each runtime is started with its --model-cpus; off (0, the default),
// the flag is not given at all.
TEST_F(SupervisorTest, ModelCpusAreGivenToEachRuntime) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING)})).ok());
  sup_->Tick();
  ASSERT_EQ(launcher_.launches().size(), 1u);
  const std::vector<std::string> off = launcher_.launches()[0].argv;
  EXPECT_EQ(std::find(off.begin(), off.end(), "--model-cpus"), off.end());

  options_.runtime_model_cpus = 2;
  sup_ = MakeSupervisor();
  // Four CPUs: the model's two get one intra-op thread each. One CPU: the runtime will not
  // split it, and its one thread is the replica's.
  ASSERT_TRUE(
      sup_->Apply(Assignment({Spec("b", -1, 4, v1::SERVING), Spec("c", -1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  auto launches = launcher_.launches();
  ASSERT_EQ(launches.size(), 3u);
  std::map<std::string, std::string> threads_of;  // replica -> its --threads
  for (size_t i : {1u, 2u}) {
    EXPECT_EQ(Arg(launches[i], "--model-cpus"), "2") << i;
    threads_of[Arg(launches[i], "--replica-id")] = Arg(launches[i], "--threads");
  }
  EXPECT_EQ(threads_of["b"], "2");
  EXPECT_EQ(threads_of["c"], "1");
}

// --runtime-malloc-huge-pages=false: replicas start with the agent's environment only.
TEST_F(SupervisorTest, MallocOnHugePagesIsTheOperatorsToTurnOff) {
  options_.runtime_malloc_huge_pages = false;
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING)})).ok());
  sup_->Tick();
  auto launches = launcher_.launches();
  ASSERT_EQ(launches.size(), 1u);
  EXPECT_EQ(TunablesOf(launches[0]), "");
  EXPECT_EQ(launches[0].env, std::vector<std::string>{"CUDA_VISIBLE_DEVICES=GPU-1"});
}
TEST_F(SupervisorTest, ATickDoesNotWaitForAWedgedRuntime) {
  std::atomic<int> late{0};
  GrpcRuntimeClientFactory clients(absl::Minutes(1), absl::Milliseconds(10), [&] { ++late; });
  sup_ = std::make_unique<Supervisor>(options_, TwoNodeTopology(), &launcher_, &clients, &clock_,
                                      [this](const std::string& s) { log_.push_back(s); },
                                      &prober_);
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();  // launched
  kiln::testing::HeldRuntimeControl runtime(Socket("a"), v1::WARM);
  ASSERT_NE(runtime.server(), nullptr);
  // Bounded: the channel connects once the socket is there; then WARM, then promoted.
  ASSERT_TRUE(kiln::testing::Eventually(
      [&] {
        sup_->Tick();
        const ReplicaView* v = View("a");
        return v && v->state == v1::SERVING && v->healthy;
      },
      absl::Seconds(10)));
  EXPECT_EQ(runtime.calls("Promote").size(), 1u);

  runtime.Hold("GetState", true);
  std::atomic<bool> ticked{false};
  std::thread pass([&] {
    sup_->Tick();
    ticked = true;
  });
  const bool came_back = kiln::testing::Eventually([&] { return ticked.load(); },
                                                   absl::Seconds(10));
  // The call did reach the runtime, which holds it still: the pass came back without it.
  const bool held = kiln::testing::Eventually(
      [&] { return runtime.held_now("GetState") == 1; }, absl::Seconds(10));
  runtime.Hold("GetState", false);  // lets a pass that waited go on
  pass.join();
  ASSERT_TRUE(came_back) << "the pass waited for the runtime's answer";
  EXPECT_TRUE(held);
  EXPECT_TRUE(View("a")->healthy);
  EXPECT_EQ(View("a")->state, v1::SERVING);
  for (const auto& line : log_) EXPECT_EQ(line.find("not answering"), std::string::npos) << line;
  // The answer comes, says so, and the next pass takes it.
  ASSERT_TRUE(kiln::testing::Eventually([&] { return late.load() >= 1; }, absl::Seconds(10)));
  const size_t asked = runtime.calls("GetState").size();
  sup_->Tick();
  EXPECT_EQ(runtime.calls("GetState").size(), asked);  // taken, not asked again
  EXPECT_TRUE(View("a")->healthy);
  sup_.reset();  // its clients tell `late`
}

TEST_F(SupervisorTest, TheDeviceMemoryARuntimeReportsIsKeptPerReplica) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING)})).ok());
  sup_->Tick();
  EXPECT_EQ(View("a")->device_memory_bytes, 0);  // not reported yet
  runtimes_.Set(Socket("a"), v1::WARM, "enc", "1", 5001);
  runtimes_.SetDeviceMemory(Socket("a"), 1200LL << 20);
  sup_->Tick();
  EXPECT_EQ(View("a")->device_memory_bytes, 1200LL << 20);
  // Graph capture finishes later and the figure grows: the next observation has it.
  runtimes_.SetDeviceMemory(Socket("a"), 2830LL << 20);
  sup_->Tick();
  EXPECT_EQ(View("a")->device_memory_bytes, 2830LL << 20);
}

TEST_F(SupervisorTest, CrashesRestartWithBackoffAndCrashLoopsAreReported) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  std::vector<absl::Duration> waits;
  for (int crash = 0; crash < 6; ++crash) {
    pid_t pid = View("a")->pid;
    ASSERT_GT(pid, 0);
    launcher_.Exit(pid, SIGKILL);
    sup_->Tick();
    EXPECT_EQ(View("a")->pid, 0);
    waits.push_back(AdvanceUntilALaunch());
    if (crash == 5) {
      EXPECT_TRUE(View("a")->crash_loop);
      EXPECT_EQ(View("a")->restarts, 6);
    }
  }
  EXPECT_EQ(waits, (std::vector<absl::Duration>{absl::Seconds(1), absl::Seconds(2),
                                                absl::Seconds(4), absl::Seconds(8),
                                                absl::Seconds(16), absl::Seconds(60)}));
  // The CPUs stay with the replica across restarts.
  auto launches = launcher_.launches();
  EXPECT_EQ(launches.front().cpus, launches.back().cpus);
}

TEST_F(SupervisorTest, RemovedReplicasDrainThenAreKilledPastTheTimeout) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  pid_t a = View("a")->pid, b = View("b")->pid;
  runtimes_.Set(Socket("a"), v1::WARM, "enc", "1");
  runtimes_.Set(Socket("b"), v1::WARM, "enc", "1");
  sup_->Tick();
  ASSERT_TRUE(sup_->Apply(Assignment({}, 2)).ok());
  auto sigs = launcher_.signals();
  EXPECT_EQ(sigs, (std::vector<std::pair<pid_t, int>>{{a, SIGTERM}, {b, SIGTERM}}));
  EXPECT_EQ(View("a")->phase, "STOPPING");
  launcher_.ExitCode(a, 0);  // a drains and exits
  sup_->Tick();
  EXPECT_EQ(View("a"), nullptr);
  clock_.Advance(absl::Seconds(10));  // b does not
  sup_->Tick();
  EXPECT_EQ(launcher_.signals().back(), std::make_pair(b, SIGKILL));
  launcher_.Exit(b, SIGKILL);
  sup_->Tick();
  EXPECT_EQ(View("b"), nullptr);
  EXPECT_EQ(launcher_.launches().size(), 2u);  // never restarted
}

TEST_F(SupervisorTest, AnAssignmentThatDoesNotFitIsRejectedWhole) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 4, v1::SERVING)})).ok());
  // GPU 0's node has 8 CPUs, one kept for the agent, 4 taken: 3 left.
  auto s = sup_->Apply(Assignment({Spec("a", 0, 4, v1::SERVING), Spec("b", 0, 4, v1::SERVING)}, 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("replica b"), std::string::npos);
  EXPECT_EQ(sup_->applied_generation(), 1);
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), 1u);
  EXPECT_FALSE(sup_->Apply(Assignment({Spec("a", 0, 4, v1::SERVING, "2")}, 3)).ok());  // same id, new version
  EXPECT_FALSE(sup_->Apply(Assignment({Spec("x", 7, 1, v1::SERVING)}, 3)).ok());      // no GPU 7
}

// Ids run to 128 characters, more than a unix socket path under --state-dir has room for: a
// long one's control socket is named by the id's start and a hash of all of it.
TEST_F(SupervisorTest, ALongIdGetsAControlSocketThatFits) {
  const size_t room = 99 - (dir_.string() + "/sockets/.KKK.sock").size();
  const std::string fits(room, 'x');
  const std::string long1(128, 'y');
  const std::string long2 = std::string(127, 'y') + "z";  // the same start
  ASSERT_TRUE(sup_->Apply(Assignment({Spec(fits, 0, 1, v1::SERVING), Spec(long1, 0, 1, v1::SERVING),
                                      Spec(long2, 1, 1, v1::SERVING)}))
                  .ok());
  sup_->Tick();
  ASSERT_EQ(launcher_.launches().size(), 3u);
  EXPECT_EQ(View(fits)->phase, "STARTING");
  EXPECT_EQ(View(long1)->phase, "STARTING") << View(long1)->last_error;
  EXPECT_EQ(View(long2)->phase, "STARTING") << View(long2)->last_error;
  std::set<std::string> sockets;
  for (const auto& l : launcher_.launches()) {
    const std::string socket = Arg(l, "--control-socket");
    EXPECT_LE(socket.size(), 99u) << socket;
    EXPECT_EQ(socket.rfind(dir_.string() + "/sockets/", 0), 0u) << socket;
    sockets.insert(socket);
  }
  EXPECT_EQ(sockets.size(), 3u);  // each its own
  EXPECT_TRUE(sockets.count(dir_.string() + "/sockets/" + fits + ".sock"));
  // The id itself is unchanged: its log file and what its runtime is told.
  EXPECT_EQ(Arg(launcher_.launches()[1], "--replica-id"), long1);
}

// A full node told to swap a replica for another (a canary for a stable one): the assignment
// is taken, not refused; the new replica waits for the CPUs of the one on its way out and
// starts once it is gone.
TEST_F(SupervisorTest, ANewReplicaWaitsForTheCpusOfOneOnItsWayOut) {
  // GPU 0's node: 8 CPUs, one kept for the agent: a (4) and b (3) fill it.
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 4, v1::SERVING), Spec("b", 0, 3, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t b = View("b")->pid;
  const auto b_cpus = View("b")->cpus;
  ASSERT_EQ(launcher_.launches().size(), 2u);
  auto s = sup_->Apply(Assignment({Spec("a", 0, 4, v1::SERVING), Spec("c", 0, 3, v1::SERVING, "2")}, 2));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(sup_->applied_generation(), 2);
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), 2u);  // c waits
  EXPECT_EQ(View("b")->phase, "STOPPING");
  EXPECT_EQ(View("c")->cpus, b_cpus);
  bool said = false;
  for (const auto& line : log_) said |= line.find("replica c: waits for CPU") != std::string::npos;
  EXPECT_TRUE(said);
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), 2u);
  launcher_.ExitCode(b, 0);  // b drained
  sup_->Tick();
  ASSERT_EQ(launcher_.launches().size(), 3u);
  EXPECT_EQ(Arg(launcher_.launches().back(), "--version"), "2");
  EXPECT_NE(View("c")->pid, 0);
  // What cannot fit even once the leaving ones are gone is still refused whole.
  EXPECT_EQ(sup_->Apply(Assignment({Spec("a", 0, 4, v1::SERVING), Spec("c", 0, 3, v1::SERVING, "2"),
                                    Spec("d", 0, 1, v1::SERVING)}, 3))
                .code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_F(SupervisorTest, ARestartedSupervisorAdoptsLiveReplicasAndDrainsOrphans) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::WARM),
                                      Spec("c", -1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  pid_t a = View("a")->pid, b = View("b")->pid, c = View("c")->pid;
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 7001);
  runtimes_.Set(Socket("b"), v1::WARM, "enc", "1", 7002);
  runtimes_.Set(Socket("c"), v1::SERVING, "enc", "1", 7003);
  sup_->Tick();
  // The agent goes away; c dies meanwhile; the replicas of a and b keep running.
  sup_.reset();
  launcher_.Exit(c, SIGKILL);
  launcher_.CollectExits();
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  EXPECT_EQ(View("a")->pid, a);
  EXPECT_TRUE(View("a")->adopted);
  EXPECT_EQ(View("a")->grpc_port, 7001);
  EXPECT_EQ(View("b")->state, v1::WARM);
  EXPECT_EQ(View("c"), nullptr);
  EXPECT_EQ(launcher_.launches().size(), 3u);  // nothing restarted
  // The new assignment no longer wants b: it is drained, a is kept as it is.
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)}, 5)).ok());
  sup_->Tick();
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{b, SIGTERM}}));
  EXPECT_EQ(launcher_.launches().size(), 3u);
  EXPECT_TRUE(fs::exists(dir_ / "replicas.json"));
}

// Each process started is in the state file before the next one starts: an agent killed later
// in the same pass (its watchdog, say) still adopts every runtime it had started.
TEST_F(SupervisorTest, EachStartedProcessIsSavedBeforeTheNextStarts) {
  std::vector<size_t> saved_at_launch;
  launcher_.OnLaunch([&](const LaunchRequest&) {
    json doc = json::parse(kiln::testing::ReadFile(dir_.string() + "/replicas.json"), nullptr,
                           false);
    saved_at_launch.push_back(doc.is_object() ? doc["replicas"].size() : 0);
  });
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING),
                                      Spec("c", -1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  launcher_.OnLaunch(nullptr);
  EXPECT_EQ(saved_at_launch, (std::vector<size_t>{0, 1, 2}));
}

// A state file that cannot be written is written on a later tick, though nothing else changed.
TEST_F(SupervisorTest, AFailedStateFileWriteIsTriedAgain) {
  fs::create_directories(dir_ / "replicas.json.tmp");  // the temporary file cannot be made
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t a = View("a")->pid;
  EXPECT_FALSE(fs::exists(dir_ / "replicas.json"));
  EXPECT_NE(absl::StrJoin(log_, "\n").find("state file:"), std::string::npos);
  fs::remove_all(dir_ / "replicas.json.tmp");
  sup_->Tick();
  json doc = json::parse(kiln::testing::ReadFile(dir_.string() + "/replicas.json"), nullptr, false);
  ASSERT_TRUE(doc.is_object());
  ASSERT_EQ(doc["replicas"].size(), 1u);
  EXPECT_EQ(doc["replicas"][0]["pid"], a);
}

// A new repository for a running replica (a file edited, a deployment moved) is kept: the
// process goes on with what it loaded, its next start reads the new one, and so does an agent
// restarted before that.
TEST_F(SupervisorTest, ARunningReplicasNewRepositoryIsTakenAtItsNextStart) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t a = View("a")->pid;
  v1::ReplicaSpec moved = Spec("a", 0, 1, v1::SERVING);
  moved.set_repository("/models-b");
  ASSERT_TRUE(sup_->Apply(Assignment({moved}, 2)).ok());
  sup_->Tick();
  EXPECT_EQ(View("a")->pid, a);  // not restarted for it
  EXPECT_NE(kiln::testing::ReadFile(dir_.string() + "/replicas.json").find("/models-b"),
            std::string::npos);
  launcher_.Exit(a, SIGKILL);
  AdvanceUntilALaunch();
  ASSERT_EQ(launcher_.launches().size(), 2u);
  const std::vector<std::string> argv = launcher_.launches().back().argv;
  auto flag = std::find(argv.begin(), argv.end(), "--model-repository");
  ASSERT_NE(flag, argv.end());
  EXPECT_EQ(*(flag + 1), "/models-b");
}

// While the state file cannot be written no process is started: a restarted agent would not
// know it, and would start a second one beside it. Waiting so is not a failed start (no
// backoff); once the file is written the rest start.
TEST_F(SupervisorTest, NothingStartsWhileTheStateFileCannotBeWritten) {
  fs::create_directories(dir_ / "replicas.json.tmp");
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  ASSERT_EQ(launcher_.launches().size(), 1u);  // the first, whose write then failed
  const std::string waiting = View("a")->pid > 0 ? "b" : "a";
  EXPECT_EQ(View(waiting)->pid, 0);
  EXPECT_NE(View(waiting)->last_error.find("the state file cannot be written"), std::string::npos)
      << View(waiting)->last_error;
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), 1u);
  EXPECT_EQ(View(waiting)->restarts, 0);
  fs::remove_all(dir_ / "replicas.json.tmp");
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), 2u);  // at once: no backoff was run
  json doc = json::parse(kiln::testing::ReadFile(dir_.string() + "/replicas.json"), nullptr, false);
  ASSERT_TRUE(doc.is_object());
  EXPECT_EQ(doc["replicas"].size(), 2u);
}

// A process at a replica's socket that names another replica is not adopted as this one (a
// runtime too old to name any is).
TEST_F(SupervisorTest, AdoptionRefusesAProcessThatRunsAnotherReplica) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING),
                                      Spec("c", -1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  pid_t a = View("a")->pid, b = View("b")->pid, c = View("c")->pid;
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 7001);
  runtimes_.SetReplicaId(Socket("a"), "a");
  runtimes_.Set(Socket("b"), v1::SERVING, "enc", "1", 7002);
  runtimes_.SetReplicaId(Socket("b"), "x");
  runtimes_.Set(Socket("c"), v1::SERVING, "enc", "1", 7003);  // names none
  sup_->Tick();
  sup_.reset();
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  ASSERT_NE(View("a"), nullptr);
  EXPECT_EQ(View("a")->pid, a);
  EXPECT_TRUE(View("a")->adopted);
  ASSERT_NE(View("c"), nullptr);
  EXPECT_EQ(View("c")->pid, c);
  EXPECT_EQ(View("b"), nullptr);
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{b, SIGKILL}}));
}

TEST_F(SupervisorTest, AnUnhealthyGpuIsDrainedAndTakesNoReplicasUntilHealthy) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  pid_t a = View("a")->pid;
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1");
  runtimes_.Set(Socket("b"), v1::SERVING, "enc", "1");
  sup_->Tick();
  sup_->SetGpuHealth(0, false, "Xid 79: GPU has fallen off the bus");
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{a, SIGTERM}}));
  EXPECT_EQ(View("a")->phase, "STOPPING");
  launcher_.ExitCode(a, 0);
  sup_->Tick();
  clock_.Advance(absl::Minutes(5));
  sup_->Tick();
  EXPECT_EQ(View("a")->phase, "FAILED");  // not restarted, still assigned and reported
  EXPECT_NE(View("a")->last_error.find("fallen off the bus"), std::string::npos);
  EXPECT_EQ(View("b")->phase, "RUNNING");  // the other GPU is untouched
  // A new replica for the sick GPU waits too.
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING),
                                      Spec("c", 0, 1, v1::WARM)}, 2)).ok());
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), 2u);
  EXPECT_EQ(View("c")->phase, "FAILED");
  sup_->SetGpuHealth(0, true, "");
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), 4u);  // a and c start again
  EXPECT_EQ(View("a")->restarts, 0);           // a drain is not a crash
}

// A GPU healthy again before its replica finished draining off it: the replica's exit is not
// a crash (no restart counted, no backoff), and it starts again at once.
// A replica in a crash loop, waiting out its backoff when the agent restarts, goes on waiting
// with its crashes counted: not started hot with a fresh history. A running one keeps its
// crash count too.
TEST_F(SupervisorTest, BackoffAndCrashLoopSurviveARestartedSupervisor) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  for (int crash = 0; crash < 6; ++crash) {
    launcher_.Exit(View("a")->pid, SIGKILL);
    sup_->Tick();
    if (crash == 5) break;  // the sixth: a crash loop, restarting in 60 s
    AdvanceUntilALaunch();
  }
  ASSERT_TRUE(View("a")->crash_loop);
  ASSERT_EQ(View("a")->pid, 0);
  launcher_.Exit(View("b")->pid, SIGKILL);  // b: one crash, then running again
  sup_->Tick();
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  ASSERT_GT(View("b")->pid, 0);
  runtimes_.Set(Socket("b"), v1::SERVING, "enc", "1", 7002);
  sup_->Tick();
  clock_.Advance(absl::Seconds(10));  // a: 49 s of its 60 s backoff left
  sup_->Tick();
  const size_t launches = launcher_.launches().size();

  sup_.reset();
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING)}, 2)).ok());
  sup_->Tick();
  ASSERT_NE(View("a"), nullptr);
  EXPECT_TRUE(View("a")->crash_loop);
  EXPECT_EQ(View("a")->restarts, 6);
  EXPECT_EQ(View("a")->pid, 0);
  EXPECT_EQ(launcher_.launches().size(), launches);  // not started hot
  clock_.Advance(absl::Seconds(48));
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), launches);
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), launches + 1);  // at its backoff from before
  EXPECT_EQ(View("b")->restarts, 1);
  // b's crash is remembered: its next one waits 2 s, not 1 s.
  launcher_.Exit(View("b")->pid, SIGKILL);
  sup_->Tick();
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  EXPECT_EQ(View("b")->pid, 0);
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  EXPECT_GT(View("b")->pid, 0);
}

// A waiting replica the first assignment after the restart no longer wants is forgotten.
TEST_F(SupervisorTest, AWaitingReplicaNoLongerAssignedIsForgotten) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  launcher_.Exit(View("a")->pid, SIGKILL);
  sup_->Tick();
  ASSERT_EQ(View("a")->phase, "BACKOFF");
  sup_.reset();
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  ASSERT_TRUE(sup_->Apply(Assignment({}, 2)).ok());
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)}, 3)).ok());
  EXPECT_EQ(View("a")->restarts, 0);
  EXPECT_EQ(View("a")->phase, "PENDING");
}

// A GPU that flaps (unhealthy, then healthy again) while a replica waits out its backoff does
// not restart the replica before its backoff ends.
TEST_F(SupervisorTest, AGpuThatFlapsDoesNotCutAReplicasBackoff) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  for (int crash = 0; crash < 3; ++crash) {  // backoffs 1 s, 2 s, then 4 s
    launcher_.Exit(View("a")->pid, SIGKILL);
    sup_->Tick();
    if (crash == 2) break;
    AdvanceUntilALaunch();
  }
  ASSERT_EQ(View("a")->phase, "BACKOFF");
  const size_t launches = launcher_.launches().size();
  sup_->SetGpuHealth(0, false, "cannot read the GPU");
  sup_->Tick();
  sup_->SetGpuHealth(0, true, "");
  sup_->Tick();
  EXPECT_EQ(View("a")->phase, "BACKOFF");
  EXPECT_EQ(launcher_.launches().size(), launches);
  clock_.Advance(absl::Seconds(3));
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), launches);
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), launches + 1);
}

TEST_F(SupervisorTest, AGpuHealthyAgainMidDrainDoesNotCountTheExitAsACrash) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t a = View("a")->pid;
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1");
  sup_->Tick();
  sup_->SetGpuHealth(0, false, "Xid 79: GPU has fallen off the bus");
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{a, SIGTERM}}));
  sup_->SetGpuHealth(0, true, "");  // before the replica exits
  launcher_.ExitCode(a, 0);
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), 2u);  // started again, no backoff
  EXPECT_EQ(View("a")->restarts, 0);
  EXPECT_FALSE(View("a")->crash_loop);
}

// A removed replica's log is kept under logs/removed/, the newest 64 at most.
TEST_F(SupervisorTest, RemovedReplicasLogsAreKeptBoundedUnderRemoved) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t a = View("a")->pid;
  const fs::path logs = dir_ / "logs";
  fs::create_directories(logs / "removed");
  { std::ofstream(logs / "a.log") << "a's last words\n"; }
  for (int i = 0; i < 70; ++i) {
    const fs::path old = logs / "removed" / ("old-" + std::to_string(i) + ".log");
    { std::ofstream(old) << i; }
    fs::last_write_time(old, fs::file_time_type::clock::now() - std::chrono::hours(100 - i));
  }
  ASSERT_TRUE(sup_->Apply(Assignment({}, 2)).ok());
  launcher_.ExitCode(a, 0);
  sup_->Tick();
  EXPECT_EQ(View("a"), nullptr);
  EXPECT_FALSE(fs::exists(logs / "a.log"));
  EXPECT_EQ(kiln::testing::ReadFile((logs / "removed" / "a.log").string()), "a's last words\n");
  size_t kept = 0;
  for (const auto& e : fs::directory_iterator(logs / "removed")) kept += e.is_regular_file();
  EXPECT_EQ(kept, 64u);
  EXPECT_FALSE(fs::exists(logs / "removed" / "old-0.log"));  // the oldest went
  EXPECT_TRUE(fs::exists(logs / "removed" / "old-69.log"));
}

// Each way a replica leaves routing (no longer assigned, assigned WARM, drained off a sick
// GPU): it is published out of routing and the router told (before_leaving_routing) before the
// replica is told to drain or demote, so that no request is sent to one that refuses work.
TEST_F(SupervisorTest, AReplicaLeavesRoutingBeforeItIsToldToDrainOrDemote) {
  struct Seen {
    size_t signals = 0;  // sent by then
    std::set<std::string> routed;
  };
  std::vector<Seen> seen;
  options_.before_leaving_routing = [&] {
    Seen s{launcher_.signals().size(), {}};
    RouterTable table = BuildRouterTable({}, *sup_->Snapshot(), "n1");
    for (const auto& e : table.routes["enc"].endpoints) s.routed.insert(e.id);
    seen.push_back(std::move(s));
  };
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING),
                                      Spec("c", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t a = View("a")->pid;
  const pid_t c = View("c")->pid;
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 6001);
  runtimes_.Set(Socket("b"), v1::SERVING, "enc", "1", 6002);
  runtimes_.Set(Socket("c"), v1::SERVING, "enc", "1", 6003);
  sup_->Tick();
  ASSERT_EQ(BuildRouterTable({}, *sup_->Snapshot(), "n1").routes["enc"].endpoints.size(), 3u);
  EXPECT_TRUE(seen.empty());  // nothing has left routing
  // "a" is no longer assigned: out of routing before its SIGTERM.
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("b", 1, 1, v1::SERVING), Spec("c", 0, 1, v1::SERVING)},
                                     2)).ok());
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].signals, 0u);
  EXPECT_EQ(seen[0].routed, (std::set<std::string>{"b", "c"}));
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{a, SIGTERM}}));
  // "b" is assigned WARM: out of routing as the assignment is taken, its Demote in the pass
  // after.
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("b", 1, 1, v1::WARM), Spec("c", 0, 1, v1::SERVING)},
                                     3)).ok());
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1].routed, std::set<std::string>{"c"});
  EXPECT_EQ(runtimes_.Get(Socket("b")).demotes, 0);
  sup_->Tick();
  EXPECT_EQ(runtimes_.Get(Socket("b")).demotes, 1);
  // "c" drains off its GPU gone bad: out of routing before its SIGTERM too.
  sup_->SetGpuHealth(0, false, "Xid 79: GPU has fallen off the bus");
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[2].signals, 1u);
  EXPECT_TRUE(seen[2].routed.empty());
  EXPECT_EQ(launcher_.signals(),
            (std::vector<std::pair<pid_t, int>>{{a, SIGTERM}, {c, SIGTERM}}));
  // An assignment that takes nothing out of routing does not call it.
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("b", 1, 1, v1::WARM), Spec("c", 0, 1, v1::SERVING)},
                                     4)).ok());
  EXPECT_EQ(seen.size(), 3u);
}

TEST_F(SupervisorTest, UnderAControllerAnUnhealthyGpusReplicasServeUntilMoved) {
  options_.drain_on_unhealthy_gpu = false;
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  pid_t a = View("a")->pid;
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 6001);
  sup_->Tick();
  ASSERT_EQ(BuildRouterTable({}, *sup_->Snapshot(), "n1").routes["enc"].endpoints.size(), 1u);
  sup_->SetGpuHealth(0, false, "Xid 48: double-bit ECC error");
  sup_->Tick();
  EXPECT_TRUE(launcher_.signals().empty());  // still serving: the controller moves it
  EXPECT_EQ(View("a")->phase, "RUNNING");
  EXPECT_EQ(View("a")->pid, a);
  EXPECT_EQ(BuildRouterTable({}, *sup_->Snapshot(), "n1").routes["enc"].endpoints.size(), 1u);
  // Should it exit, it is not restarted on that GPU.
  launcher_.ExitCode(a, 1);
  sup_->Tick();
  clock_.Advance(absl::Minutes(5));
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), 1u);
  EXPECT_NE(View("a")->last_error.find("double-bit ECC"), std::string::npos);
}

TEST_F(SupervisorTest, ProbeFailuresTakeAReplicaOutOfRoutingAndSilenceGetsItKilled) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 6001);
  sup_->Tick();
  EXPECT_TRUE(View("a")->healthy);
  EXPECT_EQ(prober_.probes("127.0.0.1:6001"), 1);
  // The model stops answering inference: out of routing, the process is left alone.
  prober_.Set("127.0.0.1:6001", absl::InternalError("model execution failed"));
  clock_.Advance(absl::Seconds(10));
  sup_->Tick();
  EXPECT_FALSE(View("a")->healthy);
  EXPECT_NE(View("a")->health_reason.find("model execution failed"), std::string::npos);
  EXPECT_TRUE(BuildRouterTable({}, *sup_->Snapshot(), "n1").routes["enc"].endpoints.empty());
  prober_.Set("127.0.0.1:6001", absl::OkStatus());
  clock_.Advance(absl::Seconds(10));
  sup_->Tick();
  EXPECT_TRUE(View("a")->healthy);
  EXPECT_EQ(BuildRouterTable({}, *sup_->Snapshot(), "n1").routes["enc"].endpoints.size(), 1u);
  // The control socket goes silent: out of routing at once, killed after the probe timeout.
  pid_t pid = View("a")->pid;
  runtimes_.SetReachable(Socket("a"), false);
  sup_->Tick();
  EXPECT_FALSE(View("a")->healthy);
  EXPECT_TRUE(launcher_.signals().empty());
  clock_.Advance(absl::Seconds(10));
  sup_->Tick();
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{pid, SIGKILL}}));
}

TEST_F(SupervisorTest, InferenceProbesFailingThreeTimesInARowRestartTheReplica) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 6001);
  sup_->Tick();
  const pid_t pid = View("a")->pid;
  auto probe_after = [&](absl::Status s) {
    prober_.Set("127.0.0.1:6001", std::move(s));
    clock_.Advance(absl::Seconds(10));
    sup_->Tick();
  };
  // Two failures, then a pass: the count starts again.
  probe_after(absl::DeadlineExceededError("probe timed out"));
  probe_after(absl::DeadlineExceededError("probe timed out"));
  probe_after(absl::OkStatus());
  EXPECT_TRUE(View("a")->healthy);
  probe_after(absl::InternalError("CUDA error: an illegal memory access"));
  probe_after(absl::InternalError("CUDA error: an illegal memory access"));
  EXPECT_TRUE(launcher_.signals().empty());  // out of routing, not killed yet
  EXPECT_FALSE(View("a")->healthy);
  probe_after(absl::InternalError("CUDA error: an illegal memory access"));
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{pid, SIGKILL}}));
  EXPECT_NE(View("a")->last_error.find("inference probe failed 3 times in a row"),
            std::string::npos);
  // Its exit restarts it (with backoff), healthy again once its new process passes.
  launcher_.ExitCode(pid, -SIGKILL);
  sup_->Tick();
  EXPECT_GT(AdvanceUntilALaunch(), absl::ZeroDuration());
  ASSERT_EQ(launcher_.launches().size(), 2u);
  prober_.Set("127.0.0.1:6002", absl::OkStatus());
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 6002);
  sup_->Tick();
  EXPECT_TRUE(View("a")->healthy);
  EXPECT_EQ(View("a")->restarts, 1);
}

// A probe that times out in the queue, or finds it full, while the model goes on executing
// says the replica is busy, not broken: it stays routed and is never killed for it. One that
// does not fit the model (INVALID_ARGUMENT) takes it out of routing but is not counted.
TEST_F(SupervisorTest, ABusyReplicaIsNeitherUnroutedNorKilledAndAMisfitProbeIsNotCounted) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 6001);
  sup_->Tick();
  uint64_t executions = 100;
  auto probe_after = [&](absl::Status s, bool executing) {
    prober_.Set("127.0.0.1:6001", std::move(s));
    clock_.Advance(absl::Seconds(10));
    if (executing) runtimes_.SetExecutions(Socket("a"), executions += 50);
    sup_->Tick();
  };
  for (int i = 0; i < 5; ++i) {
    probe_after(absl::DeadlineExceededError("the request timed out in the queue"), true);
    probe_after(absl::ResourceExhaustedError("the request queue is full"), true);
  }
  EXPECT_TRUE(launcher_.signals().empty());
  EXPECT_TRUE(View("a")->healthy) << View("a")->health_reason;
  EXPECT_EQ(std::count_if(log_.begin(), log_.end(),
                          [](const std::string& l) { return l.find("busy, kept in routing") != std::string::npos; }),
            1);
  for (int i = 0; i < 5; ++i) probe_after(absl::InvalidArgumentError("input 'x': expected shape"), true);
  EXPECT_TRUE(launcher_.signals().empty());
  EXPECT_FALSE(View("a")->healthy);
  // The same timeouts with nothing executing: the model hangs. Three in a row kill it, and
  // its exit says why.
  const pid_t pid = View("a")->pid;
  for (int i = 0; i < 3; ++i) probe_after(absl::DeadlineExceededError("the request timed out in the queue"), false);
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{pid, SIGKILL}}));
  launcher_.ExitCode(pid, -SIGKILL);
  sup_->Tick();
  EXPECT_NE(View("a")->last_error.find("by the agent: inference probe failed 3 times in a row"),
            std::string::npos)
      << View("a")->last_error;
}

// A failed probe of a runtime whose Stats answer is slow to come is judged once it comes,
// not as broken for want of it: a busy replica (its executions moving) stays routed.
TEST_F(SupervisorTest, AProbeIsJudgedOnceASlowStatsAnswerComes) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 6001);
  sup_->Tick();  // the first probe passes: its executions are the baseline
  ASSERT_TRUE(View("a")->healthy);
  prober_.Set("127.0.0.1:6001", absl::DeadlineExceededError("the request timed out in the queue"));
  runtimes_.SetExecutions(Socket("a"), 500);
  runtimes_.SetStatsPending(Socket("a"), true);
  clock_.Advance(absl::Seconds(10));
  sup_->Tick();
  sup_->Tick();
  EXPECT_EQ(prober_.probes("127.0.0.1:6001"), 2);  // no new probe while this one waits
  EXPECT_TRUE(View("a")->healthy) << View("a")->health_reason;
  runtimes_.SetStatsPending(Socket("a"), false);
  sup_->Tick();
  EXPECT_TRUE(View("a")->healthy) << View("a")->health_reason;
  EXPECT_EQ(std::count_if(log_.begin(), log_.end(),
                          [](const std::string& l) {
                            return l.find("busy, kept in routing") != std::string::npos;
                          }),
            1)
      << absl::StrJoin(log_, "\n");
  for (const auto& line : log_) EXPECT_EQ(line.find("probe failed"), std::string::npos) << line;
}

// A demotion starts the count afresh: two failures before it and one after it are not three
// in a row.
TEST_F(SupervisorTest, ADemotionStartsTheProbeFailureCountAfresh) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 6001);
  sup_->Tick();
  prober_.Set("127.0.0.1:6001", absl::InternalError("CUDA error"));
  for (int i = 0; i < 2; ++i) {
    clock_.Advance(absl::Seconds(10));
    sup_->Tick();
  }
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::WARM)}, 2)).ok());
  sup_->Tick();
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)}, 3)).ok());
  sup_->Tick();  // promoted, and probed at once (it failed before)
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  EXPECT_EQ(prober_.probes("127.0.0.1:6001"), 4);  // 1 + 2 before, 1 after
  EXPECT_TRUE(launcher_.signals().empty());
}

TEST_F(SupervisorTest, WithNoRestartsAFailingReplicaOnlyLeavesRouting) {
  options_.inference_probe_failures = 0;
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 6001);
  prober_.Set("127.0.0.1:6001", absl::InternalError("model execution failed"));
  for (int i = 0; i < 10; ++i) {
    clock_.Advance(absl::Seconds(10));
    sup_->Tick();
  }
  EXPECT_EQ(prober_.probes("127.0.0.1:6001"), 10);
  EXPECT_TRUE(launcher_.signals().empty());
  EXPECT_FALSE(View("a")->healthy);
}

// A probe sent while the replica served, answered after it was demoted (WARM refuses
// inference), says nothing of its health: promoted again, it is routed at once.
TEST_F(SupervisorTest, AProbeThatMeetsADemotedReplicaIsNotCounted) {
  ASSERT_NO_FATAL_FAILURE(StartWithAHeldProbe());
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::WARM)}, 2)).ok());
  sup_->Tick();
  EXPECT_EQ(runtimes_.Get(Socket("a")).state.state(), v1::WARM);
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)}, 3)).ok());
  sup_->Tick();
  EXPECT_EQ(runtimes_.Get(Socket("a")).state.state(), v1::SERVING);
  // The held probe now answers what it met while the replica was WARM.
  prober_.Set("127.0.0.1:6001", absl::UnavailableError("the model is WARM"));
  prober_.Hold(false);
  ASSERT_TRUE(kiln::testing::Eventually([&] { return prober_.answered("127.0.0.1:6001") == 1; },
                                        absl::Seconds(10)));
  // The runner has one thread: once it has started the next probe, the first one's answer is
  // waiting to be taken, and the next Tick takes it.
  prober_.Hold(true);
  clock_.Advance(absl::Seconds(10));
  ASSERT_TRUE(kiln::testing::Eventually(
      [&] {
        sup_->Tick();
        return prober_.probes("127.0.0.1:6001") == 2;
      },
      absl::Seconds(10)));
  sup_->Tick();
  EXPECT_TRUE(View("a")->healthy) << View("a")->health_reason;
}

// Probes run off the loop: a replica whose probe hangs does not hold up the loop's other work.
TEST_F(SupervisorTest, AHungProbeDoesNotHoldUpTheLoop) {
  ASSERT_NO_FATAL_FAILURE(StartWithAHeldProbe());
  // While it hangs, a second replica is started and promoted, and "a" is not probed again.
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING)},
                                     2)).ok());
  sup_->Tick();
  ASSERT_EQ(launcher_.launches().size(), 2u);
  runtimes_.Set(Socket("b"), v1::WARM, "enc", "1", 6002);
  clock_.Advance(absl::Seconds(30));
  sup_->Tick();
  EXPECT_EQ(runtimes_.Get(Socket("b")).state.state(), v1::SERVING);
  EXPECT_EQ(prober_.probes("127.0.0.1:6001"), 1);
  EXPECT_TRUE(View("a")->healthy);  // no answer yet is not a failure
  prober_.Set("127.0.0.1:6001", absl::DeadlineExceededError("probe timed out"));
  prober_.Hold(false);
  ASSERT_TRUE(kiln::testing::Eventually(
      [&] {
        sup_->Tick();
        return !View("a")->healthy;
      },
      absl::Seconds(10)));
  EXPECT_NE(View("a")->health_reason.find("probe timed out"), std::string::npos);
}

TEST_F(SupervisorTest, AnApplicationXidGetsTheGpusServingReplicasProbedAtOnce) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 6001);
  runtimes_.Set(Socket("b"), v1::SERVING, "enc", "1", 6002);
  sup_->Tick();
  ASSERT_EQ(prober_.probes("127.0.0.1:6001"), 1);
  clock_.Advance(absl::Seconds(1));
  sup_->ProbeGpuSoon(0, "Xid 31: GPU memory page fault");
  sup_->Tick();
  EXPECT_EQ(prober_.probes("127.0.0.1:6001"), 2);
  EXPECT_EQ(prober_.probes("127.0.0.1:6002"), 1);  // another GPU's waits for its interval
  // A storm (the same fault every second) probes at the interval, not every second.
  for (int i = 0; i < 8; ++i) {
    clock_.Advance(absl::Seconds(1));
    sup_->ProbeGpuSoon(0, "Xid 31: GPU memory page fault");
    sup_->Tick();
  }
  EXPECT_EQ(prober_.probes("127.0.0.1:6001"), 2);
  EXPECT_EQ(std::count_if(log_.begin(), log_.end(),
                          [](const std::string& l) { return l.find("probed now") != std::string::npos; }),
            1);
}

// A fault raised while a probe is under way (it may have been sent before the fault) gets one
// more probe as soon as that one answers.
TEST_F(SupervisorTest, AnXidDuringAProbeGetsOneMoreProbe) {
  ASSERT_NO_FATAL_FAILURE(StartWithAHeldProbe());
  sup_->ProbeGpuSoon(0, "Xid 13: graphics engine exception");
  prober_.Hold(false);
  ASSERT_TRUE(kiln::testing::Eventually(
      [&] {
        sup_->Tick();
        return prober_.probes("127.0.0.1:6001") == 2;
      },
      absl::Seconds(10)));
}

TEST_F(SupervisorTest, RecoveryIgnoresGarbageAndAdoptsSilentReplicas) {
  fs::create_directories(dir_);
  { std::ofstream(dir_ / "replicas.json") << "{not json"; }
  auto fresh = MakeSupervisor();
  EXPECT_TRUE(fresh->Recover().ok());
  EXPECT_TRUE(fresh->Snapshot()->empty());

  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  pid_t a = View("a")->pid, b = View("b")->pid;
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 7001);
  runtimes_.Set(Socket("b"), v1::SERVING, "enc", "1", 7002);
  sup_->Tick();
  // Both alive, their control sockets silent when the agent comes back (busy, say).
  runtimes_.SetReachable(Socket("a"), false);
  runtimes_.SetReachable(Socket("b"), false);
  sup_.reset();
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING)}, 2)).ok());
  // Adopted, out of routing, not killed for one silence.
  for (const std::string id : {"a", "b"}) {
    ASSERT_NE(View(id), nullptr) << id;
    EXPECT_TRUE(View(id)->adopted) << id;
    EXPECT_FALSE(View(id)->healthy) << id;
  }
  EXPECT_TRUE(launcher_.signals().empty());
  sup_->Tick();
  EXPECT_TRUE(launcher_.signals().empty());
  // b answers again and is back; a stays silent for the probe timeout and is replaced.
  runtimes_.SetReachable(Socket("b"), true);
  clock_.Advance(absl::Seconds(5));
  sup_->Tick();
  EXPECT_EQ(View("b")->pid, b);
  EXPECT_EQ(View("b")->state, v1::SERVING);
  EXPECT_TRUE(launcher_.signals().empty());
  clock_.Advance(options_.probe_timeout);
  sup_->Tick();
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{a, SIGKILL}}));
  EXPECT_EQ(View("b")->pid, b);
  EXPECT_EQ(launcher_.launches().size(), 2u);  // nothing started twice
}

// A replica still loading when the agent comes back is adopted as starting: its start
// timeout applies (from the adoption), and it goes on to its state once WARM.
TEST_F(SupervisorTest, AReplicaAdoptedWhileLoadingIsStillStarting) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  pid_t a = View("a")->pid, b = View("b")->pid;
  runtimes_.Set(Socket("a"), v1::LOADING, "enc", "1");
  runtimes_.Set(Socket("b"), v1::LOADING, "enc", "1");
  sup_.reset();
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING), Spec("b", 1, 1, v1::SERVING)}, 2)).ok());
  EXPECT_EQ(View("a")->phase, "STARTING");
  EXPECT_EQ(View("b")->phase, "STARTING");
  runtimes_.Set(Socket("b"), v1::WARM, "enc", "1", 7002);
  sup_->Tick();
  sup_->Tick();
  EXPECT_EQ(View("b")->phase, "RUNNING");
  EXPECT_EQ(runtimes_.Get(Socket("b")).promotes, 1);
  clock_.Advance(options_.start_timeout);
  sup_->Tick();
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{a, SIGKILL}}));
  EXPECT_EQ(View("b")->pid, b);
}

TEST_F(SupervisorTest, ARenamedReplicaGoesOnUnderItsNewIdInTheSameProcess) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("pool-enc-0", 0, 1, v1::WARM), Spec("s0", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t member = View("pool-enc-0")->pid;
  const std::string cpus = View("pool-enc-0")->cpus;
  runtimes_.Set(Socket("pool-enc-0"), v1::WARM, "enc", "1", 5001);
  runtimes_.SetReplicaId(Socket("pool-enc-0"), "pool-enc-0");  // as it was started
  runtimes_.Set(Socket("s0"), v1::SERVING, "enc", "1", 5002);
  sup_->Tick();
  ASSERT_TRUE(sup_->Converged());

  // Bad renames change nothing.
  auto next = Assignment({Spec("s1", 0, 1, v1::SERVING), Spec("s0", 0, 1, v1::SERVING)}, 2);
  EXPECT_FALSE(sup_->Apply(next, {{"nosuch", "s1"}}).ok());
  EXPECT_FALSE(sup_->Apply(next, {{"pool-enc-0", "s0"}}).ok());  // s0 is taken
  EXPECT_FALSE(sup_->Apply(Assignment({Spec("s1", 0, 1, v1::SERVING, "2")}, 2),
                           {{"pool-enc-0", "s1"}}).ok());  // another version
  EXPECT_FALSE(sup_->Apply(Assignment({}, 2), {{"pool-enc-0", "s1"}}).ok());  // s1 not assigned
  EXPECT_EQ(sup_->applied_generation(), 1);
  EXPECT_NE(View("pool-enc-0"), nullptr);

  // Scale-up: the pool member becomes s1 and is promoted; nothing starts, nothing stops.
  ASSERT_TRUE(sup_->Apply(next, {{"pool-enc-0", "s1"}}).ok());
  EXPECT_EQ(View("pool-enc-0"), nullptr);
  ASSERT_NE(View("s1"), nullptr);
  EXPECT_EQ(View("s1")->pid, member);
  EXPECT_EQ(View("s1")->cpus, cpus);
  EXPECT_EQ(View("s1")->socket, Socket("pool-enc-0"));  // its socket stays where it listens
  sup_->Tick();
  EXPECT_EQ(runtimes_.Get(Socket("pool-enc-0")).promotes, 1);
  EXPECT_EQ(View("s1")->state, v1::SERVING);
  EXPECT_EQ(launcher_.launches().size(), 2u);
  EXPECT_TRUE(launcher_.signals().empty());
  // The state file has the new id: a restarted supervisor adopts s1 (the process still names
  // itself by the id it was started as).
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  ASSERT_NE(View("s1"), nullptr);
  EXPECT_EQ(View("s1")->pid, member);
  EXPECT_TRUE(View("s1")->adopted);
  EXPECT_TRUE(launcher_.signals().empty());
}

TEST_F(SupervisorTest, LastUsedSurvivesARestartedSupervisor) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1");
  sup_->Tick();
  clock_.Advance(absl::Minutes(1));  // serving a while after the state file was last written
  sup_->Tick();
  const absl::Time used = View("a")->last_used;
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::WARM)}, 2)).ok());
  sup_->Tick();  // demoted; idle from here
  runtimes_.Set(Socket("a"), v1::WARM, "enc", "1");
  clock_.Advance(absl::Minutes(5));
  sup_->Tick();
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  EXPECT_EQ(View("a")->last_used, used + absl::ZeroDuration());
}

TEST_F(SupervisorTest, AnIdFreedByARenameGetsAnotherSocketWhileItsOldOwnerListens) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("pool-enc-0", 0, 1, v1::WARM)})).ok());
  sup_->Tick();
  runtimes_.Set(Socket("pool-enc-0"), v1::WARM, "enc", "1");
  sup_->Tick();
  // pool-enc-0 becomes s1 (still on pool-enc-0's socket); a new pool-enc-0 starts beside it.
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("s1", 0, 1, v1::SERVING), Spec("pool-enc-0", 0, 1, v1::WARM)}, 2),
                          {{"pool-enc-0", "s1"}}).ok());
  sup_->Tick();
  EXPECT_EQ(View("s1")->socket, Socket("pool-enc-0"));
  EXPECT_EQ(Arg(launcher_.launches().back(), "--control-socket"),
            dir_.string() + "/sockets/pool-enc-0.1.sock");
  EXPECT_EQ(View("pool-enc-0")->socket, dir_.string() + "/sockets/pool-enc-0.1.sock");
}

TEST_F(SupervisorTest, AReplicaAssignedAgainWhileItDrainsStartsAgainOnceGone) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t first = View("a")->pid;
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1");
  sup_->Tick();
  ASSERT_TRUE(sup_->Apply(Assignment({}, 2)).ok());
  EXPECT_EQ(View("a")->phase, "STOPPING");
  // Back in the assignment, with a new version, before it is gone.
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING, "2")}, 3)).ok());
  sup_->Tick();
  EXPECT_EQ(View("a")->pid, first);  // still draining
  launcher_.ExitCode(first, 0);
  sup_->Tick();
  ASSERT_NE(View("a"), nullptr);
  EXPECT_NE(View("a")->pid, first);
  EXPECT_EQ(View("a")->spec.version(), "2");
  EXPECT_EQ(View("a")->restarts, 0);
  EXPECT_EQ(Arg(launcher_.launches().back(), "--version"), "2");
}

// A draining replica assigned again does not get back CPUs given meanwhile to another: on a
// full NUMA node the assignment that wants both is refused, and nothing shares a CPU.
TEST_F(SupervisorTest, AReplicaAssignedAgainWhileItDrainsDoesNotShareTheCpusOfItsReplacement) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("r", 0, 7, v1::SERVING)})).ok());  // node 0, full
  sup_->Tick();
  const pid_t r = View("r")->pid;
  runtimes_.Set(Socket("r"), v1::SERVING, "enc", "1");
  sup_->Tick();
  // r goes, n takes its place (its CPUs once r is gone).
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("n", 0, 7, v1::SERVING)}, 2)).ok());
  EXPECT_EQ(View("r")->phase, "STOPPING");
  EXPECT_EQ(View("n")->cpus, View("r")->cpus);
  // r back while it drains, n kept: no room for both on node 0.
  auto both = sup_->Apply(Assignment({Spec("r", 0, 7, v1::SERVING), Spec("n", 0, 7, v1::SERVING)}, 3));
  EXPECT_EQ(both.code(), absl::StatusCode::kResourceExhausted) << both;
  // Once r is gone, n starts on the CPUs alone.
  launcher_.ExitCode(r, 0);
  sup_->Tick();
  EXPECT_EQ(View("r"), nullptr);
  ASSERT_NE(View("n"), nullptr);
  EXPECT_EQ(View("n")->phase, "STARTING");
}

TEST_F(SupervisorTest, ARejectedAssignmentChangesNothingEvenWithRenames) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("pool-enc-0", 0, 1, v1::WARM), Spec("b", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  // b changes version under the same id (refused), in the same assignment as a rename.
  auto s = sup_->Apply(Assignment({Spec("s1", 0, 1, v1::SERVING), Spec("b", 0, 1, v1::SERVING, "2")}, 2),
                       {{"pool-enc-0", "s1"}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(View("pool-enc-0"), nullptr);
  EXPECT_EQ(View("s1"), nullptr);
  EXPECT_EQ(View("b")->phase, "STARTING");
  EXPECT_TRUE(launcher_.signals().empty());
}

TEST_F(SupervisorTest, LastUsedIsTheLastTimeAReplicaWasSeenServing) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  const absl::Time start = clock_.Now();
  sup_->Tick();
  EXPECT_EQ(View("a")->last_used, start);
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1");
  clock_.Advance(absl::Seconds(5));
  sup_->Tick();
  EXPECT_EQ(View("a")->last_used, start + absl::Seconds(5));
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::WARM)}, 2)).ok());
  sup_->Tick();  // demoted
  clock_.Advance(absl::Seconds(5));
  sup_->Tick();
  EXPECT_EQ(View("a")->last_used, start + absl::Seconds(5));
}

// --- Pre-started runtimes -------------------------------------------------------------------

class PrestartTest : public SupervisorTest {
 protected:
  void SetUp() override {
    options_.prestart_per_gpu = 1;
    options_.prestart_cpu = 1;
    SupervisorTest::SetUp();
  }
  bool IsPrestart(const LaunchRequest& r) {
    return std::find(r.argv.begin(), r.argv.end(), "--prestart") != r.argv.end();
  }
  std::vector<LaunchRequest> PrestartLaunches() {
    std::vector<LaunchRequest> out;
    for (const auto& l : launcher_.launches()) {
      if (IsPrestart(l)) out.push_back(l);
    }
    return out;
  }
  std::vector<LaunchRequest> ColdLaunches() {
    std::vector<LaunchRequest> out;
    for (const auto& l : launcher_.launches()) {
      if (!IsPrestart(l)) out.push_back(l);
    }
    return out;
  }
  // The pool of `gpu` (for -1, the CPU pool of NUMA node `node`), not stopping nor sent a
  // Load.
  const PrestartedView* Pool(int gpu, int node = -1) {
    pool_ = sup_->PrestartedSnapshot();
    for (const auto& p : *pool_) {
      if (p.gpu == gpu && p.numa_node == node && !p.stopping && p.loading_for.empty()) return &p;
    }
    return nullptr;
  }
  // Every pre-started runtime launched so far answers with no model.
  void AllPrestartedAnswer() {
    for (const auto& l : PrestartLaunches()) {
      if (runtimes_.Get(Arg(l, "--control-socket")).loads.empty()) {
        runtimes_.Set(Arg(l, "--control-socket"), v1::LOADING);
      }
    }
  }
  int Signals(pid_t pid, int sig) {
    int n = 0;
    for (const auto& [p, s] : launcher_.signals()) n += p == pid && s == sig;
    return n;
  }
  // The pools started and ready, and the one of `gpu` (for -1, of NUMA node `node`) holding
  // the Load it is sent (answers pending until released).
  PrestartedView ReadyWithLoadHeld(int gpu, int node = -1) {
    sup_->Tick();
    return HoldLoadOnceReady(gpu, node);
  }
  // As ReadyWithLoadHeld, of the pools started already.
  PrestartedView HoldLoadOnceReady(int gpu, int node = -1) {
    AllPrestartedAnswer();
    sup_->Tick();
    const PrestartedView* p = Pool(gpu, node);
    EXPECT_NE(p, nullptr);
    if (p == nullptr) return {};
    runtimes_.HoldLoad(p->socket, true);
    return *p;
  }
  std::shared_ptr<const std::vector<PrestartedView>> pool_;
};

TEST_F(PrestartTest, APoolPerGpuAndPerNumaNodeForCpuStartsOnItsNodeAndBecomesReady) {
  sup_->Tick();
  auto pre = PrestartLaunches();
  ASSERT_EQ(pre.size(), 4u);  // cpu on node 0 and on node 1, gpu 0, gpu 1
  EXPECT_EQ(Arg(pre[0], "--device"), "cpu");
  EXPECT_EQ(pre[0].cpus, (std::vector<int>{1, 2, 3, 4, 5, 6, 7}));  // node 0 but the agent's
  EXPECT_EQ(pre[0].memory_node, 0);
  EXPECT_EQ(pre[1].cpus, (std::vector<int>{8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(pre[1].memory_node, 1);
  EXPECT_EQ(Arg(pre[3], "--device"), "cuda:0");
  EXPECT_EQ(pre[3].cpus, (std::vector<int>{8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(pre[3].memory_node, 1);
  EXPECT_EQ(pre[3].env[0], "CUDA_VISIBLE_DEVICES=GPU-1");
  for (const LaunchRequest& l : pre) EXPECT_EQ(TunablesOf(l), ExpectedTunables());
  EXPECT_EQ(Arg(pre[2], "--model"), "");  // no model yet
  ASSERT_NE(Pool(1), nullptr);
  EXPECT_FALSE(Pool(1)->ready);
  AllPrestartedAnswer();
  sup_->Tick();
  EXPECT_TRUE(Pool(-1, 0)->ready);
  EXPECT_TRUE(Pool(-1, 1)->ready);
  EXPECT_TRUE(Pool(1)->ready);
  EXPECT_EQ(launcher_.launches().size(), 4u);  // full: nothing more
}

TEST_F(PrestartTest, AStartingReplicaIsHandedOnePinnedToItsCpusAndThePoolRefills) {
  sup_->Tick();
  AllPrestartedAnswer();
  sup_->Tick();
  ASSERT_NE(Pool(1), nullptr);
  const pid_t pooled = Pool(1)->pid;
  const std::string pooled_socket = Pool(1)->socket;
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING)})).ok());
  sup_->Tick();
  ASSERT_NE(View("a"), nullptr);
  // No cold start: the replica is the pre-started process, given the cold command line.
  EXPECT_TRUE(ColdLaunches().empty());
  EXPECT_EQ(View("a")->pid, pooled);
  EXPECT_EQ(View("a")->phase, "STARTING");
  auto loads = runtimes_.Get(pooled_socket).loads;
  ASSERT_EQ(loads.size(), 1u);
  LaunchRequest as_cold;
  as_cold.argv = loads[0];
  as_cold.argv.insert(as_cold.argv.begin(), "kiln-runtime");
  EXPECT_EQ(Arg(as_cold, "--model"), "enc");
  EXPECT_EQ(Arg(as_cold, "--control-socket"), Socket("a"));
  EXPECT_EQ(Arg(as_cold, "--device"), "cuda:0");
  EXPECT_EQ(Arg(as_cold, "--threads"), "2");
  EXPECT_EQ(Arg(as_cold, "--replica-id"), "a");  // named at the Load, as a cold start is
  EXPECT_EQ(Arg(as_cold, "--cpu-set"), "8-9");
  EXPECT_EQ(Arg(as_cold, "--memory-node"), "1");
  // The pool refilled in the same tick; the handed one left it.
  EXPECT_EQ(PrestartLaunches().size(), 5u);
  ASSERT_NE(Pool(1), nullptr);
  EXPECT_NE(Pool(1)->pid, pooled);
  EXPECT_FALSE(Pool(1)->ready);
  // From here it is any replica: it loads, is promoted, and a crash restarts it (from the
  // pool again once that one is ready).
  runtimes_.Set(Socket("a"), v1::WARM, "enc", "1", 5001);
  sup_->Tick();
  EXPECT_EQ(runtimes_.Get(Socket("a")).promotes, 1);
  EXPECT_TRUE(sup_->Converged());
  AllPrestartedAnswer();
  sup_->Tick();
  ASSERT_NE(Pool(1), nullptr);
  const pid_t second = Pool(1)->pid;
  launcher_.Exit(pooled, SIGKILL);
  sup_->Tick();
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  EXPECT_EQ(View("a")->pid, second);
  EXPECT_EQ(View("a")->restarts, 1);
  // A CPU replica takes the pool of the NUMA node its CPUs are on.
  const pid_t node0 = Pool(-1, 0)->pid;
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING), Spec("c", -1, 1, v1::SERVING)}, 2)).ok());
  sup_->Tick();
  EXPECT_EQ(View("c")->pid, node0);  // node 0 has the most free CPUs (a holds two of node 1's)
  EXPECT_EQ(View("c")->cpus, "1");
}

TEST_F(PrestartTest, RefusedArgumentsStartTheReplicaColdAndTwoRefusalsRetireTheRuntime) {
  sup_->Tick();
  AllPrestartedAnswer();
  sup_->Tick();
  const pid_t pooled = Pool(-1, 1)->pid;
  runtimes_.FailNextLoad(Pool(-1, 1)->socket,
                         absl::InvalidArgumentError("--max-request-bytes: not a size"));
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("c", -1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  // The replica starts cold (where a bad model fails as it always has); the pre-started
  // runtime stays, it may be this replica's arguments that it cannot take.
  ASSERT_EQ(ColdLaunches().size(), 1u);
  EXPECT_EQ(View("c")->pid, 1004);
  EXPECT_EQ(Pool(-1, 1)->pid, pooled);
  EXPECT_TRUE(launcher_.signals().empty());
  // Refusing a second replica retires it (an older runtime binary still running, say).
  ASSERT_TRUE(sup_->Apply(Assignment({}, 2)).ok());
  launcher_.ExitCode(1004, 0);
  sup_->Tick();
  runtimes_.FailNextLoad(Pool(-1, 1)->socket,
                         absl::InvalidArgumentError("--max-request-bytes: not a size"));
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("d", -1, 1, v1::SERVING)}, 3)).ok());
  sup_->Tick();
  EXPECT_EQ(ColdLaunches().size(), 2u);
  EXPECT_EQ(Signals(pooled, SIGTERM), 1);
  ASSERT_NE(Pool(-1, 1), nullptr);  // replaced by a new one
  EXPECT_NE(Pool(-1, 1)->pid, pooled);
}

TEST_F(PrestartTest, ARuntimeThatFailsTheLoadIsKilledAndTheReplicaStartsCold) {
  for (absl::Status failure : {absl::UnavailableError("connection refused"),
                               absl::FailedPreconditionError("a Load was already accepted"),
                               absl::UnimplementedError("Load")}) {
    SCOPED_TRACE(failure.ToString());
    SetUp();
    sup_->Tick();
    AllPrestartedAnswer();
    sup_->Tick();
    const pid_t pooled = Pool(0)->pid;
    const size_t launched = launcher_.launches().size();
    const size_t signalled = launcher_.signals().size();
    runtimes_.FailNextLoad(Pool(0)->socket, failure);
    ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
    sup_->Tick();
    EXPECT_EQ(launcher_.signals().size(), signalled + 1);
    EXPECT_EQ(launcher_.signals().back(), std::make_pair(pooled, SIGKILL));
    // Started cold; the pool refills only after its backoff.
    auto launches = launcher_.launches();
    ASSERT_EQ(launches.size(), launched + 1);
    EXPECT_FALSE(IsPrestart(launches.back()));
    EXPECT_EQ(View("a")->pid, 1000 + static_cast<int>(launched));  // the fake's pids count up
    EXPECT_EQ(Arg(launches.back(), "--cpu-set"), "");  // a cold start is pinned by the launcher
    EXPECT_EQ(launches.back().cpus, (std::vector<int>{1}));
    launcher_.Exit(pooled, SIGKILL);
    sup_->Tick();  // the killed one's exit is no crash of anything
    EXPECT_EQ(View("a")->restarts, 0);
    clock_.Advance(absl::Seconds(1));
    sup_->Tick();
    EXPECT_NE(Pool(0), nullptr);
    TearDown();
  }
}

// A pre-started runtime slow to answer its Load does not hold up the agent's loop: the
// replica waits, pending, for the answer, which a later pass takes.
TEST_F(PrestartTest, ALoadStillOnItsWayLeavesTheReplicaPendingUntilItsAnswerComes) {
  const PrestartedView held = ReadyWithLoadHeld(1);
  const pid_t pooled = held.pid;
  const std::string socket = held.socket;
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING)})).ok());
  sup_->Tick();
  EXPECT_EQ(View("a")->phase, "PENDING");
  EXPECT_EQ(View("a")->pid, 0);
  EXPECT_TRUE(ColdLaunches().empty());
  // The one asked is leaving the pool: the pool refills meanwhile.
  EXPECT_EQ(PrestartLaunches().size(), 5u);
  pool_ = sup_->PrestartedSnapshot();
  auto asked = std::find_if(pool_->begin(), pool_->end(),
                            [&](const PrestartedView& p) { return p.pid == pooled; });
  ASSERT_NE(asked, pool_->end());
  EXPECT_EQ(asked->loading_for, "a");
  clock_.Advance(absl::Milliseconds(1500));
  sup_->Tick();  // asked again: the same call's answer, still on its way
  EXPECT_EQ(View("a")->phase, "PENDING");
  EXPECT_EQ(runtimes_.Get(socket).load_calls, 2);
  EXPECT_TRUE(runtimes_.Get(socket).loads.empty());
  runtimes_.HoldLoad(socket, false);
  sup_->Tick();
  EXPECT_EQ(View("a")->pid, pooled);
  EXPECT_EQ(View("a")->phase, "STARTING");
  EXPECT_TRUE(ColdLaunches().empty());
  ASSERT_EQ(runtimes_.Get(socket).loads.size(), 1u);
  LaunchRequest as_cold;
  as_cold.argv = runtimes_.Get(socket).loads[0];
  as_cold.argv.insert(as_cold.argv.begin(), "kiln-runtime");
  EXPECT_EQ(Arg(as_cold, "--replica-id"), "a");
  EXPECT_EQ(Arg(as_cold, "--cpu-set"), "8-9");
  EXPECT_TRUE(launcher_.signals().empty());
}

// Past kHandOverWait (2 s) the replica starts cold; the Load's late answer stops a runtime
// that took a model nobody waits for, and kills one that failed it.
TEST_F(PrestartTest, AReplicaStartsColdWhenItsLoadIsUnansweredForTwoSeconds) {
  for (bool late_answer_ok : {true, false}) {
    SCOPED_TRACE(late_answer_ok ? "answered OK" : "failed");
    SetUp();  // the fake launcher and runtimes carry on from the round before
    sup_->Tick();
    AllPrestartedAnswer();
    sup_->Tick();
    const pid_t pooled = Pool(0)->pid;
    const std::string socket = Pool(0)->socket;
    const size_t cold = ColdLaunches().size();
    const size_t signalled = launcher_.signals().size();
    const size_t loaded = runtimes_.Get(socket).loads.size();
    runtimes_.HoldLoad(socket, true);
    ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
    sup_->Tick();
    clock_.Advance(absl::Milliseconds(1999));
    sup_->Tick();
    EXPECT_EQ(View("a")->phase, "PENDING");
    EXPECT_EQ(ColdLaunches().size(), cold);
    clock_.Advance(absl::Milliseconds(1));
    sup_->Tick();
    ASSERT_EQ(ColdLaunches().size(), cold + 1);
    EXPECT_NE(View("a")->pid, pooled);
    EXPECT_EQ(View("a")->phase, "STARTING");
    // On sockets of its own: the runtime that may yet take the Load binds the ones it named.
    auto on_its_way = runtimes_.Get(socket).load_on_its_way;
    ASSERT_TRUE(on_its_way.has_value());
    LaunchRequest sent;
    sent.argv = {"kiln-runtime"};
    sent.argv.insert(sent.argv.end(), on_its_way->begin(), on_its_way->end());
    EXPECT_EQ(Arg(sent, "--control-socket"), Socket("a"));
    EXPECT_NE(Arg(ColdLaunches().back(), "--control-socket"), Socket("a"));
    EXPECT_EQ(View("a")->socket, Arg(ColdLaunches().back(), "--control-socket"));
    sup_->Tick();  // still no answer: nothing happens to the runtime
    EXPECT_EQ(launcher_.signals().size(), signalled);
    if (!late_answer_ok) runtimes_.FailNextLoad(socket, absl::UnavailableError("reset"));
    runtimes_.HoldLoad(socket, false);
    sup_->Tick();
    // Either way it is killed: one that took the model serves nobody.
    ASSERT_EQ(launcher_.signals().size(), signalled + 1);
    EXPECT_EQ(launcher_.signals().back(), std::make_pair(pooled, SIGKILL));
    EXPECT_EQ(runtimes_.Get(socket).loads.size(), loaded + (late_answer_ok ? 1 : 0));
    EXPECT_EQ(ColdLaunches().size(), cold + 1);  // the replica keeps its cold start
    TearDown();
  }
}

// A replica removed while its Load is on its way: the runtime's answer settles it. Refused
// arguments put it back in the pool, still blank.
TEST_F(PrestartTest, ALoadAnsweredAfterItsReplicaWasRemovedIsSettledByThePool) {
  const PrestartedView held = ReadyWithLoadHeld(-1, 1);
  const pid_t pooled = held.pid;
  const std::string socket = held.socket;
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("c", -1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  EXPECT_EQ(View("c")->phase, "PENDING");
  ASSERT_TRUE(sup_->Apply(Assignment({}, 2)).ok());
  sup_->Tick();
  EXPECT_EQ(View("c"), nullptr);
  EXPECT_TRUE(ColdLaunches().empty());
  runtimes_.FailNextLoad(socket, absl::InvalidArgumentError("--threads: not a number"));
  runtimes_.HoldLoad(socket, false);
  sup_->Tick();
  pool_ = sup_->PrestartedSnapshot();
  auto back = std::find_if(pool_->begin(), pool_->end(),
                           [&](const PrestartedView& p) { return p.pid == pooled; });
  ASSERT_NE(back, pool_->end());
  EXPECT_EQ(back->loading_for, "");
  EXPECT_FALSE(back->stopping);
  EXPECT_EQ(Signals(pooled, SIGTERM) + Signals(pooled, SIGKILL), 0);
  EXPECT_TRUE(runtimes_.Get(socket).loads.empty());
  // Blank still, it takes the next replica.
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("d", -1, 1, v1::SERVING)}, 3)).ok());
  sup_->Tick();
  EXPECT_EQ(View("d")->pid, pooled);
  EXPECT_TRUE(ColdLaunches().empty());
}

// A replica restarting after a crash (its backoff over) waits for its Load's answer as a new
// one does, on the same runtime: no other pre-started runtime is spent on it meanwhile.
TEST_F(PrestartTest, ARestartAfterACrashWaitsForItsLoadOnOneRuntime) {
  sup_->Tick();
  AllPrestartedAnswer();
  sup_->Tick();
  const std::string first_socket = Pool(1)->socket;
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t first = View("a")->pid;
  const PrestartedView held = HoldLoadOnceReady(1);
  const pid_t pooled = held.pid;
  const std::string socket = held.socket;
  launcher_.Exit(first, SIGSEGV);
  sup_->Tick();
  EXPECT_EQ(View("a")->phase, "BACKOFF");
  clock_.Advance(absl::Seconds(1));
  for (int i = 0; i < 3; ++i) {
    sup_->Tick();
    EXPECT_EQ(View("a")->phase, "PENDING");
    clock_.Advance(absl::Milliseconds(200));
    AllPrestartedAnswer();  // the refill is ready too: it must not be asked
  }
  EXPECT_EQ(runtimes_.Get(socket).load_calls, 3);
  for (const auto& l : PrestartLaunches()) {
    const std::string other = Arg(l, "--control-socket");
    if (other == socket) continue;
    EXPECT_EQ(runtimes_.Get(other).load_calls, other == first_socket ? 1 : 0) << other;
  }
  runtimes_.HoldLoad(socket, false);
  sup_->Tick();
  EXPECT_EQ(View("a")->pid, pooled);
  EXPECT_EQ(View("a")->restarts, 1);
  EXPECT_TRUE(ColdLaunches().empty());
}

// A replica waiting for its Load keeps the socket the Load named, even once a lower name is
// free again: asked again, it is the same Load, not one for another socket (given up).
TEST_F(PrestartTest, AReplicaWaitingForItsLoadKeepsTheSocketItNamed) {
  const std::string first = ReadyWithLoadHeld(0).socket;
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  clock_.Advance(absl::Seconds(2));
  sup_->Tick();  // gave up on the first: cold, on a socket of its own
  const pid_t cold = View("a")->pid;
  ASSERT_EQ(View("a")->socket, Socket("a").substr(0, Socket("a").size() - 5) + ".1.sock");
  const PrestartedView held = HoldLoadOnceReady(0);
  const pid_t second = held.pid;
  const std::string second_socket = held.socket;
  launcher_.Exit(cold, SIGSEGV);
  sup_->Tick();
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();  // the restart's Load, to the second runtime, waits
  EXPECT_EQ(View("a")->phase, "PENDING");
  // The first refuses its late Load: back in the pool, and the name it held is free again.
  runtimes_.FailNextLoad(first, absl::InvalidArgumentError("--threads: not a number"));
  runtimes_.HoldLoad(first, false);
  sup_->Tick();
  EXPECT_EQ(View("a")->phase, "PENDING");
  runtimes_.HoldLoad(second_socket, false);
  sup_->Tick();
  EXPECT_EQ(View("a")->pid, second);
  EXPECT_EQ(ColdLaunches().size(), 1u);
  const auto loads = runtimes_.Get(second_socket).loads;
  ASSERT_EQ(loads.size(), 1u);
  LaunchRequest sent;
  sent.argv = {"kiln-runtime"};
  sent.argv.insert(sent.argv.end(), loads[0].begin(), loads[0].end());
  EXPECT_EQ(Arg(sent, "--control-socket"), View("a")->socket);
}

// A replica that crashed and waits for its Load's answer keeps its crash count across an
// agent restart (the state file lists it with the replicas waiting out a backoff); the
// runtime the Load went to is killed, and no replica starts on the socket it named until
// that process is gone.
TEST_F(PrestartTest, ACrashedReplicaWaitingForItsLoadKeepsItsCrashesAcrossARestart) {
  sup_->Tick();
  AllPrestartedAnswer();
  sup_->Tick();
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t first = View("a")->pid;
  AllPrestartedAnswer();
  sup_->Tick();
  const pid_t pooled = Pool(1)->pid;
  runtimes_.HoldLoad(Pool(1)->socket, true);
  launcher_.Exit(first, SIGSEGV);
  sup_->Tick();
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  ASSERT_EQ(View("a")->phase, "PENDING");
  ASSERT_EQ(View("a")->restarts, 1);
  sup_.reset();
  options_.prestart_per_gpu = 0;  // cold from here: the socket is what is looked at
  options_.prestart_cpu = 0;
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  EXPECT_EQ(Signals(pooled, SIGKILL), 1);
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING)}, 2)).ok());
  sup_->Tick();
  clock_.Advance(absl::Seconds(2));
  sup_->Tick();
  ASSERT_NE(View("a"), nullptr);
  EXPECT_EQ(View("a")->restarts, 1);  // the crash before the agent's restart still counts
  EXPECT_NE(View("a")->pid, 0);
  EXPECT_NE(View("a")->socket, Socket("a"));  // the killed runtime's Load named that one
  launcher_.Exit(pooled, SIGKILL);
  launcher_.Exit(View("a")->pid, SIGSEGV);
  sup_->Tick();
  clock_.Advance(absl::Seconds(10));
  sup_->Tick();
  EXPECT_EQ(View("a")->socket, Socket("a"));  // gone: the name is free again
}

// A Load that fails (not its arguments) after waiting: the runtime is killed, and the replica
// starts cold on a socket the runtime did not name, until that runtime is gone.
TEST_F(PrestartTest, ALoadThatFailsAfterWaitingStartsTheReplicaAwayFromItsSocket) {
  const PrestartedView held = ReadyWithLoadHeld(0);
  const pid_t pooled = held.pid;
  const std::string socket = held.socket;
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  runtimes_.FailNextLoad(socket, absl::DeadlineExceededError("Load"));
  runtimes_.HoldLoad(socket, false);
  clock_.Advance(absl::Milliseconds(500));
  sup_->Tick();
  EXPECT_EQ(Signals(pooled, SIGKILL), 1);
  ASSERT_EQ(ColdLaunches().size(), 1u);
  EXPECT_NE(Arg(ColdLaunches()[0], "--control-socket"), Socket("a"));
}

// The answer is for the replica as it was when the Load was sent: one whose settings changed
// meanwhile starts cold (on sockets of its own) instead of taking it.
TEST_F(PrestartTest, ALoadSentForAReplicaSinceChangedIsGivenUp) {
  const PrestartedView held = ReadyWithLoadHeld(0);
  const pid_t pooled = held.pid;
  const std::string socket = held.socket;
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  EXPECT_EQ(View("a")->phase, "PENDING");
  v1::ReplicaSpec moved = Spec("a", 0, 1, v1::SERVING);
  moved.set_repository("/models-v2");
  ASSERT_TRUE(sup_->Apply(Assignment({moved}, 2)).ok());
  sup_->Tick();
  ASSERT_EQ(ColdLaunches().size(), 1u);
  EXPECT_EQ(Arg(ColdLaunches()[0], "--model-repository"), "/models-v2");
  EXPECT_NE(Arg(ColdLaunches()[0], "--control-socket"), Socket("a"));
  runtimes_.HoldLoad(socket, false);
  sup_->Tick();
  EXPECT_EQ(Signals(pooled, SIGKILL), 1);  // it took the old settings' Load: serves nobody
}

// An agent stopped while a Load was on its way does not adopt that runtime as blank (it may
// take the Load still): it is killed, and the replica starts afresh.
TEST_F(PrestartTest, ARuntimeSentALoadWhenTheAgentStoppedIsNotAdopted) {
  sup_->Tick();
  AllPrestartedAnswer();
  sup_->Tick();
  const pid_t pooled = Pool(1)->pid;
  runtimes_.HoldLoad(Pool(1)->socket, true);
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING)})).ok());
  sup_->Tick();
  EXPECT_EQ(View("a")->phase, "PENDING");
  sup_.reset();
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  EXPECT_EQ(Signals(pooled, SIGKILL), 1);
  pool_ = sup_->PrestartedSnapshot();
  for (const auto& p : *pool_) EXPECT_NE(p.pid, pooled);
  // The replica starts afresh: from the adopted pool, on a socket the killed one did not name.
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING)}, 2)).ok());
  sup_->Tick();
  ASSERT_NE(View("a"), nullptr);
  EXPECT_NE(View("a")->pid, 0);
  EXPECT_NE(View("a")->pid, pooled);
  EXPECT_NE(View("a")->socket, Socket("a"));
}

TEST_F(PrestartTest, CrashedOrSilentPrestartedRuntimesAreReplacedWithBackoff) {
  sup_->Tick();
  const pid_t silent = Pool(-1, 0)->pid;
  const std::string silent_socket = Pool(-1, 0)->socket;
  // Silent past the timeout: killed, replaced after the first backoff.
  clock_.Advance(options_.prestart_timeout);
  AllPrestartedAnswer();
  runtimes_.SetReachable(silent_socket, false);
  sup_->Tick();
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{silent, SIGKILL}}));
  EXPECT_EQ(Pool(-1, 0), nullptr);
  EXPECT_EQ(PrestartLaunches().size(), 4u);
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  ASSERT_NE(Pool(-1, 0), nullptr);
  EXPECT_EQ(PrestartLaunches().size(), 5u);
  // A crash: replaced after the backoff doubles.
  launcher_.Exit(Pool(-1, 0)->pid, SIGSEGV);
  sup_->Tick();
  EXPECT_EQ(Pool(-1, 0), nullptr);
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  EXPECT_EQ(Pool(-1, 0), nullptr);
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  EXPECT_NE(Pool(-1, 0), nullptr);
}

TEST_F(PrestartTest, AnUnhealthyGpusPrestartedRuntimesStopAndAreNotReplaced) {
  sup_->Tick();
  AllPrestartedAnswer();
  sup_->Tick();
  const pid_t gpu0 = Pool(0)->pid;
  sup_->SetGpuHealth(0, false, "Xid 79");
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{gpu0, SIGTERM}}));
  launcher_.ExitCode(gpu0, 0);
  sup_->Tick();
  clock_.Advance(absl::Minutes(1));
  sup_->Tick();
  EXPECT_EQ(Pool(0), nullptr);
  EXPECT_EQ(PrestartLaunches().size(), 4u);
  sup_->SetGpuHealth(0, true, "");
  sup_->Tick();
  EXPECT_NE(Pool(0), nullptr);
}

TEST_F(PrestartTest, OneThatDoesNotStopIsKilledAndKeptInTheStateFileUntilItIsGone) {
  sup_->Tick();
  AllPrestartedAnswer();
  sup_->Tick();
  const pid_t gpu0 = Pool(0)->pid;
  sup_->SetGpuHealth(0, false, "Xid 79");
  sup_->Tick();
  std::string state = kiln::testing::ReadFile(dir_.string() + "/replicas.json");
  EXPECT_NE(state.find("\"pid\": " + std::to_string(gpu0)), std::string::npos) << state;
  clock_.Advance(options_.stop_timeout);
  sup_->Tick();
  EXPECT_EQ(Signals(gpu0, SIGKILL), 1);
  // An agent restarted meanwhile does not keep it either.
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  EXPECT_EQ(Signals(gpu0, SIGKILL), 2);
  EXPECT_EQ(Pool(0), nullptr);
}

TEST_F(PrestartTest, ParkingGpusHandTheirPoolOnlyToReplicasThatRunUnparked) {
  options_.park_warm_replicas = true;
  sup_ = MakeSupervisor();
  sup_->Tick();
  AllPrestartedAnswer();
  sup_->Tick();
  // Pool processes are not parked: the replicas they are for are mostly new SERVING ones.
  for (const auto& l : PrestartLaunches()) {
    EXPECT_EQ(std::count(l.env.begin(), l.env.end(), "CUDA_DISABLE_PERF_BOOST=1"), 0);
  }
  ASSERT_NE(Pool(1), nullptr);
  const pid_t pooled = Pool(1)->pid;
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("w", 1, 1, v1::WARM)})).ok());
  sup_->Tick();
  // A WARM replica on a parking GPU starts parked, so cold.
  const auto cold = ColdLaunches();
  ASSERT_EQ(cold.size(), 1u);
  EXPECT_EQ(std::count(cold[0].env.begin(), cold[0].env.end(), "CUDA_DISABLE_PERF_BOOST=1"), 1);
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("w", 1, 1, v1::WARM), Spec("s", 1, 1, v1::SERVING)}, 2)).ok());
  sup_->Tick();
  ASSERT_NE(View("s"), nullptr);
  EXPECT_EQ(View("s")->pid, pooled);
}

TEST_F(PrestartTest, ARestartedSupervisorAdoptsThePoolAndReplicasHandedFromIt) {
  sup_->Tick();
  AllPrestartedAnswer();
  sup_->Tick();
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t a = View("a")->pid;
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 7001);
  AllPrestartedAnswer();
  sup_->Tick();
  const std::vector<std::pair<int, int>> pools = {{-1, 0}, {-1, 1}, {0, -1}, {1, -1}};
  std::map<std::pair<int, int>, pid_t> pooled;
  for (auto [g, n] : pools) pooled[{g, n}] = Pool(g, n)->pid;
  const size_t launched = launcher_.launches().size();

  sup_.reset();
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  EXPECT_EQ(View("a")->pid, a);  // its command line names the pre-started socket: still ours
  EXPECT_TRUE(View("a")->adopted);
  for (auto [g, n] : pools) {
    ASSERT_NE(Pool(g, n), nullptr) << g << "/" << n;
    EXPECT_EQ(Pool(g, n)->pid, (pooled[{g, n}]));
    EXPECT_TRUE(Pool(g, n)->adopted);
    EXPECT_TRUE(Pool(g, n)->ready);
  }
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 2, v1::SERVING)}, 2)).ok());
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), launched);  // nothing new
  EXPECT_TRUE(launcher_.signals().empty());

  // An agent without a pool kills what the old one pre-started (nothing tracks them after).
  sup_.reset();
  options_.prestart_per_gpu = 0;
  options_.prestart_cpu = 0;
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  EXPECT_EQ(View("a")->pid, a);
  EXPECT_TRUE(sup_->PrestartedSnapshot()->empty());
  for (auto [g, n] : pools) EXPECT_EQ(Signals(pooled[{g, n}], SIGKILL), 1);
}

// An agent restarted with another --runtime-binary stops the runtimes the old one pre-started
// from the old binary (before, it skipped them, and they held their CPUs for ever), and
// pre-starts its own.
TEST_F(PrestartTest, PrestartedRuntimesOfAnotherBinaryAreStopped) {
  sup_->Tick();
  AllPrestartedAnswer();
  sup_->Tick();
  std::vector<pid_t> old;
  for (const auto& p : *sup_->PrestartedSnapshot()) old.push_back(p.pid);
  ASSERT_EQ(old.size(), 4u);
  const size_t launched = launcher_.launches().size();
  sup_.reset();
  options_.runtime_binary = "/opt/kiln-2/bin/kiln-runtime";
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  for (pid_t pid : old) EXPECT_EQ(Signals(pid, SIGKILL), 1) << pid;
  for (pid_t pid : old) launcher_.Exit(pid, SIGKILL);
  sup_->Tick();
  ASSERT_EQ(launcher_.launches().size(), launched + 4);
  EXPECT_EQ(launcher_.launches().back().argv[0], "/opt/kiln-2/bin/kiln-runtime");
}

TEST_F(PrestartTest, NewNamesNeverReuseOneAHandedReplicaStillNames) {
  options_.prestart_per_gpu = 0;
  sup_ = MakeSupervisor();
  sup_->Tick();
  AllPrestartedAnswer();
  sup_->Tick();
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("c", -1, 1, v1::SERVING)})).ok());
  const std::string handed = Pool(-1, 1)->socket;
  sup_->Tick();  // c takes node 1's runtime, whose command line names its socket for good
  runtimes_.Set(Socket("c"), v1::SERVING, "enc", "1", 7001);
  launcher_.Exit(Pool(-1, 1)->pid, SIGKILL);  // the replacement dies
  sup_->Tick();
  launcher_.Exit(Pool(-1, 0)->pid, SIGKILL);
  sup_->Tick();
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  clock_.Advance(absl::Seconds(5));
  sup_->Tick();
  ASSERT_EQ(PrestartLaunches().size(), 5u);
  std::map<std::string, int> uses;
  for (const auto& l : PrestartLaunches()) uses[Arg(l, "--control-socket")]++;
  EXPECT_EQ(uses[handed], 1) << handed << " reused while replica c's process names it";
}

TEST_F(PrestartTest, AdoptionKeepsOnlyWhatThePoolsWantOnTheSameGpus) {
  options_.prestart_per_gpu = 3;
  sup_ = MakeSupervisor();
  sup_->Tick();
  AllPrestartedAnswer();
  sup_->Tick();
  ASSERT_EQ(PrestartLaunches().size(), 8u);
  const pid_t gpu1 = Pool(1)->pid;

  // Restarted with smaller pools, on a node whose GPUs now enumerate the other way round.
  options_.prestart_per_gpu = 1;
  Topology t = TwoNodeTopology();
  std::swap(t.gpus[0], t.gpus[1]);
  sup_ = std::make_unique<Supervisor>(options_, t, &launcher_, &runtimes_, &clock_,
                                      [this](const std::string& s) { log_.push_back(s); }, &prober_);
  ASSERT_TRUE(sup_->Recover().ok());
  // Index 1 is another physical GPU now: nothing started for GPU-1 is kept as gpu 1.
  EXPECT_EQ(Signals(gpu1, SIGKILL), 1);
  EXPECT_TRUE(Pool(0) == nullptr && Pool(1) == nullptr);
  sup_->Tick();
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  AllPrestartedAnswer();
  sup_->Tick();
  // A same-shape restart (both GPUs where they were) trims the adopted pools to their size.
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  sup_->Tick();
  int per_gpu[2] = {0, 0};
  for (const auto& p : *sup_->PrestartedSnapshot()) {
    if (p.gpu >= 0 && !p.stopping) per_gpu[p.gpu]++;
  }
  EXPECT_EQ(per_gpu[0], 1);
  EXPECT_EQ(per_gpu[1], 1);
}

// A replica that never reaches WARM (a load hung on its device or its model store) is killed
// at the start timeout and restarted with backoff, instead of holding its CPUs and the node's
// readiness for ever.
TEST_F(SupervisorTest, AReplicaNotWarmInTimeIsKilledAndRestarted) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t a = View("a")->pid;
  runtimes_.Set(Socket("a"), v1::LOADING, "enc", "1");  // answers, but stays LOADING
  clock_.Advance(options_.start_timeout - absl::Seconds(1));
  sup_->Tick();
  EXPECT_TRUE(launcher_.signals().empty());
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{a, SIGKILL}}));
  EXPECT_NE(View("a")->last_error.find("not WARM within"), std::string::npos);
  launcher_.Exit(a, SIGKILL);
  sup_->Tick();
  clock_.Advance(absl::Seconds(1));
  sup_->Tick();
  EXPECT_EQ(launcher_.launches().size(), 2u);  // restarted after its backoff
  EXPECT_NE(View("a")->pid, a);
}

// A crash loop is reported while it lasts, not for ever: a replica that has run as long as
// resets the backoff (10 minutes) is out of it.
TEST_F(SupervisorTest, ACrashLoopEndsOnceTheReplicaRunsLongEnough) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  for (int crash = 0; crash < 6; ++crash) {
    launcher_.Exit(View("a")->pid, SIGKILL);
    sup_->Tick();
    AdvanceUntilALaunch();
  }
  ASSERT_TRUE(View("a")->crash_loop);
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1");
  sup_->Tick();
  clock_.Advance(absl::Minutes(9));
  sup_->Tick();
  EXPECT_TRUE(View("a")->crash_loop);
  clock_.Advance(absl::Minutes(1));
  sup_->Tick();
  EXPECT_FALSE(View("a")->crash_loop);
}

// A drain under way when the agent restarts goes on under the next agent: to the same
// deadline (not a fresh one), and a replica assigned again with another shape while it drained
// (to start once it is gone) does not get the saved assignment refused.
TEST_F(SupervisorTest, ADrainOutlivesAnAgentRestart) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 0, 1, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t a = View("a")->pid;
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1");
  sup_->Tick();
  ASSERT_TRUE(sup_->Apply(Assignment({}, 2)).ok());  // removed: it drains
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{a, SIGTERM}}));
  const v1::Assignment again = Assignment({Spec("a", 0, 2, v1::SERVING)}, 3);  // another shape
  ASSERT_TRUE(sup_->Apply(again).ok());
  clock_.Advance(absl::Seconds(6));
  sup_->Tick();
  sup_.reset();  // the agent restarts mid-drain
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  ASSERT_NE(View("a"), nullptr);
  EXPECT_EQ(View("a")->pid, a);
  EXPECT_EQ(View("a")->phase, "STOPPING");
  ASSERT_TRUE(sup_->Apply(again).ok()) << "the saved assignment is refused";
  sup_->Tick();
  EXPECT_EQ(launcher_.signals().size(), 1u);  // no second SIGTERM
  clock_.Advance(absl::Seconds(4));  // the first agent's 10 s deadline
  sup_->Tick();
  EXPECT_EQ(launcher_.signals().back(), std::make_pair(a, SIGKILL));
  launcher_.Exit(a, SIGKILL);
  sup_->Tick();
  ASSERT_EQ(launcher_.launches().size(), 2u);  // started again, as assigned now
  EXPECT_EQ(launcher_.launches().back().cpus.size(), 2u);
  EXPECT_EQ(View("a")->restarts, 0);
}

// State file entries a newer agent wrote (fields this one does not know) are adopted; fields
// of the wrong type count as absent; an entry whose spec cannot be read is not adopted, and its
// process, when it is ours, is stopped rather than left running with no owner.
TEST_F(SupervisorTest, RecoveryReadsNewerEntriesAndStopsWhatItCannotAdopt) {
  pid_t a = 0, b = 0;
  nlohmann::json doc = TwoServingThenGone(-1, &a, &b);
  const std::string path = dir_.string() + "/replicas.json";
  for (auto& e : doc["replicas"]) {
    if (e["pid"] == a) {
      e["spec"]["fieldOfANewerAgent"] = 3;
      e["log"] = nullptr;
      e["memory_node"] = "zero";
      e["restarts"] = "many";
    } else {
      e["spec"]["gpu"] = "the first";
    }
  }
  { std::ofstream(path) << doc.dump(); }
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  ASSERT_NE(View("a"), nullptr);
  EXPECT_EQ(View("a")->pid, a);
  EXPECT_TRUE(View("a")->adopted);
  EXPECT_EQ(View("b"), nullptr);
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{b, SIGKILL}}));
}

// A state file not as kiln wrote it: an entry without a control socket or with a pid out of
// range is passed over (an empty socket would match any process's command line), and a second
// entry for an adopted id is not adopted: its process, if ours, is stopped, never left unowned.
TEST_F(SupervisorTest, RecoveryPassesOverEntriesThatCannotBeTiedToTheirProcess) {
  pid_t a = 0, b = 0;
  nlohmann::json doc = TwoServingThenGone(1, &a, &b);
  const std::string path = dir_.string() + "/replicas.json";
  nlohmann::json ea, eb;
  for (const auto& e : doc["replicas"]) (e["pid"] == a ? ea : eb) = e;
  nlohmann::json no_socket = ea, huge_pid = ea, a_as_b = ea;
  no_socket["socket"] = "";
  no_socket.erase("launch_socket");
  huge_pid["pid"] = int64_t{1} << 40;
  a_as_b["spec"]["replicaId"] = "b";
  doc["replicas"] = {no_socket, huge_pid, eb, a_as_b, eb};
  { std::ofstream(path) << doc.dump(); }
  sup_ = MakeSupervisor();
  ASSERT_TRUE(sup_->Recover().ok());
  EXPECT_EQ(View("a"), nullptr);
  ASSERT_NE(View("b"), nullptr);
  EXPECT_EQ(View("b")->pid, b);
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{a, SIGKILL}}));
  const std::string said = absl::StrJoin(log_, "\n");
  EXPECT_NE(said.find("socket: not a control socket's path"), std::string::npos) << said;
  EXPECT_NE(said.find("pid: not a process id"), std::string::npos) << said;
  EXPECT_NE(said.find("a second entry for replica b"), std::string::npos) << said;
}

// A replica on a GPU the node no longer shows (the driver stopped answering after an upgrade,
// say) is not adopted, and its process is stopped; the agent does not crash on it.
TEST_F(SupervisorTest, RecoveryStopsReplicasOfAGpuTheNodeNoLongerHas) {
  ASSERT_TRUE(sup_->Apply(Assignment({Spec("a", 1, 1, v1::SERVING), Spec("c", -1, 1, v1::SERVING)})).ok());
  sup_->Tick();
  const pid_t a = View("a")->pid, c = View("c")->pid;
  runtimes_.Set(Socket("a"), v1::SERVING, "enc", "1", 7001);
  runtimes_.Set(Socket("c"), v1::SERVING, "enc", "1", 7003);
  sup_->Tick();
  sup_.reset();
  Topology no_gpus = TwoNodeTopology();
  no_gpus.gpus.clear();
  sup_ = std::make_unique<Supervisor>(options_, no_gpus, &launcher_, &runtimes_, &clock_,
                                      [this](const std::string& s) { log_.push_back(s); },
                                      &prober_);
  ASSERT_TRUE(sup_->Recover().ok());
  EXPECT_EQ(View("a"), nullptr);
  ASSERT_NE(View("c"), nullptr);
  EXPECT_EQ(View("c")->pid, c);
  EXPECT_EQ(launcher_.signals(), (std::vector<std::pair<pid_t, int>>{{a, SIGKILL}}));
  sup_->Tick();  // nothing indexes a GPU that is not there
  // The saved assignment, applied again, is refused with the reason.
  absl::Status s = sup_->Apply(Assignment({Spec("a", 1, 1, v1::SERVING), Spec("c", -1, 1, v1::SERVING)}, 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("does not exist"), std::string::npos) << s;
}

}  // namespace
}  // namespace kiln
