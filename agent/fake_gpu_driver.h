#pragma once

#include <deque>
#include <string>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "agent/gpu_driver.h"

namespace kiln {

// An in-memory GPU driver: tests program it; `--fake-gpus N:MEM` runs a "GPU" node on a CPU
// machine with it (replicas then run on cpu, and status and logs say the GPUs are fake).
class FakeGpuDriver : public GpuDriver {
 public:
  struct Gpu {
    GpuIdentity identity;
    GpuTelemetry telemetry;
    bool locked_clocks = false;
    uint32_t locked_min_mhz = 0;
    uint32_t locked_max_mhz = 0;
    // A limit set outside kiln (an out-of-band one, say; 0 = none): the enforced limit is the
    // lower of it and the card's management limit.
    uint32_t external_cap_mw = 0;
  };

  explicit FakeGpuDriver(std::vector<Gpu> gpus) : gpus_(std::move(gpus)) {}

  // `count` GPUs of `memory_bytes` each, on PCI buses 0000:1x:00.0, 700 W cards.
  static std::vector<Gpu> MakeGpus(int count, int64_t memory_bytes);
  // Parses `--fake-gpus N:MEM` ("4:80Gi").
  static absl::StatusOr<std::vector<Gpu>> ParseSpec(const std::string& spec);

  std::string name() const override { return "fake"; }
  bool fake() const override { return true; }
  absl::StatusOr<int> DeviceCount() override;
  absl::StatusOr<GpuIdentity> Identify(int index) override;
  absl::StatusOr<GpuTelemetry> Read(int index) override;
  absl::StatusOr<std::vector<GpuEvent>> WaitEvents(absl::Duration timeout) override;
  absl::Status SetPersistenceMode(int index, bool enabled) override;
  absl::Status SetPowerLimit(int index, uint32_t milliwatts) override;
  absl::Status LockSmClocks(int index, uint32_t min_mhz, uint32_t max_mhz) override;
  absl::Status ResetSmClocks(int index) override;

  // Test controls.
  void InjectXid(int index, uint64_t xid);
  // Read(index) fails with `error` until set back to OK.
  void SetReadError(int index, absl::Status error);
  void SetTelemetry(int index, const GpuTelemetry& t);
  void SetExternalPowerCap(int index, uint32_t milliwatts);
  Gpu Get(int index) const;
  // Every setter call, in order ("power_limit 0 300000").
  std::vector<std::string> calls() const;

 private:
  absl::Status Check(int index) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<int, absl::Status> read_errors_ ABSL_GUARDED_BY(mu_);
  std::vector<Gpu> gpus_ ABSL_GUARDED_BY(mu_);
  std::deque<GpuEvent> events_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> calls_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln
