#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/histogram.h"
#include "runtime/backend.h"
#include "common/oip_parameters.h"
#include "runtime/batcher.h"
#include "runtime/lifecycle.h"
#include "runtime/model_config.h"
#include "runtime/response_cache.h"

namespace kiln {

// A protocol-neutral inference request, as the frontends decode it.
struct InferRequest {
  std::string model_name;
  std::string model_version;  // empty = the served version
  std::string id;
  std::vector<Tensor> inputs;
  std::vector<std::string> outputs;  // requested outputs; empty = all
  int64_t priority = 0;              // 0 = the config's default level
  int64_t timeout_micros = 0;        // 0 = the config's default
  // The caller's own deadline (a gRPC deadline, the router's), as the time it had left when the
  // request was decoded; 0 = none. It bounds the request's timeout but never replaces it: the
  // request leaves the queue at the earlier of the two.
  int64_t caller_time_left_micros = 0;
  // Neither answered from the response cache nor stored in it (parameter kiln-skip-cache):
  // the agent's health probe, which must run the model.
  bool skip_cache = false;
  // It was read by a thread that reads other callers' requests too (the data socket's reader,
  // the REST server's): with priority levels it is queued rather than run on that thread, so
  // that a higher-priority request read after it is not held back by it.
  bool shared_reader = false;
  // Never run on the thread that handed it in, even by an idle model: that thread serves every
  // connection of its port (the gRPC port's one thread), which must go on reading requests
  // (to batch them) and answering pings while the model runs.
  bool never_inline = false;
};

struct InferResponse {
  std::string model_name;
  std::string model_version;
  std::string id;
  std::vector<Tensor> outputs;
  bool cache_hit = false;
};

struct EngineStats {
  uint64_t requests = 0;
  uint64_t errors = 0;
  int64_t in_flight = 0;
  int64_t queue_depth = 0;
  int64_t idle_spins = 0;         // Batcher::idle_spins
  int64_t idle_spin_catches = 0;  // Batcher::idle_spin_catches
  uint64_t batches = 0;
  uint64_t rejected_queue_full = 0;
  uint64_t timed_out = 0;
  Histogram::Snapshot latency_micros;
  // How long the model took per execution (a batch counts once), in microseconds: the part of
  // a request's latency that is the model's, apart from queueing and the frontends.
  Histogram::Snapshot compute_micros;
  Histogram::Snapshot batch_size;
  ResponseCache::Counters cache;
};

// One served model version: request validation, the response cache, the dynamic batcher and
// the backend, gated by the lifecycle (only SERVING takes inference).
// The payload limit a runtime starts with (--max-request-bytes): a request's bytes, decoded,
// and once padded to its sequence bucket.
inline constexpr int64_t kDefaultMaxRequestBytes = 64LL * 1024 * 1024;

class InferenceEngine {
 public:
  using Done = std::function<void(absl::StatusOr<InferResponse>)>;

  static absl::StatusOr<std::unique_ptr<InferenceEngine>> Create(
      ModelConfig config, std::string version, std::unique_ptr<Backend> backend,
      Lifecycle* lifecycle, Clock* clock);
  ~InferenceEngine();

  const ModelConfig& config() const { return config_; }
  const std::string& version() const { return version_; }
  std::string device() const { return backend_->device(); }
  std::string backend_description() const { return backend_->Describe(); }

  // Runs the config's warm-up samples straight on the backend (on the batcher's thread when
  // the backend wants one execution thread, else here); with `once`, only one
  // iteration of the first sample (to wake a parked device before routing). Without samples,
  // one zero-filled request of the smallest shape, best effort (its failure is logged).
  absl::Status Warmup(bool once = false);
  // The backend's device-side preparation (CUDA graph capture), after Warmup(); see
  // Backend::Prepare.
  absl::StatusOr<std::string> Prepare(const std::function<bool()>& cancelled) {
    return backend_->Prepare(cancelled);
  }
  int64_t device_memory_bytes() const { return backend_->DeviceMemoryBytes(); }

  // The most a request may hold once padded to its sequence bucket (the frontends' payload
  // limit; kDefaultMaxRequestBytes until set).
  void SetPayloadLimit(int64_t bytes) { payload_limit_ = bytes; }
  // How long the executions' thread waits busily for the next request before it sleeps
  // (Batcher::SetIdleSpin; 0 = not at all).
  void SetIdleSpin(absl::Duration spin) { batcher_->SetIdleSpin(spin); }
  // Runs the model on `cpus` alone (Batcher::IsolateExecutor). Before Warmup, so that what
  // the first executions set up (LibTorch's intra-op threads) is made on those CPUs.
  absl::Status IsolateModel(const std::vector<int>& cpus) {
    return batcher_->IsolateExecutor(cpus);
  }
  // Validates and queues `request`; `done` runs exactly once (maybe on this thread).
  void Infer(InferRequest request, Done done);
  // A request a frontend refused before it could be decoded (bad body, wrong byte size, a
  // decoded size over the limit): counted as a request and an error, as the callers' error
  // rate should see it. (A REST body whose declared length is over the limit is refused by the
  // HTTP server before any handler and is not counted.)
  void CountRefused();
  // Synchronous convenience over Infer().
  absl::StatusOr<InferResponse> InferSync(InferRequest request);

  // Checks a request's model, version, inputs and outputs against the config; reorders the
  // inputs into config order. Public for the frontends' unit tests.
  absl::Status Validate(InferRequest& request) const;

  // True when a model with this name (and version, if non-empty) is the one served.
  bool Serves(const std::string& model, const std::string& version) const;

  // Waits until no request is in flight or `timeout` passes; true when idle.
  bool WaitIdle(absl::Duration timeout);
  int64_t in_flight() const { return in_flight_.load(); }

  EngineStats Stats() const;
  // Stops the batcher: queued requests fail with UNAVAILABLE.
  void Stop();

 private:
  absl::Status WarmupHere(bool once);  // Warmup() on the calling thread
  absl::Status RunWarmupSample(const WarmupSample& w, bool once);
  InferenceEngine(ModelConfig config, std::string version, std::unique_ptr<Backend> backend,
                  Lifecycle* lifecycle, Clock* clock);
  // Counters and latency, before the reply goes out.
  void Record(absl::Time start, const absl::Status& status);
  // Leaves the in-flight count, after the reply was handed to the frontend.
  void Leave();
  // Leaves on scope exit: a request's in-flight count comes down even if its answer throws.
  struct LeaveAfter {
    InferenceEngine* engine;
    ~LeaveAfter() { engine->Leave(); }
  };

  const ModelConfig config_;
  const std::string version_;
  std::atomic<int64_t> payload_limit_{kDefaultMaxRequestBytes};
  std::unique_ptr<Backend> backend_;
  Lifecycle* lifecycle_;
  Clock* clock_;
  std::unique_ptr<ResponseCache> cache_;  // null when disabled
  std::unique_ptr<Batcher> batcher_;

  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> errors_{0};
  std::atomic<uint64_t> batches_{0};
  std::atomic<uint64_t> rejected_queue_full_{0};
  std::atomic<uint64_t> timed_out_{0};
  std::atomic<int64_t> in_flight_{0};
  Histogram latency_micros_;
  Histogram compute_micros_;
  Histogram batch_size_;
  mutable absl::Mutex idle_mu_;
};

}  // namespace kiln
