#include "agent/gpu_monitor.h"

namespace kiln {

void GpuMonitor::Poll() {
  auto events = driver_->WaitEvents(absl::ZeroDuration());
  if (events.ok()) {
    for (const auto& e : *events) xids_[e.index].push_back(e.xid);
  }
  for (int gpu : gpus_) {
    auto t = driver_->Read(gpu);
    GpuHealthInput in;
    if (t.ok()) {
      telemetry_[gpu] = *t;
      ecc_baseline_.try_emplace(gpu, t->ecc_uncorrected);
      in.ecc_uncorrected = t->ecc_uncorrected;
      in.ecc_uncorrected_baseline = ecc_baseline_[gpu];
      in.clock_event_reasons = t->clock_event_reasons;
      in.temperature_c = t->temperature_c;
    }
    in.xids = xids_[gpu];
    GpuHealth h = EvaluateGpuHealth(in);
    if (!t.ok()) {
      h.healthy = false;
      h.degraded = true;
      h.reasons.push_back("cannot read the GPU: " + std::string(t.status().message()));
    }
    health_[gpu] = std::move(h);
  }
}

bool GpuMonitor::Healthy(int gpu) const {
  auto it = health_.find(gpu);
  return it == health_.end() || it->second.healthy;
}

}  // namespace kiln
