#pragma once

#include <functional>
#include <string>

#include "absl/status/statusor.h"

namespace kiln {

// Asks the kernel for a free TCP port on `address` (IPv4). For servers that cannot bind
// port 0 themselves (cpprestsdk's listener); callers retry if the port is taken meanwhile.
absl::StatusOr<int> PickFreePort(const std::string& address);

// Opens a server that cannot bind port 0 itself: calls `open(port)` with `port`, or, when it
// is 0, with free ports from PickFreePort (up to 5 tries, in case another process takes one
// between the pick and the bind). Returns the port that opened, or the last error.
absl::StatusOr<int> OpenOnPort(const std::string& address, int port,
                               const std::function<absl::Status(int port)>& open);

}  // namespace kiln
