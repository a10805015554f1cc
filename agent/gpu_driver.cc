#include "agent/gpu_driver.h"

#include <cctype>

#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"

namespace kiln {

absl::StatusOr<std::string> NormalizePciBusId(const std::string& bus_id) {
  auto bad = [&]() {
    return absl::InvalidArgumentError("PCI bus id '" + bus_id +
                                      "': expected DOMAIN:BUS:DEVICE.FUNCTION in hex");
  };
  std::vector<std::string> parts = absl::StrSplit(bus_id, ':');
  if (parts.size() != 3) return bad();
  std::vector<std::string> dev_fn = absl::StrSplit(parts[2], '.');
  if (dev_fn.size() != 2) return bad();
  auto hex = [](const std::string& s, size_t max) {
    if (s.empty() || s.size() > max) return false;
    for (char c : s) {
      if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
    }
    return true;
  };
  std::string domain = parts[0];
  if (!hex(domain, 8) || !hex(parts[1], 2) || !hex(dev_fn[0], 2) || !hex(dev_fn[1], 1)) {
    return bad();
  }
  // sysfs uses a 4-digit domain; NVML pads it to 8.
  while (domain.size() > 4 && domain[0] == '0') domain.erase(0, 1);
  if (domain.size() > 4) return bad();
  while (domain.size() < 4) domain.insert(0, "0");
  std::string bus = parts[1].size() == 1 ? "0" + parts[1] : parts[1];
  std::string dev = dev_fn[0].size() == 1 ? "0" + dev_fn[0] : dev_fn[0];
  return absl::AsciiStrToLower(domain + ":" + bus + ":" + dev + "." + dev_fn[1]);
}

}  // namespace kiln
