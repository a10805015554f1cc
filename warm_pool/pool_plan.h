#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kiln {

// The warm pool's decisions, as pure functions of (targets, replicas): the agent's event loop
// carries the actions out.

enum class PoolState { kStarting, kWarm, kServing, kDraining };
const char* PoolStateName(PoolState s);

struct PoolReplica {
  std::string id;
  std::string key;  // the model version, "embedder@2"
  PoolState state = PoolState::kStarting;
  PoolState start_as = PoolState::kServing;  // for kStarting: what it becomes once loaded
  int gpu = -1;
  int64_t gpu_memory_bytes = 0;
  absl::Time last_used;  // last request served, or when it became WARM
};

struct PoolTarget {
  std::string key;
  int serving = 0;
  int warm = 0;
};

enum class PoolActionKind { kPromote, kDemote, kStart, kDrain };
const char* PoolActionName(PoolActionKind k);

struct PoolAction {
  PoolActionKind kind;
  std::string key;
  std::string replica_id;                    // empty for kStart
  PoolState start_as = PoolState::kServing;  // for kStart
};

// Scale-up promotes WARM replicas first (the most recently used, ties by id) and starts cold
// ones only for what is left; scale-down demotes SERVING replicas (least recently used first)
// into the pool while it is short, else drains them; the pool is refilled (start as WARM)
// or trimmed (drain the least recently used WARM) to its size. Keys without a target are
// drained. Replicas already starting count toward what they will become.
std::vector<PoolAction> PlanPool(const std::vector<PoolTarget>& targets,
                                 const std::vector<PoolReplica>& replicas);

// WARM replicas on `gpu` to evict, least recently used first, so that `needed_bytes` fit
// beside `free_bytes`. RESOURCE_EXHAUSTED when evicting every WARM replica is not enough.
absl::StatusOr<std::vector<std::string>> PlanEvictions(const std::vector<PoolReplica>& replicas,
                                                       int gpu, int64_t free_bytes,
                                                       int64_t needed_bytes);

}  // namespace kiln
