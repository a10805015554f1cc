#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace kiln {

// Asks the kernel for a free TCP port on `address` (IPv4). For servers that cannot bind
// port 0 themselves (cpprestsdk's listener); callers retry if the port is taken meanwhile.
absl::StatusOr<int> PickFreePort(const std::string& address);

}  // namespace kiln
