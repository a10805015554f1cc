#include "common/process_start.h"

#include <unistd.h>

#include <algorithm>

#include <fstream>
#include <sstream>
#include <string>

#include "absl/time/clock.h"

namespace kiln {

absl::Time ProcessStartTime(absl::Time fallback) {
  std::ifstream stat("/proc/self/stat");
  std::string text;
  std::getline(stat, text);
  size_t close = text.rfind(')');
  if (close == std::string::npos) return fallback;
  // Fields after the command name start at field 3 (state); starttime is field 22.
  std::istringstream rest(text.substr(close + 2));
  std::string field;
  long long start_ticks = -1;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i == 22) start_ticks = std::stoll(field);
  }
  // Age = uptime now - start since boot, both read now: 10 ms resolution.
  std::ifstream uptime_file("/proc/uptime");
  double uptime = -1;
  uptime_file >> uptime;
  long ticks = sysconf(_SC_CLK_TCK);
  if (start_ticks < 0 || uptime < 0 || ticks <= 0) return fallback;
  absl::Duration age = absl::Seconds(uptime) - absl::Milliseconds(start_ticks * 1000 / ticks);
  if (age < absl::ZeroDuration()) return fallback;
  return std::min(absl::Now() - age, fallback);
}

}  // namespace kiln
