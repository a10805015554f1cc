#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kiln {

struct LaunchRequest {
  std::vector<std::string> argv;  // argv[0] is the executable path
  // NAME=VALUE entries on top of the agent's environment; one replaces the agent's own entry of
  // the same NAME (a process reads the first of two, which would be the agent's).
  std::vector<std::string> env;
  std::vector<int> cpus;          // CPU affinity; empty = inherit
  int memory_node = -1;           // bind memory to this NUMA node; -1 = no binding
  std::string log_file;           // stdout and stderr; empty = inherit
};

// The GLIBC_TUNABLES entry that puts glibc malloc's heap on transparent huge pages
// (glibc.malloc.hugetlb=1), given the value the agent itself runs with (nullptr: none). A
// runtime's start allocates tens of MiB in small pieces while LibTorch registers its
// operators; on 2 MiB pages that is a few dozen page faults instead of ~10,000, about 0.1-0.2 s
// of spawn -> WARM on a VM (bench/RESULTS.md, 2026-11-28 session 9). Empty when the agent's
// value already says how malloc uses huge pages: the operator's choice stands.
std::string MallocHugePagesTunable(const char* inherited);

struct ProcessExit {
  pid_t pid = 0;
  int status = 0;  // as waitpid reports it
};

// The OS seam for processes. Children are started in their own session, so they survive the
// agent's exit and can be adopted again.
class ProcessLauncher {
 public:
  virtual ~ProcessLauncher() = default;
  virtual absl::StatusOr<pid_t> Launch(const LaunchRequest& request) = 0;
  virtual absl::Status Signal(pid_t pid, int sig) = 0;
  // Exits seen since the last call (children reaped, and adopted processes found gone).
  virtual std::vector<ProcessExit> CollectExits() = 0;
  // Watch a process this launcher did not start (re-adoption after an agent restart).
  virtual absl::Status Adopt(pid_t pid) = 0;
  virtual bool Alive(pid_t pid) = 0;
  // The process's command line, arguments joined by NUL ("" when gone).
  virtual std::string CommandLine(pid_t pid) = 0;
  // `on_exit` runs (on a thread of the launcher's) when an adopted process exits, once per
  // process: the caller then collects it with CollectExits. A child's exit is the caller's
  // SIGCHLD. An empty function stops the watching; it has returned when this call returns.
  virtual void NotifyAdoptedExits(std::function<void()> on_exit) {}
};

class RealProcessLauncher : public ProcessLauncher {
 public:
  absl::StatusOr<pid_t> Launch(const LaunchRequest& request) override;
  absl::Status Signal(pid_t pid, int sig) override;
  std::vector<ProcessExit> CollectExits() override;
  absl::Status Adopt(pid_t pid) override;
  bool Alive(pid_t pid) override;
  std::string CommandLine(pid_t pid) override;
  void NotifyAdoptedExits(std::function<void()> on_exit) override;

 private:
  void WatchLoop(std::function<void()> on_exit);
  void WakeWatcher() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // the adopted set changed, or it stops

  absl::Mutex mu_;
  std::vector<pid_t> children_ ABSL_GUARDED_BY(mu_);
  // Adopted processes (not our children) by pid, each with a pidfd taken at adoption (-1 where
  // the kernel has none): its exit is seen, and it is signalled, through the pidfd, so a pid
  // the kernel reuses for another process is never mistaken for it.
  std::map<pid_t, int> adopted_ ABSL_GUARDED_BY(mu_);
  // The watcher of adopted pidfds: the processes it has reported (not reported again), a
  // pipe that wakes it, and whether it stops. The thread and the pipe are set up and torn
  // down only by NotifyAdoptedExits, never while the watcher runs (it reads the pipe's ends
  // without the lock).
  std::thread watcher_;
  std::set<pid_t> reported_ ABSL_GUARDED_BY(mu_);
  int watcher_wake_[2] = {-1, -1};
  bool watcher_stop_ ABSL_GUARDED_BY(mu_) = false;

 public:
  ~RealProcessLauncher() override;
};

// A launcher for tests: nothing runs; the test decides when processes exit.
class FakeProcessLauncher : public ProcessLauncher {
 public:
  absl::StatusOr<pid_t> Launch(const LaunchRequest& request) override;
  absl::Status Signal(pid_t pid, int sig) override;
  std::vector<ProcessExit> CollectExits() override;
  absl::Status Adopt(pid_t pid) override;
  bool Alive(pid_t pid) override;
  std::string CommandLine(pid_t pid) override;

  // The process exits with `status` (waitpid form), e.g. Exit(pid, SIGKILL) for a kill.
  void Exit(pid_t pid, int signal_number);
  void ExitCode(pid_t pid, int code);
  void FailNextLaunch(absl::Status status);
  // Called at the start of every Launch, before the process "exists".
  void OnLaunch(std::function<void(const LaunchRequest&)> hook) {
    absl::MutexLock lock(&mu_);
    on_launch_ = std::move(hook);
  }
  // Every launch so far, in order.
  std::vector<LaunchRequest> launches() const;
  std::vector<std::pair<pid_t, int>> signals() const;
  std::vector<pid_t> alive() const;

 private:
  mutable absl::Mutex mu_;
  pid_t next_pid_ ABSL_GUARDED_BY(mu_) = 1000;
  std::map<pid_t, bool> alive_ ABSL_GUARDED_BY(mu_);
  std::map<pid_t, std::string> cmdlines_ ABSL_GUARDED_BY(mu_);
  std::vector<ProcessExit> exits_ ABSL_GUARDED_BY(mu_);
  std::vector<LaunchRequest> launches_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<pid_t, int>> signals_ ABSL_GUARDED_BY(mu_);
  absl::Status fail_next_ ABSL_GUARDED_BY(mu_);
  std::function<void(const LaunchRequest&)> on_launch_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln
