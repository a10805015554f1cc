#include "agent/fake_gpu_driver.h"

#include <algorithm>

#include <cstdio>

#include "common/config_node.h"
#include "common/status.h"

namespace kiln {

std::vector<FakeGpuDriver::Gpu> FakeGpuDriver::MakeGpus(int count, int64_t memory_bytes) {
  std::vector<Gpu> out;
  for (int i = 0; i < count; ++i) {
    Gpu g;
    char uuid[64];
    std::snprintf(uuid, sizeof(uuid), "GPU-fake0000-0000-0000-0000-%012d", i);
    char bus[32];
    std::snprintf(bus, sizeof(bus), "00000000:%02X:00.0", 0x10 + i);
    g.identity.index = i;
    g.identity.uuid = uuid;
    g.identity.name = "Fake GPU";
    g.identity.pci_bus_id = bus;
    g.identity.memory_total_bytes = memory_bytes;
    g.identity.power_limit_min_mw = 200000;
    g.identity.power_limit_max_mw = 700000;
    g.identity.power_limit_default_mw = 700000;
    g.telemetry.memory_total_bytes = memory_bytes;
    g.telemetry.power_limit_mw = 700000;
    g.telemetry.power_management_limit_mw = 700000;
    g.telemetry.power_draw_mw = 70000;
    g.telemetry.temperature_c = 35;
    g.telemetry.sm_clock_mhz = 345;
    g.telemetry.persistence_mode = true;
    out.push_back(g);
  }
  return out;
}

absl::StatusOr<std::vector<FakeGpuDriver::Gpu>> FakeGpuDriver::ParseSpec(const std::string& spec) {
  size_t colon = spec.find(':');
  auto bad = [&]() {
    return absl::InvalidArgumentError("--fake-gpus: '" + spec +
                                      "' must be COUNT:MEMORY, like 4:80Gi");
  };
  if (colon == std::string::npos || colon == 0) return bad();
  std::string count_text = spec.substr(0, colon);
  if (count_text.find_first_not_of("0123456789") != std::string::npos || count_text.size() > 3) {
    return bad();
  }
  int count = std::stoi(count_text);
  if (count < 1 || count > 64) {
    return absl::InvalidArgumentError("--fake-gpus: count must be in 1..64, got " + count_text);
  }
  KILN_ASSIGN_OR_RETURN(int64_t mem, ParseByteSize(spec.substr(colon + 1), "--fake-gpus memory"));
  if (mem <= 0) return absl::InvalidArgumentError("--fake-gpus: memory must be > 0");
  return MakeGpus(count, mem);
}

absl::Status FakeGpuDriver::Check(int index) const {
  if (index < 0 || index >= static_cast<int>(gpus_.size())) {
    return absl::NotFoundError("no GPU " + std::to_string(index));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> FakeGpuDriver::DeviceCount() {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(gpus_.size());
}

absl::StatusOr<GpuIdentity> FakeGpuDriver::Identify(int index) {
  absl::MutexLock lock(&mu_);
  KILN_RETURN_IF_ERROR(Check(index));
  return gpus_[index].identity;
}

absl::StatusOr<GpuTelemetry> FakeGpuDriver::Read(int index) {
  absl::MutexLock lock(&mu_);
  KILN_RETURN_IF_ERROR(Check(index));
  if (auto it = read_errors_.find(index); it != read_errors_.end() && !it->second.ok()) {
    return it->second;
  }
  return gpus_[index].telemetry;
}

void FakeGpuDriver::SetReadError(int index, absl::Status error) {
  absl::MutexLock lock(&mu_);
  read_errors_[index] = std::move(error);
}

absl::StatusOr<std::vector<GpuEvent>> FakeGpuDriver::WaitEvents(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto has_events = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !events_.empty(); };
  mu_.AwaitWithTimeout(absl::Condition(&has_events), timeout);
  std::vector<GpuEvent> out(events_.begin(), events_.end());
  events_.clear();
  return out;
}

absl::Status FakeGpuDriver::SetPersistenceMode(int index, bool enabled) {
  absl::MutexLock lock(&mu_);
  KILN_RETURN_IF_ERROR(Check(index));
  gpus_[index].telemetry.persistence_mode = enabled;
  calls_.push_back("persistence " + std::to_string(index) + " " + (enabled ? "on" : "off"));
  return absl::OkStatus();
}

absl::Status FakeGpuDriver::SetPowerLimit(int index, uint32_t milliwatts) {
  absl::MutexLock lock(&mu_);
  KILN_RETURN_IF_ERROR(Check(index));
  const auto& id = gpus_[index].identity;
  if (milliwatts < id.power_limit_min_mw || milliwatts > id.power_limit_max_mw) {
    return absl::InvalidArgumentError("power limit " + std::to_string(milliwatts) +
                                      " mW is outside the card's bounds");
  }
  Gpu& g = gpus_[index];
  g.telemetry.power_management_limit_mw = milliwatts;
  g.telemetry.power_limit_mw =
      g.external_cap_mw > 0 ? std::min(milliwatts, g.external_cap_mw) : milliwatts;
  calls_.push_back("power_limit " + std::to_string(index) + " " + std::to_string(milliwatts));
  return absl::OkStatus();
}

absl::Status FakeGpuDriver::LockSmClocks(int index, uint32_t min_mhz, uint32_t max_mhz) {
  absl::MutexLock lock(&mu_);
  KILN_RETURN_IF_ERROR(Check(index));
  gpus_[index].locked_clocks = true;
  gpus_[index].locked_min_mhz = min_mhz;
  gpus_[index].locked_max_mhz = max_mhz;
  calls_.push_back("lock_clocks " + std::to_string(index) + " " + std::to_string(min_mhz) + " " +
                   std::to_string(max_mhz));
  return absl::OkStatus();
}

absl::Status FakeGpuDriver::ResetSmClocks(int index) {
  absl::MutexLock lock(&mu_);
  KILN_RETURN_IF_ERROR(Check(index));
  gpus_[index].locked_clocks = false;
  calls_.push_back("reset_clocks " + std::to_string(index));
  return absl::OkStatus();
}

void FakeGpuDriver::InjectXid(int index, uint64_t xid) {
  absl::MutexLock lock(&mu_);
  events_.push_back({index, xid});
}

void FakeGpuDriver::SetTelemetry(int index, const GpuTelemetry& t) {
  absl::MutexLock lock(&mu_);
  if (Check(index).ok()) gpus_[index].telemetry = t;
}

FakeGpuDriver::Gpu FakeGpuDriver::Get(int index) const {
  absl::MutexLock lock(&mu_);
  return gpus_.at(index);
}

std::vector<std::string> FakeGpuDriver::calls() const {
  absl::MutexLock lock(&mu_);
  return calls_;
}

void FakeGpuDriver::SetExternalPowerCap(int index, uint32_t milliwatts) {
  absl::MutexLock lock(&mu_);
  if (index < 0 || index >= static_cast<int>(gpus_.size())) return;
  Gpu& g = gpus_[index];
  g.external_cap_mw = milliwatts;
  const uint32_t set = g.telemetry.power_management_limit_mw;
  g.telemetry.power_limit_mw = milliwatts > 0 ? std::min(set, milliwatts) : set;
}

}  // namespace kiln
