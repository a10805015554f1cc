#include "controller/placement.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string_view>
#include <tuple>
#include <unordered_map>

namespace kiln {

std::string_view DeploymentView(std::string_view replica_id) {
  size_t dot = replica_id.find('.');
  if (dot == std::string_view::npos || dot == 0) return {};
  return replica_id.substr(0, dot);
}

size_t& PlacementFreshIndexAfter() {
  static size_t after = 256;
  return after;
}

std::string DeploymentOfReplica(const std::string& replica_id) {
  return std::string(DeploymentView(replica_id));
}

namespace {

// One replica as the placement sees it: the union of the assignment and the report.
struct NodeState;

struct Existing {
  NodeState* ns = nullptr;  // where it runs
  // Model, version, gpu, cpus, state as assigned (the node's entry, not copied) or, for a
  // replica only reported, as reported.
  const v1::ReplicaSpec* assigned = nullptr;
  std::unique_ptr<v1::ReplicaSpec> reported_spec;  // only for a replica only reported
  const std::string* id = nullptr;  // its id where the input holds it (outlives Place)
  const v1::ReplicaSpec& spec() const { return assigned ? *assigned : *reported_spec; }
  v1::LifecycleState keep_as = v1::LIFECYCLE_STATE_UNSPECIFIED;  // SERVING or WARM when kept
  v1::LifecycleState reported = v1::LIFECYCLE_STATE_UNSPECIFIED;
  bool healthy = true;     // not crash-looping or FAILED: worth keeping
  bool ready = false;      // reported SERVING and passing its probe: taking traffic now
  int64_t gpu_memory = 0;  // max(reservation, reported use)
};

struct NodeState {
  const PlacementNode* node = nullptr;
  int index = 0;    // position in name order
  int zone_id = 0;  // nodes without a zone label are each their own zone
  int cpu_used = 0;
  std::vector<int64_t> gpu_used;  // by position in node->gpus
  // The node's assignment as placement goes: the input's own specs where a replica stays as
  // it was assigned, else specs placement made (copied into the result at the end; most of a
  // pass's replicas stay as they were, and copying each one made most of a pass's cost).
  std::vector<const v1::ReplicaSpec*> assignment;
};

// Replicas of one deployment per node and per zone, kept as placement goes: per node a short
// list (a deployment is on a few of thousands of nodes), per zone a vector (zones are few).
struct Spread {
  // (node index, replicas) while a few, a hash map once the deployment is on many nodes.
  static constexpr size_t kFew = 16;
  std::vector<std::pair<int, int>> few;
  std::unordered_map<int, int> many;
  std::vector<int> per_zone;
  int on(int node) const {
    if (!many.empty()) {
      auto it = many.find(node);
      return it == many.end() ? 0 : it->second;
    }
    for (const auto& [n, count] : few) {
      if (n == node) return count;
    }
    return 0;
  }
  void Add(int node) {
    if (!many.empty()) {
      many[node]++;
      return;
    }
    for (auto& [n, count] : few) {
      if (n == node) {
        count++;
        return;
      }
    }
    few.push_back({node, 1});
    if (few.size() > kFew) {
      for (const auto& [n, count] : few) many[n] = count;
      few.clear();
    }
  }
  void Remove(int node) {
    if (!many.empty()) {
      auto it = many.find(node);
      if (it != many.end() && --it->second == 0) many.erase(it);
      return;
    }
    for (size_t i = 0; i < few.size(); ++i) {
      if (few[i].first == node && --few[i].second == 0) {
        few.erase(few.begin() + static_cast<long>(i));
        return;
      }
    }
  }
};

// CPUs in a cpulist ("0-3,8" -> 5); 0 when it does not parse.
int CountCpus(const std::string& list) {
  int n = 0;
  size_t pos = 0;
  while (pos < list.size()) {
    size_t comma = list.find(',', pos);
    std::string part = list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    try {
      size_t dash = part.find('-');
      if (dash == std::string::npos) {
        (void)std::stoi(part);
        n += 1;
      } else {
        n += std::stoi(part.substr(dash + 1)) - std::stoi(part.substr(0, dash)) + 1;
      }
    } catch (...) {
      return 0;
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return n;
}

// Records the number of a `<deployment>.<n>` id as taken (ids of another shape are ignored).
void NoteIdInUse(const std::string& id, std::set<int>* used) {
  try {
    used->insert(std::stoi(id.substr(id.find('.') + 1)));
  } catch (...) {
  }
}

// The demands' (deployment, version) groups: for each demand, the position of the first one
// with the same deployment and version (demands come sorted by deployment).
std::vector<size_t> DemandGroups(const std::vector<PlacementDemand>& demands) {
  std::vector<size_t> group(demands.size());
  for (size_t i = 0; i < demands.size(); ++i) {
    group[i] = i;
    for (size_t j = i; j-- > 0 && demands[j].deployment == demands[i].deployment;) {
      if (demands[j].version == demands[i].version) group[i] = group[j];
    }
  }
  return group;
}

int GpuFromDevice(const std::string& device) {
  if (device.rfind("cuda:", 0) != 0) return -1;
  try {
    return std::stoi(device.substr(5));
  } catch (...) {
    return -1;
  }
}

}  // namespace

PlacementResult Place(const std::vector<PlacementDemand>& demands_in,
                      const std::vector<PlacementNode>& nodes,
                      const std::set<std::string>& retired_ids,
                      const std::map<std::string, std::string>& moves,
                      const std::set<std::string>& evicted, bool omit_unchanged) {
  PlacementResult out;
  std::deque<v1::ReplicaSpec> made;  // specs placement made or changed (addresses stay put)
  // Replicas this call placed new: one evicted again within the call never ran anywhere.
  std::set<std::string_view> placed_now;
  std::vector<PlacementDemand> demands = demands_in;
  // By deployment; a deployment's demands (stable, then canary) keep their order.
  std::stable_sort(demands.begin(), demands.end(),
                   [](const auto& a, const auto& b) { return a.deployment < b.deployment; });
  std::map<std::string, NodeState> state;
  // Keyed by views into the input's replica ids, which outlive this call.
  std::unordered_map<std::string_view, std::vector<Existing>> by_deployment;
  for (const PlacementNode& n : nodes) {
    NodeState& ns = state[n.name];
    ns.node = &n;
    ns.assignment.reserve(ns.assignment.size() + n.assigned.size() + n.reported.size());
    // A node runs a handful of replicas: a vector searched by id beats a map.
    std::vector<Existing> seen;
    seen.reserve(n.assigned.size() + n.reported.size());
    for (const v1::ReplicaSpec* assigned : n.assigned) {
      const v1::ReplicaSpec& spec = *assigned;
      Existing& e = seen.emplace_back();
      e.ns = &ns;
      e.assigned = &spec;
      e.id = &spec.replica_id();
      e.gpu_memory = spec.gpu_memory_bytes();
    }
    for (const v1::ReplicaStatus* reported : n.reported) {
      const v1::ReplicaStatus& rs = *reported;
      auto it = std::find_if(seen.begin(), seen.end(), [&](const Existing& e) {
        return e.spec().replica_id() == rs.replica_id();
      });
      if (it == seen.end()) {
        Existing e;
        e.ns = &ns;
        e.reported_spec = std::make_unique<v1::ReplicaSpec>();
        e.id = &rs.replica_id();
        v1::ReplicaSpec& spec = *e.reported_spec;
        spec.set_replica_id(rs.replica_id());
        spec.set_model(rs.model());
        spec.set_version(rs.version());
        spec.set_gpu(GpuFromDevice(rs.device()));
        spec.set_state(rs.state());
        spec.set_cpus(CountCpus(rs.cpus()));
        spec.set_gpu_memory_bytes(rs.gpu_memory_bytes());
        e.gpu_memory = rs.gpu_memory_bytes();
        seen.push_back(std::move(e));
        it = seen.end() - 1;
      }
      it->reported = rs.state();
      // Replaced only when it cannot recover where it is: a crash loop or FAILED. A replica
      // that is starting, or briefly failing its probe, is the agent's to restart, not ours
      // to move (it reports healthy=false while it loads).
      it->healthy = !rs.crash_loop() && rs.state() != v1::FAILED;
      it->ready = rs.state() == v1::SERVING && rs.healthy();
      it->gpu_memory = std::max(it->gpu_memory, rs.measured_gpu_memory_bytes());
    }
    for (Existing& e : seen) {
      std::string_view dep = DeploymentView(*e.id);
      if (!dep.empty()) by_deployment[dep].push_back(std::move(e));
    }
  }
  std::vector<NodeState*> order;  // by name (the map's order)
  std::map<std::string, int> zones;
  std::vector<bool> unlabelled_zone;  // by zone id: a node without a zone label
  std::vector<std::string> zone_names;  // by zone id: the label (empty when unlabelled)
  for (auto& [name, ns] : state) {
    ns.index = static_cast<int>(order.size());
    ns.gpu_used.assign(ns.node->gpus.size(), 0);
    order.push_back(&ns);
    std::string zone = ns.node->zone.empty() ? "node:" + name : ns.node->zone;
    auto [z, added] = zones.emplace(zone, static_cast<int>(zones.size()));
    ns.zone_id = z->second;
    if (added) {
      unlabelled_zone.push_back(ns.node->zone.empty());
      zone_names.push_back(ns.node->zone);
    }
  }
  // Per deployment, the nodes where one of its replicas crash-loops or FAILED: its new
  // replicas go elsewhere while another node has room (the fault may be the node's).
  std::unordered_map<std::string_view, std::vector<int>> crashed_on;
  for (const auto& [dep, replicas] : by_deployment) {
    for (const Existing& e : replicas) {
      if (!e.healthy) crashed_on[dep].push_back(e.ns->index);
    }
  }
  for (const NodeState* ns : order) {
    for (const std::string& dep : ns->node->crashed) crashed_on[dep].push_back(ns->index);
  }
  std::unordered_map<std::string, Spread> spread;
  auto spread_of = [&](const std::string& dep) -> Spread& {
    Spread& sp = spread[dep];
    if (sp.per_zone.empty()) sp.per_zone.assign(zones.size(), 0);
    return sp;
  };
  // `sp`: the deployment's spread, or null for a replica on its way out (it holds resources,
  // but new replicas should not avoid its node on its account).
  auto add = [&](NodeState& ns, const v1::ReplicaSpec* spec, int64_t gpu_memory, Spread* sp) {
    ns.cpu_used += spec->cpus();
    for (size_t i = 0; spec->gpu() >= 0 && i < ns.node->gpus.size(); ++i) {
      if (ns.node->gpus[i].index == spec->gpu()) ns.gpu_used[i] += gpu_memory;
    }
    if (sp) {
      sp->Add(ns.index);
      sp->per_zone[ns.zone_id]++;
    }
    ns.assignment.push_back(spec);
  };

  // Pass 1: every deployment keeps what it has, so pass 2 sees all the room already taken.
  // Per (deployment, version); ids are unique per deployment across its versions.
  struct Kept {
    int64_t serving = 0, warm = 0;
    std::set<std::string> lingering;  // WARM beyond the pool, kept after a scale-down
    int64_t new_serving = 0;  // SERVING replicas to start (short of the count, within surge)
    int64_t keep_moving = 0;  // moving replicas kept serving (they cover a shortfall)
    bool moving = false;      // some replica of it is moving
    std::vector<const Existing*> ready_kept;  // SERVING, taking traffic, staying
  };
  const std::vector<size_t> group = DemandGroups(demands);
  std::vector<Kept> kept(demands.size());  // by the demand's group
  auto existing_of = [&](const std::string& deployment) -> std::span<Existing> {
    auto it = by_deployment.find(deployment);
    return it == by_deployment.end() ? std::span<Existing>() : std::span<Existing>(it->second);
  };
  // The numbers a deployment's new replicas may not take: its replicas' and retired ones'.
  // Made when the deployment first places a replica (a steady tick places none).
  std::unordered_map<std::string_view, std::set<int>> ids_in_use;
  auto ids_of = [&](const std::string& deployment) -> std::set<int>& {
    auto [it, added] = ids_in_use.try_emplace(deployment);
    if (added) {
      for (const std::string& id : retired_ids) {
        if (DeploymentView(id) == deployment) NoteIdInUse(id, &it->second);
      }
      for (const Existing& e : existing_of(deployment)) NoteIdInUse(*e.id, &it->second);
    }
    return it->second;
  };
  // maxSurge and maxUnavailable are the deployment's, shared by its demands (its versions
  // during a rollout): what the stable version, first, uses of them the others do not get.
  const std::string* budget_of = nullptr;
  int64_t surge_left = 0, unavailable_left = 0;
  for (size_t di = 0; di < demands.size(); ++di) {
    const PlacementDemand& d = demands[di];
    if (budget_of == nullptr || *budget_of != d.deployment) {
      budget_of = &d.deployment;
      surge_left = d.max_surge;
      unavailable_left = d.max_unavailable;
    }
    std::vector<Existing*> mine;
    for (Existing& e : existing_of(d.deployment)) {
      // A replica whose CPUs or GPU kind no longer fit the spec is replaced (the agent
      // refuses to change a running replica's shape under the same id).
      bool same_shape = e.spec().cpus() == d.cpus && (e.spec().gpu() >= 0) == (d.gpus > 0);
      if (e.healthy && same_shape && e.spec().model() == d.model &&
          e.spec().version() == d.version && e.ns != nullptr &&
          (evicted.empty() || !evicted.count(e.spec().replica_id()))) {
        mine.push_back(&e);
      }
    }
    auto serving_now = [](const Existing& e) {
      v1::LifecycleState s = e.reported != v1::LIFECYCLE_STATE_UNSPECIFIED ? e.reported
                                                                            : e.spec().state();
      return s == v1::SERVING;
    };
    // On a GPU its node reports unhealthy, or no longer reports at all: to be moved.
    auto on_bad_gpu = [&](const Existing& e) {
      if (e.spec().gpu() < 0) return false;
      for (const auto& g : e.ns->node->gpus) {
        if (g.index == e.spec().gpu()) return !g.healthy;
      }
      return true;
    };
    // The replicas that stay, SERVING first (as reported, else as assigned), then by id; the
    // ones that move and take traffic now, by id. A moving replica not taking traffic goes.
    // A move the caller asked for (not forced by a bad GPU) is voluntary: it never leaves a
    // slot empty, and waits while its replica is briefly not ready.
    std::vector<Existing*> staying, moving;
    std::map<const Existing*, std::string> why;
    std::set<const Existing*> voluntary;
    for (Existing* e : mine) {
      // Moved when its GPU went bad (forced) or the caller asks (voluntary).
      const bool forced = on_bad_gpu(*e);
      auto asked = forced || moves.empty() ? moves.end() : moves.find(e->spec().replica_id());
      if (!forced && (asked == moves.end() || !e->ready)) {
        staying.push_back(e);
      } else if (e->ready) {
        moving.push_back(e);
        if (forced) {
          why[e] = "GPU " + std::to_string(e->spec().gpu()) + " (unhealthy)";
        } else {
          voluntary.insert(e);
          why[e] = "(" + asked->second + ")";
        }
      }
    }
    // SERVING first, then what the node was assigned before what it only still reports (a
    // replica already taken off the node, whose agent has not reported since, must not win its
    // slot back from its replacement), then by id.
    std::stable_sort(staying.begin(), staying.end(), [&](const Existing* a, const Existing* b) {
      bool sa = serving_now(*a), sb = serving_now(*b);
      if (sa != sb) return sa;
      bool aa = a->assigned != nullptr, ab = b->assigned != nullptr;
      if (aa != ab) return aa;
      return a->spec().replica_id() < b->spec().replica_id();
    });
    std::sort(moving.begin(), moving.end(), [&](const Existing* a, const Existing* b) {
      bool va = voluntary.count(a) > 0, vb = voluntary.count(b) > 0;
      if (va != vb) return va;
      return a->spec().replica_id() < b->spec().replica_id();
    });
    std::vector<Existing*> keep;
    int64_t serving = 0, warm = 0, ready = 0;
    std::set<std::string> lingering;
    for (Existing* e : staying) {
      if (serving < d.serving) {
        e->keep_as = v1::SERVING;
        serving++;
        ready += e->ready ? 1 : 0;
      } else if (warm < d.warm) {
        e->keep_as = v1::WARM;
        warm++;
      } else if (static_cast<int64_t>(lingering.size()) < d.linger &&
                 (e->assigned || !e->ns->node->assignment_known)) {
        // Scaled down: WARM for a while before it goes. Only one still assigned: one already
        // taken off its node (its agent may still report it) is never taken back. (A node not
        // sent an assignment yet, after a restart, took nothing off.)
        e->keep_as = v1::WARM;
        lingering.insert(e->spec().replica_id());
      } else {
        continue;  // beyond what is wanted: dropped (the agent drains it)
      }
      keep.push_back(e);
    }
    // Moving replicas stay while the staying ones that take traffic are too few: at least
    // `serving - maxUnavailable` must, counting the moving ones kept.
    // (Voluntary moves, sorted first, stay until their replacement serves, maxUnavailable or
    // not.)
    const int64_t keep_moving = std::max(
        std::clamp<int64_t>(d.serving - unavailable_left - ready, 0,
                            static_cast<int64_t>(moving.size())),
        std::min(static_cast<int64_t>(voluntary.size()), std::max<int64_t>(0, d.serving - ready)));
    std::set<const Existing*> leaving;
    for (int64_t i = 0; i < static_cast<int64_t>(moving.size()); ++i) {
      Existing* e = moving[i];
      std::string where = e->spec().replica_id() + " on " + e->ns->node->name + " " + why[e];
      if (i < keep_moving) {
        e->keep_as = v1::SERVING;
        keep.push_back(e);
        leaving.insert(e);
        out.moves.push_back(d.deployment + ": " + where + " serves until its replacement does");
      } else if (ready + keep_moving < d.serving) {
        out.moves.push_back(d.deployment + ": " + where +
                            " dropped before its replacement serves (maxUnavailable " +
                            std::to_string(d.max_unavailable) + " for the deployment)");
      }
    }
    for (Existing* e : keep) {
      // As assigned when nothing about it changes (the input's spec itself), else a new one.
      const v1::ReplicaSpec* spec = e->assigned;
      if (spec == nullptr || spec->state() != e->keep_as || spec->repository() != d.repository ||
          spec->gpu_memory_bytes() != d.gpu_memory_bytes) {
        v1::ReplicaSpec& changed = made.emplace_back(e->spec());
        changed.set_state(e->keep_as);
        changed.set_repository(d.repository);
        changed.set_gpu_memory_bytes(d.gpu_memory_bytes);
        spec = &changed;
      }
      add(*e->ns, spec, std::max(e->gpu_memory, d.gpu_memory_bytes),
          leaving.count(e) ? nullptr : &spread_of(d.deployment));
    }
    Kept& counts = kept[group[di]];
    counts.serving = serving;
    counts.warm = warm;
    counts.lingering = std::move(lingering);
    counts.keep_moving = keep_moving;
    counts.moving = !moving.empty();
    for (Existing* e : keep) {
      if (e->ready && e->keep_as == v1::SERVING && !leaving.count(e)) counts.ready_kept.push_back(e);
    }
    // New SERVING replicas this pass, within maxSurge of the wanted count (the moving ones
    // kept count against it).
    counts.new_serving = std::clamp<int64_t>(d.serving + surge_left - serving - keep_moving, 0,
                                             d.serving - serving);
    surge_left -= std::max<int64_t>(0, serving + keep_moving + counts.new_serving - d.serving);
    unavailable_left -= std::max<int64_t>(0, d.serving - ready - keep_moving);
    surge_left = std::max<int64_t>(0, surge_left);
    unavailable_left = std::max<int64_t>(0, unavailable_left);
  }
  // The room index for pass 2, per zone, in the placement key's order: each healthy GPU that
  // is not overloaded by its free memory, each node by its free CPUs (then load, node, GPU).
  using Slot = std::tuple<int64_t, double, int, int, size_t>;  // free, load, node, gpu, position
  constexpr double kLowest = -std::numeric_limits<double>::infinity();
  std::vector<std::set<Slot>> gpu_slots(zones.size()), cpu_slots(zones.size());
  auto slots_of = [&](const NodeState& ns, auto&& fn) {
    if (!ns.node->schedulable) return;
    fn(cpu_slots[ns.zone_id], Slot{ns.node->cpu_capacity - ns.cpu_used, ns.node->load, ns.index,
                                   -1, 0});
    for (size_t i = 0; i < ns.node->gpus.size(); ++i) {
      // Overloaded GPUs are left to the full scan, as a last resort.
      if (!ns.node->gpus[i].healthy || !ns.node->gpus[i].overloaded.empty()) continue;
      fn(gpu_slots[ns.zone_id], Slot{ns.node->gpus[i].memory_bytes - ns.gpu_used[i],
                                     ns.node->load, ns.index, ns.node->gpus[i].index, i});
    }
  };
  // While one demand places many replicas, its own copy of the index without the nodes that
  // run its deployment (the room index keeps them, and skipping them was quadratic: 3.3 s for
  // 5 deployments of 10,000 replicas on 10,000 nodes). Made once a search skips many nodes;
  // kept in step by index() and unindex() until the demand is done.
  struct FreshIndex {
    const Spread* of = nullptr;  // the deployment's spread while in use
    bool gpu = false;            // GPU slots (else CPU slots)
    std::vector<std::set<Slot>> zones;
  } fresh;
  auto mirror = [&](const NodeState& ns, bool insert) {
    if (fresh.of == nullptr || (insert && fresh.of->on(ns.index) != 0)) return;
    slots_of(ns, [&](std::set<Slot>& set, const Slot& slot) {
      const bool gpu_set = &set >= gpu_slots.data() && &set < gpu_slots.data() + gpu_slots.size();
      if (gpu_set != fresh.gpu) return;
      std::set<Slot>& mine = fresh.zones[ns.zone_id];
      if (insert) {
        mine.insert(slot);
      } else {
        mine.erase(slot);
      }
    });
  };
  auto index = [&](const NodeState& ns) {
    slots_of(ns, [](std::set<Slot>& set, const Slot& slot) { set.insert(slot); });
    mirror(ns, true);
  };
  auto unindex = [&](const NodeState& ns) {
    slots_of(ns, [](std::set<Slot>& set, const Slot& slot) { set.erase(slot); });
    mirror(ns, false);
  };
  bool indexed = false;  // built on first use: a steady tick places nothing
  const size_t kFreshAfter = PlacementFreshIndexAfter();  // skips before a demand's own index
  // What one replica of `d` needs of a slot: free memory on a GPU, or free CPUs.
  auto need_of = [](const PlacementDemand& d) { return d.gpus > 0 ? d.gpu_memory_bytes : d.cpus; };
  // Zone z's slots with room for one replica of `d`, in the index's order (tightest first).
  auto room_in = [&](const PlacementDemand& d, size_t z) {
    if (!indexed) {
      for (const NodeState* ns : order) index(*ns);
      indexed = true;
    }
    const std::set<Slot>& slots = d.gpus > 0 ? gpu_slots[z] : cpu_slots[z];
    return std::make_pair(slots.lower_bound(Slot{need_of(d), kLowest, -1, -1, -1}), slots.end());
  };
  const std::string* previous_deployment = nullptr;  // demands come sorted by deployment

  // What a kept or placed replica was charged on its GPU: as pass 1 charges it (its old
  // reservation or, only reported, the reported one; at least what it reports using and its
  // new reservation).
  auto charged_of = [](const NodeState& ns, const v1::ReplicaSpec& spec) {
    int64_t base = -1, measured = 0;
    for (const v1::ReplicaSpec* a : ns.node->assigned) {
      if (a->replica_id() == spec.replica_id()) base = a->gpu_memory_bytes();
    }
    for (const v1::ReplicaStatus* r : ns.node->reported) {
      if (r->replica_id() != spec.replica_id()) continue;
      if (base < 0) base = r->gpu_memory_bytes();
      measured = r->measured_gpu_memory_bytes();
    }
    return std::max({base, measured, spec.gpu_memory_bytes()});
  };
  auto idle_of = [](const NodeState& ns, const std::string& id) -> int64_t {
    for (const v1::ReplicaStatus* r : ns.node->reported) {
      if (r->replica_id() == id) return r->idle_ms();
    }
    return 0;  // placed but not reported yet: just made
  };
  using Key = std::tuple<int, int, int64_t, double, int, int>;
  // Added to a node's count of the deployment where the deployment crash-loops: any other
  // node with room wins.
  constexpr int kAvoided = 1 << 20;
  auto avoided = [&crashed_on](const std::string& deployment, int node) {
    if (crashed_on.empty()) return false;
    auto it = crashed_on.find(deployment);
    return it != crashed_on.end() &&
           std::find(it->second.begin(), it->second.end(), node) != it->second.end();
  };
  // Under GPU memory pressure SERVING outranks WARM: a new SERVING replica of `d` with no room
  // anywhere gets it by evicting WARM replicas of other deployments from one GPU, least
  // recently used first. Only GPU memory is freed this way: the node must have the CPUs
  // already (an agent keeps a replica's CPUs until it is gone, so CPUs freed by an eviction
  // could not be handed on in the same assignment). The spot that evicts the fewest replicas
  // wins, then the fewest bytes, then node and GPU order. Nothing is evicted when no spot can
  // be freed. The evicted replicas' deployments are short of their warm pool from now on
  // (refilled where there is room).
  auto evict_for = [&](const PlacementDemand& d) -> std::optional<Key> {
    if (d.gpus == 0) return std::nullopt;
    struct Plan {
      bool avoided = false;  // the deployment crash-loops on the node
      size_t count = 0;
      int64_t bytes = 0;
      int node = 0;
      int gpu = -1;
      std::vector<size_t> victims;  // positions in the node's assignment
    };
    std::optional<Plan> best;
    for (NodeState* nsp : order) {
      NodeState& ns = *nsp;
      const PlacementNode& n = *ns.node;
      if (!n.schedulable || ns.cpu_used + d.cpus > n.cpu_capacity) continue;
      // (idle desc, id) order: least recently used first.
      std::vector<std::tuple<int64_t, std::string, size_t>> warm;
      for (size_t pos = 0; pos < ns.assignment.size(); ++pos) {
        const v1::ReplicaSpec& spec = *ns.assignment[pos];
        if (spec.state() != v1::WARM || spec.gpu() < 0 ||
            DeploymentOfReplica(spec.replica_id()) == d.deployment) {
          continue;
        }
        warm.emplace_back(-idle_of(ns, spec.replica_id()), spec.replica_id(), pos);
      }
      if (warm.empty()) continue;
      std::sort(warm.begin(), warm.end());
      for (size_t gi = 0; gi < n.gpus.size(); ++gi) {
        if (!n.gpus[gi].healthy) continue;
        const int gpu = n.gpus[gi].index;
        int64_t memory_free = n.gpus[gi].memory_bytes - ns.gpu_used[gi];
        Plan p;
        p.avoided = avoided(d.deployment, ns.index);
        p.node = ns.index;
        p.gpu = gpu;
        for (const auto& [neg_idle, id, pos] : warm) {
          if (memory_free >= d.gpu_memory_bytes) break;
          const v1::ReplicaSpec& spec = *ns.assignment[pos];
          if (spec.gpu() != gpu) continue;
          const int64_t charged = charged_of(ns, spec);
          memory_free += charged;
          p.bytes += charged;
          p.victims.push_back(pos);
        }
        p.count = p.victims.size();
        if (p.count == 0 || memory_free < d.gpu_memory_bytes) continue;
        if (!best || std::tie(p.avoided, p.count, p.bytes, p.node, p.gpu) <
                         std::tie(best->avoided, best->count, best->bytes, best->node, best->gpu)) {
          best = std::move(p);
        }
      }
    }
    if (!best) return std::nullopt;
    NodeState& ns = *order[best->node];
    if (indexed) unindex(ns);
    std::sort(best->victims.rbegin(), best->victims.rend());  // erase from the back
    for (size_t pos : best->victims) {
      const v1::ReplicaSpec& spec = *ns.assignment[pos];
      const std::string dep = DeploymentOfReplica(spec.replica_id());
      const int64_t charged = charged_of(ns, spec);
      ns.cpu_used -= spec.cpus();
      for (size_t i = 0; i < ns.node->gpus.size(); ++i) {
        if (ns.node->gpus[i].index == spec.gpu()) ns.gpu_used[i] -= charged;
      }
      Spread& victim_spread = spread_of(dep);
      victim_spread.Remove(ns.index);
      victim_spread.per_zone[ns.zone_id]--;
      auto first = std::lower_bound(
          demands.begin(), demands.end(), dep,
          [](const PlacementDemand& a, const std::string& b) { return a.deployment < b; });
      for (auto it = first; it != demands.end() && it->deployment == dep; ++it) {
        if (it->version == spec.version()) {
          Kept& victim = kept[group[it - demands.begin()]];
          // A pool's replica: a lingering one of the deployment takes its place in the pool,
          // else the pool is short and refilled.
          if (!victim.lingering.erase(spec.replica_id())) {
            if (!victim.lingering.empty()) {
              victim.lingering.erase(victim.lingering.begin());
            } else {
              victim.warm--;
            }
          }
          break;
        }
      }
      // (One placed by this call never ran: no eviction to report, the warm pool is short.)
      if (!placed_now.count(spec.replica_id())) {
        out.evicted[spec.replica_id()] =
            spec.replica_id() + " (WARM, idle " +
            std::to_string(idle_of(ns, spec.replica_id()) / 1000) + " s) on " + ns.node->name +
            " GPU " + std::to_string(spec.gpu()) +
            " makes room for a SERVING replica of " + d.deployment;
      }
      ns.assignment.erase(ns.assignment.begin() + static_cast<long>(pos));
    }
    if (indexed) index(ns);
    return Key{0, 0, 0, ns.node->load, ns.index, best->gpu};
  };

  bool any_overloaded = false;
  for (const NodeState* ns : order) {
    for (const auto& g : ns->node->gpus) any_overloaded |= !g.overloaded.empty();
  }
  // Overloaded GPUs that already have a replica named to move off them this call, or moving.
  std::set<std::pair<int, int>> overload_claimed;  // (node index, gpu index)
  std::set<std::pair<int64_t, int64_t>> no_room_for;  // (GPU memory, CPUs) with no room left
  if (any_overloaded) {
    for (const NodeState* ns : order) {
      for (const v1::ReplicaSpec* spec : ns->assignment) {
        if (spec->gpu() >= 0 && moves.count(spec->replica_id())) {
          overload_claimed.insert({ns->index, spec->gpu()});
        }
      }
    }
  }

  // Pass 2: new replicas.
  for (size_t di = 0; di < demands.size(); ++di) {
    const PlacementDemand& d = demands[di];
    const bool first_of_deployment =
        previous_deployment == nullptr || *previous_deployment != d.deployment;
    previous_deployment = &d.deployment;
    Kept& counts = kept[group[di]];
    int64_t serving = counts.serving;
    int64_t warm = counts.warm;
    int next_id = 0;
    auto fresh_id = [&]() {
      std::set<int>& used_ids = ids_of(d.deployment);
      while (used_ids.count(next_id)) next_id++;
      used_ids.insert(next_id);
      return d.deployment + "." + std::to_string(next_id);
    };
    const int64_t new_serving = counts.new_serving;
    int64_t missing = new_serving + (d.warm - warm);
    // A node's best (node, gpu) for this demand now, by the documented order; lower tuples
    // win (the node index is the name order). Nothing when it has no room.
    Spread& sp = spread_of(d.deployment);
    auto key_of = [&](NodeState& ns, bool overloaded) -> std::optional<Key> {
      const PlacementNode& n = *ns.node;
      if (!n.schedulable || ns.cpu_used + d.cpus > n.cpu_capacity) return std::nullopt;
      // A node the deployment crash-loops on comes after every other node with room.
      int here = sp.on(ns.index) + (avoided(d.deployment, ns.index) ? kAvoided : 0);
      int zone_count = sp.per_zone[ns.zone_id];
      if (d.gpus == 0) {
        if (overloaded) return std::nullopt;  // CPU slots are never overloaded
        return Key{here, zone_count, n.cpu_capacity - ns.cpu_used - d.cpus, n.load, ns.index, -1};
      }
      std::optional<Key> best;
      for (size_t i = 0; i < n.gpus.size(); ++i) {
        const auto& g = n.gpus[i];
        if (!g.healthy || g.overloaded.empty() == overloaded) continue;
        int64_t left = g.memory_bytes - ns.gpu_used[i] - d.gpu_memory_bytes;
        if (left < 0) continue;
        Key k{here, zone_count, left, n.load, ns.index, g.index};
        if (!best || k < *best) best = k;
      }
      return best;
    };
    // The best spot on a node this deployment is not on yet, from the room index: per zone
    // the first slot (in the key's own order) that fits and whose node is free of the
    // deployment and has the CPUs; the zone with the fewest of the deployment wins. Nothing
    // when no zone has such a node (then every node is scanned: the key's first field, the
    // deployment's count on the node, decides).
    fresh.of = nullptr;  // this demand's own index, once it needs one
    fresh.zones.clear();
    auto best_fresh = [&]() -> std::optional<Key> {
      const int64_t need = need_of(d);
      size_t skipped = 0;
      for (;;) {  // again (once) with the demand's own index, after many skips
        const bool own = fresh.of == &sp;
        std::optional<Key> best;
        for (size_t z = 0; z < zones.size() && skipped <= kFreshAfter; ++z) {
          const int zone_count = sp.per_zone[z];
          if (best && std::get<1>(*best) < zone_count) continue;
          auto [it, end] = room_in(d, z);
          if (own) {
            it = fresh.zones[z].lower_bound(Slot{need, kLowest, -1, -1, -1});
            end = fresh.zones[z].end();
          }
          for (; it != end; ++it) {
            const NodeState& ns = *order[std::get<2>(*it)];
            const bool here = sp.on(ns.index) != 0;
            if (here || ns.cpu_used + d.cpus > ns.node->cpu_capacity ||
                avoided(d.deployment, ns.index)) {
              // (Only skips for the deployment's own nodes count: its index leaves out those.)
              if (here && !own && ++skipped > kFreshAfter) break;
              continue;
            }
            Key k{0, zone_count, std::get<0>(*it) - need, std::get<1>(*it), ns.index,
                  std::get<3>(*it)};
            if (!best || k < *best) best = k;
            break;
          }
        }
        if (own || skipped <= kFreshAfter) return best;
        // The nodes free of the deployment, in the room index's order.
        skipped = 0;
        fresh.of = &sp;
        fresh.gpu = d.gpus > 0;
        fresh.zones.assign(zones.size(), {});
        for (size_t z = 0; z < zones.size(); ++z) {
          for (const Slot& slot : fresh.gpu ? gpu_slots[z] : cpu_slots[z]) {
            if (sp.on(std::get<2>(slot)) == 0) fresh.zones[z].insert(fresh.zones[z].end(), slot);
          }
        }
      }
    };
    // Once no node free of the deployment has room, none will within this call (its count on a
    // node only grows): later replicas go straight to the full scan.
    bool fresh_exhausted = false;
    bool evict_exhausted = false;
    for (int64_t k = 0; k < missing; ++k) {
      bool as_serving = k < new_serving;
      std::optional<Key> best;
      if (!fresh_exhausted) {
        best = best_fresh();
        fresh_exhausted = !best.has_value();
      }
      // The full scan: GPUs that are not overloaded, then (only if none has room, and not for
      // a surge replacement of a moving replica, which may wait) those that are.
      const bool fill_overloaded =
          any_overloaded && (!as_serving || serving + counts.keep_moving < d.serving);
      for (bool overloaded : {false, true}) {
        if (best || (overloaded && !fill_overloaded)) break;
        for (NodeState* nsp : order) {
          auto key = key_of(*nsp, overloaded);
          if (key && (!best || *key < *best)) best = key;
        }
      }
      // Eviction only fills a SERVING slot that is empty (not one a moving replica still
      // serves: a move may wait for room), and stops once it found nothing to evict.
      if (!best && as_serving && !evict_exhausted &&
          serving + counts.keep_moving < d.serving) {
        best = evict_for(d);
        evict_exhausted = !best.has_value();
      }
      if (!best) continue;  // counted below, as the shortfall
      v1::ReplicaSpec& spec = made.emplace_back();
      spec.set_replica_id(fresh_id());
      placed_now.insert(spec.replica_id());  // a view into `made`, whose addresses stay put
      spec.set_model(d.model);
      spec.set_version(d.version);
      spec.set_repository(d.repository);
      spec.set_gpu(std::get<5>(*best));
      spec.set_cpus(static_cast<int32_t>(d.cpus));
      spec.set_state(as_serving ? v1::SERVING : v1::WARM);
      spec.set_gpu_memory_bytes(d.gpu_memory_bytes);
      NodeState& chosen = *order[std::get<4>(*best)];
      unindex(chosen);
      add(chosen, &spec, d.gpu_memory_bytes, &sp);
      index(chosen);
      if (as_serving) {
        serving++;
      } else {
        warm++;
      }
    }
    // Overload: at full strength with nothing moving, a replica serving on an overloaded GPU
    // when a GPU that is not overloaded has room for it (any zone). One per GPU per call.
    // (Once per deployment: its first demand, the stable version's.)
    bool overload_named = false;
    if (any_overloaded && d.gpus > 0 && first_of_deployment && serving == d.serving &&
        warm == d.warm && !counts.moving && d.max_surge > 0) {
      const Existing* from = nullptr;
      const PlacementNode::Gpu* hot = nullptr;
      // Moving a GPU's only SERVING replica cannot ease it (the load goes along).
      auto serving_on = [](const NodeState& ns, int gpu) {
        int n = 0;
        for (const v1::ReplicaSpec* spec : ns.assignment) {
          n += spec->gpu() == gpu && spec->state() == v1::SERVING;
        }
        return n;
      };
      for (const Existing* e : counts.ready_kept) {
        for (const auto& g : e->ns->node->gpus) {
          if (g.index != e->spec().gpu() || g.overloaded.empty() ||
              overload_claimed.count({e->ns->index, g.index}) || serving_on(*e->ns, g.index) < 2) {
            continue;
          }
          if (!from || e->spec().replica_id() > from->spec().replica_id()) {
            from = e;
            hot = &g;
          }
        }
      }
      // Once a shape found no room anywhere, it finds none again within this call.
      const auto shape = std::make_pair(d.gpu_memory_bytes, d.cpus);
      if (from && no_room_for.count(shape)) from = nullptr;
      for (size_t z = 0; from && z < zones.size() && !out.skewed.count(from->spec().replica_id());
           ++z) {
        for (auto [it, end] = room_in(d, z); it != end; ++it) {
          const NodeState& to = *order[std::get<2>(*it)];
          if (to.cpu_used + d.cpus > to.node->cpu_capacity) continue;
          out.skewed[from->spec().replica_id()] =
              "overloaded: " + from->ns->node->name + " GPU " + std::to_string(hot->index) +
              " (" + hot->overloaded + "); room on " + to.node->name + " GPU " +
              std::to_string(std::get<3>(*it));
          overload_claimed.insert({from->ns->index, hot->index});
          overload_named = true;
          break;
        }
      }
      if (from && !overload_named) no_room_for.insert(shape);
    }
    // Skew: at full strength with nothing moving, the node with the most of the deployment
    // against a node of its zone with room and at least two fewer.
    // (Once per deployment: its first demand, the stable version's.)
    // (Not while replicas a scale-down left WARM linger: they count where they are, and would
    // have replicas moved that the window's end then takes away.)
    if (first_of_deployment && serving == d.serving && warm == d.warm && !counts.moving &&
        d.max_surge > 0 && !counts.ready_kept.empty() && !overload_named &&
        counts.lingering.empty()) {
      const Existing* from = nullptr;
      int most = 0;
      for (const Existing* e : counts.ready_kept) {
        int here = sp.on(e->ns->index);
        if (here > most ||
            (here == most && from && e->spec().replica_id() > from->spec().replica_id())) {
          most = here;
          from = e;
        }
      }
      if (from && most >= 2) {
        // Its zone; nodes without a zone label count as one zone here (each is its own for
        // spreading new replicas).
        const std::string& label = from->ns->node->zone;
        for (size_t z = 0; z < zones.size() && !out.skewed.count(from->spec().replica_id());
             ++z) {
          if (label.empty() ? !unlabelled_zone[z] : static_cast<int>(z) != from->ns->zone_id) {
            continue;
          }
          for (auto [it, end] = room_in(d, z); it != end; ++it) {
            const NodeState& to = *order[std::get<2>(*it)];
            const int there = sp.on(to.index);
            if (there > most - 2 || to.cpu_used + d.cpus > to.node->cpu_capacity ||
                avoided(d.deployment, to.index)) {
              continue;
            }
            out.skewed[from->spec().replica_id()] =
                "spread: " + from->ns->node->name + " runs " + std::to_string(most) + " of " +
                d.deployment + ", " + to.node->name + " " + std::to_string(there);
            break;
          }
        }
      }
      // Across zones (labelled ones): the zone with the most of the deployment against a zone
      // with at least two fewer and a node free of it with room. A new replica goes to such a
      // node of the zone with the fewest (best_fresh), so the move always evens the zones out
      // and never swings back.
      const Existing* zone_from = nullptr;
      for (const Existing* e : counts.ready_kept) {
        if (e->ns->node->zone.empty()) continue;
        if (!zone_from ||
            std::make_tuple(sp.per_zone[e->ns->zone_id], sp.on(e->ns->index),
                            std::string_view(e->spec().replica_id())) >
                std::make_tuple(sp.per_zone[zone_from->ns->zone_id], sp.on(zone_from->ns->index),
                                std::string_view(zone_from->spec().replica_id()))) {
          zone_from = e;
        }
      }
      const int zone_most = zone_from ? sp.per_zone[zone_from->ns->zone_id] : 0;
      for (size_t z = 0; zone_from && zone_most >= 2 && z < zones.size() &&
                         !out.skewed.count(zone_from->spec().replica_id()) &&
                         !out.skewed.count(from ? from->spec().replica_id() : std::string());
           ++z) {
        if (unlabelled_zone[z] || static_cast<int>(z) == zone_from->ns->zone_id ||
            sp.per_zone[z] > zone_most - 2) {
          continue;
        }
        for (auto [it, end] = room_in(d, z); it != end; ++it) {
          const NodeState& to = *order[std::get<2>(*it)];
          if (sp.on(to.index) != 0 || to.cpu_used + d.cpus > to.node->cpu_capacity ||
              avoided(d.deployment, to.index)) {
            continue;
          }
          out.skewed[zone_from->spec().replica_id()] =
              "zones: " + zone_names[zone_from->ns->zone_id] + " runs " +
              std::to_string(zone_most) + " of " + d.deployment + ", " + zone_names[z] + " " +
              std::to_string(sp.per_zone[z]) + " (room on " + to.node->name + ")";
          break;
        }
      }
    }
    counts.serving = serving;
    counts.warm = warm;  // a later demand's evictions may still lower it
  }
  for (size_t di = 0; di < demands.size(); ++di) {
    const PlacementDemand& d = demands[di];
    // What is short of the wanted counts: serving slots that neither a replica nor a moving one
    // (still serving until its replacement does) fills, and the warm pool's gap.
    const Kept& counts = kept[group[di]];
    const int64_t unplaced =
        std::max<int64_t>(0, d.serving - counts.serving - counts.keep_moving) +
        std::max<int64_t>(0, d.warm - counts.warm);
    if (unplaced > 0) {
      out.unplaced.push_back(
          d.deployment + ": " + std::to_string(unplaced) + " of " +
          std::to_string(d.serving + d.warm) + " replicas have no node with room (" +
          (d.gpus > 0 ? std::to_string(d.gpu_memory_bytes) + " bytes of free GPU memory and "
                      : std::string()) +
          std::to_string(d.cpus) + " free CPUs needed)");
    }
  }
  // Each node's assignment by replica id; one that is exactly what the node was assigned
  // (the same specs, in that order) is only named when the caller asked for that.
  for (NodeState* ns : order) {
    std::sort(ns->assignment.begin(), ns->assignment.end(),
              [](const v1::ReplicaSpec* a, const v1::ReplicaSpec* b) {
                return a->replica_id() < b->replica_id();
              });
    if (omit_unchanged && ns->assignment == ns->node->assigned) {
      out.unchanged.push_back(ns->node->name);
      continue;
    }
    std::vector<v1::ReplicaSpec>& specs = out.nodes[ns->node->name];
    specs.reserve(ns->assignment.size());
    for (const v1::ReplicaSpec* spec : ns->assignment) specs.push_back(*spec);
  }
  return out;
}

}  // namespace kiln
