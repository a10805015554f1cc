#include "controller/routing.h"

#include <algorithm>
#include <map>

#include "common/hash.h"

namespace kiln {

namespace {

// FNV-1a over the strings (each closed by a 0xff byte, so ("ab", "c") differs from ("a", "bc")),
// then a final mix so that nearby inputs spread over the whole range.
uint64_t Hash(const std::string& a, const std::string& b = "") {
  uint64_t h = kFnv1aOffset;
  for (const std::string* s : {&a, &b}) h = Fnv1a64("\xff", Fnv1a64(*s, h));
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  return h;
}

}  // namespace

int RoutingGroupOf(const std::string& node, int groups) {
  return groups <= 1 ? 0 : static_cast<int>(Hash(node) % static_cast<uint64_t>(groups));
}

std::vector<v1::Route> GroupRoutes(const RouteInput& in, const RoutingOptions& options) {
  const int groups = std::max(1, options.groups);
  const size_t per_version = static_cast<size_t>(std::max(1, options.per_version));
  std::vector<v1::Route> out(groups, in.head);
  // Per version, its serving nodes in name order.
  std::map<std::string, std::vector<const RouteInput::Serving*>> by_version;
  for (const auto& s : in.serving) by_version[s.version].push_back(&s);
  for (auto& [version, list] : by_version) {
    std::sort(list.begin(), list.end(),
              [](const auto* a, const auto* b) { return a->node < b->node; });
  }
  for (int g = 0; g < groups; ++g) {
    v1::Route& route = out[g];
    route.clear_endpoints();
    const std::string seed = "group:" + std::to_string(g) + "/";
    for (const auto& [version, list] : by_version) {
      std::vector<const RouteInput::Serving*> chosen = list;
      if (chosen.size() > per_version) {
        // Rendezvous: the nodes with the highest hash of (group, version, node).
        std::vector<std::pair<uint64_t, const RouteInput::Serving*>> scored;
        scored.reserve(list.size());
        for (const auto* s : list) scored.push_back({Hash(seed + version, s->node), s});
        std::partial_sort(scored.begin(), scored.begin() + per_version, scored.end(),
                          [](const auto& a, const auto& b) {
                            return a.first != b.first ? a.first > b.first
                                                      : a.second->node < b.second->node;
                          });
        chosen.clear();
        for (size_t i = 0; i < per_version; ++i) chosen.push_back(scored[i].second);
        std::sort(chosen.begin(), chosen.end(),
                  [](const auto* a, const auto* b) { return a->node < b->node; });
      }
      for (const auto* s : chosen) {
        auto* e = route.add_endpoints();
        e->set_replica_id(s->node + "/" + s->version);
        e->set_version(s->version);
        e->set_node_name(s->node);
        e->set_grpc_address(s->grpc_address);
        e->set_http_address(s->http_address);
      }
    }
  }
  return out;
}

}  // namespace kiln
