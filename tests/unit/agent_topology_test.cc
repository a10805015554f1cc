#include <sched.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <thread>

#include "agent/cpu_allocator.h"
#include "agent/fake_gpu_driver.h"
#include "agent/nvml_driver.h"
#include "agent/topology.h"
#include "common/cpu_list.h"
#include "common/pinning.h"
#include "gtest/gtest.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

TEST(CpuListTest, ParsesAndFormats) {
  EXPECT_EQ(*ParseCpuList("0-3,8,10-11\n", "f"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(*ParseCpuList("", "f"), std::vector<int>{});
  EXPECT_EQ(*ParseCpuList("5,1,1-2", "f"), (std::vector<int>{1, 2, 5}));
  EXPECT_EQ(FormatCpuList({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(FormatCpuList({}), "");
  for (const char* bad : {"a", "3-1", "1-", "-2", "1,,2", "0-99999"}) {
    auto r = ParseCpuList(bad, "cpuset.cpus.effective");
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("cpuset.cpus.effective"), std::string::npos);
  }
}

// The calling thread's CPUs: all of this process's here, and only the one a thread is held to.
TEST(CpuListTest, AllowedCpusAreTheCallingThreadsAffinity) {
  const std::vector<int> all = AllowedCpus();
  ASSERT_FALSE(all.empty());
  EXPECT_TRUE(std::is_sorted(all.begin(), all.end()));
  std::vector<int> in_thread;
  std::thread t([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(all.back(), &one);
    ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
    in_thread = AllowedCpus();
  });
  t.join();
  EXPECT_EQ(in_thread, std::vector<int>{all.back()});
  EXPECT_EQ(AllowedCpus(), all);  // this thread is untouched
}

// PinThisThread holds the calling thread alone; no CPUs, or one out of range, is refused
// and leaves it where it was.
TEST(PinningTest, PinThisThreadPinsOnlyTheCaller) {
  const std::vector<int> all = AllowedCpus();
  ASSERT_FALSE(all.empty());
  std::vector<int> in_thread, after_bad;
  absl::Status empty, out_of_range, pinned;
  std::thread t([&] {
    empty = PinThisThread({});
    out_of_range = PinThisThread({all.back(), CPU_SETSIZE});
    after_bad = AllowedCpus();
    pinned = PinThisThread({all.back()});
    in_thread = AllowedCpus();
  });
  t.join();
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument) << empty;
  EXPECT_EQ(out_of_range.code(), absl::StatusCode::kInvalidArgument) << out_of_range;
  EXPECT_NE(out_of_range.message().find("cpu " + std::to_string(CPU_SETSIZE)), std::string::npos)
      << out_of_range;
  EXPECT_EQ(after_bad, all);
  ASSERT_TRUE(pinned.ok()) << pinned;
  EXPECT_EQ(in_thread, std::vector<int>{all.back()});
  EXPECT_EQ(AllowedCpus(), all);  // this thread is untouched
}

TEST(PciBusIdTest, NormalisesToSysfsForm) {
  EXPECT_EQ(*NormalizePciBusId("00000000:3B:00.0"), "0000:3b:00.0");
  EXPECT_EQ(*NormalizePciBusId("0000:3b:00.0"), "0000:3b:00.0");
  EXPECT_EQ(*NormalizePciBusId("00000001:C1:1F.7"), "0001:c1:1f.7");
  for (const char* bad : {"", "3b:00.0", "0000:3b:00", "zz:3b:00.0", "123456789:00:00.0"}) {
    EXPECT_FALSE(NormalizePciBusId(bad).ok()) << bad;
  }
}

TEST(CgroupTest, FindsTheV2Path) {
  EXPECT_EQ(CgroupV2Path("0::/kubepods/pod1/c2\n"), "/kubepods/pod1/c2");
  EXPECT_EQ(CgroupV2Path("0::/\n"), "");
  EXPECT_EQ(CgroupV2Path("12:cpuset:/x\n"), "");
}

// A fake sysfs: 2 NUMA nodes (0: CPUs 0-7, 1: CPUs 8-15), 4 GPUs (0 and 1 on node 0, 2 on
// node 1, 3 with numa_node -1), the process's cgroup limited to CPUs 0-13.
class FakeSysfsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("kiln_sysfs_" + std::to_string(getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    Write("devices/system/cpu/online", "0-15\n");
    Write("devices/system/node/node0/cpulist", "0-7\n");
    Write("devices/system/node/node0/meminfo", "Node 0 MemTotal:       65536 kB\nNode 0 MemFree: 1 kB\n");
    Write("devices/system/node/node1/cpulist", "8-15\n");
    Write("devices/system/node/node1/meminfo", "Node 1 MemTotal:       131072 kB\n");
    Write("devices/system/node/possible", "0-1\n");
    Write("fs/cgroup/kiln/cpuset.cpus.effective", "0-13\n");
    const char* numa[] = {"0", "0", "1", "-1"};
    const char* local[] = {"0-7", "0-7", "8-15", "0-15"};
    for (int i = 0; i < 4; ++i) {
      char bdf[32];
      std::snprintf(bdf, sizeof(bdf), "0000:%02x:00.0", 0x10 + i);
      Write(std::string("bus/pci/devices/") + bdf + "/numa_node", std::string(numa[i]) + "\n");
      Write(std::string("bus/pci/devices/") + bdf + "/local_cpulist", std::string(local[i]) + "\n");
    }
    driver_ = std::make_unique<FakeGpuDriver>(FakeGpuDriver::MakeGpus(4, 80LL << 30));
  }
  void TearDown() override { fs::remove_all(root_); }
  void Write(const std::string& rel, const std::string& text) {
    fs::create_directories((root_ / rel).parent_path());
    std::ofstream(root_ / rel) << text;
  }
  Topology Discover(std::vector<int> affinity = {}) {
    TopologyOptions o;
    o.sysfs_root = root_.string();
    o.cgroup_path = "/kiln";
    o.affinity = std::move(affinity);
    auto t = DiscoverTopology(fs_, driver_.get(), o);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : Topology{};
  }

  fs::path root_;
  RootedFilesystem fs_;
  std::unique_ptr<FakeGpuDriver> driver_;
};

TEST_F(FakeSysfsTest, DiscoversNodesGpusAndAllowedCpus) {
  Topology t = Discover();
  EXPECT_EQ(t.online_cpus.size(), 16u);
  EXPECT_EQ(FormatCpuList(t.allowed_cpus), "0-13");
  ASSERT_EQ(t.numa_nodes.size(), 2u);
  EXPECT_EQ(t.numa_nodes[1].memory_bytes, 131072LL * 1024);
  EXPECT_EQ(t.NumaNodeOfCpu(9), 1);
  ASSERT_EQ(t.gpus.size(), 4u);
  EXPECT_TRUE(t.fake_gpus);
  EXPECT_EQ(t.gpu_driver, "fake");
  EXPECT_EQ(t.gpus[2].pci_bus_id, "0000:12:00.0");
  EXPECT_EQ(t.gpus[2].numa_node, 1);
  EXPECT_EQ(FormatCpuList(t.gpus[2].local_cpus), "8-13");  // within the cgroup
  EXPECT_EQ(t.gpus[3].numa_node, -1);
  EXPECT_EQ(FormatCpuList(t.gpus[3].local_cpus), "0-13");  // unknown: all allowed
}

TEST_F(FakeSysfsTest, AffinityNarrowsTheAllowedSet) {
  Topology t = Discover({2, 3, 4, 9});
  EXPECT_EQ(FormatCpuList(t.allowed_cpus), "2-4,9");
  EXPECT_EQ(FormatCpuList(t.gpus[0].local_cpus), "2-4");
}

TEST_F(FakeSysfsTest, NoNumaDirectoryMeansOneNode) {
  fs::remove_all(root_ / "devices/system/node");
  Topology t = Discover();
  ASSERT_EQ(t.numa_nodes.size(), 1u);
  EXPECT_EQ(t.numa_nodes[0].cpus.size(), 16u);
}

TEST_F(FakeSysfsTest, CpuOnlyNodeWithoutADriver) {
  TopologyOptions o;
  o.sysfs_root = root_.string();
  auto t = DiscoverTopology(fs_, nullptr, o);
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(t->gpus.empty());
  EXPECT_EQ(t->gpu_driver, "none");
  EXPECT_EQ(FormatCpuList(t->allowed_cpus), "0-15");  // the root cgroup has no cpuset file
}

TEST_F(FakeSysfsTest, BrokenSysfsIsAClearError) {
  Write("devices/system/cpu/online", "garbage");
  TopologyOptions o;
  o.sysfs_root = root_.string();
  auto t = DiscoverTopology(fs_, nullptr, o);
  EXPECT_NE(t.status().message().find("devices/system/cpu/online"), std::string::npos);
  o.sysfs_root = (root_ / "missing").string();
  EXPECT_EQ(DiscoverTopology(fs_, nullptr, o).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(FakeSysfsTest, AllocatesExclusiveNumaLocalCpus) {
  Topology t = Discover();
  std::vector<int> reserved = AgentReservedCpus(t, 1);
  EXPECT_EQ(reserved, std::vector<int>{0});
  std::set<int> used;
  auto a = AllocateCpus(t, used, reserved, 0, 3);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(FormatCpuList(a->cpus), "1-3");
  EXPECT_EQ(a->memory_node, 0);
  used.insert(a->cpus.begin(), a->cpus.end());
  auto b = AllocateCpus(t, used, reserved, 1, 4);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(FormatCpuList(b->cpus), "4-7");  // no overlap with GPU 0's replica
  used.insert(b->cpus.begin(), b->cpus.end());
  auto c = AllocateCpus(t, used, reserved, 2, 4);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(FormatCpuList(c->cpus), "8-11");
  EXPECT_EQ(c->memory_node, 1);
  used.insert(c->cpus.begin(), c->cpus.end());
  // Node 1 has 12-13 left inside the cgroup (14-15 are outside it).
  auto d = AllocateCpus(t, used, reserved, 2, 3);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(d.status().message().find("3 CPUs wanted, 2 free"), std::string::npos) << d.status();
  // GPU 3's NUMA node is unknown: any allowed CPU, no memory binding.
  auto e = AllocateCpus(t, used, reserved, 3, 2);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(FormatCpuList(e->cpus), "12-13");
  EXPECT_EQ(e->memory_node, -1);
}

TEST_F(FakeSysfsTest, CpuReplicasTakeTheEmptiestNode) {
  Topology t = Discover();
  std::set<int> used = {1, 2, 3};
  auto a = AllocateCpus(t, used, {0}, -1, 2);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(FormatCpuList(a->cpus), "8-9");  // node 1 has 6 free in the cgroup, node 0 has 4
  EXPECT_EQ(a->memory_node, 1);
  EXPECT_FALSE(AllocateCpus(t, used, {0}, -1, 7).ok());
  EXPECT_FALSE(AllocateCpus(t, used, {0}, 9, 1).ok());
  EXPECT_FALSE(AllocateCpus(t, used, {0}, 0, 0).ok());
}

TEST(FakeGpuDriverTest, SpecAndSettings) {
  auto gpus = FakeGpuDriver::ParseSpec("2:16Gi");
  ASSERT_TRUE(gpus.ok());
  FakeGpuDriver d(*gpus);
  EXPECT_EQ(*d.DeviceCount(), 2);
  EXPECT_EQ(d.Identify(1)->memory_total_bytes, 16LL << 30);
  EXPECT_TRUE(d.SetPowerLimit(0, 300000).ok());
  EXPECT_FALSE(d.SetPowerLimit(0, 50000).ok());  // below the card's minimum
  EXPECT_EQ(d.Read(0)->power_limit_mw, 300000u);
  EXPECT_EQ(d.calls(), std::vector<std::string>{"power_limit 0 300000"});
  d.InjectXid(1, 79);
  auto ev = d.WaitEvents(absl::ZeroDuration());
  ASSERT_TRUE(ev.ok());
  ASSERT_EQ(ev->size(), 1u);
  EXPECT_EQ((*ev)[0].xid, 79u);
  for (const char* bad : {"", "4", "x:1Gi", "0:1Gi", "65:1Gi", "2:lots", "2:"}) {
    EXPECT_FALSE(FakeGpuDriver::ParseSpec(bad).ok()) << bad;
  }
}

TEST(NvmlDriverTest, MissingLibraryMeansCpuOnlyNode) {
  auto d = LoadNvmlDriver("libkiln-no-such-nvml.so.1");
  EXPECT_EQ(d.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(d.status().message().find("CPU-only"), std::string::npos);
}

}  // namespace
}  // namespace kiln
