#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace kiln {

// The warm pool of a node that runs alone (an assignment file), as a pure function of what
// the file wants and what the node runs. Under a controller, the controller's placement keeps
// the pools; this is the same policy for one node.
//
// Replicas of the same shape (model, version, repository, GPU, CPUs, runtime settings) are
// interchangeable, so a pool is kept per shape, and a running replica may take another id:
// - scale-up: a replica new to the file takes a pool member of its shape (the most recently
//   used loaded one; else one still starting) instead of starting cold; the pool is refilled
//   with new members, which start in the background;
// - scale-down: a replica that leaves the file joins its shape's pool while the pool is short
//   (it is demoted, not drained); otherwise it drains;
// - the pool is trimmed to its size (members still starting go first, then the least recently
//   used);
// - GPU memory: when the declared memory of what a GPU would hold exceeds the GPU's, WARM pool
//   members on it are evicted, least recently used first, until it fits or none is left.

struct PoolWanted {
  std::string id;
  std::string shape;
  int gpu = -1;
  int64_t gpu_memory_bytes = 0;  // declared; 0 = not counted
};

struct PoolSpec {
  std::string shape;
  int size = 0;
  std::string id_prefix;  // new members are `id_prefix` + the smallest free number
  int gpu = -1;
  int64_t gpu_memory_bytes = 0;
};

struct PoolRunning {
  std::string id;
  std::string shape;
  bool pool_member = false;  // one of a pool's own ids, not named by the file
  bool loaded = false;       // WARM or SERVING: takes traffic as soon as it is promoted
  bool crash_loop = false;   // never taken over (a new replica would wait out its backoff)
  absl::Time last_used;      // last seen SERVING, or when it started
};

struct PoolPlan {
  // Running replicas that go on under another id (the same process): from -> to.
  std::map<std::string, std::string> renames;
  // Each pool's members after the plan (ids kept, taken over, or new), by shape.
  std::map<std::string, std::vector<std::string>> members;
  // Pool members dropped to make room on a GPU for the file's own replicas.
  std::vector<std::string> evicted;
};

// `reserved`: ids still held by replicas on their way out (draining): never given to a new
// member, and a wanted replica with one is not new (it starts again once the old one is gone).
PoolPlan PlanNodePools(const std::vector<PoolWanted>& wanted, const std::vector<PoolSpec>& pools,
                       const std::vector<PoolRunning>& running,
                       const std::map<int, int64_t>& gpu_memory_bytes,
                       const std::set<std::string>& reserved = {});

}  // namespace kiln
