#pragma once

// A process's threads, from /proc: the CPU time those of one name have used (for tests of what
// spins), and the CPUs each may run on (for tests of pinning).
#include <sys/types.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace kiln::testing {

// User and system CPU time, in ms, of the threads of process `pid` (0: this one) whose name
// (comm) is `name`; -1 when none is (or /proc cannot be read). Counted in clock ticks (10 ms
// on most kernels). Threads that end while they are looked at are left out.
inline double ThreadCpuMs(pid_t pid, const std::string& name) {
  const std::filesystem::path tasks =
      pid == 0 ? std::filesystem::path("/proc/self/task")
               : std::filesystem::path("/proc") / std::to_string(pid) / "task";
  double ms = -1;
  std::error_code ec;
  std::filesystem::directory_iterator it(tasks, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    std::ifstream comm(it->path() / "comm");
    std::string got;
    if (!std::getline(comm, got) || got != name) continue;
    std::ifstream stat_file(it->path() / "stat");
    const std::string stat((std::istreambuf_iterator<char>(stat_file)),
                           std::istreambuf_iterator<char>());
    // After the name's closing parenthesis: the state (field 3), ... utime (14), stime (15).
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 1));
    const std::vector<std::string> f{std::istream_iterator<std::string>(rest),
                                     std::istream_iterator<std::string>()};
    if (f.size() < 13) continue;
    const double ticks = std::strtod(f[11].c_str(), nullptr) + std::strtod(f[12].c_str(), nullptr);
    ms = (ms < 0 ? 0 : ms) + ticks * 1000.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  return ms;
}

// Each thread of process `pid`: its name (comm) and the CPUs it may run on, as /proc writes
// them ("0-3,8"). Threads that end while they are looked at are left out; empty when /proc
// cannot be read.
struct ThreadCpuList {
  std::string name;
  std::string cpus;
};
inline std::vector<ThreadCpuList> ThreadCpuLists(pid_t pid) {
  std::vector<ThreadCpuList> out;
  std::error_code ec;
  std::filesystem::directory_iterator
      it(std::filesystem::path("/proc") / std::to_string(pid) / "task", ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    std::ifstream comm(it->path() / "comm");
    std::ifstream status(it->path() / "status");
    ThreadCpuList t;
    if (!std::getline(comm, t.name)) continue;
    const std::string key = "Cpus_allowed_list:\t";
    for (std::string line; std::getline(status, line);) {
      if (line.rfind(key, 0) == 0) {
        t.cpus = line.substr(key.size());
        out.push_back(std::move(t));
        break;
      }
    }
  }
  return out;
}

}  // namespace kiln::testing
