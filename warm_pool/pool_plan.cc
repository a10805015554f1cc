#include "warm_pool/pool_plan.h"

#include <algorithm>
#include <set>

namespace kiln {

namespace {

// Best to take over first: loaded before still starting, then the most recently used.
bool BetterToTake(const PoolRunning* a, const PoolRunning* b) {
  if (a->loaded != b->loaded) return a->loaded;
  if (a->last_used != b->last_used) return a->last_used > b->last_used;
  return a->id < b->id;
}

// First to let go: still starting before loaded, then the least recently used.
bool FirstToDrop(const PoolRunning* a, const PoolRunning* b) {
  if (a->loaded != b->loaded) return !a->loaded;
  if (a->last_used != b->last_used) return a->last_used < b->last_used;
  return a->id < b->id;
}

}  // namespace

PoolPlan PlanNodePools(const std::vector<PoolWanted>& wanted, const std::vector<PoolSpec>& pools,
                       const std::vector<PoolRunning>& running,
                       const std::map<int, int64_t>& gpu_memory_bytes,
                       const std::set<std::string>& reserved) {
  PoolPlan plan;
  std::set<std::string> wanted_ids, used_ids = reserved;
  for (const auto& w : wanted) wanted_ids.insert(w.id);
  used_ids.insert(wanted_ids.begin(), wanted_ids.end());
  std::map<std::string, const PoolRunning*> by_id;
  for (const auto& r : running) {
    by_id[r.id] = &r;
    used_ids.insert(r.id);
  }
  std::map<std::string, const PoolSpec*> pool_of;
  for (const auto& p : pools) pool_of[p.shape] = &p;

  // Pool members that may change hands or stay: running, a pool's own, not named by the file.
  std::map<std::string, std::vector<const PoolRunning*>> members;
  for (const auto& r : running) {
    if (r.pool_member && !wanted_ids.count(r.id)) members[r.shape].push_back(&r);
  }
  // Scale-up: a replica new to the file takes a member of its shape (not one crash-looping).
  for (const auto& w : wanted) {
    if (by_id.count(w.id) || reserved.count(w.id)) continue;
    auto& group = members[w.shape];
    auto best = group.end();
    for (auto it = group.begin(); it != group.end(); ++it) {
      if (!(*it)->crash_loop && (best == group.end() || BetterToTake(*it, *best))) best = it;
    }
    if (best == group.end()) continue;
    plan.renames[(*best)->id] = w.id;
    group.erase(best);
  }
  // Scale-down: a replica leaving the file joins its shape's pool while that is short.
  auto new_id = [&](const PoolSpec& p) {
    for (int n = 0;; ++n) {
      std::string id = p.id_prefix + std::to_string(n);
      if (used_ids.insert(id).second) return id;
    }
  };
  std::map<std::string, std::vector<std::string>> joined;  // shape -> new member ids
  std::vector<const PoolRunning*> leaving;
  for (const auto& r : running) {
    // A crash-looping one does not join: it could never be taken over, and would hold a
    // slot of the pool for good.
    if (!r.pool_member && !wanted_ids.count(r.id) && !r.crash_loop) leaving.push_back(&r);
  }
  std::sort(leaving.begin(), leaving.end(),
            [](const PoolRunning* a, const PoolRunning* b) { return a->id < b->id; });
  for (const PoolRunning* l : leaving) {
    const PoolRunning& r = *l;
    auto p = pool_of.find(r.shape);
    if (p == pool_of.end()) continue;
    size_t have = members[r.shape].size() + joined[r.shape].size();
    if (have >= static_cast<size_t>(std::max(0, p->second->size))) continue;
    std::string id = new_id(*p->second);
    plan.renames[r.id] = id;
    joined[r.shape].push_back(id);
  }
  // Each pool at its size: trimmed, or filled with new members.
  for (const auto& p : pools) {
    auto& group = members[p.shape];
    std::sort(group.begin(), group.end(), FirstToDrop);
    const size_t size = static_cast<size_t>(std::max(0, p.size));
    // Replicas join only while the existing members leave room for them.
    const size_t keep = std::min(group.size(), size - joined[p.shape].size());
    std::vector<std::string>& out = plan.members[p.shape];
    for (size_t i = group.size() - keep; i < group.size(); ++i) out.push_back(group[i]->id);
    for (const auto& id : joined[p.shape]) out.push_back(id);
    while (out.size() < size) out.push_back(new_id(p));
  }

  // GPU memory: the file's own replicas first; pool members give way, least recently used
  // (then not yet running) first.
  std::map<int, int64_t> demand;
  for (const auto& w : wanted) {
    if (w.gpu >= 0) demand[w.gpu] += w.gpu_memory_bytes;
  }
  struct Member {
    std::string id;
    std::string shape;
    int gpu;
    int64_t bytes;
    const PoolRunning* running;  // null: new, or a replica joining under a new id
  };
  std::map<std::string, std::string> renamed_from;
  for (const auto& [from, to] : plan.renames) renamed_from[to] = from;
  std::vector<Member> all;
  for (const auto& p : pools) {
    if (p.gpu < 0 || p.gpu_memory_bytes <= 0) continue;
    for (const auto& id : plan.members[p.shape]) {
      const PoolRunning* r = nullptr;
      if (auto it = by_id.find(id); it != by_id.end()) r = it->second;
      if (auto it = renamed_from.find(id); it != renamed_from.end()) r = by_id[it->second];
      all.push_back({id, p.shape, p.gpu, p.gpu_memory_bytes, r});
      demand[p.gpu] += p.gpu_memory_bytes;
    }
  }
  // Evict order: members not yet loaded (nothing lost) first, then the least recently used.
  std::sort(all.begin(), all.end(), [](const Member& a, const Member& b) {
    bool a_warm = a.running && a.running->loaded, b_warm = b.running && b.running->loaded;
    if (a_warm != b_warm) return !a_warm;
    if (a_warm && a.running->last_used != b.running->last_used) {
      return a.running->last_used < b.running->last_used;
    }
    return a.id < b.id;
  });
  for (const auto& m : all) {
    auto cap = gpu_memory_bytes.find(m.gpu);
    if (cap == gpu_memory_bytes.end() || demand[m.gpu] <= cap->second) continue;
    demand[m.gpu] -= m.bytes;
    auto& ids = plan.members[m.shape];
    ids.erase(std::remove(ids.begin(), ids.end(), m.id), ids.end());
    plan.evicted.push_back(m.id);
    // A replica that was to join the pool under this id drains instead.
    if (auto it = renamed_from.find(m.id); it != renamed_from.end()) plan.renames.erase(it->second);
  }
  return plan;
}

}  // namespace kiln
