#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "agent/gpu_driver.h"
#include "health/gpu_health.h"

namespace kiln {

// Watches each GPU: Xid events, uncorrectable ECC errors against the count first seen, and
// throttling. Not thread-safe: the agent's loop calls Poll() and reads the results.
class GpuMonitor {
 public:
  GpuMonitor(GpuDriver* driver, std::vector<int> gpus) : driver_(driver), gpus_(std::move(gpus)) {}

  // Drains pending Xid events (without blocking) and reads every GPU's telemetry.
  void Poll();

  const std::map<int, GpuHealth>& health() const { return health_; }
  const std::map<int, GpuTelemetry>& telemetry() const { return telemetry_; }
  bool Healthy(int gpu) const;

 private:
  GpuDriver* driver_;
  std::vector<int> gpus_;
  std::map<int, uint64_t> ecc_baseline_;
  std::map<int, std::vector<uint64_t>> xids_;  // since the agent started: a GPU that needed a
                                               // reset stays unhealthy until it is reset
  std::map<int, GpuTelemetry> telemetry_;
  std::map<int, GpuHealth> health_;
};

}  // namespace kiln
