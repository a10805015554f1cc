#include "agent/cpu_allocator.h"

#include <algorithm>

namespace kiln {

std::vector<int> AgentReservedCpus(const Topology& topology, int reserved) {
  std::vector<int> out;
  if (reserved <= 0) return out;
  for (const auto& node : topology.numa_nodes) {
    for (int c : IntersectCpus(node.cpus, topology.allowed_cpus)) {
      if (static_cast<int>(out.size()) == reserved) return out;
      out.push_back(c);
    }
    if (!out.empty()) return out;  // all from one node
  }
  return out;
}

std::vector<int> AgentCpus(const std::vector<int>& allowed, const std::set<int>& held,
                           const std::vector<int>& reserved) {
  std::vector<int> out;
  for (int c : allowed) {
    if (!held.count(c)) out.push_back(c);
  }
  if (!out.empty()) return out;
  return reserved.empty() ? allowed : reserved;
}

namespace {

std::vector<int> Free(const std::vector<int>& candidates, const std::set<int>& in_use,
                      const std::vector<int>& reserved) {
  std::vector<int> out;
  for (int c : candidates) {
    if (in_use.count(c) || std::find(reserved.begin(), reserved.end(), c) != reserved.end()) {
      continue;
    }
    out.push_back(c);
  }
  return out;
}

}  // namespace

absl::StatusOr<CpuAssignment> AllocateCpus(const Topology& t, const std::set<int>& in_use,
                                           const std::vector<int>& reserved, int gpu, int count) {
  if (count < 1) return absl::InvalidArgumentError("cpus: must be >= 1, got " + std::to_string(count));
  CpuAssignment a;
  if (gpu >= 0) {
    if (gpu >= static_cast<int>(t.gpus.size())) {
      return absl::NotFoundError("gpu " + std::to_string(gpu) + ": this node has " +
                                 std::to_string(t.gpus.size()) + " GPU(s)");
    }
    const GpuTopology& g = t.gpus[gpu];
    std::vector<int> free = Free(g.local_cpus, in_use, reserved);
    if (static_cast<int>(free.size()) < count) {
      return absl::ResourceExhaustedError(
          "gpu " + std::to_string(gpu) + ": " + std::to_string(count) + " CPUs wanted, " +
          std::to_string(free.size()) + " free near it (local " + FormatCpuList(g.local_cpus) +
          ", in use or reserved elsewhere)");
    }
    a.cpus.assign(free.begin(), free.begin() + count);
    a.memory_node = g.numa_node;
    return a;
  }
  // A CPU replica: the NUMA node with the most free CPUs (lowest id on ties).
  int best_node = -1;
  std::vector<int> best;
  for (const auto& node : t.numa_nodes) {
    std::vector<int> free = Free(IntersectCpus(node.cpus, t.allowed_cpus), in_use, reserved);
    if (free.size() > best.size()) {
      best = free;
      best_node = node.id;
    }
  }
  if (static_cast<int>(best.size()) < count) {
    return absl::ResourceExhaustedError("cpus: " + std::to_string(count) +
                                        " wanted, at most " + std::to_string(best.size()) +
                                        " free on one NUMA node");
  }
  a.cpus.assign(best.begin(), best.begin() + count);
  a.memory_node = t.numa_nodes.size() > 1 ? best_node : -1;
  return a;
}

}  // namespace kiln
