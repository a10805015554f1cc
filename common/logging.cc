#include "common/logging.h"

#include "spdlog/sinks/stdout_color_sinks.h"

namespace kiln {

std::shared_ptr<spdlog::logger> GetLogger(const std::string& name) {
  // spdlog's registry owns the loggers; creation is serialised there.
  if (auto existing = spdlog::get(name)) return existing;
  try {
    auto logger = spdlog::stderr_color_mt(name);
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ [%n] %v");
    logger->set_level(spdlog::get_level());
    return logger;
  } catch (const spdlog::spdlog_ex&) {
    // Lost a race with another thread creating the same logger.
    return spdlog::get(name);
  }
}

absl::Status CheckLogLevel(const std::string& level) {
  if (spdlog::level::from_str(level) == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError("log level '" + level +
                                      "': expected trace, debug, info, warn, error, critical "
                                      "or off");
  }
  return absl::OkStatus();
}

absl::Status SetLogLevel(const std::string& level) {
  if (absl::Status s = CheckLogLevel(level); !s.ok()) return s;
  auto parsed = spdlog::level::from_str(level);
  spdlog::set_level(parsed);
  spdlog::apply_all([parsed](std::shared_ptr<spdlog::logger> l) { l->set_level(parsed); });
  return absl::OkStatus();
}

}  // namespace kiln
