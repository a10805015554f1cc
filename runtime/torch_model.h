#pragma once

// What the LibTorch backends (TorchScript, AOTInductor) share: datatype mapping, output
// unpacking, device set-up, and one Backend over a TorchRunner. Included only by the LibTorch
// targets (never together with spdlog or fmt).

#include <torch/script.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/backend.h"
#include "runtime/torch_runner.h"

namespace kiln {

// The first line of a LibTorch error, plus its last non-empty line when they differ (the
// interpreter's "operation failed" header names no cause; the last line does).
std::string FirstLine(const std::string& s);

double MillisSince(std::chrono::steady_clock::time_point t0);

absl::StatusOr<at::ScalarType> ToTorchType(DataType t, const std::string& field);

// The model's return value (a tensor, a tuple or list in output order, or a dict keyed by
// output name) -> output tensors in config order and config datatypes, contiguous, still on
// the model's device.
absl::StatusOr<std::vector<at::Tensor>> UnpackOutputs(const ModelConfig& config,
                                                      const c10::IValue& result);

// The device a model runs on, checked against this build and host, with its CUDA context made
// (so a load log tells context creation and loading apart).
struct TorchDevice {
  torch::Device device{torch::kCPU};
  at::ScalarType compute_type = at::kFloat;  // instance.precision
  double context_ms = 0;
  int intra_op_threads = 1;  // LibTorch's, once set up
};
// Runs `fn` and turns a LibTorch exception into INVALID_ARGUMENT: "`prefix`: first line".
template <typename T, typename F>
absl::StatusOr<T> CatchTorch(const std::string& prefix, F&& fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(prefix + ": " + FirstLine(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(prefix + ": " + FirstLine(e.what()));
  }
}

using BackendOr = absl::StatusOr<std::unique_ptr<Backend>>;

// A made backend, started (its runner chosen), as a Backend.
template <typename B>
BackendOr Started(std::unique_ptr<B> backend) {
  absl::Status started = backend->Start();
  if (!started.ok()) return started;
  return std::unique_ptr<Backend>(std::move(backend));
}

// Fails with NOT_FOUND / PERMISSION_DENIED naming the file.
absl::Status CheckReadable(const std::string& model_file);

absl::StatusOr<TorchDevice> SetUpTorchDevice(const ModelConfig& config,
                                             const BackendOptions& options);

// A backend factory's frame: the file must be readable, the device is set up, then
// `load(device)` makes the backend; LibTorch exceptions become errors naming the file.
template <typename F>
BackendOr LoadTorchBackend(const ModelConfig& config, const std::string& model_file,
                           const BackendOptions& options, F&& load) {
  if (absl::Status st = CheckReadable(model_file); !st.ok()) return st;
  return CatchTorch<std::unique_ptr<Backend>>(model_file, [&]() -> BackendOr {
    auto device = SetUpTorchDevice(config, options);
    if (!device.ok()) return device.status();
    return load(*device);
  });
}

// The runner options for `config` on `device`: inputs in config order (sequence inputs filled
// with their pad value while graphs are captured) and, on cuda, the planned graphs.
absl::StatusOr<RunnerOptions> MakeRunnerOptions(const ModelConfig& config,
                                                const TorchDevice& device);

// A Backend over a TorchRunner: request bytes in, one Run() at a time, bytes out.
class TorchModelBackend : public Backend {
 public:
  // `what` names the backend in Describe() ("torchscript", "aotinductor"); `note` says what
  // loading did.
  TorchModelBackend(const ModelConfig& config, TorchDevice device, std::string what,
                    std::string note)
      : config_(config), device_(device), what_(std::move(what)), note_(std::move(note)) {}

  std::string device() const override { return device_.device.str(); }
  std::string Describe() const override;
  absl::StatusOr<std::string> Prepare(const std::function<bool()>& cancelled) override;
  int64_t DeviceMemoryBytes() const override { return runner_->DeviceMemoryBytes(); }
  bool WantsOneExecutionThread() const override {
    return device_.device.is_cpu() && device_.intra_op_threads > 1;
  }
  absl::StatusOr<std::vector<Tensor>> Execute(std::vector<Tensor> inputs) override;

 protected:
  // Starts the runner over `forward`: the CUDA runner on a cuda device, the direct one on cpu.
  absl::Status StartRunner(ForwardFn forward);
  // The runner (its graphs and staging) goes before the model it runs: derived destructors,
  // which own the model, call this first.
  void StopRunner() { runner_.reset(); }

  const ModelConfig config_;
  const TorchDevice device_;

 private:
  std::string what_;
  std::string note_;
  std::mutex mu_;  // one Run() at a time: its returned tensors are reused buffers
  std::unique_ptr<TorchRunner> runner_;
};

}  // namespace kiln
