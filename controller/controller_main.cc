// kiln-controller: holds ModelDeployments (the embedded SQLite store under --state-dir, or the
// Kubernetes API with --store=kubernetes), serves the admin API, and runs the decisions and the
// agents' ControlPlane streams. With --leader-elect only the holder of the Lease runs the
// decisions and takes agent streams; the others serve the admin API and wait their turn.
#include <signal.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <thread>

#include <fstream>
#include <sstream>

#include "common/clock.h"
#include "common/cli.h"
#include "common/grpc_tls.h"
#include "common/logging.h"
#include "controller/admin_api.h"
#include "controller/admin_server.h"
#include "controller/controller.h"
#include <grpcpp/grpcpp.h>
#include "controller/kube_store.h"
#include "controller/leader_election.h"
#include "controller/sqlite_store.h"

int main(int argc, char** argv) {
  std::string state_dir;
  std::string bind = "127.0.0.1";
  int port = 7070;
  std::string token_file;
  std::string listen = "127.0.0.1:7071";
  double scale_down_warm_s = 300;
  double observe_s = 10, not_ready_s = 10, lost_s = 30, stabilization_s = 300, rebalance_s = 30,
         counters_s = 10;
  std::string store_kind = "sqlite";
  std::string kubeconfig, kube_namespace;
  bool leader_elect = false;
  kiln::LeaderElectionOptions le;
  if (const char* pod = std::getenv("POD_NAME"); pod && *pod) {
    le.identity = pod;
  } else {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    le.identity = host;
  }
  double lease_s = 15, renew_s = 10, retry_s = 2;
  CLI::App app{"kiln-controller: desired state and decisions for a fleet of kiln agents"};
  app.add_option("--store", store_kind, "Where ModelDeployments live: sqlite or kubernetes")
      ->check(CLI::IsMember({"sqlite", "kubernetes"}))
      ->capture_default_str();
  app.add_option("--state-dir", state_dir, "Directory of the embedded store (kiln.db); --store=sqlite");
  app.add_option("--kubeconfig", kubeconfig,
                 "kubeconfig file for --store=kubernetes (none: the pod's service account)");
  app.add_option("--namespace", kube_namespace,
                 "Namespace of the ModelDeployments and the Lease (default: the kubeconfig's or the pod's)");
  app.add_flag("--leader-elect", leader_elect,
               "Run the decisions only while holding the Lease (--store=kubernetes)");
  app.add_option("--lease-name", le.lease_name, "Name of the coordination.k8s.io Lease")
      ->capture_default_str();
  app.add_option("--identity", le.identity, "This candidate's name in the Lease (default: $POD_NAME or the host name)")
      ->capture_default_str();
  app.add_option("--lease-duration-seconds", lease_s, "Lease duration")->check(CLI::Range(0.1, 3600.0))->capture_default_str();
  app.add_option("--renew-deadline-seconds", renew_s, "A leader that could not renew for this long steps down")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  app.add_option("--retry-period-seconds", retry_s, "How often candidates try the Lease")
      ->check(CLI::Range(0.05, 3600.0))
      ->capture_default_str();
  app.add_option("--admin-bind", bind, "IPv4 address of the admin API")->capture_default_str();
  app.add_option("--admin-port", port, "Admin API port (0 = pick a free one)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option("--token-file", token_file,
                 "File holding the bearer token the admin API requires (none: no auth)");
  app.add_option("--listen", listen,
                 "HOST:PORT for the agents' ControlPlane streams (port 0 = pick a free one)")
      ->capture_default_str();
  kiln::TlsFiles tls;
  tls.cert_flag = "--tls-cert";
  tls.key_flag = "--tls-key";
  tls.ca_flag = "--tls-client-ca";
  app.add_option("--tls-cert", tls.cert,
                 "PEM certificate (chain) of the ControlPlane listener; with --tls-key: TLS");
  app.add_option("--tls-key", tls.key, "PEM private key of --tls-cert");
  app.add_option("--tls-client-ca", tls.ca,
                 "PEM CA bundle: agents must present a certificate it signed (mutual TLS), and "
                 "a node may only register under a name its certificate carries (SAN or CN)");
  bool node_identity = true;
  app.add_option("--tls-node-identity", node_identity,
                 "With --tls-client-ca: a node registers only under a name its certificate "
                 "carries; false where agents share one certificate (one Secret for a DaemonSet)")
      ->capture_default_str();
  app.add_option("--observe-seconds", observe_s,
                 "After a start, wait this long for agents to re-register before acting "
                 "(agents retry at most every 5 s; keep it above that)")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
  app.add_option("--node-not-ready-seconds", not_ready_s, "A silent node is NotReady after this")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  app.add_option("--node-lost-seconds", lost_s,
                 "A silent node is Lost (its replicas placed elsewhere) after this")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  double forget_s = 3600;
  app.add_option("--forget-lost-node-seconds", forget_s,
                 "A Lost node whose agent stays away this much longer is forgotten (gone from "
                 "the node list; its replica ids stay retired); 0 = never. kilnctl delete node "
                 "forgets one at once")
      ->check(CLI::Range(0.0, 31536000.0))
      ->capture_default_str();
  app.add_option("--status-counters-seconds", counters_s,
                 "Per-version request/error/p99 counters in status are written at most this often "
                 "when nothing else in it changed (each write is a store transaction)")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
  app.add_option("--rebalance-after-seconds", rebalance_s,
                 "A deployment piled on one node (2+ more replicas than another node of its zone "
                 "with room) this long gets one moved there, make-before-break")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  int overload_pct = 95;
  app.add_option("--overload-utilization-pct", overload_pct,
                 "A GPU this busy with requests queued, or throttling, is overloaded: for "
                 "--rebalance-after-seconds, and one replica at a time moves off it to a GPU "
                 "with room (0 = never)")
      ->check(CLI::Range(0, 100))
      ->capture_default_str();
  app.add_option("--scale-down-stabilization-seconds", stabilization_s,
                 "Autoscaled deployments scale down only after load stayed low this long")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  app.add_option("--scale-down-warm-seconds", scale_down_warm_s,
                 "Replicas a scale-down leaves over stay WARM this long (a scale-up within it "
                 "promotes them), then drain; WARM ones go first when a GPU needs room (0 = "
                 "drain at once)")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  if (auto code = kiln::ParseCommandLine(app, argc, argv)) return *code;
  auto log = kiln::GetLogger("controller.main");
  std::string token;
  if (!token_file.empty()) {
    std::ifstream in(token_file);
    if (!in) {
      log->error("--token-file: cannot read {}", token_file);
      return 2;
    }
    std::getline(in, token);
    while (!token.empty() && (token.back() == '\r' || token.back() == ' ')) token.pop_back();
    if (token.empty()) {
      log->error("--token-file: {} holds no token on its first line", token_file);
      return 2;
    }
  }
  std::shared_ptr<grpc::ServerCredentials> control_credentials =
      grpc::InsecureServerCredentials();
  if (tls.any()) {
    auto creds = kiln::MakeServerCredentials(tls);
    if (!creds.ok()) {
      log->error("{}", std::string(creds.status().message()));
      return 2;
    }
    control_credentials = *creds;
  }
  // Signals are taken synchronously: blocked here (inherited by every thread), awaited below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  kiln::RealClock clock;
  le.lease_duration = absl::Seconds(lease_s);
  le.renew_deadline = absl::Seconds(renew_s);
  le.retry_period = absl::Seconds(retry_s);
  if (leader_elect) {
    if (store_kind != "kubernetes") {
      log->error("--leader-elect: needs --store=kubernetes (the Lease lives in the Kubernetes API)");
      return 2;
    }
    if (auto s = kiln::LeaderElector::Validate(le); !s.ok()) {
      log->error("{} (--lease-duration-seconds > --renew-deadline-seconds > --retry-period-seconds)",
                 std::string(s.message()));
      return 2;
    }
  }
  std::unique_ptr<kiln::Store> store_holder;
  kiln::KubernetesStore* kube_store = nullptr;
  std::string store_name;
  if (store_kind == "sqlite") {
    if (state_dir.empty()) {
      log->error("--state-dir: required with --store=sqlite");
      return 2;
    }
    kiln::SqliteStore::Options so;
    so.state_dir = state_dir;
    auto opened = kiln::SqliteStore::Open(so, &clock);
    if (!opened.ok()) {
      log->error("{}", std::string(opened.status().message()));
      return 1;
    }
    store_name = (*opened)->path();
    store_holder = std::move(*opened);
  } else {
    auto kc = kubeconfig.empty() ? kiln::KubeConfig::InCluster() : kiln::KubeConfig::FromKubeconfig(kubeconfig);
    if (!kc.ok()) {
      log->error("{}", std::string(kc.status().message()));
      return 2;
    }
    if (!kube_namespace.empty()) kc->ns = kube_namespace;
    store_name = kc->server + " namespace " + kc->ns;
    auto opened = kiln::KubernetesStore::Open(*kc, {});
    if (!opened.ok()) {
      log->error("{}", std::string(opened.status().message()));
      return 1;
    }
    kube_store = opened->get();
    store_holder = std::move(*opened);
  }
  kiln::Store* store = store_holder.get();
  if (lost_s < not_ready_s) {
    log->error("--node-lost-seconds: must be >= --node-not-ready-seconds ({})", not_ready_s);
    return 2;
  }
  kiln::ControllerOptions co;
  co.observe_for = absl::Seconds(observe_s);
  co.leases.not_ready_after = absl::Seconds(not_ready_s);
  co.leases.lost_after = absl::Seconds(lost_s);
  co.forget_lost_after = absl::Seconds(forget_s);
  co.scale_down_stabilization = absl::Seconds(stabilization_s);
  co.scale_down_warm_for = absl::Seconds(scale_down_warm_s);
  co.rebalance_after = absl::Seconds(rebalance_s);
  co.overload_utilization_pct = overload_pct;
  co.status_counters_every = absl::Seconds(counters_s);
  co.require_node_identity = !tls.ca.empty() && node_identity;
  kiln::Controller controller(co, store, &clock);
  // In a Pod (POD_NAME set) under leader election, the leader labels its own Pod so that the
  // agents' Service (kiln-controller-leader) reaches it alone; a candidate clears the label at
  // start (a restarted container keeps its Pod's labels) and when it stops.
  const char* pod_env = std::getenv("POD_NAME");
  const char* pod_ns_env = std::getenv("POD_NAMESPACE");
  const std::string pod_name = pod_env ? pod_env : "";
  const std::string pod_ns = pod_ns_env && *pod_ns_env ? pod_ns_env : kube_namespace;
  auto label_pod = [&](bool leader) {
    if (!leader_elect || pod_name.empty() || !kube_store) return;
    const std::string ns = pod_ns.empty() ? kube_store->client()->config().ns : pod_ns;
    absl::Status st = kiln::LabelPodAsLeader(kube_store->client(), ns, pod_name, leader);
    if (st.ok()) {
      log->info("pod {}/{}: {} {}", ns, pod_name, leader ? "labelled" : "unlabelled",
                kiln::kLeaderPodLabel);
    } else {
      log->warn("pod {}/{}: cannot {} {} ({}); agents reach the leader by retrying", ns,
                pod_name, leader ? "set" : "clear", kiln::kLeaderPodLabel,
                std::string(st.message()));
    }
  };
  // The decisions and the agents' streams: at once, or once this candidate leads.
  std::unique_ptr<grpc::Server> control;
  auto lead = [&]() -> bool {
    int control_port = 0;
    grpc::ServerBuilder builder;
    // A port another process holds is an error, not shared (gRPC would share it with
    // SO_REUSEPORT: a second controller on the port would split the agents between them).
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.AddListeningPort(listen, control_credentials, &control_port);
    builder.RegisterService(&controller);
    control = builder.BuildAndStart();
    if (!control || control_port == 0) {
      log->error("--listen: cannot listen on {}", listen);
      return false;
    }
    controller.Start();
    label_pod(true);
    log->info("control={}:{} tls={} leading={}", listen.substr(0, listen.rfind(':')), control_port,
              tls.ca.empty() ? (tls.any() ? "server" : "off")
                             : (co.require_node_identity ? "mutual" : "mutual-shared"),
              leader_elect ? le.identity : "(no election)");
    return true;
  };
  std::atomic<bool> stop_electing{false};
  std::atomic<int> exit_code{0};
  std::thread elector_thread;
  std::unique_ptr<kiln::LeaderElector> elector;
  if (!leader_elect) {
    if (!lead()) return 1;
  } else {
    label_pod(false);
    elector = std::make_unique<kiln::LeaderElector>(kube_store->client(), le, &clock);
    elector_thread = std::thread([&] {
      bool leading = false;
      while (!stop_electing) {
        bool now_leading = elector->Tick();
        if (now_leading && !leading) {
          if (!lead()) {
            exit_code = 1;
            kill(getpid(), SIGTERM);
            return;
          }
        } else if (!now_leading && leading) {
          // Stepped down: stop acting at once and let the supervisor start a fresh follower.
          log->error("lost the lease {}: exiting so that only the leader acts", le.lease_name);
          exit_code = 1;
          kill(getpid(), SIGTERM);
          return;
        }
        leading = now_leading;
        // The next round a retry period on, or at the renew deadline if that comes first: a
        // leader that could not renew steps down on time, not a sleep later.
        absl::Time until = std::min(absl::Now() + le.retry_period, elector->StepDownAt());
        while (!stop_electing && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
      }
    });
  }
  kiln::AdminApi api(store, token);
  api.SetNodesSource([&controller]() { return controller.NodesJson(); });
  api.SetMetricsSource([&controller]() { return controller.MetricsText(); });
  api.SetNodeRemover([&controller](const std::string& name) { return controller.ForgetNode(name); });
  // Answered once the action is written down in the deployment's status: a controller killed
  // after the answer has not lost it. At most two callers wait at a time (the admin server has
  // four threads, and its health probes must get through): others are answered "requested"
  // (202) at once.
  kiln::RolloutActionAnswers action_answers(/*max_waiting=*/2, absl::Seconds(10));
  api.SetRolloutActions([&](const std::string& name, const std::string& action) {
    return action_answers.Answer(
        [&] { return controller.RequestRolloutAction(name, action); },
        [&](uint64_t ticket, absl::Duration wait) {
          return controller.AwaitRolloutAction(ticket, wait);
        });
  });
  auto server = kiln::StartAdminHttpServer(bind, port, &api);
  if (!server.ok()) {
    log->error("{}", std::string(server.status().message()));
    return 1;
  }
  auto rv = store->CurrentResourceVersion();
  log->info("listening admin=http://{}:{} store={} resource_version={} auth={} leader_election={}",
            bind, (*server)->port(), store_name, rv.ok() ? *rv : 0, token.empty() ? "none" : "bearer",
            leader_elect ? le.lease_name + " as " + le.identity : "off");
  sd_notify(0, "READY=1");
  // systemd's watchdog: pinged from a thread that stops when the process stops making progress
  // on its main duties (it checks the store's cache answers).
  uint64_t watchdog_usec = 0;
  std::thread watchdog;
  std::atomic<bool> stop_watchdog{false};
  if (sd_watchdog_enabled(0, &watchdog_usec) > 0) {
    watchdog = std::thread([&] {
      while (!stop_watchdog) {
        if (store->CurrentResourceVersion().ok()) sd_notify(0, "WATCHDOG=1");
        absl::Time until = absl::Now() + absl::Microseconds(watchdog_usec / 2);
        while (!stop_watchdog && absl::Now() < until) absl::SleepFor(absl::Milliseconds(50));
      }
    });
  }
  int sig = 0;
  sigwait(&signals, &sig);
  log->info("signal {}: stopping", sig);
  sd_notify(0, "STOPPING=1");
  stop_electing = true;
  if (elector_thread.joinable()) elector_thread.join();
  controller.Stop();
  if (control) control->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (elector) {
    label_pod(false);
    elector->Release();  // the next leader need not wait out the lease
  }
  stop_watchdog = true;
  if (watchdog.joinable()) watchdog.join();
  server->reset();
  store_holder.reset();
  log->info("stopped");
  return exit_code.load();
}
