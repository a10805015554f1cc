#include "agent/gpu_monitor.h"

#include <algorithm>
#include <fstream>
#include <utility>

#include "common/filesystem.h"
#include "common/logging.h"
#include "nlohmann/json.hpp"

namespace kiln {

namespace {
bool DrainClass(uint64_t xid) { return ClassifyXid(xid).action == XidAction::kDrainGpu; }
}  // namespace

GpuMonitor::GpuMonitor(GpuDriver* driver, std::vector<int> gpus, Persistence persistence,
                       Clock* clock)
    : driver_(driver),
      gpus_(std::move(gpus)),
      persistence_(std::move(persistence)),
      clock_(clock ? clock : &steady_clock_) {
  if (persistence_.state_file.empty()) return;
  if (persistence_.boot_id.empty()) {
    // Without it a reboot could not be told apart: nothing is kept rather than kept forever.
    GetLogger("agent.gpu")->warn("the host's boot id is unknown: GPU health is not kept across "
                                 "agent restarts");
    persistence_.state_file.clear();
    return;
  }
  // Each GPU's UUID while it can still be read (a GPU that fell off the bus cannot say it).
  for (int gpu : gpus_) (void)Uuid(gpu);
  Restore();
}

bool GpuMonitor::AddDrainXid(int gpu, uint64_t xid) {
  auto& list = drain_xids_[gpu];
  if (std::find(list.begin(), list.end(), xid) != list.end()) return false;
  list.push_back(xid);
  return true;
}

std::string GpuMonitor::Uuid(int gpu) {
  auto it = uuids_.find(gpu);
  if (it != uuids_.end()) return it->second;
  auto id = driver_->Identify(gpu);
  if (!id.ok() || id->uuid.empty()) return "";
  uuids_[gpu] = id->uuid;
  return id->uuid;
}

void GpuMonitor::Restore() {
  if (persistence_.state_file.empty()) return;
  std::ifstream in(persistence_.state_file);
  if (!in) return;
  nlohmann::json doc = nlohmann::json::parse(in, nullptr, false);
  auto log = GetLogger("agent.gpu");
  if (!doc.is_object() || !doc.contains("gpus") || !doc["gpus"].is_object()) {
    log->warn("{}: not a GPU health file; starting afresh", persistence_.state_file);
    return;
  }
  if (!doc.contains("boot_id") || !doc["boot_id"].is_string()) {
    log->warn("{}: boot_id: not a string; starting afresh", persistence_.state_file);
    return;
  }
  if (doc["boot_id"].get<std::string>() != persistence_.boot_id) {
    log->info("{}: from an earlier boot; the GPUs were reset since, starting afresh",
              persistence_.state_file);
    return;
  }
  for (const auto& [uuid, g] : doc["gpus"].items()) {
    if (!g.is_object()) continue;
    std::vector<uint64_t> xids;
    if (g.contains("xids") && g["xids"].is_array()) {
      for (const auto& x : g["xids"]) {
        if (x.is_number_unsigned() && DrainClass(x.get<uint64_t>())) xids.push_back(x.get<uint64_t>());
      }
    }
    std::optional<uint64_t> baseline;
    if (g.contains("ecc_uncorrected_baseline") && g["ecc_uncorrected_baseline"].is_number_unsigned()) {
      baseline = g["ecc_uncorrected_baseline"].get<uint64_t>();
    }
    restored_[uuid] = {std::move(xids), baseline};
  }
}

void GpuMonitor::Save() {
  if (persistence_.state_file.empty()) return;
  auto entry = [](const std::vector<uint64_t>& xids, std::optional<uint64_t> baseline) {
    nlohmann::json g = {{"xids", xids}};
    if (baseline) g["ecc_uncorrected_baseline"] = *baseline;
    return g;
  };
  nlohmann::json gpus = nlohmann::json::object();
  for (int gpu : gpus_) {
    std::string uuid = Uuid(gpu);
    if (uuid.empty()) continue;
    auto b = ecc_baseline_.find(gpu);
    gpus[uuid] = entry(drain_xids_[gpu], b != ecc_baseline_.end()
                                             ? std::optional<uint64_t>(b->second)
                                             : std::nullopt);
  }
  // Entries of GPUs not seen yet are kept as they were.
  for (const auto& [uuid, r] : restored_) {
    if (!gpus.contains(uuid)) gpus[uuid] = entry(r.first, r.second);
  }
  nlohmann::json doc = {{"boot_id", persistence_.boot_id}, {"gpus", std::move(gpus)}};
  absl::Status s = ReplaceFile(persistence_.state_file, doc.dump(2) + "\n");
  if (!s.ok()) GetLogger("agent.gpu")->error("{}", std::string(s.message()));
}

void GpuMonitor::Poll() {
  bool changed = false;
  const absl::Time now = clock_->Now();
  auto events = driver_->WaitEvents(absl::ZeroDuration());
  if (events.ok()) {
    for (const auto& e : *events) {
      const XidAction action = ClassifyXid(e.xid).action;
      if (action == XidAction::kDrainGpu) {
        // Once per code: a storm of them says no more than the first.
        changed |= AddDrainXid(e.index, e.xid);
        continue;
      }
      if (action == XidAction::kApplication) new_application_xids_.emplace_back(e.index, e.xid);
      auto& recent = recent_xids_[e.index];
      recent.push_back({e.xid, now});
      if (recent.size() > kRecentApplicationXids) recent.pop_front();
    }
  }
  for (auto& [gpu, recent] : recent_xids_) {
    while (!recent.empty() && now - recent.front().at >= kApplicationXidWindow) recent.pop_front();
  }
  for (int gpu : gpus_) {
    if (!restored_.empty()) {
      auto r = restored_.find(Uuid(gpu));
      if (r != restored_.end()) {
        for (uint64_t x : r->second.first) AddDrainXid(gpu, x);
        if (r->second.second) ecc_baseline_.try_emplace(gpu, *r->second.second);
        if (!r->second.first.empty()) {
          GetLogger("agent.gpu")
              ->warn("gpu {} ({}): unhealthy before the agent restarted ({} Xid(s) that need a "
                     "reset); kept so until the node reboots, or {} is removed and the agent restarted",
                     gpu, r->first, r->second.first.size(), persistence_.state_file);
        }
        restored_.erase(r);
      }
    }
    auto t = driver_->Read(gpu);
    GpuHealthInput in;
    if (t.ok()) {
      telemetry_[gpu] = *t;
      changed |= ecc_baseline_.try_emplace(gpu, t->ecc_uncorrected).second;
      in.ecc_uncorrected = t->ecc_uncorrected;
      in.ecc_uncorrected_baseline = ecc_baseline_[gpu];
      in.clock_event_reasons = t->clock_event_reasons;
      in.temperature_c = t->temperature_c;
    }
    in.xids = drain_xids_[gpu];
    for (const SeenXid& x : recent_xids_[gpu]) in.xids.push_back(x.xid);
    GpuHealth h = EvaluateGpuHealth(in);
    int& failures = read_failures_[gpu];
    failures = t.ok() ? 0 : failures + 1;
    if (!t.ok()) {
      h.degraded = true;
      if (failures >= kReadFailuresUnhealthy) {
        h.healthy = false;
        h.reasons.push_back("cannot read the GPU (" + std::to_string(failures) +
                            " times in a row): " + std::string(t.status().message()));
      } else {
        h.reasons.push_back("a read of the GPU failed (" + std::to_string(failures) + " of " +
                            std::to_string(kReadFailuresUnhealthy) + " before it is unhealthy): " +
                            std::string(t.status().message()));
      }
    }
    health_[gpu] = std::move(h);
  }
  if (changed) Save();
}

bool GpuMonitor::Healthy(int gpu) const {
  auto it = health_.find(gpu);
  return it == health_.end() || it->second.healthy;
}

std::vector<std::pair<int, uint64_t>> GpuMonitor::TakeApplicationXids() {
  return std::exchange(new_application_xids_, {});
}

}  // namespace kiln
