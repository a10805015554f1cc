#include "common/pinning.h"

#include <linux/mempolicy.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include "absl/strings/numbers.h"

namespace kiln {

absl::Status PinThisProcess(const std::vector<int>& cpus, int memory_node) {
  if (!cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : cpus) {
      if (c < 0 || c >= CPU_SETSIZE) {
        return absl::InvalidArgumentError("cpu " + std::to_string(c) + " is out of range");
      }
      CPU_SET(c, &set);
    }
    // A thread may start while the list is read: go round until a pass finds no new one.
    std::error_code ec;
    for (int pass = 0, pinned_before = -1, pinned = 0; pass < 8 && pinned != pinned_before;
         ++pass) {
      pinned_before = pinned;
      pinned = 0;
      for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task", ec)) {
        int tid = 0;
        if (!absl::SimpleAtoi(entry.path().filename().string(), &tid)) continue;
        if (sched_setaffinity(tid, sizeof(set), &set) != 0) {
          if (errno == ESRCH) continue;  // the thread ended meanwhile
          return absl::InternalError("sched_setaffinity(thread " + std::to_string(tid) +
                                     "): " + strerror(errno));
        }
        ++pinned;
      }
      if (ec) return absl::InternalError("/proc/self/task: " + ec.message());
    }
  }
  if (memory_node >= 0) {
    if (memory_node >= 1024) {
      return absl::InvalidArgumentError("memory node " + std::to_string(memory_node) +
                                        " is out of range");
    }
    unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {};
    mask[memory_node / (8 * sizeof(unsigned long))] |= 1UL << (memory_node % (8 * sizeof(unsigned long)));
    if (syscall(SYS_set_mempolicy, MPOL_BIND, mask, sizeof(mask) * 8) != 0) {
      return absl::InternalError("set_mempolicy(node " + std::to_string(memory_node) +
                                 "): " + strerror(errno));
    }
  }
  return absl::OkStatus();
}

}  // namespace kiln
