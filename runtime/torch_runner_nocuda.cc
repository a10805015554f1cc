// The CUDA runner's stand-in for builds whose LibTorch has no CUDA (Debian's libtorch-dev).
#include "runtime/torch_runner.h"

namespace kiln {

absl::StatusOr<std::unique_ptr<TorchRunner>> MakeCudaRunner(ForwardFn, RunnerOptions options) {
  return absl::FailedPreconditionError(
      "device " + options.device.str() +
      ": this kiln-runtime was built against a LibTorch without CUDA (build with a CUDA "
      "LibTorch to serve on GPUs)");
}

bool CudaRunnerBuiltIn() { return false; }

}  // namespace kiln
