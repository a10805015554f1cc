#pragma once

// How a loaded model (TorchScript module or AOTInductor package) is driven on its device.
// Included only by the LibTorch targets (never together with spdlog or fmt).
//
// Two runners: the direct one (any device, plain copies, used on cpu) and the CUDA one (its
// own stream, pinned reused staging buffers, async copies, CUDA graphs per batch x length
// bucket). The CUDA runner lives in its own target, built only where LibTorch has CUDA; the
// default (CPU) build links a stand-in whose factory says CUDA is not built in.

#include <torch/script.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/buckets.h"

namespace kiln {

inline bool IsFloatingType(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

// The datatype an input of type `t` runs in: floating inputs take a reduced compute type.
inline at::ScalarType RunType(at::ScalarType t, at::ScalarType compute) {
  return IsFloatingType(t) && compute != at::kFloat ? compute : t;
}

// One forward of the model on device tensors (config order, run types), on the current
// stream: the output tensors in config order and config datatypes, contiguous, still on the
// device. A backend wraps its module or package in one of these.
using ForwardFn =
    std::function<absl::StatusOr<std::vector<at::Tensor>>(const std::vector<at::Tensor>&)>;

struct RunnerInput {
  at::ScalarType dtype = at::kFloat;  // the request's datatype
  std::vector<int64_t> dims;          // without the batch dimension; -1 = the sequence axis
  double fill = 1.0;                  // what the static inputs hold while graphs are captured
};

struct RunnerOptions {
  torch::Device device{torch::kCPU};
  at::ScalarType compute_type = at::kFloat;  // floating inputs are cast to this on the device
  std::vector<RunnerInput> inputs;            // config order
  std::vector<GraphShape> graphs;             // CUDA graphs to capture (largest first)
  int64_t graph_warmup_iterations = 3;
  std::vector<std::string> attention;         // instance.attention (cuda only; empty = default)
};

class TorchRunner {
 public:
  virtual ~TorchRunner() = default;
  // `inputs` are host tensors in config order (they may borrow request memory). The returned
  // host tensors stay valid until the next Run(); callers serialise Run() and copy out.
  virtual absl::StatusOr<std::vector<at::Tensor>> Run(const std::vector<at::Tensor>& inputs) = 0;
  // Device-side preparation after warm-up (graph capture), concurrent with Run(); stops early
  // once `cancelled` returns true. A line for the log.
  virtual absl::StatusOr<std::string> Prepare(const std::function<bool()>& cancelled) {
    return std::string();
  }
  virtual int64_t DeviceMemoryBytes() const { return 0; }
  virtual std::string Describe() const = 0;
};

std::unique_ptr<TorchRunner> MakeDirectRunner(ForwardFn forward, RunnerOptions options);

// FAILED_PRECONDITION in a build whose LibTorch has no CUDA.
absl::StatusOr<std::unique_ptr<TorchRunner>> MakeCudaRunner(ForwardFn forward,
                                                            RunnerOptions options);
bool CudaRunnerBuiltIn();

}  // namespace kiln
