#include "runtime/model_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "common/config_node.h"
#include "common/status.h"
#include "runtime/tensor.h"

namespace kiln {

namespace fs = std::filesystem;

const char* PrecisionName(Precision p) {
  switch (p) {
    case Precision::kFp16:
      return "fp16";
    case Precision::kBf16:
      return "bf16";
    default:
      return "fp32";
  }
}

int ModelConfig::InputIndex(const std::string& n) const {
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].name == n) return static_cast<int>(i);
  }
  return -1;
}

int ModelConfig::OutputIndex(const std::string& n) const {
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].name == n) return static_cast<int>(i);
  }
  return -1;
}

namespace {

absl::StatusOr<std::vector<TensorSpec>> ParseTensorList(const ConfigNode& root,
                                                        const std::string& key) {
  KILN_ASSIGN_OR_RETURN(ConfigNode list, root.Child(key));
  KILN_ASSIGN_OR_RETURN(auto items, list.Items());
  std::vector<TensorSpec> out;
  for (const auto& item : items) {
    KILN_RETURN_IF_ERROR(item.CheckKeys({"name", "datatype", "data_type", "dims"}));
    TensorSpec spec;
    KILN_ASSIGN_OR_RETURN(ConfigNode name, item.Child("name"));
    KILN_ASSIGN_OR_RETURN(spec.name, name.AsString());
    std::string dt_key = item.Has("data_type") ? "data_type" : "datatype";
    KILN_ASSIGN_OR_RETURN(ConfigNode dt, item.Child(dt_key));
    KILN_ASSIGN_OR_RETURN(std::string dt_name, dt.AsString());
    KILN_ASSIGN_OR_RETURN(spec.dtype, ParseDataType(dt_name, dt.path()));
    KILN_ASSIGN_OR_RETURN(ConfigNode dims, item.Child("dims"));
    KILN_ASSIGN_OR_RETURN(spec.dims, dims.AsIntList());
    out.push_back(std::move(spec));
  }
  return out;
}

absl::StatusOr<DynamicBatchingConfig> ParseDynamicBatching(const ConfigNode& node) {
  DynamicBatchingConfig db;
  if (node.IsNull()) return db;
  KILN_RETURN_IF_ERROR(node.CheckKeys({"preferred_batch_size", "max_queue_delay_microseconds",
                                       "priority_levels", "default_priority_level",
                                       "max_queue_size", "default_timeout_microseconds"}));
  KILN_ASSIGN_OR_RETURN(db.preferred_batch_size, node.GetIntList("preferred_batch_size"));
  KILN_ASSIGN_OR_RETURN(db.max_queue_delay_microseconds,
                        node.GetInt("max_queue_delay_microseconds", 0));
  KILN_ASSIGN_OR_RETURN(db.priority_levels, node.GetInt("priority_levels", 1));
  KILN_ASSIGN_OR_RETURN(db.default_priority_level, node.GetInt("default_priority_level", 1));
  KILN_ASSIGN_OR_RETURN(db.max_queue_size, node.GetInt("max_queue_size", 0));
  KILN_ASSIGN_OR_RETURN(db.default_timeout_microseconds,
                        node.GetInt("default_timeout_microseconds", 0));
  return db;
}

absl::StatusOr<std::vector<WarmupSample>> ParseWarmup(const ConfigNode& node) {
  KILN_ASSIGN_OR_RETURN(auto items, node.Items());
  std::vector<WarmupSample> out;
  for (const auto& item : items) {
    KILN_RETURN_IF_ERROR(item.CheckKeys({"name", "batch_size", "iterations", "inputs", "data"}));
    WarmupSample w;
    KILN_ASSIGN_OR_RETURN(w.name, item.GetString("name", item.path()));
    KILN_ASSIGN_OR_RETURN(w.batch_size, item.GetInt("batch_size", 1));
    KILN_ASSIGN_OR_RETURN(w.iterations, item.GetInt("iterations", 1));
    KILN_ASSIGN_OR_RETURN(std::string data, item.GetString("data", "zero"));
    if (data != "zero" && data != "one") {
      return absl::InvalidArgumentError(item.path() + ".data: must be zero or one, got '" + data +
                                        "'");
    }
    w.ones = data == "one";
    if (auto inputs = item.OptionalChild("inputs")) {
      KILN_ASSIGN_OR_RETURN(auto entries, inputs->Entries());
      for (const auto& [name, spec] : entries) {
        KILN_RETURN_IF_ERROR(spec.CheckKeys({"dims"}));
        KILN_ASSIGN_OR_RETURN(ConfigNode dims, spec.Child("dims"));
        KILN_ASSIGN_OR_RETURN(w.dims[name], dims.AsIntList());
      }
    }
    out.push_back(std::move(w));
  }
  return out;
}

absl::StatusOr<CudaGraphsConfig> ParseCudaGraphs(const ConfigNode& node,
                                                 int64_t max_batch_size) {
  CudaGraphsConfig g;
  g.enable = true;  // `cuda_graphs: {}` turns them on with defaults
  if (node.IsNull()) return g;
  KILN_RETURN_IF_ERROR(
      node.CheckKeys({"enable", "batch_sizes", "max_tokens", "warmup_iterations"}));
  KILN_ASSIGN_OR_RETURN(g.enable, node.GetBool("enable", true));
  if (node.Has("batch_sizes")) {
    KILN_ASSIGN_OR_RETURN(g.batch_sizes, node.GetIntList("batch_sizes"));
  }
  KILN_ASSIGN_OR_RETURN(g.max_tokens, node.GetInt("max_tokens", 0));
  KILN_ASSIGN_OR_RETURN(g.warmup_iterations, node.GetInt("warmup_iterations", 3));
  return g;
}

absl::StatusOr<std::vector<std::string>> ParseAttention(const ConfigNode& node) {
  if (!node.IsSequence()) {
    return node.Error("must be a list of attention kernels (cudnn, flash, efficient, math)");
  }
  KILN_ASSIGN_OR_RETURN(auto items, node.Items());
  if (items.empty()) {
    return node.Error("must name at least one kernel (leave it out for LibTorch's default)");
  }
  std::vector<std::string> out;
  for (const ConfigNode& item : items) {
    KILN_ASSIGN_OR_RETURN(std::string name, item.AsString());
    bool known = false;
    for (const char* k : kAttentionKernels) known = known || name == k;
    if (!known) {
      return item.Error("unknown attention kernel '" + name +
                        "' (expected cudnn, flash, efficient or math)");
    }
    if (std::find(out.begin(), out.end(), name) != out.end()) {
      return item.Error("'" + name + "' is listed twice");
    }
    out.push_back(std::move(name));
  }
  return out;
}

absl::StatusOr<SequenceBucketsConfig> ParseSequenceBuckets(const ConfigNode& node) {
  SequenceBucketsConfig sb;
  KILN_RETURN_IF_ERROR(node.CheckKeys({"lengths", "pad"}));
  KILN_ASSIGN_OR_RETURN(sb.lengths, node.GetIntList("lengths"));
  KILN_ASSIGN_OR_RETURN(ConfigNode pad, node.Child("pad"));
  KILN_ASSIGN_OR_RETURN(auto entries, pad.Entries());
  for (const auto& [name, value] : entries) {
    KILN_ASSIGN_OR_RETURN(sb.pad[name], value.AsDouble());
  }
  return sb;
}

absl::Status ValidateTensorList(const std::vector<TensorSpec>& list, const std::string& key,
                                int64_t max_batch_size) {
  if (list.empty()) return absl::InvalidArgumentError(key + ": must list at least one tensor");
  std::set<std::string> seen;
  for (size_t i = 0; i < list.size(); ++i) {
    std::string path = key + "[" + std::to_string(i) + "]";
    const auto& t = list[i];
    if (t.name.empty()) return absl::InvalidArgumentError(path + ".name: must not be empty");
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(path + ".name: '" + t.name + "' is listed twice");
    }
    if (t.dims.empty() && max_batch_size == 0) {
      return absl::InvalidArgumentError(
          path + ".dims: must not be empty when max_batch_size is 0 (the model has no batch "
                 "dimension)");
    }
    for (int64_t d : t.dims) {
      if (d == 0 || d < -1) {
        return absl::InvalidArgumentError(path + ".dims: each dimension must be positive or -1 "
                                                 "(variable), got " +
                                          ShapeString(t.dims));
      }
    }
    // A tensor no request could carry (too many dimensions, or too many elements at its
    // smallest) fails the load, not every request after it.
    std::vector<int64_t> smallest;
    if (max_batch_size > 0) smallest.push_back(max_batch_size);
    for (int64_t d : t.dims) smallest.push_back(d == -1 ? 1 : d);
    KILN_RETURN_IF_ERROR(CheckTensorRank(
        smallest.size(), path + ".dims" + (max_batch_size > 0 ? " with the batch dimension" : "")));
    KILN_RETURN_IF_ERROR(ElementCount(smallest, path + ".dims (at max_batch_size)").status());
  }
  return absl::OkStatus();
}

absl::Status ValidateDevice(const std::string& device, const std::string& field) {
  if (device == "cpu") return absl::OkStatus();
  if (device.rfind("cuda:", 0) == 0 && device.size() > 5 && device.size() < 9 &&
      std::all_of(device.begin() + 5, device.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(field + ": must be cpu or cuda:N, got '" + device + "'");
}

bool HasVariableDim(const TensorSpec& t) {
  return std::find(t.dims.begin(), t.dims.end(), -1) != t.dims.end();
}

absl::Status ValidateBuckets(const ModelConfig& c) {
  if (c.sequence_buckets) {
    const auto& sb = *c.sequence_buckets;
    if (sb.lengths.empty()) {
      return absl::InvalidArgumentError("sequence_buckets.lengths: must list at least one length");
    }
    if (sb.lengths.size() > 64) {
      return absl::InvalidArgumentError("sequence_buckets.lengths: at most 64 buckets, got " +
                                        std::to_string(sb.lengths.size()));
    }
    for (size_t i = 0; i < sb.lengths.size(); ++i) {
      std::string path = "sequence_buckets.lengths[" + std::to_string(i) + "]";
      if (sb.lengths[i] < 1 || sb.lengths[i] > (1 << 24)) {
        return absl::InvalidArgumentError(path + ": must be in 1..16777216, got " +
                                          std::to_string(sb.lengths[i]));
      }
      if (i > 0 && sb.lengths[i] <= sb.lengths[i - 1]) {
        return absl::InvalidArgumentError(path + ": lengths must be strictly ascending, got " +
                                          ShapeString(sb.lengths));
      }
    }
    for (const auto& [name, value] : sb.pad) {
      int idx = c.InputIndex(name);
      if (idx < 0) {
        return absl::InvalidArgumentError("sequence_buckets.pad." + name + ": no such input");
      }
      const TensorSpec& in = c.inputs[idx];
      if (std::count(in.dims.begin(), in.dims.end(), -1) != 1) {
        return absl::InvalidArgumentError("sequence_buckets.pad." + name +
                                          ": the input must have exactly one variable (-1) "
                                          "dimension, its sequence axis; dims are " +
                                          ShapeString(in.dims));
      }
      if (!std::isfinite(value)) {
        return absl::InvalidArgumentError("sequence_buckets.pad." + name + ": must be finite");
      }
      double lo = 0, hi = 0;  // the datatype's integer range; lo == hi marks a float type
      switch (in.dtype) {
        case DataType::kBool: lo = 0, hi = 1; break;
        case DataType::kUint8: lo = 0, hi = 255; break;
        case DataType::kInt8: lo = -128, hi = 127; break;
        case DataType::kUint16: lo = 0, hi = 65535; break;
        case DataType::kInt16: lo = -32768, hi = 32767; break;
        case DataType::kUint32: lo = 0, hi = 4294967295.0; break;
        case DataType::kInt32: lo = -2147483648.0, hi = 2147483647.0; break;
        // 2^63 and 2^64 are exact doubles; the ranges end just below them.
        case DataType::kUint64: lo = 0, hi = 18446744073709549568.0; break;
        case DataType::kInt64: lo = -9223372036854775808.0, hi = 9223372036854774784.0; break;
        default: break;
      }
      if (lo != hi) {
        if (std::floor(value) != value) {
          return absl::InvalidArgumentError("sequence_buckets.pad." + name + ": " +
                                            DataTypeName(in.dtype) +
                                            " input needs an integer pad value");
        }
        if (value < lo || value > hi) {
          return absl::InvalidArgumentError(
              "sequence_buckets.pad." + name + ": " + std::to_string(value) + " is outside " +
              DataTypeName(in.dtype) + "'s range");
        }
      }
    }
    for (const auto& in : c.inputs) {
      if (HasVariableDim(in) && !sb.pad.count(in.name)) {
        return absl::InvalidArgumentError("sequence_buckets.pad." + in.name +
                                          ": required, the input has variable dims " +
                                          ShapeString(in.dims));
      }
    }
    if (sb.pad.empty()) {
      return absl::InvalidArgumentError(
          "sequence_buckets.pad: must name at least one input with a variable dimension");
    }
    for (size_t i = 0; i < c.outputs.size(); ++i) {
      if (std::count(c.outputs[i].dims.begin(), c.outputs[i].dims.end(), -1) > 1) {
        return absl::InvalidArgumentError(
            "output[" + std::to_string(i) + "].dims: with sequence_buckets an output may have at "
            "most one variable dimension (trimmed back to the request's length), got " +
            ShapeString(c.outputs[i].dims));
      }
    }
  }
  const CudaGraphsConfig& g = c.instance.cuda_graphs;
  if (g.enable) {
    if (c.max_batch_size == 0) {
      return absl::InvalidArgumentError(
          "instance.cuda_graphs: needs max_batch_size > 0 (graphs are captured per batch size)");
    }
    for (const auto& in : c.inputs) {
      if (HasVariableDim(in) && !c.sequence_buckets) {
        return absl::InvalidArgumentError(
            "instance.cuda_graphs: input '" + in.name + "' has variable dims " +
            ShapeString(in.dims) + "; graphs need fixed shapes, so configure sequence_buckets");
      }
    }
    for (size_t i = 0; i < g.batch_sizes.size(); ++i) {
      std::string path = "instance.cuda_graphs.batch_sizes[" + std::to_string(i) + "]";
      if (g.batch_sizes[i] < 1 || g.batch_sizes[i] > c.max_batch_size) {
        return absl::InvalidArgumentError(path + ": must be in 1.." +
                                          std::to_string(c.max_batch_size) +
                                          " (max_batch_size), got " +
                                          std::to_string(g.batch_sizes[i]));
      }
      if (i > 0 && g.batch_sizes[i] <= g.batch_sizes[i - 1]) {
        return absl::InvalidArgumentError(path + ": batch sizes must be strictly ascending, got " +
                                          ShapeString(g.batch_sizes));
      }
    }
    if (g.max_tokens < 0) {
      return absl::InvalidArgumentError(
          "instance.cuda_graphs.max_tokens: must be >= 0 (0 = no limit), got " +
          std::to_string(g.max_tokens));
    }
    if (g.warmup_iterations < 1 || g.warmup_iterations > 100) {
      return absl::InvalidArgumentError(
          "instance.cuda_graphs.warmup_iterations: must be in 1..100, got " +
          std::to_string(g.warmup_iterations));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string ModelFileFor(const std::string& backend) {
  return backend == "aotinductor" ? "model.pt2" : "model.pt";
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& yaml_text,
                                             const std::string& source) {
  KILN_ASSIGN_OR_RETURN(ConfigNode root, ConfigNode::Parse(yaml_text, source));
  auto in_source = [&](absl::Status s) { return Annotate(s, source); };
  absl::Status keys = root.CheckKeys({"name", "backend", "platform", "max_batch_size", "input",
                                      "output", "dynamic_batching", "response_cache", "instance",
                                      "sequence_buckets", "warmup"});
  if (!keys.ok()) return in_source(keys);

  ModelConfig c;
  auto parse = [&]() -> absl::Status {
    KILN_ASSIGN_OR_RETURN(ConfigNode name, root.Child("name"));
    KILN_ASSIGN_OR_RETURN(c.name, name.AsString());
    if (root.Has("backend")) {
      KILN_ASSIGN_OR_RETURN(c.backend, root.GetString("backend", ""));
    } else if (root.Has("platform")) {
      // Triton's name for a TorchScript model.
      KILN_ASSIGN_OR_RETURN(std::string platform, root.GetString("platform", ""));
      if (platform != "pytorch_libtorch") {
        return absl::InvalidArgumentError("platform: only pytorch_libtorch is supported, got '" +
                                          platform + "'");
      }
      c.backend = "torchscript";
    } else {
      return absl::InvalidArgumentError("backend: required field is missing");
    }
    KILN_ASSIGN_OR_RETURN(c.max_batch_size, root.GetInt("max_batch_size", 0));
    KILN_ASSIGN_OR_RETURN(c.inputs, ParseTensorList(root, "input"));
    KILN_ASSIGN_OR_RETURN(c.outputs, ParseTensorList(root, "output"));
    // `dynamic_batching: {}` (or the key alone) turns it on with defaults.
    if (auto db = root.SectionChild("dynamic_batching")) {
      KILN_ASSIGN_OR_RETURN(c.dynamic_batching, ParseDynamicBatching(*db));
    }
    if (auto rc = root.OptionalChild("response_cache")) {
      KILN_RETURN_IF_ERROR(rc->CheckKeys({"enable", "max_bytes"}));
      KILN_ASSIGN_OR_RETURN(c.response_cache.enable, rc->GetBool("enable", false));
      if (auto mb = rc->OptionalChild("max_bytes")) {
        KILN_ASSIGN_OR_RETURN(std::string text, mb->AsString());
        KILN_ASSIGN_OR_RETURN(c.response_cache.max_bytes, ParseByteSize(text, mb->path()));
      }
    }
    if (auto inst = root.OptionalChild("instance")) {
      KILN_RETURN_IF_ERROR(
          inst->CheckKeys({"device", "threads", "precision", "cuda_graphs", "jit_optimize",
                           "freeze", "attention"}));
      KILN_ASSIGN_OR_RETURN(c.instance.jit_optimize, inst->GetBool("jit_optimize", true));
      KILN_ASSIGN_OR_RETURN(c.instance.freeze, inst->GetBool("freeze", true));
      KILN_ASSIGN_OR_RETURN(c.instance.device, inst->GetString("device", "cpu"));
      KILN_ASSIGN_OR_RETURN(c.instance.threads, inst->GetInt("threads", 0));
      KILN_ASSIGN_OR_RETURN(std::string p, inst->GetString("precision", "fp32"));
      if (p == "fp32") {
        c.instance.precision = Precision::kFp32;
      } else if (p == "fp16") {
        c.instance.precision = Precision::kFp16;
      } else if (p == "bf16") {
        c.instance.precision = Precision::kBf16;
      } else {
        return absl::InvalidArgumentError("instance.precision: must be fp32, fp16 or bf16, got '" +
                                          p + "'");
      }
      if (auto a = inst->OptionalChild("attention")) {
        KILN_ASSIGN_OR_RETURN(c.instance.attention, ParseAttention(*a));
      }
      if (auto g = inst->SectionChild("cuda_graphs")) {
        KILN_ASSIGN_OR_RETURN(c.instance.cuda_graphs, ParseCudaGraphs(*g, c.max_batch_size));
      }
    }
    if (auto sb = root.OptionalChild("sequence_buckets")) {
      KILN_ASSIGN_OR_RETURN(c.sequence_buckets, ParseSequenceBuckets(*sb));
    }
    if (auto w = root.OptionalChild("warmup")) {
      KILN_ASSIGN_OR_RETURN(c.warmup, ParseWarmup(*w));
    }
    return ValidateModelConfig(c);
  };
  absl::Status s = parse();
  if (!s.ok()) return in_source(s);
  return c;
}

absl::Status ValidateModelConfig(const ModelConfig& c) {
  if (c.name.empty()) return absl::InvalidArgumentError("name: must not be empty");
  if (c.backend.empty()) return absl::InvalidArgumentError("backend: must not be empty");
  if (c.max_batch_size < 0) {
    return absl::InvalidArgumentError("max_batch_size: must be >= 0 (0 = no batch dimension), got " +
                                      std::to_string(c.max_batch_size));
  }
  if (c.max_batch_size > 1 << 20) {
    return absl::InvalidArgumentError("max_batch_size: must be <= 1048576, got " +
                                      std::to_string(c.max_batch_size));
  }
  KILN_RETURN_IF_ERROR(ValidateTensorList(c.inputs, "input", c.max_batch_size));
  KILN_RETURN_IF_ERROR(ValidateTensorList(c.outputs, "output", c.max_batch_size));
  if (c.dynamic_batching) {
    const auto& db = *c.dynamic_batching;
    if (c.max_batch_size == 0) {
      return absl::InvalidArgumentError(
          "dynamic_batching: needs max_batch_size > 0 (the model must have a batch dimension)");
    }
    for (size_t i = 0; i < db.preferred_batch_size.size(); ++i) {
      int64_t p = db.preferred_batch_size[i];
      if (p < 1 || p > c.max_batch_size) {
        return absl::InvalidArgumentError("dynamic_batching.preferred_batch_size[" +
                                          std::to_string(i) + "]: must be in 1.." +
                                          std::to_string(c.max_batch_size) +
                                          " (max_batch_size), got " + std::to_string(p));
      }
    }
    if (db.max_queue_delay_microseconds < 0 || db.max_queue_delay_microseconds > 60'000'000) {
      return absl::InvalidArgumentError(
          "dynamic_batching.max_queue_delay_microseconds: must be in 0..60000000, got " +
          std::to_string(db.max_queue_delay_microseconds));
    }
    if (db.priority_levels < 1 || db.priority_levels > 16) {
      return absl::InvalidArgumentError("dynamic_batching.priority_levels: must be in 1..16, got " +
                                        std::to_string(db.priority_levels));
    }
    if (db.default_priority_level < 1 || db.default_priority_level > db.priority_levels) {
      return absl::InvalidArgumentError(
          "dynamic_batching.default_priority_level: must be in 1.." +
          std::to_string(db.priority_levels) + " (priority_levels), got " +
          std::to_string(db.default_priority_level));
    }
    if (db.max_queue_size < 0) {
      return absl::InvalidArgumentError(
          "dynamic_batching.max_queue_size: must be >= 0 (0 = unbounded), got " +
          std::to_string(db.max_queue_size));
    }
    if (db.default_timeout_microseconds < 0) {
      return absl::InvalidArgumentError(
          "dynamic_batching.default_timeout_microseconds: must be >= 0, got " +
          std::to_string(db.default_timeout_microseconds));
    }
  }
  if (c.response_cache.max_bytes <= 0) {
    return absl::InvalidArgumentError("response_cache.max_bytes: must be > 0");
  }
  KILN_RETURN_IF_ERROR(ValidateDevice(c.instance.device, "instance.device"));
  if (!c.instance.attention.empty() && c.backend == "aotinductor") {
    return absl::InvalidArgumentError(
        "instance.attention: applies to TorchScript models only (an AOTInductor package's "
        "attention kernels are fixed when it is compiled)");
  }
  if (c.instance.threads < 0 || c.instance.threads > 1024) {
    return absl::InvalidArgumentError("instance.threads: must be in 0..1024, got " +
                                      std::to_string(c.instance.threads));
  }
  KILN_RETURN_IF_ERROR(ValidateBuckets(c));
  for (size_t i = 0; i < c.warmup.size(); ++i) {
    const auto& w = c.warmup[i];
    std::string path = "warmup[" + std::to_string(i) + "]";
    if (c.max_batch_size > 0 && (w.batch_size < 1 || w.batch_size > c.max_batch_size)) {
      return absl::InvalidArgumentError(path + ".batch_size: must be in 1.." +
                                        std::to_string(c.max_batch_size) + ", got " +
                                        std::to_string(w.batch_size));
    }
    if (w.iterations < 1 || w.iterations > 1000) {
      return absl::InvalidArgumentError(path + ".iterations: must be in 1..1000, got " +
                                        std::to_string(w.iterations));
    }
    for (const auto& [name, dims] : w.dims) {
      int idx = c.InputIndex(name);
      if (idx < 0) {
        return absl::InvalidArgumentError(path + ".inputs." + name + ": no such input");
      }
      const auto& spec = c.inputs[idx].dims;
      if (dims.size() != spec.size()) {
        return absl::InvalidArgumentError(path + ".inputs." + name + ".dims: expected " +
                                          std::to_string(spec.size()) + " dims like " +
                                          ShapeString(spec) + ", got " + ShapeString(dims));
      }
      for (size_t d = 0; d < dims.size(); ++d) {
        if (dims[d] < 1 || (spec[d] != -1 && spec[d] != dims[d])) {
          return absl::InvalidArgumentError(path + ".inputs." + name + ".dims: " +
                                            ShapeString(dims) + " does not fit " +
                                            ShapeString(spec));
        }
      }
    }
    for (const auto& in : c.inputs) {
      auto it = w.dims.find(in.name);
      std::vector<int64_t> shape = it != w.dims.end() ? it->second : in.dims;
      if (c.sequence_buckets && it != w.dims.end()) {
        for (size_t d = 0; d < in.dims.size() && d < shape.size(); ++d) {
          if (in.dims[d] == -1 && shape[d] > c.sequence_buckets->lengths.back()) {
            return absl::InvalidArgumentError(
                path + ".inputs." + in.name + ".dims: length " + std::to_string(shape[d]) +
                " exceeds the longest bucket " +
                std::to_string(c.sequence_buckets->lengths.back()) + " (sequence_buckets.lengths)");
          }
        }
      }
      bool concrete = std::find(shape.begin(), shape.end(), -1) == shape.end();
      if (concrete) {
        shape.insert(shape.begin(), std::max<int64_t>(w.batch_size, 1));
        auto n = ElementCount(shape, path + ".inputs." + in.name);
        if (!n.ok()) return n.status();
        if (*n * static_cast<int64_t>(DataTypeSize(in.dtype)) > (1LL << 30)) {
          return absl::InvalidArgumentError(path + ".inputs." + in.name + ": " +
                                            ShapeString(shape) +
                                            " is over 1 GiB; warm-up samples must be small");
        }
      }
      bool variable = std::find(in.dims.begin(), in.dims.end(), -1) != in.dims.end();
      if (variable && !w.dims.count(in.name)) {
        return absl::InvalidArgumentError(path + ".inputs." + in.name +
                                          ": required, the input has variable dims " +
                                          ShapeString(in.dims));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ResolvedModel> ResolveModel(const std::string& repository, const std::string& name,
                                           const std::string& version) {
  if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
    return absl::InvalidArgumentError("--model: '" + name + "' is not a model name");
  }
  std::error_code ec;
  if (!fs::is_directory(repository, ec)) {
    return absl::NotFoundError("--model-repository: '" + repository + "' is not a directory");
  }
  ResolvedModel m;
  m.model_dir = (fs::path(repository) / name).string();
  if (!fs::is_directory(m.model_dir, ec)) {
    return absl::NotFoundError("--model: no model '" + name + "' in " + repository);
  }
  std::string config_file = (fs::path(m.model_dir) / "config.yaml").string();
  std::ifstream in(config_file);
  if (!in) return absl::NotFoundError(config_file + ": cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  KILN_ASSIGN_OR_RETURN(m.config, ParseModelConfig(text.str(), config_file));
  if (m.config.name != name) {
    return absl::InvalidArgumentError(config_file + ": name: '" + m.config.name +
                                      "' does not match the model directory '" + name + "'");
  }
  // Version directories are canonical numbers ("1", "10"; not "01").
  std::vector<int64_t> numeric;
  for (const auto& entry : fs::directory_iterator(m.model_dir, ec)) {
    if (!entry.is_directory()) continue;
    std::string v = entry.path().filename().string();
    if (v.empty() || v.size() > 18 || (v.size() > 1 && v[0] == '0') ||
        !std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      continue;
    }
    numeric.push_back(std::stoll(v));
  }
  std::sort(numeric.begin(), numeric.end());
  for (int64_t v : numeric) m.versions.push_back(std::to_string(v));
  if (version.empty()) {
    if (numeric.empty()) {
      return absl::NotFoundError("--model: '" + name + "' has no numeric version directory in " +
                                 m.model_dir);
    }
    m.version = std::to_string(numeric.back());
  } else {
    if (std::find(m.versions.begin(), m.versions.end(), version) == m.versions.end()) {
      return absl::NotFoundError("--version: model '" + name + "' has no version '" + version +
                                 "' in " + m.model_dir);
    }
    m.version = version;
  }
  m.model_file = (fs::path(m.model_dir) / m.version / ModelFileFor(m.config.backend)).string();
  if (!fs::is_regular_file(m.model_file, ec)) {
    return absl::NotFoundError(m.model_file + ": model file is missing");
  }
  return m;
}

}  // namespace kiln
