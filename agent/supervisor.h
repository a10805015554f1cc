#pragma once

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/cpu_allocator.h"
#include "agent/inference_prober.h"
#include "agent/process_launcher.h"
#include "agent/runtime_client.h"
#include "agent/topology.h"
#include "common/clock.h"
#include "health/restart_policy.h"
#include "kiln/v1/control_plane.pb.h"
#include "nlohmann/json_fwd.hpp"

namespace kiln {

struct SupervisorOptions {
  std::string runtime_binary;
  // replicas.json (what re-adoption reads), sockets/ (mode 0700) and logs/ live here.
  std::string state_dir;
  std::string bind_address = "127.0.0.1";
  RestartPolicy restart;
  // After SIGTERM a replica drains; past this it is killed.
  absl::Duration stop_timeout = absl::Seconds(30);
  // CPUs of the first NUMA node kept for the agent itself.
  int reserved_cpus = 1;
  // GPU replicas run on cpu (a --fake-gpus node).
  bool fake_gpus = false;
  // WARM replicas on a real GPU get CUDA_DISABLE_PERF_BOOST=1.
  bool park_warm_replicas = false;
  std::string runtime_log_level = "info";
  // Runtimes start with glibc malloc's heap on transparent huge pages (GLIBC_TUNABLES
  // glibc.malloc.hugetlb=1, unless the agent's own GLIBC_TUNABLES says otherwise).
  bool runtime_malloc_huge_pages = true;
  // Given to each runtime as --idle-spin-us when not 0: after each execution its executions'
  // thread waits busily this long for the next request before it sleeps.
  int64_t runtime_idle_spin_us = 0;
  // Given to each runtime as --model-cpus when not 0: its model runs alone on the last this
  // many of the replica's CPUs, everything else on the rest.
  int64_t runtime_model_cpus = 0;
  // A running replica whose control socket does not answer for this long is killed (and
  // restarted); it leaves routing at the first unanswered probe.
  absl::Duration probe_timeout = absl::Seconds(10);
  // A tiny real inference per SERVING replica this often; 0 = off. A failed probe takes the
  // replica out of routing; this many failed in a row get it killed and restarted with
  // backoff, as a crash (0 = never: it stays out of routing until a probe passes).
  absl::Duration inference_probe_interval = absl::Seconds(10);
  int inference_probe_failures = 3;
  // Threads that run the probes, off the agent's loop (0: inline, for tests).
  int probe_threads = 2;
  // When a GPU goes unhealthy: true, its replicas drain at once (a node on its own); false,
  // they keep serving while they can (a controller moves them make-before-break). Either way
  // none is restarted on that GPU until it is healthy again.
  bool drain_on_unhealthy_gpu = true;
  // Pre-started runtimes (kiln-runtime --prestart: LibTorch loaded and the device ready, no
  // model) kept per GPU and for CPU replicas. A replica that starts takes one (RuntimeControl
  // Load) instead of spawning cold, and the pool refills in the background. 0 = none.
  int prestart_per_gpu = 0;
  int prestart_cpu = 0;
  // A pre-started runtime not ready within this long is killed (and replaced, with backoff).
  absl::Duration prestart_timeout = absl::Seconds(120);
  // A replica not WARM (loaded and warmed up) within this long of its start is killed and
  // restarted with backoff: a load stuck on a hung device or a stalled model store would
  // otherwise hold its CPUs and the node's readiness for ever. 0 = no limit.
  absl::Duration start_timeout = absl::Minutes(10);
  // Called on the supervisor's thread once replicas that leave routing (no longer assigned,
  // assigned WARM, draining off an unhealthy GPU) are published so, and before any of them is
  // told to drain or demote: the node's router stops choosing them first, so that no new
  // request is sent to a replica about to refuse work. Empty: nothing is called.
  std::function<void()> before_leaving_routing;
};

// One pre-started runtime waiting for a replica.
struct PrestartedView {
  std::string name;
  int gpu = -1;        // -1 = for CPU replicas
  int numa_node = -1;  // a CPU pool's NUMA node on a multi-node machine; else -1
  pid_t pid = 0;
  bool ready = false;  // answers its control socket with no model
  bool adopted = false;
  bool stopping = false;  // told to exit; leaves the list when it has
  std::string socket;
  // The replica it was sent a Load for whose answer is still on its way (empty: none).
  std::string loading_for;
};

// What the agent reports and routes by, for one replica.
struct ReplicaView {
  v1::ReplicaSpec spec;
  std::string phase;  // STARTING, RUNNING, BACKOFF, CRASH_LOOP, STOPPING, FAILED
  v1::LifecycleState state = v1::LIFECYCLE_STATE_UNSPECIFIED;  // last observed
  pid_t pid = 0;
  int grpc_port = 0;
  int http_port = 0;
  int restarts = 0;
  bool crash_loop = false;
  bool adopted = false;
  bool removing = false;  // no longer assigned: draining, then gone
  // Answers its control socket and (when SERVING) the inference probe: only healthy
  // replicas are routed to.
  bool healthy = false;
  std::string health_reason;
  std::string last_error;
  std::string cpus;
  std::string socket;
  // Where the runtime serves ModelInfer to the router (its report; empty: gRPC only).
  std::string data_socket;
  std::string device;
  // Device memory the runtime reports holding (weights, activations, CUDA graph pools);
  // 0 until it reports, and on cpu.
  int64_t device_memory_bytes = 0;
  // Last seen SERVING, or when it started: what "least recently used" means for a pool.
  absl::Time last_used;
};

// Owns every kiln-runtime process on the node: starts replicas with their CPU set and memory
// node, promotes and demotes them to the assigned state, restarts crashed ones with backoff
// (crash loops are reported and restarted only at the maximum backoff), stops removed ones
// (SIGTERM drains; killed past the stop timeout), and records them in a state file so that a
// restarted agent adopts them instead of restarting them. Not thread-safe: one thread (the
// agent's loop) calls it; others read Snapshot().
class Supervisor {
 public:
  using Log = std::function<void(const std::string&)>;
  Supervisor(SupervisorOptions options, Topology topology, ProcessLauncher* launcher,
             RuntimeClientFactory* clients, Clock* clock, Log log,
             InferenceProber* prober = nullptr);

  // Reads the state file and adopts the replicas still running and answering.
  absl::Status Recover();
  // Makes the assignment the desired set. INVALID_ARGUMENT or RESOURCE_EXHAUSTED (no CPUs)
  // leave the previous assignment in force. `renames` (old id -> new id) first give running
  // replicas the id they go on under (a warm pool member taking a new replica's place): the
  // same process, CPUs and socket; its spec must match the new id's but for the state.
  absl::Status Apply(const v1::Assignment& assignment,
                     const std::map<std::string, std::string>& renames = {});
  // One pass: collect exits, restart what is due, start, promote/demote, stop.
  void Tick();

  // An unhealthy GPU takes no new replicas and its replicas are drained (not restarted) until
  // it is healthy again; they stay assigned and are reported with the reason.
  void SetGpuHealth(int gpu, bool healthy, const std::string& reason);
  // Something on the GPU failed that may have broken a replica's device context (an
  // application-class Xid; NVML does not say whose): its SERVING replicas are probed on the
  // next pass instead of at their interval.
  void ProbeGpuSoon(int gpu, const std::string& reason);

  // The replicas as last published. Keep the returned pointer while reading: iterating
  // `*Snapshot()` directly lets the vector be freed mid-loop when a newer one is published.
  std::shared_ptr<const std::vector<ReplicaView>> Snapshot() const;
  // The CPUs the replicas hold (each replica's exclusive set, from its assignment until it
  // is gone).
  std::set<int> HeldCpus() const;
  // The CPUs kept for the agent itself (AgentReservedCpus), never given to a replica.
  const std::vector<int>& reserved_cpus() const { return reserved_; }
  // Stops every pre-started runtime and keeps the pool empty (the agent stopping its
  // replicas on exit).
  void StopPrestarted();
  // The pre-started runtimes as last published.
  std::shared_ptr<const std::vector<PrestartedView>> PrestartedSnapshot() const;
  // Read from any thread (the controller stream reports it).
  int64_t applied_generation() const { return applied_generation_.load(); }
  // True once every assigned replica has reached its assigned state.
  bool Converged() const;
  // Nothing is on its way: every replica is in its assigned state, or crash-looping, or held
  // off an unhealthy GPU, or failed (what the node serves now is what it will serve).
  bool Settled() const;

 private:
  enum class Phase { kPending, kStarting, kRunning, kBackoff, kStopping, kFailed };
  struct Replica {
    v1::ReplicaSpec spec;
    CpuAssignment cpus;
    int64_t device_memory_bytes = 0;
    Phase phase = Phase::kPending;
    pid_t pid = 0;
    std::string socket;
    // The socket named on the process's command line: `socket`, or the pre-started
    // runtime's own when one was handed this replica (what re-adoption checks).
    std::string launch_socket;
    // The id the process was started (or handed a model) as: what its GetState names. A file's
    // pool member renamed to a scale-up's replica keeps its first one.
    std::string launched_as;
    std::string log_file;
    std::unique_ptr<RuntimeClient> client;
    v1::LifecycleState observed = v1::LIFECYCLE_STATE_UNSPECIFIED;
    int grpc_port = 0;
    int http_port = 0;
    std::string data_socket;  // as the runtime reports it
    CrashHistory crashes;
    absl::Time due;  // restart time (kBackoff) or kill time (kStopping)
    int restarts = 0;
    bool crash_loop = false;
    bool removing = false;
    // Assigned again while it drained: started anew, as this, once it is gone.
    std::optional<v1::ReplicaSpec> readd;
    CpuAssignment readd_cpus;
    bool adopted = false;
    bool held = false;  // stopped because its GPU is unhealthy
    bool start_timed_out = false;  // killed for not reaching WARM in time (logged once)
    bool gpu_drain = false;        // SIGTERMed to drain off its unhealthy GPU
    bool waiting_for_cpus = false;  // its CPUs are still held by a replica on its way out
    absl::Time last_answer;
    absl::Time last_used;
    bool control_ok = false;
    absl::Time last_probe = absl::InfinitePast();
    absl::Status probe = absl::OkStatus();
    uint64_t probe_token = 0;  // the probe under way (0: none); a result for another is stale
    int probe_failures = 0;    // in a row, of those that say it is broken (health/probe_verdict.h)
    // Its executions (RuntimeStats.batches) at the last probe's answer; -1: unknown.
    int64_t probe_batches = -1;
    bool probe_busy = false;   // the last probe found it busy (logged once)
    // An application Xid on its GPU: when it was last probed for one (one probe per storm), and
    // whether one more is due once the probe under way answers.
    absl::Time xid_probe_at = absl::InfinitePast();
    bool probe_again = false;
    // Why the agent killed it, for its exit's report.
    std::string kill_reason;
    std::string last_error;
  };
  // Running in the state its spec asks for, and not being removed.
  static bool InAssignedState(const Replica& r);

  // A pool: the pre-started runtimes for one GPU, or for CPU replicas (one per NUMA node on
  // a multi-node machine, so that each is bound to its node from exec on).
  using PoolKey = std::pair<int, int>;  // (gpu, numa node): (g, -1) or (-1, node or -1)
  struct Prestarted {
    int gpu = -1;
    int numa_node = -1;
    pid_t pid = 0;
    std::string socket;
    std::string log_file;
    std::vector<std::string> env;  // what it was started with on top of the agent's
    std::string gpu_uuid;          // the physical GPU it was started on
    std::unique_ptr<RuntimeClient> client;
    absl::Time started;
    absl::Time due;  // for `stopping`: killed past this
    int refusals = 0;
    // The replica a Load on its way was sent for (empty: none). The replica waits for the
    // answer up to kHandOverWait, then starts cold and leaves the answer to TickPool
    // (`load_abandoned`).
    std::string loading_for;
    absl::Time load_sent;
    std::vector<std::string> load_args;  // what the Load on its way was sent
    bool load_abandoned = false;
    // The control socket a Load it may have taken names: kept from the Load until the process
    // is gone (or refused it), so that no other replica is started on it.
    std::string load_socket;
    bool ready = false;
    bool adopted = false;
    bool stopping = false;  // told to exit (GPU unhealthy, pool shrank, or retired)
    PoolKey key() const { return {gpu, numa_node}; }
  };
  struct PoolSlot {
    CrashHistory crashes;
    absl::Time due = absl::InfinitePast();  // no new one before this (after a failure)
  };

  absl::Status Launch(Replica& r);
  // Names `r`'s sockets and log, and the request that starts it cold.
  absl::StatusOr<LaunchRequest> ColdStart(Replica& r);
  // What every runtime's launch adds to the request, and which a pre-started runtime is never
  // compared on (it is not in `env` of ColdStart or of a pool entry): malloc on huge pages.
  LaunchRequest WithRuntimeEnvironment(LaunchRequest req) const;
  // Another replica (one on its way out) still holds one of `r`'s CPUs: `r` starts once it is
  // gone. Says so in the log the first time.
  bool WaitsForCpus(Replica& r);
  // Gives `r` a ready pre-started runtime of its pool (same GPU, or for a CPU replica the same
  // NUMA node) started with the environment a cold start would have. kHanded: one took it;
  // kWaiting: the Load's answer is still on its way (`r` stays pending and asks again on the
  // next pass, which the answer wakes); kCold: none could (then it starts cold); kGaveUp: the
  // Load on its way is given up (unanswered past kHandOverWait, or sent for what `r` no
  // longer is), and `r` starts cold on sockets of its own. A runtime that fails the Load is
  // killed; one that refuses the arguments twice is retired.
  enum class HandOverResult { kHanded, kWaiting, kCold, kGaveUp };
  HandOverResult HandOver(Replica& r, const LaunchRequest& cold);
  // A pre-started runtime whose Load no replica waits for now (it was removed, or stopped
  // waiting): its answer, once it comes, stops it (it took a model nobody wants) or drops it.
  // True when `it` was erased (advanced).
  bool SettleAbandonedLoad(std::map<std::string, Prestarted>::iterator& it);
  // Kills a pre-started runtime that failed a Load and drops it (a failure for its pool's
  // backoff); the socket its Load named stays taken until the process is gone.
  void KillOverLoad(std::map<std::string, Prestarted>::iterator it);
  // A pre-started runtime that refused a Load's arguments (still blank): back in its pool,
  // retired at the second refusal.
  void RefusedLoad(const std::string& name, Prestarted& p);
  // The pre-started runtime whose Load replica `id` waits for (end() if none).
  std::map<std::string, Prestarted>::iterator LoadAwaitedBy(const std::string& id);

  void StopPrestarted(const std::string& name, Prestarted& p, const std::string& why);
  void DropPrestarted(std::map<std::string, Prestarted>::iterator it, bool failed);
  void TickPool();
  // The pools this node keeps, with the CPUs and memory node each one's processes start on.
  struct PoolPlace {
    std::vector<int> cpus;
    int memory_node = -1;
  };
  std::map<PoolKey, PoolPlace> Pools() const;
  // How many pre-started runtimes pool `key` of `pools` (Pools()) keeps.
  int PoolTarget(const std::map<PoolKey, PoolPlace>& pools, PoolKey key) const;
  absl::Status LaunchPrestarted(PoolKey key, const PoolPlace& place);
  // Adopts the pre-started runtimes of the state file (`doc`) still waiting for a Load.
  void RecoverPrestarted(const nlohmann::json& doc);
  // Keeps new pre-started names above the one in `path` (a socket or log of one).
  void NotePrestartName(const std::string& path);
  void HandleExit(const ProcessExit& e);
  // A removed replica that is gone becomes its re-assignment (pending), if it has one.
  bool Readd(Replica& r);
  void Observe(Replica& r);
  // Marks `r` stopping; its pid goes into `drains`, to be sent SIGTERM by LeaveRouting.
  void BeginStop(Replica& r, const std::string& why, std::vector<pid_t>* drains);
  // Publishes, has the router let go of what left routing (Options::before_leaving_routing),
  // then sends each of `drains` SIGTERM (it drains, then exits).
  void LeaveRouting(const std::vector<pid_t>& drains);
  std::string Device(const v1::ReplicaSpec& spec) const;
  std::set<int> CpusInUse(const std::string& except_id) const;
  absl::Status WriteStateFile();
  // Writes the state file now: at once after each process started, so that an agent killed
  // later in the same pass (its watchdog, say) still finds the process to adopt. A failed
  // write is logged and tried again on the next tick.
  void SaveState();
  void Publish();
  // Applies the inference probes that finished: health, and a restart after
  // inference_probe_failures in a row.
  void TakeProbeResults();

  const SupervisorOptions options_;
  const Topology topology_;
  ProcessLauncher* launcher_;
  RuntimeClientFactory* clients_;
  Clock* clock_;
  Log log_;
  std::unique_ptr<ProbeRunner> probes_;  // null without a prober
  // Probe results whose replica's Stats answer was still on its way: judged on a later pass.
  std::vector<ProbeRunner::Result> probes_waiting_for_stats_;
  uint64_t probe_seq_ = 0;
  std::vector<int> reserved_;
  std::map<std::string, Replica> replicas_;  // by replica id
  // A replica with no process when the agent stopped (waiting out a backoff, in a crash
  // loop), from the state file: the first assignment that wants it again, unchanged, goes on
  // with its backoff and crash count instead of starting it hot.
  struct Waiting {
    v1::ReplicaSpec spec;
    CrashHistory crashes;
    int restarts = 0;
    bool crash_loop = false;
    absl::Time due;
  };
  std::map<std::string, Waiting> recovered_waiting_;  // until the first Apply after Recover
  std::map<int, std::string> unhealthy_gpus_;  // gpu -> reason
  std::map<std::string, Prestarted> prestarted_;  // by name, "prestart-7"
  std::map<PoolKey, PoolSlot> pool_slots_;
  // Control sockets named in the Loads of pre-started runtimes killed over them, by pid, until
  // the process is gone: no replica is started on one meanwhile.
  std::map<pid_t, std::string> dying_sockets_;
  int64_t prestart_seq_ = 0;
  bool pool_stopped_ = false;
  bool state_dirty_ = false;  // the state file is rewritten on the next Tick
  absl::Status state_write_;  // the state file's last write
  // OK once the state file is written (a failed write is tried again here); else why no
  // process may be started now.
  absl::Status StateWritable();
  absl::Duration load_time_this_tick_;  // Loads block the loop: a budget per Tick
  std::atomic<int64_t> applied_generation_{0};

  mutable absl::Mutex snapshot_mu_;
  std::shared_ptr<const std::vector<ReplicaView>> snapshot_ ABSL_GUARDED_BY(snapshot_mu_);
  std::shared_ptr<const std::vector<PrestartedView>> prestarted_snapshot_
      ABSL_GUARDED_BY(snapshot_mu_);
};

}  // namespace kiln
