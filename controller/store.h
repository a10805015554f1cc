#pragma once

// The controller's desired-state store: objects by (kind, name) with a spec the user owns and a
// status the controller owns, Kubernetes-style. Every write bumps one store-wide
// resourceVersion; a spec change also bumps the object's generation. Writers that pass the
// resourceVersion they read get optimistic concurrency (ABORTED on a conflict, HTTP 409).
// Every change is an event a watcher can read back from a resourceVersion on.
//
// Backends: the embedded SQLite store here; a Kubernetes store later, behind the same
// interface.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kiln {

struct StoredObject {
  std::string kind;
  std::string name;
  std::string uid;
  int64_t generation = 0;        // bumped when the spec changes
  int64_t resource_version = 0;  // the store-wide version of this object's last write
  int64_t created_unix_micros = 0;
  std::string spec;    // JSON text
  std::string status;  // JSON text ("{}" until the controller writes one)
};

struct WatchEvent {
  enum class Type { kAdded, kModified, kDeleted };
  Type type = Type::kAdded;
  int64_t resource_version = 0;
  StoredObject object;  // for kDeleted: the object as it was last
};
const char* WatchEventTypeName(WatchEvent::Type t);

// What the controller did to an object and why, for operators (Kubernetes' core/v1 Event).
struct ObjectEvent {
  std::string kind;
  std::string name;
  std::string type;    // Normal or Warning
  std::string reason;  // CamelCase: RolloutStep, RolledBack, FailedPlacement, ...
  std::string message;
  int64_t unix_micros = 0;
};

class Store {
 public:
  virtual ~Store() = default;

  // NOT_FOUND when absent.
  virtual absl::StatusOr<StoredObject> Get(const std::string& kind, const std::string& name) = 0;
  // Sorted by name.
  virtual absl::StatusOr<std::vector<StoredObject>> List(const std::string& kind) = 0;
  // ALREADY_EXISTS when present. Generation 1.
  virtual absl::StatusOr<StoredObject> Create(const std::string& kind, const std::string& name,
                                              const std::string& spec) = 0;
  // Replaces the spec. `expected_resource_version` 0 writes unconditionally; otherwise a
  // different current version is ABORTED. An identical spec changes nothing and returns the
  // object as it is.
  virtual absl::StatusOr<StoredObject> Update(const std::string& kind, const std::string& name,
                                              const std::string& spec,
                                              int64_t expected_resource_version) = 0;
  // Replaces the status; the generation stays.
  virtual absl::StatusOr<StoredObject> UpdateStatus(const std::string& kind,
                                                    const std::string& name,
                                                    const std::string& status,
                                                    int64_t expected_resource_version) = 0;
  virtual absl::Status Delete(const std::string& kind, const std::string& name,
                              int64_t expected_resource_version) = 0;

  // The newest resourceVersion in the store.
  virtual absl::StatusOr<int64_t> CurrentResourceVersion() = 0;
  // Changes after `resource_version`, oldest first, at most `limit`. OUT_OF_RANGE (HTTP 410)
  // when events that old were compacted away: the watcher must list again.
  virtual absl::StatusOr<std::vector<WatchEvent>> EventsSince(int64_t resource_version,
                                                              int limit) = 0;
  // Blocks until the store moves past `resource_version` or `timeout` passes (changes made
  // through this Store object wake it at once); true when it has.
  virtual bool WaitForChange(int64_t resource_version, absl::Duration timeout) = 0;

  // An event about an object for operators (type Normal or Warning, a CamelCase reason):
  // rollout steps, rollbacks, placement failures. The Kubernetes store records a core/v1
  // Event; the embedded store keeps the newest kMaxObjectEvents in its database.
  virtual void RecordEvent(const std::string& kind, const std::string& name,
                           const std::string& type, const std::string& reason,
                           const std::string& message) = 0;
  // Events about `kind`/`name` (every object of `kind` when `name` is empty): the newest
  // `limit`, oldest first.
  virtual absl::StatusOr<std::vector<ObjectEvent>> ListEvents(const std::string& kind,
                                                              const std::string& name,
                                                              int limit) = 0;
};

}  // namespace kiln
