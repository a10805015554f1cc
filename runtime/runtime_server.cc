#include "runtime/runtime_server.h"

#include <unistd.h>

#include <filesystem>

#include <grpcpp/server_builder.h>

#include "common/cpu_list.h"
#include "common/logging.h"
#include "common/pinning.h"
#include "common/status.h"

namespace kiln {

namespace {

v1::LifecycleState ToProto(RuntimeState s) {
  switch (s) {
    case RuntimeState::kLoading:
      return v1::LOADING;
    case RuntimeState::kWarm:
      return v1::WARM;
    case RuntimeState::kServing:
      return v1::SERVING;
    case RuntimeState::kDraining:
      return v1::DRAINING;
    case RuntimeState::kStopped:
      return v1::STOPPED;
    case RuntimeState::kFailed:
      return v1::FAILED;
  }
  return v1::LIFECYCLE_STATE_UNSPECIFIED;
}

void ToProto(const Histogram::Snapshot& h, v1::Histogram* out) {
  for (double b : h.bounds) out->add_bounds(b);
  for (uint64_t c : h.counts) out->add_counts(c);
  out->set_sum(h.sum);
  out->set_count(h.count);
}

}  // namespace

absl::Status ValidateRuntimeOptions(const RuntimeOptions& o) {
  if (o.model_repository.empty()) {
    return absl::InvalidArgumentError("--model-repository: is required");
  }
  if (o.model.empty()) return absl::InvalidArgumentError("--model: is required");
  if (o.grpc_port < 0 || o.grpc_port > 65535) {
    return absl::InvalidArgumentError("--grpc-port: must be in 0..65535, got " +
                                      std::to_string(o.grpc_port));
  }
  if (o.http_port < 0 || o.http_port > 65535) {
    return absl::InvalidArgumentError("--http-port: must be in 0..65535, got " +
                                      std::to_string(o.http_port));
  }
  if (o.grpc_port != 0 && o.grpc_port == o.http_port) {
    return absl::InvalidArgumentError("--http-port: must differ from --grpc-port");
  }
  if (o.initial_state != "warm" && o.initial_state != "serving") {
    return absl::InvalidArgumentError("--initial-state: must be warm or serving, got '" +
                                      o.initial_state + "'");
  }
  if (!o.device.empty() && o.device != "cpu" &&
      !(o.device.rfind("cuda:", 0) == 0 && o.device.size() > 5 && o.device.size() < 9 &&
        o.device.find_first_not_of("0123456789", 5) == std::string::npos)) {
    return absl::InvalidArgumentError("--device: must be cpu or cuda:N, got '" + o.device + "'");
  }
  if (o.idle_spin_us < 0 || o.idle_spin_us > kMaxIdleSpinMicros) {
    return absl::InvalidArgumentError("--idle-spin-us: must be in 0.." +
                                      std::to_string(kMaxIdleSpinMicros) + ", got " +
                                      std::to_string(o.idle_spin_us));
  }
  if (o.model_cpus < 0 || o.model_cpus > kMaxModelCpus) {
    return absl::InvalidArgumentError("--model-cpus: must be in 0.." +
                                      std::to_string(kMaxModelCpus) + ", got " +
                                      std::to_string(o.model_cpus));
  }
  if (o.threads < 0 || o.threads > 1024) {
    return absl::InvalidArgumentError("--threads: must be in 0..1024");
  }
  if (o.http_threads < 1 || o.http_threads > 64) {
    return absl::InvalidArgumentError("--http-threads: must be in 1..64, got " +
                                      std::to_string(o.http_threads));
  }
  if (o.max_request_bytes < 1024 || o.max_request_bytes > (2LL << 30)) {
    return absl::InvalidArgumentError("--max-request-bytes: must be in 1Ki..2Gi");
  }
  if (o.control_socket.size() >= 100) {
    return absl::InvalidArgumentError("--control-socket: path is too long for a unix socket "
                                      "(max 99 bytes)");
  }
  if (o.drain_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--drain-timeout-ms: must be >= 0");
  }
  if (o.replica_id.size() > 253 ||
      o.replica_id.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                     "0123456789._-") != std::string::npos) {
    return absl::InvalidArgumentError("--replica-id: '" + o.replica_id +
                                      "' must be at most 253 of A-Z a-z 0-9 . _ -");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RuntimeServer>> RuntimeServer::Create(
    RuntimeOptions options, const BackendRegistry* backends, Clock* clock,
    absl::Time process_start) {
  KILN_RETURN_IF_ERROR(ValidateRuntimeOptions(options));
  KILN_ASSIGN_OR_RETURN(ResolvedModel model,
                        ResolveModel(options.model_repository, options.model, options.version));
  // Before any port is taken: an unknown backend is the config's error, not a failed load.
  if (absl::Status s = backends->Check(model.config.backend); !s.ok()) {
    return absl::InvalidArgumentError(
        (std::filesystem::path(model.model_dir) / "config.yaml").string() + ": " +
        std::string(s.message()));
  }
  return std::unique_ptr<RuntimeServer>(
      new RuntimeServer(std::move(options), backends, clock, process_start, std::move(model)));
}

RuntimeServer::RuntimeServer(RuntimeOptions options, const BackendRegistry* backends,
                             Clock* clock, absl::Time process_start, ResolvedModel model)
    : options_(std::move(options)),
      backends_(backends),
      clock_(clock),
      process_start_(process_start),
      model_(std::move(model)),
      lifecycle_(clock, "[model=" + model_.config.name + " v=" + model_.version +
                            " pid=" + std::to_string(getpid()) + "] "),
      host_(model_.config, model_.version, &lifecycle_) {}

RuntimeServer::~RuntimeServer() { Stop(); }

absl::Status RuntimeServer::Start() {
  KILN_RETURN_IF_ERROR(StartListening());
  absl::Status loaded = Load();
  if (!loaded.ok()) {
    lifecycle_.Fail(std::string(loaded.message()));
    return loaded;
  }
  return absl::OkStatus();
}

absl::Status RuntimeServer::StartListening() {
  auto log = GetLogger("runtime.server");
  const std::vector<int> usable = AllowedCpus();
  if (options_.model_cpus > 0) {
    // The model's own CPUs: the last --model-cpus of those this process may use (applied in
    // Load, once the model's thread exists).
    const size_t n = static_cast<size_t>(options_.model_cpus);
    if (usable.size() > n) {
      other_cpus_.assign(usable.begin(), usable.end() - static_cast<long>(n));
      model_cpus_.assign(usable.end() - static_cast<long>(n), usable.end());
    } else {
      log->warn("--model-cpus {}: not used, this runtime may run on {} CPU(s) ({}); the model's "
                "CPUs need at least one more for everything else",
                options_.model_cpus, usable.size(), FormatCpuList(usable));
    }
  }
  if (options_.idle_spin_us > 0) {
    // A spinning thread on the only CPU would hold off the one that hands it work.
    if (usable.size() >= 2) {
      // With --model-cpus leaving one CPU for the rest, the frontends still spin there: on the
      // development VM that served faster than not (bench/RESULTS.md, session 12); the
      // answering thread, woken, takes the CPU from a spinning one.
      idle_spin_ = absl::Microseconds(options_.idle_spin_us);
    } else {
      log->warn("--idle-spin-us {}: not used, this runtime may run on {} CPU (a spin needs two: "
                "on one, a spinning thread would hold off the one that hands it work)",
                options_.idle_spin_us, usable.size());
    }
  }
  // Before the control socket answers: GetState reports it.
  if (!options_.data_socket.empty()) {
    KILN_ASSIGN_OR_RETURN(data_, DataServer::Start(options_.data_socket, &host_,
                                                   options_.max_request_bytes));
  }
  if (!options_.control_socket.empty()) {
    control_service_ = std::make_unique<ControlService>(this, options_.drain_timeout);
    KILN_ASSIGN_OR_RETURN(control_server_,
                          StartControlServer(options_.control_socket, control_service_.get()));
  }
  grpc_service_ = std::make_unique<GrpcInferenceService>(&host_, options_.max_request_bytes,
                                                         options_.server_version);
  // A port another process holds is an error, not shared. Oversized messages are refused
  // from their length prefix, before they are buffered. Clients that keep their connections
  // alive with pings while a long inference sends nothing back get them answered.
  GrpcH2Server::Options g;
  g.bind_address = options_.bind_address;
  g.port = options_.grpc_port;
  g.flag = "--grpc-port";
  g.max_message_bytes = options_.max_request_bytes + 64 * 1024;
  // The reading thread spins too, after each piece of work, as the REST threads do.
  g.idle_spin = idle_spin_;
  KILN_ASSIGN_OR_RETURN(grpc_server_,
                        GrpcH2Server::Start(g, [svc = grpc_service_.get()](
                                                   std::shared_ptr<GrpcH2Server::Call> call) {
                          svc->Serve(std::move(call));
                        }));
  grpc_port_ = grpc_server_->port();
  HttpFrontend::Options http;
  http.bind_address = options_.bind_address;
  http.port = options_.http_port;
  http.max_request_bytes = options_.max_request_bytes;
  http.threads = options_.http_threads;
  http.idle_spin = idle_spin_;
  http.server_version = options_.server_version;
  KILN_ASSIGN_OR_RETURN(http_, HttpFrontend::Start(&host_, http));
  http_port_ = http_->port();
  log->info("listening grpc_port={} http_port={} control_socket={} data_socket={} model={} "
            "version={} replica={}",
            grpc_port_.load(), http_port_.load(),
            options_.control_socket.empty() ? "-" : options_.control_socket,
            options_.data_socket.empty() ? "-" : options_.data_socket, model_.config.name,
            model_.version, options_.replica_id.empty() ? "-" : options_.replica_id);
  return absl::OkStatus();
}

absl::Status RuntimeServer::Load() {
  auto log = GetLogger("runtime.server");
  BackendOptions bo;
  bo.device = options_.device;
  bo.threads = options_.threads;
  if (!model_cpus_.empty()) {
    // One intra-op thread per model CPU: more would take turns on them.
    const int64_t asked = bo.threads > 0 ? bo.threads : model_.config.instance.threads;
    if (asked > options_.model_cpus) {
      log->warn("{} {}: capped at --model-cpus {} (one intra-op thread per model CPU)",
                bo.threads > 0 ? "--threads" : "instance.threads", asked, options_.model_cpus);
    }
    if (asked == 0 || asked > options_.model_cpus) bo.threads = options_.model_cpus;
  }
  absl::Time t0 = clock_->Now();
  KILN_ASSIGN_OR_RETURN(auto backend, backends_->Create(model_.config, model_.model_file, bo));
  absl::Time t1 = clock_->Now();
  KILN_ASSIGN_OR_RETURN(engine_, InferenceEngine::Create(model_.config, model_.version,
                                                         std::move(backend), &lifecycle_, clock_));
  engine_->SetPayloadLimit(options_.max_request_bytes);
  engine_->SetIdleSpin(idle_spin_);
  if (!model_cpus_.empty()) {
    // Every thread so far (the frontends', the batcher's) leaves the model's CPUs, and those
    // started from here on inherit that; then the executions' thread alone moves onto them.
    if (absl::Status s = PinThisProcess(other_cpus_, -1); !s.ok()) {
      return absl::InternalError("--model-cpus: pinning the other threads to cpus " +
                                 FormatCpuList(other_cpus_) + ": " + std::string(s.message()));
    }
    if (absl::Status s = engine_->IsolateModel(model_cpus_); !s.ok()) {
      return absl::InternalError("--model-cpus: pinning the model to cpus " +
                                 FormatCpuList(model_cpus_) + ": " + std::string(s.message()));
    }
    log->info("the model runs alone on cpus {}, everything else on cpus {}",
              FormatCpuList(model_cpus_), FormatCpuList(other_cpus_));
  }
  KILN_RETURN_IF_ERROR(engine_->Warmup());
  absl::Time t2 = clock_->Now();
  host_.SetEngine(engine_.get());
  device_memory_bytes_ = engine_->device_memory_bytes();
  load_time_micros_ = absl::ToInt64Microseconds(t2 - process_start_);
  log->info(
      "loaded {} ({}): process start to load {:.1f} ms, load {:.1f} ms, warmup {:.1f} ms, "
      "since process start {:.1f} ms, device memory {:.1f} MiB",
      model_.model_file, engine_->backend_description(),
      absl::ToDoubleMilliseconds(t0 - process_start_), absl::ToDoubleMilliseconds(t1 - t0),
      absl::ToDoubleMilliseconds(t2 - t1), absl::ToDoubleMilliseconds(t2 - process_start_),
      device_memory_bytes_.load() / 1048576.0);
  KILN_RETURN_IF_ERROR(lifecycle_.Transition(RuntimeState::kWarm, "loaded and warmed up"));
  if (options_.initial_state == "serving") {
    absl::Status serving = lifecycle_.Transition(RuntimeState::kServing, "--initial-state=serving");
    // A Drain or Shutdown that came once it was WARM is a stop, not a failed start.
    // So is a Promote that came first (SERVING already).
    const RuntimeState now = lifecycle_.state();
    if (!serving.ok() && now != RuntimeState::kDraining && now != RuntimeState::kStopped &&
        now != RuntimeState::kServing) {
      return serving;
    }
  }
  // CUDA graphs are captured while the replica already counts as WARM (and may be promoted):
  // shapes not captured yet run eagerly until their graph exists.
  prepare_thread_ = std::thread([this]() {
    auto log = GetLogger("runtime.server");
    absl::Time start = clock_->Now();
    auto prepared = engine_->Prepare([this]() { return prepare_cancel_.load(); });
    device_memory_bytes_ = engine_->device_memory_bytes();
    if (!prepared.ok()) {
      log->warn("device preparation stopped: {}; shapes without a graph run eagerly",
                prepared.status().ToString());
    } else if (!prepared->empty()) {
      log->info("device preparation: {} ({:.1f} ms, ready {:.1f} ms after process start), "
                "device memory {:.1f} MiB",
                *prepared, absl::ToDoubleMilliseconds(clock_->Now() - start),
                absl::ToDoubleMilliseconds(clock_->Now() - process_start_),
                device_memory_bytes_.load() / 1048576.0);
    }
  });
  return absl::OkStatus();
}

v1::RuntimeState RuntimeServer::GetState() {
  v1::RuntimeState s;
  s.set_state(ToProto(lifecycle_.state()));
  s.set_model_name(model_.config.name);
  s.set_model_version(model_.version);
  s.set_replica_id(options_.replica_id);
  InferenceEngine* engine = host_.engine();
  s.set_device(engine ? engine->device()
                      : (options_.device.empty() ? model_.config.instance.device
                                                 : options_.device));
  s.set_grpc_port(grpc_port_.load());
  s.set_http_port(http_port_.load());
  if (data_) s.set_data_socket(data_->path());
  // Set before the control socket answers; the engine is handed over once pinned.
  if (engine != nullptr && !model_cpus_.empty()) s.set_model_cpus(FormatCpuList(model_cpus_));
  s.set_pid(getpid());
  s.set_load_time_micros(load_time_micros_.load());
  s.set_failure_reason(lifecycle_.failure_reason());
  s.set_state_since_unix_micros(absl::ToUnixMicros(lifecycle_.since()));
  s.set_device_memory_bytes(device_memory_bytes_.load());
  return s;
}

absl::Status RuntimeServer::Promote() {
  absl::MutexLock promoting(&promote_mu_);
  RuntimeState s = lifecycle_.state();
  if (s == RuntimeState::kServing) return absl::OkStatus();  // idempotent
  if (s != RuntimeState::kWarm || host_.engine() == nullptr) {
    return absl::FailedPreconditionError(std::string("cannot promote while ") +
                                         RuntimeStateName(s));
  }
  if (options_.warmup_on_promote) {
    absl::Time t0 = clock_->Now();
    KILN_RETURN_IF_ERROR(Annotate(host_.engine()->Warmup(/*once=*/true), "promote"));
    GetLogger("runtime.server")
        ->info("warm-up on promote: {:.2f} ms", absl::ToDoubleMilliseconds(clock_->Now() - t0));
  }
  return lifecycle_.Transition(RuntimeState::kServing, "promoted");
}

absl::Status RuntimeServer::Demote() {
  // After a Promote under way (its warm-up), not between its look and its move: a Demote
  // answered WARM is not undone by the Promote finishing.
  absl::MutexLock promoting(&promote_mu_);
  RuntimeState s = lifecycle_.state();
  if (s == RuntimeState::kWarm) return absl::OkStatus();
  if (s != RuntimeState::kServing) {
    // Only loading itself may leave LOADING.
    return absl::FailedPreconditionError(std::string("cannot demote while ") +
                                         RuntimeStateName(s));
  }
  return lifecycle_.Transition(RuntimeState::kWarm, "demoted");
}

absl::StatusOr<bool> RuntimeServer::Drain(absl::Duration deadline) {
  RuntimeState s = lifecycle_.state();
  if (s != RuntimeState::kDraining) {
    absl::Status moved = lifecycle_.Transition(RuntimeState::kDraining, "drain requested");
    // Another Drain (or SIGTERM) may have moved it there between the look and the move.
    if (!moved.ok() && lifecycle_.state() != RuntimeState::kDraining) return moved;
  }
  {
    absl::MutexLock lock(&mu_);
    drain_until_ = std::min(drain_until_, absl::Now() + deadline);
  }
  InferenceEngine* engine = host_.engine();
  if (!engine) return true;
  bool drained = engine->WaitIdle(deadline);
  GetLogger("runtime.server")
      ->info("drain {}: {} request(s) in flight", drained ? "complete" : "deadline passed",
             engine->in_flight());
  return drained;
}

int64_t RuntimeServer::InFlight() {
  InferenceEngine* engine = host_.engine();
  return engine ? engine->in_flight() : 0;
}

v1::RuntimeStats RuntimeServer::Stats() {
  v1::RuntimeStats out;
  out.set_state(ToProto(lifecycle_.state()));
  auto counts = lifecycle_.transition_counts();
  for (int i = 0; i < kRuntimeStateCount; ++i) {
    (*out.mutable_transitions())[RuntimeStateName(static_cast<RuntimeState>(i))] = counts[i];
  }
  InferenceEngine* engine = host_.engine();
  if (!engine) return out;
  EngineStats s = engine->Stats();
  out.set_requests(s.requests);
  out.set_errors(s.errors);
  out.set_in_flight(s.in_flight);
  out.set_queue_depth(s.queue_depth);
  ToProto(s.latency_micros, out.mutable_latency_micros());
  ToProto(s.batch_size, out.mutable_batch_size());
  ToProto(s.compute_micros, out.mutable_compute_micros());
  out.set_compute_p50_micros(s.compute_micros.Quantile(0.5));
  out.set_compute_p99_micros(s.compute_micros.Quantile(0.99));
  out.set_cache_hits(s.cache.hits);
  out.set_cache_misses(s.cache.misses);
  out.set_cache_bytes(static_cast<uint64_t>(s.cache.bytes));
  out.set_batches(s.batches);
  out.set_rejected_queue_full(s.rejected_queue_full);
  out.set_timed_out(s.timed_out);
  out.set_idle_spins(static_cast<uint64_t>(s.idle_spins));
  out.set_idle_spin_catches(static_cast<uint64_t>(s.idle_spin_catches));
  out.set_latency_p50_micros(s.latency_micros.Quantile(0.5));
  out.set_latency_p99_micros(s.latency_micros.Quantile(0.99));
  return out;
}

bool RuntimeServer::Shutdown(absl::Duration deadline) {
  bool drained = true;
  RuntimeState s = lifecycle_.state();
  if (s == RuntimeState::kWarm || s == RuntimeState::kServing || s == RuntimeState::kDraining) {
    auto d = Drain(deadline);
    drained = d.ok() && *d;
  }
  absl::MutexLock lock(&mu_);
  shutdown_requested_ = true;
  return drained;
}

bool RuntimeServer::WaitForShutdownRequest(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&shutdown_requested_), timeout);
}

void RuntimeServer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  prepare_cancel_ = true;
  RuntimeState s = lifecycle_.state();
  // Draining already (an agent's Drain under way): its in-flight and queued work still gets
  // the drain deadline before anything is failed.
  if (s == RuntimeState::kWarm || s == RuntimeState::kServing || s == RuntimeState::kDraining) {
    absl::Duration wait = options_.drain_timeout;
    {
      absl::MutexLock lock(&mu_);
      if (drain_until_ != absl::InfiniteFuture()) {
        wait = std::max(absl::ZeroDuration(), drain_until_ - absl::Now());
      }
    }
    (void)Drain(wait);
  }
  if (prepare_thread_.joinable()) prepare_thread_.join();
  auto log = GetLogger("runtime.server");
  absl::Time t0 = absl::Now();
  // The drain deadline has passed (or everything finished): whatever is still queued fails
  // now, so neither frontend waits on the model past the deadline.
  if (InferenceEngine* e = host_.engine()) e->Stop();
  // STOPPED once nothing runs any more.
  if (lifecycle_.state() == RuntimeState::kDraining) {
    (void)lifecycle_.Transition(RuntimeState::kStopped, "shut down");
  }
  if (http_) http_->Stop();
  if (data_) data_->Stop();
  absl::Time t1 = absl::Now();
  if (grpc_server_) {
    grpc_server_->Stop(absl::Milliseconds(100));
  }
  absl::Time t2 = absl::Now();
  if (control_server_) {
    control_server_->Stop(absl::Milliseconds(100));
    // A call still running on a worker (a Promote's warm-up, a Drain) was cancelled, not
    // finished: it ends now the engine has stopped, and uses this object until then.
    control_service_->JoinWorkers();
    std::error_code ec;
    std::filesystem::remove(options_.control_socket, ec);
  }
  log->debug("stop: http {:.1f} ms, grpc {:.1f} ms, rest {:.1f} ms",
             absl::ToDoubleMilliseconds(t1 - t0), absl::ToDoubleMilliseconds(t2 - t1),
             absl::ToDoubleMilliseconds(absl::Now() - t2));
}

}  // namespace kiln
