#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

// What an Xid (an NVIDIA driver error event) means for the fleet.
enum class XidAction {
  kInformational,  // log and count
  kApplication,    // the process that caused it is at fault: its replica is unhealthy
  kDrainGpu,       // the GPU needs a reset or is failing: drain it, place nothing new on it
};

struct XidClass {
  XidAction action;
  const char* description;
};

// Classification from NVIDIA's public Xid catalogue; unknown Xids are informational.
XidClass ClassifyXid(uint64_t xid);

// Throttle (clock event) reasons that mean the card is being slowed by heat or power.
bool IsThermalOrPowerThrottle(uint64_t clock_event_reasons);
std::string DescribeClockEvents(uint64_t clock_event_reasons);

struct GpuHealthInput {
  uint64_t ecc_uncorrected = 0;
  uint64_t ecc_uncorrected_baseline = 0;  // the count when the agent first saw the GPU
  uint64_t clock_event_reasons = 0;
  uint32_t temperature_c = 0;
  std::vector<uint64_t> xids;  // Xids seen since the GPU was last healthy
};

struct GpuHealth {
  bool healthy = true;     // takes new replicas
  bool degraded = false;   // throttled or informational faults: still usable, reported
  std::vector<std::string> reasons;
};

// Pure: new uncorrectable ECC errors or a drain-class Xid make the GPU unhealthy; thermal or
// power throttling and informational Xids only degrade it.
GpuHealth EvaluateGpuHealth(const GpuHealthInput& in);

}  // namespace kiln
