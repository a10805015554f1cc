// kiln-runtime: serves one model version as one replica.
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/config_node.h"
#include "common/cli.h"
#include "common/cpu_list.h"
#include "common/logging.h"
#include "common/pinning.h"
#include "common/process_start.h"
#include "common/signal_pipe.h"
#include "runtime/aoti_backend.h"
#include "runtime/control_service.h"
#include "runtime/runtime_server.h"
#include "runtime/torchscript_backend.h"

namespace {

// The flags of a cold start, also what a pre-started runtime's Load carries.
struct Flags {
  kiln::RuntimeOptions o;
  std::string max_request = "64Mi";
  int64_t drain_ms = 30000;
  // Where the process pins itself before it loads: what a pre-started runtime handed a
  // replica needs (a cold start is pinned by whoever starts it).
  std::string cpu_set;
  std::vector<int> cpus;
  int memory_node = -1;
};

void AddRuntimeFlags(CLI::App& app, Flags* f, bool model_required) {
  kiln::RuntimeOptions& o = f->o;
  auto* repo = app.add_option("--model-repository", o.model_repository,
                              "Model repository (DIR/NAME/config.yaml, DIR/NAME/V/model.pt or "
                              "model.pt2)");
  auto* model = app.add_option("--model", o.model, "Model name");
  if (model_required) {
    repo->required();
    model->required();
  }
  app.add_option("--version", o.version, "Model version (default: the highest numeric one)");
  app.add_option("--grpc-port", o.grpc_port, "gRPC port (0 = pick a free one)")
      ->capture_default_str();
  app.add_option("--http-port", o.http_port, "REST port (0 = pick a free one)")
      ->capture_default_str();
  app.add_option("--bind-address", o.bind_address, "IPv4 address for both frontends")
      ->capture_default_str();
  app.add_option("--control-socket", o.control_socket,
                 "Unix socket for kiln.v1.RuntimeControl (mode 0600)");
  app.add_option("--data-socket", o.data_socket,
                 "Unix socket serving ModelInfer to the node's router (mode 0600)");
  app.add_option("--initial-state", o.initial_state, "warm or serving")->capture_default_str();
  app.add_option("--device", o.device, "cpu or cuda:N (default: the config's instance.device)");
  app.add_option("--replica-id", o.replica_id,
                 "The replica this process runs, as its agent names it (logs, GetState)");
  app.add_option("--threads", o.threads, "Intra-op threads (0 = the config's or LibTorch's)");
  app.add_option("--http-threads", o.http_threads,
                 "REST frontend threads (reading, JSON decoding and encoding); more only for "
                 "JSON-heavy traffic on a replica with CPUs to spare")
      ->capture_default_str();
  app.add_option("--max-request-bytes", f->max_request,
                 "Largest request payload (bytes, or 64Mi)")
      ->capture_default_str();
  app.add_option("--idle-spin-us", o.idle_spin_us,
                 "After each execution (and each request read or answer written), the serving "
                 "threads wait busily this long for the next request before sleeping (0 = off, "
                 "at most 10000): lower latency at low load, for CPU time")
      ->capture_default_str();
  app.add_option("--model-cpus", o.model_cpus,
                 "Run the model alone on the last N of this process's CPUs (its executions' "
                 "thread and LibTorch's intra-op threads); every other thread, and encoding and "
                 "sending replies, on the rest (0 = off; needs at least N+1 CPUs)")
      ->capture_default_str();
  app.add_option("--drain-timeout-ms", f->drain_ms, "Default drain deadline")
      ->capture_default_str();
  app.add_option("--cpu-set", f->cpu_set,
                 "Pin every thread to these CPUs (\"2-5,8\") before loading");
  app.add_option("--memory-node", f->memory_node,
                 "Bind memory allocated from loading on to this NUMA node (-1 = no binding)")
      ->capture_default_str();
  // Default on for a power-parked replica (the agent sets CUDA_DISABLE_PERF_BOOST=1).
  const char* parked = getenv("CUDA_DISABLE_PERF_BOOST");
  o.warmup_on_promote = parked != nullptr && std::string(parked) == "1";
  app.add_flag("--warmup-on-promote,!--no-warmup-on-promote", o.warmup_on_promote,
               "Run one warm-up inference before a promoted replica is routed");
}

// The values flags carry as text, converted; errors name the flag.
absl::Status FinishFlags(Flags* f) {
  auto max_bytes = kiln::ParseByteSize(f->max_request, "--max-request-bytes");
  if (!max_bytes.ok()) return max_bytes.status();
  f->o.max_request_bytes = *max_bytes;
  f->o.drain_timeout = absl::Milliseconds(f->drain_ms);
  if (!f->cpu_set.empty()) {
    auto cpus = kiln::ParseCpuList(f->cpu_set, "--cpu-set");
    if (!cpus.ok()) return cpus.status();
    if (cpus->empty() || cpus->back() >= CPU_SETSIZE) {
      return absl::InvalidArgumentError("--cpu-set: '" + f->cpu_set + "' must list CPUs 0.." +
                                        std::to_string(CPU_SETSIZE - 1));
    }
    f->cpus = *cpus;
  }
  if (f->memory_node < -1 || f->memory_node >= 1024) {
    return absl::InvalidArgumentError("--memory-node: must be -1..1023, got " +
                                      std::to_string(f->memory_node));
  }
  return absl::OkStatus();
}

// A Load request's arguments as a cold start's command line; errors name the flag.
absl::StatusOr<Flags> ParseLoadArgs(const std::vector<std::string>& args) {
  Flags f;
  CLI::App app{"kiln-runtime Load"};
  AddRuntimeFlags(app, &f, /*model_required=*/true);
  std::string log_level;  // accepted for a cold start's command line; the process keeps its own
  app.add_option("--log-level", log_level);
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes them last first
  try {
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(std::string("args: ") + e.what());
  }
  if (auto s = FinishFlags(&f); !s.ok()) return s;
  if (auto s = kiln::ValidateRuntimeOptions(f.o); !s.ok()) return s;
  if (f.o.control_socket.empty()) {
    return absl::InvalidArgumentError("--control-socket: a pre-started runtime needs one to be "
                                      "driven after it loads");
  }
  return f;
}

// A pre-started runtime: answers RuntimeControl with no model (LOADING, empty model name) until
// a Load with good arguments arrives. A Load is checked as far as a cold start checks before
// it binds or loads anything (flags, the model's repository, version and config.yaml, the
// device) and answered only then; a Shutdown (or SIGTERM) wins over a Load.
class Prestarted : public kiln::ControlTarget {
 public:
  Prestarted(std::string device, const kiln::BackendRegistry* backends, kiln::Clock* clock)
      : device_(std::move(device)), backends_(backends), clock_(clock) {}

  kiln::v1::RuntimeState GetState() override {
    kiln::v1::RuntimeState s;
    s.set_state(kiln::v1::LOADING);
    s.set_pid(getpid());
    absl::MutexLock lock(&mu_);
    if (loaded_) s.set_model_name(model_);
    return s;
  }
  absl::Status Promote() override { return NoModel(); }
  bool PromoteWaits() const override { return false; }
  absl::Status Demote() override { return NoModel(); }
  absl::StatusOr<bool> Drain(absl::Duration) override { return true; }
  kiln::v1::RuntimeStats Stats() override { return {}; }
  bool Shutdown(absl::Duration) override {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    return true;
  }
  int64_t InFlight() override { return 0; }
  absl::Status Load(const std::vector<std::string>& args) override {
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_) return absl::FailedPreconditionError("shutting down");
      if (loaded_) return absl::FailedPreconditionError("a Load was already accepted");
    }
    auto f = ParseLoadArgs(args);
    if (!f.ok()) return f.status();
    // The device made ready at pre-start is the one to use; another would leave that one's
    // context idle for the process's life.
    if (!device_.empty()) {
      if (f->o.device.empty()) f->o.device = device_;
      if (f->o.device != device_) {
        return absl::InvalidArgumentError("--device: this runtime was pre-started for " + device_ +
                                          ", not " + f->o.device);
      }
    }
    auto server = kiln::RuntimeServer::Create(f->o, backends_, clock_, absl::Now());
    if (!server.ok()) return server.status();
    absl::MutexLock lock(&mu_);
    if (shutdown_) return absl::FailedPreconditionError("shutting down");
    if (loaded_) return absl::FailedPreconditionError("a Load was already accepted");
    model_ = f->o.model;
    loaded_ = std::move(*server);
    cpus_ = f->cpus;
    memory_node_ = f->memory_node;
    return absl::OkStatus();
  }
  // Waits up to `timeout` for a Load or a Shutdown; true once either came.
  bool Wait(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return loaded_ != nullptr || shutdown_;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  }
  // The runtime a Load made, unless a Shutdown came (then nothing), and where the Load said
  // to pin the process.
  std::unique_ptr<kiln::RuntimeServer> Take(std::vector<int>* cpus, int* memory_node) {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return nullptr;
    *cpus = cpus_;
    *memory_node = memory_node_;
    return std::move(loaded_);
  }
  void RequestShutdown() { Shutdown(absl::ZeroDuration()); }

 private:
  static absl::Status NoModel() {
    return absl::FailedPreconditionError("no model loaded yet (pre-started: send Load)");
  }
  const std::string device_;
  const kiln::BackendRegistry* backends_;
  kiln::Clock* clock_;
  absl::Mutex mu_;
  std::unique_ptr<kiln::RuntimeServer> loaded_ ABSL_GUARDED_BY(mu_);
  std::string model_ ABSL_GUARDED_BY(mu_);
  std::vector<int> cpus_ ABSL_GUARDED_BY(mu_);
  int memory_node_ ABSL_GUARDED_BY(mu_) = -1;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

// Waits up to `timeout_ms` for a signal; true when SIGTERM/SIGINT arrived.
bool Signalled(int timeout_ms) {
  const int sig = kiln::NextSignal(timeout_ms);
  if (sig == 0) return false;
  kiln::GetLogger("runtime.main")->info("signal {}: draining", sig);
  return true;
}

}  // namespace


int main(int argc, char** argv) {
  // Includes the time the loader spent on LibTorch before main().
  const absl::Time process_start = kiln::ProcessStartTime(absl::Now());
  bool prestart = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    prestart |= a == "--prestart" || (a.rfind("--prestart=", 0) == 0 && a != "--prestart=false");
  }

  Flags f;
  CLI::App app{"kiln-runtime: serves one model version over the Open Inference Protocol v2"};
  AddRuntimeFlags(app, &f, /*model_required=*/!prestart);
  app.add_flag("--prestart", prestart,
               "Start with LibTorch loaded and the device ready but no model; RuntimeControl "
               "Load on --control-socket hands it one (model flags then come with the Load)");
  if (auto code = kiln::ParseCommandLine(app, argc, argv)) return *code;
  auto log = kiln::GetLogger("runtime.main");
  if (auto s = FinishFlags(&f); !s.ok()) {
    log->error("{}", std::string(s.message()));
    return 2;
  }
  if (!kiln::InstallSignalPipe({SIGTERM, SIGINT})) {
    log->error("cannot install signal handlers");
    return 1;
  }

  kiln::BackendRegistry backends;
  kiln::RegisterTorchScriptBackend(&backends);
  kiln::RegisterAotiBackend(&backends);
  kiln::RealClock clock;

  std::unique_ptr<kiln::RuntimeServer> server;
  if (prestart) {
    if (f.o.control_socket.empty()) {
      log->error("--prestart: needs --control-socket (Load arrives there)");
      return 2;
    }
    // The model and how it is served come with the Load; said here, they would be ignored.
    for (const char* flag : {"--model-repository", "--model", "--version", "--grpc-port",
                             "--http-port", "--initial-state", "--threads", "--http-threads",
                             "--cpu-set", "--memory-node", "--replica-id", "--idle-spin-us",
                             "--model-cpus"}) {
      if (app.count(flag) > 0) {
        log->error("{}: not with --prestart (it comes with the Load)", flag);
        return 2;
      }
    }
    if (auto s = kiln::PrepareTorchDevice(f.o.device); !s.ok()) {
      log->error("{}", std::string(s.message()));
      return 1;
    }
    Prestarted waiting(f.o.device, &backends, &clock);
    kiln::ControlService service(&waiting, f.o.drain_timeout);
    auto control = kiln::StartControlServer(f.o.control_socket, &service);
    if (!control.ok()) {
      log->error("{}", std::string(control.status().message()));
      return 2;
    }
    log->info("pre-started in {:.0f} ms: device {} ready, waiting for Load on {}",
              absl::ToDoubleMilliseconds(absl::Now() - process_start),
              f.o.device.empty() ? "cpu" : f.o.device, f.o.control_socket);
    while (!waiting.Wait(absl::Milliseconds(100))) {
      if (Signalled(0)) waiting.RequestShutdown();
    }
    // A Load's answer is written before the socket closes, and a Load still being handled
    // finishes first: what it left decides.
    (*control)->Stop(absl::Milliseconds(500));
    service.JoinWorkers();
    std::error_code ec;
    std::filesystem::remove(f.o.control_socket, ec);
    if (Signalled(0)) waiting.RequestShutdown();
    server = waiting.Take(&f.cpus, &f.memory_node);
    if (!server) {
      log->info("stopped before any Load");
      return 0;
    }
    log->info("Load accepted after {:.0f} ms", absl::ToDoubleMilliseconds(absl::Now() - process_start));
  } else {
    auto created = kiln::RuntimeServer::Create(f.o, &backends, &clock, process_start);
    if (!created.ok()) {
      log->error("{}", std::string(created.status().message()));
      return 2;
    }
    server = std::move(*created);
  }
  // The main thread loads the model and starts the serving threads: pinned here, they all are.
  if (auto s = kiln::PinThisProcess(f.cpus, f.memory_node); !s.ok()) {
    log->error("pinning to cpus {} / memory node {}: {}", kiln::FormatCpuList(f.cpus),
               f.memory_node, std::string(s.message()));
    return 1;
  }
  if (!f.cpus.empty() || f.memory_node >= 0) {
    log->info("pinned to cpus {}, memory node {}", f.cpus.empty() ? "(unchanged)" : kiln::FormatCpuList(f.cpus),
              f.memory_node);
  }
  if (auto s = server->Start(); !s.ok()) {
    log->error("startup failed: {}", std::string(s.message()));
    server->Stop();
    return 1;
  }
  for (;;) {
    if (server->WaitForShutdownRequest(absl::ZeroDuration())) {
      log->info("shutdown requested over the control socket");
      break;
    }
    if (Signalled(100)) break;
  }
  server->Stop();
  log->info("stopped");
  return 0;
}
