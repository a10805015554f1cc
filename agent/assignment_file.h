#pragma once

#include <string>

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
struct AssignmentFile {
  v1::Assignment assignment;
  v1::RoutingTable routing;
};

// Parses and validates; every error names the field ("replicas[1].state: ...").
absl::StatusOr<AssignmentFile> ParseAssignmentFile(const std::string& yaml_text,
                                                   const std::string& source);
absl::StatusOr<AssignmentFile> LoadAssignmentFile(const std::string& path);

// Checks an Assignment (from a file or from the controller). Names the bad field.
absl::Status ValidateAssignment(const v1::Assignment& assignment);
absl::Status ValidateRoutingTable(const v1::RoutingTable& table);

}  // namespace kiln
