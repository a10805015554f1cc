#include "tests/support/fake_kube_api.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <sstream>

#include "absl/time/clock.h"
#include "controller/model_deployment.h"
#include "tests/support/shell.h"

namespace kiln::testing {

namespace {

using nlohmann::json;

constexpr char kToken[] = "test-token";

bool SendAll(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

json StatusBody(int code, const std::string& reason, const std::string& message) {
  return {{"kind", "Status"}, {"apiVersion", "v1"}, {"metadata", json::object()},
          {"status", "Failure"}, {"message", message}, {"reason", reason}, {"code", code}};
}

const char* ReasonPhrase(int code) {
  switch (code) {
    case 200: return "OK";
    case 201: return "Created";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 409: return "Conflict";
    case 410: return "Gone";
    case 422: return "Unprocessable Entity";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

std::map<std::string, std::string> ParseQuery(const std::string& q) {
  std::map<std::string, std::string> out;
  std::stringstream ss(q);
  std::string kv;
  while (std::getline(ss, kv, '&')) {
    auto eq = kv.find('=');
    if (eq == std::string::npos) out[kv] = "";
    else out[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return out;
}

int64_t RvOf(const json& obj) {
  if (!obj.contains("metadata") || !obj["metadata"].contains("resourceVersion")) return 0;
  const json& v = obj["metadata"]["resourceVersion"];
  if (!v.is_string() || v.get<std::string>().empty()) return -1;
  try {
    return std::stoll(v.get<std::string>());
  } catch (...) {
    return -1;
  }
}

// The autoscaling/v1 Scale view of a ModelDeployment (the CRD's scale subresource paths).
json ScaleOf(const json& o) {
  json status = o.value("status", json::object());
  return {{"kind", "Scale"}, {"apiVersion", "autoscaling/v1"},
          {"metadata", {{"name", o["metadata"]["name"]}, {"namespace", o["metadata"].value("namespace", "")},
                        {"resourceVersion", o["metadata"]["resourceVersion"]}}},
          {"spec", {{"replicas", o["spec"].value("replicas", 0)}}},
          {"status", {{"replicas", status.value("replicas", 0)}, {"selector", status.value("selector", "")}}}};
}

}  // namespace

std::string FakeKubeApi::ModelDeployments(const std::string& ns) {
  return "/apis/serving.kiln.dev/v1alpha1/namespaces/" + ns + "/modeldeployments";
}

std::string FakeKubeApi::Pods(const std::string& ns) { return "/api/v1/namespaces/" + ns + "/pods"; }

void FakeKubeApi::AddPod(const std::string& ns, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (objects_[Pods(ns)].count(name)) return;  // kept, labels and all (a restarted container)
  objects_[Pods(ns)][name] = {{"apiVersion", "v1"}, {"kind", "Pod"},
                              {"metadata", {{"name", name}, {"namespace", ns},
                                            {"labels", {{"app.kubernetes.io/name", "kiln"}}},
                                            {"resourceVersion", std::to_string(++rv_)}}}};
}

std::string FakeKubeApi::Leases(const std::string& ns) {
  return "/apis/coordination.k8s.io/v1/namespaces/" + ns + "/leases";
}

namespace {

CrdSchema RepositoryCrdSchema() {
  const std::string path = std::string(KILN_SOURCE_DIR) + "/manifests/crd.yaml";
  auto docs = YamlDocumentsToJson(ReadFile(path), path);
  if (!docs.ok() || docs->empty()) throw std::runtime_error(path + ": no CRD in it");
  auto schema = CrdSchema::FromCrd(docs->at(0), "v1alpha1");
  if (!schema.ok()) throw std::runtime_error(path + ": " + std::string(schema.status().message()));
  return *schema;
}

}  // namespace

FakeKubeApi::FakeKubeApi() : schema_(RepositoryCrdSchema()) {
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::listen(listen_fd_, 64);
  socklen_t len = sizeof(addr);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

FakeKubeApi::~FakeKubeApi() {
  stopping_ = true;
  ::shutdown(listen_fd_, SHUT_RDWR);
  ::close(listen_fd_);
  acceptor_.join();
  std::vector<std::thread> workers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : open_fds_) ::shutdown(fd, SHUT_RDWR);
    workers.swap(workers_);
  }
  changed_.notify_all();
  for (auto& t : workers) t.join();
}

void FakeKubeApi::AcceptLoop() {
  while (!stopping_) {
    int fd = ::accept(listen_fd_, nullptr, nullptr);
    if (fd < 0) {
      if (stopping_) return;
      continue;
    }
    std::lock_guard<std::mutex> lock(mu_);
    open_fds_.push_back(fd);
    workers_.emplace_back([this, fd] { Serve(fd); });
  }
}

void FakeKubeApi::DropWatches() {
  std::lock_guard<std::mutex> lock(mu_);
  ++drop_epoch_;
  changed_.notify_all();
}

void FakeKubeApi::Compact() {
  std::lock_guard<std::mutex> lock(mu_);
  compacted_ = rv_;
  history_.clear();
}

void FakeKubeApi::Bookmark() {
  std::lock_guard<std::mutex> lock(mu_);
  ++bookmark_epoch_;
  changed_.notify_all();
}

void FakeKubeApi::SetGoneAsStatus(bool as_status) {
  std::lock_guard<std::mutex> lock(mu_);
  gone_as_status_ = as_status;
}

void FakeKubeApi::SetOnRequest(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  on_request_ = std::move(hook);
}

void FakeKubeApi::SetUnavailable(bool down) {
  std::lock_guard<std::mutex> lock(mu_);
  unavailable_ = down;
  if (down) ++drop_epoch_;
  changed_.notify_all();
}

void FakeKubeApi::SetWatchesRefused(bool refused) {
  std::lock_guard<std::mutex> lock(mu_);
  watches_refused_ = refused;
  if (refused) ++drop_epoch_;
  changed_.notify_all();
}

json FakeKubeApi::Get(const std::string& collection, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& objs = objects_[collection];
  auto it = objs.find(name);
  return it == objs.end() ? json() : it->second;
}

int64_t FakeKubeApi::resource_version() {
  std::lock_guard<std::mutex> lock(mu_);
  return rv_;
}

std::vector<json> FakeKubeApi::EventsRecorded() {
  std::lock_guard<std::mutex> lock(mu_);
  return events_recorded_;
}

void FakeKubeApi::RecordLocked(const std::string& collection, const std::string& type,
                               const json& obj) {
  history_.push_back({rv_, collection, type, obj});
  changed_.notify_all();
}

void FakeKubeApi::Serve(int fd) {
  std::string buf;
  char chunk[8192];
  size_t header_end;
  while ((header_end = buf.find("\r\n\r\n")) == std::string::npos) {
    ssize_t n = ::recv(fd, chunk, sizeof(chunk), 0);
    if (n <= 0) break;
    buf.append(chunk, static_cast<size_t>(n));
  }
  auto finish = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = open_fds_.begin(); it != open_fds_.end(); ++it) {
      if (*it == fd) {
        open_fds_.erase(it);
        break;
      }
    }
    ::close(fd);
  };
  if (header_end == std::string::npos) return finish();
  std::istringstream head(buf.substr(0, header_end));
  std::string method, target, version, line;
  head >> method >> target >> version;
  std::getline(head, line);
  size_t content_length = 0;
  std::string auth, content_type;
  while (std::getline(head, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    for (auto& c : key) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::string value = line.substr(colon + 1);
    while (!value.empty() && value.front() == ' ') value.erase(0, 1);
    if (key == "content-length") content_length = std::stoul(value);
    if (key == "authorization") auth = value;
    if (key == "content-type") content_type = value.substr(0, value.find(';'));
  }
  std::string body = buf.substr(header_end + 4);
  while (body.size() < content_length) {
    ssize_t n = ::recv(fd, chunk, sizeof(chunk), 0);
    if (n <= 0) break;
    body.append(chunk, static_cast<size_t>(n));
  }
  std::string path = target, query;
  if (auto q = target.find('?'); q != std::string::npos) {
    path = target.substr(0, q);
    query = target.substr(q + 1);
  }
  auto params = ParseQuery(query);
  params[" content-type"] = content_type;  // for Handle (no query key has a space)
  Response r;
  bool down;
  std::function<void()> hook;
  {
    std::lock_guard<std::mutex> lock(mu_);
    down = unavailable_ || (watches_refused_ && (params["watch"] == "1" || params["watch"] == "true"));
    hook = on_request_;
  }
  if (hook) hook();
  if (down) {
    r = {503, StatusBody(503, "ServiceUnavailable", "the server is currently unable to handle the request")};
  } else if (auth != std::string("Bearer ") + kToken) {
    r = {401, StatusBody(401, "Unauthorized", "Unauthorized")};
  } else if (method == "GET" && (params["watch"] == "1" || params["watch"] == "true")) {
    watches_started_++;
    Watch(fd, path, params);
    return finish();
  } else {
    r = Handle(method, path, params, body);
  }
  std::string text = r.body.dump();
  std::string out = "HTTP/1.1 " + std::to_string(r.code) + " " + ReasonPhrase(r.code) +
                    "\r\nContent-Type: application/json\r\nContent-Length: " +
                    std::to_string(text.size()) + "\r\nConnection: close\r\n\r\n" + text;
  SendAll(fd, out);
  finish();
}

void FakeKubeApi::Watch(int fd, const std::string& collection,
                        const std::map<std::string, std::string>& query) {
  int64_t drop_epoch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    drop_epoch = drop_epoch_;
    open_by_epoch_[drop_epoch]++;
  }
  Stream(fd, collection, query, drop_epoch);
  std::lock_guard<std::mutex> lock(mu_);
  open_by_epoch_[drop_epoch]--;
}

int FakeKubeApi::open_watches() {
  std::lock_guard<std::mutex> lock(mu_);
  return open_by_epoch_[drop_epoch_];
}

void FakeKubeApi::Stream(int fd, const std::string& collection,
                         const std::map<std::string, std::string>& query, int64_t drop_epoch) {
  int64_t from = 0;
  if (auto it = query.find("resourceVersion"); it != query.end() && !it->second.empty()) {
    from = std::stoll(it->second);
  }
  double timeout_s = 300;
  if (auto it = query.find("timeoutSeconds"); it != query.end()) timeout_s = std::stod(it->second);
  bool bookmarks = query.count("allowWatchBookmarks") && query.at("allowWatchBookmarks") == "true";
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (gone_as_status_ && from != 0 && from < compacted_) {
      lock.unlock();
      const std::string body = StatusBody(410, "Expired", "too old resource version").dump();
      SendAll(fd, "HTTP/1.1 410 Gone\r\nContent-Type: application/json\r\nContent-Length: " +
                      std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body);
      return;
    }
  }
  if (!SendAll(fd, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                   "Connection: close\r\n\r\n")) {
    return;
  }
  auto send_event = [&](const json& e) {
    std::string line = e.dump() + "\n";
    char size[32];
    std::snprintf(size, sizeof(size), "%zx\r\n", line.size());
    return SendAll(fd, size + line + "\r\n");
  };
  std::unique_lock<std::mutex> lock(mu_);
  int64_t bookmark_epoch = bookmark_epoch_;
  if (from != 0 && from < compacted_) {
    lock.unlock();
    send_event({{"type", "ERROR"},
                {"object", StatusBody(410, "Expired", "too old resource version: " + std::to_string(from) +
                                                          " (" + std::to_string(compacted_) + ")")}});
    SendAll(fd, "0\r\n\r\n");
    return;
  }
  int64_t sent_up_to = from;
  while (true) {
    std::vector<json> out;
    for (const auto& e : history_) {
      if (e.rv > sent_up_to && e.collection == collection) out.push_back({{"type", e.type}, {"object", e.object}});
    }
    if (!history_.empty()) sent_up_to = std::max(sent_up_to, history_.back().rv);
    bool bookmark = bookmarks && bookmark_epoch != bookmark_epoch_;
    bookmark_epoch = bookmark_epoch_;
    int64_t rv_now = rv_;
    lock.unlock();
    for (const auto& e : out) {
      if (!send_event(e)) return;
    }
    if (bookmark) {
      json obj = {{"kind", "ModelDeployment"}, {"apiVersion", kModelDeploymentApiVersion},
                  {"metadata", {{"resourceVersion", std::to_string(rv_now)}}}};
      if (!send_event({{"type", "BOOKMARK"}, {"object", obj}})) return;
    }
    lock.lock();
    bool more = changed_.wait_until(lock, deadline, [&] {
      return stopping_ || drop_epoch_ != drop_epoch || bookmark_epoch_ != bookmark_epoch ||
             (!history_.empty() && history_.back().rv > sent_up_to);
    });
    if (stopping_ || drop_epoch_ != drop_epoch) {
      // Mid-stream loss: no terminating chunk, the connection just goes.
      lock.unlock();
      ::shutdown(fd, SHUT_RDWR);
      return;
    }
    if (!more) {  // timeoutSeconds: a clean end of the stream
      lock.unlock();
      SendAll(fd, "0\r\n\r\n");
      return;
    }
  }
}

FakeKubeApi::Response FakeKubeApi::Handle(const std::string& method, const std::string& path,
                                          const std::map<std::string, std::string>& query,
                                          const std::string& body) {
  const std::string content_type = query.count(" content-type") ? query.at(" content-type") : "";
  // /apis/GROUP/VERSION/namespaces/NS/RESOURCE[/NAME[/SUB]] or /api/v1/namespaces/NS/RESOURCE...
  std::vector<std::string> parts;
  std::stringstream ss(path);
  std::string p;
  while (std::getline(ss, p, '/')) {
    if (!p.empty()) parts.push_back(p);
  }
  size_t ns_at = parts.size() > 1 && parts[0] == "api" ? 2 : 3;
  if (parts.size() < ns_at + 3 || parts[ns_at] != "namespaces") {
    return {404, StatusBody(404, "NotFound", "the server could not find the requested resource")};
  }
  std::string collection;
  for (size_t i = 0; i <= ns_at + 2; ++i) collection += "/" + parts[i];
  const std::string resource = parts[ns_at + 2];
  if (resource != "modeldeployments" && resource != "leases" && resource != "events" &&
      resource != "pods") {
    return {404, StatusBody(404, "NotFound", "the server could not find the requested resource")};
  }
  std::string name = parts.size() > ns_at + 3 ? parts[ns_at + 3] : "";
  std::string sub = parts.size() > ns_at + 4 ? parts[ns_at + 4] : "";
  if (!sub.empty() && (resource != "modeldeployments" || (sub != "status" && sub != "scale"))) {
    return {404, StatusBody(404, "NotFound", "no subresource " + sub)};
  }
  json parsed;
  if (!body.empty()) {
    parsed = json::parse(body, nullptr, false);
    if (parsed.is_discarded()) return {400, StatusBody(400, "BadRequest", "body is not JSON")};
  }
  if (method == "GET" && name.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    json items = json::array();
    for (const auto& [n, o] : objects_[collection]) items.push_back(o);
    std::string list_kind = resource == "modeldeployments" ? "ModelDeploymentList"
                            : resource == "leases"         ? "LeaseList"
                                                           : "EventList";
    return {200, {{"kind", list_kind}, {"metadata", {{"resourceVersion", std::to_string(rv_)}}}, {"items", items}}};
  }
  if (method == "GET") {
    std::lock_guard<std::mutex> lock(mu_);
    auto& objs = objects_[collection];
    auto it = objs.find(name);
    if (it == objs.end()) {
      return {404, StatusBody(404, "NotFound", resource + " \"" + name + "\" not found")};
    }
    if (sub == "scale") return {200, ScaleOf(it->second)};
    return {200, it->second};
  }
  if (resource == "pods") {
    // Only what a controller labelling its own Pod needs: a merge patch of the labels.
    if (method != "PATCH" || name.empty()) {
      return {405, StatusBody(405, "MethodNotAllowed", method + " on pods is not served here")};
    }
    if (content_type != "application/merge-patch+json") {
      return {415, StatusBody(415, "UnsupportedMediaType", "want application/merge-patch+json, got " + content_type)};
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto& pods = objects_[collection];
    auto it = pods.find(name);
    if (it == pods.end()) return {404, StatusBody(404, "NotFound", "pods \"" + name + "\" not found")};
    if (!parsed.is_object()) return {400, StatusBody(400, "BadRequest", "not a merge patch")};
    json& labels = it->second["metadata"]["labels"];
    if (parsed.contains("metadata") && parsed["metadata"].contains("labels")) {
      for (const auto& [k, v] : parsed["metadata"]["labels"].items()) {
        if (v.is_null()) {
          labels.erase(k);
        } else {
          labels[k] = v;
        }
      }
    }
    it->second["metadata"]["resourceVersion"] = std::to_string(++rv_);
    return {200, it->second};
  }
  if (method == "POST" || method == "PUT" || method == "DELETE") {
    if (method == "POST" && !name.empty()) return {405, StatusBody(405, "MethodNotAllowed", "POST to a name")};
    if (method != "POST" && name.empty()) return {405, StatusBody(405, "MethodNotAllowed", "no name")};
    return Write(method, collection, name, sub, parsed);
  }
  return {405, StatusBody(405, "MethodNotAllowed", method + " is not supported")};
}

FakeKubeApi::Response FakeKubeApi::Write(const std::string& method, const std::string& collection,
                                         const std::string& path_name, const std::string& sub,
                                         const json& body) {
  const bool is_md = collection.find("/modeldeployments") != std::string::npos;
  const bool is_event = collection.size() >= 7 && collection.compare(collection.size() - 7, 7, "/events") == 0;
  std::string ns;
  {
    auto at = collection.find("/namespaces/");
    ns = collection.substr(at + 12, collection.find('/', at + 12) - at - 12);
  }
  auto invalid = [&](const std::vector<std::string>& errs, const std::string& name) -> Response {
    json causes = json::array();
    std::string msg;
    for (const auto& e : errs) {
      causes.push_back({{"message", e}});
      msg += (msg.empty() ? "" : ", ") + e;
    }
    json st = StatusBody(422, "Invalid", "ModelDeployment.serving.kiln.dev \"" + name + "\" is invalid: " + msg);
    st["details"] = {{"name", name}, {"causes", causes}};
    return {422, st};
  };
  std::lock_guard<std::mutex> lock(mu_);
  auto& objs = objects_[collection];
  if (method == "POST") {
    if (!body.is_object() || !body.contains("metadata") || !body["metadata"].contains("name") ||
        !body["metadata"]["name"].is_string() || body["metadata"]["name"].get<std::string>().empty()) {
      return {422, StatusBody(422, "Invalid", "metadata.name: Required value")};
    }
    std::string name = body["metadata"]["name"];
    if (objs.count(name)) {
      return {409, StatusBody(409, "AlreadyExists", "\"" + name + "\" already exists")};
    }
    json obj = body;
    if (is_md) {
      obj.erase("status");  // the status subresource: create ignores it
      auto errs = schema_.Validate(obj);
      if (!errs.empty()) return invalid(errs, name);
    }
    ++rv_;
    obj["metadata"]["namespace"] = ns;
    obj["metadata"]["uid"] = "uid-" + std::to_string(++uid_seq_);
    obj["metadata"]["resourceVersion"] = std::to_string(rv_);
    obj["metadata"]["creationTimestamp"] = FormatRfc3339(absl::Now());
    if (!is_event) obj["metadata"]["generation"] = 1;
    objs[name] = obj;
    if (is_event) events_recorded_.push_back(obj);
    RecordLocked(collection, "ADDED", obj);
    return {201, obj};
  }
  auto it = objs.find(path_name);
  if (it == objs.end()) {
    return {404, StatusBody(404, "NotFound", "\"" + path_name + "\" not found")};
  }
  json& cur = it->second;
  const int64_t cur_rv = std::stoll(cur["metadata"]["resourceVersion"].get<std::string>());
  if (method == "DELETE") {
    if (body.is_object() && body.contains("preconditions") && body["preconditions"].contains("resourceVersion")) {
      if (body["preconditions"]["resourceVersion"] != cur["metadata"]["resourceVersion"]) {
        return {409, StatusBody(409, "Conflict", "Precondition failed: ResourceVersion in precondition: " +
                                                     body["preconditions"]["resourceVersion"].dump() +
                                                     ", ResourceVersion in storage: " + std::to_string(cur_rv))};
      }
    }
    ++rv_;
    json gone = cur;
    gone["metadata"]["resourceVersion"] = std::to_string(rv_);
    objs.erase(it);
    RecordLocked(collection, "DELETED", gone);
    return {200, StatusBody(200, "", "")};
  }
  // PUT: optimistic concurrency when the body carries a resourceVersion.
  if (!body.is_object()) return {400, StatusBody(400, "BadRequest", "body must be an object")};
  int64_t want = RvOf(body);
  if (want < 0) return {400, StatusBody(400, "BadRequest", "metadata.resourceVersion: Invalid value")};
  bool leases = collection.find("/leases") != std::string::npos;
  // As the real server: no unconditional update of a Lease or of a custom resource (its scale
  // subresource excepted, which kubectl scale writes without one).
  if (want == 0 && (leases || (is_md && sub != "scale"))) {
    return {422, StatusBody(422, "Invalid", "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update")};
  }
  if (want != 0 && want != cur_rv) {
    return {409, StatusBody(409, "Conflict",
                            "Operation cannot be fulfilled on " + collection.substr(collection.rfind('/') + 1) + " \"" +
                                path_name + "\": the object has been modified; please apply your changes to the "
                                "latest version and try again")};
  }
  json next = cur;
  if (sub == "status") {
    next["status"] = body.value("status", json::object());
  } else if (sub == "scale") {
    if (!body.contains("spec") || !body["spec"].contains("replicas")) {
      return {422, StatusBody(422, "Invalid", "spec.replicas: Required value")};
    }
    next["spec"]["replicas"] = body["spec"]["replicas"];
  } else if (is_md) {  // the main resource: spec, labels and annotations; the status stays
    json meta = body.value("metadata", json::object());
    next["spec"] = body.value("spec", json::object());
    next["metadata"]["labels"] = meta.value("labels", json::object());
    next["metadata"]["annotations"] = meta.value("annotations", json::object());
  } else {  // a Lease has no subresources: the whole object, with the server's metadata
    next = body;
    next["metadata"] = cur["metadata"];
  }
  if (is_md) {
    auto errs = schema_.Validate(next);
    if (!errs.empty()) return invalid(errs, path_name);
  }
  auto same_meta = [](const json& a, const json& b, const char* key) {
    return a["metadata"].value(key, json::object()) == b["metadata"].value(key, json::object());
  };
  if (next.value("spec", json()) == cur.value("spec", json()) && next.value("status", json()) == cur.value("status", json()) &&
      same_meta(next, cur, "labels") && same_meta(next, cur, "annotations")) {
    if (sub == "scale") return {200, ScaleOf(cur)};
    return {200, cur};  // a no-op write changes nothing, not even the resourceVersion
  }
  if (next.value("spec", json()) != cur.value("spec", json())) {
    next["metadata"]["generation"] = cur["metadata"].value("generation", 1) + 1;
  }
  ++rv_;
  next["metadata"]["resourceVersion"] = std::to_string(rv_);
  cur = next;
  RecordLocked(collection, "MODIFIED", next);
  if (sub == "scale") return {200, ScaleOf(next)};
  return {200, next};
}

}  // namespace kiln::testing
