#pragma once

// The TorchScript backend. This header is LibTorch-free; torchscript_backend.cc is the only
// file in kiln that includes LibTorch, and it includes neither spdlog nor fmt.

#include "runtime/backend.h"

namespace kiln {

absl::StatusOr<std::unique_ptr<Backend>> CreateTorchScriptBackend(const ModelConfig& config,
                                                                  const std::string& model_file,
                                                                  const BackendOptions& options);

// Registers the backend as "torchscript".
void RegisterTorchScriptBackend(BackendRegistry* registry);

// For a pre-started runtime: loads what LibTorch loads lazily and makes `device` ready ("cpu"
// or "cuda:N": its context is created) with a small computation. An error names --device.
absl::Status PrepareTorchDevice(const std::string& device);

// Whether this build's LibTorch can reach a CUDA device, and how many (defined with the
// device set-up the LibTorch backends share, runtime/torch_model.cc).
int TorchCudaDeviceCount();

}  // namespace kiln
