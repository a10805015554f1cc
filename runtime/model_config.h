#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/tensor.h"

namespace kiln {

struct TensorSpec {
  std::string name;
  DataType dtype = DataType::kFp32;
  // Without the batch dimension when max_batch_size > 0; -1 marks a variable dimension.
  std::vector<int64_t> dims;
};

struct DynamicBatchingConfig {
  std::vector<int64_t> preferred_batch_size;
  int64_t max_queue_delay_microseconds = 0;
  // Priority 1 is the highest; a request names its level with the `priority` parameter.
  int64_t priority_levels = 1;
  int64_t default_priority_level = 1;
  // 0 = unbounded.
  int64_t max_queue_size = 0;
  // 0 = no timeout unless the request gives one.
  int64_t default_timeout_microseconds = 0;
};

struct ResponseCacheConfig {
  bool enable = false;
  int64_t max_bytes = 64LL * 1024 * 1024;
};

enum class Precision { kFp32, kFp16, kBf16 };
const char* PrecisionName(Precision p);

// CUDA graphs, captured per (batch size, sequence bucket) after warm-up and replayed when
// serving. Ignored on cpu.
struct CudaGraphsConfig {
  bool enable = false;
  std::vector<int64_t> batch_sizes;  // ascending; default: powers of two up to max_batch_size
  int64_t max_tokens = 0;            // skip shapes over batch x length tokens; 0 = no limit
  int64_t warmup_iterations = 3;     // runs of each shape before its capture
};

struct InstanceConfig {
  std::string device = "cpu";  // cpu | cuda:N
  int64_t threads = 0;         // 0 = the backend's default
  Precision precision = Precision::kFp32;
  CudaGraphsConfig cuda_graphs;
  // TorchScript's profiling optimiser. Off, each new shape runs as loaded (frozen) without
  // the profiling and re-optimising runs, which shortens warm-up and graph capture.
  bool jit_optimize = true;
  // Freeze the module after loading (inline, fold weights in). Always on for fp16/bf16 on
  // cpu, where the LayerNorm/Softmax pass needs the inlined graph. Off saves its time at
  // load (about 0.8 s for a 1.1 GB encoder).
  bool freeze = true;
  // The fused attention kernels (scaled_dot_product_attention) LibTorch may pick on cuda:
  // any of cudnn, flash, efficient, math. Empty = LibTorch's default set. A listed kernel is
  // used only where it takes the shape and mask (flash takes no mask); a shape no listed
  // kernel takes fails when run (at warm-up or graph capture for the shapes those run).
  // Process-wide (one model per runtime); TorchScript only; ignored on cpu.
  std::vector<std::string> attention;
};

// The kernel names `instance.attention` accepts.
inline constexpr const char* kAttentionKernels[] = {"cudnn", "flash", "efficient", "math"};

// Requests are padded along their variable (sequence) dimension to the next of `lengths`, so
// similar lengths batch together; outputs with a variable dimension are trimmed back.
struct SequenceBucketsConfig {
  std::vector<int64_t> lengths;       // strictly ascending; the last is the longest accepted
  std::map<std::string, double> pad;  // every variable input -> its pad value
};

struct WarmupSample {
  std::string name;
  int64_t batch_size = 1;
  int64_t iterations = 1;
  // Concrete non-batch dims per input; inputs not listed use their configured dims (which
  // must then be fixed).
  std::map<std::string, std::vector<int64_t>> dims;
  bool ones = false;  // fill with ones instead of zeros
};

struct ModelConfig {
  std::string name;
  std::string backend;
  int64_t max_batch_size = 0;
  std::vector<TensorSpec> inputs;
  std::vector<TensorSpec> outputs;
  std::optional<DynamicBatchingConfig> dynamic_batching;
  ResponseCacheConfig response_cache;
  InstanceConfig instance;
  std::optional<SequenceBucketsConfig> sequence_buckets;
  std::vector<WarmupSample> warmup;

  int InputIndex(const std::string& name) const;   // -1 when absent
  int OutputIndex(const std::string& name) const;  // -1 when absent
};

// Parses config.yaml text (YAML is syntax; ModelConfig is the schema) and validates it.
// `source` names the file in errors; every error names the field and the reason.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& yaml_text,
                                             const std::string& source);
absl::Status ValidateModelConfig(const ModelConfig& config);

// The file a version directory holds for `backend`: model.pt2 for aotinductor (an
// AOTInductor package), model.pt for torchscript and anything else.
std::string ModelFileFor(const std::string& backend);

// A model in a Triton-layout repository: DIR/NAME/config.yaml and DIR/NAME/V/model.pt (or
// model.pt2, by backend).
struct ResolvedModel {
  ModelConfig config;
  std::string version;
  std::string model_dir;   // DIR/NAME
  std::string model_file;  // DIR/NAME/V/model.pt or model.pt2
  std::vector<std::string> versions;  // every numeric version present, ascending
};

// Loads NAME from `repository`. Without `version`, picks the highest numeric version.
absl::StatusOr<ResolvedModel> ResolveModel(const std::string& repository, const std::string& name,
                                           const std::string& version);

}  // namespace kiln
