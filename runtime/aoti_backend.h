#pragma once

// The AOTInductor backend: serves a model.pt2 package (torch.export + AOTInductor). This
// header is LibTorch-free. Two implementations, chosen by target: aoti_backend.cc where
// LibTorch ships the package loader (PyTorch 2.6 and newer), aoti_backend_unavailable.cc
// elsewhere (Debian's 1.13), whose factory says the backend is not built in.

#include "runtime/backend.h"

namespace kiln {

absl::StatusOr<std::unique_ptr<Backend>> CreateAotiBackend(const ModelConfig& config,
                                                           const std::string& model_file,
                                                           const BackendOptions& options);

// Registers the backend as "aotinductor" (in every build; where it is not built in, loading a
// model with it fails with FAILED_PRECONDITION naming the reason).
void RegisterAotiBackend(BackendRegistry* registry);

bool AotiBackendBuiltIn();

}  // namespace kiln
