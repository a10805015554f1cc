#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "agent/gpu_driver.h"

namespace kiln {

// Loads NVML with dlopen("libnvidia-ml.so.1") so the agent runs where there is no GPU.
// NOT_FOUND when the library or a GPU is absent: the node is then a CPU-only node.
absl::StatusOr<std::unique_ptr<GpuDriver>> LoadNvmlDriver(const char* library = "libnvidia-ml.so.1");

}  // namespace kiln
