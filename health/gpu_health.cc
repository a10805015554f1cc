#include "health/gpu_health.h"

namespace kiln {

namespace {
// Reason bits as NVML defines them.
constexpr uint64_t kSwPowerCap = 0x4;
constexpr uint64_t kHwSlowdown = 0x8;
constexpr uint64_t kSwThermal = 0x20;
constexpr uint64_t kHwThermal = 0x40;
constexpr uint64_t kHwPowerBrake = 0x80;
}  // namespace

XidClass ClassifyXid(uint64_t xid) {
  switch (xid) {
    // The classes follow NVIDIA's Xid catalogue's immediate action: RESTART_APP is the
    // application's (its replica restarts), a reset, reboot or drain is the GPU's.
    case 8:
      return {XidAction::kApplication, "GPU stopped processing (a channel timed out)"};
    case 13:
      return {XidAction::kApplication, "graphics engine exception"};
    case 31:
      return {XidAction::kApplication, "GPU memory page fault"};
    case 43:
      return {XidAction::kApplication, "GPU stopped processing (the faulting context was reset)"};
    case 45:
      return {XidAction::kApplication, "preemptive cleanup after a context ended"};
    case 68:
      return {XidAction::kApplication, "video processor exception"};
    case 69:
      return {XidAction::kApplication, "graphics engine class error"};
    case 38:
      return {XidAction::kDrainGpu, "driver firmware error"};
    case 48:
      return {XidAction::kDrainGpu, "double-bit ECC error"};
    case 61:
    case 62:
      return {XidAction::kDrainGpu, "internal micro-controller halt"};
    case 63:
      return {XidAction::kInformational, "ECC page retirement or row remapping recorded"};
    case 64:
      return {XidAction::kDrainGpu, "ECC page retirement or row remapping failure"};
    case 74:
      return {XidAction::kDrainGpu, "NVLink error"};
    case 79:
      return {XidAction::kDrainGpu, "GPU has fallen off the bus"};
    case 92:
      return {XidAction::kInformational, "high single-bit ECC error rate"};
    case 94:
      return {XidAction::kApplication, "contained ECC error (the affected application must restart)"};
    case 95:
      return {XidAction::kDrainGpu, "uncontained ECC error"};
    case 119:
    case 120:
      return {XidAction::kDrainGpu, "GSP firmware error"};
    case 154:
      return {XidAction::kDrainGpu,
              "GPU recovery action changed (the GPU needs a reset or the node a reboot)"};
    default:
      return {XidAction::kInformational, "unclassified Xid"};
  }
}

bool IsThermalOrPowerThrottle(uint64_t r) {
  return (r & (kHwSlowdown | kSwThermal | kHwThermal | kHwPowerBrake)) != 0;
}

std::string DescribeClockEvents(uint64_t r) {
  std::string out;
  auto add = [&](uint64_t bit, const char* name) {
    if (r & bit) out += (out.empty() ? "" : ",") + std::string(name);
  };
  add(kSwPowerCap, "sw_power_cap");
  add(kHwSlowdown, "hw_slowdown");
  add(kSwThermal, "sw_thermal");
  add(kHwThermal, "hw_thermal");
  add(kHwPowerBrake, "hw_power_brake");
  return out;
}

GpuHealth EvaluateGpuHealth(const GpuHealthInput& in) {
  GpuHealth h;
  if (in.ecc_uncorrected > in.ecc_uncorrected_baseline) {
    h.healthy = false;
    h.reasons.push_back(std::to_string(in.ecc_uncorrected - in.ecc_uncorrected_baseline) +
                        " new uncorrectable ECC error(s)");
  }
  for (uint64_t xid : in.xids) {
    XidClass c = ClassifyXid(xid);
    std::string what = "Xid " + std::to_string(xid) + ": " + c.description;
    if (c.action == XidAction::kDrainGpu) {
      h.healthy = false;
      h.reasons.push_back(what);
    } else {
      h.degraded = true;
      h.reasons.push_back(what);
    }
  }
  if (IsThermalOrPowerThrottle(in.clock_event_reasons)) {
    h.degraded = true;
    h.reasons.push_back("throttled: " + DescribeClockEvents(in.clock_event_reasons) + " at " +
                        std::to_string(in.temperature_c) + " C");
  }
  if (!h.healthy) h.degraded = true;
  return h;
}

}  // namespace kiln
