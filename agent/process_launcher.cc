#include "agent/process_launcher.h"

#include <fcntl.h>
#include <linux/close_range.h>
#include <numaif.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string_view>

extern char** environ;

namespace kiln {

namespace {

// Marks every descriptor from `low` up close-on-exec. Runs in a forked child of a threaded
// process, so only system calls: close_range (Linux 5.11), else one fcntl per possible
// descriptor.
void MarkCloseOnExecFrom(int low) {
  if (syscall(SYS_close_range, static_cast<unsigned>(low), ~0U, CLOSE_RANGE_CLOEXEC) == 0) return;
  struct rlimit lim {};
  rlim_t top = 65536;
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    top = std::min<rlim_t>(lim.rlim_cur, 1 << 20);
  }
  for (int fd = low; fd < static_cast<int>(top); ++fd) {
    const int flags = fcntl(fd, F_GETFD);
    if (flags >= 0 && !(flags & FD_CLOEXEC)) fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
  }
}

}  // namespace

std::string MallocHugePagesTunable(const char* inherited) {
  constexpr std::string_view kTunable = "glibc.malloc.hugetlb=1";
  if (inherited == nullptr || *inherited == '\0') return "GLIBC_TUNABLES=" + std::string(kTunable);
  const std::string_view value(inherited);
  if (value.find("glibc.malloc.hugetlb") != std::string_view::npos) return "";
  return "GLIBC_TUNABLES=" + std::string(value) + ":" + std::string(kTunable);
}

absl::StatusOr<pid_t> RealProcessLauncher::Launch(const LaunchRequest& r) {
  if (r.argv.empty()) return absl::InvalidArgumentError("launch: empty argv");
  if (access(r.argv[0].c_str(), X_OK) != 0) {
    return absl::NotFoundError(r.argv[0] + ": not an executable");
  }
  // Everything the child needs is prepared before fork: the child only makes syscalls.
  std::vector<char*> argv;
  for (const auto& a : r.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env_storage;
  for (char** e = environ; e && *e; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    const bool replaced = std::any_of(r.env.begin(), r.env.end(), [&](const std::string& x) {
      return x.size() > name.size() && x.compare(0, name.size(), name) == 0 &&
             x[name.size()] == '=';
    });
    if (!replaced) env_storage.emplace_back(entry);
  }
  for (const auto& e : r.env) env_storage.push_back(e);
  std::vector<char*> envp;
  for (auto& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);
  cpu_set_t cpuset;
  CPU_ZERO(&cpuset);
  for (int c : r.cpus) {
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &cpuset);
  }
  unsigned long nodemask[16] = {};
  if (r.memory_node >= 0 && r.memory_node < 1024) {
    nodemask[r.memory_node / (8 * sizeof(unsigned long))] |=
        1UL << (r.memory_node % (8 * sizeof(unsigned long)));
  }
  int log_fd = -1;
  if (!r.log_file.empty()) {
    log_fd = open(r.log_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
    if (log_fd < 0) return absl::PermissionDeniedError(r.log_file + ": " + strerror(errno));
  }
  int err_pipe[2];
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    if (log_fd >= 0) close(log_fd);
    return absl::InternalError("pipe2 failed");
  }
  // Signals are held across fork: the child must not run the agent's handlers (a SIGTERM
  // landing between fork and exec would write to the agent's signal pipe and stop it). The
  // child puts every disposition back to the default, then takes signals again.
  sigset_t all, before;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &before);
  pid_t pid = fork();
  if (pid != 0) pthread_sigmask(SIG_SETMASK, &before, nullptr);
  if (pid < 0) {
    if (log_fd >= 0) close(log_fd);
    close(err_pipe[0]);
    close(err_pipe[1]);
    return absl::ResourceExhaustedError(std::string("fork: ") + strerror(errno));
  }
  if (pid == 0) {
    // Child: own session and process group, so the runtime outlives the agent.
    setsid();
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    for (int s = 1; s < NSIG; ++s) sigaction(s, &dfl, nullptr);  // KILL, STOP: refused, fine
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    int step = 0;
    if (log_fd >= 0) {
      dup2(log_fd, 1);
      dup2(log_fd, 2);
    }
    // Nothing but stdin, stdout and stderr reaches the runtime. Libraries open descriptors
    // without close-on-exec (Boost.Asio's sockets: the agent's admin and router listeners and
    // their connections); a runtime holding the admin listener would keep a restarted agent
    // from binding its port, and a connection the agent closed from ending.
    MarkCloseOnExecFrom(3);
    if (!r.cpus.empty() && sched_setaffinity(0, sizeof(cpuset), &cpuset) != 0) step = 1;
    if (step == 0 && r.memory_node >= 0 &&
        set_mempolicy(MPOL_BIND, nodemask, sizeof(nodemask) * 8 + 1) != 0) {
      step = 2;
    }
    if (step == 0) {
      execve(argv[0], argv.data(), envp.data());
      step = 3;
    }
    int e[2] = {step, errno};
    [[maybe_unused]] ssize_t n = write(err_pipe[1], e, sizeof(e));
    _exit(127);
  }
  if (log_fd >= 0) close(log_fd);
  close(err_pipe[1]);
  int e[2] = {0, 0};
  ssize_t n = read(err_pipe[0], e, sizeof(e));  // EOF (0) when exec succeeded
  close(err_pipe[0]);
  if (n == sizeof(e)) {
    int status;
    waitpid(pid, &status, 0);
    const char* what = e[0] == 1 ? "sched_setaffinity" : e[0] == 2 ? "set_mempolicy" : "execve";
    return absl::InternalError(std::string(what) + " failed for " + r.argv[0] + ": " +
                               strerror(e[1]));
  }
  absl::MutexLock lock(&mu_);
  children_.push_back(pid);
  return pid;
}

namespace {
int PidfdOpen(pid_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }
int PidfdSendSignal(int fd, int sig) {
  return static_cast<int>(syscall(SYS_pidfd_send_signal, fd, sig, nullptr, 0));
}
// The process behind `fd` has exited (its pidfd polls readable).
bool PidfdExited(int fd) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, 0) > 0;
}
}  // namespace

RealProcessLauncher::~RealProcessLauncher() {
  NotifyAdoptedExits(nullptr);
  absl::MutexLock lock(&mu_);
  for (const auto& [pid, fd] : adopted_) {
    if (fd >= 0) close(fd);
  }
}

absl::Status RealProcessLauncher::Signal(pid_t pid, int sig) {
  if (pid <= 0) return absl::InvalidArgumentError("bad pid");
  {
    absl::MutexLock lock(&mu_);
    auto it = adopted_.find(pid);
    if (it != adopted_.end() && it->second >= 0) {
      if (PidfdSendSignal(it->second, sig) != 0 && errno != ESRCH) {
        return absl::InternalError("pidfd_send_signal(" + std::to_string(pid) +
                                   "): " + strerror(errno));
      }
      return absl::OkStatus();
    }
  }
  if (kill(pid, sig) != 0 && errno != ESRCH) {
    return absl::InternalError("kill(" + std::to_string(pid) + "): " + strerror(errno));
  }
  return absl::OkStatus();
}

bool RealProcessLauncher::Alive(pid_t pid) {
  if (pid <= 0 || kill(pid, 0) != 0) return false;
  // A zombie is not alive.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  std::getline(stat, text);
  size_t close_paren = text.rfind(')');
  return close_paren == std::string::npos || close_paren + 2 >= text.size() ||
         text[close_paren + 2] != 'Z';
}

std::string RealProcessLauncher::CommandLine(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return s;
}

absl::Status RealProcessLauncher::Adopt(pid_t pid) {
  if (!Alive(pid)) return absl::NotFoundError("process " + std::to_string(pid) + " is not running");
  const int fd = PidfdOpen(pid);  // -1 on a kernel without pidfds: kill(pid, 0) then
  absl::MutexLock lock(&mu_);
  auto [it, fresh] = adopted_.try_emplace(pid, fd);
  if (!fresh && fd >= 0) close(fd);
  if (fresh) WakeWatcher();
  return absl::OkStatus();
}

void RealProcessLauncher::WakeWatcher() {
  if (watcher_wake_[1] < 0) return;
  char one = 1;
  (void)!::write(watcher_wake_[1], &one, 1);
}

void RealProcessLauncher::NotifyAdoptedExits(std::function<void()> on_exit) {
  if (watcher_.joinable()) {
    {
      absl::MutexLock lock(&mu_);
      watcher_stop_ = true;
      WakeWatcher();
    }
    watcher_.join();
    absl::MutexLock lock(&mu_);
    ::close(watcher_wake_[0]);
    ::close(watcher_wake_[1]);
    watcher_wake_[0] = watcher_wake_[1] = -1;
    watcher_stop_ = false;
  }
  if (!on_exit) return;
  absl::MutexLock lock(&mu_);
  reported_.clear();  // exits not collected yet are announced to this watcher too
  if (::pipe2(watcher_wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    watcher_wake_[0] = watcher_wake_[1] = -1;
    return;  // exits are seen when CollectExits is next called, as without a watcher
  }
  watcher_ = std::thread([this, on_exit = std::move(on_exit)] { WatchLoop(on_exit); });
}

void RealProcessLauncher::WatchLoop(std::function<void()> on_exit) {
  for (;;) {
    std::vector<pollfd> fds{{watcher_wake_[0], POLLIN, 0}};
    std::vector<pid_t> pids{0};
    {
      absl::MutexLock lock(&mu_);
      if (watcher_stop_) return;
      for (const auto& [pid, fd] : adopted_) {
        if (fd < 0 || reported_.count(pid)) continue;
        fds.push_back({fd, POLLIN, 0});
        pids.push_back(pid);
      }
    }
    // A pidfd closed by CollectExits meanwhile stays open for this poll (the kernel holds
    // the file); the wake that follows its removal makes the next pass drop it.
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno != EINTR) usleep(100 * 1000);  // not expected; tried again, never spun on
      continue;
    }
    if (fds[0].revents & POLLIN) {
      char drain[64];
      while (::read(watcher_wake_[0], drain, sizeof(drain)) > 0) {
      }
    }
    bool exited = false;
    {
      absl::MutexLock lock(&mu_);
      for (size_t i = 1; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        if (adopted_.count(pids[i]) && reported_.insert(pids[i]).second) exited = true;
      }
    }
    if (exited) on_exit();
  }
}

std::vector<ProcessExit> RealProcessLauncher::CollectExits() {
  std::vector<ProcessExit> out;
  absl::MutexLock lock(&mu_);
  for (auto it = children_.begin(); it != children_.end();) {
    int status = 0;
    pid_t r = waitpid(*it, &status, WNOHANG);
    if (r == *it || (r < 0 && errno == ECHILD)) {
      out.push_back({*it, r == *it ? status : 0});
      it = children_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = adopted_.begin(); it != adopted_.end();) {
    const auto [pid, fd] = *it;
    if (fd >= 0 ? PidfdExited(fd) : !Alive(pid)) {
      out.push_back({pid, 0});  // not our child: the exit status is unknown
      if (fd >= 0) close(fd);
      reported_.erase(pid);
      it = adopted_.erase(it);
      WakeWatcher();
    } else {
      ++it;
    }
  }
  return out;
}

absl::StatusOr<pid_t> FakeProcessLauncher::Launch(const LaunchRequest& request) {
  std::function<void(const LaunchRequest&)> hook;
  {
    absl::MutexLock lock(&mu_);
    hook = on_launch_;
  }
  if (hook) hook(request);
  absl::MutexLock lock(&mu_);
  if (!fail_next_.ok()) {
    absl::Status s = fail_next_;
    fail_next_ = absl::OkStatus();
    return s;
  }
  pid_t pid = next_pid_++;
  alive_[pid] = true;
  std::string cmd;
  for (const auto& a : request.argv) cmd += a + std::string(1, '\0');
  cmdlines_[pid] = cmd;
  launches_.push_back(request);
  return pid;
}

absl::Status FakeProcessLauncher::Signal(pid_t pid, int sig) {
  absl::MutexLock lock(&mu_);
  signals_.push_back({pid, sig});
  return absl::OkStatus();
}

std::vector<ProcessExit> FakeProcessLauncher::CollectExits() {
  absl::MutexLock lock(&mu_);
  std::vector<ProcessExit> out;
  out.swap(exits_);
  return out;
}

absl::Status FakeProcessLauncher::Adopt(pid_t pid) {
  absl::MutexLock lock(&mu_);
  if (!alive_[pid]) return absl::NotFoundError("not running");
  return absl::OkStatus();
}

std::string FakeProcessLauncher::CommandLine(pid_t pid) {
  absl::MutexLock lock(&mu_);
  return alive_[pid] ? cmdlines_[pid] : "";
}

bool FakeProcessLauncher::Alive(pid_t pid) {
  absl::MutexLock lock(&mu_);
  return alive_[pid];
}

void FakeProcessLauncher::Exit(pid_t pid, int signal_number) {
  absl::MutexLock lock(&mu_);
  if (!alive_[pid]) return;
  alive_[pid] = false;
  exits_.push_back({pid, signal_number & 0x7f});  // WIFSIGNALED form
}

void FakeProcessLauncher::ExitCode(pid_t pid, int code) {
  absl::MutexLock lock(&mu_);
  if (!alive_[pid]) return;
  alive_[pid] = false;
  exits_.push_back({pid, (code & 0xff) << 8});  // WIFEXITED form
}

void FakeProcessLauncher::FailNextLaunch(absl::Status status) {
  absl::MutexLock lock(&mu_);
  fail_next_ = std::move(status);
}

std::vector<LaunchRequest> FakeProcessLauncher::launches() const {
  absl::MutexLock lock(&mu_);
  return launches_;
}

std::vector<std::pair<pid_t, int>> FakeProcessLauncher::signals() const {
  absl::MutexLock lock(&mu_);
  return signals_;
}

std::vector<pid_t> FakeProcessLauncher::alive() const {
  absl::MutexLock lock(&mu_);
  std::vector<pid_t> out;
  for (const auto& [pid, a] : alive_) {
    if (a) out.push_back(pid);
  }
  return out;
}

}  // namespace kiln
