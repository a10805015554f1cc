#include "runtime/torchscript_backend.h"

#include <torch/csrc/jit/ir/ir.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/script.h>

#include <cstring>
#include <filesystem>
#include <fstream>

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

bool IsFloating(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
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

class TorchScriptBackend : public Backend {
 public:
  TorchScriptBackend(const ModelConfig& config, torch::jit::Module module, torch::Device device,
                     at::ScalarType compute_type, int upcast_ops)
      : config_(config),
        module_(std::move(module)),
        device_(device),
        compute_type_(compute_type),
        upcast_ops_(upcast_ops) {}

  std::string device() const override { return device_.str(); }

  std::string Describe() const override {
    std::string d = "torchscript on " + device_.str() + ", " + PrecisionName(config_.instance.precision);
    if (compute_type_ != at::kFloat) {
      d += " (" + std::to_string(upcast_ops_) + " layer_norm/softmax ops kept in fp32)";
    }
    return d + ", " + std::to_string(at::get_num_threads()) + " intra-op threads";
  }

  absl::StatusOr<std::vector<Tensor>> Execute(std::vector<Tensor> inputs) override {
    try {
      c10::InferenceMode guard;
      std::vector<c10::IValue> args;
      args.reserve(inputs.size());
      for (size_t i = 0; i < inputs.size(); ++i) {
        Tensor& t = inputs[i];
        auto st = ToTorchType(t.dtype, "input '" + t.name + "'");
        if (!st.ok()) return st.status();
        at::Tensor x = torch::from_blob(t.data.data(), t.shape, torch::TensorOptions().dtype(*st));
        if (IsFloating(*st) && *st != compute_type_ && compute_type_ != at::kFloat) {
          x = x.to(compute_type_);
        }
        // from_blob borrows the request's bytes; they outlive forward(), and outputs are
        // copied out below, so a model that returns a view of its input stays safe.
        if (!device_.is_cpu()) x = x.to(device_, /*non_blocking=*/false);
        args.emplace_back(std::move(x));
      }
      c10::IValue result = module_.forward(std::move(args));
      std::vector<at::Tensor> outs;
      const size_t n = config_.outputs.size();
      if (result.isTensor()) {
        if (n != 1) return ShapeError("a single tensor", n);
        outs.push_back(result.toTensor());
      } else if (result.isTuple() || result.isTensorList() || result.isList()) {
        std::vector<c10::IValue> elems;
        if (result.isTuple()) {
          for (const auto& e : result.toTupleRef().elements()) elems.push_back(e);
        } else {
          for (const auto& e : result.toListRef()) elems.push_back(e);
        }
        if (elems.size() != n) return ShapeError(std::to_string(elems.size()) + " values", n);
        for (size_t i = 0; i < n; ++i) {
          if (!elems[i].isTensor()) {
            return absl::InternalError("the model's output " + std::to_string(i) +
                                       " is not a tensor");
          }
          outs.push_back(elems[i].toTensor());
        }
      } else if (result.isGenericDict()) {
        auto dict = result.toGenericDict();
        for (const auto& spec : config_.outputs) {
          auto it = dict.find(c10::IValue(spec.name));
          if (it == dict.end() || !it->value().isTensor()) {
            return absl::InternalError("the model's output dict has no tensor '" + spec.name +
                                       "'");
          }
          outs.push_back(it->value().toTensor());
        }
      } else {
        return absl::InternalError("the model returned " + result.tagKind() +
                                   "; expected a tensor, a tuple or a dict keyed by output name");
      }
      std::vector<Tensor> out(n);
      for (size_t i = 0; i < n; ++i) {
        const TensorSpec& spec = config_.outputs[i];
        auto want = ToTorchType(spec.dtype, "output '" + spec.name + "'");
        if (!want.ok()) return want.status();
        at::Tensor y = outs[i];
        if (y.scalar_type() != *want) {
          if (IsFloating(y.scalar_type()) && IsFloating(*want)) {
            y = y.to(*want);
          } else {
            return absl::InternalError("output '" + spec.name + "': the model returned " +
                                       std::string(c10::toString(y.scalar_type())) +
                                       " but the config says " + DataTypeName(spec.dtype));
          }
        }
        y = y.to(torch::kCPU).contiguous();
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
  absl::Status ShapeError(const std::string& got, size_t want) {
    return absl::InternalError("the model returned " + got + " but the config lists " +
                               std::to_string(want) + " outputs");
  }

  const ModelConfig config_;
  torch::jit::Module module_;
  torch::Device device_;
  at::ScalarType compute_type_;
  int upcast_ops_;
};

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

    torch::jit::Module module;
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
    int rewritten = 0;
    if (compute != at::kFloat) {
      // Weights and floating inputs go to the reduced type; freezing inlines the graph so
      // LayerNorm and Softmax can be found and kept in fp32.
      module.to(compute);
      module = torch::jit::freeze(module);
      auto graph = module.get_method("forward").graph();
      UpcastSensitiveOps(graph->block(), compute, &rewritten);
    }
    return std::unique_ptr<Backend>(
        new TorchScriptBackend(config, std::move(module), device, compute, rewritten));
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
