#include "controller/kube_store.h"

#include <unistd.h>

#include "common/logging.h"
#include "controller/model_deployment.h"

namespace kiln {

namespace {

using nlohmann::json;

int64_t ParseRv(const json& meta) {
  if (!meta.is_object() || !meta.contains("resourceVersion") || !meta["resourceVersion"].is_string()) return 0;
  try {
    return std::stoll(meta["resourceVersion"].get<std::string>());
  } catch (...) {
    return 0;
  }
}

absl::Status FromHttp(const KubeResponse& r, const std::string& what) {
  std::string msg = what + ": " + KubeClient::Describe(r);
  switch (r.code) {
    case 404: return absl::NotFoundError(msg);
    case 409:
      if (r.body.is_object() && r.body.value("reason", "") == "AlreadyExists") return absl::AlreadyExistsError(msg);
      return absl::AbortedError(msg);
    case 400:
    case 422: return absl::InvalidArgumentError(msg);
    case 401:
    case 403: return absl::PermissionDeniedError(msg);
    case 410: return absl::OutOfRangeError(msg);
    default: return absl::UnavailableError(msg);
  }
}

}  // namespace

absl::StatusOr<StoredObject> StoredFromKube(const json& o) {
  if (!o.is_object() || !o.contains("metadata") || !o["metadata"].is_object()) {
    return absl::DataLossError("object without metadata");
  }
  const json& m = o["metadata"];
  StoredObject s;
  s.kind = o.value("kind", kModelDeploymentKind);
  s.name = m.value("name", "");
  if (s.name.empty()) return absl::DataLossError("object without metadata.name");
  s.uid = m.value("uid", "");
  s.generation = m.value("generation", int64_t{1});
  s.resource_version = ParseRv(m);
  if (m.contains("creationTimestamp") && m["creationTimestamp"].is_string()) {
    auto t = ParseRfc3339(m["creationTimestamp"].get<std::string>(), "metadata.creationTimestamp");
    if (t.ok()) s.created_unix_micros = absl::ToUnixMicros(*t);
  }
  s.spec = json{{"labels", m.value("labels", json::object())}, {"spec", o.value("spec", json::object())}}.dump();
  s.status = o.contains("status") && o["status"].is_object() ? o["status"].dump() : "{}";
  return s;
}

KubernetesStore::KubernetesStore(KubeConfig config, Options options)
    : options_(options), client_(std::move(config)) {}

absl::StatusOr<std::unique_ptr<KubernetesStore>> KubernetesStore::Open(KubeConfig config, Options options) {
  std::unique_ptr<KubernetesStore> store(new KubernetesStore(std::move(config), options));
  absl::Time deadline = absl::Now() + options.sync_timeout;
  absl::Status s;
  while (!(s = store->ListOnce()).ok()) {
    if (s.code() == absl::StatusCode::kPermissionDenied || s.code() == absl::StatusCode::kNotFound ||
        absl::Now() + options.retry > deadline) {
      return absl::Status(s.code(), "kubernetes store: first list: " + std::string(s.message()));
    }
    absl::SleepFor(options.retry);
  }
  store->loop_ = std::thread([s = store.get()] { s->Loop(); });
  store->event_loop_ = std::thread([s = store.get()] { s->EventLoop(); });
  return store;
}

KubernetesStore::~KubernetesStore() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  {
    absl::MutexLock lock(&events_mu_);
    events_stopping_ = true;
    events_deadline_ = absl::Now() + absl::Seconds(3);  // a last try for what is queued
  }
  client_.StopWatches();  // also one the loop is about to start
  if (loop_.joinable()) loop_.join();
  if (event_loop_.joinable()) event_loop_.join();
}

std::string KubernetesStore::Collection() const {
  return "/apis/serving.kiln.dev/v1alpha1/namespaces/" + client_.config().ns + "/modeldeployments";
}

absl::Status KubernetesStore::CheckKind(const std::string& kind) const {
  if (kind != kModelDeploymentKind) {
    return absl::InvalidArgumentError("kubernetes store: kind '" + kind + "' is not kept (only " +
                                      kModelDeploymentKind + ")");
  }
  return absl::OkStatus();
}

absl::Status KubernetesStore::ListOnce() {
  auto r = client_.Call("GET", Collection());
  if (!r.ok()) return r.status();
  if (r->code != 200) return FromHttp(*r, "list " + Collection());
  if (!r->body.is_object() || !r->body.contains("items") || !r->body["items"].is_array()) {
    return absl::UnavailableError("list " + Collection() + ": not a list");
  }
  const int64_t list_rv = ParseRv(r->body.value("metadata", json::object()));
  absl::MutexLock lock(&mu_);
  // The list replaces the cache: what is gone was deleted, what is newer was modified.
  std::map<std::string, json> seen;
  for (const auto& item : r->body["items"]) {
    if (item.contains("metadata")) seen[item["metadata"].value("name", "")] = item;
  }
  for (auto it = cache_.begin(); it != cache_.end();) {
    if (seen.count(it->first)) {
      ++it;
      continue;
    }
    json gone = it->second.object;
    gone["metadata"]["resourceVersion"] = std::to_string(list_rv);
    ++it;
    ApplyLocked(WatchEvent::Type::kDeleted, gone);
  }
  for (const auto& [name, item] : seen) {
    ApplyLocked(cache_.count(name) ? WatchEvent::Type::kModified : WatchEvent::Type::kAdded, item);
  }
  rv_ = std::max(rv_, list_rv);
  watch_rv_ = list_rv;  // the list is whole up to here: a watch goes on from it
  ++lists_;
  return absl::OkStatus();
}

const StoredObject* KubernetesStore::ApplyLocked(WatchEvent::Type type, const json& object) {
  auto stored = StoredFromKube(object);
  if (!stored.ok()) {
    GetLogger("controller.kube")->warn("ignoring an object the API served: {}", stored.status().ToString());
    return nullptr;
  }
  auto it = cache_.find(stored->name);
  if (type != WatchEvent::Type::kDeleted && it != cache_.end() &&
      it->second.stored.resource_version >= stored->resource_version) {
    return &it->second.stored;  // already applied (our own write, or seen before a re-watch)
  }
  const StoredObject* now = nullptr;
  if (type == WatchEvent::Type::kDeleted) {
    // Gone, unless the cache already holds a newer object of that name (created again).
    if (it == cache_.end()) return nullptr;
    if (it->second.stored.resource_version > stored->resource_version) return &it->second.stored;
    cache_.erase(it);
  } else {
    Cached& c = cache_[stored->name];
    c = {*stored, object};
    now = &c.stored;
  }
  rv_ = std::max(rv_, stored->resource_version);
  ++applied_;
  history_.push_back({type, stored->resource_version, *stored});
  while (history_.size() > options_.history) {
    history_floor_ = history_.front().resource_version;
    history_.pop_front();
  }
  return now;
}

void KubernetesStore::Loop() {
  auto log = GetLogger("controller.kube");
  bool need_list = false;
  while (true) {
    int64_t from;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      from = watch_rv_;
    }
    if (need_list) {
      absl::Status s = ListOnce();
      if (!s.ok()) {
        log->warn("relist: {}", s.ToString());
        absl::MutexLock lock(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.retry);
        continue;
      }
      need_list = false;
      continue;
    }
    int64_t timeout_s = std::max<int64_t>(1, absl::ToInt64Seconds(options_.watch_timeout));
    std::string path = Collection() + "?watch=1&allowWatchBookmarks=true&resourceVersion=" +
                       std::to_string(from) + "&timeoutSeconds=" + std::to_string(timeout_s);
    {
      absl::MutexLock lock(&mu_);
      ++watches_;
    }
    bool gone = false;
    bool errored = false;
    int64_t delivered = 0;
    const absl::Time began = absl::Now();
    absl::Status s = client_.Watch(
        path,
        [&](const json& e) {
          std::string type = e.value("type", "");
          const json& obj = e.contains("object") ? e["object"] : json();
          if (type == "ERROR") {
            int code = obj.is_object() ? obj.value("code", 0) : 0;
            if (code == 410) gone = true;
            else log->warn("watch error: {}", obj.dump());
            errored = !gone;
            return false;
          }
          ++delivered;
          absl::MutexLock lock(&mu_);
          // What the watch has delivered, whatever the cache already held (this store's own
          // writes move rv_, not this: events before them may not have come yet).
          const int64_t event_rv = ParseRv(obj.is_object() ? obj.value("metadata", json::object())
                                                           : json::object());
          watch_rv_ = std::max(watch_rv_, event_rv);
          if (type == "BOOKMARK") {
            rv_ = std::max(rv_, event_rv);
          } else if (type == "ADDED") {
            ApplyLocked(WatchEvent::Type::kAdded, obj);
          } else if (type == "MODIFIED") {
            ApplyLocked(WatchEvent::Type::kModified, obj);
          } else if (type == "DELETED") {
            ApplyLocked(WatchEvent::Type::kDeleted, obj);
          }
          return !stopping_;
        },
        options_.watch_timeout + absl::Seconds(30));
    if (gone || absl::IsOutOfRange(s)) {  // as an event, or as the answer's status
      log->info("watch from resourceVersion {}: 410 Gone, listing again", from);
      need_list = true;
      continue;
    }
    // A broken stream, an error event, or one the server ended at once with nothing in it:
    // watched again after a pause, never in a tight loop.
    const bool idle_end = s.ok() && delivered == 0 && absl::Now() - began < absl::Seconds(1);
    if (!s.ok() || errored || idle_end) {
      if (!s.ok()) {
        log->warn("watch broke: {}; watching again from the last version seen", s.ToString());
      }
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.retry);
    }
  }
}

absl::StatusOr<StoredObject> KubernetesStore::Get(const std::string& kind, const std::string& name) {
  if (auto s = CheckKind(kind); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto it = cache_.find(name);
  if (it == cache_.end()) return absl::NotFoundError(kind + " '" + name + "' not found");
  return it->second.stored;
}

absl::StatusOr<std::vector<StoredObject>> KubernetesStore::List(const std::string& kind) {
  if (auto s = CheckKind(kind); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  std::vector<StoredObject> out;
  for (const auto& [name, c] : cache_) out.push_back(c.stored);
  return out;
}

absl::StatusOr<StoredObject> KubernetesStore::FinishWrite(const absl::StatusOr<KubeResponse>& r,
                                                          const std::string& what) {
  if (!r.ok()) return r.status();
  if (r->code != 200 && r->code != 201) return FromHttp(*r, what);
  absl::MutexLock lock(&mu_);
  const StoredObject* stored = ApplyLocked(WatchEvent::Type::kModified, r->body);
  if (!stored) return absl::DataLossError(what + ": the API answered without the object");
  return *stored;
}

namespace {

// The stored envelope {"labels": {...}, "spec": {...}}.
absl::StatusOr<json> Envelope(const std::string& text) {
  json env = json::parse(text, nullptr, false);
  if (env.is_discarded() || !env.is_object()) return absl::InvalidArgumentError("spec: not a JSON object");
  return env;
}

}  // namespace

absl::StatusOr<StoredObject> KubernetesStore::Create(const std::string& kind, const std::string& name,
                                                     const std::string& spec) {
  if (auto s = CheckKind(kind); !s.ok()) return s;
  auto env = Envelope(spec);
  if (!env.ok()) return env.status();
  json body = {{"apiVersion", kModelDeploymentApiVersion},
               {"kind", kModelDeploymentKind},
               {"metadata", {{"name", name}, {"namespace", client_.config().ns},
                             {"labels", env->value("labels", json::object())}}},
               {"spec", env->value("spec", json::object())}};
  return FinishWrite(client_.Call("POST", Collection(), &body), "create " + name);
}

absl::StatusOr<StoredObject> KubernetesStore::Update(const std::string& kind, const std::string& name,
                                                     const std::string& spec,
                                                     int64_t expected_resource_version) {
  if (auto s = CheckKind(kind); !s.ok()) return s;
  auto env = Envelope(spec);
  if (!env.ok()) return env.status();
  json meta = {{"name", name}, {"namespace", client_.config().ns},
               {"labels", env->value("labels", json::object())}};
  json body = {{"apiVersion", kModelDeploymentApiVersion}, {"kind", kModelDeploymentKind},
               {"metadata", meta}, {"spec", env->value("spec", json::object())}};
  const std::string path = Collection() + "/" + name;
  if (expected_resource_version != 0) {
    body["metadata"]["resourceVersion"] = std::to_string(expected_resource_version);
    return FinishWrite(client_.Call("PUT", path, &body), "update " + name);
  }
  return PutAtCurrentVersion(name, path, &body, "update " + name);
}

absl::StatusOr<StoredObject> KubernetesStore::PutAtCurrentVersion(const std::string& name,
                                                                  const std::string& path,
                                                                  json* body,
                                                                  const std::string& what) {
  // The API allows no unconditional update of a custom resource: it is made against the
  // version read just before, again if another write came in between.
  absl::StatusOr<KubeResponse> put = absl::UnavailableError("not tried");
  for (int attempt = 0; attempt < 5; ++attempt) {
    auto got = client_.Call("GET", Collection() + "/" + name);
    if (!got.ok()) return got.status();
    if (got->code != 200) return FromHttp(*got, what);
    (*body)["metadata"]["resourceVersion"] =
        got->body.value("metadata", json::object()).value("resourceVersion", "0");
    put = client_.Call("PUT", path, body);
    if (!put.ok() || put->code != 409) break;
  }
  return FinishWrite(put, what);
}

absl::StatusOr<StoredObject> KubernetesStore::UpdateStatus(const std::string& kind, const std::string& name,
                                                           const std::string& status,
                                                           int64_t expected_resource_version) {
  if (auto s = CheckKind(kind); !s.ok()) return s;
  json st = json::parse(status, nullptr, false);
  if (st.is_discarded() || !st.is_object()) return absl::InvalidArgumentError("status: not a JSON object");
  json body;
  {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(name);
    if (it == cache_.end()) return absl::NotFoundError(kind + " '" + name + "' not found");
    body = it->second.object;  // the whole object: the server takes only its status
  }
  body["status"] = st;
  const std::string path = Collection() + "/" + name + "/status";
  if (expected_resource_version != 0) {
    body["metadata"]["resourceVersion"] = std::to_string(expected_resource_version);
    return FinishWrite(client_.Call("PUT", path, &body), "status of " + name);
  }
  return PutAtCurrentVersion(name, path, &body, "status of " + name);
}

absl::Status KubernetesStore::Delete(const std::string& kind, const std::string& name,
                                     int64_t expected_resource_version) {
  if (auto s = CheckKind(kind); !s.ok()) return s;
  json body = {{"kind", "DeleteOptions"}, {"apiVersion", "v1"}};
  if (expected_resource_version != 0) {
    body["preconditions"] = {{"resourceVersion", std::to_string(expected_resource_version)}};
  }
  auto r = client_.Call("DELETE", Collection() + "/" + name, &body);
  if (!r.ok()) return r.status();
  if (r->code != 200 && r->code != 202) return FromHttp(*r, "delete " + name);
  absl::MutexLock lock(&mu_);
  auto it = cache_.find(name);
  if (it != cache_.end()) {
    json gone = it->second.object;
    ApplyLocked(WatchEvent::Type::kDeleted, gone);
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> KubernetesStore::CurrentResourceVersion() {
  absl::MutexLock lock(&mu_);
  return rv_;
}

absl::StatusOr<std::vector<WatchEvent>> KubernetesStore::EventsSince(int64_t resource_version, int limit) {
  if (resource_version < 0 || limit < 1) return absl::InvalidArgumentError("resourceVersion and limit must be >= 0 and >= 1");
  absl::MutexLock lock(&mu_);
  if (resource_version < history_floor_) {
    return absl::OutOfRangeError("resourceVersion " + std::to_string(resource_version) +
                                 " is too old (history starts after " + std::to_string(history_floor_) + ")");
  }
  std::vector<WatchEvent> out;
  for (const auto& e : history_) {
    if (e.resource_version <= resource_version) continue;
    out.push_back(e);
    if (static_cast<int>(out.size()) >= limit) break;
  }
  return out;
}

bool KubernetesStore::WaitForChange(int64_t resource_version, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto moved = [this, resource_version]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return rv_ > resource_version || stopping_;
  };
  mu_.AwaitWithTimeout(absl::Condition(&moved), timeout);
  return rv_ > resource_version;
}

void KubernetesStore::RecordEvent(const std::string& kind, const std::string& name, const std::string& type,
                                  const std::string& reason, const std::string& message) {
  std::string uid;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = cache_.find(name); it != cache_.end()) uid = it->second.stored.uid;
  }
  absl::Time now = absl::Now();
  const std::string& ns = client_.config().ns;
  json body = {
      {"apiVersion", "v1"},
      {"kind", "Event"},
      {"metadata", {{"name", name + "." + std::to_string(absl::ToUnixNanos(now))}, {"namespace", ns}}},
      {"involvedObject", {{"apiVersion", kModelDeploymentApiVersion}, {"kind", kind}, {"name", name},
                          {"namespace", ns}, {"uid", uid}}},
      {"type", type},
      {"reason", reason},
      {"message", message.substr(0, 1024)},
      {"source", {{"component", "kiln-controller"}}},
      {"firstTimestamp", FormatRfc3339(now)},
      {"lastTimestamp", FormatRfc3339(now)},
      {"count", 1}};
  absl::MutexLock lock(&events_mu_);
  if (events_.size() >= options_.event_queue && !events_.empty()) {
    events_.pop_front();
    // Said at the first drop and at every power of two after it, not at each one.
    if (++events_dropped_ && (events_dropped_ & (events_dropped_ - 1)) == 0) {
      GetLogger("controller.kube")->warn("events: the queue of {} is full; {} dropped so far",
                                         options_.event_queue, events_dropped_);
    }
  }
  events_.push_back(std::move(body));
}

absl::StatusOr<std::vector<ObjectEvent>> KubernetesStore::ListEvents(const std::string& kind,
                                                                      const std::string& name,
                                                                      int limit) {
  if (limit <= 0) return absl::InvalidArgumentError("limit: must be > 0");
  // The API server filters (the fields are indexed for Events); the loop below checks again.
  std::string selector = "involvedObject.kind%3D" + kind;
  if (!name.empty()) selector += "%2CinvolvedObject.name%3D" + name;
  auto r = client_.Call("GET", "/api/v1/namespaces/" + client_.config().ns +
                                   "/events?fieldSelector=" + selector);
  if (!r.ok()) return r.status();
  if (r->code != 200) {
    return absl::UnavailableError("events: the API server answered " + std::to_string(r->code));
  }
  std::vector<ObjectEvent> out;
  if (!r->body.is_object() || !r->body.contains("items") || !r->body["items"].is_array()) return out;
  for (const auto& e : r->body["items"]) {
    if (!e.is_object() || !e.contains("involvedObject") || !e["involvedObject"].is_object()) continue;
    // Fields may be missing or null (Events written by other tools): read safely.
    auto text = [](const json& o, const char* key) {
      auto it = o.find(key);
      return it != o.end() && it->is_string() ? it->get<std::string>() : std::string();
    };
    const json& about = e["involvedObject"];
    if (text(about, "kind") != kind || (!name.empty() && text(about, "name") != name)) continue;
    ObjectEvent ev{kind, text(about, "name"), text(e, "type"), text(e, "reason"),
                   text(e, "message"), 0};
    absl::Time t;
    std::string err;
    std::string when = text(e, "lastTimestamp");
    if (when.empty()) when = text(e, "eventTime");
    if (absl::ParseTime(absl::RFC3339_full, when, &t, &err)) ev.unix_micros = absl::ToUnixMicros(t);
    out.push_back(std::move(ev));
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const ObjectEvent& a, const ObjectEvent& b) { return a.unix_micros < b.unix_micros; });
  if (static_cast<int>(out.size()) > limit) out.erase(out.begin(), out.end() - limit);
  return out;
}

void KubernetesStore::EventLoop() {
  for (;;) {
    nlohmann::json body;
    {
      absl::MutexLock lock(&events_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(events_mu_) {
        return events_stopping_ || !events_.empty();
      };
      events_mu_.Await(absl::Condition(&ready));
      if (events_.empty()) return;  // stopping, nothing left
      if (events_stopping_ && absl::Now() > events_deadline_) {
        events_dropped_ += static_cast<int64_t>(events_.size());
        GetLogger("controller.kube")->warn("events: {} not posted before shutdown", events_.size());
        events_.clear();
        return;
      }
      body = std::move(events_.front());
      events_.pop_front();
    }
    PostEvent(body);
  }
}

void KubernetesStore::PostEvent(const nlohmann::json& body) {
  const std::string& ns = client_.config().ns;
  auto r = client_.Call("POST", "/api/v1/namespaces/" + ns + "/events", &body, absl::Seconds(2));
  if (!r.ok() || (r->code != 201 && r->code != 200)) {
    GetLogger("controller.kube")->warn("event {} for {}: {}", body.value("reason", ""),
                                       body["involvedObject"].value("name", ""),
                                       r.ok() ? KubeClient::Describe(*r) : r.status().ToString());
  }
}

int64_t KubernetesStore::events_dropped() const {
  absl::MutexLock lock(&events_mu_);
  return events_dropped_;
}

int64_t KubernetesStore::lists() const {
  absl::MutexLock lock(&mu_);
  return lists_;
}
int64_t KubernetesStore::watches() const {
  absl::MutexLock lock(&mu_);
  return watches_;
}
int64_t KubernetesStore::applied_changes() const {
  absl::MutexLock lock(&mu_);
  return applied_;
}

}  // namespace kiln
