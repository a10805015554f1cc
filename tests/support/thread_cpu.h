#pragma once

// CPU time a process's threads of one name have used, from /proc: for tests of what spins.
#include <sys/types.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace kiln::testing {

// User and system CPU time, in ms, of the threads of process `pid` (0: this one) whose name
// (comm) is `name`; -1 when none is. Counted in clock ticks (10 ms on most kernels).
inline double ThreadCpuMs(pid_t pid, const std::string& name) {
  const std::filesystem::path tasks =
      pid == 0 ? std::filesystem::path("/proc/self/task")
               : std::filesystem::path("/proc") / std::to_string(pid) / "task";
  double ms = -1;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator(tasks, ec)) {
    std::ifstream comm(task.path() / "comm");
    std::string got;
    if (!std::getline(comm, got) || got != name) continue;
    std::ifstream stat_file(task.path() / "stat");
    const std::string stat((std::istreambuf_iterator<char>(stat_file)),
                           std::istreambuf_iterator<char>());
    // After the name's closing parenthesis: the state (field 3), ... utime (14), stime (15).
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 1));
    const std::vector<std::string> f{std::istream_iterator<std::string>(rest),
                                     std::istream_iterator<std::string>()};
    if (f.size() < 13) continue;
    if (ms < 0) ms = 0;
    ms += (std::stod(f[11]) + std::stod(f[12])) * 1000.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  return ms;
}

}  // namespace kiln::testing
