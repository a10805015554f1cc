#include "runtime/torchscript_backend.h"

#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/script.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "runtime/torch_runner.h"

namespace kiln {

namespace {

// The first line of a LibTorch error, plus its last non-empty line when they differ (the
// interpreter's "operation failed" header names no cause; the last line does).
std::string FirstLine(const std::string& s) {
  size_t nl = s.find('\n');
  std::string first = nl == std::string::npos ? s : s.substr(0, nl);
  size_t end = s.find_last_not_of(" \n\t");
  if (end == std::string::npos || nl == std::string::npos || end < nl) return first;
  size_t begin = s.rfind('\n', end);
  std::string last = s.substr(begin + 1, end - begin);
  return last == first ? first : first + " ... " + last;
}

absl::StatusOr<at::ScalarType> ToTorchType(DataType t, const std::string& field) {
  switch (t) {
    case DataType::kBool:
      return at::kBool;
    case DataType::kUint8:
      return at::kByte;
    case DataType::kInt8:
      return at::kChar;
    case DataType::kInt16:
      return at::kShort;
    case DataType::kInt32:
      return at::kInt;
    case DataType::kInt64:
      return at::kLong;
    case DataType::kFp16:
      return at::kHalf;
    case DataType::kBf16:
      return at::kBFloat16;
    case DataType::kFp32:
      return at::kFloat;
    case DataType::kFp64:
      return at::kDouble;
    default:
      return absl::InvalidArgumentError(field + ": datatype " + std::string(DataTypeName(t)) +
                                        " is not supported by the torchscript backend");
  }
}

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

// The model's return value -> output tensors in config order and config datatypes, still on
// the model's device.
absl::StatusOr<std::vector<at::Tensor>> UnpackOutputs(const ModelConfig& config,
                                                      const c10::IValue& result) {
  std::vector<at::Tensor> outs;
  const size_t n = config.outputs.size();
  auto shape_error = [n](const std::string& got) {
    return absl::InternalError("the model returned " + got + " but the config lists " +
                               std::to_string(n) + " outputs");
  };
  if (result.isTensor()) {
    if (n != 1) return shape_error("a single tensor");
    outs.push_back(result.toTensor());
  } else if (result.isTuple() || result.isTensorList() || result.isList()) {
    std::vector<c10::IValue> elems;
    if (result.isTuple()) {
      for (const auto& e : result.toTupleRef().elements()) elems.push_back(e);
    } else {
      for (const auto& e : result.toListRef()) elems.push_back(e);
    }
    if (elems.size() != n) return shape_error(std::to_string(elems.size()) + " values");
    for (size_t i = 0; i < n; ++i) {
      if (!elems[i].isTensor()) {
        return absl::InternalError("the model's output " + std::to_string(i) +
                                   " is not a tensor");
      }
      outs.push_back(elems[i].toTensor());
    }
  } else if (result.isGenericDict()) {
    auto dict = result.toGenericDict();
    for (const auto& spec : config.outputs) {
      auto it = dict.find(c10::IValue(spec.name));
      if (it == dict.end() || !it->value().isTensor()) {
        return absl::InternalError("the model's output dict has no tensor '" + spec.name + "'");
      }
      outs.push_back(it->value().toTensor());
    }
  } else {
    return absl::InternalError("the model returned " + result.tagKind() +
                               "; expected a tensor, a tuple or a dict keyed by output name");
  }
  for (size_t i = 0; i < n; ++i) {
    const TensorSpec& spec = config.outputs[i];
    auto want = ToTorchType(spec.dtype, "output '" + spec.name + "'");
    if (!want.ok()) return want.status();
    at::Tensor& y = outs[i];
    if (y.scalar_type() != *want) {
      if (IsFloatingType(y.scalar_type()) && IsFloatingType(*want)) {
        y = y.to(*want);
      } else {
        return absl::InternalError("output '" + spec.name + "': the model returned " +
                                   std::string(c10::toString(y.scalar_type())) +
                                   " but the config says " + DataTypeName(spec.dtype));
      }
    }
    if (!y.is_contiguous()) y = y.contiguous();
  }
  return outs;
}

class TorchScriptBackend : public Backend {
 public:
  TorchScriptBackend(const ModelConfig& config, torch::jit::Module module, torch::Device device,
                     at::ScalarType compute_type, std::string precision_note,
                     double context_ms)
      : config_(config),
        module_(std::move(module)),
        device_(device),
        compute_type_(compute_type),
        precision_note_(std::move(precision_note)),
        context_ms_(context_ms) {}

  // Picks the runner: the CUDA runner on a cuda device, the direct one on cpu.
  absl::Status Start() {
    RunnerOptions ro;
    ro.device = device_;
    ro.compute_type = compute_type_;
    for (const auto& spec : config_.inputs) {
      RunnerInput in;
      auto st = ToTorchType(spec.dtype, "input '" + spec.name + "'");
      if (!st.ok()) return st.status();
      in.dtype = *st;
      in.dims = spec.dims;
      in.fill = 1.0;
      if (config_.sequence_buckets) {
        // Capture with real tokens (the pad id) but an all-ones mask, so no row is all padding.
        auto it = config_.sequence_buckets->pad.find(spec.name);
        if (it != config_.sequence_buckets->pad.end() && it->second != 0) in.fill = it->second;
      }
      ro.inputs.push_back(std::move(in));
    }
    ro.graph_warmup_iterations = config_.instance.cuda_graphs.warmup_iterations;
    UnpackFn unpack = [this](const c10::IValue& v) { return UnpackOutputs(config_, v); };
    if (device_.is_cuda()) {
      ro.graphs = PlanGraphs(config_);
      auto runner = MakeCudaRunner(&module_, unpack, std::move(ro));
      if (!runner.ok()) return runner.status();
      runner_ = std::move(*runner);
    } else {
      runner_ = MakeDirectRunner(&module_, unpack, std::move(ro));
    }
    return absl::OkStatus();
  }

  std::string device() const override { return device_.str(); }

  std::string Describe() const override {
    std::string d = "torchscript on " + device_.str() + ", " +
                    PrecisionName(config_.instance.precision);
    if (!precision_note_.empty()) d += " (" + precision_note_ + ")";
    if (device_.is_cpu()) {
      d += ", " + std::to_string(at::get_num_threads()) + " intra-op threads";
    } else {
      char ctx[64];
      std::snprintf(ctx, sizeof(ctx), "%.1f", context_ms_);
      d += ", cuda context " + std::string(ctx) + " ms, " + runner_->Describe();
    }
    if (config_.sequence_buckets) {
      d += ", " + std::to_string(config_.sequence_buckets->lengths.size()) +
           " sequence buckets up to " + std::to_string(config_.sequence_buckets->lengths.back());
    }
    return d;
  }

  absl::StatusOr<std::string> Prepare(const std::function<bool()>& cancelled) override {
    try {
      c10::InferenceMode guard;
      return runner_->Prepare(cancelled);
    } catch (const c10::Error& e) {
      return absl::InternalError("device preparation failed: " +
                                 FirstLine(e.what_without_backtrace()));
    } catch (const std::exception& e) {
      return absl::InternalError(std::string("device preparation failed: ") +
                                 FirstLine(e.what()));
    }
  }

  int64_t DeviceMemoryBytes() const override { return runner_->DeviceMemoryBytes(); }

  absl::StatusOr<std::vector<Tensor>> Execute(std::vector<Tensor> inputs) override {
    try {
      c10::InferenceMode guard;
      std::vector<at::Tensor> args;
      args.reserve(inputs.size());
      for (size_t i = 0; i < inputs.size(); ++i) {
        Tensor& t = inputs[i];
        auto st = ToTorchType(t.dtype, "input '" + t.name + "'");
        if (!st.ok()) return st.status();
        // from_blob borrows the request's bytes; they outlive Run(), and outputs are copied
        // out below, so a model that returns a view of its input stays safe.
        args.push_back(torch::from_blob(t.data.data(), t.shape, torch::TensorOptions().dtype(*st)));
      }
      std::lock_guard<std::mutex> lock(mu_);
      auto outs = runner_->Run(args);
      if (!outs.ok()) return outs.status();
      const size_t n = config_.outputs.size();
      std::vector<Tensor> out(n);
      for (size_t i = 0; i < n && i < outs->size(); ++i) {
        const TensorSpec& spec = config_.outputs[i];
        const at::Tensor& y = (*outs)[i];
        Tensor& o = out[i];
        o.name = spec.name;
        o.dtype = spec.dtype;
        o.shape.assign(y.sizes().begin(), y.sizes().end());
        o.data.assign(static_cast<const char*>(y.data_ptr()), y.nbytes());
      }
      return out;
    } catch (const c10::Error& e) {
      return absl::InternalError("model execution failed: " +
                                 FirstLine(e.what_without_backtrace()));
    } catch (const std::exception& e) {
      return absl::InternalError(std::string("model execution failed: ") + FirstLine(e.what()));
    }
  }

 private:
  const ModelConfig config_;
  torch::jit::Module module_;
  torch::Device device_;
  at::ScalarType compute_type_;
  std::string precision_note_;
  double context_ms_;
  std::mutex mu_;  // one Run() at a time: its returned tensors are reused buffers
  std::unique_ptr<TorchRunner> runner_;
};

double MillisSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int TorchCudaDeviceCount() {
  try {
    return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

absl::StatusOr<std::unique_ptr<Backend>> CreateTorchScriptBackend(const ModelConfig& config,
                                                                  const std::string& model_file,
                                                                  const BackendOptions& options) {
  for (const auto& spec : config.inputs) {
    auto st = ToTorchType(spec.dtype, "input '" + spec.name + "'");
    if (!st.ok()) return st.status();
  }
  for (const auto& spec : config.outputs) {
    auto st = ToTorchType(spec.dtype, "output '" + spec.name + "'");
    if (!st.ok()) return st.status();
  }
  std::string dev = options.device.empty() ? config.instance.device : options.device;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(model_file, ec)) {
    return absl::NotFoundError(model_file + ": model file is missing");
  }
  {
    std::ifstream probe(model_file, std::ios::binary);
    if (!probe) return absl::PermissionDeniedError(model_file + ": cannot be read");
  }
  try {
    torch::Device device(dev);
    if (device.is_cuda() && !CudaRunnerBuiltIn()) {
      return absl::FailedPreconditionError(
          "device " + dev + ": this kiln-runtime was built against a LibTorch without CUDA");
    }
    if (device.is_cuda()) {
      int count = TorchCudaDeviceCount();
      if (count == 0) {
        return absl::FailedPreconditionError("device " + dev +
                                             ": this LibTorch build has no usable CUDA device");
      }
      if (device.index() >= count) {
        return absl::FailedPreconditionError("device " + dev + ": only " + std::to_string(count) +
                                             " CUDA device(s) present");
      }
    }
    at::ScalarType compute = at::kFloat;
    if (config.instance.precision == Precision::kFp16) {
      if (device.is_cpu()) {
        return absl::InvalidArgumentError(
            "instance.precision: fp16 needs a CUDA device (use bf16 or fp32 on cpu)");
      }
      compute = at::kHalf;
    } else if (config.instance.precision == Precision::kBf16) {
      compute = at::kBFloat16;
    }
    int64_t threads = options.threads > 0 ? options.threads : config.instance.threads;
    if (threads > 0) at::set_num_threads(static_cast<int>(threads));

    double context_ms = 0;
    if (device.is_cuda()) {
      // Creates the CUDA context before the load, so the log tells the two apart.
      auto t0 = std::chrono::steady_clock::now();
      at::empty({1}, at::TensorOptions().device(device)).zero_();
      torch::cuda::synchronize(device.index());
      context_ms = MillisSince(t0);
    }
    torch::jit::Module module;
    auto t_load = std::chrono::steady_clock::now();
    try {
      module = torch::jit::load(model_file, device);
    } catch (const c10::Error& e) {
      return absl::InvalidArgumentError(model_file + ": not a loadable TorchScript model: " +
                                        FirstLine(e.what_without_backtrace()));
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(model_file + ": not a loadable TorchScript model: " +
                                        FirstLine(e.what()));
    }
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
    auto backend = std::make_unique<TorchScriptBackend>(config, std::move(module), device,
                                                        compute, note, context_ms);
    absl::Status started = backend->Start();
    if (!started.ok()) return started;
    return std::unique_ptr<Backend>(std::move(backend));
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(model_file + ": " + FirstLine(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(model_file + ": " + FirstLine(e.what()));
  }
}

void RegisterTorchScriptBackend(BackendRegistry* registry) {
  registry->Register("torchscript", CreateTorchScriptBackend);
}

}  // namespace kiln
