#include "agent/agent.h"

#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <systemd/sd-journal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <tuple>

#include "agent/admin_server.h"
#include "agent/assignment_file.h"
#include "agent/controller_client.h"
#include "agent/cpu_allocator.h"
#include "agent/fake_gpu_driver.h"
#include "agent/nvml_driver.h"
#include "agent/router.h"
#include "common/cpu_list.h"
#include "common/filesystem.h"
#include "common/http_server.h"
#include "common/idle_spin.h"
#include "common/logging.h"
#include "common/pinning.h"
#include "common/status.h"
#include "nlohmann/json.hpp"
#include "warm_pool/pool_plan.h"

namespace kiln {

namespace fs = std::filesystem;

namespace {

// The time on the monotonic clock, from an arbitrary start.
absl::Duration MonotonicNow() {
  return absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
}

// How long each EXTEND_TIMEOUT_USEC gives systemd's start timeout, sent every 5 s until READY.
constexpr absl::Duration kStartExtension = absl::Seconds(30);

// How long the loop waits for a runtime's control answer before it goes on without it (a
// healthy runtime answers in well under a millisecond; a Promote that warms a parked GPU up
// takes longer, and its answer wakes the loop when it comes).
constexpr absl::Duration kControlInlineWait = absl::Milliseconds(20);

std::shared_ptr<spdlog::logger> Log() { return GetLogger("agent"); }

std::string Escape(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

// True when stderr is connected to the journal (systemd sets JOURNAL_STREAM to its
// device:inode): replica events then go to journald with structured fields.
bool StderrIsJournal() {
  const char* js = getenv("JOURNAL_STREAM");
  if (js == nullptr) return false;
  struct stat st;
  if (fstat(2, &st) != 0) return false;
  std::string want = std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
  return want == js;
}

// A label name or value: at most 63 of [A-Za-z0-9-_.], alphanumeric at both ends.
bool LabelWord(std::string_view w) {
  if (w.size() > 63) return false;
  if (w.empty()) return true;
  auto alnum = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; };
  if (!alnum(w.front()) || !alnum(w.back())) return false;
  return std::all_of(w.begin(), w.end(),
                     [&](char c) { return alnum(c) || c == '-' || c == '_' || c == '.'; });
}

// A DNS subdomain: at most 253, lowercase alphanumeric, '-' and '.', alphanumeric at both ends.
bool DnsSubdomain(std::string_view d) {
  if (d.empty() || d.size() > 253) return false;
  auto ok_end = [](char c) { return std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)); };
  if (!ok_end(d.front()) || !ok_end(d.back())) return false;
  return std::all_of(d.begin(), d.end(), [&](char c) { return ok_end(c) || c == '-' || c == '.'; });
}

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> ParseNodeLabels(
    const std::vector<std::string>& flags) {
  std::map<std::string, std::string> labels;
  for (const auto& f : flags) {
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError("--label '" + f + "': " + why);
    };
    const size_t eq = f.find('=');
    if (eq == std::string::npos) return bad("must be KEY=VALUE");
    const std::string key = f.substr(0, eq);
    const std::string value = f.substr(eq + 1);
    const size_t slash = key.find('/');
    const std::string name = slash == std::string::npos ? key : key.substr(slash + 1);
    if (slash != std::string::npos && !DnsSubdomain(key.substr(0, slash))) {
      return bad("the key's prefix must be a DNS subdomain (lowercase, at most 253 characters)");
    }
    if (name.empty() || !LabelWord(name)) {
      return bad("the key's name must be 1..63 of A-Z a-z 0-9 - _ . starting and ending "
                 "alphanumeric");
    }
    if (!LabelWord(value)) {
      return bad("the value must be at most 63 of A-Z a-z 0-9 - _ . starting and ending "
                 "alphanumeric");
    }
    if (!labels.emplace(key, value).second) return bad("the key '" + key + "' is given twice");
  }
  return labels;
}

absl::Status ValidateAgentOptions(const AgentOptions& o) {
  if (o.node_name.empty()) return absl::InvalidArgumentError("--node-name: must not be empty");
  if (o.state_dir.empty() || o.state_dir[0] != '/') {
    return absl::InvalidArgumentError("--state-dir: must be an absolute path");
  }
  if (o.state_dir.size() > 60) {
    return absl::InvalidArgumentError(
        "--state-dir: at most 60 characters (control sockets live under it)");
  }
  if (access(o.runtime_binary.c_str(), X_OK) != 0) {
    return absl::InvalidArgumentError("--runtime-binary: '" + o.runtime_binary +
                                      "' is not an executable");
  }
  for (auto [flag, port] : {std::pair<const char*, int>{"--admin-port", o.admin_port},
                             {"--grpc-port", o.grpc_port},
                             {"--http-port", o.http_port}}) {
    if (port < 0 || port > 65535) {
      return absl::InvalidArgumentError(std::string(flag) + ": must be in 0..65535");
    }
  }
  if (o.reserved_cpus < 0 || o.reserved_cpus > 64) {
    return absl::InvalidArgumentError("--reserved-cpus: must be in 0..64");
  }
  if (o.start_timeout < absl::ZeroDuration() || o.start_timeout > absl::Hours(24)) {
    return absl::InvalidArgumentError("--start-timeout-ms: must be in 0..86400000");
  }
  if (o.stop_timeout < absl::ZeroDuration() || o.stop_timeout > absl::Hours(1)) {
    return absl::InvalidArgumentError("--stop-timeout-ms: must be in 0..3600000, got " +
                                      std::to_string(absl::ToInt64Milliseconds(o.stop_timeout)));
  }
  if (absl::Status s = CheckLogLevel(o.runtime_log_level); !s.ok()) {
    return absl::InvalidArgumentError("--runtime-log-level: " + std::string(s.message()));
  }
  if (o.runtime_idle_spin_us < 0 || o.runtime_idle_spin_us > kMaxIdleSpinMicros) {
    return absl::InvalidArgumentError("--runtime-idle-spin-us: must be in 0.." +
                                      std::to_string(kMaxIdleSpinMicros) + ", got " +
                                      std::to_string(o.runtime_idle_spin_us));
  }
  if (o.runtime_model_cpus < 0 || o.runtime_model_cpus > kMaxModelCpus) {
    return absl::InvalidArgumentError("--runtime-model-cpus: must be in 0.." +
                                      std::to_string(kMaxModelCpus) + ", got " +
                                      std::to_string(o.runtime_model_cpus));
  }
  if (o.router_busy_poll_us < 0 || o.router_busy_poll_us > 100000) {
    return absl::InvalidArgumentError("--router-busy-poll-us: must be in 0..100000");
  }
  if (o.router_busy_poll_threads < 0 || o.router_busy_poll_threads > 64) {
    return absl::InvalidArgumentError("--router-busy-poll-threads: must be in 0..64");
  }
  if (o.router_http_threads < 1 || o.router_http_threads > 64) {
    return absl::InvalidArgumentError("--router-http-threads: must be in 1..64");
  }
  if (!o.assignment_file.empty() && !o.controller.empty()) {
    return absl::InvalidArgumentError(
        "--controller: give either --assignment-file or --controller, not both");
  }
  if (o.controller_tls.any() || !o.controller_server_name.empty()) {
    if (o.controller.empty()) {
      return absl::InvalidArgumentError(
          (o.controller_tls.any() ? o.controller_tls.ca_flag : std::string("--controller-server-name")) +
          ": only with --controller");
    }
    KILN_RETURN_IF_ERROR(MakeChannelCredentials(o.controller_tls).status());
  }
  for (auto [flag, n] : {std::pair<const char*, int>{"--prestart-per-gpu", o.prestart_per_gpu},
                          {"--prestart-cpu", o.prestart_cpu}}) {
    if (n < 0 || n > 16) return absl::InvalidArgumentError(std::string(flag) + ": must be in 0..16");
  }
  if (o.tick < absl::Milliseconds(10) || o.tick > absl::Seconds(10)) {
    return absl::InvalidArgumentError("--tick-ms: must be in 10..10000");
  }
  if (o.inference_probe_interval != absl::ZeroDuration() &&
      (o.inference_probe_interval < absl::Milliseconds(100) ||
       o.inference_probe_interval > absl::Hours(1))) {
    return absl::InvalidArgumentError(
        "--inference-probe-interval-ms: must be 0 (off) or in 100..3600000, got " +
        std::to_string(absl::ToInt64Milliseconds(o.inference_probe_interval)));
  }
  if (o.inference_probe_timeout < absl::Milliseconds(10) ||
      o.inference_probe_timeout > absl::Minutes(1)) {
    return absl::InvalidArgumentError(
        "--inference-probe-timeout-ms: must be in 10..60000, got " +
        std::to_string(absl::ToInt64Milliseconds(o.inference_probe_timeout)));
  }
  if (o.inference_probe_failures < 0 || o.inference_probe_failures > 100) {
    return absl::InvalidArgumentError(
        "--inference-probe-failures: must be in 0..100 (0 = never restart), got " +
        std::to_string(o.inference_probe_failures));
  }
  return ParsePowerMode(o.gpu_power).status();
}

absl::StatusOr<std::unique_ptr<Agent>> Agent::Create(AgentOptions options, Clock* clock) {
  KILN_RETURN_IF_ERROR(ValidateAgentOptions(options));
  std::unique_ptr<GpuDriver> gpus;
  if (!options.fake_gpus.empty()) {
    KILN_ASSIGN_OR_RETURN(auto fake, FakeGpuDriver::ParseSpec(options.fake_gpus));
    gpus = std::make_unique<FakeGpuDriver>(std::move(fake));
    Log()->warn("--fake-gpus {}: these GPUs are FAKE; their replicas run on cpu",
                options.fake_gpus);
  } else {
    auto nvml = LoadNvmlDriver();
    if (nvml.ok()) {
      gpus = std::move(*nvml);
    } else {
      Log()->info("no GPUs: {}", std::string(nvml.status().message()));
    }
  }
  TopologyOptions topo;
  topo.sysfs_root = options.sysfs_root;
  std::ifstream cg("/proc/self/cgroup");
  std::stringstream cgtext;
  cgtext << cg.rdbuf();
  topo.cgroup_path = CgroupV2Path(cgtext.str());
  topo.affinity = AllowedCpus();
  RootedFilesystem fs;
  auto topology = DiscoverTopology(fs, gpus.get(), topo);
  if (!topology.ok()) return Annotate(topology.status(), "--sysfs-root " + options.sysfs_root);
  std::unique_ptr<Agent> agent(
      new Agent(std::move(options), clock, std::move(*topology), std::move(gpus)));
  KILN_RETURN_IF_ERROR(agent->supervisor_->Recover());
  if (!agent->options_.assignment_file.empty()) {
    KILN_ASSIGN_OR_RETURN(AssignmentFile file, LoadAssignmentFile(agent->options_.assignment_file));
    KILN_RETURN_IF_ERROR(
        Annotate(agent->ApplyFile(file, ++agent->generation_), agent->options_.assignment_file));
    agent->routing_ = file.routing;
  }
  if (!agent->options_.controller.empty()) {
    // Static stability: the last assignment the controller sent, until it sends another.
    v1::Assignment a;
    std::ifstream in(agent->options_.state_dir + "/assignment.pb", std::ios::binary);
    if (in && a.ParseFromIstream(&in) && ValidateAssignment(a).ok() &&
        agent->supervisor_->Apply(a).ok()) {
      agent->generation_ = a.generation();
      Log()->info("serving the controller's last assignment (generation {}) until it reconnects",
                  a.generation());
    }
    v1::RoutingTable t;
    std::ifstream rin(agent->options_.state_dir + "/routing.pb", std::ios::binary);
    if (rin && t.ParseFromIstream(&rin) && ValidateRoutingTable(t).ok()) {
      agent->routing_ = t;
      agent->routing_generation_ = t.generation();
    }
  }
  return agent;
}

Agent::Agent(AgentOptions options, Clock* clock, Topology topology, std::unique_ptr<GpuDriver> gpus)
    : options_(std::move(options)), clock_(clock), topology_(std::move(topology)), gpus_(std::move(gpus)) {
  const Topology& t = topology_;
  Log()->info("node {}: {} CPUs online, allowed {}, {} NUMA node(s), {} GPU(s) via {}",
              options_.node_name, t.online_cpus.size(), FormatCpuList(t.allowed_cpus),
              t.numa_nodes.size(), t.gpus.size(), t.gpu_driver);
  for (const auto& g : t.gpus) {
    Log()->info("gpu {}: {} {} bus {} numa {} local cpus {}{}", g.identity.index, g.identity.name,
                g.identity.uuid, g.pci_bus_id, g.numa_node, FormatCpuList(g.local_cpus),
                t.fake_gpus ? " (FAKE)" : "");
  }
  launcher_ = std::make_unique<RealProcessLauncher>();
  // A control call waits a moment for its answer on the loop; past that the loop goes on and
  // the answer, when it comes, wakes it. One wedged runtime must not hold up the others.
  clients_ = std::make_unique<GrpcRuntimeClientFactory>(absl::Seconds(2), kControlInlineWait,
                                                        [this] { Wake(); });
  stat_client_factory_ = std::make_unique<GrpcRuntimeClientFactory>(absl::Seconds(2));
  prober_ = MakeGrpcInferenceProber(options_.inference_probe_timeout);
  SupervisorOptions so;
  so.runtime_binary = options_.runtime_binary;
  so.state_dir = options_.state_dir;
  so.stop_timeout = options_.stop_timeout;
  so.start_timeout = options_.start_timeout;
  so.reserved_cpus = options_.reserved_cpus;
  so.fake_gpus = t.fake_gpus;
  so.runtime_log_level = options_.runtime_log_level;
  so.runtime_malloc_huge_pages = options_.runtime_malloc_huge_pages;
  so.runtime_idle_spin_us = options_.runtime_idle_spin_us;
  so.runtime_model_cpus = options_.runtime_model_cpus;
  so.prestart_per_gpu = options_.prestart_per_gpu;
  so.prestart_cpu = options_.prestart_cpu;
  so.inference_probe_interval = options_.inference_probe_interval;
  so.inference_probe_failures = options_.inference_probe_failures;
  // With a controller, replicas on a failing GPU serve until it has moved them elsewhere.
  so.drain_on_unhealthy_gpu = options_.controller.empty();
  so.before_leaving_routing = [this] { RefreshRoutes(); };
  PowerMode mode = *ParsePowerMode(options_.gpu_power);
  PowerPolicy policy;
  policy.park_warm_replicas = !t.fake_gpus && mode != PowerMode::kOff;
  so.park_warm_replicas = policy.park_warm_replicas;
  const bool journal = StderrIsJournal();
  auto log = [this, journal](const std::string& s) {
    // "replica ID: ..." lines carry MODEL, VERSION, REPLICA and GPU_UUID fields in journald.
    if (journal && s.rfind("replica ", 0) == 0 && s.find(':') != std::string::npos && supervisor_) {
      std::string id = s.substr(8, s.find(':') - 8);
      auto snapshot = supervisor_->Snapshot();
      for (const auto& v : *snapshot) {
        if (v.spec.replica_id() != id) continue;
        std::string gpu = v.spec.gpu() >= 0 && v.spec.gpu() < static_cast<int>(topology_.gpus.size())
                              ? topology_.gpus[v.spec.gpu()].identity.uuid
                              : "";
        if (sd_journal_send("MESSAGE=%s", s.c_str(), "PRIORITY=6", "SYSLOG_IDENTIFIER=kiln-agent",
                            "REPLICA=%s", id.c_str(), "MODEL=%s", v.spec.model().c_str(),
                            "VERSION=%s", v.spec.version().c_str(), "GPU_UUID=%s", gpu.c_str(),
                            nullptr) >= 0) {
          return;
        }
        break;  // the journal refused it: plain log below
      }
    }
    Log()->info("{}", s);
  };
  supervisor_ = std::make_unique<Supervisor>(so, topology_, launcher_.get(), clients_.get(), clock_,
                                             log, prober_.get());
  // The default policy: persistence on; a GPU holding only WARM replicas (or none) is capped at
  // its minimum power limit; a serving GPU runs at its default limit.
  policy.idle.persistence = true;
  policy.warm_only.persistence = true;
  policy.serving.persistence = true;
  // Each card's own bounds: a node's GPUs need not be alike.
  policy.idle.card_limit = PowerKnobs::CardLimit::kMinimum;
  policy.warm_only.card_limit = PowerKnobs::CardLimit::kMinimum;
  policy.serving.card_limit = PowerKnobs::CardLimit::kDefault;
  if (gpus_) {
    std::vector<int> indexes;
    for (const auto& g : t.gpus) indexes.push_back(g.identity.index);
    // What needs a GPU reset outlives an agent restart (until the node reboots).
    std::string boot_id;
    std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
    monitor_ = std::make_unique<GpuMonitor>(
        gpus_.get(), indexes,
        GpuMonitor::Persistence{options_.state_dir + "/gpu_health.json", boot_id},
        /*clock=*/nullptr);  // monotonic: an Xid's age must not follow a stepped wall clock
    power_ = std::make_unique<GpuPowerManager>(
        gpus_.get(), mode, policy, [](const std::string& s) { Log()->info("power: {}", s); },
        options_.state_dir + "/gpu_power_originals.json");
  }
}

Agent::~Agent() {
  Stop();
  // The runtime clients end their calls on the way while Wake()'s mutex still exists: a late
  // answer wakes the loop.
  supervisor_.reset();
  absl::MutexLock lock(&load_mu_);
  stat_clients_.clear();
}

absl::Status Agent::Start() {
  AdminHandlers h;
  h.live = [this]() { return live(); };
  h.ready = [this]() { return ready(); };
  h.metrics = [this]() { return MetricsText(); };
  h.replicas = [this]() { return ReplicasJson(); };
  if (topology_.fake_gpus) {
    auto* fake = static_cast<FakeGpuDriver*>(gpus_.get());
    h.inject_xid = [fake](int index, uint64_t xid) -> absl::Status {
      auto count = fake->DeviceCount();
      if (!count.ok()) return count.status();
      if (index >= *count) {
        return absl::NotFoundError("index: no fake GPU " + std::to_string(index) + " (there are " +
                                   std::to_string(*count) + ")");
      }
      Log()->warn("fake GPU {}: injected Xid {}", index, xid);
      fake->InjectXid(index, xid);
      return absl::OkStatus();
    };
  }
  Router::Options ro;
  ro.bind_address = options_.ingress_bind;
  ro.grpc_port = options_.grpc_port;
  ro.node_name = options_.node_name;
  ro.http_port = options_.http_port;
  ro.busy_poll = {options_.router_busy_poll_us, options_.router_busy_poll_threads};
  ro.http_threads = options_.router_http_threads;
  // Socket activation (kiln-agent-grpc.socket, kiln-agent-http.socket): the router serves the
  // sockets systemd holds, which queue connections while the agent restarts.
  char** names = nullptr;
  const int handed = sd_listen_fds_with_names(1, &names);
  if (handed < 0) return absl::InternalError("LISTEN_FDS: " + std::string(strerror(-handed)));
  absl::Status names_ok = absl::OkStatus();
  for (int i = 0; i < handed; ++i) {
    const std::string name = names && names[i] ? names[i] : "";
    if (name == "grpc") {
      ro.grpc_listen_fd = SD_LISTEN_FDS_START + i;
    } else if (name == "http") {
      ro.http_listen_fd = SD_LISTEN_FDS_START + i;
    } else if (names_ok.ok()) {
      names_ok = absl::InvalidArgumentError(
          "LISTEN_FDNAMES: socket " + std::to_string(i) + " is named '" + name +
          "'; the agent serves sockets named grpc and http (FileDescriptorName=)");
    }
  }
  for (int i = 0; names && i < handed; ++i) free(names[i]);
  free(names);
  KILN_RETURN_IF_ERROR(names_ok);
  if (handed > 0) {
    Log()->info("router: serving {} socket(s) handed over by the service manager{}{}", handed,
                ro.grpc_listen_fd >= 0 ? " (grpc)" : "", ro.http_listen_fd >= 0 ? " (http)" : "");
    // The socket units decide the ports now: say so where the flags ask for others.
    for (auto [fd, flag, port] : {std::tuple<int, const char*, int>{ro.grpc_listen_fd, "--grpc-port", ro.grpc_port},
                                  {ro.http_listen_fd, "--http-port", ro.http_port}}) {
      if (fd >= 0 && port != 0 && LocalPort(fd) != port) {
        Log()->warn("{} {} is not used: the router serves the socket handed over on port {} "
                    "(set the port in the socket unit)",
                    flag, port, LocalPort(fd));
      }
    }
  }
  KILN_ASSIGN_OR_RETURN(
      router_, Router::Start(ro, std::make_shared<RouterTable>(BuildRouterTable(
                                     routing_, *supervisor_->Snapshot(), options_.node_name))));
  // After the router (its /metrics read it) and stopped before it.
  KILN_ASSIGN_OR_RETURN(admin_, StartAdminServer(options_.admin_bind, options_.admin_port, h));
  Log()->info("admin listening admin_port={} (/healthz /readyz /metrics /v1/replicas)",
              admin_->port());
  last_tick_mono_ms_ = absl::ToInt64Milliseconds(MonotonicNow());
  launcher_->NotifyAdoptedExits([this] { Wake(); });
  loop_ = std::thread([this]() { Loop(); });
  if (!options_.controller.empty()) {
    ControllerClient::Hooks hooks;
    hooks.make_register = [this]() { return MakeRegister(); };
    hooks.make_status = [this]() { return MakeStatus(); };
    hooks.apply_assignment = [this](const v1::Assignment& a) { return ApplyFromController(a); };
    hooks.apply_routing = [this](const v1::RoutingTable& t) {
      return ApplyRoutingFromController(t);
    };
    hooks.log = [](const std::string& s) { Log()->info("{}", s); };
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
    if (options_.controller_tls.any()) {
      KILN_ASSIGN_OR_RETURN(creds, MakeChannelCredentials(options_.controller_tls));
    }
    controller_ = std::make_unique<ControllerClient>(options_.controller, hooks, creds,
                                                     options_.controller_server_name);
    controller_->Start();
  }
  return absl::OkStatus();
}

absl::Status Agent::RunOnLoop(std::function<absl::Status()> task) {
  return tasks_.Run(std::move(task), absl::Seconds(10));
}

absl::Status Agent::Persist(const std::string& name, const google::protobuf::Message& m) {
  const std::string path = options_.state_dir + "/" + name;
  std::string bytes;
  if (!m.SerializeToString(&bytes)) return absl::DataLossError(path + ": cannot serialize");
  return ReplaceFile(path, bytes);
}

absl::Status Agent::ApplyFromController(const v1::Assignment& a) {
  KILN_RETURN_IF_ERROR(ValidateAssignment(a));
  return RunOnLoop([this, a]() -> absl::Status {
    if (a.generation() == generation_ && generation_ != 0) return absl::OkStatus();  // no-op
    // Saved before it is applied, and Acked only once saved: an agent restarted at any moment
    // serves what the controller was told it serves (or, mid-apply, the one before).
    const std::string path = options_.state_dir + "/assignment.pb";
    const absl::StatusOr<std::string> previous = RootedFilesystem().ReadFile(path);  // none yet
    if (absl::Status p = Persist("assignment.pb", a); !p.ok()) {
      return absl::UnavailableError("not applied: it cannot be saved (" + std::string(p.message()) +
                                    ")");
    }
    if (absl::Status s = supervisor_->Apply(a); !s.ok()) {
      std::error_code ec;
      absl::Status back = previous.ok() ? ReplaceFile(path, *previous) : absl::OkStatus();
      if (!previous.ok()) fs::remove(path, ec);
      if (!back.ok()) Log()->error("{}", std::string(back.message()));
      return s;
    }
    generation_ = a.generation();
    Log()->info("controller assignment generation {} applied: {} replica(s)", a.generation(),
                a.replicas_size());
    return absl::OkStatus();
  });
}

absl::Status Agent::ApplyRoutingFromController(const v1::RoutingTable& t) {
  KILN_RETURN_IF_ERROR(ValidateRoutingTable(t));
  return RunOnLoop([this, t]() -> absl::Status {
    routing_ = t;
    routing_generation_ = t.generation();
    absl::Status p = Persist("routing.pb", t);
    if (!p.ok()) Log()->error("{}", std::string(p.message()));
    return absl::OkStatus();
  });
}

namespace {
v1::ReplicaStatus ToStatus(const ReplicaView& v) {
  v1::ReplicaStatus s;
  s.set_replica_id(v.spec.replica_id());
  s.set_model(v.spec.model());
  s.set_version(v.spec.version());
  s.set_device(v.device);
  s.set_state(v.state);
  s.set_healthy(v.healthy);
  s.set_health_reason(v.health_reason.empty() ? v.last_error : v.health_reason);
  s.set_pid(v.pid);
  s.set_restarts(v.restarts);
  s.set_crash_loop(v.crash_loop);
  s.set_cpus(v.cpus);
  s.set_gpu_memory_bytes(v.spec.gpu_memory_bytes());
  s.set_measured_gpu_memory_bytes(v.device_memory_bytes);
  return s;
}
}  // namespace

v1::Register Agent::MakeRegister() {
  v1::Register r;
  r.set_node_name(options_.node_name);
  r.set_agent_version("0.1.0");
  for (const auto& [k, v] : options_.labels) (*r.mutable_labels())[k] = v;
  for (const auto& n : topology_.numa_nodes) {
    auto* m = r.add_numa_nodes();
    m->set_id(n.id);
    m->set_cpus(FormatCpuList(n.cpus));
    m->set_memory_bytes(n.memory_bytes);
  }
  r.set_allowed_cpus(FormatCpuList(topology_.allowed_cpus));
  r.set_cpu_capacity(static_cast<int32_t>(topology_.allowed_cpus.size()) -
                     std::min<int32_t>(options_.reserved_cpus,
                                       static_cast<int32_t>(topology_.allowed_cpus.size())));
  for (const auto& g : topology_.gpus) {
    auto* gi = r.add_gpus();
    gi->set_index(g.identity.index);
    gi->set_uuid(g.identity.uuid);
    gi->set_name(g.identity.name);
    gi->set_pci_bus_id(g.pci_bus_id);
    gi->set_numa_node(g.numa_node);
    gi->set_local_cpus(FormatCpuList(g.local_cpus));
    gi->set_memory_bytes(g.identity.memory_total_bytes);
    gi->set_power_limit_min_mw(g.identity.power_limit_min_mw);
    gi->set_power_limit_max_mw(g.identity.power_limit_max_mw);
    gi->set_fake(topology_.fake_gpus);
  }
  auto snapshot = supervisor_->Snapshot();
  for (const auto& v : *snapshot) *r.add_replicas() = ToStatus(v);
  std::string host = options_.ingress_bind == "0.0.0.0" ? options_.node_name : options_.ingress_bind;
  r.set_ingress_grpc_address(host + ":" + std::to_string(ingress_grpc_port()));
  r.set_ingress_http_address(host + ":" + std::to_string(ingress_http_port()));
  return r;
}

std::map<std::string, absl::StatusOr<v1::RuntimeStats>> Agent::ReplicaStats(
    StatsCaller caller, const std::vector<std::string>& sockets) {
  std::map<std::string, std::shared_ptr<RuntimeClient>> clients;
  {
    absl::MutexLock lock(&load_mu_);
    for (const std::string& socket : sockets) {
      auto& c = stat_clients_[{caller, socket}];
      if (!c) c = stat_client_factory_->Connect(socket);
      clients[socket] = c;
    }
  }
  for (auto& [socket, client] : clients) client->StartStats();
  std::map<std::string, absl::StatusOr<v1::RuntimeStats>> out;
  for (auto& [socket, client] : clients) out.emplace(socket, client->AwaitStats());
  return out;
}

absl::Time LastActive(const std::optional<ActivitySample>& previous, uint64_t requests,
                      absl::Time now, absl::Time last_serving) {
  if (!previous) return std::min(now, last_serving);
  if (requests == previous->requests) return previous->active;
  return now;
}

v1::NodeStatus Agent::MakeStatus() {
  v1::NodeStatus st;
  absl::Time now = absl::Now();
  auto snapshot = supervisor_->Snapshot();
  std::vector<std::string> sockets;
  for (const auto& v : *snapshot) {
    if (v.pid > 0 && !v.socket.empty()) sockets.push_back(v.socket);
  }
  auto all_stats = ReplicaStats(kStatusReport, sockets);
  for (const auto& v : *snapshot) {
    v1::ReplicaStatus* r = st.add_replicas();
    *r = ToStatus(v);
    if (v.pid <= 0 || v.socket.empty()) continue;
    // When it last served: now while it does (the state file's time may be hours old for a
    // replica adopted SERVING), else the supervisor's record.
    const absl::Time last_serving = v.state == v1::SERVING ? now : std::min(now, v.last_used);
    const absl::StatusOr<v1::RuntimeStats>& stats = all_stats.at(v.socket);
    absl::MutexLock lock(&load_mu_);
    if (!stats.ok()) {
      // No numbers this time; its idle time still counts from its last known activity.
      auto seen = last_stats_.find(v.socket);
      r->set_idle_ms(absl::ToInt64Milliseconds(
          now - (seen != last_stats_.end() ? seen->second.active : last_serving)));
      continue;
    }
    v1::ReplicaLoad* load = r->mutable_load();
    load->set_in_flight(stats->in_flight());
    load->set_queue_depth(stats->queue_depth());
    load->set_latency_p50_micros(stats->latency_p50_micros());
    load->set_latency_p99_micros(stats->latency_p99_micros());
    load->set_requests(stats->requests());
    load->set_errors(stats->errors());
    if (stats->batches() > 0) {
      load->set_mean_batch_size(stats->batch_size().sum() / static_cast<double>(stats->batches()));
    }
    auto prev = last_stats_.find(v.socket);
    std::optional<ActivitySample> previous;
    if (prev != last_stats_.end()) {
      previous = ActivitySample{prev->second.stats.requests(), prev->second.active};
    }
    const absl::Time active = LastActive(previous, stats->requests(), now, last_serving);
    if (prev != last_stats_.end() && stats->requests() >= prev->second.stats.requests()) {
      double secs = absl::ToDoubleSeconds(now - prev->second.at);
      uint64_t dr = stats->requests() - prev->second.stats.requests();
      uint64_t de = stats->errors() - std::min(stats->errors(), prev->second.stats.errors());
      if (secs > 0) load->set_qps(dr / secs);
      if (dr > 0) load->set_error_rate(static_cast<double>(de) / dr);
    }
    r->set_idle_ms(absl::ToInt64Milliseconds(now - active));
    last_stats_[v.socket] = {now, *stats, active};
  }
  {
    // Replicas gone since (every new replica has a socket of its own): nothing kept for them.
    std::set<std::string> live;
    for (const auto& v : *snapshot) live.insert(v.socket);
    absl::MutexLock lock(&load_mu_);
    std::erase_if(last_stats_, [&](const auto& e) { return !live.count(e.first); });
    std::erase_if(stat_clients_, [&](const auto& e) { return !live.count(e.first.second); });
  }
  {
    absl::MutexLock lock(&health_mu_);
    for (const auto& g : topology_.gpus) {
      v1::GpuStatus* gs = st.add_gpus();
      gs->set_index(g.identity.index);
      gs->set_uuid(g.identity.uuid);
      auto h = gpu_health_.find(g.identity.index);
      gs->set_healthy(h == gpu_health_.end() || h->second.healthy);
      if (h != gpu_health_.end()) {
        gs->set_degraded(h->second.degraded);
        for (const auto& reason : h->second.reasons) gs->add_reasons(reason);
      }
      if (gpus_) {
        auto t = gpus_->Read(g.identity.index);
        if (t.ok()) {
          gs->set_utilization_pct(t->utilization_gpu_pct);
          gs->set_memory_used_bytes(t->memory_used_bytes);
          gs->set_memory_total_bytes(t->memory_total_bytes);
          gs->set_power_draw_mw(t->power_draw_mw);
          gs->set_power_limit_mw(t->power_limit_mw);
          gs->set_temperature_c(t->temperature_c);
          gs->set_sm_clock_mhz(t->sm_clock_mhz);
        }
      }
    }
  }
  st.set_assignment_generation(supervisor_->applied_generation());
  st.set_routing_generation(routing_generation_.load());
  return st;
}

int Agent::admin_port() const { return admin_ ? admin_->port() : 0; }
int Agent::ingress_grpc_port() const { return router_ ? router_->grpc_port() : 0; }
int Agent::ingress_http_port() const { return router_ ? router_->http_port() : 0; }

bool Agent::live() const {
  // The loop ticks every options_.tick; a loop silent for 30 ticks (and >= 5 s) is stalled.
  int64_t age = absl::ToInt64Milliseconds(MonotonicNow()) - last_tick_mono_ms_.load();
  return age < std::max<int64_t>(5000, 30 * absl::ToInt64Milliseconds(options_.tick));
}

absl::Status Agent::ApplyFile(const AssignmentFile& file, int64_t generation) {
  std::vector<PoolWanted> wanted;
  for (const auto& r : file.assignment.replicas()) {
    wanted.push_back({r.replica_id(), ReplicaShape(r), r.gpu(), r.gpu_memory_bytes()});
  }
  std::vector<PoolSpec> pools;
  std::map<std::string, const v1::ReplicaSpec*> pool_spec;  // by shape
  for (const auto& p : file.pools) {
    std::string shape = ReplicaShape(p.spec);
    pools.push_back({shape, p.size, PoolIdPrefix(p.spec), p.spec.gpu(), p.spec.gpu_memory_bytes()});
    pool_spec[shape] = &p.spec;
  }
  std::vector<PoolRunning> running;
  std::set<std::string> draining;
  auto snapshot = supervisor_->Snapshot();
  for (const auto& v : *snapshot) {
    if (v.removing) {
      draining.insert(v.spec.replica_id());
      continue;
    }
    bool loaded = v.phase == "RUNNING" && (v.state == v1::WARM || v.state == v1::SERVING);
    running.push_back({v.spec.replica_id(), ReplicaShape(v.spec),
                       IsPoolMemberId(v.spec.replica_id()), loaded, v.crash_loop, v.last_used});
  }
  std::map<int, int64_t> gpu_memory;
  for (const auto& g : topology_.gpus) {
    if (g.identity.memory_total_bytes > 0) gpu_memory[g.identity.index] = g.identity.memory_total_bytes;
  }
  PoolPlan plan = PlanNodePools(wanted, pools, running, gpu_memory, draining);
  std::set<std::string> existing;
  for (const auto& r : running) existing.insert(r.id);
  for (const auto& [from, to] : plan.renames) existing.insert(to);
  // Pool members are best-effort: members not running yet are dropped, newest first, while
  // the node lacks the CPUs for them, rather than the whole file being refused.
  std::vector<std::pair<std::string, std::string>> members;  // (shape, id)
  for (const auto& [shape, ids] : plan.members) {
    for (const auto& id : ids) members.emplace_back(shape, id);
  }
  for (;;) {
    v1::Assignment a = file.assignment;
    a.set_generation(generation);
    for (const auto& [shape, id] : members) {
      v1::ReplicaSpec* r = a.add_replicas();
      *r = *pool_spec.at(shape);
      r->set_replica_id(id);
    }
    absl::Status s = supervisor_->Apply(a, plan.renames);
    if (!absl::IsResourceExhausted(s)) {
      KILN_RETURN_IF_ERROR(s);
      break;
    }
    auto fresh = std::find_if(members.rbegin(), members.rend(),
                              [&](const auto& m) { return !existing.count(m.second); });
    if (fresh == members.rend()) return s;
    Log()->warn("warm pool member {} not started: {}", fresh->second, std::string(s.message()));
    members.erase(std::next(fresh).base());
  }
  for (const auto& id : plan.evicted) {
    Log()->info("warm pool member {} not kept: its GPU's memory is taken by the file's replicas", id);
  }
  return absl::OkStatus();
}

void Agent::RequestReload() {
  reload_ = true;
  Wake();
}

void Agent::ChildExited() { Wake(); }

void Agent::Wake() {
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

void Agent::Reload() {
  if (options_.assignment_file.empty()) return;
  auto file = LoadAssignmentFile(options_.assignment_file);
  absl::Status s = file.status();
  v1::RoutingTable previous = routing_;
  if (file.ok()) {
    routing_ = file->routing;  // what a replica leaving routing meanwhile is routed by
    s = ApplyFile(*file, generation_ + 1);
  }
  if (!s.ok()) {
    routing_ = std::move(previous);
    rejected_reloads_++;
    Log()->error("assignment file rejected, keeping generation {}: {}", generation_,
                 std::string(s.message()));
    return;
  }
  generation_++;
  Log()->info("assignment file reloaded: generation {}, {} replica(s), {} warm pool(s)",
              generation_, file->assignment.replicas_size(), file->pools.size());
}

void Agent::UpdatePower() {
  if (!power_) return;
  std::vector<int> gpus;
  for (const auto& g : topology_.gpus) gpus.push_back(g.identity.index);
  std::vector<GpuHolder> holders;
  for (const auto& v : *supervisor_->Snapshot()) {
    holders.push_back({v.spec.gpu(), v.spec.state() == v1::SERVING});
  }
  // A pre-started runtime holds its GPU's context while it waits (and until it has exited):
  // that GPU is not idle.
  for (const auto& p : *supervisor_->PrestartedSnapshot()) holders.push_back({p.gpu, false});
  for (const auto& [gpu, l] : ClassifyGpuLoads(gpus, holders)) {
    auto it = gpu_load_.find(gpu);
    if (it != gpu_load_.end() && it->second == l) continue;
    // A change that failed is tried again with backoff (PowerRetry): a card that refuses a
    // setting for good is not asked every pass.
    PowerRetry& retry = power_retry_[gpu];
    const absl::Time now = clock_->Now();
    if (!retry.Due(l, now)) continue;
    auto r = power_->Apply(gpu, l);
    if (!r.ok()) {
      const std::string why(r.status().message());
      if (retry.Failed(l, why, now)) Log()->error("power: gpu {}: {}", gpu, why);
      continue;
    }
    power_retry_.erase(gpu);
    gpu_load_[gpu] = l;
  }
}

void Agent::RefreshRoutes() {
  if (!router_ || !supervisor_) return;
  router_->SetTable(std::make_shared<RouterTable>(
      BuildRouterTable(routing_, *supervisor_->Snapshot(), options_.node_name)));
}

void Agent::PinAgent() {
  const std::set<int> held = supervisor_->HeldCpus();
  std::vector<int> want = AgentCpus(topology_.allowed_cpus, held, supervisor_->reserved_cpus());
  if (want == agent_cpus_) return;
  agent_cpus_ = want;  // a failure is logged once per change, not retried every pass
  if (absl::Status s = PinThisProcess(want, -1); !s.ok()) {
    Log()->warn("cannot keep the agent's threads on cpus {}: {}", FormatCpuList(want),
                std::string(s.message()));
    return;
  }
  Log()->info("agent threads on cpus {} (replicas hold {})", FormatCpuList(want),
              FormatCpuList(std::vector<int>(held.begin(), held.end())));
  absl::MutexLock lock(&cpus_mu_);
  agent_cpus_text_ = FormatCpuList(want);
}

void Agent::Loop() {
  uint64_t watchdog_usec = 0;
  bool watchdog = sd_watchdog_enabled(0, &watchdog_usec) > 0;
  // Watchdog pings and polls go by the monotonic clock: a wall clock stepped back (chrony at
  // boot) must neither stop the pings (systemd would kill a healthy agent) nor the GPU polls.
  absl::Duration last_watchdog = -absl::InfiniteDuration();
  absl::Duration last_extend = -absl::InfiniteDuration();
  bool notified_ready = false;
  bool settled_once = false;
  std::string last_status;
  int64_t logged_converged = -1;  // the generation last logged as served in full
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      wake_ = false;  // this pass takes whatever was posted before it
    }
    if (reload_.exchange(false)) Reload();
    tasks_.RunPending();
    if (monitor_ && MonotonicNow() - last_gpu_poll_ >= absl::Seconds(1)) {
      last_gpu_poll_ = MonotonicNow();
      monitor_->Poll();
      for (const auto& [gpu, xid] : monitor_->TakeApplicationXids()) {
        supervisor_->ProbeGpuSoon(gpu, "Xid " + std::to_string(xid) + ": " +
                                           ClassifyXid(xid).description);
      }
      for (const auto& [gpu, h] : monitor_->health()) {
        std::string why;
        for (const auto& r : h.reasons) why += (why.empty() ? "" : "; ") + r;
        supervisor_->SetGpuHealth(gpu, h.healthy, why);
      }
      absl::MutexLock lock(&health_mu_);
      gpu_health_ = monitor_->health();
    }
    supervisor_->Tick();
    // Routing follows the replicas: a replica that is not SERVING leaves routing at once (one
    // told to drain or demote has left it already: SupervisorOptions::before_leaving_routing).
    RefreshRoutes();
    UpdatePower();
    PinAgent();
    // Ready (/readyz, systemd's READY=1): an assignment is applied and, once since the agent
    // started, every replica settled (in its assigned state, crash-looping or held off a bad
    // GPU), so a rolling update waits for a restarted node's replicas. From then on it stays
    // ready: replicas coming up or going away in a scale step or rollout are out of routing
    // and do not take the node out of its Service.
    const bool converged = supervisor_->Converged();
    if (generation_ > 0 && !settled_once && supervisor_->Settled()) settled_once = true;
    const bool serving = generation_ > 0 && settled_once;
    ready_ = serving;
    converged_ = converged;
    std::string status;
    if (serving) {
      status = "serving generation " + std::to_string(generation_) +
               (converged ? ", every replica in its assigned state"
                          : ", replicas on their way to their assigned state");
    } else {
      status = generation_ > 0 ? "starting generation " + std::to_string(generation_) +
                                     "'s replicas"
                               : "waiting for an assignment";
    }
    if (status != last_status) {
      last_status = status;
      if (serving && !notified_ready) {
        notified_ready = true;
        sd_notifyf(0, "READY=1\nSTATUS=%s", status.c_str());
      } else {
        sd_notifyf(0, "STATUS=%s", status.c_str());
      }
    }
    if (converged && serving && generation_ != logged_converged) {
      logged_converged = generation_;
      Log()->info("serving the assignment (generation {})", generation_);
    }
    const absl::Duration mono = MonotonicNow();
    if (!notified_ready && mono - last_extend >= absl::Seconds(5)) {
      // Not READY yet (no assignment, or models still loading, for minutes maybe): systemd's
      // start timeout is pushed on while this loop turns, and runs out only if it stops.
      sd_notifyf(0, "EXTEND_TIMEOUT_USEC=%lld",
                 static_cast<long long>(absl::ToInt64Microseconds(kStartExtension)));
      last_extend = mono;
    }
    absl::Duration wait = options_.tick;
    if (watchdog) {
      const absl::Duration half = absl::Microseconds(watchdog_usec / 2);
      if (mono - last_watchdog >= half) {
        sd_notify(0, "WATCHDOG=1");
        last_watchdog = mono;
      }
      wait = std::min(wait, last_watchdog + half - mono);
    }
    last_tick_mono_ms_ = absl::ToInt64Milliseconds(mono);
    ticks_++;
    absl::MutexLock lock(&mu_);
    auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || wake_; };
    mu_.AwaitWithTimeout(absl::Condition(&woken), wait);
  }
  sd_notify(0, "STOPPING=1");
  if (options_.stop_replicas_on_exit) {
    v1::Assignment none;
    none.set_generation(generation_ + 1);
    (void)supervisor_->Apply(none);
    supervisor_->StopPrestarted();
    absl::Time deadline = absl::Now() + options_.stop_timeout + absl::Seconds(5);
    while ((!supervisor_->Snapshot()->empty() || !supervisor_->PrestartedSnapshot()->empty()) &&
           absl::Now() < deadline) {
      supervisor_->Tick();
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  if (power_) {
    absl::Status s = power_->RestoreAll();
    if (!s.ok()) Log()->error("power: restore: {}", std::string(s.message()));
  }
}

void Agent::Stop() {
  if (controller_) controller_->Stop();
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (loop_.joinable()) loop_.join();
  launcher_->NotifyAdoptedExits(nullptr);
  admin_.reset();
  router_.reset();
}

std::string Agent::ReplicasJson() const {
  nlohmann::json out = {{"node", options_.node_name}, {"ready", ready()}, {"converged", converged()}, {"replicas", nlohmann::json::array()}};
  {
    absl::MutexLock lock(&cpus_mu_);
    out["agent_cpus"] = agent_cpus_text_;
  }
  auto snapshot = supervisor_->Snapshot();
  for (const auto& v : *snapshot) {
    out["replicas"].push_back({{"id", v.spec.replica_id()},
                               {"model", v.spec.model()},
                               {"version", v.spec.version()},
                               {"gpu", v.spec.gpu()},
                               {"device", v.device},
                               {"assigned_state", v1::LifecycleState_Name(v.spec.state())},
                               {"state", v1::LifecycleState_Name(v.state)},
                               {"phase", v.phase},
                               {"pid", v.pid},
                               {"grpc_port", v.grpc_port},
                               {"http_port", v.http_port},
                               {"data_socket", v.data_socket},
                               {"restarts", v.restarts},
                               {"crash_loop", v.crash_loop},
                               {"healthy", v.healthy},
                               {"health_reason", v.health_reason},
                               {"adopted", v.adopted},
                               {"removing", v.removing},
                               {"cpus", v.cpus},
                               {"device_memory_bytes", v.device_memory_bytes},
                               {"last_error", v.last_error}});
  }
  out["prestarted"] = nlohmann::json::array();
  for (const auto& p : *supervisor_->PrestartedSnapshot()) {
    out["prestarted"].push_back({{"name", p.name},
                                 {"gpu", p.gpu},
                                 {"numa_node", p.numa_node},
                                 {"pid", p.pid},
                                 {"ready", p.ready},
                                 {"adopted", p.adopted},
                                 {"stopping", p.stopping},
                                 {"loading_for", p.loading_for}});
  }
  return out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string Agent::MetricsText() {
  std::ostringstream m;
  std::string node = "node=\"" + Escape(options_.node_name) + "\"";
  m << "# HELP kiln_agent_ready 1 when an assignment is applied and, once since the agent "
       "started, every replica settled.\n"
    << "# TYPE kiln_agent_ready gauge\n"
    << "kiln_agent_ready{" << node << "} " << (ready() ? 1 : 0) << "\n"
    << "# HELP kiln_agent_converged 1 when every assigned replica is in its assigned state.\n"
    << "# TYPE kiln_agent_converged gauge\n"
    << "kiln_agent_converged{" << node << "} " << (converged() ? 1 : 0) << "\n"
    << "# HELP kiln_agent_assignment_reloads_rejected_total Assignment files rejected.\n"
    << "# TYPE kiln_agent_assignment_reloads_rejected_total counter\n"
    << "kiln_agent_assignment_reloads_rejected_total{" << node << "} " << rejected_reloads_.load()
    << "\n";
  if (power_) {
    m << "# HELP kiln_agent_gpu_power_changes_total GPU settings the power policy changed: "
         "planned (logged; all that dry-run does) and applied (set and read back).\n"
      << "# TYPE kiln_agent_gpu_power_changes_total counter\n"
      << "kiln_agent_gpu_power_changes_total{" << node << ",outcome=\"planned\"} "
      << power_->changes_planned() << "\n"
      << "kiln_agent_gpu_power_changes_total{" << node << ",outcome=\"applied\"} "
      << power_->changes_applied() << "\n";
  }
  if (router_) {
    m << "# HELP kiln_router_forwarded_total Inference calls the node's router forwarded "
         "(retries included), by protocol (grpc, rest) and transport: data_socket to a replica "
         "on this node, grpc or http otherwise.\n"
      << "# TYPE kiln_router_forwarded_total counter\n"
      << "kiln_router_forwarded_total{" << node << ",protocol=\"grpc\",transport=\"data_socket\"} "
      << router_->forwarded_data_socket() << "\n"
      << "kiln_router_forwarded_total{" << node << ",protocol=\"grpc\",transport=\"grpc\"} "
      << router_->forwarded_grpc() << "\n"
      << "kiln_router_forwarded_total{" << node << ",protocol=\"rest\",transport=\"data_socket\"} "
      << router_->forwarded_rest_data_socket() << "\n"
      << "kiln_router_forwarded_total{" << node << ",protocol=\"rest\",transport=\"http\"} "
      << router_->forwarded_rest_http() << "\n"
      << "# HELP kiln_router_retries_total Forwarded calls tried again on another replica after "
         "theirs went away.\n"
      << "# TYPE kiln_router_retries_total counter\n"
      << "kiln_router_retries_total{" << node << "} " << router_->retries() << "\n";
  }
  auto snapshot = supervisor_->Snapshot();
  auto labels = [&](const ReplicaView& v) {
    return node + ",replica=\"" + Escape(v.spec.replica_id()) + "\",model=\"" +
           Escape(v.spec.model()) + "\",version=\"" + Escape(v.spec.version()) + "\",gpu=\"" +
           std::to_string(v.spec.gpu()) + "\"";
  };
  m << "# HELP kiln_replica_state 1 for the replica's current lifecycle state.\n"
    << "# TYPE kiln_replica_state gauge\n";
  for (const auto& v : *snapshot) {
    m << "kiln_replica_state{" << labels(v) << ",state=\"" << v1::LifecycleState_Name(v.state)
      << "\"} 1\n";
  }
  m << "# HELP kiln_replica_restarts_total Restarts after the replica exited on its own.\n"
    << "# TYPE kiln_replica_restarts_total counter\n";
  for (const auto& v : *snapshot) m << "kiln_replica_restarts_total{" << labels(v) << "} " << v.restarts << "\n";
  m << "# HELP kiln_replica_healthy 1 when the replica answers its probes (only healthy "
       "replicas are routed to).\n"
    << "# TYPE kiln_replica_healthy gauge\n";
  for (const auto& v : *snapshot) m << "kiln_replica_healthy{" << labels(v) << "} " << (v.healthy ? 1 : 0) << "\n";
  // Load, read from each running replica's control socket at scrape time.
  struct Load {
    std::string labels;
    v1::RuntimeStats stats;
  };
  std::vector<Load> loads;
  auto running = [](const auto& v) {
    return v.pid > 0 && !v.socket.empty() && v.phase == "RUNNING";
  };
  std::vector<std::string> sockets;
  for (const auto& v : *snapshot) {
    if (running(v)) sockets.push_back(v.socket);
  }
  auto all_stats = ReplicaStats(kMetricsScrape, sockets);
  for (const auto& v : *snapshot) {
    if (!running(v)) continue;
    const auto& stats = all_stats.at(v.socket);
    if (stats.ok()) loads.push_back({labels(v), *stats});
  }
  auto emit = [&](const char* name, const char* type, const char* help, auto value) {
    m << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
    for (const auto& l : loads) m << name << "{" << l.labels << "} " << value(l.stats) << "\n";
  };
  emit("kiln_replica_requests_total", "counter", "Inference requests the replica received.",
       [](const v1::RuntimeStats& s) { return s.requests(); });
  emit("kiln_replica_errors_total", "counter", "Inference requests that failed.",
       [](const v1::RuntimeStats& s) { return s.errors(); });
  emit("kiln_replica_in_flight", "gauge", "Requests accepted and not yet answered.",
       [](const v1::RuntimeStats& s) { return s.in_flight(); });
  emit("kiln_replica_queue_depth", "gauge", "Requests waiting in the batcher.",
       [](const v1::RuntimeStats& s) { return s.queue_depth(); });
  emit("kiln_replica_latency_p99_seconds", "gauge", "p99 request latency since start.",
       [](const v1::RuntimeStats& s) { return s.latency_p99_micros() / 1e6; });
  emit("kiln_replica_compute_p99_seconds", "gauge",
       "p99 time the model took per execution (a batch counts once) since start.",
       [](const v1::RuntimeStats& s) { return s.compute_p99_micros() / 1e6; });
  {
    std::map<std::pair<int, bool>, int> pool;  // (gpu, ready) -> count
    int per_gpu = options_.prestart_per_gpu;
    for (int g = 0; per_gpu > 0 && g < static_cast<int>(topology_.gpus.size()); ++g) {
      pool[{g, true}] = pool[{g, false}] = 0;
    }
    if (options_.prestart_cpu > 0) pool[{-1, true}] = pool[{-1, false}] = 0;
    for (const auto& p : *supervisor_->PrestartedSnapshot()) {
      if (!p.stopping) pool[{p.gpu, p.ready}]++;
    }
    m << "# HELP kiln_agent_prestarted_runtimes Pre-started runtimes (no model yet) by GPU "
         "(-1 = for CPU replicas), ready or still starting.\n"
      << "# TYPE kiln_agent_prestarted_runtimes gauge\n";
    for (const auto& [key, n] : pool) {
      m << "kiln_agent_prestarted_runtimes{" << node << ",gpu=\"" << key.first << "\",ready=\""
        << (key.second ? "true" : "false") << "\"} " << n << "\n";
    }
  }
  m << "# HELP kiln_replica_crash_loop 1 while the replica is in a crash loop.\n"
    << "# TYPE kiln_replica_crash_loop gauge\n";
  for (const auto& v : *snapshot) m << "kiln_replica_crash_loop{" << labels(v) << "} " << (v.crash_loop ? 1 : 0) << "\n";
  if (gpus_) {
    struct Row {
      std::string labels;
      GpuTelemetry t;
    };
    std::vector<Row> rows;                    // the GPUs whose telemetry could be read
    std::vector<std::pair<int, std::string>> all;  // every GPU, with its labels
    for (const auto& g : topology_.gpus) {
      const std::string gpu_labels = node + ",gpu=\"" + std::to_string(g.identity.index) +
                                     "\",uuid=\"" + Escape(g.identity.uuid) + "\",fake=\"" +
                                     (topology_.fake_gpus ? "true" : "false") + "\"";
      all.emplace_back(g.identity.index, gpu_labels);
      auto t = gpus_->Read(g.identity.index);
      if (t.ok()) rows.push_back({gpu_labels, *t});
    }
    auto gauge = [&](const char* name, const char* help, auto value) {
      m << "# HELP " << name << " " << help << "\n# TYPE " << name << " gauge\n";
      for (const auto& r : rows) m << name << "{" << r.labels << "} " << value(r.t) << "\n";
    };
    gauge("kiln_gpu_power_draw_watts", "Power draw.", [](const GpuTelemetry& t) { return t.power_draw_mw / 1000.0; });
    gauge("kiln_gpu_power_limit_watts", "Enforced power limit.", [](const GpuTelemetry& t) { return t.power_limit_mw / 1000.0; });
    gauge("kiln_gpu_memory_used_bytes", "Memory in use.", [](const GpuTelemetry& t) { return t.memory_used_bytes; });
    gauge("kiln_gpu_memory_total_bytes", "Memory.", [](const GpuTelemetry& t) { return t.memory_total_bytes; });
    gauge("kiln_gpu_utilization_ratio", "SM utilisation, 0..1.", [](const GpuTelemetry& t) { return t.utilization_gpu_pct / 100.0; });
    gauge("kiln_gpu_temperature_celsius", "Temperature.", [](const GpuTelemetry& t) { return t.temperature_c; });
    // Every GPU, whether its telemetry could be read or not: one that cannot be read (fallen
    // off the bus) is exactly the one to alert on.
    absl::MutexLock lock(&health_mu_);
    m << "# HELP kiln_gpu_healthy 0 when the GPU takes no replicas (Xid, ECC, unreadable).\n"
         "# TYPE kiln_gpu_healthy gauge\n";
    for (const auto& [gpu, gpu_labels] : all) {
      auto it = gpu_health_.find(gpu);
      const bool healthy = it == gpu_health_.end() || it->second.healthy;
      m << "kiln_gpu_healthy{" << gpu_labels << "} " << (healthy ? 1 : 0) << "\n";
    }
    m << "# HELP kiln_gpu_degraded 1 when the GPU is throttled, has informational faults or a "
         "failed read.\n# TYPE kiln_gpu_degraded gauge\n";
    for (const auto& [gpu, gpu_labels] : all) {
      auto it = gpu_health_.find(gpu);
      const bool degraded = it != gpu_health_.end() && it->second.degraded;
      m << "kiln_gpu_degraded{" << gpu_labels << "} " << (degraded ? 1 : 0) << "\n";
    }
  }
  return m.str();
}

}  // namespace kiln
