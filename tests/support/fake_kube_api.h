#pragma once

// An in-test Kubernetes API server over loopback HTTP/1.1 (port 0). It keeps the API's rules
// the controller depends on: one monotonically increasing resourceVersion; list, then watch
// from a version (events after it, bookmarks, timeoutSeconds); 410 Gone for a compacted
// version; 409 Conflict for a stale update or an existing name; ModelDeployments validated
// against manifests/crd.yaml's schema; the status subresource (only status changes, generation
// kept) and the scale subresource (spec.replicas); spec changes bump metadata.generation;
// coordination.k8s.io/v1 Leases; core/v1 Events. Tests can drop every watch mid-stream, compact
// history and write as another client would.

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "controller/crd_schema.h"
#include "nlohmann/json.hpp"

namespace kiln::testing {

class FakeKubeApi {
 public:
  // Validates ModelDeployments against the repository's manifests/crd.yaml.
  FakeKubeApi();
  ~FakeKubeApi();

  int port() const { return port_; }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

  // Closes every open watch stream at once, as a lost connection would.
  void DropWatches();
  // Forgets history up to now: watches from an older version get 410 Gone.
  void Compact();
  // Sends a BOOKMARK with the current resourceVersion on every open watch.
  void Bookmark();
  // Refuses every request with 503 while set (an API server that is down).
  void SetUnavailable(bool down);
  // A watch from a compacted version is answered HTTP 410 (as some API servers and proxies do)
  // instead of a 200 stream holding a 410 ERROR event.
  void SetGoneAsStatus(bool as_status);
  // Runs `hook` on the serving thread as each request arrives, before it is answered (a test's
  // simulated clock moving while a request is out); empty: none.
  void SetOnRequest(std::function<void()> hook);
  // Drops open watches and answers new ones 503 while set; other requests work (a client
  // whose watch connection cannot get through).
  void SetWatchesRefused(bool refused);

  // A Pod the controller may label (kept as it is if it exists) (GET and JSON merge-patch PATCH of metadata.labels are
  // served for pods; nothing else).
  void AddPod(const std::string& ns, const std::string& name);
  static std::string Pods(const std::string& ns);

  // Direct access, as another client (kubectl) would have.
  nlohmann::json Get(const std::string& collection, const std::string& name);
  int64_t resource_version();
  std::vector<nlohmann::json> EventsRecorded();
  int watches_started() const { return watches_started_.load(); }
  // Watches streaming now that a DropWatches() would cut (opened since the last drop).
  int open_watches();

  // The collections this server keeps (path prefixes).
  static std::string ModelDeployments(const std::string& ns);
  static std::string Leases(const std::string& ns);

 private:
  struct Response {
    int code = 200;
    nlohmann::json body;
  };
  struct Event {
    int64_t rv;
    std::string collection;
    std::string type;
    nlohmann::json object;
  };
  void AcceptLoop();
  void Serve(int fd);
  Response Handle(const std::string& method, const std::string& path,
                  const std::map<std::string, std::string>& query, const std::string& body);
  void Watch(int fd, const std::string& collection, const std::map<std::string, std::string>& query);
  // The stream of one watch; it ends when DropWatches moves past `drop_epoch`.
  void Stream(int fd, const std::string& collection, const std::map<std::string, std::string>& query,
              int64_t drop_epoch);
  Response Write(const std::string& method, const std::string& collection, const std::string& name,
                 const std::string& sub, const nlohmann::json& body);
  void RecordLocked(const std::string& collection, const std::string& type, const nlohmann::json& obj);

  CrdSchema schema_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> watches_started_{0};
  std::thread acceptor_;

  std::mutex mu_;
  std::condition_variable changed_;
  int64_t rv_ = 100;
  int64_t compacted_ = 0;
  int64_t uid_seq_ = 0;
  int64_t drop_epoch_ = 0;
  std::map<int64_t, int> open_by_epoch_;  // streaming watches by the drop epoch they began in
  int64_t bookmark_epoch_ = 0;
  bool unavailable_ = false;
  std::function<void()> on_request_;  // under mu_
  bool gone_as_status_ = false;       // under mu_
  bool watches_refused_ = false;
  std::map<std::string, std::map<std::string, nlohmann::json>> objects_;  // collection -> name
  std::vector<Event> history_;
  std::vector<nlohmann::json> events_recorded_;
  std::vector<std::thread> workers_;
  std::vector<int> open_fds_;
};

}  // namespace kiln::testing
