#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kiln {

// The router's choices, as pure functions (the router's threads only carry them out).

struct WeightedVersion {
  std::string version;
  int weight = 0;  // relative; 0 = takes no traffic
};

// A stable 64-bit hash (FNV-1a) of a sticky key: the same key picks the same version on
// every node and across restarts.
uint64_t StickyHash(const std::string& key);

// Picks a version by weight. With a sticky key the choice is a function of the key's hash;
// without one, of `random` (any uniformly random 64-bit value). FAILED_PRECONDITION when no
// version has weight.
absl::StatusOr<std::string> PickVersion(const std::vector<WeightedVersion>& versions,
                                        const std::optional<std::string>& sticky_key,
                                        uint64_t random);

struct RouteEndpoint {
  std::string id;
  std::string version;
  bool local = false;
  bool healthy = true;
  int64_t outstanding = 0;
};

// The endpoint for `version`: healthy and not in `exclude` (a failed first try), local
// before remote, then fewest outstanding requests, then the lowest id. NOT_FOUND when none.
absl::StatusOr<size_t> PickEndpoint(const std::vector<RouteEndpoint>& endpoints,
                                    const std::string& version,
                                    const std::set<std::string>& exclude);

}  // namespace kiln
