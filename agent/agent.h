#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/gpu_monitor.h"
#include "agent/gpu_power.h"
#include "agent/loop_tasks.h"
#include "agent/supervisor.h"
#include "agent/topology.h"
#include "common/clock.h"
#include "common/grpc_tls.h"

namespace kiln {

struct AgentOptions {
  std::string node_name;
  std::string assignment_file;  // run alone from this file...
  std::string controller;       // ...or take assignments from this controller (host:port)
  // TLS to the controller (--controller-ca, --controller-cert, --controller-key): the CA
  // turns it on; the certificate is this node's identity when the controller requires one.
  TlsFiles controller_tls;
  std::string controller_server_name;  // the name the controller's certificate must carry
  std::string state_dir = "/var/lib/kiln/agent";
  std::string runtime_binary;
  std::string sysfs_root = "/sys";
  std::string fake_gpus;  // "N:MEM"
  std::string gpu_power = "dry-run";
  int reserved_cpus = 1;
  std::string admin_bind = "0.0.0.0";
  int admin_port = 8002;  // 0 = pick a free one
  // Node ingress (the router): OIP v2 over gRPC and REST. 0 = pick a free port.
  std::string ingress_bind = "0.0.0.0";
  int grpc_port = 8001;
  int http_port = 8000;
  // The router busy-polls local replicas' data sockets for answers (agent/busy_poll.h):
  // windows of this many microseconds around each expected answer (0 = off), at most
  // `router_busy_poll_threads` readers at once, each holding a CPU while it spins. Off by
  // default: it removed the router's overhead on a 2-vCPU VM but bought nothing on a 16-core
  // GPU host, where it cost half a CPU (bench/RESULTS.md).
  int64_t router_busy_poll_us = 0;
  int router_busy_poll_threads = 1;
  // Threads of the router's REST server (reading, HTTP parsing, replies). One by default: with
  // a second each request hopped between them, and the router's median was 26-45 µs higher on
  // a 2-vCPU VM (bench/RESULTS.md).
  int router_http_threads = 1;
  absl::Duration tick = absl::Milliseconds(100);
  absl::Duration stop_timeout = absl::Seconds(30);
  // A replica not WARM within this long of its start is killed and restarted (0 = no limit).
  absl::Duration start_timeout = absl::Minutes(10);
  // A tiny real inference per SERVING replica (--inference-probe-interval-ms, 0 = off), given
  // --inference-probe-timeout-ms; a failure takes it out of routing, and
  // --inference-probe-failures in a row (0 = never) get it restarted.
  absl::Duration inference_probe_interval = absl::Seconds(10);
  absl::Duration inference_probe_timeout = absl::Seconds(2);
  int inference_probe_failures = 3;
  bool stop_replicas_on_exit = false;
  std::string runtime_log_level = "info";
  // Runtimes start with malloc's heap on transparent huge pages (SupervisorOptions).
  bool runtime_malloc_huge_pages = true;
  // Each runtime's executions' thread waits busily this long for the next request after each
  // execution (the runtime's --idle-spin-us); 0 = off.
  int64_t runtime_idle_spin_us = 0;
  // Each runtime runs its model alone on the last this many of its CPUs (the runtime's
  // --model-cpus); 0 = off.
  int64_t runtime_model_cpus = 0;
  // Pre-started runtimes kept ready per GPU (--prestart-per-gpu) and for CPU replicas
  // (--prestart-cpu): a replica that starts is handed one instead of spawning cold.
  int prestart_per_gpu = 0;
  int prestart_cpu = 0;
  // This node's labels (--label KEY=VALUE), sent to the controller when the agent registers:
  // `topology.kubernetes.io/zone` (or `zone`) is the zone placement spreads replicas across.
  std::map<std::string, std::string> labels;
};

absl::Status ValidateAgentOptions(const AgentOptions& options);

// --label values ("KEY=VALUE", Kubernetes label syntax: a key is [DNS-prefix/]name, the name
// and the value at most 63 of [A-Za-z0-9-_.], starting and ending alphanumeric; the value may
// be empty). INVALID_ARGUMENT naming the flag, the value and the reason; a key given twice is
// an error.
absl::StatusOr<std::map<std::string, std::string>> ParseNodeLabels(
    const std::vector<std::string>& flags);

// When a replica was last active, which its reported idle time counts from. With an earlier
// Stats sample (its request count and when it was last active): now when the count moved
// since, else the sample's time (a count that went down, a restarted runtime, counts as
// moved). Without one (the replica just started, or the agent did): `last_serving`, now for a
// replica serving now, else when the supervisor last saw it SERVING (the state file keeps it),
// so a WARM replica's idle time (what "least recently used" means to the controller's
// evictions) survives an agent restart.
struct ActivitySample {
  uint64_t requests = 0;
  absl::Time active;
};
absl::Time LastActive(const std::optional<ActivitySample>& previous, uint64_t requests,
                      absl::Time now, absl::Time last_serving);

class HttpServer;
class Router;

// One node: discovers its topology, runs the assignment through the supervisor on one loop
// thread, sets GPU power state by what each GPU holds, and serves /healthz, /readyz,
// /metrics and /v1/replicas. Replicas outlive the agent and are adopted by the next one.
class Agent {
 public:
  static absl::StatusOr<std::unique_ptr<Agent>> Create(AgentOptions options, Clock* clock);
  ~Agent();

  absl::Status Start();
  // Re-reads the assignment file on the loop (SIGHUP). A bad file keeps the old assignment.
  void RequestReload();
  // A child process changed state (SIGCHLD): the loop runs a pass at once, so a replica's
  // exit is seen and acted on without waiting out the tick. Replicas adopted from an earlier
  // agent are not its children: the launcher watches their pidfds and wakes the loop the same
  // way.
  void ChildExited();
  void Stop();

  int admin_port() const;
  int ingress_grpc_port() const;
  int ingress_http_port() const;
  // An assignment is applied and, once since the agent started, every replica settled
  // (/readyz, systemd's READY=1).
  bool ready() const { return ready_.load(); }
  // Every replica is in its assigned state.
  bool converged() const { return converged_.load(); }
  bool live() const;
  std::string MetricsText();
  std::string ReplicasJson() const;

 private:
  Agent(AgentOptions options, Clock* clock, Topology topology, std::unique_ptr<GpuDriver> gpus);
  void Loop();
  // The router's table again, from the controller's routing and the replicas as published.
  void RefreshRoutes();
  // Runs `task` on the loop thread and waits (bounded) for its result.
  absl::Status RunOnLoop(std::function<absl::Status()> task);
  absl::Status ApplyFromController(const v1::Assignment& a);
  // Runs an assignment file: its replicas as written, its warm pools kept by
  // PlanNodePools (a new replica takes a pool member, one removed joins a short pool).
  absl::Status ApplyFile(const struct AssignmentFile& file, int64_t generation);
  absl::Status ApplyRoutingFromController(const v1::RoutingTable& t);
  v1::Register MakeRegister();
  v1::NodeStatus MakeStatus();
  // Replicas' counters over their control sockets (one cached client per socket), by socket.
  // The calls run at once, so a scrape or status report waits for the slowest replica (at
  // most one call's deadline), not for each wedged one in turn.
  enum StatsCaller { kStatusReport = 0, kMetricsScrape = 1 };
  std::map<std::string, absl::StatusOr<v1::RuntimeStats>> ReplicaStats(
      StatsCaller caller, const std::vector<std::string>& sockets);
  absl::Status Persist(const std::string& name, const google::protobuf::Message& m);
  void Reload();
  void UpdatePower();
  // Keeps the agent's own threads off the replicas' CPUs (AgentCpus), re-pinned when they
  // change.
  void PinAgent();

  const AgentOptions options_;
  Clock* clock_;
  const Topology topology_;
  std::unique_ptr<GpuDriver> gpus_;
  std::unique_ptr<ProcessLauncher> launcher_;
  std::unique_ptr<RuntimeClientFactory> clients_;  // the loop's: never waits long
  // The status and metrics threads' (stat_clients_): these wait for each answer (bounded by
  // the call's timeout), so that a slow replica's numbers are fresh, not left out.
  std::unique_ptr<RuntimeClientFactory> stat_client_factory_;
  std::unique_ptr<InferenceProber> prober_;
  std::unique_ptr<Supervisor> supervisor_;
  std::unique_ptr<GpuPowerManager> power_;
  std::unique_ptr<GpuMonitor> monitor_;  // loop thread only
  // On the monotonic clock (MonotonicNow): a wall clock stepped back must not stop the polls.
  absl::Duration last_gpu_poll_ = -absl::InfiniteDuration();
  mutable absl::Mutex health_mu_;
  std::map<int, GpuHealth> gpu_health_ ABSL_GUARDED_BY(health_mu_);
  std::unique_ptr<HttpServer> admin_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<class ControllerClient> controller_;
  std::atomic<int64_t> routing_generation_{0};
  // Tasks posted to the loop thread.
  LoopTasks tasks_{[this] { Wake(); }};
  // For load figures between two Status messages (the controller client's thread).
  absl::Mutex load_mu_;
  // Per replica socket: the last Stats and when they were taken, and when the replica was
  // last seen serving (its request count moved) or first seen.
  struct SeenStats {
    absl::Time at;
    v1::RuntimeStats stats;
    absl::Time active;
  };
  std::map<std::string, SeenStats> last_stats_ ABSL_GUARDED_BY(load_mu_);
  // Shared: a caller uses one outside the lock while a Status pass may prune it.
  // Kept by caller (ReplicaStats's `caller`: the status report, a metrics scrape) and socket: a
  // caller's answer is never taken by the other, who would then ask that replica again alone.
  std::map<std::pair<int, std::string>, std::shared_ptr<RuntimeClient>> stat_clients_
      ABSL_GUARDED_BY(load_mu_);
  v1::RoutingTable routing_;  // loop thread only (set before the loop starts)
  std::map<int, GpuLoad> gpu_load_;  // loop thread only
  std::map<int, PowerRetry> power_retry_;  // loop thread only: GPUs whose change failed
  std::vector<int> agent_cpus_;             // loop thread only: as last pinned
  mutable absl::Mutex cpus_mu_;
  std::string agent_cpus_text_ ABSL_GUARDED_BY(cpus_mu_);  // for /v1/replicas
  int64_t generation_ = 0;           // loop thread only
  std::atomic<bool> ready_{false};
  std::atomic<bool> converged_{false};
  std::atomic<bool> reload_{false};
  std::atomic<int64_t> last_tick_mono_ms_{0};  // the loop's last pass, monotonic clock
  std::atomic<uint64_t> rejected_reloads_{0};
  std::atomic<uint64_t> ticks_{0};

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Work was posted (a reload, a task): the loop runs now instead of at its next tick.
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  void Wake() ABSL_LOCKS_EXCLUDED(mu_);
  std::thread loop_;
};

}  // namespace kiln
