#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kiln {

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}. `field` names the source in errors.
absl::StatusOr<std::vector<int>> ParseCpuList(const std::string& text, const std::string& field);
// {0,1,2,3,8} -> "0-3,8".
std::string FormatCpuList(const std::vector<int>& cpus);
// The CPUs the calling thread may run on (sched_getaffinity), ascending; empty if unknown.
std::vector<int> AllowedCpus();

}  // namespace kiln
