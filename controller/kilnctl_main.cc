// kilnctl: the command line for kiln-controller's admin API (kubectl-like).
#include <cpprest/http_client.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "controller/admin_api.h"
#include "controller/model_deployment.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace {

namespace fs = std::filesystem;
namespace http = web::http;
using nlohmann::json;

constexpr char kResource[] = "modeldeployment.serving.kiln.dev";

struct Reply {
  int code = 0;  // 0: no answer
  json body;
  std::string error;  // transport error
};

class Client {
 public:
  Client(std::string server, std::string token) : server_(std::move(server)), token_(std::move(token)) {}

  Reply Call(const http::method& method, const std::string& path, const std::string& body = "") {
    Reply out;
    try {
      http::client::http_client_config cfg;
      cfg.set_timeout(std::chrono::seconds(30));
      http::client::http_client client(server_, cfg);
      http::http_request req(method);
      req.set_request_uri(path);
      if (!token_.empty()) req.headers().add(http::header_names::authorization, "Bearer " + token_);
      if (!body.empty()) req.set_body(body, "application/json");
      http::http_response resp = client.request(req).get();
      out.code = resp.status_code();
      std::string text = resp.extract_utf8string(true).get();
      out.body = json::parse(text, nullptr, false);
      if (out.body.is_discarded()) out.body = json{{"message", text}};
    } catch (const std::exception& e) {
      out.error = e.what();
    }
    return out;
  }
  const std::string& server() const { return server_; }

 private:
  std::string server_;
  std::string token_;
};

// kubectl's shape: "Error from server (NotFound): ..." and exit 1.
int ServerError(const Reply& r, const Client& c) {
  if (r.code == 0) {
    std::cerr << "error: cannot reach kiln-controller at " << c.server() << ": " << r.error << "\n";
    return 1;
  }
  std::cerr << "Error from server (" << r.body.value("reason", std::to_string(r.code))
            << "): " << r.body.value("message", r.body.dump()) << "\n";
  return 1;
}

YAML::Node ToYaml(const json& j) {
  YAML::Node n;
  if (j.is_object()) {
    n = YAML::Node(YAML::NodeType::Map);
    for (auto it = j.begin(); it != j.end(); ++it) n[it.key()] = ToYaml(it.value());
  } else if (j.is_array()) {
    n = YAML::Node(YAML::NodeType::Sequence);
    for (const auto& e : j) n.push_back(ToYaml(e));
  } else if (j.is_string()) {
    n = j.get<std::string>();
  } else if (j.is_boolean()) {
    n = j.get<bool>();
  } else if (j.is_number_integer()) {
    n = j.get<int64_t>();
  } else if (j.is_number()) {
    n = j.get<double>();
  }
  return n;
}

// -o json and -o yaml; false for the other formats (tables).
bool PrintStructured(const json& body, const std::string& output) {
  if (output == "json") {
    std::cout << body.dump(2) << "\n";
    return true;
  }
  if (output == "yaml") {
    YAML::Emitter e;
    e << ToYaml(body);
    std::cout << e.c_str() << "\n";
    return true;
  }
  return false;
}

std::string Age(const std::string& created) {
  absl::Time t;
  std::string err;
  if (!absl::ParseTime("%Y-%m-%dT%H:%M:%SZ", created, &t, &err)) return "?";
  int64_t s = absl::ToInt64Seconds(absl::Now() - t);
  if (s < 0) s = 0;
  if (s < 120) return std::to_string(s) + "s";
  if (s < 7200) return std::to_string(s / 60) + "m";
  if (s < 172800) return std::to_string(s / 3600) + "h";
  return std::to_string(s / 86400) + "d";
}

// Columns padded to their widest cell, three spaces apart (kubectl's look).
void PrintRows(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& r : rows) {
    width.resize(std::max(width.size(), r.size()), 0);
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(width[i] - r[i].size() + 3, ' ');
    }
    std::cout << line << "\n";
  }
}

void PrintTable(const std::vector<json>& items, bool wide) {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> head = {"NAME", "MODEL", "VERSION", "REPLICAS", "READY", "AGE"};
  if (wide) {
    head.insert(head.end(), {"WARM", "GPUS", "STRATEGY", "GENERATION"});
  }
  rows.push_back(head);
  for (const auto& o : items) {
    const json& spec = o.value("spec", json::object());
    const json& status = o.value("status", json::object());
    const json& model = spec.value("model", json::object());
    std::string replicas = spec.contains("autoscale")
                               ? std::to_string(spec["autoscale"].value("min", 0)) + "-" +
                                     std::to_string(spec["autoscale"].value("max", 0))
                               : std::to_string(spec.value("replicas", 0));
    std::vector<std::string> row = {o["metadata"].value("name", ""),
                                    model.value("name", ""),
                                    model.value("version", ""),
                                    replicas,
                                    std::to_string(status.value("readyReplicas", 0)) + "/" +
                                        std::to_string(status.value(
                                            "desiredReplicas", spec.value("replicas", 0))),
                                    Age(o["metadata"].value("creationTimestamp", ""))};
    if (wide) {
      row.push_back(std::to_string(spec.value("warmPool", 0)));
      row.push_back(std::to_string(spec.value("resources", json::object()).value("gpus", 0)));
      row.push_back(spec.value("rollout", json::object()).value("strategy", ""));
      row.push_back(std::to_string(o["metadata"].value("generation", 0)));
    }
    rows.push_back(row);
  }
  PrintRows(rows);
}

bool IsDeploymentType(const std::string& t) {
  return t == "deployments" || t == "deployment" || t == "deploy" || t == "md" ||
         t == "modeldeployment" || t == "modeldeployments" || t == kResource;
}

// The files `apply -f` reads: the path itself, or a directory's *.yaml, *.yml and *.json.
std::vector<std::string> ApplyFiles(const std::string& path, std::string* error) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(path, ec)) {
      std::string ext = e.path().extension().string();
      if (e.is_regular_file() && (ext == ".yaml" || ext == ".yml" || ext == ".json")) {
        files.push_back(e.path().string());
      }
    }
    std::sort(files.begin(), files.end());
    if (files.empty()) *error = path + ": no .yaml, .yml or .json files in it";
    return files;
  }
  if (!fs::is_regular_file(path, ec)) {
    *error = path + ": no such file or directory";
    return {};
  }
  return {path};
}

int Apply(Client& c, const std::string& path) {
  std::string error;
  auto files = ApplyFiles(path, &error);
  if (!error.empty()) {
    std::cerr << "error: " << error << "\n";
    return 1;
  }
  // Everything is parsed and validated before anything is sent.
  std::vector<kiln::ModelDeployment> all;
  for (const auto& f : files) {
    std::ifstream in(f);
    std::stringstream text;
    text << in.rdbuf();
    if (!in) {
      std::cerr << "error: " << f << ": cannot be read\n";
      return 1;
    }
    auto ds = kiln::ParseModelDeployments(text.str(), f);
    if (!ds.ok()) {
      std::cerr << "error: " << ds.status().message() << "\n";
      return 1;
    }
    all.insert(all.end(), ds->begin(), ds->end());
  }
  int rc = 0;
  for (const auto& d : all) {
    json labels = json::object();
    for (const auto& [k, v] : d.labels) labels[k] = v;
    json doc = {{"apiVersion", kiln::kModelDeploymentApiVersion},
                {"kind", kiln::kModelDeploymentKind},
                {"metadata", {{"name", d.name}, {"labels", labels}}},
                {"spec", kiln::SpecToJson(d.spec)}};
    std::string path_one = std::string(kiln::kDeploymentsPath) + "/" + d.name;
    Reply current, r;
    std::string verb;
    // Read, then write against what was read; again (a few times) when the controller wrote
    // the status in between (409 Conflict says nothing about the spec here). A file read
    // back with `get -o yaml` and edited names the resourceVersion (and generation) it was read
    // at: when the spec changed since (another generation, or no generation to tell), it is
    // written against that resourceVersion, once, so that the Conflict is the answer rather
    // than someone else's change silently undone.
    const bool pinned = d.resource_version != 0;
    bool strict = false;
    for (int attempt = 0; attempt < 5; ++attempt) {
      current = c.Call(http::methods::GET, path_one);
      if (current.code == 404 && pinned) {
        // Deleted since the file was read: made again only from a file that does not pin it.
        std::cerr << "Error from server (Conflict): " << kResource << " \"" << d.name
                  << "\" was deleted since this file was read (resourceVersion "
                  << d.resource_version
                  << "); drop metadata.resourceVersion to create it again\n";
        rc = 1;
        break;
      } else if (current.code == 404) {
        r = c.Call(http::methods::POST, kiln::kDeploymentsPath, doc.dump());
        verb = "created";
      } else if (current.code == 200) {
        const json& meta = current.body["metadata"];
        // Another object of the same name (deleted and made again), or another spec of it.
        strict = pinned && (d.generation == 0 ||
                            meta.value("generation", int64_t{0}) != d.generation ||
                            (!d.uid.empty() && meta.value("uid", "") != d.uid));
        doc["metadata"]["resourceVersion"] =
            strict ? std::to_string(d.resource_version) : meta.value("resourceVersion", "0");
        r = c.Call(http::methods::PUT, path_one, doc.dump());
        verb = r.code == 200 && r.body["metadata"].value("resourceVersion", "") ==
                                    current.body["metadata"].value("resourceVersion", "")
                   ? "unchanged"
                   : "configured";
      } else {
        break;
      }
      if (r.code != 409 || strict) break;
    }
    if (current.code == 404 && pinned) continue;  // said above
    if (current.code != 404 && current.code != 200) {
      rc = ServerError(current, c);
      continue;
    }
    if (r.code != 200 && r.code != 201) {
      rc = ServerError(r, c);
      continue;
    }
    std::cout << kResource << "/" << d.name << " " << verb << "\n";
  }
  return rc;
}

// "<none>" for an empty cell, as kubectl shows one.
std::string Cell(const std::string& v) { return v.empty() ? "<none>" : v; }

// The replicas the controller sees on every node; those of deployment `of` (or the replica
// named so) when it is given.
std::vector<json> ReplicasOf(const json& list, const std::string& of) {
  std::vector<json> out;
  for (const auto& r : list.value("items", json::array())) {
    const std::string id = r.value("id", "");
    if (!of.empty() && id != of && id.rfind(of + ".", 0) != 0) continue;
    out.push_back(r);
  }
  return out;
}

void PrintReplicas(const std::vector<json>& replicas, bool wide, const std::string& indent = "") {
  std::vector<std::vector<std::string>> rows = {
      {indent + "NAME", "NODE", "MODEL", "VERSION", "STATE", "HEALTHY", "RESTARTS"}};
  if (wide) {
    rows[0].insert(rows[0].end(),
                   {"DEVICE", "CPUS", "PID", "QPS", "P99", "IN-FLIGHT", "GPU-MEM", "IDLE", "REASON"});
  }
  for (const auto& r : replicas) {
    std::string restarts = std::to_string(r.value("restarts", 0));
    if (r.value("crashLoop", false)) restarts += " (CrashLoop)";
    rows.push_back({indent + r.value("id", ""), r.value("node", ""), r.value("model", ""),
                    r.value("version", ""), r.value("state", ""),
                    r.value("healthy", false) ? "true" : "false", restarts});
    if (wide) {
      rows.back().push_back(Cell(r.value("device", "")));
      rows.back().push_back(Cell(r.value("cpus", "")));
      const int64_t pid = r.value("pid", int64_t{0});
      rows.back().push_back(pid > 0 ? std::to_string(pid) : "<none>");
      char qps[32], p99[32];
      std::snprintf(qps, sizeof(qps), "%.1f", r.value("qps", 0.0));
      std::snprintf(p99, sizeof(p99), "%.1fms", r.value("p99Ms", 0.0));
      rows.back().push_back(qps);
      rows.back().push_back(p99);
      rows.back().push_back(std::to_string(r.value("inFlight", 0)));
      const int64_t gpu_mem = r.value("gpuMemoryBytes", int64_t{0});
      rows.back().push_back(gpu_mem > 0 ? std::to_string(gpu_mem >> 20) + "Mi" : "<none>");
      rows.back().push_back(std::to_string(r.value("idleSeconds", int64_t{0})) + "s");
      rows.back().push_back(Cell(r.value("healthReason", "")));
    }
  }
  PrintRows(rows);
}

void PrintEvents(const json& list, const std::string& indent = "") {
  std::vector<std::vector<std::string>> rows = {{indent + "TYPE", "REASON", "AGE", "OBJECT", "MESSAGE"}};
  for (const auto& e : list.value("items", json::array())) {
    rows.push_back({indent + e.value("type", ""), e.value("reason", ""),
                    Age(e.value("lastTimestamp", "")),
                    e["involvedObject"].value("name", ""), e.value("message", "")});
  }
  PrintRows(rows);
}

// `kilnctl describe deployment NAME`: the object, its rollout, versions, conditions, replicas
// and recent events, as `kubectl describe` lays them out.
int Describe(Client& c, const std::string& name) {
  Reply r = c.Call(http::methods::GET, std::string(kiln::kDeploymentsPath) + "/" + name);
  if (r.code != 200) return ServerError(r, c);
  const json& o = r.body;
  const json& spec = o.value("spec", json::object());
  const json& status = o.value("status", json::object());
  const json& model = spec.value("model", json::object());
  const json& meta = o.value("metadata", json::object());
  auto line = [](const std::string& k, const std::string& v) {
    std::cout << k << ":" << std::string(k.size() < 20 ? 20 - k.size() : 1, ' ') << v << "\n";
  };
  line("Name", meta.value("name", ""));
  std::string labels;
  for (const auto& [k, v] : meta.value("labels", json::object()).items()) {
    labels += (labels.empty() ? "" : ",") + k + "=" + v.get<std::string>();
  }
  line("Labels", Cell(labels));
  line("Created", meta.value("creationTimestamp", "") + " (" + Age(meta.value("creationTimestamp", "")) + " ago)");
  line("Generation", std::to_string(meta.value("generation", 0)) + " (observed " +
                         std::to_string(status.value("observedGeneration", 0)) + ")");
  line("Model", model.value("name", "") + " version " + model.value("version", ""));
  line("URI", model.value("uri", ""));
  std::string want = spec.contains("autoscale")
                         ? "autoscale " + std::to_string(spec["autoscale"].value("min", 0)) + ".." +
                               std::to_string(spec["autoscale"].value("max", 0)) + " (" +
                               std::to_string(status.value("desiredReplicas", 0)) + " desired)"
                         : std::to_string(spec.value("replicas", 0)) + " desired";
  line("Replicas", want + " | " + std::to_string(status.value("readyReplicas", 0)) + " ready | " +
                       std::to_string(status.value("warmReplicas", 0)) + " warm (pool " +
                       std::to_string(spec.value("warmPool", 0)) + ")");
  const json& ro_spec = spec.value("rollout", json::object());
  line("Strategy", ro_spec.value("strategy", "Canary"));
  const json& ro = status.value("rollout", json::object());
  if (!ro.empty()) {
    std::cout << "Rollout:\n";
    std::cout << "  Phase:            " << ro.value("phase", "") << "\n";
    std::cout << "  Stable version:   " << Cell(ro.value("stableVersion", "")) << "\n";
    const std::string canary = ro.value("canaryVersion", "");
    std::cout << "  Canary version:   " << Cell(canary);
    if (!canary.empty()) {
      std::cout << " (weight " << ro.value("canaryWeight", 0) << "%, step "
                << ro.value("step", 0) + 1 << ")";
    }
    std::cout << "\n";
    if (!ro.value("failedVersion", "").empty()) {
      std::cout << "  Failed version:   " << ro.value("failedVersion", "")
                << " (not tried again until the spec names another)\n";
    }
    if (ro.value("promoting", false)) std::cout << "  Promoting:        true\n";
    if (ro.value("paused", false)) std::cout << "  Paused:           true\n";
    std::cout << "  Message:          " << ro.value("message", "") << "\n";
  }
  const json& versions = status.value("versions", json::array());
  if (!versions.empty()) {
    std::cout << "Versions:\n";
    std::vector<std::vector<std::string>> rows = {
        {"  VERSION", "WEIGHT", "READY", "REQUESTS", "ERROR-RATE", "P99-MS"}};
    for (const auto& v : versions) {
      char rate[32], p99[32];
      std::snprintf(rate, sizeof(rate), "%.2f%%", 100.0 * v.value("errorRate", 0.0));
      std::snprintf(p99, sizeof(p99), "%.1f", v.value("latencyP99Ms", 0.0));
      rows.push_back({"  " + v.value("version", ""), std::to_string(v.value("weight", 0)) + "%",
                      std::to_string(v.value("readyReplicas", 0)),
                      std::to_string(v.value("requests", uint64_t{0})), rate, p99});
    }
    PrintRows(rows);
  }
  const json& conditions = status.value("conditions", json::array());
  if (!conditions.empty()) {
    std::cout << "Conditions:\n";
    std::vector<std::vector<std::string>> rows = {{"  TYPE", "STATUS", "REASON", "MESSAGE"}};
    for (const auto& cnd : conditions) {
      rows.push_back({"  " + cnd.value("type", ""), cnd.value("status", ""),
                      cnd.value("reason", ""), cnd.value("message", "")});
    }
    PrintRows(rows);
  }
  Reply reps = c.Call(http::methods::GET, kiln::kReplicasPath);
  if (reps.code == 200) {
    auto mine = ReplicasOf(reps.body, name);
    std::cout << "Replicas:" << (mine.empty() ? "            <none>" : "") << "\n";
    if (!mine.empty()) PrintReplicas(mine, false, "  ");
  }
  Reply ev = c.Call(http::methods::GET, std::string(kiln::kDeploymentsPath) + "/" + name + "/events");
  if (ev.code == 200) {
    json recent = ev.body;
    auto& items = recent["items"];
    if (items.size() > 20) items.erase(items.begin(), items.end() - 20);
    std::cout << "Events:" << (items.empty() ? "              <none>" : "") << "\n";
    if (!items.empty()) PrintEvents(recent, "  ");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string server = std::getenv("KILN_SERVER") ? std::getenv("KILN_SERVER") : "http://127.0.0.1:7070";
  std::string token_file;
  CLI::App app{"kilnctl: manage ModelDeployments on a kiln-controller"};
  app.require_subcommand(1);
  app.add_option("--server", server, "The controller's admin URL (env KILN_SERVER)")->capture_default_str();
  app.add_option("--token-file", token_file, "File holding the bearer token");

  std::string file;
  auto* apply = app.add_subcommand("apply", "Create or update ModelDeployments from YAML/JSON");
  apply->add_option("-f,--filename", file, "A file or a directory of them")->required();

  std::string type, name, output;
  auto* get = app.add_subcommand("get", "List or show deployments, nodes, replicas or events");
  get->add_option("type", type, "deployments, nodes, replicas or events")->required();
  get->add_option("name", name,
                  "One deployment or node; for replicas and events, those of this deployment");
  get->add_option("-o,--output", output, "wide, yaml or json")
      ->check(CLI::IsMember({"wide", "yaml", "json"}));

  std::string describe_type, describe_name;
  auto* describe = app.add_subcommand("describe", "Show a deployment in detail, with its events");
  describe->add_option("type", describe_type, "deployment")->required();
  describe->add_option("name", describe_name, "Its name")->required();

  auto* del = app.add_subcommand(
      "delete", "Delete a ModelDeployment, or forget a node whose agent is gone for good");
  del->add_option("type", type, "deployment | node")->required();
  del->add_option("name", name, "Its name")->required();

  int64_t replicas = -1;
  auto* scale = app.add_subcommand("scale", "Set a ModelDeployment's replicas");
  scale->add_option("name", name, "Its name")->required();
  scale->add_option("--replicas", replicas, "The new count")->required()->check(CLI::Range(0, 10000));

  std::string rollout_name;
  bool watch = false;
  double watch_timeout_s = 600;
  auto* rollout = app.add_subcommand("rollout", "Follow a deployment's rollout");
  rollout->require_subcommand(1);
  auto* rollout_status = rollout->add_subcommand("status", "Where the rollout stands");
  rollout_status->add_option("name", rollout_name, "The deployment")->required();
  rollout_status->add_flag("-w,--watch", watch, "Follow it until it is done or fails");
  rollout_status->add_option("--timeout-seconds", watch_timeout_s, "Give up watching after this")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  std::map<std::string, CLI::App*> rollout_actions;
  for (const char* action : {"pause", "resume", "abort", "promote"}) {
    auto* a = rollout->add_subcommand(action, std::string("Ask the controller to ") + action +
                                                  " the rollout");
    a->add_option("name", rollout_name, "The deployment")->required();
    rollout_actions[action] = a;
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  std::string token;
  if (!token_file.empty()) {
    std::ifstream in(token_file);
    if (!in || !std::getline(in, token) || token.empty()) {
      std::cerr << "error: --token-file: cannot read a token from " << token_file << "\n";
      return 2;
    }
  }
  Client c(server, token);

  if (apply->parsed()) return Apply(c, file);
  for (const auto& [action, sub] : rollout_actions) {
    if (!sub->parsed()) continue;
    json body = {{"action", action}};
    Reply r = c.Call(http::methods::POST,
                     std::string(kiln::kDeploymentsPath) + "/" + rollout_name + "/rollout",
                     body.dump());
    // 200: taken and written down; 202: accepted (a controller before that answer).
    if (r.code != 200 && r.code != 202) return ServerError(r, c);
    std::cout << kResource << "/" << rollout_name << " " << action
              << (r.code == 200 ? " applied\n" : " requested\n");
    return 0;
  }
  if (rollout_status->parsed()) {
    // Prints each new state of the rollout; with -w until it is promoted (0) or rolled back
    // (1), like `kubectl rollout status -w`.
    std::string last;
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(watch_timeout_s * 1000));
    for (;;) {
      Reply r = c.Call(http::methods::GET, std::string(kiln::kDeploymentsPath) + "/" + rollout_name);
      if (r.code != 200) return ServerError(r, c);
      const json& ro = r.body.value("status", json::object()).value("rollout", json::object());
      std::string want = r.body["spec"]["model"].value("version", "");
      std::string phase = ro.value("phase", "");
      std::string line = phase.empty() ? "waiting for the controller to observe the deployment"
                                       : phase + ": " + ro.value("message", "");
      if (line != last) {
        std::cout << line << std::endl;
        last = line;
        // What each version serves, as the analysis sees it.
        const json& status = r.body.value("status", json::object());
        for (const auto& v : status.value("versions", json::array())) {
          char buf[256];
          std::snprintf(buf, sizeof(buf),
                        "  version %s: weight %d%%, %d ready, %llu requests, error rate %.2f%%, "
                        "p99 %.1f ms",
                        v.value("version", "").c_str(), v.value("weight", 0),
                        v.value("readyReplicas", 0),
                        static_cast<unsigned long long>(v.value("requests", uint64_t{0})),
                        100.0 * v.value("errorRate", 0.0), v.value("latencyP99Ms", 0.0));
          std::cout << buf << std::endl;
        }
      }
      bool done = phase == "Stable" && ro.value("stableVersion", "") == want &&
                  ro.value("canaryVersion", "").empty();
      if (done) {
        std::cout << "deployment \"" << rollout_name << "\" serves version " << want << "\n";
        return 0;
      }
      if (phase == "Degraded") {
        std::cerr << "error: rollout of version " << ro.value("failedVersion", want)
                  << " failed and was rolled back\n";
        return 1;
      }
      if (!watch) return 0;
      if (std::chrono::steady_clock::now() > deadline) {
        std::cerr << "error: timed out waiting for the rollout to finish\n";
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
  }
  if (describe->parsed()) {
    if (!IsDeploymentType(describe_type)) {
      std::cerr << "error: kilnctl describes deployments, not \"" << describe_type << "\"\n";
      return 1;
    }
    return Describe(c, describe_name);
  }
  if (get->parsed() && (type == "replicas" || type == "replica" || type == "rep")) {
    Reply r = c.Call(http::methods::GET, kiln::kReplicasPath);
    if (r.code != 200) return ServerError(r, c);
    auto replicas = ReplicasOf(r.body, name);
    if (output == "json" || output == "yaml") {
      PrintStructured(json{{"kind", "ReplicaList"}, {"items", replicas}}, output);
      return 0;
    }
    if (replicas.empty()) {
      std::cerr << "No resources found.\n";
      return 0;
    }
    PrintReplicas(replicas, output == "wide");
    return 0;
  }
  if (get->parsed() && (type == "events" || type == "event" || type == "ev")) {
    Reply r = c.Call(http::methods::GET,
                     name.empty() ? std::string(kiln::kEventsPath)
                                  : std::string(kiln::kDeploymentsPath) + "/" + name + "/events");
    if (r.code != 200) return ServerError(r, c);
    if (PrintStructured(r.body, output)) return 0;
    if (r.body.value("items", json::array()).empty()) {
      std::cerr << "No resources found.\n";
      return 0;
    }
    PrintEvents(r.body);
    return 0;
  }
  if (get->parsed() && (type == "nodes" || type == "node" || type == "no")) {
    Reply r = c.Call(http::methods::GET, kiln::kNodesPath);
    if (r.code != 200) return ServerError(r, c);
    if (PrintStructured(r.body, output)) return 0;
    const bool wide = output == "wide";
    std::vector<std::vector<std::string>> rows = {
        {"NAME", "STATUS", "CPUS", "GPUS", "REPLICAS", "LAST-SEEN"}};
    if (wide) {
      rows[0].push_back("ZONE");
      rows[0].push_back("GENERATION");
      rows[0].push_back("REFUSED");
    }
    for (const auto& n : r.body["items"]) {
      if (!name.empty() && n.value("name", "") != name) continue;
      int serving = 0, warm = 0;
      for (const auto& rep : n["replicas"]) {
        if (rep.value("state", "") == "SERVING") serving++;
        if (rep.value("state", "") == "WARM") warm++;
      }
      rows.push_back({n.value("name", ""), n.value("health", ""),
                      std::to_string(n.value("cpus", 0)), std::to_string(n.value("gpus", 0)),
                      std::to_string(serving) + " serving, " + std::to_string(warm) + " warm",
                      std::to_string(n.value("lastHeardSecondsAgo", 0)) + "s ago"});
      if (wide) {
        rows.back().push_back(Cell(n.value("zone", "")));
        rows.back().push_back(std::to_string(n.value("assignmentGeneration", 0)));
        rows.back().push_back(Cell(n.value("refused", "")));
      }
    }
    if (rows.size() == 1) {
      std::cerr << (name.empty() ? "No resources found.\n" : "Error from server (NotFound): node '" + name + "' not found\n");
      return name.empty() ? 0 : 1;
    }
    PrintRows(rows);
    return 0;
  }
  if (del->parsed() && (type == "node" || type == "nodes" || type == "no")) {
    Reply r = c.Call(http::methods::DEL, std::string(kiln::kNodesPath) + "/" +
                                             web::uri::encode_data_string(name));
    if (r.code != 200) return ServerError(r, c);
    std::cout << "node \"" << name << "\" deleted\n";
    return 0;
  }
  if (get->parsed() || del->parsed()) {
    if (!IsDeploymentType(type)) {
      std::cerr << "error: the server doesn't have a resource type \"" << type
                << "\" (kilnctl knows: deployments, nodes, replicas, events)\n";
      return 1;
    }
  }
  if (get->parsed()) {
    std::string path = std::string(kiln::kDeploymentsPath) + (name.empty() ? "" : "/" + name);
    Reply r = c.Call(http::methods::GET, path);
    if (r.code != 200) return ServerError(r, c);
    if (!PrintStructured(r.body, output)) {
      std::vector<json> items;
      if (name.empty()) {
        for (const auto& o : r.body["items"]) items.push_back(o);
        if (items.empty()) {
          std::cerr << "No resources found.\n";
          return 0;
        }
      } else {
        items.push_back(r.body);
      }
      PrintTable(items, output == "wide");
    }
    return 0;
  }
  if (del->parsed()) {
    Reply r = c.Call(http::methods::DEL, std::string(kiln::kDeploymentsPath) + "/" + name);
    if (r.code != 200) return ServerError(r, c);
    std::cout << kResource << " \"" << name << "\" deleted\n";
    return 0;
  }
  if (scale->parsed()) {
    json body = {{"spec", {{"replicas", replicas}}}};
    Reply r = c.Call(http::methods::PUT, std::string(kiln::kDeploymentsPath) + "/" + name + "/scale",
                     body.dump());
    if (r.code != 200) return ServerError(r, c);
    std::cout << kResource << "/" << name << " scaled\n";
    return 0;
  }
  return 2;
}
