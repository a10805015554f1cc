#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agent/gpu_driver.h"
#include "common/cpu_list.h"
#include "common/filesystem.h"

namespace kiln {

std::vector<int> IntersectCpus(const std::vector<int>& a, const std::vector<int>& b);

struct NumaNode {
  int id = 0;
  std::vector<int> cpus;          // online CPUs of the node
  int64_t memory_bytes = 0;
};

struct GpuTopology {
  GpuIdentity identity;
  std::string pci_bus_id;       // sysfs form, "0000:3b:00.0"
  int numa_node = -1;           // -1 = unknown
  std::vector<int> local_cpus;  // within the allowed CPUs; all allowed CPUs when unknown
};

struct Topology {
  std::vector<int> online_cpus;
  std::vector<int> allowed_cpus;  // online, in this process's cgroup cpuset and affinity
  std::vector<NumaNode> numa_nodes;
  std::vector<GpuTopology> gpus;
  std::string gpu_driver;  // "nvml 550.54", "fake", or "none"
  bool fake_gpus = false;

  int NumaNodeOfCpu(int cpu) const;  // -1 when unknown
};

struct TopologyOptions {
  std::string sysfs_root = "/sys";
  // This process's cgroup (v2) path, from /proc/self/cgroup ("0::/kubepods/..."); empty for
  // the root cgroup.
  std::string cgroup_path;
  // The CPUs sched_getaffinity allows; empty = no restriction.
  std::vector<int> affinity;
};

// Reads CPUs, NUMA nodes and memory from sysfs, the allowed CPUs from the cgroup cpuset and
// affinity, and GPUs from `gpus` (null = a CPU-only node) with their NUMA node and local CPUs
// from sysfs.
absl::StatusOr<Topology> DiscoverTopology(const Filesystem& fs, GpuDriver* gpus,
                                          const TopologyOptions& options);

// Parses /proc/self/cgroup text and returns the cgroup v2 path ("" when absent).
std::string CgroupV2Path(const std::string& proc_self_cgroup);

}  // namespace kiln
