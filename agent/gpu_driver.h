#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kiln {

// What a GPU is: fixed for the life of the process.
struct GpuIdentity {
  int index = 0;
  std::string uuid;
  std::string name;
  std::string pci_bus_id;  // as the driver reports it ("00000000:3B:00.0")
  int64_t memory_total_bytes = 0;
  // Power limit bounds and default, milliwatts (0 when unsupported).
  uint32_t power_limit_min_mw = 0;
  uint32_t power_limit_max_mw = 0;
  uint32_t power_limit_default_mw = 0;
};

// NVML's clock event (throttle) reason bits, from its public API.
enum ClockEventReason : uint64_t {
  kClockEventGpuIdle = 0x1,
  kClockEventApplicationsClocksSetting = 0x2,
  kClockEventSwPowerCap = 0x4,
  kClockEventHwSlowdown = 0x8,
  kClockEventSyncBoost = 0x10,
  kClockEventSwThermalSlowdown = 0x20,
  kClockEventHwThermalSlowdown = 0x40,
  kClockEventHwPowerBrakeSlowdown = 0x80,
  kClockEventDisplayClockSetting = 0x100,
};

// What a GPU is doing now.
struct GpuTelemetry {
  int64_t memory_used_bytes = 0;
  int64_t memory_total_bytes = 0;
  uint32_t utilization_gpu_pct = 0;
  uint32_t utilization_memory_pct = 0;
  uint32_t power_draw_mw = 0;
  uint32_t power_limit_mw = 0;  // the enforced limit (every limiter's, the card's own included)
  // The limit set on the card (nvmlDeviceGetPowerManagementLimit): what kiln sets, and what it
  // restores. The enforced one may be lower (an out-of-band limit, say). 0: not read.
  uint32_t power_management_limit_mw = 0;
  uint32_t temperature_c = 0;
  uint32_t sm_clock_mhz = 0;
  uint64_t clock_event_reasons = 0;
  uint64_t ecc_corrected = 0;
  uint64_t ecc_uncorrected = 0;
  bool persistence_mode = false;
};

struct GpuEvent {
  int index = 0;
  uint64_t xid = 0;
};

// The GPU driver seam: NVML loaded at run time in production (`nvml_driver.h`), a
// programmable fake in tests and for `--fake-gpus` (`fake_gpu_driver.h`).
class GpuDriver {
 public:
  virtual ~GpuDriver() = default;
  // A human-readable name ("nvml 12.550", "fake").
  virtual std::string name() const = 0;
  // True for the fake driver: replicas run on cpu, and status and logs say so.
  virtual bool fake() const { return false; }
  virtual absl::StatusOr<int> DeviceCount() = 0;
  virtual absl::StatusOr<GpuIdentity> Identify(int index) = 0;
  virtual absl::StatusOr<GpuTelemetry> Read(int index) = 0;
  // Waits up to `timeout` for Xid (critical error) events on any GPU.
  virtual absl::StatusOr<std::vector<GpuEvent>> WaitEvents(absl::Duration timeout) = 0;

  // Card settings (GPU power policy). Callers honour dry-run before calling these.
  virtual absl::Status SetPersistenceMode(int index, bool enabled) = 0;
  virtual absl::Status SetPowerLimit(int index, uint32_t milliwatts) = 0;
  virtual absl::Status LockSmClocks(int index, uint32_t min_mhz, uint32_t max_mhz) = 0;
  virtual absl::Status ResetSmClocks(int index) = 0;
};

// "00000000:3B:00.0" (NVML) -> "0000:3b:00.0" (sysfs). INVALID_ARGUMENT when malformed.
absl::StatusOr<std::string> NormalizePciBusId(const std::string& bus_id);

}  // namespace kiln
