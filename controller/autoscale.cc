#include "controller/autoscale.h"

#include <algorithm>
#include <cmath>

namespace kiln {

int64_t RawRecommendation(const Autoscale& spec, double in_flight) {
  double want = spec.target_in_flight > 0 ? std::ceil(std::max(0.0, in_flight) / spec.target_in_flight)
                                          : static_cast<double>(spec.max);
  if (!(want < 1e9)) want = 1e9;
  return std::clamp(static_cast<int64_t>(want), spec.floor(), spec.ceiling());
}

int64_t AutoscaleHistory::Recommend(const Autoscale& spec, double in_flight, bool have_reports,
                                    int64_t current, absl::Time now,
                                    absl::Duration stabilization) {
  current = std::clamp(current, spec.floor(), spec.ceiling());
  if (!have_reports) return current;
  int64_t raw = RawRecommendation(spec, in_flight);
  // The first look counts the present count as a recommendation: a controller that just
  // started (or a deployment just switched to autoscaling) does not scale down for a window.
  if (recent_.empty()) recent_.emplace_back(now, current);
  recent_.emplace_back(now, raw);
  while (!recent_.empty() && recent_.front().first < now - stabilization) recent_.pop_front();
  if (raw >= current) return raw;  // up (or steady) at once
  int64_t highest = raw;
  for (const auto& [when, r] : recent_) highest = std::max(highest, r);
  // The count never rises on the way down: the window only holds scale-downs back.
  return std::min(current, highest);
}

int64_t WarmAfterScaleDown::Update(const std::string& version, int64_t serving, absl::Time now,
                                   absl::Duration window) {
  if (version != version_) {
    version_ = version;
    last_serving_ = serving;
    batches_.clear();
    return 0;
  }
  if (serving < last_serving_) {
    batches_.emplace_back(now + window, last_serving_ - serving);
  } else {
    // Promoted back: the newest batches give them up first.
    for (int64_t up = serving - last_serving_; up > 0 && !batches_.empty();) {
      const int64_t taken = std::min(up, batches_.back().second);
      batches_.back().second -= taken;
      up -= taken;
      if (batches_.back().second == 0) batches_.pop_back();
    }
  }
  last_serving_ = serving;
  while (!batches_.empty() && batches_.front().first <= now) batches_.pop_front();
  int64_t n = 0;
  for (const auto& [until, count] : batches_) n += count;
  return n;
}

void WarmAfterScaleDown::Restore(std::string version, int64_t last_serving,
                                 std::deque<std::pair<absl::Time, int64_t>> batches) {
  version_ = std::move(version);
  last_serving_ = last_serving;
  batches_ = std::move(batches);
}

}  // namespace kiln
