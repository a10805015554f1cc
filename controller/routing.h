#pragma once

// The fleet's routing tables. A deployment's route names, per version, the nodes that serve
// it: one endpoint per node (its router balances among its own replicas), not one per replica.
// A node needs few of them: its own replicas come first, and the others only carry what it
// cannot serve itself. So nodes fall into `groups` groups by a hash of their name, and each
// group gets one table that lists, per version, at most `per_version` serving nodes chosen for
// that group by rendezvous hashing: stable as nodes come and go (a change reaches only the
// groups whose choice it touches), different per group, and all of them when fewer serve. So
// requests a node forwards go to at most groups x per_version (512) distinct serving nodes per
// version: above that, some serving nodes take only the traffic that arrives at their own
// ingress (load balancers in front of the nodes spread that). The table's size and the work
// per change no longer grow with the fleet: whole-state tables of every replica, sent to every
// node, grew with its square. Agents older than this table leave no endpoint out and could
// forward to their own ingress: upgrade agents before the controller.

#include <cstdint>
#include <string>
#include <vector>

#include "kiln/v1/control_plane.pb.h"

namespace kiln {

struct RoutingOptions {
  int groups = 64;
  int per_version = 8;
};

// One deployment's route: the versions' weights and sticky key (`head`, no endpoints) and the
// nodes serving it now.
struct RouteInput {
  v1::Route head;
  struct Serving {
    std::string node, version, grpc_address, http_address;
  };
  std::vector<Serving> serving;  // one entry per (node, version)
};

// The group a node belongs to (0 .. groups-1), from its name alone.
int RoutingGroupOf(const std::string& node, int groups);

// The route each group gets (index = group): `head` with at most `per_version` of the serving
// nodes per version, by node name. An endpoint's replica_id is "NODE/VERSION".
std::vector<v1::Route> GroupRoutes(const RouteInput& route, const RoutingOptions& options);

}  // namespace kiln
