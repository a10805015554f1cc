#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace kiln {

// Pins the calling process after it has started (a pre-started runtime handed a replica):
// every thread it has now runs on `cpus` (empty = leave affinity alone), and the calling
// thread's memory policy binds new allocations to NUMA node `memory_node` (-1 = leave it);
// threads the caller starts afterwards inherit both. Memory already allocated stays where it
// is. Errors name the step and the CPU or node.
absl::Status PinThisProcess(const std::vector<int>& cpus, int memory_node);

// kiln-runtime --model-cpus and kiln-agent --runtime-model-cpus: at most this many.
inline constexpr int64_t kMaxModelCpus = 1024;

// Pins the calling thread alone to `cpus` (not empty); threads it starts afterwards inherit it.
absl::Status PinThisThread(const std::vector<int>& cpus);

}  // namespace kiln
