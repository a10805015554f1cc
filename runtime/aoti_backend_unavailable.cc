// The AOTInductor backend's stand-in for builds whose LibTorch has no package loader.
#include "runtime/aoti_backend.h"

namespace kiln {

absl::StatusOr<std::unique_ptr<Backend>> CreateAotiBackend(const ModelConfig& config,
                                                           const std::string& model_file,
                                                           const BackendOptions&) {
  return absl::FailedPreconditionError(
      "backend: aotinductor: this kiln-runtime was built against a LibTorch without the "
      "AOTInductor package loader (PyTorch 2.6 or newer has it), so " + model_file +
      " cannot be served; build kiln with such a LibTorch or export the model to TorchScript");
}

void RegisterAotiBackend(BackendRegistry* registry) {
  registry->Register("aotinductor", CreateAotiBackend);
}

bool AotiBackendBuiltIn() { return false; }

}  // namespace kiln
