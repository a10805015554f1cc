#include "runtime/buckets.h"

#include <algorithm>
#include <cstring>

#include "common/status.h"

namespace kiln {

absl::StatusOr<int64_t> BucketLength(const SequenceBucketsConfig& buckets, int64_t length,
                                     const std::string& field) {
  auto it = std::lower_bound(buckets.lengths.begin(), buckets.lengths.end(), length);
  if (it == buckets.lengths.end()) {
    return absl::InvalidArgumentError(
        field + ": sequence length " + std::to_string(length) + " exceeds the longest bucket " +
        std::to_string(buckets.lengths.empty() ? 0 : buckets.lengths.back()) +
        " (sequence_buckets.lengths)");
  }
  return *it;
}

int SequenceAxis(const TensorSpec& spec, bool batched) {
  auto it = std::find(spec.dims.begin(), spec.dims.end(), -1);
  if (it == spec.dims.end()) return -1;
  return static_cast<int>(it - spec.dims.begin()) + (batched ? 1 : 0);
}

absl::StatusOr<int64_t> RequestSequenceLength(const ModelConfig& config,
                                              const std::vector<Tensor>& inputs) {
  const bool batched = config.max_batch_size > 0;
  int64_t length = -1;
  std::string first;
  for (size_t i = 0; i < config.inputs.size() && i < inputs.size(); ++i) {
    int axis = SequenceAxis(config.inputs[i], batched);
    if (axis < 0 || axis >= static_cast<int>(inputs[i].shape.size())) continue;
    int64_t l = inputs[i].shape[axis];
    if (length >= 0 && l != length) {
      return absl::InvalidArgumentError("input '" + inputs[i].name + "': sequence length " +
                                        std::to_string(l) + " differs from input '" + first +
                                        "' (" + std::to_string(length) + ")");
    }
    if (length < 0) first = inputs[i].name;
    length = l;
  }
  return length;
}

void WriteScalar(DataType dtype, double value, char* dst) {
  auto put = [dst](auto v) { std::memcpy(dst, &v, sizeof(v)); };
  switch (dtype) {
    case DataType::kBool:
    case DataType::kUint8:
      put(static_cast<uint8_t>(value));
      break;
    case DataType::kInt8:
      put(static_cast<int8_t>(value));
      break;
    case DataType::kUint16:
      put(static_cast<uint16_t>(value));
      break;
    case DataType::kInt16:
      put(static_cast<int16_t>(value));
      break;
    case DataType::kUint32:
      put(static_cast<uint32_t>(value));
      break;
    case DataType::kInt32:
      put(static_cast<int32_t>(value));
      break;
    case DataType::kUint64:
      put(static_cast<uint64_t>(value));
      break;
    case DataType::kInt64:
      put(static_cast<int64_t>(value));
      break;
    case DataType::kFp16:
      put(FloatToHalf(static_cast<float>(value)));
      break;
    case DataType::kBf16:
      put(FloatToBf16(static_cast<float>(value)));
      break;
    case DataType::kFp32:
      put(static_cast<float>(value));
      break;
    case DataType::kFp64:
      put(value);
      break;
  }
}

namespace {

// Product of shape[from..to).
int64_t Span(const std::vector<int64_t>& shape, size_t from, size_t to) {
  int64_t n = 1;
  for (size_t d = from; d < to; ++d) n *= shape[d];
  return n;
}

}  // namespace

absl::Status PadToBucket(const ModelConfig& config, int64_t bucket, std::vector<Tensor>* inputs,
                         int64_t max_bytes) {
  if (!config.sequence_buckets) return absl::OkStatus();
  const bool batched = config.max_batch_size > 0;
  // What the padded inputs will hold, counted first (overflow-safe through ElementCount).
  int64_t total = 0;
  for (size_t i = 0; i < inputs->size(); ++i) {
    const Tensor& t = (*inputs)[i];
    std::vector<int64_t> padded = t.shape;
    const int axis = i < config.inputs.size() ? SequenceAxis(config.inputs[i], batched) : -1;
    if (axis >= 0 && axis < static_cast<int>(padded.size())) padded[axis] = std::max(padded[axis], bucket);
    KILN_ASSIGN_OR_RETURN(int64_t n, ElementCount(padded, "input '" + t.name + "'"));
    const int64_t bytes = n * static_cast<int64_t>(DataTypeSize(t.dtype));  // ElementCount keeps x8 in range
    if (bytes > max_bytes - total) {
      return absl::InvalidArgumentError(
          "padded to its sequence bucket of " + std::to_string(bucket) +
          ", the request would hold more than the payload limit of " + std::to_string(max_bytes) +
          " bytes");
    }
    total += bytes;
  }
  for (size_t i = 0; i < config.inputs.size() && i < inputs->size(); ++i) {
    int axis = SequenceAxis(config.inputs[i], batched);
    if (axis < 0) continue;
    Tensor& t = (*inputs)[i];
    const int64_t len = t.shape[axis];
    if (len == bucket) continue;
    if (len > bucket) {
      return absl::InternalError("input '" + t.name + "': length " + std::to_string(len) +
                                 " is over its bucket " + std::to_string(bucket));
    }
    auto pad_it = config.sequence_buckets->pad.find(t.name);
    double pad = pad_it == config.sequence_buckets->pad.end() ? 0.0 : pad_it->second;
    const size_t elem = DataTypeSize(t.dtype);
    const int64_t outer = Span(t.shape, 0, axis);
    const int64_t inner = Span(t.shape, axis + 1, t.shape.size());
    std::string pad_block(static_cast<size_t>(inner) * elem, '\0');
    for (int64_t e = 0; e < inner; ++e) WriteScalar(t.dtype, pad, pad_block.data() + e * elem);
    const size_t in_row = static_cast<size_t>(len * inner) * elem;
    std::string out;
    out.resize(static_cast<size_t>(outer * bucket * inner) * elem);
    char* dst = out.data();
    const char* src = t.data.data();
    for (int64_t o = 0; o < outer; ++o) {
      std::memcpy(dst, src, in_row);
      dst += in_row;
      src += in_row;
      for (int64_t p = len; p < bucket; ++p) {
        std::memcpy(dst, pad_block.data(), pad_block.size());
        dst += pad_block.size();
      }
    }
    t.data = std::move(out);
    t.shape[axis] = bucket;
  }
  return absl::OkStatus();
}

absl::Status TrimToLength(const ModelConfig& config, int64_t length,
                          std::vector<Tensor>* outputs) {
  if (!config.sequence_buckets || length < 0) return absl::OkStatus();
  const bool batched = config.max_batch_size > 0;
  for (Tensor& t : *outputs) {
    int idx = config.OutputIndex(t.name);
    if (idx < 0) continue;
    int axis = SequenceAxis(config.outputs[idx], batched);
    if (axis < 0 || axis >= static_cast<int>(t.shape.size())) continue;
    const int64_t have = t.shape[axis];
    if (have == length) continue;
    if (have < length) {
      return absl::InternalError("output '" + t.name + "': the model returned " +
                                 std::to_string(have) + " positions for a sequence of " +
                                 std::to_string(length));
    }
    const size_t elem = DataTypeSize(t.dtype);
    const int64_t outer = Span(t.shape, 0, axis);
    const int64_t inner = Span(t.shape, axis + 1, t.shape.size());
    const size_t keep = static_cast<size_t>(length * inner) * elem;
    const size_t stride = static_cast<size_t>(have * inner) * elem;
    std::string out;
    out.resize(static_cast<size_t>(outer) * keep);
    for (int64_t o = 0; o < outer; ++o) {
      std::memcpy(out.data() + o * keep, t.data.data() + o * stride, keep);
    }
    t.data = std::move(out);
    t.shape[axis] = length;
  }
  return absl::OkStatus();
}

std::vector<GraphShape> PlanGraphs(const ModelConfig& config) {
  const CudaGraphsConfig& g = config.instance.cuda_graphs;
  std::vector<GraphShape> plan;
  if (!g.enable || config.max_batch_size <= 0) return plan;
  std::vector<int64_t> batches = g.batch_sizes;
  if (batches.empty()) {
    for (int64_t b = 1; b < config.max_batch_size; b *= 2) batches.push_back(b);
    batches.push_back(config.max_batch_size);
  }
  std::vector<int64_t> lengths = {-1};
  if (config.sequence_buckets) lengths = config.sequence_buckets->lengths;
  for (int64_t l : lengths) {
    for (int64_t b : batches) {
      if (g.max_tokens > 0 && b * std::max<int64_t>(l, 1) > g.max_tokens) continue;
      plan.push_back({b, l});
    }
  }
  std::stable_sort(plan.begin(), plan.end(), [](const GraphShape& a, const GraphShape& b) {
    int64_t ta = a.batch * std::max<int64_t>(a.length, 1);
    int64_t tb = b.batch * std::max<int64_t>(b.length, 1);
    if (ta != tb) return ta > tb;
    return a.batch > b.batch;
  });
  return plan;
}

std::optional<GraphShape> GraphFor(const std::vector<GraphShape>& plan, int64_t rows,
                                   int64_t length) {
  std::optional<GraphShape> best;
  for (const GraphShape& s : plan) {
    if (s.length != length || s.batch < rows) continue;
    if (!best || s.batch < best->batch) best = s;
  }
  return best;
}

std::vector<GraphShape> PlanChunks(const std::vector<GraphShape>& captured, int64_t rows,
                                   int64_t length) {
  std::vector<int64_t> sizes;
  for (const GraphShape& s : captured) {
    if (s.length == length) sizes.push_back(s.batch);
  }
  std::vector<GraphShape> chunks;
  if (sizes.empty() || rows <= 0) return chunks;
  std::sort(sizes.begin(), sizes.end());
  int64_t left = rows;
  while (left > 0) {
    auto cover = std::lower_bound(sizes.begin(), sizes.end(), left);  // smallest >= left
    if (cover != sizes.end() && (*cover - left) * 4 <= *cover) {
      chunks.push_back({*cover, length});
      break;
    }
    if (cover == sizes.begin()) {  // fewer rows left than the smallest graph holds
      chunks.push_back({*cover, length});
      break;
    }
    int64_t fit = *std::prev(cover);  // largest < left (or the largest of all)
    if (cover != sizes.end() && *cover == left) fit = left;
    chunks.push_back({fit, length});
    left -= fit;
  }
  return chunks;
}

}  // namespace kiln
