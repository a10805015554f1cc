#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kiln/v1/control_plane.pb.h"

namespace kiln {

// What `kiln-agent --assignment-file FILE` runs: the same Assignment and RoutingTable the
// controller would send, written as YAML for a node that runs alone.
//
//   replicas:
//     - {id: enc-0, model: encoder, version: "2", repository: /models, gpu: 0, cpus: 2,
//        state: SERVING, threads: 0}
//   warmPools:
//     - {model: encoder, version: "2", repository: /models, size: 1, gpu: 0, cpus: 2}
//   routes:
//     - model: encoder
//       versions: [{version: "2", weight: 100}]
//       stickyKey: header:x-user-id
//
// `replicas` are run as written. A warm pool keeps `size` WARM replicas of its shape whose ids
// are the agent's own (`pool-...`, reserved): a replica added to the file takes one of them
// (promoted in place, the pool refilled behind it), and one removed joins its pool while the
// pool is short (see warm_pool/pool_plan.h).
struct FileWarmPool {
  v1::ReplicaSpec spec;  // what every member runs (state WARM, no id)
  int size = 0;
};

struct AssignmentFile {
  v1::Assignment assignment;  // the file's own replicas
  std::vector<FileWarmPool> pools;
  v1::RoutingTable routing;
};

// What makes two replicas interchangeable (model, version, repository, GPU, CPUs, GPU memory
// and runtime settings), as a key.
std::string ReplicaShape(const v1::ReplicaSpec& spec);
// The ids of a pool's members start with this; every pool member's id starts with "pool-".
std::string PoolIdPrefix(const v1::ReplicaSpec& spec);
bool IsPoolMemberId(const std::string& id);

// Parses and validates; every error names the field ("replicas[1].state: ...").
absl::StatusOr<AssignmentFile> ParseAssignmentFile(const std::string& yaml_text,
                                                   const std::string& source);
absl::StatusOr<AssignmentFile> LoadAssignmentFile(const std::string& path);

// Checks an Assignment (from a file or from the controller). Names the bad field.
absl::Status ValidateAssignment(const v1::Assignment& assignment);
absl::Status ValidateRoutingTable(const v1::RoutingTable& table);

}  // namespace kiln
