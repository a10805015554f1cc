// The real launcher on /bin/sh (milliseconds): affinity, memory policy, environment, own
// session, log file, exit collection.
#include "agent/process_launcher.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"

namespace kiln {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Bounded poll for the exit of `pid`.
std::optional<ProcessExit> WaitForExit(ProcessLauncher& l, pid_t pid) {
  for (int i = 0; i < 2000; ++i) {
    for (const auto& e : l.CollectExits()) {
      if (e.pid == pid) return e;
    }
    usleep(1000);
  }
  return std::nullopt;
}

// A `sleep 30` this test process starts itself (so not the launcher's child).
pid_t SpawnSleep() {
  pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sleep", "sleep", "30", nullptr);
    _exit(1);
  }
  return pid;
}

class RealLauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    log_ = (std::filesystem::temp_directory_path() /
            ("kiln_launch_" + std::to_string(getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".log"))
               .string();
    std::filesystem::remove(log_);
  }
  void TearDown() override { std::filesystem::remove(log_); }
  std::string log_;
  RealProcessLauncher launcher_;
};

TEST_F(RealLauncherTest, AppliesAffinityMemoryPolicyEnvironmentAndSession) {
  LaunchRequest r;
  r.argv = {"/bin/sh", "-c",
            "grep Cpus_allowed_list /proc/self/status; echo env=$KILN_TEST_VALUE; "
            "head -1 /proc/self/numa_maps; cut -d' ' -f6 /proc/self/stat; echo pid=$$"};
  r.env = {"KILN_TEST_VALUE=hello"};
  r.cpus = {0};
  r.memory_node = 0;
  r.log_file = log_;
  auto pid = launcher_.Launch(r);
  ASSERT_TRUE(pid.ok()) << pid.status();
  auto exit = WaitForExit(launcher_, *pid);
  ASSERT_TRUE(exit.has_value());
  EXPECT_TRUE(WIFEXITED(exit->status) && WEXITSTATUS(exit->status) == 0);
  std::string out = ReadAll(log_);
  EXPECT_NE(out.find("Cpus_allowed_list:\t0\n"), std::string::npos) << out;
  EXPECT_NE(out.find("env=hello"), std::string::npos) << out;
  EXPECT_NE(out.find("bind:0"), std::string::npos) << out;
  // The session id (field 6 of /proc/self/stat of the sh) is the child's own pid.
  EXPECT_NE(out.find(std::to_string(*pid) + "\npid=" + std::to_string(*pid)), std::string::npos)
      << out;
}

// An entry of the request replaces the agent's own of the same name: a process reads the first
// of two (a CUDA_VISIBLE_DEVICES or GLIBC_TUNABLES of the agent's would win otherwise).
TEST_F(RealLauncherTest, TheRequestsEntriesReplaceTheAgentsOfTheSameName) {
  ASSERT_EQ(setenv("KILN_TEST_REPLACED", "agent", 1), 0);
  ASSERT_EQ(setenv("KILN_TEST_KEPT", "agent", 1), 0);
  LaunchRequest r;
  r.argv = {"/bin/sh", "-c",
            "echo n=$(tr '\\0' '\\n' < /proc/$$/environ | grep -c '^KILN_TEST_REPLACED=');"
            " echo v=$KILN_TEST_REPLACED; echo k=$KILN_TEST_KEPT; echo p=$KILN_TEST_REPLACED_NOT"};
  r.env = {"KILN_TEST_REPLACED=replica", "KILN_TEST_REPLACED_NOT=new"};
  r.log_file = log_;
  auto pid = launcher_.Launch(r);
  unsetenv("KILN_TEST_REPLACED");
  unsetenv("KILN_TEST_KEPT");
  ASSERT_TRUE(pid.ok()) << pid.status();
  auto exit = WaitForExit(launcher_, *pid);
  ASSERT_TRUE(exit.has_value());
  std::string out = ReadAll(log_);
  EXPECT_NE(out.find("n=1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("v=replica\n"), std::string::npos) << out;
  EXPECT_NE(out.find("k=agent\n"), std::string::npos) << out;
  EXPECT_NE(out.find("p=new\n"), std::string::npos) << out;
}

TEST(MallocHugePagesTunableTest, AddsTheTunableUnlessTheAgentsValueSetsIt) {
  EXPECT_EQ(MallocHugePagesTunable(nullptr), "GLIBC_TUNABLES=glibc.malloc.hugetlb=1");
  EXPECT_EQ(MallocHugePagesTunable(""), "GLIBC_TUNABLES=glibc.malloc.hugetlb=1");
  EXPECT_EQ(MallocHugePagesTunable("glibc.malloc.check=3"),
            "GLIBC_TUNABLES=glibc.malloc.check=3:glibc.malloc.hugetlb=1");
  EXPECT_EQ(MallocHugePagesTunable("glibc.malloc.hugetlb=0"), "");
  EXPECT_EQ(MallocHugePagesTunable("glibc.malloc.check=3:glibc.malloc.hugetlb=2"), "");
}

// The child starts with no signal blocked or ignored, whatever the agent blocks or ignores
// (the agent ignores SIGPIPE; an ignored disposition would outlive exec).
TEST_F(RealLauncherTest, TheChildStartsWithDefaultSignals) {
  struct sigaction ignore {}, pipe_before {}, usr2_before {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ASSERT_EQ(sigaction(SIGPIPE, &ignore, &pipe_before), 0);
  ASSERT_EQ(sigaction(SIGUSR2, &ignore, &usr2_before), 0);
  sigset_t usr1, old;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &usr1, &old);
  LaunchRequest r;
  r.argv = {"/bin/sh", "-c", "grep -E '^Sig(Blk|Ign)' /proc/self/status"};
  r.log_file = log_;
  auto pid = launcher_.Launch(r);
  // The launcher gave this thread its own mask back (SIGUSR1 still blocked, nothing else).
  sigset_t now;
  pthread_sigmask(SIG_SETMASK, &old, &now);
  EXPECT_EQ(sigismember(&now, SIGUSR1), 1);
  EXPECT_EQ(sigismember(&now, SIGTERM), 0);
  sigaction(SIGPIPE, &pipe_before, nullptr);
  sigaction(SIGUSR2, &usr2_before, nullptr);
  ASSERT_TRUE(pid.ok()) << pid.status();
  auto exit = WaitForExit(launcher_, *pid);
  ASSERT_TRUE(exit.has_value());
  std::string out = ReadAll(log_);
  EXPECT_NE(out.find("SigBlk:\t0000000000000000\n"), std::string::npos) << out;
  size_t at = out.find("SigIgn:\t");
  ASSERT_NE(at, std::string::npos) << out;
  const uint64_t ignored = std::stoull(out.substr(at + 8, 16), nullptr, 16);
  EXPECT_EQ(ignored & (1ULL << (SIGPIPE - 1)), 0u) << out;
  EXPECT_EQ(ignored & (1ULL << (SIGUSR2 - 1)), 0u) << out;
}

// Descriptors the agent holds without close-on-exec (Boost.Asio's listeners and connections
// are made so) do not reach the child: a runtime holding the agent's admin listener would keep
// a restarted agent from binding its port.
TEST_F(RealLauncherTest, TheChildInheritsNoDescriptorButItsStandardOnes) {
  int p[2];
  ASSERT_EQ(pipe(p), 0);  // no O_CLOEXEC
  const int sock = socket(AF_INET, SOCK_STREAM, 0);  // no SOCK_CLOEXEC
  ASSERT_GE(sock, 0);
  LaunchRequest r;
  const std::string fds =
      std::to_string(p[0]) + " " + std::to_string(p[1]) + " " + std::to_string(sock);
  r.argv = {"/bin/sh", "-c",
            "for fd in " + fds +
                "; do if [ -e /proc/$$/fd/$fd ]; then echo open=$fd; else echo closed=$fd; fi; "
                "done; [ -e /proc/$$/fd/1 ] && echo stdout=open"};
  r.log_file = log_;
  auto pid = launcher_.Launch(r);
  close(p[0]);
  close(p[1]);
  close(sock);
  ASSERT_TRUE(pid.ok()) << pid.status();
  auto exit = WaitForExit(launcher_, *pid);
  ASSERT_TRUE(exit.has_value());
  std::string out = ReadAll(log_);
  EXPECT_EQ(out.find("open="), std::string::npos) << out;
  EXPECT_NE(out.find("closed=" + std::to_string(sock)), std::string::npos) << out;
  EXPECT_NE(out.find("stdout=open"), std::string::npos) << out;
}

TEST_F(RealLauncherTest, ReportsSignalsAndMissingBinaries) {
  LaunchRequest r;
  r.argv = {"/bin/sleep", "30"};
  auto pid = launcher_.Launch(r);
  ASSERT_TRUE(pid.ok());
  EXPECT_TRUE(launcher_.Alive(*pid));
  ASSERT_TRUE(launcher_.Signal(*pid, SIGKILL).ok());
  auto exit = WaitForExit(launcher_, *pid);
  ASSERT_TRUE(exit.has_value());
  EXPECT_TRUE(WIFSIGNALED(exit->status));
  EXPECT_EQ(WTERMSIG(exit->status), SIGKILL);
  EXPECT_FALSE(launcher_.Alive(*pid));

  r.argv = {"/nonexistent/kiln-runtime"};
  EXPECT_EQ(launcher_.Launch(r).status().code(), absl::StatusCode::kNotFound);
  r.argv = {"/bin/true"};
  r.cpus = {CPU_SETSIZE - 1};  // no such CPU here: the affinity call fails in the child
  auto bad = launcher_.Launch(r);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("sched_setaffinity"), std::string::npos) << bad.status();
}

TEST_F(RealLauncherTest, AdoptsAProcessItDidNotStart) {
  const pid_t pid = SpawnSleep();
  RealProcessLauncher other;
  ASSERT_TRUE(other.Adopt(pid).ok());
  EXPECT_TRUE(other.CollectExits().empty());
  kill(pid, SIGKILL);
  int status;
  waitpid(pid, &status, 0);  // reaped by its real parent
  auto exit = WaitForExit(other, pid);
  EXPECT_TRUE(exit.has_value());
  EXPECT_EQ(other.Adopt(pid).code(), absl::StatusCode::kNotFound);
}

// An adopted process is signalled and its exit seen through the pidfd taken at adoption (so a
// reused pid is never taken for it): the signal reaches it, and its exit shows while it is
// still a zombie its real parent has not reaped, whose pid kill(pid, 0) still finds.
TEST_F(RealLauncherTest, AnAdoptedProcessIsFollowedByItsPidfd) {
  const pid_t pid = SpawnSleep();
  RealProcessLauncher other;
  ASSERT_TRUE(other.Adopt(pid).ok());
  ASSERT_TRUE(other.Signal(pid, SIGKILL).ok());
  auto exit = WaitForExit(other, pid);  // not reaped yet: a zombie
  EXPECT_TRUE(exit.has_value());
  EXPECT_EQ(kill(pid, 0), 0) << "the zombie should still hold its pid";
  int status;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
}

// An adopted process's exit is announced by the launcher's watcher, once, without anyone
// calling CollectExits (the agent's loop wakes on it instead of waiting out its tick); a
// process adopted after the watcher started is watched too, and stopping the watcher returns.
TEST_F(RealLauncherTest, AnAdoptedProcessesExitIsAnnouncedOnce) {
  const pid_t first = SpawnSleep();
  RealProcessLauncher other;
  ASSERT_TRUE(other.Adopt(first).ok());
  std::atomic<int> announced{0};
  other.NotifyAdoptedExits([&] { announced++; });
  usleep(20000);  // the watcher is asleep on `first` alone when `second` is adopted
  const pid_t second = SpawnSleep();
  ASSERT_TRUE(other.Adopt(second).ok());
  usleep(20000);
  EXPECT_EQ(announced.load(), 0) << "nothing exited yet";

  kill(second, SIGKILL);
  for (int i = 0; i < 5000 && announced.load() == 0; ++i) usleep(1000);
  ASSERT_EQ(announced.load(), 1);
  usleep(20000);
  EXPECT_EQ(announced.load(), 1) << "an exit not yet collected is announced once, not again";
  auto exits = other.CollectExits();
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].pid, second);

  kill(first, SIGKILL);
  for (int i = 0; i < 5000 && announced.load() < 2; ++i) usleep(1000);
  EXPECT_EQ(announced.load(), 2);
  other.NotifyAdoptedExits(nullptr);  // stops; returns
  int status;
  waitpid(first, &status, 0);
  waitpid(second, &status, 0);
}

}  // namespace
}  // namespace kiln
