#include "agent/nvml_driver.h"

#include <dlfcn.h>

#include <cstring>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/status.h"

namespace kiln {

namespace {

// The NVML ABI subset kiln uses, written from NVML's public API reference.
using nvmlReturn_t = int;
using nvmlDevice_t = struct NvmlDeviceOpaque*;
using nvmlEventSet_t = struct NvmlEventSetOpaque*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr nvmlReturn_t kNvmlErrorTimeout = 10;
constexpr unsigned kNvmlTemperatureGpu = 0;
constexpr unsigned kNvmlClockSm = 1;
constexpr unsigned kNvmlMemoryErrorCorrected = 0;
constexpr unsigned kNvmlMemoryErrorUncorrected = 1;
constexpr unsigned kNvmlVolatileEcc = 0;
constexpr unsigned long long kNvmlEventTypeXidCriticalError = 0x8;

struct NvmlPciInfo {
  char bus_id_legacy[16];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pci_device_id;
  unsigned int pci_subsystem_id;
  char bus_id[32];
};
struct NvmlMemory {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
struct NvmlUtilization {
  unsigned int gpu;
  unsigned int memory;
};
struct NvmlEventData {
  nvmlDevice_t device;
  unsigned long long event_type;
  unsigned long long event_data;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};

struct NvmlApi {
  nvmlReturn_t (*init)();
  nvmlReturn_t (*shutdown)();
  const char* (*error_string)(nvmlReturn_t);
  nvmlReturn_t (*system_get_driver_version)(char*, unsigned);
  nvmlReturn_t (*device_get_count)(unsigned*);
  nvmlReturn_t (*device_get_handle_by_index)(unsigned, nvmlDevice_t*);
  nvmlReturn_t (*device_get_uuid)(nvmlDevice_t, char*, unsigned);
  nvmlReturn_t (*device_get_name)(nvmlDevice_t, char*, unsigned);
  nvmlReturn_t (*device_get_pci_info)(nvmlDevice_t, NvmlPciInfo*);
  nvmlReturn_t (*device_get_memory_info)(nvmlDevice_t, NvmlMemory*);
  nvmlReturn_t (*device_get_utilization_rates)(nvmlDevice_t, NvmlUtilization*);
  nvmlReturn_t (*device_get_power_usage)(nvmlDevice_t, unsigned*);
  nvmlReturn_t (*device_get_enforced_power_limit)(nvmlDevice_t, unsigned*);
  nvmlReturn_t (*device_get_power_management_limit)(nvmlDevice_t, unsigned*);  // may be null
  nvmlReturn_t (*device_get_power_limit_constraints)(nvmlDevice_t, unsigned*, unsigned*);
  nvmlReturn_t (*device_get_power_default_limit)(nvmlDevice_t, unsigned*);
  nvmlReturn_t (*device_get_temperature)(nvmlDevice_t, unsigned, unsigned*);
  nvmlReturn_t (*device_get_clock_info)(nvmlDevice_t, unsigned, unsigned*);
  nvmlReturn_t (*device_get_clock_reasons)(nvmlDevice_t, unsigned long long*);
  nvmlReturn_t (*device_get_total_ecc_errors)(nvmlDevice_t, unsigned, unsigned,
                                              unsigned long long*);
  nvmlReturn_t (*device_get_persistence_mode)(nvmlDevice_t, unsigned*);
  nvmlReturn_t (*device_set_persistence_mode)(nvmlDevice_t, unsigned);
  nvmlReturn_t (*device_set_power_limit)(nvmlDevice_t, unsigned);
  nvmlReturn_t (*device_set_locked_clocks)(nvmlDevice_t, unsigned, unsigned);
  nvmlReturn_t (*device_reset_locked_clocks)(nvmlDevice_t);
  nvmlReturn_t (*event_set_create)(nvmlEventSet_t*);
  nvmlReturn_t (*device_register_events)(nvmlDevice_t, unsigned long long, nvmlEventSet_t);
  nvmlReturn_t (*event_set_wait)(nvmlEventSet_t, NvmlEventData*, unsigned);
  nvmlReturn_t (*event_set_free)(nvmlEventSet_t);
};

template <typename F>
bool Bind(void* lib, const char* name, F* out, bool required = true) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  return *out != nullptr || !required;
}

class NvmlDriver : public GpuDriver {
 public:
  NvmlDriver(void* lib, NvmlApi api, std::vector<nvmlDevice_t> devices, std::string version)
      : lib_(lib), api_(api), devices_(std::move(devices)), version_(std::move(version)) {
    if (api_.event_set_create && api_.event_set_create(&events_) == kNvmlSuccess) {
      for (auto d : devices_) {
        // Not every GPU supports Xid events; those simply report none.
        (void)api_.device_register_events(d, kNvmlEventTypeXidCriticalError, events_);
      }
    }
  }
  ~NvmlDriver() override {
    if (events_ && api_.event_set_free) api_.event_set_free(events_);
    api_.shutdown();
    dlclose(lib_);
  }

  std::string name() const override { return "nvml " + version_; }

  absl::StatusOr<int> DeviceCount() override { return static_cast<int>(devices_.size()); }

  absl::StatusOr<GpuIdentity> Identify(int index) override {
    KILN_ASSIGN_OR_RETURN(nvmlDevice_t d, Device(index));
    GpuIdentity id;
    id.index = index;
    char buf[96] = {};
    KILN_RETURN_IF_ERROR(Check(api_.device_get_uuid(d, buf, sizeof(buf)), "nvmlDeviceGetUUID"));
    id.uuid = buf;
    std::memset(buf, 0, sizeof(buf));
    KILN_RETURN_IF_ERROR(Check(api_.device_get_name(d, buf, sizeof(buf)), "nvmlDeviceGetName"));
    id.name = buf;
    NvmlPciInfo pci{};
    KILN_RETURN_IF_ERROR(Check(api_.device_get_pci_info(d, &pci), "nvmlDeviceGetPciInfo_v3"));
    id.pci_bus_id = pci.bus_id;
    NvmlMemory mem{};
    KILN_RETURN_IF_ERROR(Check(api_.device_get_memory_info(d, &mem), "nvmlDeviceGetMemoryInfo"));
    id.memory_total_bytes = static_cast<int64_t>(mem.total);
    unsigned lo = 0, hi = 0, def = 0;
    if (api_.device_get_power_limit_constraints(d, &lo, &hi) == kNvmlSuccess) {
      id.power_limit_min_mw = lo;
      id.power_limit_max_mw = hi;
    }
    if (api_.device_get_power_default_limit(d, &def) == kNvmlSuccess) {
      id.power_limit_default_mw = def;
    }
    return id;
  }

  absl::StatusOr<GpuTelemetry> Read(int index) override {
    KILN_ASSIGN_OR_RETURN(nvmlDevice_t d, Device(index));
    GpuTelemetry t;
    NvmlMemory mem{};
    KILN_RETURN_IF_ERROR(Check(api_.device_get_memory_info(d, &mem), "nvmlDeviceGetMemoryInfo"));
    t.memory_total_bytes = static_cast<int64_t>(mem.total);
    t.memory_used_bytes = static_cast<int64_t>(mem.used);
    // The rest is best effort: unsupported counters read as zero.
    NvmlUtilization util{};
    if (api_.device_get_utilization_rates(d, &util) == kNvmlSuccess) {
      t.utilization_gpu_pct = util.gpu;
      t.utilization_memory_pct = util.memory;
    }
    unsigned v = 0;
    if (api_.device_get_power_usage(d, &v) == kNvmlSuccess) t.power_draw_mw = v;
    if (api_.device_get_enforced_power_limit(d, &v) == kNvmlSuccess) t.power_limit_mw = v;
    if (api_.device_get_power_management_limit &&
        api_.device_get_power_management_limit(d, &v) == kNvmlSuccess) {
      t.power_management_limit_mw = v;
    }
    if (api_.device_get_temperature(d, kNvmlTemperatureGpu, &v) == kNvmlSuccess) {
      t.temperature_c = v;
    }
    if (api_.device_get_clock_info(d, kNvmlClockSm, &v) == kNvmlSuccess) t.sm_clock_mhz = v;
    unsigned long long reasons = 0;
    if (api_.device_get_clock_reasons && api_.device_get_clock_reasons(d, &reasons) == kNvmlSuccess) {
      t.clock_event_reasons = reasons;
    }
    unsigned long long ecc = 0;
    if (api_.device_get_total_ecc_errors(d, kNvmlMemoryErrorCorrected, kNvmlVolatileEcc, &ecc) ==
        kNvmlSuccess) {
      t.ecc_corrected = ecc;
    }
    if (api_.device_get_total_ecc_errors(d, kNvmlMemoryErrorUncorrected, kNvmlVolatileEcc, &ecc) ==
        kNvmlSuccess) {
      t.ecc_uncorrected = ecc;
    }
    unsigned mode = 0;
    if (api_.device_get_persistence_mode(d, &mode) == kNvmlSuccess) t.persistence_mode = mode != 0;
    return t;
  }

  absl::StatusOr<std::vector<GpuEvent>> WaitEvents(absl::Duration timeout) override {
    std::vector<GpuEvent> out;
    if (!events_) {
      absl::SleepFor(timeout);
      return out;
    }
    // nvmlEventSetWait_v2 hands over one event per call: everything queued is taken now (up
    // to a bound), so a drain-class Xid behind a burst of application ones is seen at once,
    // not one poll per event later.
    constexpr int kMaxEventsPerCall = 256;
    unsigned wait_ms = static_cast<unsigned>(absl::ToInt64Milliseconds(timeout));
    for (int n = 0; n < kMaxEventsPerCall; ++n) {
      NvmlEventData data{};
      nvmlReturn_t r = api_.event_set_wait(events_, &data, wait_ms);
      if (r == kNvmlErrorTimeout) break;
      if (r != kNvmlSuccess && !out.empty()) break;  // keep what was read; the error shows next time
      KILN_RETURN_IF_ERROR(Check(r, "nvmlEventSetWait_v2"));
      for (size_t i = 0; i < devices_.size(); ++i) {
        if (devices_[i] == data.device) out.push_back({static_cast<int>(i), data.event_data});
      }
      wait_ms = 0;  // the rest only if already queued
    }
    return out;
  }

  absl::Status SetPersistenceMode(int index, bool enabled) override {
    KILN_ASSIGN_OR_RETURN(nvmlDevice_t d, Device(index));
    return Check(api_.device_set_persistence_mode(d, enabled ? 1 : 0),
                 "nvmlDeviceSetPersistenceMode");
  }
  absl::Status SetPowerLimit(int index, uint32_t milliwatts) override {
    KILN_ASSIGN_OR_RETURN(nvmlDevice_t d, Device(index));
    return Check(api_.device_set_power_limit(d, milliwatts), "nvmlDeviceSetPowerManagementLimit");
  }
  absl::Status LockSmClocks(int index, uint32_t min_mhz, uint32_t max_mhz) override {
    KILN_ASSIGN_OR_RETURN(nvmlDevice_t d, Device(index));
    return Check(api_.device_set_locked_clocks(d, min_mhz, max_mhz), "nvmlDeviceSetGpuLockedClocks");
  }
  absl::Status ResetSmClocks(int index) override {
    KILN_ASSIGN_OR_RETURN(nvmlDevice_t d, Device(index));
    return Check(api_.device_reset_locked_clocks(d), "nvmlDeviceResetGpuLockedClocks");
  }

 private:
  absl::StatusOr<nvmlDevice_t> Device(int index) const {
    if (index < 0 || index >= static_cast<int>(devices_.size())) {
      return absl::NotFoundError("no GPU " + std::to_string(index));
    }
    return devices_[index];
  }
  absl::Status Check(nvmlReturn_t r, const char* call) const {
    if (r == kNvmlSuccess) return absl::OkStatus();
    return absl::UnavailableError(std::string(call) + ": " + api_.error_string(r));
  }

  void* lib_;
  NvmlApi api_;
  std::vector<nvmlDevice_t> devices_;
  std::string version_;
  nvmlEventSet_t events_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GpuDriver>> LoadNvmlDriver(const char* library) {
  void* lib = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return absl::NotFoundError(std::string(library) + " is not present (a CPU-only node)");
  }
  NvmlApi a{};
  bool ok = Bind(lib, "nvmlInit_v2", &a.init) && Bind(lib, "nvmlShutdown", &a.shutdown) &&
            Bind(lib, "nvmlErrorString", &a.error_string) &&
            Bind(lib, "nvmlSystemGetDriverVersion", &a.system_get_driver_version) &&
            Bind(lib, "nvmlDeviceGetCount_v2", &a.device_get_count) &&
            Bind(lib, "nvmlDeviceGetHandleByIndex_v2", &a.device_get_handle_by_index) &&
            Bind(lib, "nvmlDeviceGetUUID", &a.device_get_uuid) &&
            Bind(lib, "nvmlDeviceGetName", &a.device_get_name) &&
            Bind(lib, "nvmlDeviceGetPciInfo_v3", &a.device_get_pci_info) &&
            Bind(lib, "nvmlDeviceGetMemoryInfo", &a.device_get_memory_info) &&
            Bind(lib, "nvmlDeviceGetUtilizationRates", &a.device_get_utilization_rates) &&
            Bind(lib, "nvmlDeviceGetPowerUsage", &a.device_get_power_usage) &&
            Bind(lib, "nvmlDeviceGetEnforcedPowerLimit", &a.device_get_enforced_power_limit) &&
            Bind(lib, "nvmlDeviceGetPowerManagementLimitConstraints",
                 &a.device_get_power_limit_constraints) &&
            Bind(lib, "nvmlDeviceGetPowerManagementDefaultLimit",
                 &a.device_get_power_default_limit) &&
            Bind(lib, "nvmlDeviceGetTemperature", &a.device_get_temperature) &&
            Bind(lib, "nvmlDeviceGetClockInfo", &a.device_get_clock_info) &&
            Bind(lib, "nvmlDeviceGetTotalEccErrors", &a.device_get_total_ecc_errors) &&
            Bind(lib, "nvmlDeviceGetPersistenceMode", &a.device_get_persistence_mode) &&
            Bind(lib, "nvmlDeviceSetPersistenceMode", &a.device_set_persistence_mode) &&
            Bind(lib, "nvmlDeviceSetPowerManagementLimit", &a.device_set_power_limit) &&
            Bind(lib, "nvmlDeviceSetGpuLockedClocks", &a.device_set_locked_clocks) &&
            Bind(lib, "nvmlDeviceResetGpuLockedClocks", &a.device_reset_locked_clocks) &&
            Bind(lib, "nvmlEventSetCreate", &a.event_set_create) &&
            Bind(lib, "nvmlDeviceRegisterEvents", &a.device_register_events) &&
            Bind(lib, "nvmlEventSetWait_v2", &a.event_set_wait) &&
            Bind(lib, "nvmlEventSetFree", &a.event_set_free);
  if (!ok) {
    dlclose(lib);
    return absl::FailedPreconditionError(std::string(library) + ": missing an NVML symbol kiln needs");
  }
  // The limit set, as against the one enforced: read where the driver has it.
  Bind(lib, "nvmlDeviceGetPowerManagementLimit", &a.device_get_power_management_limit, false);
  // The clock-event query was renamed; take whichever this driver has.
  if (!Bind(lib, "nvmlDeviceGetCurrentClocksEventReasons", &a.device_get_clock_reasons, false) ||
      a.device_get_clock_reasons == nullptr) {
    Bind(lib, "nvmlDeviceGetCurrentClocksThrottleReasons", &a.device_get_clock_reasons, false);
  }
  if (a.init() != kNvmlSuccess) {
    dlclose(lib);
    return absl::NotFoundError("nvmlInit failed: no usable NVIDIA driver (a CPU-only node)");
  }
  char version[96] = {};
  a.system_get_driver_version(version, sizeof(version));
  unsigned count = 0;
  if (a.device_get_count(&count) != kNvmlSuccess || count == 0) {
    a.shutdown();
    dlclose(lib);
    return absl::NotFoundError("NVML reports no GPU (a CPU-only node)");
  }
  std::vector<nvmlDevice_t> devices(count);
  for (unsigned i = 0; i < count; ++i) {
    if (a.device_get_handle_by_index(i, &devices[i]) != kNvmlSuccess) {
      a.shutdown();
      dlclose(lib);
      return absl::UnavailableError("nvmlDeviceGetHandleByIndex_v2(" + std::to_string(i) +
                                    ") failed");
    }
  }
  return std::unique_ptr<GpuDriver>(new NvmlDriver(lib, a, std::move(devices), version));
}

}  // namespace kiln
