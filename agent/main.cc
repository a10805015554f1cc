// kiln-agent: one per node; owns the node's kiln-runtime processes.
#include <signal.h>

#include <filesystem>

#include "agent/agent.h"
#include "common/cli.h"
#include "common/logging.h"
#include "common/signal_pipe.h"

int main(int argc, char** argv) {
  kiln::AgentOptions o;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  o.node_name = host;
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  o.runtime_binary = ec ? "kiln-runtime" : (self.parent_path() / "kiln-runtime").string();
  int tick_ms = 100;
  int stop_timeout_ms = 30000;
  int64_t start_timeout_ms = 600000;

  CLI::App app{"kiln-agent: runs a node's model replicas"};
  app.add_option("--node-name", o.node_name, "This node's name")->capture_default_str();
  app.add_option("--assignment-file", o.assignment_file,
                 "Run this node alone from a YAML assignment (reloaded on SIGHUP)");
  app.add_option("--controller", o.controller,
                 "Take assignments from kiln-controller at HOST:PORT (kiln.v1.ControlPlane)");
  o.controller_tls.ca_flag = "--controller-ca";
  o.controller_tls.cert_flag = "--controller-cert";
  o.controller_tls.key_flag = "--controller-key";
  app.add_option("--controller-ca", o.controller_tls.ca,
                 "PEM CA bundle that signed the controller's certificate (turns TLS on)");
  app.add_option("--controller-cert", o.controller_tls.cert,
                 "PEM client certificate naming this node (SAN or CN = --node-name), for a "
                 "controller that requires one");
  app.add_option("--controller-key", o.controller_tls.key, "PEM private key of --controller-cert");
  app.add_option("--controller-server-name", o.controller_server_name,
                 "Name the controller's certificate must carry (default: --controller's host)");
  app.add_option("--state-dir", o.state_dir, "Replica state, sockets and logs")
      ->capture_default_str();
  app.add_option("--runtime-binary", o.runtime_binary, "kiln-runtime")->capture_default_str();
  app.add_option("--sysfs-root", o.sysfs_root, "sysfs root")->capture_default_str();
  app.add_option("--fake-gpus", o.fake_gpus, "COUNT:MEMORY fake GPUs (replicas run on cpu)");
  app.add_option("--gpu-power", o.gpu_power, "off, dry-run or enforce")->capture_default_str();
  app.add_option("--reserved-cpus", o.reserved_cpus, "CPUs kept for the agent")->capture_default_str();
  app.add_option("--admin-bind", o.admin_bind, "Address for /healthz /readyz /metrics")
      ->capture_default_str();
  app.add_option("--admin-port", o.admin_port, "Port for /healthz /readyz /metrics (0 = free)")
      ->capture_default_str();
  app.add_option("--ingress-bind", o.ingress_bind, "Address for the inference router")
      ->capture_default_str();
  app.add_option("--grpc-port", o.grpc_port, "Router gRPC port (0 = free)")->capture_default_str();
  app.add_option("--http-port", o.http_port, "Router REST port (0 = free)")->capture_default_str();
  app.add_option("--router-busy-poll-us", o.router_busy_poll_us,
                 "The router spins for a local replica's answer over a window this long around "
                 "when it is expected, instead of sleeping through it (0 = off; try 1000)")
      ->capture_default_str();
  app.add_option("--router-busy-poll-threads", o.router_busy_poll_threads,
                 "At most this many of the router's readers spin at once, each on a CPU (0 = off)")
      ->capture_default_str();
  app.add_option("--router-http-threads", o.router_http_threads,
                 "Threads of the router's REST server (1..64)")
      ->capture_default_str();
  app.add_option("--tick-ms", tick_ms, "Supervision period")->capture_default_str();
  app.add_option("--start-timeout-ms", start_timeout_ms,
                 "A replica not WARM (loaded, warmed up) this long after its start is killed and "
                 "restarted with backoff (0 = no limit)")
      ->capture_default_str();
  app.add_option("--stop-timeout-ms", stop_timeout_ms, "Drain deadline before a replica is killed")
      ->capture_default_str();
  int64_t probe_interval_ms = absl::ToInt64Milliseconds(o.inference_probe_interval);
  int64_t probe_timeout_ms = absl::ToInt64Milliseconds(o.inference_probe_timeout);
  app.add_option("--inference-probe-interval-ms", probe_interval_ms,
                 "A tiny real inference per SERVING replica this often; a failure takes it out "
                 "of routing (0 = off)")
      ->capture_default_str();
  app.add_option("--inference-probe-timeout-ms", probe_timeout_ms,
                 "How long one inference probe may take")
      ->capture_default_str();
  app.add_option("--inference-probe-failures", o.inference_probe_failures,
                 "Failed inference probes in a row that get a replica killed and restarted with "
                 "backoff (0 = never: it stays out of routing)")
      ->capture_default_str();
  app.add_flag("--stop-replicas-on-exit", o.stop_replicas_on_exit,
               "Drain and stop every replica when the agent exits (default: they keep running "
               "and the next agent adopts them)");
  app.add_option("--runtime-log-level", o.runtime_log_level, "Log level for replicas")
      ->capture_default_str();
  app.add_option("--runtime-malloc-huge-pages", o.runtime_malloc_huge_pages,
                 "Start replicas with glibc malloc's heap on transparent huge pages "
                 "(GLIBC_TUNABLES=glibc.malloc.hugetlb=1; a GLIBC_TUNABLES of the agent's "
                 "that sets it wins): about 10,000 fewer page faults in a runtime's start")
      ->capture_default_str();
  app.add_option("--runtime-idle-spin-us", o.runtime_idle_spin_us,
                 "Each replica's executions' thread waits busily this long for the next "
                 "request after each execution (its --idle-spin-us; 0 = off, at most 10000): "
                 "lower latency at low load, for CPU time")
      ->capture_default_str();
  app.add_option("--runtime-model-cpus", o.runtime_model_cpus,
                 "Each replica runs its model alone on the last N of its CPUs, everything else "
                 "(frontends, replies) on the rest (its --model-cpus; 0 = off; a replica with "
                 "N CPUs or fewer runs without it)")
      ->capture_default_str();
  app.add_option("--prestart-per-gpu", o.prestart_per_gpu,
                 "Pre-started runtimes (LibTorch loaded, device context made, no model) kept "
                 "per GPU: a starting replica is handed one instead of spawning cold (0..16)")
      ->capture_default_str();
  app.add_option("--prestart-cpu", o.prestart_cpu,
                 "Pre-started runtimes kept for CPU replicas (0..16)")
      ->capture_default_str();
  std::vector<std::string> labels;
  app.add_option("--label", labels,
                 "KEY=VALUE: a label of this node, sent to the controller (repeatable); "
                 "topology.kubernetes.io/zone=Z (or zone=Z) names the zone replicas are spread "
                 "across");
  if (auto code = kiln::ParseCommandLine(app, argc, argv)) return *code;
  auto log = kiln::GetLogger("agent.main");
  auto parsed_labels = kiln::ParseNodeLabels(labels);
  if (!parsed_labels.ok()) {
    log->error("{}", std::string(parsed_labels.status().message()));
    return 2;
  }
  o.labels = *parsed_labels;
  o.tick = absl::Milliseconds(tick_ms);
  o.stop_timeout = absl::Milliseconds(stop_timeout_ms);
  o.start_timeout = absl::Milliseconds(start_timeout_ms);
  o.inference_probe_interval = absl::Milliseconds(probe_interval_ms);
  o.inference_probe_timeout = absl::Milliseconds(probe_timeout_ms);

  // SIGCHLD: a replica's exit wakes the loop.
  if (!kiln::InstallSignalPipe({SIGTERM, SIGINT, SIGHUP, SIGCHLD})) {
    log->error("cannot install signal handlers");
    return 1;
  }

  kiln::RealClock clock;
  auto agent = kiln::Agent::Create(o, &clock);
  if (!agent.ok()) {
    log->error("{}", std::string(agent.status().message()));
    return 2;
  }
  if (auto s = (*agent)->Start(); !s.ok()) {
    log->error("{}", std::string(s.message()));
    return 1;
  }
  for (;;) {
    const int sig = kiln::NextSignal(1000);
    if (sig == 0) continue;
    if (sig == SIGHUP) {
      log->info("SIGHUP: reloading {}", o.assignment_file);
      (*agent)->RequestReload();
      continue;
    }
    if (sig == SIGCHLD) {
      (*agent)->ChildExited();
      continue;
    }
    log->info("signal {}: stopping{}", sig,
              o.stop_replicas_on_exit ? " and draining replicas" : " (replicas keep running)");
    break;
  }
  (*agent)->Stop();
  log->info("stopped");
  return 0;
}
