#pragma once

// Helpers for tests that drive real binaries: start one with its output to a log, run a
// command line, read a file whole.
#include <fcntl.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace kiln::testing {

struct ShellResult {
  int rc = -1;
  std::string out;  // stdout and stderr together
};

// Runs `cmd` through /bin/sh and waits for it.
inline ShellResult Shell(const std::string& cmd) {
  ShellResult r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Starts args[0] with `args`, its stdout and stderr appended to `log`; returns the pid. With
// `netns` (a path such as /run/netns/NAME) it runs in that network namespace.
inline pid_t SpawnLogged(const std::vector<std::string>& args, const std::string& log,
                         const std::string& netns = "") {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    if (!netns.empty()) {
      int ns = open(netns.c_str(), O_RDONLY | O_CLOEXEC);
      if (ns < 0 || setns(ns, CLONE_NEWNET) != 0) {
        // No allocation here (a forked child of a threaded process): plain writes.
        const char* why = strerror(errno);
        const char prefix[] = "cannot enter the network namespace: ";
        (void)!write(2, prefix, sizeof(prefix) - 1);
        (void)!write(2, why, strlen(why));
        (void)!write(2, "\n", 1);
        _exit(126);
      }
      close(ns);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Whether `pid` runs: it exists and is not a zombie (killed, not yet reaped by its parent).
inline bool Running(pid_t pid) {
  const std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

// Prometheus's promtool: on the PATH, else `fallback` (where scripts/fetch-promtool.sh puts
// it); empty when neither has it.
inline std::string FindPromtool(const std::string& fallback) {
  if (Shell("command -v promtool").rc == 0) return "promtool";
  if (access(fallback.c_str(), X_OK) == 0) return fallback;
  return "";
}

// `promtool check metrics` on `text` (written to `scratch` first): its exit status and output.
inline ShellResult PromtoolCheck(const std::string& promtool, const std::string& text,
                                 const std::string& scratch) {
  std::ofstream(scratch) << text;
  return Shell(promtool + " check metrics < " + scratch);
}

}  // namespace kiln::testing
