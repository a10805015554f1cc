#include "agent/topology.h"

#include <algorithm>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/status.h"

namespace kiln {

std::vector<int> IntersectCpus(const std::vector<int>& a, const std::vector<int>& b) {
  std::vector<int> x = a, y = b, out;
  std::sort(x.begin(), x.end());
  std::sort(y.begin(), y.end());
  std::set_intersection(x.begin(), x.end(), y.begin(), y.end(), std::back_inserter(out));
  return out;
}

int Topology::NumaNodeOfCpu(int cpu) const {
  for (const auto& n : numa_nodes) {
    if (std::binary_search(n.cpus.begin(), n.cpus.end(), cpu)) return n.id;
  }
  return -1;
}

std::string CgroupV2Path(const std::string& proc_self_cgroup) {
  std::istringstream in(proc_self_cgroup);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("0::", 0) == 0) {
      std::string p = line.substr(3);
      return p == "/" ? "" : p;
    }
  }
  return "";
}

namespace {

int64_t ParseNodeMemTotal(const std::string& meminfo) {
  std::istringstream in(meminfo);
  std::string line;
  while (std::getline(in, line)) {
    size_t at = line.find("MemTotal:");
    if (at == std::string::npos) continue;
    std::istringstream rest(line.substr(at + 9));
    int64_t kb = 0;
    rest >> kb;
    return kb * 1024;
  }
  return 0;
}

}  // namespace

absl::StatusOr<Topology> DiscoverTopology(const Filesystem& fs, GpuDriver* gpus,
                                          const TopologyOptions& options) {
  const std::string& sys = options.sysfs_root;
  Topology t;
  KILN_ASSIGN_OR_RETURN(std::string online, fs.ReadFile(sys + "/devices/system/cpu/online"));
  KILN_ASSIGN_OR_RETURN(t.online_cpus,
                        ParseCpuList(online, sys + "/devices/system/cpu/online"));
  if (t.online_cpus.empty()) {
    return absl::FailedPreconditionError(sys + "/devices/system/cpu/online lists no CPU");
  }

  // NUMA nodes; a kernel without NUMA shows none: one node holds every CPU.
  auto nodes = fs.ListDir(sys + "/devices/system/node");
  if (nodes.ok()) {
    for (const auto& name : *nodes) {
      int id = 0;
      if (name.rfind("node", 0) != 0 || !absl::SimpleAtoi(name.substr(4), &id)) continue;
      std::string dir = sys + "/devices/system/node/" + name;
      NumaNode n;
      n.id = id;
      KILN_ASSIGN_OR_RETURN(std::string list, fs.ReadFile(dir + "/cpulist"));
      KILN_ASSIGN_OR_RETURN(n.cpus, ParseCpuList(list, dir + "/cpulist"));
      n.cpus = IntersectCpus(n.cpus, t.online_cpus);
      if (auto mem = fs.ReadFile(dir + "/meminfo"); mem.ok()) n.memory_bytes = ParseNodeMemTotal(*mem);
      t.numa_nodes.push_back(std::move(n));
    }
    std::sort(t.numa_nodes.begin(), t.numa_nodes.end(),
              [](const NumaNode& a, const NumaNode& b) { return a.id < b.id; });
  }
  if (t.numa_nodes.empty()) t.numa_nodes.push_back(NumaNode{0, t.online_cpus, 0});

  t.allowed_cpus = t.online_cpus;
  std::string cpuset = sys + "/fs/cgroup" + options.cgroup_path + "/cpuset.cpus.effective";
  if (auto eff = fs.ReadFile(cpuset); eff.ok()) {
    KILN_ASSIGN_OR_RETURN(auto cg, ParseCpuList(*eff, cpuset));
    if (!cg.empty()) t.allowed_cpus = IntersectCpus(t.allowed_cpus, cg);
  }
  if (!options.affinity.empty()) t.allowed_cpus = IntersectCpus(t.allowed_cpus, options.affinity);
  if (t.allowed_cpus.empty()) {
    return absl::FailedPreconditionError("no CPU is both online and allowed to this process "
                                         "(cgroup cpuset and affinity)");
  }

  t.gpu_driver = "none";
  if (gpus == nullptr) return t;
  t.gpu_driver = gpus->name();
  t.fake_gpus = gpus->fake();
  KILN_ASSIGN_OR_RETURN(int count, gpus->DeviceCount());
  for (int i = 0; i < count; ++i) {
    GpuTopology g;
    KILN_ASSIGN_OR_RETURN(g.identity, gpus->Identify(i));
    KILN_ASSIGN_OR_RETURN(g.pci_bus_id, NormalizePciBusId(g.identity.pci_bus_id));
    std::string dev = sys + "/bus/pci/devices/" + g.pci_bus_id;
    if (auto numa = fs.ReadFile(dev + "/numa_node"); numa.ok()) {
      int n = -1;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(*numa), &n) && n >= 0) g.numa_node = n;
    }
    g.local_cpus = t.allowed_cpus;
    if (g.numa_node >= 0) {
      if (auto local = fs.ReadFile(dev + "/local_cpulist"); local.ok()) {
        KILN_ASSIGN_OR_RETURN(auto cpus, ParseCpuList(*local, dev + "/local_cpulist"));
        auto within = IntersectCpus(cpus, t.allowed_cpus);
        if (!within.empty()) g.local_cpus = within;
      }
    }
    t.gpus.push_back(std::move(g));
  }
  return t;
}

}  // namespace kiln
