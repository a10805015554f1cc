// kiln-runtime: serves one model version as one replica.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>


#include "common/clock.h"
#include "common/config_node.h"
#include "common/cli.h"
#include "common/logging.h"
#include "common/process_start.h"
#include "runtime/aoti_backend.h"
#include "runtime/runtime_server.h"
#include "runtime/torchscript_backend.h"

namespace {

// SIGTERM/SIGINT may land on any thread (LibTorch and gRPC start threads of their own), so
// the handler only writes the signal number to a pipe that the main loop polls.
int signal_pipe[2] = {-1, -1};

void OnSignal(int sig) {
  char c = static_cast<char>(sig);
  [[maybe_unused]] ssize_t n = write(signal_pipe[1], &c, 1);
}

bool InstallSignalHandlers() {
  if (pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return false;
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (sigaction(SIGTERM, &sa, nullptr) != 0 || sigaction(SIGINT, &sa, nullptr) != 0) {
    return false;
  }
  signal(SIGPIPE, SIG_IGN);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  // Includes the time the loader spent on LibTorch before main().
  const absl::Time process_start = kiln::ProcessStartTime(absl::Now());
  kiln::RuntimeOptions o;
  std::string max_request = "64Mi";
  int64_t drain_ms = 30000;

  CLI::App app{"kiln-runtime: serves one model version over the Open Inference Protocol v2"};
  app.add_option("--model-repository", o.model_repository,
                 "Model repository (DIR/NAME/config.yaml, DIR/NAME/V/model.pt or model.pt2)")
      ->required();
  app.add_option("--model", o.model, "Model name")->required();
  app.add_option("--version", o.version, "Model version (default: the highest numeric one)");
  app.add_option("--grpc-port", o.grpc_port, "gRPC port (0 = pick a free one)")
      ->capture_default_str();
  app.add_option("--http-port", o.http_port, "REST port (0 = pick a free one)")
      ->capture_default_str();
  app.add_option("--bind-address", o.bind_address, "IPv4 address for both frontends")
      ->capture_default_str();
  app.add_option("--control-socket", o.control_socket,
                 "Unix socket for kiln.v1.RuntimeControl (mode 0600)");
  app.add_option("--initial-state", o.initial_state, "warm or serving")->capture_default_str();
  app.add_option("--device", o.device, "cpu or cuda:N (default: the config's instance.device)");
  app.add_option("--threads", o.threads, "Intra-op threads (0 = the config's or LibTorch's)");
  app.add_option("--max-request-bytes", max_request, "Largest request payload (bytes, or 64Mi)")
      ->capture_default_str();
  app.add_option("--drain-timeout-ms", drain_ms, "Default drain deadline")->capture_default_str();
  // Default on for a power-parked replica (the agent sets CUDA_DISABLE_PERF_BOOST=1).
  const char* parked = getenv("CUDA_DISABLE_PERF_BOOST");
  o.warmup_on_promote = parked != nullptr && std::string(parked) == "1";
  app.add_flag("--warmup-on-promote,!--no-warmup-on-promote", o.warmup_on_promote,
               "Run one warm-up inference before a promoted replica is routed");
  if (auto code = kiln::ParseCommandLine(app, argc, argv)) return *code;
  auto log = kiln::GetLogger("runtime.main");
  auto max_bytes = kiln::ParseByteSize(max_request, "--max-request-bytes");
  if (!max_bytes.ok()) {
    log->error("{}", std::string(max_bytes.status().message()));
    return 2;
  }
  o.max_request_bytes = *max_bytes;
  o.drain_timeout = absl::Milliseconds(drain_ms);
  if (!InstallSignalHandlers()) {
    log->error("cannot install signal handlers");
    return 1;
  }

  kiln::BackendRegistry backends;
  kiln::RegisterTorchScriptBackend(&backends);
  kiln::RegisterAotiBackend(&backends);
  kiln::RealClock clock;

  auto server = kiln::RuntimeServer::Create(o, &backends, &clock, process_start);
  if (!server.ok()) {
    log->error("{}", std::string(server.status().message()));
    return 2;
  }
  if (auto s = (*server)->Start(); !s.ok()) {
    log->error("startup failed: {}", std::string(s.message()));
    (*server)->Stop();
    return 1;
  }
  for (;;) {
    if ((*server)->WaitForShutdownRequest(absl::ZeroDuration())) {
      log->info("shutdown requested over the control socket");
      break;
    }
    pollfd pfd{signal_pipe[0], POLLIN, 0};
    if (poll(&pfd, 1, 100) > 0) {
      char sig = 0;
      if (read(signal_pipe[0], &sig, 1) == 1) {
        log->info("signal {}: draining", static_cast<int>(sig));
        break;
      }
    }
  }
  (*server)->Stop();
  log->info("stopped");
  return 0;
}
