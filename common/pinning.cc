#include "common/pinning.h"

#include <linux/mempolicy.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>

#include "absl/strings/numbers.h"

namespace kiln {

namespace {

absl::Status ToCpuSet(const std::vector<int>& cpus, cpu_set_t* set) {
  CPU_ZERO(set);
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE) {
      return absl::InvalidArgumentError("cpu " + std::to_string(c) + " is out of range");
    }
    CPU_SET(c, set);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PinThisThread(const std::vector<int>& cpus) {
  if (cpus.empty()) return absl::InvalidArgumentError("no cpus to pin the thread to");
  cpu_set_t set;
  if (absl::Status s = ToCpuSet(cpus, &set); !s.ok()) return s;
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    return absl::InternalError("sched_setaffinity(this thread): " + std::string(strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status PinThisProcess(const std::vector<int>& cpus, int memory_node) {
  if (!cpus.empty()) {
    cpu_set_t set;
    if (absl::Status s = ToCpuSet(cpus, &set); !s.ok()) return s;
    // A thread may start while the list is read: go round until a pass finds no new one.
    std::set<int> pinned;
    bool settled = false;
    for (int pass = 0; pass < 8 && !settled; ++pass) {
      bool found_new = false;
      std::error_code ec;
      for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task", ec)) {
        int tid = 0;
        if (!absl::SimpleAtoi(entry.path().filename().string(), &tid) || pinned.count(tid)) continue;
        found_new = true;
        if (sched_setaffinity(tid, sizeof(set), &set) != 0) {
          if (errno == ESRCH) continue;  // the thread ended meanwhile
          return absl::InternalError("sched_setaffinity(thread " + std::to_string(tid) +
                                     "): " + strerror(errno));
        }
        pinned.insert(tid);
      }
      if (ec) return absl::InternalError("/proc/self/task: " + ec.message());
      settled = !found_new;
    }
    if (!settled) {
      return absl::InternalError("threads kept starting while they were pinned");
    }
  }
  if (memory_node >= 0) {
    if (memory_node >= 1024) {
      return absl::InvalidArgumentError("memory node " + std::to_string(memory_node) +
                                        " is out of range");
    }
    unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {};
    mask[memory_node / (8 * sizeof(unsigned long))] |= 1UL << (memory_node % (8 * sizeof(unsigned long)));
    // The kernel reads one bit fewer than maxnode says.
    if (syscall(SYS_set_mempolicy, MPOL_BIND, mask, sizeof(mask) * 8 + 1) != 0) {
      return absl::InternalError("set_mempolicy(node " + std::to_string(memory_node) +
                                 "): " + strerror(errno));
    }
  }
  return absl::OkStatus();
}

}  // namespace kiln
