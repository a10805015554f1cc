#include "agent/assignment_file.h"

#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "common/config_node.h"
#include "common/hash.h"
#include "common/status.h"
#include "common/uri.h"

namespace kiln {

namespace {

bool IsName(const std::string& s) {
  if (s.empty() || s.size() > 128 || s == "." || s == "..") return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) {
      return false;
    }
  }
  return true;
}

bool IsVersion(const std::string& s) {
  return !s.empty() && s.size() <= 18 && s.find_first_not_of("0123456789") == std::string::npos;
}

absl::StatusOr<v1::LifecycleState> ParseState(const ConfigNode& n) {
  KILN_ASSIGN_OR_RETURN(std::string s, n.AsString());
  if (s == "SERVING") return v1::SERVING;
  if (s == "WARM") return v1::WARM;
  return n.Error("must be SERVING or WARM, got '" + s + "'");
}

absl::Status ParseReplicaFields(const ConfigNode& item, v1::ReplicaSpec* r) {
  KILN_ASSIGN_OR_RETURN(ConfigNode model, item.Child("model"));
  KILN_ASSIGN_OR_RETURN(*r->mutable_model(), model.AsString());
  KILN_ASSIGN_OR_RETURN(ConfigNode version, item.Child("version"));
  KILN_ASSIGN_OR_RETURN(*r->mutable_version(), version.AsString());
  KILN_ASSIGN_OR_RETURN(ConfigNode repo, item.Child("repository"));
  KILN_ASSIGN_OR_RETURN(*r->mutable_repository(), repo.AsString());
  KILN_ASSIGN_OR_RETURN(int64_t gpu, item.GetInt("gpu", -1));
  KILN_ASSIGN_OR_RETURN(int64_t cpus, item.GetInt("cpus", 1));
  KILN_ASSIGN_OR_RETURN(int64_t threads, item.GetInt("threads", 0));
  if (gpu < -1 || gpu > 1024) return absl::InvalidArgumentError(item.path() + ".gpu: must be -1..1024");
  if (cpus < 1 || cpus > 1024) return absl::InvalidArgumentError(item.path() + ".cpus: must be 1..1024");
  if (threads < 0 || threads > 1024) {
    return absl::InvalidArgumentError(item.path() + ".threads: must be 0..1024");
  }
  r->set_gpu(static_cast<int32_t>(gpu));
  r->set_cpus(static_cast<int32_t>(cpus));
  r->mutable_runtime()->set_threads(static_cast<int32_t>(threads));
  if (auto mem = item.OptionalChild("gpuMemory")) {
    KILN_ASSIGN_OR_RETURN(std::string text, mem->AsString());
    KILN_ASSIGN_OR_RETURN(int64_t bytes, ParseByteSize(text, mem->path()));
    r->set_gpu_memory_bytes(bytes);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateAssignment(const v1::Assignment& a) {
  std::set<std::string> ids;
  for (int i = 0; i < a.replicas_size(); ++i) {
    const auto& r = a.replicas(i);
    std::string p = "replicas[" + std::to_string(i) + "]";
    if (!IsName(r.model())) {
      return absl::InvalidArgumentError(p + ".model: '" + r.model() +
                                        "' must be 1-128 of [A-Za-z0-9._-]");
    }
    if (!IsVersion(r.version())) {
      return absl::InvalidArgumentError(p + ".version: '" + r.version() +
                                        "' must be a numeric version");
    }
    if (!IsName(r.replica_id())) {
      return absl::InvalidArgumentError(p + ".id: '" + r.replica_id() +
                                        "' must be 1-128 of [A-Za-z0-9._-]");
    }
    if (!ids.insert(r.replica_id()).second) {
      return absl::InvalidArgumentError(p + ".id: '" + r.replica_id() + "' is used twice");
    }
    // The agent's pre-started runtimes are prestart-N: their control sockets and logs are
    // named so, and a replica of that name would share them.
    if (r.replica_id().size() > 9 && r.replica_id().rfind("prestart-", 0) == 0 &&
        r.replica_id().find_first_not_of("0123456789", 9) == std::string::npos) {
      return absl::InvalidArgumentError(p + ".id: '" + r.replica_id() +
                                        "' is reserved for the agent's pre-started runtimes");
    }
    if (r.repository().empty() || r.repository()[0] != '/') {
      return absl::InvalidArgumentError(p + ".repository: must be an absolute path, got '" +
                                        r.repository() + "'");
    }
    if (r.gpu() < -1) return absl::InvalidArgumentError(p + ".gpu: must be >= -1");
    if (r.cpus() < 1) return absl::InvalidArgumentError(p + ".cpus: must be >= 1");
    if (r.state() != v1::SERVING && r.state() != v1::WARM) {
      return absl::InvalidArgumentError(p + ".state: must be SERVING or WARM");
    }
    // Bounded, so that a node's sums of it cannot overflow (a GPU holds far less than 1Pi).
    if (r.gpu_memory_bytes() < 0 || r.gpu_memory_bytes() > (int64_t{1} << 50)) {
      return absl::InvalidArgumentError(p + ".gpuMemory: must be in 0..1048576Gi (1 PiB)");
    }
  }
  return absl::OkStatus();
}

namespace {

// HOST:PORT as the router's clients take it (common/uri.h), with a host that is one.
bool IsHostPort(const std::string& a) {
  std::string host, port;
  return SplitHostPort(a, &host, &port).ok() && host.find_first_of(" /[]") == std::string::npos;
}

}  // namespace

absl::Status ValidateRoutingTable(const v1::RoutingTable& t) {
  std::set<std::string> models;
  for (int i = 0; i < t.routes_size(); ++i) {
    const auto& r = t.routes(i);
    std::string p = "routes[" + std::to_string(i) + "]";
    if (!IsName(r.model())) return absl::InvalidArgumentError(p + ".model: not a model name");
    if (!models.insert(r.model()).second) {
      return absl::InvalidArgumentError(p + ".model: '" + r.model() + "' has two routes");
    }
    if (r.versions_size() == 0) {
      return absl::InvalidArgumentError(p + ".versions: must list at least one version");
    }
    int total = 0;
    std::set<std::string> versions;
    for (int v = 0; v < r.versions_size(); ++v) {
      std::string vp = p + ".versions[" + std::to_string(v) + "]";
      if (!IsVersion(r.versions(v).version())) {
        return absl::InvalidArgumentError(vp + ".version: must be a numeric version");
      }
      if (!versions.insert(r.versions(v).version()).second) {
        return absl::InvalidArgumentError(vp + ".version: listed twice");
      }
      if (r.versions(v).weight() < 0 || r.versions(v).weight() > 1000000) {
        return absl::InvalidArgumentError(vp + ".weight: must be in 0..1000000");
      }
      total += r.versions(v).weight();
    }
    if (total == 0) return absl::InvalidArgumentError(p + ".versions: every weight is 0");
    for (int e = 0; e < r.endpoints_size(); ++e) {
      const auto& ep = r.endpoints(e);
      const std::string epp = p + ".endpoints[" + std::to_string(e) + "]";
      if (!IsHostPort(ep.grpc_address())) {
        return absl::InvalidArgumentError(epp + ".grpc: must be HOST:PORT, got '" +
                                          ep.grpc_address() + "'");
      }
      if (!ep.http_address().empty() && !IsHostPort(ep.http_address())) {
        return absl::InvalidArgumentError(epp + ".http: must be HOST:PORT, got '" +
                                          ep.http_address() + "'");
      }
    }
    const std::string& sticky = r.sticky_key();
    if (!sticky.empty() && !((sticky.rfind("header:", 0) == 0 && sticky.size() > 7) ||
                             (sticky.rfind("parameter:", 0) == 0 && sticky.size() > 10))) {
      return absl::InvalidArgumentError(p + ".stickyKey: must be header:NAME or parameter:NAME, got '" +
                                        sticky + "'");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<AssignmentFile> ParseAssignmentFile(const std::string& yaml_text,
                                                   const std::string& source) {
  KILN_ASSIGN_OR_RETURN(ConfigNode root, ConfigNode::Parse(yaml_text, source));
  AssignmentFile out;
  auto parse = [&]() -> absl::Status {
    if (root.IsNull()) return absl::OkStatus();  // an empty file: run nothing
    KILN_RETURN_IF_ERROR(root.CheckKeys({"replicas", "warmPools", "routes"}));
    if (auto replicas = root.OptionalChild("replicas")) {
      KILN_ASSIGN_OR_RETURN(auto items, replicas->Items());
      for (size_t i = 0; i < items.size(); ++i) {
        const auto& item = items[i];
        KILN_RETURN_IF_ERROR(item.CheckKeys({"id", "model", "version", "repository", "gpu", "cpus",
                                             "state", "threads", "gpuMemory"}));
        v1::ReplicaSpec* r = out.assignment.add_replicas();
        KILN_RETURN_IF_ERROR(ParseReplicaFields(item, r));
        KILN_ASSIGN_OR_RETURN(std::string id, item.GetString("id", ""));
        r->set_replica_id(id.empty() ? r->model() + "-" + r->version() + "-" + std::to_string(i)
                                     : id);
        if (auto state = item.OptionalChild("state")) {
          KILN_ASSIGN_OR_RETURN(auto s, ParseState(*state));
          r->set_state(s);
        } else {
          r->set_state(v1::SERVING);
        }
      }
    }
    for (int i = 0; i < out.assignment.replicas_size(); ++i) {
      const std::string& id = out.assignment.replicas(i).replica_id();
      if (IsPoolMemberId(id)) {
        return absl::InvalidArgumentError("replicas[" + std::to_string(i) + "].id: '" + id +
                                          "' starts with 'pool-', which is reserved for warm "
                                          "pool members; give the replica another id");
      }
    }
    if (auto pools = root.OptionalChild("warmPools")) {
      KILN_ASSIGN_OR_RETURN(auto items, pools->Items());
      std::map<std::string, std::string> shapes;  // shape -> the pool that has it
      for (size_t i = 0; i < items.size(); ++i) {
        const auto& item = items[i];
        KILN_RETURN_IF_ERROR(item.CheckKeys({"model", "version", "repository", "gpu", "cpus",
                                             "size", "threads", "gpuMemory"}));
        KILN_ASSIGN_OR_RETURN(int64_t size, item.GetInt("size", 1));
        if (size < 0 || size > 64) return absl::InvalidArgumentError(item.path() + ".size: must be 0..64");
        FileWarmPool pool;
        pool.size = static_cast<int>(size);
        KILN_RETURN_IF_ERROR(ParseReplicaFields(item, &pool.spec));
        pool.spec.set_state(v1::WARM);
        // Checked like a replica (the id is a stand-in).
        v1::Assignment check;
        *check.add_replicas() = pool.spec;
        check.mutable_replicas(0)->set_replica_id("pool");
        if (auto s = ValidateAssignment(check); !s.ok()) {
          std::string msg(s.message());
          return absl::InvalidArgumentError(item.path() + msg.substr(msg.find('.')));
        }
        auto [it, fresh] = shapes.emplace(ReplicaShape(pool.spec), item.path());
        if (!fresh) {
          return absl::InvalidArgumentError(item.path() + ": the same replicas as " + it->second +
                                            "; give one pool the size of both");
        }
        out.pools.push_back(std::move(pool));
      }
    }
    if (auto routes = root.OptionalChild("routes")) {
      KILN_ASSIGN_OR_RETURN(auto items, routes->Items());
      for (const auto& item : items) {
        KILN_RETURN_IF_ERROR(item.CheckKeys({"model", "versions", "stickyKey", "endpoints"}));
        v1::Route* r = out.routing.add_routes();
        KILN_ASSIGN_OR_RETURN(ConfigNode model, item.Child("model"));
        KILN_ASSIGN_OR_RETURN(*r->mutable_model(), model.AsString());
        KILN_ASSIGN_OR_RETURN(*r->mutable_sticky_key(), item.GetString("stickyKey", ""));
        KILN_ASSIGN_OR_RETURN(ConfigNode versions, item.Child("versions"));
        KILN_ASSIGN_OR_RETURN(auto vs, versions.Items());
        for (const auto& v : vs) {
          KILN_RETURN_IF_ERROR(v.CheckKeys({"version", "weight"}));
          auto* rv = r->add_versions();
          KILN_ASSIGN_OR_RETURN(ConfigNode ver, v.Child("version"));
          KILN_ASSIGN_OR_RETURN(*rv->mutable_version(), ver.AsString());
          KILN_ASSIGN_OR_RETURN(int64_t w, v.GetInt("weight", 100));
          if (w < 0 || w > 1000000) return absl::InvalidArgumentError(v.path() + ".weight: must be in 0..1000000");
          rv->set_weight(static_cast<int32_t>(w));
        }
        if (auto eps = item.OptionalChild("endpoints")) {
          KILN_ASSIGN_OR_RETURN(auto es, eps->Items());
          for (const auto& e : es) {
            KILN_RETURN_IF_ERROR(e.CheckKeys({"node", "version", "grpc", "http"}));
            auto* ep = r->add_endpoints();
            KILN_ASSIGN_OR_RETURN(*ep->mutable_node_name(), e.GetString("node", ""));
            KILN_ASSIGN_OR_RETURN(ConfigNode ver, e.Child("version"));
            KILN_ASSIGN_OR_RETURN(*ep->mutable_version(), ver.AsString());
            KILN_ASSIGN_OR_RETURN(ConfigNode grpc, e.Child("grpc"));
            KILN_ASSIGN_OR_RETURN(*ep->mutable_grpc_address(), grpc.AsString());
            KILN_ASSIGN_OR_RETURN(*ep->mutable_http_address(), e.GetString("http", ""));
            ep->set_replica_id(ep->node_name() + "/" + ep->grpc_address());
            bool listed = false;
            for (const auto& rv : r->versions()) listed |= rv.version() == ep->version();
            if (!listed) {
              return absl::InvalidArgumentError(e.path() + ".version: '" + ep->version() +
                                                "' is not one of the route's versions");
            }
          }
        }
      }
    }
    KILN_RETURN_IF_ERROR(ValidateAssignment(out.assignment));
    return ValidateRoutingTable(out.routing);
  };
  absl::Status s = parse();
  if (!s.ok()) return Annotate(s, source);
  return out;
}

std::string ReplicaShape(const v1::ReplicaSpec& s) {
  std::string key;
  for (const std::string& part :
       {s.model(), s.version(), s.repository(), std::to_string(s.gpu()), std::to_string(s.cpus()),
        std::to_string(s.gpu_memory_bytes()), std::to_string(s.runtime().threads()),
        std::to_string(s.runtime().max_request_bytes())}) {
    key += part;
    key += '\0';
  }
  return key;
}

bool IsPoolMemberId(const std::string& id) { return id.rfind("pool-", 0) == 0; }

std::string PoolIdPrefix(const v1::ReplicaSpec& spec) {
  // Short (control sockets are named by the id), readable, and one per shape.
  char hash[8];
  snprintf(hash, sizeof(hash), "%04x", static_cast<unsigned>(Fnv1a64(ReplicaShape(spec)) & 0xffff));
  return "pool-" + spec.model().substr(0, 12) + "-" + hash + "-";
}

absl::StatusOr<AssignmentFile> LoadAssignmentFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(path + ": cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  return ParseAssignmentFile(text.str(), path);
}

}  // namespace kiln
