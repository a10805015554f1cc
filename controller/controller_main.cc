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
#include "controller/sqlite_store.h"

int main(int argc, char** argv) {
  std::string state_dir;
  std::string bind = "127.0.0.1";
  int port = 7070;
  std::string token_file;
  std::string log_level = "info";
  CLI::App app{"kiln-controller: desired state and decisions for a fleet of kiln agents"};
  app.add_option("--state-dir", state_dir, "Directory of the embedded store (kiln.db)")->required();
  app.add_option("--admin-bind", bind, "IPv4 address of the admin API")->capture_default_str();
  app.add_option("--admin-port", port, "Admin API port (0 = pick a free one)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option("--token-file", token_file,
                 "File holding the bearer token the admin API requires (none: no auth)");
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
  kiln::AdminApi api(store->get(), token);
  auto server = kiln::AdminHttpServer::Start(bind, port, &api);
  if (!server.ok()) {
    log->error("{}", std::string(server.status().message()));
    return 1;
  }
  auto rv = (*store)->CurrentResourceVersion();
  log->info("listening admin=http://{}:{} store={} resource_version={} auth={}", bind,
            (*server)->port(), (*store)->path(), rv.ok() ? *rv : 0,
            token.empty() ? "none" : "bearer");
  int sig = 0;
  sigwait(&signals, &sig);
  log->info("signal {}: stopping", sig);
  server->reset();
  store->reset();
  log->info("stopped");
  return 0;
}
