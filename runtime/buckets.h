#pragma once

// Sequence-length buckets and CUDA-graph shape plans. Pure functions, free of any backend's
// headers, so the whole policy is unit-tested on CPU.
//
// A model with `sequence_buckets` pads each request's variable (sequence) dimension up to the
// next bucket length with the input's pad value (token id for ids, 0 for the mask), so requests
// of similar length share a shape and batch together while a short query never waits behind,
// or pays for, a long document. Outputs with a variable dimension are trimmed back to the
// request's own length before the reply.

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/model_config.h"
#include "runtime/tensor.h"

namespace kiln {

// The bucket for a sequence of `length` tokens: the smallest configured length >= `length`.
// INVALID_ARGUMENT naming `field` when it exceeds the largest bucket.
absl::StatusOr<int64_t> BucketLength(const SequenceBucketsConfig& buckets, int64_t length,
                                     const std::string& field);

// The axis (in the full tensor shape, batch dimension included when `batched`) that holds the
// sequence for a tensor spec: its single -1 dimension. -1 when the spec has none.
int SequenceAxis(const TensorSpec& spec, bool batched);

// The request's sequence length: every input with a sequence axis must agree on it. Returns -1
// when the model has no variable input. `inputs` are in config order, already validated.
absl::StatusOr<int64_t> RequestSequenceLength(const ModelConfig& config,
                                              const std::vector<Tensor>& inputs);

// Pads every input with a sequence axis from its length to `bucket` along that axis with the
// input's pad value. Inputs already `bucket` long are left untouched. Padded, the inputs may
// hold at most `max_bytes` together (the payload limit: a short request in a long bucket can
// grow by thousands of times); past it INVALID_ARGUMENT, before anything is allocated.
absl::Status PadToBucket(const ModelConfig& config, int64_t bucket, std::vector<Tensor>* inputs,
                         int64_t max_bytes = std::numeric_limits<int64_t>::max());

// Trims every output with a sequence axis back to `length` along that axis. An output whose
// axis is already `length` long is left untouched; one shorter than `length` is an error (the
// model did not return one position per token).
absl::Status TrimToLength(const ModelConfig& config, int64_t length, std::vector<Tensor>* outputs);

// Writes `value` as one element of `dtype` at `dst` (little-endian).
void WriteScalar(DataType dtype, double value, char* dst);

// One CUDA-graph shape: batch rows x sequence length (length -1 for a model without a
// variable dimension).
struct GraphShape {
  int64_t batch = 1;
  int64_t length = -1;
  bool operator==(const GraphShape& o) const { return batch == o.batch && length == o.length; }
};

// The graphs to capture: every configured batch size crossed with every bucket length (or
// the one fixed shape), dropping pairs over max_tokens, largest first so smaller graphs reuse
// the memory pool the largest one sized. Empty when graphs are off.
std::vector<GraphShape> PlanGraphs(const ModelConfig& config);

// The captured shape that serves `rows` rows at `length`: same length, the smallest batch
// size >= rows. Nothing when no graph fits (the request runs without a graph).
std::optional<GraphShape> GraphFor(const std::vector<GraphShape>& plan, int64_t rows,
                                   int64_t length);

// Splits a batch of `rows` rows at `length` into captured graph shapes, in order: each piece
// is the largest captured batch size that fits in the rows left, except that the rest goes
// into one padded graph when at most a quarter of that graph is padding. Empty when no graph
// has this length (the batch runs without graphs).
std::vector<GraphShape> PlanChunks(const std::vector<GraphShape>& captured, int64_t rows,
                                   int64_t length);

}  // namespace kiln
