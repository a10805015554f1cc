#include "agent/gpu_power.h"

#include <algorithm>
#include <fstream>
#include <limits>

#include "common/filesystem.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace kiln {

const char* GpuLoadName(GpuLoad l) {
  switch (l) {
    case GpuLoad::kIdle:
      return "idle";
    case GpuLoad::kWarmOnly:
      return "warm-only";
    case GpuLoad::kServing:
      return "serving";
  }
  return "?";
}

std::map<int, GpuLoad> ClassifyGpuLoads(const std::vector<int>& gpus,
                                        const std::vector<GpuHolder>& holders) {
  std::map<int, GpuLoad> load;
  for (int g : gpus) load[g] = GpuLoad::kIdle;
  for (const auto& h : holders) {
    auto it = load.find(h.gpu);
    if (it == load.end()) continue;
    if (h.serving) {
      it->second = GpuLoad::kServing;
    } else if (it->second == GpuLoad::kIdle) {
      it->second = GpuLoad::kWarmOnly;
    }
  }
  return load;
}

const PowerKnobs& PowerPolicy::For(GpuLoad load) const {
  switch (load) {
    case GpuLoad::kWarmOnly:
      return warm_only;
    case GpuLoad::kServing:
      return serving;
    default:
      return idle;
  }
}

std::string PowerChange::Describe() const {
  switch (kind) {
    case kPersistence:
      return std::string("persistence mode ") + (a ? "on" : "off");
    case kPowerLimit:
      return "power limit " + std::to_string(a / 1000) + " W";
    case kLockClocks:
      return "lock SM clocks " + std::to_string(a) + "-" + std::to_string(b) + " MHz";
    case kUnlockClocks:
      return "unlock SM clocks";
  }
  return "?";
}

uint32_t LimitSet(const GpuTelemetry& t) {
  return t.power_management_limit_mw > 0 ? t.power_management_limit_mw : t.power_limit_mw;
}

std::vector<PowerChange> PlanPowerChanges(const GpuIdentity& card, const GpuTelemetry& now,
                                          const ClockLock& current_lock, const PowerKnobs& want) {
  std::vector<PowerChange> out;
  if (want.persistence && *want.persistence != now.persistence_mode) {
    out.push_back({PowerChange::kPersistence, *want.persistence ? 1u : 0u});
  }
  std::optional<uint32_t> wanted_limit = want.power_limit_mw;
  if (want.card_limit == PowerKnobs::CardLimit::kMinimum && card.power_limit_min_mw > 0) {
    wanted_limit = card.power_limit_min_mw;
  } else if (want.card_limit == PowerKnobs::CardLimit::kDefault &&
             card.power_limit_default_mw > 0) {
    wanted_limit = card.power_limit_default_mw;
  }
  if (wanted_limit) {
    uint32_t limit = *wanted_limit;
    if (card.power_limit_max_mw > 0) {
      limit = std::clamp(limit, card.power_limit_min_mw, card.power_limit_max_mw);
    }
    if (limit != LimitSet(now)) out.push_back({PowerChange::kPowerLimit, limit});
  }
  if (want.locked_sm_clocks) {
    if (current_lock != want.locked_sm_clocks) {
      out.push_back({PowerChange::kLockClocks, want.locked_sm_clocks->first,
                     want.locked_sm_clocks->second});
    }
  } else if (want.unlock_clocks && current_lock) {
    out.push_back({PowerChange::kUnlockClocks});
  }
  return out;
}

bool PowerRetry::Failed(GpuLoad load, const std::string& error, absl::Time now) {
  const bool same = load_ == load;
  const bool log = !same || error_ != error;
  backoff_ = same ? std::min(backoff_ * 2, absl::Minutes(10)) : absl::Seconds(30);
  load_ = load;
  error_ = error;
  next_ = now + backoff_;
  return log;
}

absl::StatusOr<PowerMode> ParsePowerMode(const std::string& text) {
  if (text == "off") return PowerMode::kOff;
  if (text == "dry-run") return PowerMode::kDryRun;
  if (text == "enforce") return PowerMode::kEnforce;
  return absl::InvalidArgumentError("--gpu-power: must be off, dry-run or enforce, got '" + text +
                                    "'");
}

GpuPowerManager::GpuPowerManager(GpuDriver* driver, PowerMode mode, PowerPolicy policy, Log log,
                                 std::string originals_file)
    : driver_(driver),
      mode_(mode),
      originals_file_(std::move(originals_file)),
      policy_(std::move(policy)),
      log_(std::move(log)) {
  if (originals_file_.empty() || mode_ != PowerMode::kEnforce) return;
  std::ifstream in(originals_file_);
  if (!in) return;
  nlohmann::json doc = nlohmann::json::parse(in, nullptr, false);
  if (!doc.is_object() || !doc.contains("gpus") || !doc["gpus"].is_object()) {
    log_(originals_file_ + ": not a file kiln wrote; ignored");
    return;
  }
  absl::MutexLock lock(&mu_);
  for (const auto& [uuid, g] : doc["gpus"].items()) {
    // An entry kiln did not write is left out, saying which field is wrong: its card keeps
    // whatever it holds now.
    std::string bad;
    if (!g.is_object()) {
      bad = "not an object";
    } else if (!g.contains("power_limit_mw") || !g["power_limit_mw"].is_number_unsigned() ||
               g["power_limit_mw"].get<uint64_t>() > std::numeric_limits<uint32_t>::max()) {
      bad = "power_limit_mw: not a limit in milliwatts";
    } else {
      for (const char* flag : {"persistence", "clocks_locked"}) {
        if (g.contains(flag) && !g[flag].is_boolean()) bad = std::string(flag) + ": not true or false";
      }
    }
    if (!bad.empty()) {
      log_(originals_file_ + ": gpus." + uuid + ": " + bad + "; that GPU's entry ignored");
      continue;
    }
    Saved s;
    s.power_limit_mw = g["power_limit_mw"].get<uint32_t>();
    s.persistence = g.contains("persistence") && g["persistence"].get<bool>();
    s.clocks_locked = g.contains("clocks_locked") && g["clocks_locked"].get<bool>();
    saved_[uuid] = s;
  }
  if (!saved_.empty()) {
    log_(std::to_string(saved_.size()) + " GPU(s) still hold settings an earlier agent made (" +
         originals_file_ + "): their own are restored on exit");
  }
}

void GpuPowerManager::SaveOriginals() {
  if (originals_file_.empty() || mode_ != PowerMode::kEnforce) return;
  nlohmann::json gpus = nlohmann::json::object();
  for (const auto& [uuid, s] : saved_) {
    gpus[uuid] = {{"persistence", s.persistence},
                  {"power_limit_mw", s.power_limit_mw},
                  {"clocks_locked", s.clocks_locked}};
  }
  for (const auto& [index, o] : originals_) {
    gpus[o.identity.uuid] = {{"persistence", o.telemetry.persistence_mode},
                             {"power_limit_mw", LimitSet(o.telemetry)},
                             {"clocks_locked", locked_[index].has_value()}};
  }
  absl::Status s = ReplaceFile(originals_file_, nlohmann::json({{"gpus", gpus}}).dump(2) + "\n");
  if (!s.ok()) log_(std::string(s.message()));
}

absl::StatusOr<std::vector<PowerChange>> GpuPowerManager::Apply(int index, GpuLoad load) {
  if (mode_ == PowerMode::kOff) return std::vector<PowerChange>{};
  KILN_ASSIGN_OR_RETURN(GpuIdentity id, driver_->Identify(index));
  KILN_ASSIGN_OR_RETURN(GpuTelemetry now, driver_->Read(index));
  absl::MutexLock lock(&mu_);
  if (!originals_.count(index)) {
    Original o{id, now};
    // Settings an earlier agent found and did not put back are the card's own, not the caps
    // it left.
    if (auto it = saved_.find(id.uuid); it != saved_.end()) {
      o.telemetry.persistence_mode = it->second.persistence;
      o.telemetry.power_limit_mw = it->second.power_limit_mw;
      o.telemetry.power_management_limit_mw = it->second.power_limit_mw;
      if (it->second.clocks_locked) locked_[index] = std::make_pair(0u, 0u);  // reset on restore
      saved_.erase(it);
    }
    originals_.emplace(index, o);
    SaveOriginals();
  }
  std::vector<PowerChange> plan = PlanPowerChanges(id, now, locked_[index], policy_.For(load));
  planned_ += plan.size();
  const std::string prefix = "gpu " + std::to_string(index) + " (" + id.uuid + ", " +
                             GpuLoadName(load) + "): ";
  for (const auto& c : plan) {
    if (mode_ == PowerMode::kDryRun) {
      log_(prefix + "would set " + c.Describe() + " (dry-run)");
      continue;
    }
    absl::Status s;
    switch (c.kind) {
      case PowerChange::kPersistence:
        s = driver_->SetPersistenceMode(index, c.a != 0);
        break;
      case PowerChange::kPowerLimit:
        s = driver_->SetPowerLimit(index, c.a);
        break;
      case PowerChange::kLockClocks:
        s = driver_->LockSmClocks(index, c.a, c.b);
        if (s.ok()) {
          locked_[index] = std::make_pair(c.a, c.b);
          SaveOriginals();  // a lock this agent made is reset by the next if it dies
        }
        break;
      case PowerChange::kUnlockClocks:
        s = driver_->ResetSmClocks(index);
        if (s.ok()) {
          locked_[index].reset();
          SaveOriginals();
        }
        break;
    }
    if (!s.ok()) return Annotate(s, prefix + c.Describe());
    applied_++;
    // Read back what the card now enforces.
    KILN_ASSIGN_OR_RETURN(GpuTelemetry after, driver_->Read(index));
    std::string readback;
    if (c.kind == PowerChange::kPowerLimit) {
      readback = ", enforced limit now " + std::to_string(after.power_limit_mw / 1000) + " W";
      if (after.power_limit_mw < c.a) readback += " (another limit on the card is lower)";
    } else if (c.kind == PowerChange::kPersistence) {
      readback = std::string(", persistence now ") + (after.persistence_mode ? "on" : "off");
    }
    log_(prefix + "set " + c.Describe() + readback);
  }
  return plan;
}

absl::Status GpuPowerManager::RestoreAll() {
  absl::MutexLock lock(&mu_);
  absl::Status first;
  for (auto& [index, orig] : originals_) {
    if (mode_ != PowerMode::kEnforce) continue;
    auto now = driver_->Read(index);
    if (!now.ok()) {
      first.Update(now.status());
      continue;
    }
    PowerKnobs back;
    back.persistence = orig.telemetry.persistence_mode;
    back.power_limit_mw = LimitSet(orig.telemetry);
    back.unlock_clocks = true;
    for (const auto& c : PlanPowerChanges(orig.identity, *now, locked_[index], back)) {
      absl::Status s;
      if (c.kind == PowerChange::kPersistence) s = driver_->SetPersistenceMode(index, c.a != 0);
      if (c.kind == PowerChange::kPowerLimit) s = driver_->SetPowerLimit(index, c.a);
      if (c.kind == PowerChange::kUnlockClocks) s = driver_->ResetSmClocks(index);
      if (s.ok()) {
        log_("gpu " + std::to_string(index) + ": restored " + c.Describe());
      } else {
        first.Update(s);
      }
    }
    locked_[index].reset();
  }
  originals_.clear();
  if (first.ok()) SaveOriginals();  // what is left: cards this agent never touched
  return first;
}

uint64_t GpuPowerManager::changes_applied() const {
  absl::MutexLock lock(&mu_);
  return applied_;
}

uint64_t GpuPowerManager::changes_planned() const {
  absl::MutexLock lock(&mu_);
  return planned_;
}

}  // namespace kiln
