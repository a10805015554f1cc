#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kiln {

// A fixed-bucket histogram (Prometheus style: bucket i counts values <= bounds[i], the last
// bucket is +Inf). Thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);

  // Exponential bounds: start, start*factor, ... (count bounds).
  static std::vector<double> ExponentialBounds(double start, double factor, int count);

  void Record(double value);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> counts;  // bounds.size() + 1 entries
    double sum = 0;
    uint64_t count = 0;
    // Linear interpolation inside the bucket holding quantile q (0..1); 0 when empty.
    double Quantile(double q) const;
    // The Prometheus text exposition of this histogram as metric `name` (HELP, TYPE,
    // cumulative `_bucket{le=...}` lines, `_sum`, `_count`); `labels` (`a="x",b="y"`, or empty)
    // go on every line.
    std::string Prometheus(const std::string& name, const std::string& help,
                           const std::string& labels = "") const;
  };
  Snapshot Take() const;

 private:
  const std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kiln
