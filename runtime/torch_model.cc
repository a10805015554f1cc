#include "runtime/torch_model.h"

#include "runtime/torchscript_backend.h"

#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

namespace kiln {

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

double MillisSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
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
                                        " is not supported by LibTorch");
  }
}

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

int TorchCudaDeviceCount() {
  try {
    return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

absl::Status CheckReadable(const std::string& model_file) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(model_file, ec)) {
    return absl::NotFoundError(model_file + ": model file is missing");
  }
  std::ifstream probe(model_file, std::ios::binary);
  if (!probe) return absl::PermissionDeniedError(model_file + ": cannot be read");
  return absl::OkStatus();
}

absl::StatusOr<TorchDevice> SetUpTorchDevice(const ModelConfig& config,
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
  TorchDevice out;
  try {
    out.device = torch::Device(dev);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError("device '" + dev + "': " + FirstLine(e.what()));
  }
  if (out.device.is_cuda() && !CudaRunnerBuiltIn()) {
    return absl::FailedPreconditionError(
        "device " + dev + ": this kiln-runtime was built against a LibTorch without CUDA");
  }
  if (out.device.is_cuda()) {
    int count = TorchCudaDeviceCount();
    if (count == 0) {
      return absl::FailedPreconditionError("device " + dev +
                                           ": this LibTorch build has no usable CUDA device");
    }
    if (out.device.index() >= count) {
      return absl::FailedPreconditionError("device " + dev + ": only " + std::to_string(count) +
                                           " CUDA device(s) present");
    }
  }
  if (config.instance.precision == Precision::kFp16) {
    if (out.device.is_cpu()) {
      return absl::InvalidArgumentError(
          "instance.precision: fp16 needs a CUDA device (use bf16 or fp32 on cpu)");
    }
    out.compute_type = at::kHalf;
  } else if (config.instance.precision == Precision::kBf16) {
    out.compute_type = at::kBFloat16;
  }
  int64_t threads = options.threads > 0 ? options.threads : config.instance.threads;
  if (threads > 0) at::set_num_threads(static_cast<int>(threads));
  out.intra_op_threads = at::get_num_threads();
  if (out.device.is_cuda()) {
    // Creates the CUDA context before the load, so the log tells the two apart.
    auto t0 = std::chrono::steady_clock::now();
    at::empty({1}, at::TensorOptions().device(out.device)).zero_();
    torch::cuda::synchronize(out.device.index());
    out.context_ms = MillisSince(t0);
  }
  return out;
}

absl::StatusOr<RunnerOptions> MakeRunnerOptions(const ModelConfig& config,
                                                const TorchDevice& device) {
  RunnerOptions ro;
  ro.device = device.device;
  ro.compute_type = device.compute_type;
  for (const auto& spec : config.inputs) {
    RunnerInput in;
    auto st = ToTorchType(spec.dtype, "input '" + spec.name + "'");
    if (!st.ok()) return st.status();
    in.dtype = *st;
    in.dims = spec.dims;
    in.fill = 1.0;
    if (config.sequence_buckets) {
      // Capture with real tokens (the pad id) but an all-ones mask, so no row is all padding.
      auto it = config.sequence_buckets->pad.find(spec.name);
      if (it != config.sequence_buckets->pad.end() && it->second != 0) in.fill = it->second;
    }
    ro.inputs.push_back(std::move(in));
  }
  ro.graph_warmup_iterations = config.instance.cuda_graphs.warmup_iterations;
  ro.attention = config.instance.attention;
  if (device.device.is_cuda()) ro.graphs = PlanGraphs(config);
  return ro;
}

absl::Status TorchModelBackend::StartRunner(ForwardFn forward) {
  auto ro = MakeRunnerOptions(config_, device_);
  if (!ro.ok()) return ro.status();
  if (device_.device.is_cuda()) {
    auto runner = MakeCudaRunner(std::move(forward), std::move(*ro));
    if (!runner.ok()) return runner.status();
    runner_ = std::move(*runner);
  } else {
    runner_ = MakeDirectRunner(std::move(forward), std::move(*ro));
  }
  return absl::OkStatus();
}

std::string TorchModelBackend::Describe() const {
  std::string d = what_ + " on " + device_.device.str() + ", " +
                  PrecisionName(config_.instance.precision);
  if (!note_.empty()) d += " (" + note_ + ")";
  if (device_.device.is_cpu()) {
    d += ", " + std::to_string(at::get_num_threads()) + " intra-op threads";
  } else {
    char ctx[64];
    std::snprintf(ctx, sizeof(ctx), "%.1f", device_.context_ms);
    d += ", cuda context " + std::string(ctx) + " ms, " + runner_->Describe();
  }
  if (config_.sequence_buckets) {
    d += ", " + std::to_string(config_.sequence_buckets->lengths.size()) +
         " sequence buckets up to " + std::to_string(config_.sequence_buckets->lengths.back());
  }
  return d;
}

absl::StatusOr<std::string> TorchModelBackend::Prepare(const std::function<bool()>& cancelled) {
  try {
    c10::InferenceMode guard;
    return runner_->Prepare(cancelled);
  } catch (const c10::Error& e) {
    return absl::InternalError("device preparation failed: " +
                               FirstLine(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(std::string("device preparation failed: ") + FirstLine(e.what()));
  }
}

absl::StatusOr<std::vector<Tensor>> TorchModelBackend::Execute(std::vector<Tensor> inputs) {
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

}  // namespace kiln
