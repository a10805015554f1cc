#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kiln {

// Open Inference Protocol tensor datatypes that kiln's backends accept.
enum class DataType {
  kBool,
  kUint8,
  kUint16,
  kUint32,
  kUint64,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kFp16,
  kBf16,
  kFp32,
  kFp64,
};

// "FP32" -> kFp32. `field` names the value in the error.
absl::StatusOr<DataType> ParseDataType(const std::string& name, const std::string& field);
const char* DataTypeName(DataType type);
size_t DataTypeSize(DataType type);

// The most dimensions a request's tensor may have (more than any model kiln serves uses).
// Checked before anything else is read of the shape.
inline constexpr size_t kMaxTensorRank = 32;
// OK when `rank` is at most kMaxTensorRank; else "<what> has N dimensions, more than the 32
// allowed".
absl::Status CheckTensorRank(size_t rank, const std::string& what);

// Element count of a shape; an error for negative dimensions or when the count or byte size
// would overflow. `field` names the tensor in errors.
absl::StatusOr<int64_t> ElementCount(const std::vector<int64_t>& shape, const std::string& field);
std::string ShapeString(const std::vector<int64_t>& shape);

// A dense row-major tensor with its bytes in little-endian order (the wire layout of
// raw_input_contents).
struct Tensor {
  std::string name;
  DataType dtype = DataType::kFp32;
  std::vector<int64_t> shape;
  std::string data;

  int64_t elements() const;
};

// IEEE half and bfloat16 conversions (round to nearest even).
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);
uint16_t FloatToBf16(float f);
float Bf16ToFloat(uint16_t b);

}  // namespace kiln
