#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>


#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/idle_spin.h"
#include "runtime/backend.h"
#include "runtime/control_service.h"
#include "runtime/grpc_frontend.h"
#include "runtime/http_frontend.h"
#include "runtime/inference_engine.h"
#include "runtime/lifecycle.h"
#include "runtime/data_server.h"
#include "runtime/model_host.h"

namespace kiln {

struct RuntimeOptions {
  std::string model_repository;
  std::string model;
  std::string version;  // empty = highest numeric
  std::string bind_address = "0.0.0.0";
  int grpc_port = 8001;  // 0 = pick a free port
  int http_port = 8000;  // 0 = pick a free port
  std::string control_socket;  // empty = no control socket
  // ModelInfer over a unix socket for the node's router (data_server.h); empty = none.
  std::string data_socket;
  std::string initial_state = "serving";  // warm | serving
  std::string device;  // empty = the config's instance.device
  // The replica this process runs, as its agent names it (logs and GetState); empty = none.
  std::string replica_id;
  int64_t threads = 0;
  int http_threads = HttpFrontend::kDefaultThreads;  // the REST frontend's threads
  int64_t max_request_bytes = kDefaultMaxRequestBytes;
  absl::Duration drain_timeout = absl::Seconds(30);
  std::string server_version = "0.1.0";
  // Run one warm-up inference before a promoted replica is routed: a power-parked device
  // (CUDA_DISABLE_PERF_BOOST=1) pays its slow first kernel here, not on a client request.
  bool warmup_on_promote = false;
  // After each execution, the executions' thread waits busily this long for the next request
  // before it sleeps (Batcher::SetIdleSpin), and the gRPC and REST threads poll busily this
  // long after each piece of work (GrpcH2Server::Options::idle_spin,
  // HttpServer::Options::idle_spin); 0 = off. At most kMaxIdleSpinMicros.
  int64_t idle_spin_us = 0;
  // The last this many of the CPUs the runtime may use run the model alone (its executions'
  // thread and what that thread starts, LibTorch's intra-op threads among them); every other
  // thread runs on the rest, and replies are encoded and sent there
  // (Batcher::IsolateExecutor). 0 = off. Without at least one CPU left over it is not used (a
  // warning). The model then gets this many intra-op threads, or fewer if --threads or the
  // config's instance.threads asks for fewer (more are capped, with a warning).
  int64_t model_cpus = 0;
};

// Checks flag values; errors name the flag.
absl::Status ValidateRuntimeOptions(const RuntimeOptions& options);

// One replica: resolves the model, starts the control socket and both frontends, loads and
// warms the model (LOADING -> WARM), then serves if asked (-> SERVING).
class RuntimeServer : public ControlTarget {
 public:
  static absl::StatusOr<std::unique_ptr<RuntimeServer>> Create(RuntimeOptions options,
                                                               const BackendRegistry* backends,
                                                               Clock* clock,
                                                               absl::Time process_start);
  ~RuntimeServer() override;

  // Starts listening, then loads. A load failure leaves the runtime FAILED and is returned.
  absl::Status Start();

  int grpc_port() const { return grpc_port_.load(); }
  int http_port() const { return http_port_.load(); }
  RuntimeState state() const { return lifecycle_.state(); }

  // Blocks until Shutdown() was called over the control socket, or `timeout` passes.
  bool WaitForShutdownRequest(absl::Duration timeout);
  // Drains (bounded), stops everything. Safe to call more than once.
  void Stop();

  // ControlTarget
  v1::RuntimeState GetState() override;
  absl::Status Promote() override;
  bool PromoteWaits() const override { return options_.warmup_on_promote; }
  absl::Status Demote() override;
  absl::StatusOr<bool> Drain(absl::Duration deadline) override;
  v1::RuntimeStats Stats() override;
  bool Shutdown(absl::Duration deadline) override;
  int64_t InFlight() override;

 private:
  RuntimeServer(RuntimeOptions options, const BackendRegistry* backends, Clock* clock,
                absl::Time process_start, ResolvedModel model);
  absl::Status StartListening();
  absl::Status Load();

  const RuntimeOptions options_;
  const BackendRegistry* backends_;
  Clock* clock_;
  const absl::Time process_start_;
  const ResolvedModel model_;
  Lifecycle lifecycle_;
  ModelHost host_;
  std::unique_ptr<InferenceEngine> engine_;
  std::unique_ptr<GrpcInferenceService> grpc_service_;
  std::unique_ptr<GrpcH2Server> grpc_server_;
  std::unique_ptr<HttpFrontend> http_;
  std::unique_ptr<DataServer> data_;
  // Written once listening; GetState may read them from the control server's threads before.
  std::atomic<int> grpc_port_{0};
  std::atomic<int> http_port_{0};
  // One Promote at a time: a second one waits and finds the replica SERVING (done), instead of
  // running the warm-up again and failing its own transition.
  absl::Mutex promote_mu_;
  std::atomic<int64_t> load_time_micros_{0};
  std::atomic<int64_t> device_memory_bytes_{0};
  // --idle-spin-us as used: zero when off, or when this process may run on one CPU only.
  absl::Duration idle_spin_ = absl::ZeroDuration();
  // --model-cpus as used (StartListening): the model's CPUs and the rest; empty when off or
  // when this process may not run on more CPUs than the model's.
  std::vector<int> model_cpus_;
  std::vector<int> other_cpus_;
  // Device preparation (CUDA graph capture) after loading, in the background.
  std::thread prepare_thread_;
  std::atomic<bool> prepare_cancel_{false};

  absl::Mutex mu_;
  // The earliest deadline a Drain (or Shutdown) set: Stop waits for no more than what is left
  // of it, not the full --drain-timeout again.
  absl::Time drain_until_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool shutdown_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  // Last, so destroyed first: the server before the service it calls, and the service (which
  // joins its workers) before anything a worker may still be using.
  std::unique_ptr<ControlService> control_service_;
  std::unique_ptr<ControlServer> control_server_;
};

}  // namespace kiln
