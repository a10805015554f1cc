#pragma once

#include <map>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "controller/store.h"

struct sqlite3;
struct sqlite3_stmt;

namespace kiln {

// The embedded store: one SQLite database (`DIR/kiln.db`) in WAL mode with synchronous
// commits, so a write that returned survives the controller being killed at any moment. Each
// write is one transaction (object row, resourceVersion counter and event together). The
// newest `event_retention` events are kept for watchers. Thread-safe.
class SqliteStore : public Store {
 public:
  struct Options {
    std::string state_dir;
    int64_t event_retention = 10000;
    // Operators' events (RecordEvent) kept: the newest this many.
    int64_t object_event_retention = 10000;
  };
  static absl::StatusOr<std::unique_ptr<SqliteStore>> Open(Options options, Clock* clock);
  ~SqliteStore() override;

  absl::StatusOr<StoredObject> Get(const std::string& kind, const std::string& name) override;
  absl::StatusOr<std::vector<StoredObject>> List(const std::string& kind) override;
  absl::StatusOr<StoredObject> Create(const std::string& kind, const std::string& name,
                                      const std::string& spec) override;
  absl::StatusOr<StoredObject> Update(const std::string& kind, const std::string& name,
                                      const std::string& spec,
                                      int64_t expected_resource_version) override;
  absl::StatusOr<StoredObject> UpdateStatus(const std::string& kind, const std::string& name,
                                            const std::string& status,
                                            int64_t expected_resource_version) override;
  absl::Status Delete(const std::string& kind, const std::string& name,
                      int64_t expected_resource_version) override;
  absl::StatusOr<int64_t> CurrentResourceVersion() override;
  absl::StatusOr<std::vector<WatchEvent>> EventsSince(int64_t resource_version,
                                                      int limit) override;
  bool WaitForChange(int64_t resource_version, absl::Duration timeout) override;
  // Kept in the database, the newest `object_event_retention` of them (older ones are pruned as
  // new ones come). A failed write is logged, never an error to the caller.
  void RecordEvent(const std::string& kind, const std::string& name, const std::string& type,
                   const std::string& reason, const std::string& message) override;
  absl::StatusOr<std::vector<ObjectEvent>> ListEvents(const std::string& kind,
                                                      const std::string& name,
                                                      int limit) override;

  const std::string& path() const { return path_; }

  // Prepared statements kept for reuse, by their SQL (sqlite_store.cc).
  struct Statement {
    sqlite3_stmt* stmt;
    bool in_use;
  };
  using Statements = std::map<std::string, Statement>;

 private:
  SqliteStore(Options options, Clock* clock, sqlite3* db, std::string path);
  absl::Status Exec(const std::string& sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<StoredObject> GetLocked(const std::string& kind, const std::string& name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<int64_t> MetaLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes `object` (or removes it when `deleted`) with the next resourceVersion and its event,
  // in one transaction.
  absl::StatusOr<StoredObject> CommitLocked(StoredObject object, WatchEvent::Type type)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckVersion(const StoredObject& current, int64_t expected) const;

  const Options options_;
  Clock* clock_;
  const std::string path_;
  absl::Mutex mu_;
  sqlite3* db_ ABSL_GUARDED_BY(mu_);
  int64_t current_rv_ ABSL_GUARDED_BY(mu_) = 0;
  Statements statements_ ABSL_GUARDED_BY(mu_);
  int64_t events_since_prune_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kiln
