#include "controller/node_registry.h"

#include <set>

namespace kiln {

const char* NodeHealthName(NodeHealth h) {
  switch (h) {
    case NodeHealth::kReady:
      return "Ready";
    case NodeHealth::kNotReady:
      return "NotReady";
    default:
      return "Lost";
  }
}

absl::Status NodeRegistry::Register(const v1::Register& r, absl::Time now) {
  if (r.node_name().empty() || r.node_name().size() > 253) {
    return absl::InvalidArgumentError("register.node_name: must be 1-253 characters");
  }
  if (r.cpu_capacity() < 0) {
    return absl::InvalidArgumentError("register.cpu_capacity: must be >= 0");
  }
  std::set<int> indexes;
  for (int i = 0; i < r.gpus_size(); ++i) {
    const auto& g = r.gpus(i);
    std::string f = "register.gpus[" + std::to_string(i) + "]";
    if (g.index() < 0 || !indexes.insert(g.index()).second) {
      return absl::InvalidArgumentError(f + ".index: must be unique and >= 0, got " +
                                        std::to_string(g.index()));
    }
    if (g.memory_bytes() < 0) {
      return absl::InvalidArgumentError(f + ".memory_bytes: must be >= 0");
    }
  }
  NodeRecord& n = nodes_[r.node_name()];
  n.registration = r;
  n.status = v1::NodeStatus();
  // The replicas it re-adopted count as its status until the first NodeStatus.
  for (const auto& rep : r.replicas()) *n.status.add_replicas() = rep;
  n.has_status = r.replicas_size() > 0;
  n.registered = now;
  n.last_heard = now;
  n.connected = true;
  return absl::OkStatus();
}

absl::Status NodeRegistry::ReportStatus(const std::string& node, v1::NodeStatus s,
                                        absl::Time now) {
  return SwapStatus(node, &s, now);
}

absl::Status NodeRegistry::SwapStatus(const std::string& node, v1::NodeStatus* s,
                                      absl::Time now) {
  auto it = nodes_.find(node);
  if (it == nodes_.end()) {
    return absl::NotFoundError("node '" + node + "' sent status before registering");
  }
  it->second.status.Swap(s);
  it->second.has_status = true;
  it->second.last_heard = now;
  return absl::OkStatus();
}

void NodeRegistry::Disconnected(const std::string& node) {
  auto it = nodes_.find(node);
  if (it != nodes_.end()) it->second.connected = false;
}

NodeHealth NodeRegistry::Health(const std::string& node, absl::Time now) const {
  auto it = nodes_.find(node);
  if (it == nodes_.end()) return NodeHealth::kLost;
  return Health(it->second, now);
}

NodeHealth NodeRegistry::Health(const NodeRecord& record, absl::Time now) const {
  absl::Duration silent = now - record.last_heard;
  if (silent >= options_.lost_after) return NodeHealth::kLost;
  if (silent >= options_.not_ready_after) return NodeHealth::kNotReady;
  return NodeHealth::kReady;
}

absl::Time NodeRegistry::NextTransition(absl::Time now) const {
  absl::Time next = absl::InfiniteFuture();
  for (const auto& [name, rec] : nodes_) {
    for (absl::Duration after : {options_.not_ready_after, options_.lost_after}) {
      const absl::Time at = rec.last_heard + after;
      if (at > now && at < next) next = at;
    }
  }
  return next;
}

std::vector<std::pair<std::string, NodeRecord>> NodeRegistry::Forget(
    absl::Time now, absl::Duration forget_after) {
  std::vector<std::pair<std::string, NodeRecord>> gone;
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    if (now - it->second.last_heard >= options_.lost_after + forget_after) {
      gone.emplace_back(it->first, std::move(it->second));
      it = nodes_.erase(it);
    } else {
      ++it;
    }
  }
  return gone;
}

absl::StatusOr<NodeRecord> NodeRegistry::Remove(const std::string& node, absl::Time now) {
  auto it = nodes_.find(node);
  if (it == nodes_.end()) return absl::NotFoundError("node '" + node + "' is not known");
  if (it->second.connected && Health(node, now) != NodeHealth::kLost) {
    return absl::FailedPreconditionError(
        "node '" + node + "' is connected and reporting: its agent is running; stop it first");
  }
  NodeRecord record = std::move(it->second);
  nodes_.erase(it);
  return record;
}

}  // namespace kiln
