// kiln-controller: holds ModelDeployments (embedded SQLite store under --state-dir) and serves
// the admin API. Placement, scaling, rollouts and the agents' ControlPlane stream come next.
#include <signal.h>

#include <CLI/CLI.hpp>
#include <fstream>
#include <sstream>

#include "common/clock.h"
#include "common/logging.h"
#include "controller/admin_api.h"
#include "controller/admin_server.h"
#include "controller/controller.h"
#include <grpcpp/grpcpp.h>
#include "controller/sqlite_store.h"

int main(int argc, char** argv) {
  std::string state_dir;
  std::string bind = "127.0.0.1";
  int port = 7070;
  std::string token_file;
  std::string log_level = "info";
  std::string listen = "127.0.0.1:7071";
  double observe_s = 5, not_ready_s = 10, lost_s = 30, stabilization_s = 300;
  CLI::App app{"kiln-controller: desired state and decisions for a fleet of kiln agents"};
  app.add_option("--state-dir", state_dir, "Directory of the embedded store (kiln.db)")->required();
  app.add_option("--admin-bind", bind, "IPv4 address of the admin API")->capture_default_str();
  app.add_option("--admin-port", port, "Admin API port (0 = pick a free one)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option("--token-file", token_file,
                 "File holding the bearer token the admin API requires (none: no auth)");
  app.add_option("--listen", listen,
                 "HOST:PORT for the agents' ControlPlane streams (port 0 = pick a free one)")
      ->capture_default_str();
  app.add_option("--observe-seconds", observe_s,
                 "After a start, wait this long for agents to re-register before acting")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
  app.add_option("--node-not-ready-seconds", not_ready_s, "A silent node is NotReady after this")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  app.add_option("--node-lost-seconds", lost_s,
                 "A silent node is Lost (its replicas placed elsewhere) after this")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  app.add_option("--scale-down-stabilization-seconds", stabilization_s,
                 "Autoscaled deployments scale down only after load stayed low this long")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error")->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  auto log = kiln::GetLogger("controller.main");
  if (auto s = kiln::SetLogLevel(log_level); !s.ok()) {
    log->error("--log-level: {}", std::string(s.message()));
    return 2;
  }
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
  // Signals are taken synchronously: blocked here (inherited by every thread), awaited below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  kiln::RealClock clock;
  kiln::SqliteStore::Options so;
  so.state_dir = state_dir;
  auto store = kiln::SqliteStore::Open(so, &clock);
  if (!store.ok()) {
    log->error("{}", std::string(store.status().message()));
    return 1;
  }
  if (lost_s < not_ready_s) {
    log->error("--node-lost-seconds: must be >= --node-not-ready-seconds ({})", not_ready_s);
    return 2;
  }
  kiln::ControllerOptions co;
  co.observe_for = absl::Seconds(observe_s);
  co.leases.not_ready_after = absl::Seconds(not_ready_s);
  co.leases.lost_after = absl::Seconds(lost_s);
  co.scale_down_stabilization = absl::Seconds(stabilization_s);
  kiln::Controller controller(co, store->get(), &clock);
  int control_port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &control_port);
  builder.RegisterService(&controller);
  std::unique_ptr<grpc::Server> control = builder.BuildAndStart();
  if (!control || control_port == 0) {
    log->error("--listen: cannot listen on {}", listen);
    return 1;
  }
  controller.Start();
  kiln::AdminApi api(store->get(), token);
  api.SetNodesSource([&controller]() { return controller.NodesJson(); });
  api.SetRolloutActions([&controller](const std::string& name, const std::string& action) {
    return controller.RequestRolloutAction(name, action);
  });
  auto server = kiln::AdminHttpServer::Start(bind, port, &api);
  if (!server.ok()) {
    log->error("{}", std::string(server.status().message()));
    return 1;
  }
  auto rv = (*store)->CurrentResourceVersion();
  std::string host = listen.substr(0, listen.rfind(':'));
  log->info("listening admin=http://{}:{} control={}:{} store={} resource_version={} auth={}",
            bind, (*server)->port(), host, control_port, (*store)->path(), rv.ok() ? *rv : 0,
            token.empty() ? "none" : "bearer");
  int sig = 0;
  sigwait(&signals, &sig);
  log->info("signal {}: stopping", sig);
  controller.Stop();
  control->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  server->reset();
  store->reset();
  log->info("stopped");
  return 0;
}
