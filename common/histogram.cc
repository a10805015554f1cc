#include "common/histogram.h"

#include <algorithm>

namespace kiln {

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

std::vector<double> Histogram::ExponentialBounds(double start, double factor, int count) {
  std::vector<double> out;
  double v = start;
  for (int i = 0; i < count; ++i) {
    out.push_back(v);
    v *= factor;
  }
  return out;
}

void Histogram::Record(double value) {
  size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  absl::MutexLock lock(&mu_);
  counts_[i]++;
  sum_ += value;
  count_++;
}

Histogram::Snapshot Histogram::Take() const {
  absl::MutexLock lock(&mu_);
  return Snapshot{bounds_, counts_, sum_, count_};
}

double Histogram::Snapshot::Quantile(double q) const {
  if (count == 0) return 0;
  double rank = q * static_cast<double>(count);
  uint64_t seen = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] == 0) continue;
    if (static_cast<double>(seen + counts[i]) >= rank) {
      double lo = i == 0 ? 0 : bounds[i - 1];
      double hi = i < bounds.size() ? bounds[i] : (bounds.empty() ? 0 : bounds.back());
      double frac = (rank - static_cast<double>(seen)) / static_cast<double>(counts[i]);
      return lo + (hi - lo) * std::clamp(frac, 0.0, 1.0);
    }
    seen += counts[i];
  }
  return bounds.empty() ? 0 : bounds.back();
}

}  // namespace kiln
