#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "agent/gpu_driver.h"
#include "common/clock.h"
#include "health/gpu_health.h"

namespace kiln {

// Watches each GPU: Xid events, uncorrectable ECC errors against the count first seen, and
// throttling. Not thread-safe: the agent's loop calls Poll() and reads the results.
//
// With a state file, what makes a GPU unhealthy until it is reset outlives the agent: its
// drain-class Xids and its ECC baseline are kept per GPU UUID with the host's boot id, and a
// restarted agent on the same boot takes them back (a GPU that needed a reset does not take
// replicas again because the agent restarted). A reboot (a new boot id) starts afresh; so does
// deleting the file and restarting the agent, once an operator has reset the GPU. Without a
// boot id nothing is kept.
class GpuMonitor {
 public:
  struct Persistence {
    std::string state_file;  // empty: nothing kept
    std::string boot_id;     // /proc/sys/kernel/random/boot_id
  };
  // `clock` null: the monotonic one (its times are ages kept in memory only).
  GpuMonitor(GpuDriver* driver, std::vector<int> gpus, Persistence persistence = {},
             Clock* clock = nullptr);

  // Application-class Xids kept per GPU (the most recent), so reasons stay bounded; each
  // keeps the GPU degraded for kApplicationXidWindow after it was seen, then is dropped.
  static constexpr size_t kRecentApplicationXids = 8;
  static constexpr absl::Duration kApplicationXidWindow = absl::Minutes(10);
  // Failed telemetry reads in a row that make a GPU unhealthy: one failed NVML call (a busy
  // driver) must not drain every replica on the GPU.
  static constexpr int kReadFailuresUnhealthy = 3;

  // Drains pending Xid events (without blocking) and reads every GPU's telemetry.
  void Poll();
  // The application-class Xids seen since the last call, as (gpu, xid), in order: each may
  // have broken a replica's device context (NVML does not say whose).
  std::vector<std::pair<int, uint64_t>> TakeApplicationXids();

  const std::map<int, GpuHealth>& health() const { return health_; }
  const std::map<int, GpuTelemetry>& telemetry() const { return telemetry_; }
  bool Healthy(int gpu) const;

 private:
  void Restore();
  // Records a drain-class Xid once per code; true when it is new.
  bool AddDrainXid(int gpu, uint64_t xid);
  void Save();
  std::string Uuid(int gpu);

  GpuDriver* driver_;
  std::vector<int> gpus_;
  Persistence persistence_;  // state_file cleared when nothing can be kept
  std::map<int, std::string> uuids_;
  std::map<int, uint64_t> ecc_baseline_;
  // Drain-class Xids, once per code (kept: a GPU that needed a reset stays unhealthy until it
  // is reset), and the most recent others (at most kRecentApplicationXids).
  std::map<int, std::vector<uint64_t>> drain_xids_;
  struct SeenXid {
    uint64_t xid;
    absl::Time at;
  };
  std::map<int, std::deque<SeenXid>> recent_xids_;
  std::vector<std::pair<int, uint64_t>> new_application_xids_;
  MonotonicClock steady_clock_;
  Clock* clock_;
  // Restored from the state file for GPUs not read yet: uuid -> (xids, ecc baseline).
  std::map<std::string, std::pair<std::vector<uint64_t>, std::optional<uint64_t>>> restored_;
  std::map<int, GpuTelemetry> telemetry_;
  std::map<int, GpuHealth> health_;
  std::map<int, int> read_failures_;  // in a row
};

}  // namespace kiln
