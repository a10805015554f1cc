#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "agent/gpu_driver.h"

namespace kiln {

// What runs on a GPU, as the power policy sees it.
enum class GpuLoad { kIdle, kWarmOnly, kServing };
const char* GpuLoadName(GpuLoad l);

// Something holding a device context on a GPU: a replica (serving or not) or a pre-started
// runtime waiting for a model.
struct GpuHolder {
  int gpu = -1;
  bool serving = false;
};
// The load of each of `gpus` (pure): serving if a holder serves on it; warm-only if something
// holds a context there but nothing serves (WARM or starting replicas, pre-started runtimes);
// idle if nothing does. Holders of other GPUs (or none, -1) are ignored.
std::map<int, GpuLoad> ClassifyGpuLoads(const std::vector<int>& gpus,
                                        const std::vector<GpuHolder>& holders);

// Card settings for one GpuLoad; an unset knob is left as found.
struct PowerKnobs {
  std::optional<bool> persistence;
  std::optional<uint32_t> power_limit_mw;  // clamped to the card's bounds
  // Locked SM clocks (min, max) MHz; `unlock_clocks` resets a lock instead.
  std::optional<std::pair<uint32_t, uint32_t>> locked_sm_clocks;
  bool unlock_clocks = false;
  // Instead of a number: each card's own minimum, or its default, limit (cards of a node
  // need not share them). Ignored where the card does not report it.
  enum class CardLimit { kNone, kMinimum, kDefault };
  CardLimit card_limit = CardLimit::kNone;
};

struct PowerPolicy {
  PowerKnobs idle;
  PowerKnobs warm_only;
  PowerKnobs serving;
  // WARM replicas get CUDA_DISABLE_PERF_BOOST=1 ("power-parked"); promotion then runs one
  // warm-up inference before the replica is routed.
  bool park_warm_replicas = true;

  const PowerKnobs& For(GpuLoad load) const;
};

// One card setting to change.
struct PowerChange {
  enum Kind { kPersistence, kPowerLimit, kLockClocks, kUnlockClocks } kind;
  uint32_t a = 0;  // persistence 0/1, limit mW, or min MHz
  uint32_t b = 0;  // max MHz
  std::string Describe() const;
};

// The changes that take the card from `now` to `want` (pure). Power limits are clamped to
// [min, max] of the card; a change already in effect is omitted.
using ClockLock = std::optional<std::pair<uint32_t, uint32_t>>;
// The power limit set on the card, as against the lower one it may enforce: the management
// limit where the driver reads it, else the enforced one.
uint32_t LimitSet(const GpuTelemetry& t);

std::vector<PowerChange> PlanPowerChanges(const GpuIdentity& card, const GpuTelemetry& now,
                                          const ClockLock& current_lock, const PowerKnobs& want);

// When a GPU's failed power change is tried again (pure; time is the caller's): after 30 s,
// doubling to 10 minutes while the same load keeps failing, from 30 s again for another load.
class PowerRetry {
 public:
  // Whether a change to `load` may be tried at `now`.
  bool Due(GpuLoad load, absl::Time now) const { return load_ != load || now >= next_; }
  // The change to `load` failed with `error` at `now`. Returns whether to log it (the first
  // failure of a load, or a new error): a card that refuses a setting for good is not logged
  // every pass.
  bool Failed(GpuLoad load, const std::string& error, absl::Time now);
  absl::Time next() const { return next_; }

 private:
  std::optional<GpuLoad> load_;  // the load whose change failed
  std::string error_;
  absl::Duration backoff_ = absl::Seconds(30);
  absl::Time next_ = absl::InfinitePast();
};

enum class PowerMode { kOff, kDryRun, kEnforce };
absl::StatusOr<PowerMode> ParsePowerMode(const std::string& text);

// Carries power plans out: dry-run logs only; enforce applies, reads back and counts; the
// settings each card had when first touched are restored by RestoreAll() (on exit).
//
// With `originals_file`, enforce mode keeps those first settings there (by GPU UUID) until
// they are restored: an agent that died without restoring (killed, crashed) leaves them for
// the next one, which restores them and does not take its own caps for the card's settings.
class GpuPowerManager {
 public:
  using Log = std::function<void(const std::string&)>;
  GpuPowerManager(GpuDriver* driver, PowerMode mode, PowerPolicy policy, Log log,
                  std::string originals_file = "");

  // Brings GPU `index` to the policy for `load`. Returns the changes planned.
  absl::StatusOr<std::vector<PowerChange>> Apply(int index, GpuLoad load);
  // Puts back what each touched card had (enforce mode). Safe to call twice.
  absl::Status RestoreAll();

  uint64_t changes_applied() const;
  uint64_t changes_planned() const;

 private:
  struct Original {
    GpuIdentity identity;
    GpuTelemetry telemetry;
  };

  // Writes originals_ (enforce mode, with a file); a failure is logged.
  void SaveOriginals() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  GpuDriver* driver_;
  const PowerMode mode_;
  const std::string originals_file_;
  // From the file: what a previous agent found on each card (by UUID) and did not put back.
  struct Saved {
    bool persistence = false;
    uint32_t power_limit_mw = 0;
    bool clocks_locked = false;
  };
  std::map<std::string, Saved> saved_ ABSL_GUARDED_BY(mu_);
  const PowerPolicy policy_;
  Log log_;
  mutable absl::Mutex mu_;
  std::map<int, Original> originals_ ABSL_GUARDED_BY(mu_);
  std::map<int, ClockLock> locked_ ABSL_GUARDED_BY(mu_);
  uint64_t applied_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t planned_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kiln
