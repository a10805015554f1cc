#pragma once

// The command line every kiln binary shares: CLI11 parsing with --log-level applied, and the
// process-wide settings every kiln binary starts with.
#include <CLI/CLI.hpp>

#include <cstdlib>
#include <optional>
#include <string>

#include "absl/synchronization/mutex.h"
#include "common/logging.h"

namespace kiln {

// Adds --log-level to `app`, parses the command line and sets the log level. Returns the code
// to exit with (CLI11's for --help or a bad flag, 2 for a bad level), or nothing to go on.
inline std::optional<int> ParseCommandLine(CLI::App& app, int argc, char** argv) {
  // Debian's Abseil is built with its debug checks, so every absl::Mutex acquisition (gRPC's
  // own locks included) also updated a global lock-order graph: 2-4% of a replica's and of the
  // router's CPU on the served path, measured, and a process abort on a suspected inversion.
  // KILN_LOCK_CHECKS=1 keeps them (scripts/test.sh sets it, so the binaries the tests start
  // still abort on a lock-order inversion).
  const char* checks = std::getenv("KILN_LOCK_CHECKS");
  if (checks == nullptr || std::string(checks) != "1") {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error")->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (auto s = SetLogLevel(log_level); !s.ok()) {
    GetLogger("main")->error("--log-level: {}", std::string(s.message()));
    return 2;
  }
  return std::nullopt;
}

}  // namespace kiln
