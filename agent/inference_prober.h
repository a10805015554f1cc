#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kiln {

// The health check that proves a replica really serves: one tiny inference.
class InferenceProber {
 public:
  virtual ~InferenceProber() = default;
  // OK when `model` at `grpc_address` answers a small all-zero request. Thread-safe.
  virtual absl::Status Probe(const std::string& grpc_address, const std::string& model) = 0;
  // Ends the probes under way (CANCELLED), and every later one at once: the agent is stopping.
  virtual void CancelAll() {}
};

// Reads the model's metadata once per address, then sends a batch-1 request of zeros with
// every variable dimension set to 1.
std::unique_ptr<InferenceProber> MakeGrpcInferenceProber(absl::Duration timeout);

// Runs probes on threads of its own. A probe takes as long as the model's inference, and up to
// its timeout on a replica that hangs; the agent's loop, which starts and promotes every
// replica of the node, must not wait for it.
class ProbeRunner {
 public:
  struct Result {
    uint64_t token = 0;
    absl::Status status;
  };
  // `threads` 0: each probe runs inside Submit (deterministic, for tests with a fake prober).
  ProbeRunner(InferenceProber* prober, int threads);
  // Cancels the probes under way (InferenceProber::CancelAll) and waits for their threads;
  // queued ones are dropped.
  ~ProbeRunner();
  ProbeRunner(const ProbeRunner&) = delete;
  ProbeRunner& operator=(const ProbeRunner&) = delete;

  // Probes `model` at `address`; its result comes back from Take() under `token`.
  void Submit(uint64_t token, std::string address, std::string model);
  // The results finished since the last call, in the order they finished.
  std::vector<Result> Take();

 private:
  struct Job {
    uint64_t token;
    std::string address;
    std::string model;
  };
  void Work();
  void Run(const Job& job);

  InferenceProber* prober_;
  absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<Result> results_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// Tests set the answer per address.
class FakeInferenceProber : public InferenceProber {
 public:
  absl::Status Probe(const std::string& grpc_address, const std::string& model) override {
    absl::MutexLock lock(&mu_);
    probes_[grpc_address]++;
    auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !hold_; };
    mu_.Await(absl::Condition(&released));
    answered_[grpc_address]++;
    auto it = results_.find(grpc_address);
    return it == results_.end() ? absl::OkStatus() : it->second;
  }
  void Set(const std::string& grpc_address, absl::Status s) {
    absl::MutexLock lock(&mu_);
    results_[grpc_address] = std::move(s);
  }
  // While held, probes wait (a replica that hangs); released, they answer what is Set then.
  void Hold(bool hold) {
    absl::MutexLock lock(&mu_);
    hold_ = hold;
  }
  int answered(const std::string& grpc_address) {
    absl::MutexLock lock(&mu_);
    return answered_[grpc_address];
  }
  int probes(const std::string& grpc_address) {
    absl::MutexLock lock(&mu_);
    return probes_[grpc_address];
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, absl::Status> results_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> probes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> answered_ ABSL_GUARDED_BY(mu_);
  bool hold_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kiln
