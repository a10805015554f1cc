#include "agent/supervisor.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include <google/protobuf/util/json_util.h>

#include "absl/strings/numbers.h"
#include "agent/assignment_file.h"
#include "common/filesystem.h"
#include "common/status.h"
#include "health/probe_verdict.h"
#include "nlohmann/json.hpp"

namespace kiln {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The longest control socket path taken: a unix socket path is at most 107 bytes, and the
// data socket beside it (".data" for ".sock") is no longer.
constexpr size_t kMaxSocketPath = 99;

// How long a replica waits for a pre-started runtime's answer to its Load before it starts
// cold instead. A Load is answered once the runtime has read the model's config: milliseconds.
constexpr absl::Duration kHandOverWait = absl::Seconds(2);

// The value after `flag` in `args` ("" if none).
std::string Arg(const std::vector<std::string>& args, const std::string& flag) {
  auto it = std::find(args.begin(), args.end(), flag);
  return it == args.end() || it + 1 == args.end() ? "" : *(it + 1);
}

// A failed Load that says the arguments were refused (the runtime is still blank), not that
// the process failed it.
bool RefusedArguments(const absl::Status& s) {
  return absl::IsInvalidArgument(s) || absl::IsNotFound(s) || absl::IsAlreadyExists(s) ||
         absl::IsPermissionDenied(s);
}

// What a replica's control socket under `state_dir` is named after: its id, or where that
// would make the path too long (ids run to 128 characters), the id's start and a hash of all
// of it. Room is kept for the ".K" (up to 3 digits) of a name another replica still holds.
// --state-dir is at most 60 characters, which leaves at least 21 here.
std::string SocketName(const std::string& state_dir, const std::string& id) {
  const size_t fixed = (state_dir + "/sockets/" + ".KKK.sock").size();
  const size_t room = kMaxSocketPath > fixed ? kMaxSocketPath - fixed : 0;
  if (id.size() <= room) return id;
  uint64_t h = 1469598103934665603ULL;  // FNV-1a: the same name on every run
  for (unsigned char c : id) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return id.substr(0, room > 17 ? room - 17 : 0) + "-" + hex;
}

// A replica's data socket beside its control socket: NAME.sock -> NAME.data (no longer).
std::string DataSocketOf(const std::string& control_socket) {
  std::string base = control_socket;
  if (base.size() > 5 && base.compare(base.size() - 5, 5, ".sock") == 0) base.resize(base.size() - 5);
  return base + ".data";
}

const char* PhaseName(int p) {
  static const char* kNames[] = {"PENDING", "STARTING", "RUNNING", "BACKOFF", "STOPPING", "FAILED"};
  return kNames[p];
}

std::string ExitText(int status) {
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  return "exited";
}

std::string ReadFileOr(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Renames a running process's log file (it goes on writing to it) to `to`, an earlier file
// there kept as `to`.1. False when it could not be moved.
bool MoveLog(const std::string& from, const std::string& to) {
  std::error_code ec;
  if (fs::exists(to, ec)) {
    fs::rename(to, to + ".1", ec);
    if (ec) return false;  // never over the earlier one
  }
  fs::rename(from, to, ec);
  return !ec;
}

// A command line (NUL-separated, as /proc/PID/cmdline) that names `socket`, non-empty, as its
// --control-socket: the runtime kiln started on it.
bool OnControlSocket(const std::string& cmdline, const std::string& socket) {
  return !socket.empty() &&
         cmdline.find(std::string("--control-socket\0", 17) + socket + '\0') != std::string::npos;
}

// A process id in a state file: a positive pid_t.
bool IsPid(const json& e, const char* key) {
  return e.contains(key) && e[key].is_number_integer() && e[key].get<int64_t>() > 0 &&
         e[key].get<int64_t>() <= std::numeric_limits<pid_t>::max();
}

// State-file fields: a non-empty string, else `fallback` (an older file lacks it); an integer,
// else `fallback`; a boolean, else false. A field of the wrong type counts as absent (a
// hand-edited or damaged file).
std::string TextOr(const json& e, const char* key, const std::string& fallback = "") {
  auto it = e.find(key);
  return it != e.end() && it->is_string() && !it->get<std::string>().empty()
             ? it->get<std::string>()
             : fallback;
}
int IntOr(const json& e, const char* key, int fallback) {
  auto it = e.find(key);
  return it != e.end() && it->is_number_integer() ? it->get<int>() : fallback;
}
bool FlagSet(const json& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_boolean() && it->get<bool>();
}

// A spec as the state file keeps it, and back (fields a newer agent wrote are skipped).
json SpecJson(const v1::ReplicaSpec& s) {
  std::string text;
  (void)google::protobuf::util::MessageToJsonString(s, &text);
  return json::parse(text);
}
bool SpecFrom(const json& j, v1::ReplicaSpec* s) {
  google::protobuf::util::JsonParseOptions parse;
  parse.ignore_unknown_fields = true;  // written by a newer agent: what this one knows
  return google::protobuf::util::JsonStringToMessage(j.dump(), s, parse).ok();
}

// The same model, version, GPU and CPU count: what one process keeps for its life.
bool SameShape(const v1::ReplicaSpec& a, const v1::ReplicaSpec& b) {
  return a.model() == b.model() && a.version() == b.version() && a.gpu() == b.gpu() &&
         a.cpus() == b.cpus();
}

// Logs of replicas that are gone are kept, this many at most (the newest), under logs/removed/:
// a controller names each placement anew, so keeping every one would fill the disk over
// rollouts, and dropping them at once would lose what a failed canary said.
constexpr size_t kRemovedLogsKept = 64;

void RetireLog(const std::string& log_file) {
  if (log_file.empty()) return;
  std::error_code ec;
  const fs::path dir = fs::path(log_file).parent_path() / "removed";
  fs::create_directories(dir, ec);
  for (const std::string& f : {log_file, log_file + ".1"}) {
    if (fs::exists(f, ec)) MoveLog(f, (dir / fs::path(f).filename()).string());
  }
  std::vector<std::pair<fs::file_time_type, fs::path>> kept;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    kept.emplace_back(fs::last_write_time(e.path(), ec), e.path());
  }
  if (kept.size() <= kRemovedLogsKept) return;
  std::sort(kept.begin(), kept.end());  // oldest first
  for (size_t i = 0; i + kRemovedLogsKept < kept.size(); ++i) fs::remove(kept[i].second, ec);
}

}  // namespace

Supervisor::Supervisor(SupervisorOptions options, Topology topology, ProcessLauncher* launcher,
                       RuntimeClientFactory* clients, Clock* clock, Log log,
                       InferenceProber* prober)
    : options_(std::move(options)),
      topology_(std::move(topology)),
      launcher_(launcher),
      clients_(clients),
      clock_(clock),
      log_(std::move(log)),
      probes_(prober ? std::make_unique<ProbeRunner>(prober, options_.probe_threads) : nullptr) {
  reserved_ = AgentReservedCpus(topology_, options_.reserved_cpus);
  std::error_code ec;
  fs::create_directories(options_.state_dir + "/sockets", ec);
  fs::create_directories(options_.state_dir + "/logs", ec);
  // The replicas' control and data sockets: the agent's user's alone.
  if (chmod((options_.state_dir + "/sockets").c_str(), 0700) != 0) {
    log_("cannot make " + options_.state_dir + "/sockets private (0700): " +
         std::strerror(errno) + "; replicas' sockets may be reachable by other users");
  }
  Publish();
}

std::string Supervisor::Device(const v1::ReplicaSpec& spec) const {
  if (spec.gpu() < 0 || options_.fake_gpus) return "cpu";
  return "cuda:" + std::to_string(spec.gpu());
}

std::set<int> Supervisor::CpusInUse(const std::string& except_id) const {
  std::set<int> used;
  for (const auto& [id, r] : replicas_) {
    if (id == except_id) continue;
    used.insert(r.cpus.cpus.begin(), r.cpus.cpus.end());
  }
  return used;
}

absl::Status Supervisor::Apply(const v1::Assignment& a,
                               const std::map<std::string, std::string>& renames) {
  // Plan first; nothing changes unless the whole assignment fits.
  std::set<std::string> renamed_to;
  for (const auto& [from, to] : renames) {
    auto it = replicas_.find(from);
    if (it == replicas_.end() || it->second.removing) {
      return absl::InvalidArgumentError("rename " + from + " -> " + to + ": no such replica running");
    }
    if ((replicas_.count(to) && !renames.count(to)) || !renamed_to.insert(to).second) {
      return absl::InvalidArgumentError("rename " + from + " -> " + to + ": " + to +
                                        " is taken");
    }
    const v1::ReplicaSpec* want = nullptr;
    for (const auto& s : a.replicas()) {
      if (s.replica_id() == to) want = &s;
    }
    const v1::ReplicaSpec& have = it->second.spec;
    if (!want || !SameShape(*want, have) || want->repository() != have.repository()) {
      return absl::InvalidArgumentError("rename " + from + " -> " + to +
                                        ": the assignment does not give " + to +
                                        " the same model, version, repository, gpu and cpus");
    }
  }
  // The id each running replica has once the renames are done.
  auto id_after = [&](const std::string& id) {
    auto it = renames.find(id);
    return it == renames.end() ? id : it->second;
  };
  std::map<std::string, CpuAssignment> cpus;
  std::set<int> used;     // every running replica's CPUs, and those given out below
  std::set<int> staying;  // the same without the replicas this assignment takes away
  for (const auto& [id, r] : replicas_) {
    // A draining replica assigned again starts a new process once gone: its CPUs are given
    // out again below, as a new replica's, since another may have been given them meanwhile.
    bool kept = false;
    for (const auto& s : a.replicas()) {
      if (!r.removing && s.replica_id() == id_after(id) && SameShape(s, r.spec)) {
        kept = true;
      }
    }
    // Replicas being replaced keep their CPUs until they are gone.
    used.insert(r.cpus.cpus.begin(), r.cpus.cpus.end());
    if (kept) {
      cpus[id_after(id)] = r.cpus;
      staying.insert(r.cpus.cpus.begin(), r.cpus.cpus.end());
    }
  }
  for (const auto& s : a.replicas()) {
    if (cpus.count(s.replica_id())) continue;
    if (s.gpu() >= static_cast<int>(topology_.gpus.size())) {
      return absl::InvalidArgumentError("replica " + s.replica_id() + ": gpu " +
                                        std::to_string(s.gpu()) + " does not exist on this node (" +
                                        std::to_string(topology_.gpus.size()) + " GPUs)");
    }
    auto alloc = AllocateCpus(topology_, used, reserved_, s.gpu(), s.cpus());
    if (!alloc.ok()) {
      // Free once the replicas this assignment takes away are gone (a full node that swaps a
      // replica for another): it starts then (Tick waits for them). Only what cannot fit even
      // then refuses the assignment.
      auto later = AllocateCpus(topology_, staying, reserved_, s.gpu(), s.cpus());
      if (!later.ok()) return Annotate(alloc.status(), "replica " + s.replica_id());
      alloc = std::move(later);
    }
    used.insert(alloc->cpus.begin(), alloc->cpus.end());
    staying.insert(alloc->cpus.begin(), alloc->cpus.end());
    cpus[s.replica_id()] = *alloc;
  }

  // A running replica keeps its shape: a changed one needs a new id (checked before anything
  // changes).
  for (const auto& s : a.replicas()) {
    const Replica* existing = nullptr;
    for (const auto& [from, to] : renames) {
      if (to == s.replica_id()) existing = &replicas_.at(from);
    }
    if (!existing && !renames.count(s.replica_id())) {
      auto it = replicas_.find(s.replica_id());
      if (it != replicas_.end()) existing = &it->second;
    }
    if (existing && !existing->removing && !SameShape(existing->spec, s)) {
      // The repository may change under a running replica (a controller's deployment points
      // at a new one for a new version while the old version's replicas run on): the process
      // keeps what it loaded, and a restart reads the new one.
      return absl::InvalidArgumentError("replica " + s.replica_id() +
                                        ": model, version, gpu or cpus changed; a changed "
                                        "replica needs a new id");
    }
  }
  // Commit. Renames first: the same process goes on under its new id.
  std::vector<std::pair<std::string, Replica>> moved;
  for (const auto& [from, to] : renames) {
    auto node = replicas_.extract(from);
    Replica& r = node.mapped();
    log_("replica " + from + ": goes on as " + to + " (pid " + std::to_string(r.pid) + ")");
    r.spec.set_replica_id(to);
    std::string log = options_.state_dir + "/logs/" + to + ".log";
    if (!r.log_file.empty() && r.log_file != log && MoveLog(r.log_file, log)) r.log_file = log;
    moved.emplace_back(to, std::move(r));
  }
  for (auto& [to, r] : moved) replicas_.emplace(to, std::move(r));
  if (!renames.empty()) state_dirty_ = true;
  std::set<std::string> wanted;
  for (const auto& s : a.replicas()) wanted.insert(s.replica_id());
  std::vector<pid_t> drains;
  bool leaving = false;  // a replica leaves routing: stopped, or assigned WARM while serving
  for (auto& [id, r] : replicas_) {
    if (wanted.count(id)) continue;
    r.readd.reset();
    if (!r.removing) {
      BeginStop(r, "no longer assigned", &drains);
      leaving = true;
    }
  }
  for (const auto& s : a.replicas()) {
    auto it = replicas_.find(s.replica_id());
    if (it != replicas_.end() && it->second.removing) {
      // Assigned again while it drains: it starts again, as now assigned, once it is gone.
      it->second.readd = s;
      it->second.readd_cpus = cpus[s.replica_id()];
      continue;
    }
    if (it == replicas_.end()) {
      Replica r;
      r.spec = s;
      r.cpus = cpus[s.replica_id()];
      r.phase = Phase::kPending;
      r.due = clock_->Now();
      auto w = recovered_waiting_.find(s.replica_id());
      if (w != recovered_waiting_.end() && SameShape(w->second.spec, s)) {
        // Waiting out a backoff when the agent stopped: it goes on waiting, crashes counted.
        r.crashes = w->second.crashes;
        r.restarts = w->second.restarts;
        r.crash_loop = w->second.crash_loop;
        r.phase = Phase::kBackoff;
        r.due = w->second.due;
        log_("replica " + s.replica_id() + ": restarts at its backoff from before the agent's "
             "restart (" + std::to_string(r.restarts) + " restarts" +
             (r.crash_loop ? ", CrashLoop" : "") + ")");
      }
      replicas_.emplace(s.replica_id(), std::move(r));
    } else {
      v1::ReplicaSpec& kept = it->second.spec;
      if (kept.state() == v1::SERVING && s.state() != v1::SERVING) leaving = true;
      kept.set_state(s.state());  // promote/demote happens in Tick
      // What the running process does not hold: its next start reads them (and the state
      // file keeps them for an agent restarted before that).
      if (kept.repository() != s.repository() ||
          kept.gpu_memory_bytes() != s.gpu_memory_bytes() ||
          kept.runtime().SerializeAsString() != s.runtime().SerializeAsString()) {
        kept.set_repository(s.repository());
        kept.set_gpu_memory_bytes(s.gpu_memory_bytes());
        *kept.mutable_runtime() = s.runtime();
        state_dirty_ = true;
      }
    }
  }
  recovered_waiting_.clear();  // what the first assignment after Recover did not want is gone
  applied_generation_ = a.generation();
  if (leaving) {
    LeaveRouting(drains);
  } else {
    Publish();
  }
  return absl::OkStatus();
}

void Supervisor::LeaveRouting(const std::vector<pid_t>& drains) {
  Publish();
  if (options_.before_leaving_routing) options_.before_leaving_routing();
  for (pid_t pid : drains) (void)launcher_->Signal(pid, SIGTERM);
}

absl::StatusOr<LaunchRequest> Supervisor::ColdStart(Replica& r) {
  const v1::ReplicaSpec& s = r.spec;
  if (s.gpu() >= static_cast<int>(topology_.gpus.size())) {
    return absl::FailedPreconditionError("gpu " + std::to_string(s.gpu()) +
                                         " does not exist on this node (" +
                                         std::to_string(topology_.gpus.size()) + " GPUs)");
  }
  // Named by the id, unless another replica still listens there (one renamed away from this
  // id keeps its socket).
  const std::string name = SocketName(options_.state_dir, s.replica_id());
  r.socket = options_.state_dir + "/sockets/" + name + ".sock";
  // Nor one named in a Load sent to a pre-started runtime (a runtime that takes it late binds
  // it) or held by one killed over its Load and not gone yet. The replica's own Load still
  // waited for keeps the socket it named: asked again, it is the same Load.
  std::erase_if(dying_sockets_, [&](const auto& e) { return !launcher_->Alive(e.first); });
  auto own = LoadAwaitedBy(s.replica_id());
  auto taken = [&](const std::string& socket) {
    return std::any_of(replicas_.begin(), replicas_.end(),
                       [&](const auto& other) {
                         return &other.second != &r && other.second.socket == socket;
                       }) ||
           std::any_of(prestarted_.begin(), prestarted_.end(),
                       [&](const auto& e) { return e.second.load_socket == socket; }) ||
           std::any_of(dying_sockets_.begin(), dying_sockets_.end(),
                       [&](const auto& e) { return e.second == socket; });
  };
  if (own != prestarted_.end()) {
    r.socket = own->second.load_socket;
  } else {
    for (int k = 1; taken(r.socket); ++k) {
      r.socket = options_.state_dir + "/sockets/" + name + "." + std::to_string(k) + ".sock";
    }
  }
  r.log_file = options_.state_dir + "/logs/" + s.replica_id() + ".log";
  if (r.socket.size() > kMaxSocketPath) {
    return absl::InvalidArgumentError("--state-dir: too long for a unix socket path (" + r.socket +
                                      ")");
  }
  LaunchRequest req;
  // A GPU replica sees only its own GPU (CUDA_VISIBLE_DEVICES), as cuda:0.
  const bool real_gpu = s.gpu() >= 0 && !options_.fake_gpus;
  int threads = s.runtime().threads() > 0 ? s.runtime().threads()
                                          : static_cast<int>(r.cpus.cpus.size());
  if (s.runtime().threads() == 0 && options_.runtime_model_cpus > 0 &&
      r.cpus.cpus.size() > static_cast<size_t>(options_.runtime_model_cpus)) {
    // The model's intra-op threads, one per CPU of its own (the runtime's --model-cpus).
    threads = static_cast<int>(options_.runtime_model_cpus);
  }
  req.argv = {options_.runtime_binary,
              "--model-repository", s.repository(),
              "--model", s.model(),
              "--version", s.version(),
              "--grpc-port", "0",
              "--http-port", "0",
              "--bind-address", options_.bind_address,
              "--control-socket", r.socket,
              "--data-socket", DataSocketOf(r.socket),
              "--initial-state", "warm",
              "--device", real_gpu ? "cuda:0" : "cpu",
              "--threads", std::to_string(threads),
              "--replica-id", s.replica_id(),
              "--log-level", options_.runtime_log_level};
  if (s.runtime().max_request_bytes() > 0) {
    req.argv.push_back("--max-request-bytes");
    req.argv.push_back(std::to_string(s.runtime().max_request_bytes()));
  }
  if (options_.runtime_idle_spin_us > 0) {
    req.argv.push_back("--idle-spin-us");
    req.argv.push_back(std::to_string(options_.runtime_idle_spin_us));
  }
  if (options_.runtime_model_cpus > 0) {
    req.argv.push_back("--model-cpus");
    req.argv.push_back(std::to_string(options_.runtime_model_cpus));
  }
  req.cpus = r.cpus.cpus;
  req.memory_node = r.cpus.memory_node;
  req.log_file = r.log_file;
  if (real_gpu) {
    req.env.push_back("CUDA_VISIBLE_DEVICES=" + topology_.gpus[s.gpu()].identity.uuid);
    // Parked while WARM; not a file's warm pool member, which may be taken over in place by a
    // SERVING replica (a parked process stays parked).
    if (options_.park_warm_replicas && s.state() == v1::WARM && !IsPoolMemberId(s.replica_id())) {
      req.env.push_back("CUDA_DISABLE_PERF_BOOST=1");
    }
  }
  return req;
}

LaunchRequest Supervisor::WithRuntimeEnvironment(LaunchRequest req) const {
  if (options_.runtime_malloc_huge_pages) {
    std::string tunable = MallocHugePagesTunable(getenv("GLIBC_TUNABLES"));
    if (!tunable.empty()) req.env.push_back(std::move(tunable));
  }
  return req;
}

absl::Status Supervisor::Launch(Replica& r) {
  const v1::ReplicaSpec& s = r.spec;
  absl::StatusOr<LaunchRequest> cold = ColdStart(r);
  if (!cold.ok()) return cold.status();
  HandOverResult hand = HandOver(r, *cold);
  if (hand == HandOverResult::kWaiting) {
    r.phase = Phase::kPending;  // asks again on the next pass (a backoff's wait is over)
    return absl::OkStatus();
  }
  if (hand == HandOverResult::kGaveUp) {
    // Named anew: the runtime that may yet take the Load binds the sockets it named.
    cold = ColdStart(r);
    if (!cold.ok()) return cold.status();
  }
  const LaunchRequest& req = *cold;
  const bool handed = hand == HandOverResult::kHanded;
  if (!handed) {
    auto pid = launcher_->Launch(WithRuntimeEnvironment(req));
    if (!pid.ok()) return pid.status();
    r.pid = *pid;
    r.launch_socket = r.socket;
    r.launched_as = s.replica_id();
  }
  r.phase = Phase::kStarting;
  r.observed = v1::LOADING;
  r.control_ok = false;
  r.probe = absl::OkStatus();
  r.last_probe = absl::InfinitePast();
  r.probe_token = 0;  // a result for the previous process is stale
  r.probe_failures = 0;
  r.probe_busy = false;
  r.probe_again = false;
  r.probe_batches = -1;
  r.kill_reason.clear();
  r.last_answer = clock_->Now();
  r.last_used = clock_->Now();
  r.client = clients_->Connect(r.socket);
  OnStart(r.crashes, clock_->Now());
  r.start_timed_out = false;
  r.gpu_drain = false;
  log_("replica " + s.replica_id() + ": " + (handed ? "handed pre-started" : "started") +
       " pid " + std::to_string(r.pid) + " (" + s.model() +
       " v" + s.version() + " on " + Device(s) + ", cpus " + FormatCpuList(r.cpus.cpus) +
       (r.cpus.memory_node >= 0 ? ", memory node " + std::to_string(r.cpus.memory_node) : "") +
       ")");
  SaveState();
  return absl::OkStatus();
}

void Supervisor::SaveState() {
  absl::Status s = WriteStateFile();
  state_write_ = s;
  if (s.ok()) return;
  log_("state file: " + std::string(s.message()) + " (tried again next tick; no process is "
       "started until it is written)");
  state_dirty_ = true;
}

absl::Status Supervisor::StateWritable() {
  if (state_write_.ok()) return absl::OkStatus();
  state_write_ = WriteStateFile();
  if (state_write_.ok()) {
    log_("state file: written again");
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      "waits: the state file cannot be written (" + std::string(state_write_.message()) +
      "), and a process it does not list would be lost to a restarted agent");
}

std::map<Supervisor::PoolKey, Supervisor::PoolPlace> Supervisor::Pools() const {
  std::map<PoolKey, PoolPlace> out;
  auto free_of = [&](const std::vector<int>& cpus) {
    std::vector<int> free;
    for (int c : cpus) {
      if (std::find(reserved_.begin(), reserved_.end(), c) == reserved_.end()) free.push_back(c);
    }
    return free;
  };
  if (options_.prestart_cpu > 0) {
    // A CPU replica's memory is bound to its node only on a multi-node machine: so are its
    // pools, one per node, bound from exec on like a cold start.
    if (topology_.numa_nodes.size() > 1) {
      for (const auto& n : topology_.numa_nodes) {
        PoolPlace place{free_of(IntersectCpus(n.cpus, topology_.allowed_cpus)), n.id};
        if (!place.cpus.empty()) out[{-1, n.id}] = place;
      }
    } else {
      out[{-1, -1}] = {free_of(topology_.allowed_cpus), -1};
    }
  }
  if (options_.prestart_per_gpu > 0) {
    for (int g = 0; g < static_cast<int>(topology_.gpus.size()); ++g) {
      // Idle until handed a replica: any of the CPUs its replicas could get, memory on its
      // GPU's node (the replica's own CPUs are set at the Load).
      out[{g, -1}] = {free_of(topology_.gpus[g].local_cpus), topology_.gpus[g].numa_node};
    }
  }
  return out;
}

int Supervisor::PoolTarget(const std::map<PoolKey, PoolPlace>& pools, PoolKey key) const {
  if (pool_stopped_ || !pools.count(key)) return 0;
  return key.first < 0 ? options_.prestart_cpu : options_.prestart_per_gpu;
}

Supervisor::HandOverResult Supervisor::HandOver(Replica& r, const LaunchRequest& cold) {
  const std::string& id = r.spec.replica_id();
  const int gpu = r.spec.gpu() >= 0 ? r.spec.gpu() : -1;
  auto it = LoadAwaitedBy(id);
  const bool asked = it != prestarted_.end();
  if (!asked) {
    // Loads wait on the loop up to the client's inline wait: past a second of them in one
    // tick, replicas start cold.
    if (load_time_this_tick_ >= absl::Seconds(1)) return HandOverResult::kCold;
    for (it = prestarted_.begin(); it != prestarted_.end(); ++it) {
      const Prestarted& p = it->second;
      if (p.gpu != gpu || !p.ready || p.stopping || p.pid <= 0 || !p.loading_for.empty()) {
        continue;
      }
      if (gpu < 0 && p.numa_node != cold.memory_node) continue;
      if (p.env != cold.env) continue;  // a parked pool for an unparked replica, say
      break;
    }
    if (it == prestarted_.end()) return HandOverResult::kCold;
  }
  Prestarted& p = it->second;
  // The cold start's command line, plus where the process now pins itself: it was started
  // on all of its pool's CPUs. (A Load on its way answers for the arguments it was sent.)
  std::vector<std::string> args(cold.argv.begin() + 1, cold.argv.end());
  if (!cold.cpus.empty()) {
    args.push_back("--cpu-set");
    args.push_back(FormatCpuList(cold.cpus));
  }
  if (cold.memory_node >= 0) {
    args.push_back("--memory-node");
    args.push_back(std::to_string(cold.memory_node));
  }
  if (asked && (p.load_args != args || p.env != cold.env)) {
    // Sent for what this replica was then (its id since given to another, its state or
    // settings changed): the answer is not for it. TickPool settles it.
    log_("pre-started runtime " + it->first + ": the Load on its way was for replica " + id +
         " as it was; the replica starts cold");
    p.load_abandoned = true;
    return HandOverResult::kGaveUp;
  }
  const absl::Time before = clock_->Now();
  absl::Status s = p.client->Load(args);
  const absl::Time now = clock_->Now();
  load_time_this_tick_ += now - before;
  if (IsAnswerPending(s)) {
    if (!asked) {
      p.loading_for = id;
      p.load_sent = now;
      p.load_args = args;
      p.load_socket = Arg(args, "--control-socket");
      state_dirty_ = true;  // an agent restarted from here must not adopt it as blank
      return HandOverResult::kWaiting;
    }
    if (now - p.load_sent < kHandOverWait) return HandOverResult::kWaiting;
    log_("pre-started runtime " + it->first + " (pid " + std::to_string(p.pid) +
         ") has not answered replica " + id + "'s Load in " + absl::FormatDuration(kHandOverWait) +
         "; the replica starts cold");
    p.load_abandoned = true;
    return HandOverResult::kGaveUp;
  }
  p.loading_for.clear();
  p.load_args.clear();
  if (!s.ok()) {
    const bool arguments = RefusedArguments(s);
    log_("pre-started runtime " + it->first + " (pid " + std::to_string(p.pid) + ") " +
         (arguments ? "refused" : "failed") + " replica " + id + " (" + std::string(s.message()) +
         "); the replica starts cold");
    if (!arguments) {
      // Not the arguments: the process (hung, shutting down, already loaded, too old). It
      // may have taken the Load after all (a deadline passed): the replica is named afresh.
      KillOverLoad(it);
      return HandOverResult::kGaveUp;
    }
    RefusedLoad(it->first, p);
    return HandOverResult::kCold;
  }
  r.pid = p.pid;
  r.launch_socket = p.socket;
  r.launched_as = id;
  // Its output goes on in the replica's log.
  r.log_file = MoveLog(p.log_file, cold.log_file) ? cold.log_file : p.log_file;
  prestarted_.erase(it);
  return HandOverResult::kHanded;
}

bool Supervisor::SettleAbandonedLoad(std::map<std::string, Prestarted>::iterator& it) {
  Prestarted& p = it->second;
  absl::Status s = p.client->Load({});
  if (IsAnswerPending(s)) return false;
  const std::string was_for = std::exchange(p.loading_for, "");
  p.load_abandoned = false;
  p.load_args.clear();
  state_dirty_ = true;
  if (s.ok()) {
    // It serves nobody, and loads on a device and CPUs others were given: no drain.
    log_("pre-started runtime " + it->first + " (pid " + std::to_string(p.pid) +
         ") took replica " + was_for + "'s model after the replica stopped waiting for it; "
         "killed");
    (void)launcher_->Signal(p.pid, SIGKILL);
    p.stopping = true;
    p.due = clock_->Now() + options_.stop_timeout;
    return false;
  }
  if (RefusedArguments(s)) {
    log_("pre-started runtime " + it->first + " refused replica " + was_for + " (" +
         std::string(s.message()) + "), which no longer waited for it");
    RefusedLoad(it->first, p);  // still blank: back in the pool
    return false;
  }
  log_("pre-started runtime " + it->first + " (pid " + std::to_string(p.pid) + ") failed replica " +
       was_for + "'s Load (" + std::string(s.message()) + "); killed");
  auto dead = it++;
  KillOverLoad(dead);
  return true;
}

std::map<std::string, Supervisor::Prestarted>::iterator Supervisor::LoadAwaitedBy(
    const std::string& id) {
  return std::find_if(prestarted_.begin(), prestarted_.end(), [&](const auto& e) {
    return e.second.loading_for == id && !e.second.load_abandoned;
  });
}

void Supervisor::RefusedLoad(const std::string& name, Prestarted& p) {
  p.load_socket.clear();  // still blank: it bound nothing
  if (++p.refusals >= 2) {
    // Arguments a cold start may take (an older runtime binary still running, say): this one
    // is retired rather than asked again.
    StopPrestarted(name, p, "refused twice");
  }
}

void Supervisor::KillOverLoad(std::map<std::string, Prestarted>::iterator it) {
  Prestarted& p = it->second;
  (void)launcher_->Signal(p.pid, SIGKILL);
  if (!p.load_socket.empty()) dying_sockets_[p.pid] = p.load_socket;
  DropPrestarted(it, /*failed=*/true);
}

absl::Status Supervisor::LaunchPrestarted(PoolKey key, const PoolPlace& place) {
  const std::string name = "prestart-" + std::to_string(++prestart_seq_);
  const int gpu = key.first;
  Prestarted p;
  p.gpu = gpu;
  p.numa_node = key.second;
  p.socket = options_.state_dir + "/sockets/" + name + ".sock";
  p.log_file = options_.state_dir + "/logs/" + name + ".log";
  if (p.socket.size() > kMaxSocketPath) {
    return absl::InvalidArgumentError("--state-dir: too long for a unix socket path (" + p.socket +
                                      ")");
  }
  const bool real_gpu = gpu >= 0 && !options_.fake_gpus;
  LaunchRequest req;
  req.argv = {options_.runtime_binary, "--prestart",
              "--control-socket", p.socket,
              "--device", real_gpu ? "cuda:0" : "cpu",
              "--log-level", options_.runtime_log_level};
  req.cpus = place.cpus;
  req.memory_node = place.memory_node;
  req.log_file = p.log_file;
  if (gpu >= 0) p.gpu_uuid = topology_.gpus[gpu].identity.uuid;
  // Not parked: the replicas it is for are mostly new SERVING ones, which run unparked (a
  // WARM replica on a parking GPU starts cold instead).
  if (real_gpu) p.env.push_back("CUDA_VISIBLE_DEVICES=" + p.gpu_uuid);
  req.env = p.env;
  auto pid = launcher_->Launch(WithRuntimeEnvironment(req));
  if (!pid.ok()) return pid.status();
  p.pid = *pid;
  p.started = clock_->Now();
  p.client = clients_->Connect(p.socket);
  OnStart(pool_slots_[key].crashes, p.started);
  log_("pre-started runtime " + name + ": pid " + std::to_string(p.pid) + " for " +
       (gpu >= 0 ? "gpu " + std::to_string(gpu)
                 : std::string("cpu replicas") +
                       (p.numa_node >= 0 ? " on numa node " + std::to_string(p.numa_node) : "")));
  prestarted_.emplace(name, std::move(p));
  SaveState();
  return absl::OkStatus();
}

void Supervisor::StopPrestarted(const std::string& name, Prestarted& p, const std::string& why) {
  if (p.stopping || p.pid <= 0) return;
  // A replica waiting for its Load starts cold (away from the sockets the Load named).
  p.loading_for.clear();
  p.load_args.clear();
  p.load_abandoned = false;
  (void)launcher_->Signal(p.pid, SIGTERM);
  p.stopping = true;
  p.due = clock_->Now() + options_.stop_timeout;
  state_dirty_ = true;
  log_("pre-started runtime " + name + ": stopping (" + why + ")");
}

void Supervisor::DropPrestarted(std::map<std::string, Prestarted>::iterator it, bool failed) {
  Prestarted& p = it->second;
  std::error_code ec;
  fs::remove(p.socket, ec);
  // The last failed one's output is kept for a look; a stopped one's is not.
  if (failed) {
    MoveLog(p.log_file, options_.state_dir + "/logs/prestart-last-failure.log");
    RestartDecision d = OnCrash(pool_slots_[p.key()].crashes, clock_->Now(), options_.restart);
    pool_slots_[p.key()].due = d.restart_at;
  } else {
    fs::remove(p.log_file, ec);
  }
  prestarted_.erase(it);
}

void Supervisor::StopPrestarted() {
  pool_stopped_ = true;
  for (auto& [name, p] : prestarted_) StopPrestarted(name, p, "the agent stops its replicas");
  Publish();
}

void Supervisor::TickPool() {
  const absl::Time now = clock_->Now();
  for (auto it = prestarted_.begin(); it != prestarted_.end();) {
    Prestarted& p = it->second;
    if (!p.loading_for.empty() && !p.stopping) {
      auto waiting = replicas_.find(p.loading_for);
      if (waiting == replicas_.end() || waiting->second.phase != Phase::kPending ||
          waiting->second.removing) {
        p.load_abandoned = true;
      }
      if (p.load_abandoned && SettleAbandonedLoad(it)) continue;
      ++it;
      continue;
    }
    if (p.stopping) {
      if (now >= p.due && p.pid > 0) {
        log_("pre-started runtime " + it->first + ": did not stop; killing pid " +
             std::to_string(p.pid));
        (void)launcher_->Signal(p.pid, SIGKILL);
        p.due = now + options_.stop_timeout;
      }
      ++it;
      continue;
    }
    if (p.ready) {
      ++it;
      continue;
    }
    auto st = p.client->GetState();
    if (IsAnswerPending(st.status())) {  // slow, not silent: its answer comes on a later pass
      ++it;
      continue;
    }
    if (st.ok() && st->state() == v1::LOADING && st->model_name().empty()) {
      p.ready = true;
      log_("pre-started runtime " + it->first + ": ready after " +
           absl::FormatDuration(absl::Trunc(now - p.started, absl::Milliseconds(1))));
    } else if (st.ok() && !st->model_name().empty()) {
      StopPrestarted(it->first, p, "it has model " + st->model_name() + ": not for the pool");
    } else if (now - p.started >= options_.prestart_timeout) {
      log_("pre-started runtime " + it->first + ": not ready after " +
           absl::FormatDuration(options_.prestart_timeout) + "; killed");
      (void)launcher_->Signal(p.pid, SIGKILL);
      auto dead = it++;
      DropPrestarted(dead, /*failed=*/true);
      continue;
    }
    ++it;
  }
  // Each pool at its size: trimmed (still starting first, then the newest), or refilled.
  std::map<PoolKey, std::vector<std::pair<std::string, Prestarted*>>> have;
  for (auto& [name, p] : prestarted_) {
    // One a Load went to is leaving the pool: the pool refills meanwhile.
    if (!p.stopping && p.loading_for.empty()) have[p.key()].push_back({name, &p});
  }
  const auto pools = Pools();
  for (auto& [key, members] : have) {
    const int target = PoolTarget(pools, key);
    std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) {
      if (a.second->ready != b.second->ready) return !a.second->ready;
      return a.second->started > b.second->started;
    });
    for (size_t i = 0; static_cast<int>(members.size() - i) > target; ++i) {
      StopPrestarted(members[i].first, *members[i].second, "more than the pool's size");
    }
  }
  for (const auto& [key, place] : pools) {
    if (key.first >= 0 && unhealthy_gpus_.count(key.first)) continue;
    PoolSlot& slot = pool_slots_[key];
    const int target = PoolTarget(pools, key);
    for (int n = static_cast<int>(have[key].size()); n < target && now >= slot.due; ++n) {
      if (!StateWritable().ok()) return;  // as for replicas (Tick)
      absl::Status s = LaunchPrestarted(key, place);
      if (!s.ok()) {
        RestartDecision d = OnCrash(slot.crashes, now, options_.restart);
        slot.due = d.restart_at;
        log_(std::string("pre-started runtime for ") +
             (key.first >= 0 ? "gpu " + std::to_string(key.first) : "cpu replicas") +
             ": cannot start: " + std::string(s.message()) + "; next try in " +
             absl::FormatDuration(d.backoff));
        break;
      }
    }
  }
}

void Supervisor::BeginStop(Replica& r, const std::string& why, std::vector<pid_t>* drains) {
  r.removing = true;
  if (r.pid > 0 && (r.phase == Phase::kStarting || r.phase == Phase::kRunning)) {
    drains->push_back(r.pid);  // the runtime drains, then exits
    r.phase = Phase::kStopping;
    r.due = clock_->Now() + options_.stop_timeout;
    state_dirty_ = true;  // the drain and its deadline are saved
    log_("replica " + r.spec.replica_id() + ": stopping (" + why + "), pid " + std::to_string(r.pid));
  } else if (r.phase != Phase::kStopping) {
    r.phase = Phase::kFailed;  // never running: nothing to stop
    r.pid = 0;
  } else {
    state_dirty_ = true;  // draining already (off an unhealthy GPU): now for good
  }
}

bool Supervisor::Readd(Replica& r) {
  if (!r.readd) return false;
  log_("replica " + r.readd->replica_id() + ": assigned again while it stopped; starting it");
  Replica fresh;
  fresh.spec = *r.readd;
  fresh.cpus = r.readd_cpus;
  fresh.phase = Phase::kPending;
  fresh.due = clock_->Now();
  r = std::move(fresh);
  return true;
}

void Supervisor::SetGpuHealth(int gpu, bool healthy, const std::string& reason) {
  bool was_healthy = !unhealthy_gpus_.count(gpu);
  if (healthy) {
    unhealthy_gpus_.erase(gpu);
  } else {
    unhealthy_gpus_[gpu] = reason;
  }
  if (was_healthy == healthy) return;
  log_("gpu " + std::to_string(gpu) + (healthy ? ": healthy again" : ": UNHEALTHY (" + reason + ")"));
  if (!healthy) {
    for (auto& [name, p] : prestarted_) {
      if (p.gpu == gpu) StopPrestarted(name, p, "gpu " + std::to_string(gpu) + " unhealthy");
    }
  }
  std::vector<pid_t> drains;
  for (auto& [id, r] : replicas_) {
    if (r.spec.gpu() != gpu || r.removing) continue;
    if (!healthy) {
      r.held = true;
      r.last_error = "gpu " + std::to_string(gpu) + " unhealthy: " + reason;
      if (!options_.drain_on_unhealthy_gpu) {
        log_("replica " + id + ": on unhealthy gpu " + std::to_string(gpu) +
             "; serving until the controller moves it (not restarted there)");
        continue;
      }
      if (r.pid > 0 && (r.phase == Phase::kStarting || r.phase == Phase::kRunning)) {
        drains.push_back(r.pid);  // drain, then it exits
        r.phase = Phase::kStopping;
        r.due = clock_->Now() + options_.stop_timeout;
        r.gpu_drain = true;
        log_("replica " + id + ": draining off unhealthy gpu " + std::to_string(gpu));
      }
    } else if (r.held) {
      r.held = false;
      if (r.phase == Phase::kFailed || r.phase == Phase::kBackoff) {
        // A backoff the GPU's trouble interrupted is waited out still (a flapping GPU must not
        // restart a crash-looping replica hot); one drained off the GPU starts at once.
        const absl::Time now = clock_->Now();
        r.due = std::max(r.due, now);
        r.phase = r.due > now ? Phase::kBackoff : Phase::kPending;
      }
    }
  }
  if (drains.empty()) {
    Publish();
  } else {
    LeaveRouting(drains);
  }
}

void Supervisor::HandleExit(const ProcessExit& e) {
  for (auto it = prestarted_.begin(); it != prestarted_.end(); ++it) {
    Prestarted& p = it->second;
    if (p.pid != e.pid || p.pid == 0) continue;
    const bool failed = !p.stopping;
    if (failed) {
      log_("pre-started runtime " + it->first + ": " + ExitText(e.status) + " (its output: " +
           options_.state_dir + "/logs/prestart-last-failure.log)");
    }
    DropPrestarted(it, failed);
    return;
  }
  for (auto it = replicas_.begin(); it != replicas_.end(); ++it) {
    Replica& r = it->second;
    if (r.pid != e.pid || r.pid == 0) continue;
    r.pid = 0;
    r.client.reset();
    r.grpc_port = r.http_port = 0;
    r.data_socket.clear();
    if (std::exchange(r.gpu_drain, false) && !r.held && !r.removing) {
      // Drained off its GPU, which was healthy again before it exited: not a crash.
      log_("replica " + r.spec.replica_id() + ": stopped (" + ExitText(e.status) +
           "); its GPU is healthy again, starting it again");
      r.phase = Phase::kPending;
      r.due = clock_->Now();
      r.observed = v1::LIFECYCLE_STATE_UNSPECIFIED;
      return;
    }
    if (r.held && !r.removing) {
      log_("replica " + r.spec.replica_id() + ": stopped (" + ExitText(e.status) +
           "); not restarted while its GPU is unhealthy");
      r.phase = Phase::kFailed;
      r.due = clock_->Now();  // no backoff: its GPU's fault, not its own
      r.observed = v1::LIFECYCLE_STATE_UNSPECIFIED;
      return;
    }
    if (r.removing) {
      log_("replica " + r.spec.replica_id() + ": stopped (" + ExitText(e.status) + ")");
      std::error_code ec;
      fs::remove(r.socket, ec);
      fs::remove(DataSocketOf(r.socket), ec);
      if (!Readd(r)) {
        RetireLog(r.log_file);
        replicas_.erase(it);
      }
      return;
    }
    RestartDecision d = OnCrash(r.crashes, clock_->Now(), options_.restart);
    r.restarts++;
    r.crash_loop = d.crash_loop;
    r.phase = Phase::kBackoff;
    r.due = d.restart_at;
    r.observed = v1::LIFECYCLE_STATE_UNSPECIFIED;
    // Killed by the agent: the reason, not only the signal.
    r.last_error = ExitText(e.status) +
                   (r.kill_reason.empty() ? "" : " by the agent: " + r.kill_reason);
    r.kill_reason.clear();
    log_("replica " + r.spec.replica_id() + ": " + r.last_error + "; restart in " +
         absl::FormatDuration(d.backoff) +
         (d.crash_loop ? " (CrashLoop: " + std::to_string(d.crashes_in_window) +
                             " crashes within the window)"
                       : ""));
    return;
  }
}

void Supervisor::Observe(Replica& r) {
  if (!r.client) return;
  absl::Time now = clock_->Now();
  if (r.phase == Phase::kStarting && r.pid > 0 && options_.start_timeout > absl::ZeroDuration() &&
      now - r.crashes.last_start >= options_.start_timeout) {
    if (!r.start_timed_out) {
      r.start_timed_out = true;
      r.last_error = "not WARM within " + absl::FormatDuration(options_.start_timeout);
      r.kill_reason = r.last_error + " of its start";
      log_("replica " + r.spec.replica_id() + ": " + r.last_error + " of its start; killing pid " +
           std::to_string(r.pid));
    }
    (void)launcher_->Signal(r.pid, SIGKILL);  // its exit restarts it, with backoff
    return;
  }
  // Out of a crash loop once it has run as long as resets the backoff.
  if (r.crash_loop && r.phase == Phase::kRunning &&
      now - r.crashes.last_start >= options_.restart.healthy_reset) {
    r.crash_loop = false;
    log_("replica " + r.spec.replica_id() + ": running for " +
         absl::FormatDuration(now - r.crashes.last_start) + "; no longer in a crash loop");
  }
  auto st = r.client->GetState();
  // Asked, and the runtime is slow to answer: its answer is taken on a later pass (it wakes
  // the loop), and the loop goes on to the other replicas meanwhile. A call that runs out of
  // time answers DEADLINE_EXCEEDED then, and counts as silence below.
  if (IsAnswerPending(st.status())) return;
  if (!st.ok()) {
    if (r.phase == Phase::kRunning) {
      if (r.control_ok) {
        log_("replica " + r.spec.replica_id() + ": control socket not answering (" +
             std::string(st.status().message()) + "); out of routing");
      }
      r.control_ok = false;
      r.last_error = "control socket: " + std::string(st.status().message());
      if (now - r.last_answer >= options_.probe_timeout && r.pid > 0) {
        r.kill_reason = "its control socket did not answer for " +
                        absl::FormatDuration(now - r.last_answer);
        log_("replica " + r.spec.replica_id() + ": no answer for " +
             absl::FormatDuration(now - r.last_answer) + "; killing pid " + std::to_string(r.pid));
        (void)launcher_->Signal(r.pid, SIGKILL);  // the exit restarts it
        r.last_answer = now;
      }
    }
    return;
  }
  r.control_ok = true;
  r.last_answer = now;
  // Leaving SERVING fixes its last use: the state file keeps it across agent restarts.
  if (r.observed == v1::SERVING && st->state() != v1::SERVING) state_dirty_ = true;
  r.observed = st->state();
  if (r.observed == v1::SERVING) r.last_used = now;
  r.grpc_port = st->grpc_port();
  r.http_port = st->http_port();
  r.data_socket = st->data_socket();
  r.device_memory_bytes = st->device_memory_bytes();
  if (r.observed == v1::FAILED) r.last_error = st->failure_reason();
  if (r.phase == Phase::kStarting && (r.observed == v1::WARM || r.observed == v1::SERVING)) {
    r.phase = Phase::kRunning;
    log_("replica " + r.spec.replica_id() + ": " + v1::LifecycleState_Name(r.observed) +
         " after " + std::to_string(st->load_time_micros() / 1000) + " ms");
  }
  if (r.phase != Phase::kRunning || r.removing) return;
  if (probes_ && r.observed == v1::SERVING && r.grpc_port > 0 && r.probe_token == 0 &&
      options_.inference_probe_interval > absl::ZeroDuration() &&
      now - r.last_probe >= options_.inference_probe_interval) {
    r.last_probe = now;
    r.probe_token = ++probe_seq_;
    probes_->Submit(r.probe_token, options_.bind_address + ":" + std::to_string(r.grpc_port),
                    r.spec.model());
  }
  if (r.spec.state() == v1::SERVING && r.observed == v1::WARM) {
    auto p = r.client->Promote();
    if (IsAnswerPending(p.status())) return;  // asked; the next pass takes its answer
    if (p.ok()) {
      r.observed = p->state();
      // One that failed its probe before it was demoted is probed at once, not at its
      // interval: until a probe passes it stays out of routing.
      if (!r.probe.ok()) r.last_probe = absl::InfinitePast();
      log_("replica " + r.spec.replica_id() + ": promoted to SERVING");
    } else {
      r.last_error = "promote: " + std::string(p.status().message());
    }
  } else if (r.spec.state() == v1::WARM && r.observed == v1::SERVING) {
    auto d = r.client->Demote();
    if (IsAnswerPending(d.status())) return;  // as for Promote
    if (d.ok()) {
      r.observed = d->state();
      state_dirty_ = true;  // its last use is fixed now
      r.probe_token = 0;    // a probe under way may meet it WARM, which says nothing
      r.probe_failures = 0;  // counted afresh once it serves again
      log_("replica " + r.spec.replica_id() + ": demoted to WARM");
    } else {
      r.last_error = "demote: " + std::string(d.status().message());
    }
  }
}

bool Supervisor::WaitsForCpus(Replica& r) {
  for (const auto& [id, other] : replicas_) {
    if (&other == &r || (other.pid <= 0 && !other.removing)) continue;
    for (int c : r.cpus.cpus) {
      if (std::find(other.cpus.cpus.begin(), other.cpus.cpus.end(), c) == other.cpus.cpus.end()) {
        continue;
      }
      if (!r.waiting_for_cpus) {
        log_("replica " + r.spec.replica_id() + ": waits for CPU " + std::to_string(c) +
             ", held by " + id + " until it is gone");
      }
      r.waiting_for_cpus = true;
      return true;
    }
  }
  r.waiting_for_cpus = false;
  return false;
}

void Supervisor::Tick() {
  load_time_this_tick_ = absl::ZeroDuration();
  const size_t pool_before = prestarted_.size();
  const int64_t seq_before = prestart_seq_;
  for (const auto& e : launcher_->CollectExits()) HandleExit(e);
  absl::Time now = clock_->Now();
  bool changed_set = false;
  for (auto it = replicas_.begin(); it != replicas_.end();) {
    Replica& r = it->second;
    if (r.removing && r.pid == 0) {
      changed_set = true;
      if (!Readd(r)) {
        it = replicas_.erase(it);
        continue;
      }
    }
    if ((r.phase == Phase::kPending || r.phase == Phase::kBackoff) && r.spec.gpu() >= 0 &&
        unhealthy_gpus_.count(r.spec.gpu())) {
      r.held = true;  // waits for its GPU
      r.phase = Phase::kFailed;
      r.last_error = "gpu " + std::to_string(r.spec.gpu()) + " unhealthy: " +
                     unhealthy_gpus_[r.spec.gpu()];
    } else if ((r.phase == Phase::kPending || r.phase == Phase::kBackoff) && now >= r.due &&
               !WaitsForCpus(r)) {
      if (absl::Status w = StateWritable(); !w.ok()) {
        r.last_error = std::string(w.message());  // not a failed start: no backoff
        ++it;
        continue;
      }
      absl::Status s = Launch(r);
      // (One waiting for its Load's answer changed nothing yet: the Load itself is saved.)
      if (!s.ok() || r.phase != Phase::kPending) changed_set = true;
      if (!s.ok()) {
        r.last_error = std::string(s.message());
        RestartDecision d = OnCrash(r.crashes, now, options_.restart);
        r.crash_loop = d.crash_loop;
        r.phase = Phase::kBackoff;
        r.due = d.restart_at;
        log_("replica " + r.spec.replica_id() + ": cannot start: " + r.last_error);
      }
    } else if (r.phase == Phase::kStarting || r.phase == Phase::kRunning) {
      Observe(r);
    } else if (r.phase == Phase::kStopping && now >= r.due && r.pid > 0) {
      log_("replica " + r.spec.replica_id() + ": did not stop within " +
           absl::FormatDuration(options_.stop_timeout) + "; killing pid " + std::to_string(r.pid));
      (void)launcher_->Signal(r.pid, SIGKILL);
      r.due = now + options_.stop_timeout;
    }
    ++it;
  }
  TakeProbeResults();
  // After the replicas, so that a replica starting this tick takes a ready runtime before
  // the pool counts what it has.
  TickPool();
  if (prestarted_.size() != pool_before || prestart_seq_ != seq_before) changed_set = true;
  if (std::exchange(state_dirty_, false)) changed_set = true;
  if (changed_set) SaveState();
  Publish();
}

void Supervisor::TakeProbeResults() {
  if (!probes_) return;
  // The results held back by a pass whose Stats call was still on its way come first.
  std::vector<ProbeRunner::Result> results = std::move(probes_waiting_for_stats_);
  probes_waiting_for_stats_.clear();
  for (auto& result : probes_->Take()) results.push_back(std::move(result));
  for (auto& result : results) {
    auto r = std::find_if(replicas_.begin(), replicas_.end(), [&](const auto& e) {
      return e.second.probe_token == result.token;
    });
    if (r == replicas_.end()) continue;  // its process is gone: stale
    Replica& rep = r->second;
    const std::string& id = r->first;
    // The probe is over (judged, or of no account): the next one may be sent.
    auto over = [&rep] {
      rep.probe_token = 0;
      if (std::exchange(rep.probe_again, false)) rep.last_probe = absl::InfinitePast();
    };
    // Sent while it was SERVING; one demoted (or stopping) since refuses inference, which says
    // nothing of its health.
    if (rep.phase != Phase::kRunning || rep.removing || rep.observed != v1::SERVING) {
      over();
      continue;
    }
    // Whether the model executed anything since the previous probe's answer.
    bool executed = false;
    if (rep.client) {
      auto stats = rep.client->Stats();
      if (IsAnswerPending(stats.status())) {
        // A slow runtime is the one whose failed probe may only mean busy: judged once its
        // Stats answer comes (it wakes the loop), not as broken for want of it.
        probes_waiting_for_stats_.push_back(std::move(result));
        continue;
      }
      const int64_t now_batches = stats.ok() ? static_cast<int64_t>(stats->batches()) : -1;
      executed = now_batches >= 0 && rep.probe_batches >= 0 && now_batches > rep.probe_batches;
      rep.probe_batches = now_batches;
    }
    over();
    const ProbeVerdict verdict = JudgeProbe(result.status, executed);
    const absl::Status was = rep.probe;
    if (verdict == ProbeVerdict::kHealthy || verdict == ProbeVerdict::kBusy) {
      if (verdict == ProbeVerdict::kBusy && !rep.probe_busy) {
        log_("replica " + id + ": inference probe not answered (" +
             std::string(result.status.message()) +
             "), but the model is executing: busy, kept in routing");
      }
      rep.probe_busy = verdict == ProbeVerdict::kBusy;
      rep.probe = absl::OkStatus();
      if (!was.ok()) log_("replica " + id + ": inference probe passes again");
      rep.probe_failures = 0;
      continue;
    }
    rep.probe_busy = false;
    rep.probe = std::move(result.status);
    if (was.ok()) {
      log_("replica " + id + ": inference probe failed (" + std::string(rep.probe.message()) +
           "); out of routing");
    }
    if (verdict != ProbeVerdict::kBroken) continue;  // the probe's own misfit: not counted
    rep.probe_failures++;
    if (options_.inference_probe_failures > 0 &&
        rep.probe_failures >= options_.inference_probe_failures && rep.pid > 0) {
      rep.kill_reason = "inference probe failed " + std::to_string(rep.probe_failures) +
                        " times in a row: " + std::string(rep.probe.message());
      rep.last_error = rep.kill_reason;
      log_("replica " + id + ": " + rep.kill_reason + "; killing pid " + std::to_string(rep.pid));
      (void)launcher_->Signal(rep.pid, SIGKILL);  // the exit restarts it, with backoff
      rep.probe_failures = 0;
    }
  }
}

void Supervisor::ProbeGpuSoon(int gpu, const std::string& reason) {
  const absl::Time now = clock_->Now();
  for (auto& [id, r] : replicas_) {
    if (r.spec.gpu() != gpu || r.removing || r.observed != v1::SERVING) continue;
    // Once per storm: a GPU raising the same fault every second is probed at the interval.
    if (now - r.xid_probe_at < options_.inference_probe_interval) continue;
    r.xid_probe_at = now;
    if (r.probe_token != 0) {
      r.probe_again = true;  // the one under way may have been sent before the fault
    } else {
      r.last_probe = absl::InfinitePast();
    }
    log_("replica " + id + ": probed now (" + reason + " on gpu " + std::to_string(gpu) + ")");
  }
}

bool Supervisor::InAssignedState(const Replica& r) {
  return !r.removing && r.phase == Phase::kRunning && r.observed == r.spec.state();
}

bool Supervisor::Converged() const {
  for (const auto& [id, r] : replicas_) {
    if (!InAssignedState(r)) return false;
  }
  return true;
}

bool Supervisor::Settled() const {
  for (const auto& [id, r] : replicas_) {
    if (r.removing) return false;
    if (!InAssignedState(r) && !r.crash_loop && !r.held && r.phase != Phase::kFailed) return false;
  }
  return true;
}

namespace {

// A replica's crashes, as the state file keeps them.
json CrashesJson(const CrashHistory& h) {
  json times = json::array();
  for (absl::Time t : h.crashes) times.push_back(absl::ToUnixMillis(t));
  return {{"times_unix_ms", times}, {"consecutive", h.consecutive}};
}

// The crashes a state file kept (what it does not say stays empty).
CrashHistory CrashesFrom(const json& e) {
  CrashHistory h;
  if (!e.is_object()) return h;
  if (e.contains("times_unix_ms") && e["times_unix_ms"].is_array()) {
    for (const auto& t : e["times_unix_ms"]) {
      if (t.is_number_integer()) h.crashes.push_back(absl::FromUnixMillis(t.get<int64_t>()));
    }
  }
  if (e.contains("consecutive") && e["consecutive"].is_number_integer()) {
    h.consecutive = std::max(0, e["consecutive"].get<int>());
  }
  return h;
}

}  // namespace

absl::Status Supervisor::WriteStateFile() {
  json doc = {{"replicas", json::array()}};
  for (const auto& [id, r] : replicas_) {
    if (r.pid <= 0) continue;
    doc["replicas"].push_back({{"id", id},
                               {"pid", r.pid},
                               {"socket", r.socket},
                               {"launch_socket", r.launch_socket},
                               {"launched_as", r.launched_as},
                               {"log", r.log_file},
                               {"cpus", FormatCpuList(r.cpus.cpus)},
                               {"memory_node", r.cpus.memory_node},
                               {"restarts", r.restarts},
                               {"crashes", CrashesJson(r.crashes)},
                               {"last_used_unix_ms", absl::ToUnixMillis(r.last_used)},
                               {"spec", SpecJson(r.spec)}});
    // A drain under way outlives the agent: the next one goes on with it, to the same
    // deadline (an agent restart neither doubles it nor takes the replica back).
    if (r.removing && r.phase == Phase::kStopping) {
      doc["replicas"].back()["stopping_until_unix_ms"] = absl::ToUnixMillis(r.due);
    }
  }
  // Replicas with no process that wait out a backoff: their crashes outlive the agent.
  doc["waiting"] = json::array();
  auto waiting = [&](const std::string& id, const v1::ReplicaSpec& s, const CrashHistory& crashes,
                     int restarts, bool crash_loop, absl::Time due) {
    doc["waiting"].push_back({{"id", id},
                              {"spec", SpecJson(s)},
                              {"crashes", CrashesJson(crashes)},
                              {"restarts", restarts},
                              {"crash_loop", crash_loop},
                              {"due_unix_ms", absl::ToUnixMillis(due)}});
  };
  for (const auto& [id, r] : replicas_) {
    // (And one that crashed before, waiting now for a pre-started runtime's answer.)
    if (r.pid <= 0 && !r.removing &&
        (r.phase == Phase::kBackoff || (r.phase == Phase::kPending && r.restarts > 0))) {
      waiting(id, r.spec, r.crashes, r.restarts, r.crash_loop, r.due);
    }
  }
  for (const auto& [id, w] : recovered_waiting_) {
    if (!replicas_.count(id)) waiting(id, w.spec, w.crashes, w.restarts, w.crash_loop, w.due);
  }
  doc["prestarted"] = json::array();
  for (const auto& [name, p] : prestarted_) {
    if (p.pid <= 0) continue;
    doc["prestarted"].push_back({{"name", name},
                                 {"pid", p.pid},
                                 {"gpu", p.gpu},
                                 {"numa_node", p.numa_node},
                                 {"gpu_uuid", p.gpu_uuid},
                                 {"env", p.env},
                                 {"stopping", p.stopping},
                                 {"socket", p.socket},
                                 {"load_socket", p.load_socket},
                                 {"log", p.log_file}});
  }
  return ReplaceFile(options_.state_dir + "/replicas.json", doc.dump(2) + "\n");
}

absl::Status Supervisor::Recover() {
  std::string path = options_.state_dir + "/replicas.json";
  if (!fs::exists(path)) return absl::OkStatus();
  json doc = json::parse(ReadFileOr(path), nullptr, false);
  if (doc.is_discarded() || !doc.contains("replicas") || !doc["replicas"].is_array()) {
    log_(path + ": not a state file kiln wrote; starting with no replicas");
    return absl::OkStatus();
  }
  for (const auto& e : doc["replicas"]) {
    // Without a pid and a control socket nothing can be told about the process: an entry
    // missing either is passed over, saying which.
    std::string bad;
    if (!e.is_object()) {
      bad = "not an object";
    } else if (!IsPid(e, "pid")) {
      bad = "pid: not a process id";
    } else if (TextOr(e, "socket").empty()) {
      bad = "socket: not a control socket's path";
    } else if (!e.contains("spec")) {
      bad = "spec: missing";
    }
    if (!bad.empty()) {
      log_(path + ": a replica entry passed over (" + bad + ")");
      continue;
    }
    pid_t pid = static_cast<pid_t>(e["pid"].get<int64_t>());
    const std::string socket = TextOr(e, "socket");
    // The pid must still be our runtime: its command line names its control socket (a
    // pre-started runtime's own, when it was handed this replica), as a whole argument.
    const std::string launch_socket = TextOr(e, "launch_socket", socket);  // empty: absent
    const bool ours = launcher_->Alive(pid) && OnControlSocket(launcher_->CommandLine(pid), launch_socket);
    v1::ReplicaSpec spec;
    const bool spec_ok = SpecFrom(e["spec"], &spec);
    const bool gpu_ok = spec.gpu() < static_cast<int>(topology_.gpus.size());
    // Two entries for one id (a file not kiln's): the first is adopted, the second is not.
    const auto first = spec_ok ? replicas_.find(spec.replica_id()) : replicas_.end();
    const bool twice = first != replicas_.end();
    if (twice && first->second.pid == pid) continue;  // the same process listed again
    if (!spec_ok || !gpu_ok || twice) {
      // Not adoptable, but it may be ours and running: stopped, never left without an owner
      // (the assignment starts the replica again where it can).
      if (ours) (void)launcher_->Signal(pid, SIGKILL);
      log_("state file: replica entry for pid " + std::to_string(pid) + " not adoptable (" +
           (!spec_ok ? std::string("its spec cannot be read")
            : twice  ? "a second entry for replica " + spec.replica_id()
                     : "gpu " + std::to_string(spec.gpu()) + " does not exist on this node (" +
                          std::to_string(topology_.gpus.size()) + " GPUs)") +
           ")" + (ours ? "; stopped it" : ""));
      continue;
    }
    NotePrestartName(launch_socket);
    // The id the process itself was given (a renamed pool member's first one).
    const std::string launched_as = TextOr(e, "launched_as", spec.replica_id());
    auto client = clients_->Connect(socket);
    absl::StatusOr<v1::RuntimeState> st =
        ours ? client->AwaitState() : absl::StatusOr<v1::RuntimeState>(absl::NotFoundError("gone"));
    // A runtime that names its replica must name the one it was given (an older one names none).
    const bool other_replica =
        st.ok() && !st->replica_id().empty() && st->replica_id() != launched_as;
    if (!ours || (st.ok() && (st->model_name() != spec.model() ||
                              st->model_version() != spec.version() || other_replica))) {
      if (ours) (void)launcher_->Signal(pid, SIGKILL);  // ours but serving something else
      log_("replica " + spec.replica_id() + ": pid " + std::to_string(pid) + " not adoptable (" +
           (ours ? (other_replica ? "it runs replica " + st->replica_id()
                                  : std::string("different model"))
                 : "gone") +
           ")");
      continue;
    }
    // Ours but not answering now (busy under load, say): adopted all the same, out of routing
    // until it answers, and killed only as any replica is, after --probe-timeout of silence.
    if (!launcher_->Adopt(pid).ok()) continue;
    Replica r;
    r.spec = spec;
    auto cpus = ParseCpuList(TextOr(e, "cpus"), "state file cpus");
    if (cpus.ok()) r.cpus.cpus = *cpus;
    r.cpus.memory_node = IntOr(e, "memory_node", -1);
    r.pid = pid;
    r.socket = socket;
    r.launch_socket = launch_socket;
    r.launched_as = launched_as;
    r.log_file = TextOr(e, "log");
    r.client = std::move(client);
    // Still loading: a start, under the start timeout from now (Observe moves it on at WARM).
    r.phase = st.ok() && st->state() == v1::LOADING ? Phase::kStarting : Phase::kRunning;
    if (st.ok()) {
      r.observed = st->state();
      r.grpc_port = st->grpc_port();
      r.http_port = st->http_port();
      r.data_socket = st->data_socket();
      r.device_memory_bytes = st->device_memory_bytes();
    } else {
      r.observed = v1::LIFECYCLE_STATE_UNSPECIFIED;
      r.last_error = "control socket: " + std::string(st.status().message());
    }
    r.restarts = IntOr(e, "restarts", 0);
    if (e.contains("crashes")) r.crashes = CrashesFrom(e["crashes"]);
    r.adopted = true;
    r.control_ok = st.ok();
    r.last_answer = clock_->Now();
    // Least recently used survives the agent's restart (what the file says; else now).
    r.last_used = clock_->Now();
    if (e.contains("last_used_unix_ms") && e["last_used_unix_ms"].is_number_integer()) {
      r.last_used = std::min(r.last_used, absl::FromUnixMillis(e["last_used_unix_ms"].get<int64_t>()));
    }
    OnStart(r.crashes, clock_->Now());
    const auto stopping = e.find("stopping_until_unix_ms");
    if (stopping != e.end() && stopping->is_number_integer()) {
      // It was draining: it goes on draining (the SIGTERM was sent), killed at its deadline.
      r.removing = true;
      r.phase = Phase::kStopping;
      r.due = std::min(absl::FromUnixMillis(stopping->get<int64_t>()),
                       clock_->Now() + options_.stop_timeout);
    }
    log_("replica " + spec.replica_id() + ": adopted pid " + std::to_string(pid) + " (" +
         (st.ok() ? v1::LifecycleState_Name(r.observed)
                  : "not answering: " + std::string(st.status().message())) +
         (r.removing ? ", draining" : "") + ")");
    replicas_.emplace(spec.replica_id(), std::move(r));
  }
  if (doc.contains("waiting") && doc["waiting"].is_array()) {
    for (const auto& e : doc["waiting"]) {
      if (!e.is_object() || !e.contains("id") || !e["id"].is_string() || !e.contains("spec") ||
          replicas_.count(e["id"].get<std::string>())) {
        continue;
      }
      Waiting w;
      if (!SpecFrom(e["spec"], &w.spec)) continue;
      w.crashes = CrashesFrom(e.contains("crashes") ? e["crashes"] : json());
      w.restarts = IntOr(e, "restarts", 0);
      w.crash_loop = FlagSet(e, "crash_loop");
      w.due = clock_->Now();
      if (e.contains("due_unix_ms") && e["due_unix_ms"].is_number_integer()) {
        w.due = std::max(w.due, absl::FromUnixMillis(e["due_unix_ms"].get<int64_t>()));
      }
      recovered_waiting_.emplace(e["id"].get<std::string>(), std::move(w));
    }
  }
  RecoverPrestarted(doc);
  Publish();
  return WriteStateFile();
}

void Supervisor::NotePrestartName(const std::string& path) {
  // New names never reuse a socket or log that a live process may still name.
  std::string base = fs::path(path).filename().string();
  int64_t seq = 0;
  if (base.rfind("prestart-", 0) == 0 &&
      absl::SimpleAtoi(base.substr(9, base.find('.') == std::string::npos
                                          ? std::string::npos
                                          : base.find('.') - 9),
                       &seq)) {
    prestart_seq_ = std::max(prestart_seq_, seq);
  }
}

void Supervisor::RecoverPrestarted(const json& doc) {
  if (!doc.contains("prestarted") || !doc["prestarted"].is_array()) return;
  const auto pools = Pools();
  for (const auto& e : doc["prestarted"]) {
    if (!e.is_object() || !IsPid(e, "pid") || !e.contains("socket") || !e["socket"].is_string() ||
        !e.contains("name") || !e["name"].is_string() || !e.contains("gpu") ||
        !e["gpu"].is_number_integer()) {
      log_("state file: a pre-started runtime's entry passed over (not one kiln wrote)");
      continue;
    }
    const std::string name = e["name"].get<std::string>();
    const pid_t pid = static_cast<pid_t>(e["pid"].get<int64_t>());
    Prestarted p;
    p.gpu = e["gpu"].get<int>();
    p.numa_node = IntOr(e, "numa_node", -1);
    p.gpu_uuid = TextOr(e, "gpu_uuid");
    p.socket = e["socket"].get<std::string>();
    p.log_file = TextOr(e, "log");
    if (e.contains("env") && e["env"].is_array()) {
      for (const auto& v : e["env"]) {
        if (v.is_string()) p.env.push_back(v.get<std::string>());
      }
    }
    NotePrestartName(p.socket);
    // Ours: a pre-started runtime named with the socket. One started from another runtime
    // binary (an upgrade moved it) is not kept, but stopped: left alone it would hold its CPUs
    // and device context for ever.
    const std::string cmdline = launcher_->CommandLine(pid);
    const bool ours = launcher_->Alive(pid) && OnControlSocket(cmdline, p.socket) &&
                      cmdline.find(std::string(1, '\0') + "--prestart" + std::string(1, '\0')) !=
                          std::string::npos;
    if (!ours) continue;
    const bool same_binary =
        cmdline.rfind(options_.runtime_binary + std::string(1, '\0'), 0) == 0;
    p.client = clients_->Connect(p.socket);
    auto st = p.client->AwaitState();
    const bool waiting = st.ok() && st->state() == v1::LOADING && st->model_name().empty();
    // Still the pool it was started for: a GPU that is the same physical one (indexes can
    // change across reboots and hardware changes).
    std::string why;
    if (FlagSet(e, "stopping")) {
      why = "it was being stopped";
    } else if (!TextOr(e, "load_socket").empty()) {
      // It may be taking that Load still (and look blank until it has).
      why = "it was sent a Load";
    } else if (!same_binary) {
      why = "started from another runtime binary than " + options_.runtime_binary;
    } else if (!waiting) {
      why = "not waiting for a Load";
    } else if (PoolTarget(pools, p.key()) <= 0) {
      why = "no pool for it";
    } else if (p.gpu >= static_cast<int>(topology_.gpus.size())) {
      why = "gpu " + std::to_string(p.gpu) + " does not exist on this node";
    } else if (p.gpu >= 0 && topology_.gpus[p.gpu].identity.uuid != p.gpu_uuid) {
      why = "gpu " + std::to_string(p.gpu) + " is now another GPU";
    } else if (!launcher_->Adopt(pid).ok()) {
      log_("pre-started runtime " + name + ": pid " + std::to_string(pid) + " gone");
      continue;
    }
    if (!why.empty()) {
      (void)launcher_->Signal(pid, SIGKILL);
      // One sent a Load may have bound the socket it named: none is started there until it
      // is gone.
      if (!TextOr(e, "load_socket").empty()) dying_sockets_[pid] = TextOr(e, "load_socket");
      log_("pre-started runtime " + name + ": pid " + std::to_string(pid) + " killed (" + why +
           ")");
      continue;
    }
    p.pid = pid;
    p.ready = true;
    p.adopted = true;
    p.started = clock_->Now();
    log_("pre-started runtime " + name + ": adopted pid " + std::to_string(pid));
    prestarted_.emplace(name, std::move(p));
  }
}

std::set<int> Supervisor::HeldCpus() const {
  std::set<int> held;
  for (const auto& [id, r] : replicas_) held.insert(r.cpus.cpus.begin(), r.cpus.cpus.end());
  return held;
}

std::shared_ptr<const std::vector<ReplicaView>> Supervisor::Snapshot() const {
  absl::MutexLock lock(&snapshot_mu_);
  return snapshot_;
}

void Supervisor::Publish() {
  auto views = std::make_shared<std::vector<ReplicaView>>();
  for (const auto& [id, r] : replicas_) {
    ReplicaView v;
    v.spec = r.spec;
    v.phase = PhaseName(static_cast<int>(r.phase));
    if (r.crash_loop && r.phase == Phase::kBackoff) v.phase = "CRASH_LOOP";
    v.state = r.observed;
    v.pid = r.pid;
    v.grpc_port = r.grpc_port;
    v.http_port = r.http_port;
    v.data_socket = r.data_socket;
    v.restarts = r.restarts;
    v.crash_loop = r.crash_loop;
    v.adopted = r.adopted;
    v.removing = r.removing;
    v.last_error = r.last_error;
    v.healthy = r.phase == Phase::kRunning && r.control_ok && r.probe.ok();
    if (!r.control_ok) {
      v.health_reason = "control socket not answering";
    } else if (!r.probe.ok()) {
      v.health_reason = "inference probe: " + std::string(r.probe.message());
    }
    v.cpus = FormatCpuList(r.cpus.cpus);
    v.socket = r.socket;
    v.device = Device(r.spec);
    v.device_memory_bytes = r.device_memory_bytes;
    v.last_used = r.last_used;
    views->push_back(std::move(v));
  }
  auto pool = std::make_shared<std::vector<PrestartedView>>();
  for (const auto& [name, p] : prestarted_) {
    pool->push_back({name, p.gpu, p.numa_node, p.pid, p.ready, p.adopted, p.stopping, p.socket,
                     p.loading_for});
  }
  absl::MutexLock lock(&snapshot_mu_);
  snapshot_ = std::move(views);
  prestarted_snapshot_ = std::move(pool);
}

std::shared_ptr<const std::vector<PrestartedView>> Supervisor::PrestartedSnapshot() const {
  absl::MutexLock lock(&snapshot_mu_);
  return prestarted_snapshot_;
}

}  // namespace kiln
