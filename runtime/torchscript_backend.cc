#include "runtime/torchscript_backend.h"

#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/cuda.h>
#include <torch/script.h>

#include <chrono>
#include <cstring>

#include "runtime/torch_model.h"

namespace kiln {

namespace {

// Keeps LayerNorm and Softmax numerically safe in a reduced-precision graph: their inputs
// (and LayerNorm's weight and bias) are cast up to fp32 and the result cast back.
void UpcastSensitiveOps(torch::jit::Block* block, at::ScalarType reduced, int* rewritten) {
  using torch::jit::Value;
  static const auto kLayerNorm = c10::Symbol::fromQualString("aten::layer_norm");
  static const auto kSoftmax = c10::Symbol::fromQualString("aten::softmax");
  static const auto kTo = c10::Symbol::fromQualString("aten::to");
  auto* graph = block->owningGraph();
  for (auto it = block->nodes().begin(); it != block->nodes().end(); ++it) {
    torch::jit::Node* node = *it;
    for (auto* sub : node->blocks()) UpcastSensitiveOps(sub, reduced, rewritten);
    bool ln = node->kind() == kLayerNorm;
    bool sm = node->kind() == kSoftmax && node->inputs().size() == 3;
    if (!ln && !sm) continue;
    torch::jit::WithInsertPoint guard(node);
    auto cast = [&](Value* v, at::ScalarType to) -> Value* {
      return graph->insert(kTo, {v, static_cast<int64_t>(to), false, false});
    };
    std::vector<size_t> tensor_inputs = ln ? std::vector<size_t>{0, 2, 3} : std::vector<size_t>{0};
    for (size_t i : tensor_inputs) {
      Value* v = node->input(i);
      if (v->type()->kind() == c10::TypeKind::NoneType) continue;
      if (v->type()->cast<c10::OptionalType>() && v->node()->kind() == c10::prim::Constant &&
          v->node()->output()->type()->kind() == c10::TypeKind::NoneType) {
        continue;
      }
      node->replaceInput(i, cast(v, at::kFloat));
    }
    Value* out = node->output();
    torch::jit::WithInsertPoint after(node->next());
    Value* back = cast(out, reduced);
    out->replaceAllUsesAfterNodeWith(back->node(), back);
    ++*rewritten;
  }
}

class TorchScriptBackend : public TorchModelBackend {
 public:
  TorchScriptBackend(const ModelConfig& config, torch::jit::Module module, TorchDevice device,
                     std::string note)
      : TorchModelBackend(config, device, "torchscript", std::move(note)),
        module_(std::move(module)) {}
  ~TorchScriptBackend() override { StopRunner(); }

  absl::Status Start() {
    return StartRunner([this](const std::vector<at::Tensor>& inputs) {
      std::vector<c10::IValue> args(inputs.begin(), inputs.end());
      return UnpackOutputs(config_, module_.forward(std::move(args)));
    });
  }

 private:
  torch::jit::Module module_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateTorchScriptBackend(const ModelConfig& config,
                                                                  const std::string& model_file,
                                                                  const BackendOptions& options) {
  return LoadTorchBackend(config, model_file, options, [&](const TorchDevice& set_up) -> BackendOr {
    const torch::Device device = set_up.device;
    const at::ScalarType compute = set_up.compute_type;
    auto t_load = std::chrono::steady_clock::now();
    auto loaded = CatchTorch<torch::jit::Module>(
        model_file + ": not a loadable TorchScript model",
        [&]() { return torch::jit::load(model_file, device); });
    if (!loaded.ok()) return loaded.status();
    torch::jit::Module module = std::move(*loaded);
    auto forward = module.find_method("forward");
    if (!forward) return absl::InvalidArgumentError(model_file + ": the module has no forward()");
    const auto& schema = forward->function().getSchema();
    size_t required = 0;
    size_t total = schema.arguments().size() - 1;  // minus self
    for (size_t i = 1; i < schema.arguments().size(); ++i) {
      if (!schema.arguments()[i].default_value()) required++;
    }
    if (config.inputs.size() < required || config.inputs.size() > total) {
      return absl::InvalidArgumentError(
          "input: the config lists " + std::to_string(config.inputs.size()) +
          " inputs but the model's forward() takes " + std::to_string(required) +
          (required == total ? "" : ".." + std::to_string(total)));
    }
    module.eval();
    std::string note;
    double load_ms = MillisSince(t_load);
    auto t_freeze = std::chrono::steady_clock::now();
    const bool reduced_cpu = compute != at::kFloat && device.is_cpu();
    if (compute != at::kFloat) module.to(compute);
    if (reduced_cpu || (device.is_cuda() && config.instance.freeze)) {
      // Freezing inlines the graph (so LayerNorm and Softmax can be found) and folds the
      // weights in.
      module = torch::jit::freeze(module);
    }
    if (compute != at::kFloat) {
      if (device.is_cpu()) {
        int rewritten = 0;
        auto graph = module.get_method("forward").graph();
        UpcastSensitiveOps(graph->block(), compute, &rewritten);
        note = std::to_string(rewritten) + " layer_norm/softmax ops kept in fp32";
      } else {
        // CUDA's LayerNorm, Softmax and fused attention kernels read half inputs but
        // accumulate in fp32 already; explicit casts would only add kernels.
        note = "layer_norm/softmax accumulate in fp32 in their CUDA kernels";
      }
    }
    double freeze_ms = MillisSince(t_freeze);
    if (!config.instance.jit_optimize) {
      // Process-wide, after freezing (which needs the optimiser); one model per process.
      torch::jit::setGraphExecutorOptimize(false);
    }
    char timing[160];
    std::snprintf(timing, sizeof(timing), "deserialise %.1f ms, freeze %.1f ms%s", load_ms,
                  freeze_ms, config.instance.jit_optimize ? "" : ", jit optimiser off");
    if (device.is_cuda() && !config.instance.freeze) {
      std::snprintf(timing, sizeof(timing), "deserialise %.1f ms, not frozen%s", load_ms,
                    config.instance.jit_optimize ? "" : ", jit optimiser off");
    }
    note += std::string(note.empty() ? "" : "; ") + timing;
    return Started(std::make_unique<TorchScriptBackend>(config, std::move(module), set_up, note));
  });
}

void RegisterTorchScriptBackend(BackendRegistry* registry) {
  registry->Register("torchscript", CreateTorchScriptBackend);
}

}  // namespace kiln

namespace kiln {

absl::Status PrepareTorchDevice(const std::string& device) {
  try {
    torch::Device d(device.empty() ? std::string("cpu") : device);
    if (d.is_cuda() && !torch::cuda::is_available()) {
      return absl::FailedPreconditionError("--device: " + device +
                                           " asked for, but this LibTorch has no CUDA device");
    }
    torch::NoGradGuard no_grad;
    torch::Tensor t = torch::ones({16, 16}, torch::TensorOptions().device(d));
    (void)torch::matmul(t, t).sum().item<float>();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return absl::FailedPreconditionError("--device: cannot prepare " + device + ": " + e.what());
  }
}

}  // namespace kiln
