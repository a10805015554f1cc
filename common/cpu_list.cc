#include "common/cpu_list.h"

#include <sched.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/ascii.h"

namespace kiln {

absl::StatusOr<std::vector<int>> ParseCpuList(const std::string& text, const std::string& field) {
  std::vector<int> out;
  std::string t(absl::StripAsciiWhitespace(text));
  if (t.empty()) return out;
  for (absl::string_view part : absl::StrSplit(t, ',')) {
    std::vector<absl::string_view> range = absl::StrSplit(part, '-');
    int lo = 0, hi = 0;
    if (range.size() == 1 && absl::SimpleAtoi(range[0], &lo)) {
      hi = lo;
    } else if (range.size() != 2 || !absl::SimpleAtoi(range[0], &lo) ||
               !absl::SimpleAtoi(range[1], &hi)) {
      return absl::InvalidArgumentError(field + ": '" + t + "' is not a CPU list");
    }
    if (lo < 0 || hi < lo || hi > 65535) {
      return absl::InvalidArgumentError(field + ": bad CPU range in '" + t + "'");
    }
    for (int c = lo; c <= hi; ++c) out.push_back(c);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  std::vector<int> c = cpus;
  std::sort(c.begin(), c.end());
  std::string out;
  for (size_t i = 0; i < c.size();) {
    size_t j = i;
    while (j + 1 < c.size() && c[j + 1] == c[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(c[i]);
    if (j > i) out += "-" + std::to_string(c[j]);
    i = j + 1;
  }
  return out;
}

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  return out;
}

}  // namespace kiln
