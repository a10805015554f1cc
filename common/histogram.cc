#include "common/histogram.h"

#include <algorithm>
#include <charconv>
#include <system_error>
#include <sstream>

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

namespace {

// The shortest text that reads back as `v` (0.004, not 0.0040000000000000001).
std::string Shortest(double v) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  return ec == std::errc() ? std::string(buf, end) : std::to_string(v);
}

}  // namespace

std::string Histogram::Snapshot::Prometheus(const std::string& name, const std::string& help,
                                           const std::string& labels) const {
  std::ostringstream out;
  const std::string sep = labels.empty() ? "" : ",";
  out << "# HELP " << name << " " << help << "\n# TYPE " << name << " histogram\n";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds.size(); ++i) {
    cumulative += i < counts.size() ? counts[i] : 0;
    out << name << "_bucket{" << labels << sep << "le=\"" << Shortest(bounds[i]) << "\"} " << cumulative
        << "\n";
  }
  out << name << "_bucket{" << labels << sep << "le=\"+Inf\"} " << count << "\n";
  const std::string braces = labels.empty() ? "" : "{" + labels + "}";
  out << name << "_sum" << braces << " " << Shortest(sum) << "\n";
  out << name << "_count" << braces << " " << count << "\n";
  return out.str();
}

}  // namespace kiln
