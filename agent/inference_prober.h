#pragma once

#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kiln {

// The health check that proves a replica really serves: one tiny inference.
class InferenceProber {
 public:
  virtual ~InferenceProber() = default;
  // OK when `model` at `grpc_address` answers a small all-zero request.
  virtual absl::Status Probe(const std::string& grpc_address, const std::string& model) = 0;
};

// Reads the model's metadata once per address, then sends a batch-1 request of zeros with
// every variable dimension set to 1.
std::unique_ptr<InferenceProber> MakeGrpcInferenceProber(absl::Duration timeout);

// Tests set the answer per address.
class FakeInferenceProber : public InferenceProber {
 public:
  absl::Status Probe(const std::string& grpc_address, const std::string& model) override {
    absl::MutexLock lock(&mu_);
    probes_[grpc_address]++;
    auto it = results_.find(grpc_address);
    return it == results_.end() ? absl::OkStatus() : it->second;
  }
  void Set(const std::string& grpc_address, absl::Status s) {
    absl::MutexLock lock(&mu_);
    results_[grpc_address] = std::move(s);
  }
  int probes(const std::string& grpc_address) {
    absl::MutexLock lock(&mu_);
    return probes_[grpc_address];
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, absl::Status> results_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> probes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln
