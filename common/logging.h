#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "spdlog/spdlog.h"

namespace kiln {

// A named logger ("runtime.batcher"), created on first use, writing to stderr with the
// process-wide pattern. Names are dotted module paths.
std::shared_ptr<spdlog::logger> GetLogger(const std::string& name);

// Sets the level of every kiln logger: trace, debug, info, warn, error, critical, off.
// An error naming the level unless it is one SetLogLevel takes.
absl::Status CheckLogLevel(const std::string& level);
absl::Status SetLogLevel(const std::string& level);

}  // namespace kiln
