#pragma once

#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agent/topology.h"

namespace kiln {

// Where one replica's threads and memory go.
struct CpuAssignment {
  std::vector<int> cpus;  // exclusive to this replica
  int memory_node = -1;   // NUMA node to bind memory to; -1 = no binding
};

// The agent keeps the first `reserved` allowed CPUs of node 0 (or of the first node with
// allowed CPUs) for itself; replicas never get them.
std::vector<int> AgentReservedCpus(const Topology& topology, int reserved);

// Picks `count` CPUs for a replica on `gpu` (-1 = a CPU replica) that are allowed, not
// reserved for the agent and not `in_use` by another replica. A GPU replica takes CPUs local
// to its GPU's NUMA node (all allowed CPUs when the node is unknown); a CPU replica takes
// them from the NUMA node with the most free CPUs. Lowest-numbered first, so the choice is
// deterministic. RESOURCE_EXHAUSTED (with the numbers) when there are not enough.
absl::StatusOr<CpuAssignment> AllocateCpus(const Topology& topology, const std::set<int>& in_use,
                                           const std::vector<int>& reserved, int gpu, int count);

// The CPUs the agent's own threads (router, loop, admin) run on: the allowed CPUs no replica
// holds, so replicas' sets stay exclusive of the agent too. When replicas hold them all: the
// CPUs reserved for the agent, and with none reserved every allowed CPU (nothing is left to
// keep apart).
std::vector<int> AgentCpus(const std::vector<int>& allowed, const std::set<int>& held,
                           const std::vector<int>& reserved);

}  // namespace kiln
