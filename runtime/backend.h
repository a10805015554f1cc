#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/model_config.h"
#include "runtime/tensor.h"

namespace kiln {

// One loaded model on one device. Implementations live in their own targets (the
// TorchScript backend is the only target that links LibTorch); this header stays free of
// any backend's headers.
class Backend {
 public:
  virtual ~Backend() = default;
  // `inputs` are in the config's input order and share dim 0 when the model batches.
  // Returns the outputs in the config's output order.
  virtual absl::StatusOr<std::vector<Tensor>> Execute(std::vector<Tensor> inputs) = 0;
  // Where the model runs ("cpu", "cuda:0").
  virtual std::string device() const = 0;
  // One line for the load log: backend, device, precision and what loading changed.
  virtual std::string Describe() const { return device(); }
  // Device-side preparation after warm-up, such as capturing CUDA graphs. It runs in the
  // background while the replica is WARM or SERVING (Execute() keeps working meanwhile, on
  // whatever is prepared so far) and stops early once `cancelled` returns true. Returns one
  // line for the log (empty when there was nothing to do).
  virtual absl::StatusOr<std::string> Prepare(const std::function<bool()>& cancelled) {
    return std::string();
  }
  // Device memory this replica holds (weights, activations, graph pools); 0 on cpu.
  virtual int64_t DeviceMemoryBytes() const { return 0; }
  // Every execution should run on one thread, never inline on a caller's. True for a CPU
  // model with several intra-op threads: OpenMP keeps a team of worker threads for each thread
  // that calls into it, and executions spread over the frontends' threads leave several teams
  // spinning against each other (measured on a 16-CPU host: 3.7x the compute time).
  virtual bool WantsOneExecutionThread() const { return false; }
};

struct BackendOptions {
  std::string device = "cpu";  // overrides the config's instance.device when set
  int64_t threads = 0;
};

using BackendFactory = std::function<absl::StatusOr<std::unique_ptr<Backend>>(
    const ModelConfig& config, const std::string& model_file, const BackendOptions& options)>;

// Backends register explicitly (from main.cc), by the name config.yaml's `backend` uses.
class BackendRegistry {
 public:
  void Register(const std::string& name, BackendFactory factory) {
    factories_[name] = std::move(factory);
  }
  // OK when config.yaml's `backend` names a registered backend.
  absl::Status Check(const std::string& backend) const {
    if (factories_.count(backend)) return absl::OkStatus();
    std::string known;
    for (const auto& [n, f] : factories_) known += (known.empty() ? "" : ", ") + n;
    return absl::InvalidArgumentError("backend: '" + backend +
                                      "' is not a registered backend (registered: " + known + ")");
  }
  absl::StatusOr<std::unique_ptr<Backend>> Create(const ModelConfig& config,
                                                  const std::string& model_file,
                                                  const BackendOptions& options) const {
    if (absl::Status s = Check(config.backend); !s.ok()) return s;
    return factories_.at(config.backend)(config, model_file, options);
  }

 private:
  std::map<std::string, BackendFactory> factories_;
};

}  // namespace kiln
