// The AOTInductor backend: a model.pt2 package made by torch.export and AOTInductor (its
// kernels compiled ahead of time, Triton on cuda), served through the same runners as
// TorchScript: on cuda its own stream, pinned staging and CUDA graphs per (batch, sequence
// bucket) captured around the package's run.
//
// Built only where LibTorch ships the package loader (runtime/CMakeLists.txt picks this file
// or aoti_backend_unavailable.cc by target).
#include "runtime/aoti_backend.h"

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "runtime/torch_model.h"

namespace kiln {

namespace {

// Package metadata written at export (bench/gpu/make_bge_m3.py writes it): the precision the
// package computes in. The device key is AOTInductor's own.
constexpr char kPrecisionKey[] = "kiln.precision";
constexpr char kDeviceKey[] = "AOTI_DEVICE_KEY";

class AotiBackend : public TorchModelBackend {
 public:
  AotiBackend(const ModelConfig& config,
              std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader, TorchDevice device,
              std::string note)
      : TorchModelBackend(config, device, "aotinductor", std::move(note)),
        loader_(std::move(loader)) {}
  ~AotiBackend() override { StopRunner(); }

  absl::Status Start() {
    return StartRunner(
        [this](const std::vector<at::Tensor>& inputs) -> absl::StatusOr<std::vector<at::Tensor>> {
          // No stream handle: the package runs on the current stream, the runner's own (and
          // the capturing one while a CUDA graph is recorded).
          std::vector<at::Tensor> outs = loader_->run(inputs, nullptr);
          return UnpackOutputs(config_, c10::IValue(c10::List<at::Tensor>(outs)));
        });
  }

 private:
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateAotiBackend(const ModelConfig& config,
                                                           const std::string& model_file,
                                                           const BackendOptions& options) {
  return LoadTorchBackend(config, model_file, options, [&](const TorchDevice& device) -> BackendOr {
    // The package checks each input's dtype, device and the ranges its dynamic dimensions were
    // exported with, and refuses the run with an error instead of reading out of bounds.
    setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", /*overwrite=*/0);
    auto t_load = std::chrono::steady_clock::now();
    using Loader = std::unique_ptr<torch::inductor::AOTIModelPackageLoader>;
    auto loaded = CatchTorch<Loader>(model_file + ": not a loadable AOTInductor package", [&]() {
      // Single-threaded runs (kiln serialises them): no per-run events or locks inside the
      // package, which CUDA graph capture needs.
      return std::make_unique<torch::inductor::AOTIModelPackageLoader>(
          model_file, "model", /*run_single_threaded=*/true, /*num_runners=*/1,
          device.device.is_cuda() ? device.device.index() : static_cast<c10::DeviceIndex>(-1));
    });
    if (!loaded.ok()) return loaded.status();
    Loader loader = std::move(*loaded);
    const double load_ms = MillisSince(t_load);
    auto metadata = loader->get_metadata();
    auto dev = metadata.find(kDeviceKey);
    if (dev != metadata.end()) {
      const bool package_cuda = dev->second == "cuda";
      if (package_cuda != device.device.is_cuda()) {
        return absl::InvalidArgumentError("instance.device: " + device.device.str() + " but " +
                                          model_file + " was compiled for " + dev->second);
      }
    }
    auto prec = metadata.find(kPrecisionKey);
    if (prec != metadata.end() && prec->second != PrecisionName(config.instance.precision)) {
      return absl::InvalidArgumentError(
          std::string("instance.precision: ") + PrecisionName(config.instance.precision) +
          " but " + model_file + " was compiled in " + prec->second +
          " (an AOTInductor package's precision is fixed at export)");
    }
    char note[160];
    std::snprintf(note, sizeof(note), "package loaded in %.1f ms%s", load_ms,
                  prec == metadata.end() ? ", precision not recorded in the package" : "");
    return Started(std::make_unique<AotiBackend>(config, std::move(loader), device, note));
  });
}

void RegisterAotiBackend(BackendRegistry* registry) {
  registry->Register("aotinductor", CreateAotiBackend);
}

bool AotiBackendBuiltIn() { return true; }

}  // namespace kiln
