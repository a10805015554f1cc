#pragma once

// Placement: a pure, deterministic function from what is wanted (per deployment: how many
// SERVING and WARM replicas of which version, with what resources) and what is observed (the
// ready nodes, their capacity and the replicas they report) to each node's whole assignment.
//
// - Replicas stay where they are unless they crash-loop or FAILED (a loading or briefly
//   unhealthy replica is the agent's to restart). Of a deployment's existing replicas of the wanted
//   version, SERVING ones are kept SERVING first, then WARM ones are promoted to fill the
//   SERVING count (a promote beats a cold start), then the rest stay WARM up to the warm pool;
//   extra replicas are dropped (WARM first).
// - New replicas go to a ready node with room (CPUs; for GPU replicas a healthy GPU with
//   enough free memory, counting each replica at the larger of its reservation and what it
//   reports using), preferring, in order: fewer replicas of the deployment on the node, then
//   in the node's zone (spread), then the best fit (least memory or CPUs left), then low load,
//   then the node name and GPU index (determinism). A node where a replica of the deployment
//   crash-loops or FAILED comes after every other node with room, for new replicas and for
//   evictions (the fault may be the node's); with no other room it is used all the same.
// - Replica ids are `<deployment>.<n>`, n the smallest number not in use by the deployment.
// - Rebalancing, make-before-break: a replica on a GPU the node reports unhealthy (or no longer
//   reports) is moved. While it serves, it keeps its SERVING slot and a replacement is placed
//   beside the wanted count (at most `max_surge` such extra replicas per demand); once the
//   replacement reports SERVING it takes the slot and the old replica is dropped (the agent
//   drains it). Up to `max_unavailable` serving replicas may instead be dropped before their
//   replacement serves, counting slots already held by replicas not yet serving. A moving
//   replica that does not serve (WARM, loading) is dropped at once: it costs no capacity.
//   maxSurge bounds SERVING replicas only: a warm pool emptied by a move (its replicas
//   promoted as replacements) is refilled at once. Both bounds are the deployment's: its
//   demands (the versions of a rollout) share them, the first demand (the stable version)
//   using them first.
// - Skew: a deployment at full strength whose replicas pile up on one node (at least two more
//   there than on another node of the zone with room for one) gets one of them named in
//   `skewed`. Placement keeps no memory: the caller decides whether to move it and then passes
//   it in `moves` on every call until it is gone, so the move runs make-before-break exactly
//   like one off an unhealthy GPU and is not undone when the skew it fixes disappears while
//   the replacement loads. Zones (labelled ones) are evened out the same way: failing a node to
//   even out, the zone with the most of the deployment names one of its replicas when a zone
//   with at least two fewer has a node free of the deployment with room (where a new replica
//   then goes, so the move never swings back).
// - Overload: an overloaded GPU takes new replicas only when no other GPU has room, and a
//   deployment at full strength with a replica serving there (nothing of it moving) names one
//   in `skewed` when a GPU that is not overloaded has room for it; one per overloaded GPU at a
//   time (none while a replica on it moves). The caller moves it as it moves skew.
// - GPU memory pressure: SERVING outranks WARM. A new GPU replica for an empty SERVING slot
//   with no room anywhere evicts WARM replicas of other deployments from one GPU of a node
//   with the CPUs free, least recently used first (`idle_ms` as reported), choosing the GPU
//   that evicts the fewest. WARM replicas, CPU replicas and replacements of moving replicas
//   (still serving) never evict anything.

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/v1/control_plane.pb.h"

namespace kiln {

struct PlacementNode {
  std::string name;
  std::string zone;  // from the node's labels; empty = its own zone
  int cpu_capacity = 0;
  struct Gpu {
    int index = 0;
    int64_t memory_bytes = 0;
    bool healthy = true;
    // Why the caller judges the GPU overloaded (busy with requests waiting, or throttling);
    // empty when it is not.
    std::string overloaded;
  };
  std::vector<Gpu> gpus;
  // What the controller last assigned to the node (replicas it may not report yet) and what
  // the node reports running (after a controller restart, the only source). The caller's
  // records, not copies (the controller's loop would otherwise copy every replica of every
  // node each tick): they must outlive the call.
  std::vector<const v1::ReplicaSpec*> assigned;
  std::vector<const v1::ReplicaStatus*> reported;
  // Deployments a replica of which crash-looped or FAILED here recently (the caller's memory:
  // the replica itself is gone from the reports soon after it is replaced). Treated as a
  // crash-looping replica is: new replicas and skew moves go elsewhere while there is room.
  std::vector<std::string> crashed;
  // False until the caller has sent the node an assignment (after a controller restart, what
  // the node reports is all there is: a replica only reported was not taken off it).
  bool assignment_known = true;
  double load = 0;                          // requests in flight on the node
  // False for a NotReady node: its replicas still count (the node may come back within the
  // grace), but nothing new goes there. Lost nodes are left out altogether.
  bool schedulable = true;
};

struct PlacementDemand {
  std::string deployment;  // the ModelDeployment's name (a DNS label: no '.')
  std::string model;
  std::string version;
  std::string repository;  // the model repository on the nodes
  int64_t serving = 0;
  int64_t warm = 0;
  int64_t gpus = 0;  // 0 or 1
  int64_t gpu_memory_bytes = 0;
  int64_t cpus = 1;
  // Replicas beyond `serving` while replicas move, and serving slots that may go empty.
  int64_t max_surge = 1;
  int64_t max_unavailable = 0;
  // Scale-down to WARM first: up to this many existing replicas beyond `serving` and `warm`
  // stay, WARM (loaded, not routed), instead of being dropped; none is started for it, and
  // they count as WARM replicas for evictions (least recently used first).
  int64_t linger = 0;
};

struct PlacementResult {
  // Every ready node's whole assignment (nodes with nothing to run get an empty list).
  std::map<std::string, std::vector<v1::ReplicaSpec>> nodes;
  // One line per demand (a deployment's version) that could not get all its replicas, starting
  // "<deployment>: ": how many and why.
  std::vector<std::string> unplaced;
  // One line per replica being moved ("deployment: ..."), while it is.
  std::vector<std::string> moves;
  // Replicas that could move to even out their deployment or off an overloaded GPU (at most
  // one per deployment), with why ("spread: sim-3 runs 3 of enc, sim-7 1").
  std::map<std::string, std::string> skewed;
  // With `omit_unchanged`: the nodes whose whole assignment is exactly what they were
  // assigned (`PlacementNode::assigned`, the same specs in the same order), left out of
  // `nodes`.
  std::vector<std::string> unchanged;
  // WARM replicas evicted by this call to make room for SERVING ones (id -> what happened).
  // The caller passes them back in `evicted` until no node runs them.
  std::map<std::string, std::string> evicted;
};

// `retired_ids`: ids not to give to new replicas (those on Lost nodes, which may come back).
// `moves`: replicas to move make-before-break (id -> why), as off an unhealthy GPU.
// `evicted`: replicas evicted earlier that a node may still report: never kept again.
// `omit_unchanged`: a node whose assignment stays exactly as assigned is named in `unchanged`
// instead of copied into `nodes` (the controller's loop sends nothing to such a node; most
// nodes in a pass).
PlacementResult Place(const std::vector<PlacementDemand>& demands,
                      const std::vector<PlacementNode>& ready_nodes,
                      const std::set<std::string>& retired_ids = {},
                      const std::map<std::string, std::string>& moves = {},
                      const std::set<std::string>& evicted = {}, bool omit_unchanged = false);

// Test seam: how many of its own deployment's nodes one search for a free node may skip before
// the demand gets its own index of the nodes free of it (placement.cc; 256). Placement's result
// is the same either way.
size_t& PlacementFreshIndexAfter();

// The deployment a replica id belongs to ("encoder.3" -> "encoder"); empty if not ours.
std::string DeploymentOfReplica(const std::string& replica_id);
// The same without a copy: a view into `replica_id`.
std::string_view DeploymentView(std::string_view replica_id);

}  // namespace kiln
