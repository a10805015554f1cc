#include "warm_pool/pool_plan.h"

#include <algorithm>
#include <map>
#include <set>

namespace kiln {

const char* PoolStateName(PoolState s) {
  switch (s) {
    case PoolState::kStarting:
      return "STARTING";
    case PoolState::kWarm:
      return "WARM";
    case PoolState::kServing:
      return "SERVING";
    case PoolState::kDraining:
      return "DRAINING";
  }
  return "?";
}

const char* PoolActionName(PoolActionKind k) {
  switch (k) {
    case PoolActionKind::kPromote:
      return "promote";
    case PoolActionKind::kDemote:
      return "demote";
    case PoolActionKind::kStart:
      return "start";
    case PoolActionKind::kDrain:
      return "drain";
  }
  return "?";
}

namespace {

bool MoreRecent(const PoolReplica* a, const PoolReplica* b) {
  if (a->last_used != b->last_used) return a->last_used > b->last_used;
  return a->id < b->id;
}
bool LessRecent(const PoolReplica* a, const PoolReplica* b) {
  if (a->last_used != b->last_used) return a->last_used < b->last_used;
  return a->id < b->id;
}

}  // namespace

std::vector<PoolAction> PlanPool(const std::vector<PoolTarget>& targets,
                                 const std::vector<PoolReplica>& replicas) {
  std::vector<PoolAction> out;
  std::map<std::string, PoolTarget> by_key;
  for (const auto& t : targets) by_key[t.key] = t;
  std::map<std::string, std::vector<const PoolReplica*>> groups;
  for (const auto& r : replicas) groups[r.key].push_back(&r);
  for (const auto& t : targets) groups[t.key];  // keys with no replica yet

  for (auto& [key, group] : groups) {
    auto target_it = by_key.find(key);
    if (target_it == by_key.end()) {
      for (const auto* r : group) {
        if (r->state != PoolState::kDraining) out.push_back({PoolActionKind::kDrain, key, r->id});
      }
      continue;
    }
    const PoolTarget& target = target_it->second;
    std::vector<const PoolReplica*> serving, warm;
    int starting_serving = 0, starting_warm = 0;
    for (const auto* r : group) {
      if (r->state == PoolState::kServing) serving.push_back(r);
      if (r->state == PoolState::kWarm) warm.push_back(r);
      if (r->state == PoolState::kStarting) {
        (r->start_as == PoolState::kServing ? starting_serving : starting_warm)++;
      }
    }
    int need = target.serving - static_cast<int>(serving.size()) - starting_serving;
    int warm_after = static_cast<int>(warm.size()) + starting_warm;
    std::set<std::string> taken;
    if (need > 0) {
      std::sort(warm.begin(), warm.end(), MoreRecent);
      int promote = std::min<int>(need, static_cast<int>(warm.size()));
      for (int i = 0; i < promote; ++i) {
        out.push_back({PoolActionKind::kPromote, key, warm[i]->id});
        taken.insert(warm[i]->id);
      }
      warm_after -= promote;
      for (int i = promote; i < need; ++i) {
        out.push_back({PoolActionKind::kStart, key, "", PoolState::kServing});
      }
    } else if (need < 0) {
      std::sort(serving.begin(), serving.end(), LessRecent);
      for (int i = 0; i < -need && i < static_cast<int>(serving.size()); ++i) {
        if (warm_after < target.warm) {
          out.push_back({PoolActionKind::kDemote, key, serving[i]->id});
          warm_after++;
        } else {
          out.push_back({PoolActionKind::kDrain, key, serving[i]->id});
        }
      }
    }
    if (warm_after < target.warm) {
      for (int i = warm_after; i < target.warm; ++i) {
        out.push_back({PoolActionKind::kStart, key, "", PoolState::kWarm});
      }
    } else if (warm_after > target.warm) {
      std::sort(warm.begin(), warm.end(), LessRecent);
      int excess = warm_after - target.warm;
      for (const auto* r : warm) {
        if (excess == 0) break;
        if (taken.count(r->id)) continue;
        out.push_back({PoolActionKind::kDrain, key, r->id});
        excess--;
      }
    }
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> PlanEvictions(const std::vector<PoolReplica>& replicas,
                                                       int gpu, int64_t free_bytes,
                                                       int64_t needed_bytes) {
  std::vector<std::string> out;
  if (needed_bytes <= free_bytes) return out;
  std::vector<const PoolReplica*> warm;
  for (const auto& r : replicas) {
    if (r.gpu == gpu && r.state == PoolState::kWarm) warm.push_back(&r);
  }
  std::sort(warm.begin(), warm.end(), LessRecent);
  int64_t freed = free_bytes;
  for (const auto* r : warm) {
    if (freed >= needed_bytes) break;
    out.push_back(r->id);
    freed += r->gpu_memory_bytes;
  }
  if (freed < needed_bytes) {
    return absl::ResourceExhaustedError(
        "gpu " + std::to_string(gpu) + ": " + std::to_string(needed_bytes) + " bytes needed, " +
        std::to_string(freed) + " available even after evicting every WARM replica");
  }
  return out;
}

}  // namespace kiln
