#include "agent/router_policy.h"

#include "common/hash.h"

namespace kiln {

uint64_t StickyHash(const std::string& key) { return Fnv1a64(key); }

absl::StatusOr<std::string> PickVersion(const std::vector<WeightedVersion>& versions,
                                        const std::optional<std::string>& sticky_key,
                                        uint64_t random) {
  uint64_t total = 0;
  for (const auto& v : versions) {
    if (v.weight > 0) total += static_cast<uint64_t>(v.weight);
  }
  if (total == 0) return absl::FailedPreconditionError("no version of the model takes traffic");
  uint64_t point = (sticky_key ? StickyHash(*sticky_key) : random) % total;
  for (const auto& v : versions) {
    if (v.weight <= 0) continue;
    if (point < static_cast<uint64_t>(v.weight)) return v.version;
    point -= static_cast<uint64_t>(v.weight);
  }
  return versions.back().version;  // unreachable: point < total
}

absl::StatusOr<size_t> PickEndpoint(const std::vector<RouteEndpoint>& endpoints,
                                    const std::string& version,
                                    const std::set<std::string>& exclude) {
  std::optional<size_t> best;
  for (size_t i = 0; i < endpoints.size(); ++i) {
    const auto& e = endpoints[i];
    if (!e.healthy || e.version != version || exclude.count(e.id)) continue;
    if (!best) {
      best = i;
      continue;
    }
    const auto& b = endpoints[*best];
    if (e.local != b.local) {
      if (e.local) best = i;
      continue;
    }
    if (e.outstanding != b.outstanding) {
      if (e.outstanding < b.outstanding) best = i;
      continue;
    }
    if (e.id < b.id) best = i;
  }
  if (!best) return absl::NotFoundError("no healthy replica of version " + version);
  return *best;
}

}  // namespace kiln
