#include "runtime/torch_runner.h"

namespace kiln {

namespace {

// Forward on the module's device with plain (synchronous) copies.
class DirectRunner : public TorchRunner {
 public:
  DirectRunner(ForwardFn forward, RunnerOptions options)
      : forward_(std::move(forward)), options_(std::move(options)) {}

  absl::StatusOr<std::vector<at::Tensor>> Run(const std::vector<at::Tensor>& inputs) override {
    std::vector<at::Tensor> args;
    args.reserve(inputs.size());
    for (const at::Tensor& in : inputs) {
      at::Tensor x = in;
      at::ScalarType run = RunType(x.scalar_type(), options_.compute_type);
      if (run != x.scalar_type()) x = x.to(run);
      if (!options_.device.is_cpu()) x = x.to(options_.device, /*non_blocking=*/false);
      args.emplace_back(std::move(x));
    }
    auto outs = forward_(args);
    if (!outs.ok()) return outs.status();
    for (at::Tensor& y : *outs) y = y.to(torch::kCPU).contiguous();
    return outs;
  }

  std::string Describe() const override { return "direct"; }

 private:
  ForwardFn forward_;
  RunnerOptions options_;
};

}  // namespace

std::unique_ptr<TorchRunner> MakeDirectRunner(ForwardFn forward, RunnerOptions options) {
  return std::make_unique<DirectRunner>(std::move(forward), std::move(options));
}

}  // namespace kiln
