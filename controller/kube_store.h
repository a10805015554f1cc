#pragma once

// The Store on the Kubernetes API: ModelDeployments are custom objects
// (serving.kiln.dev/v1alpha1) in one namespace. Reads come from a cache kept by list-then-watch
// (resourceVersion, bookmarks); a 410 Gone relists, a broken or ended stream watches again
// from the last version seen, so no change is missed, and a change is applied only when its
// version is newer than the cached object's, so none is applied twice. Writes go to the API
// (409 on a stale resourceVersion -> ABORTED: the caller re-reads and retries), the status
// through the status subresource, and land in the cache at once (read your own writes).
// spec.replicas set through the scale subresource arrives like any other spec change.

#include <deque>
#include <map>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "controller/kube_client.h"
#include "controller/store.h"

namespace kiln {

class KubernetesStore : public Store {
 public:
  struct Options {
    absl::Duration watch_timeout = absl::Minutes(5);  // the server ends each watch after this
    absl::Duration retry = absl::Seconds(1);          // pause before a watch or list again
    absl::Duration sync_timeout = absl::Seconds(30);  // Open waits this long for the first list
    size_t history = 10000;                           // changes kept for EventsSince
    size_t event_queue = 1000;  // core/v1 Events waiting to be posted; beyond, the oldest go
  };

  // Lists once (failing if the API cannot be reached within sync_timeout), then keeps the
  // cache current from a background thread.
  static absl::StatusOr<std::unique_ptr<KubernetesStore>> Open(KubeConfig config, Options options);
  ~KubernetesStore() override;

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
  absl::StatusOr<std::vector<WatchEvent>> EventsSince(int64_t resource_version, int limit) override;
  bool WaitForChange(int64_t resource_version, absl::Duration timeout) override;
  void RecordEvent(const std::string& kind, const std::string& name, const std::string& type,
                   const std::string& reason, const std::string& message) override;
  // The namespace's Events about ModelDeployments (from the API server: every controller's,
  // this one's still queued aside), filtered here.
  absl::StatusOr<std::vector<ObjectEvent>> ListEvents(const std::string& kind,
                                                      const std::string& name,
                                                      int limit) override;

  KubeClient* client() { return &client_; }
  int64_t lists() const;           // full lists so far (1 + relists)
  int64_t watches() const;         // watch streams opened
  int64_t applied_changes() const; // watch events that changed the cache
  int64_t events_dropped() const;  // Events dropped because the queue was full

 private:
  KubernetesStore(KubeConfig config, Options options);
  std::string Collection() const;
  absl::Status ListOnce();
  void Loop();
  // Applies an object the API returned (a write's answer or a watch event) if newer. Returns
  // what the cache holds under its name afterwards (null when unreadable or deleted).
  const StoredObject* ApplyLocked(WatchEvent::Type type, const nlohmann::json& object)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Posts queued Events one by one (RecordEvent only queues: the controller's loop never
  // waits for the API server); on shutdown, what is queued gets a last try.
  void EventLoop();
  void PostEvent(const nlohmann::json& body);
  absl::Status CheckKind(const std::string& kind) const;
  // PUTs `body` to `path` (the object `name` or its status) at the object's current version.
  absl::StatusOr<StoredObject> PutAtCurrentVersion(const std::string& name, const std::string& path,
                                                   nlohmann::json* body, const std::string& what);
  absl::StatusOr<StoredObject> FinishWrite(const absl::StatusOr<KubeResponse>& r,
                                           const std::string& what);

  const Options options_;
  KubeClient client_;
  mutable absl::Mutex mu_;
  struct Cached {
    StoredObject stored;    // what Get and List return
    nlohmann::json object;  // the object as served (status writes send it back whole)
  };
  std::map<std::string, Cached> cache_ ABSL_GUARDED_BY(mu_);
  int64_t rv_ ABSL_GUARDED_BY(mu_) = 0;       // the newest version seen (list, event, bookmark)
  // Where the watch goes on from: the last list's version, or the newest event or bookmark the
  // watch delivered. Not this store's own writes, which can be newer than events not yet seen.
  int64_t watch_rv_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<WatchEvent> history_ ABSL_GUARDED_BY(mu_);
  int64_t history_floor_ ABSL_GUARDED_BY(mu_) = 0;  // EventsSince below this: OUT_OF_RANGE
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t lists_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t watches_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t applied_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread loop_;
  mutable absl::Mutex events_mu_;
  std::deque<nlohmann::json> events_ ABSL_GUARDED_BY(events_mu_);
  bool events_stopping_ ABSL_GUARDED_BY(events_mu_) = false;
  absl::Time events_deadline_ ABSL_GUARDED_BY(events_mu_) = absl::InfiniteFuture();
  int64_t events_dropped_ ABSL_GUARDED_BY(events_mu_) = 0;
  std::thread event_loop_;
};

// StoredObject <-> the Kubernetes object.
absl::StatusOr<StoredObject> StoredFromKube(const nlohmann::json& object);

}  // namespace kiln
