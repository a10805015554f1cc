#pragma once

// The nodes the controller hears from, with a lease each: a node that has sent nothing (no
// Register, no NodeStatus) for `not_ready_after` is NotReady (no new replicas go there, its
// replicas are not routed to from elsewhere), and after `lost_after` it is Lost (its replicas
// are placed again elsewhere). Time comes from the caller, so the whole policy is tested with
// simulated time. Not thread-safe: the controller's loop owns it.

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kiln/v1/control_plane.pb.h"

namespace kiln {

enum class NodeHealth { kReady, kNotReady, kLost };
const char* NodeHealthName(NodeHealth h);

struct NodeRecord {
  v1::Register registration;
  v1::NodeStatus status;        // the newest
  bool has_status = false;
  absl::Time registered;
  absl::Time last_heard;
  bool connected = false;       // its stream is open now
};

class NodeRegistry {
 public:
  struct Options {
    absl::Duration not_ready_after = absl::Seconds(10);
    absl::Duration lost_after = absl::Seconds(30);
  };
  explicit NodeRegistry(Options options) : options_(options) {}

  // A Register replaces what was known of the node (an agent restart re-registers with the
  // replicas it adopted). INVALID_ARGUMENT names the field when it is unusable.
  absl::Status Register(const v1::Register& r, absl::Time now);
  // NOT_FOUND for a node that never registered on this controller.
  absl::Status ReportStatus(const std::string& node, v1::NodeStatus s, absl::Time now);
  // The same, swapping: `s` gets the node's previous status (for its memory to be reused).
  absl::Status SwapStatus(const std::string& node, v1::NodeStatus* s, absl::Time now);
  void Disconnected(const std::string& node);

  NodeHealth Health(const std::string& node, absl::Time now) const;
  // The same for a record of nodes() (no lookup).
  NodeHealth Health(const NodeRecord& record, absl::Time now) const;
  // When the next node goes NotReady or Lost if it stays silent (after `now`); the infinite
  // future when no node will. The loop wakes then, so a lease that ends is acted on at once
  // instead of at the next tick.
  absl::Time NextTransition(absl::Time now) const;
  const std::map<std::string, NodeRecord>& nodes() const { return nodes_; }
  // Forgets nodes Lost for longer than `forget_after` (their replicas were placed again), and
  // returns their records (the caller retires their replica ids and ends a stream still open:
  // a machine that died without closing its connection leaves one behind).
  std::vector<std::pair<std::string, NodeRecord>> Forget(absl::Time now,
                                                         absl::Duration forget_after);
  // Forgets one node now (an operator removing a node that will not come back) and returns its
  // record. NOT_FOUND for an unknown node, FAILED_PRECONDITION while its agent's stream is open
  // and its lease has not ended (a Lost node's open stream is a dead machine's).
  absl::StatusOr<NodeRecord> Remove(const std::string& node, absl::Time now);

 private:
  Options options_;
  std::map<std::string, NodeRecord> nodes_;
};

}  // namespace kiln
