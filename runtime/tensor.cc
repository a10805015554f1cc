#include "runtime/tensor.h"

#include <cstring>
#include <limits>
#include <string_view>

#include "common/status.h"

namespace kiln {

namespace {
struct TypeInfo {
  DataType type;
  const char* name;
  size_t size;
};
constexpr TypeInfo kTypes[] = {
    {DataType::kBool, "BOOL", 1},     {DataType::kUint8, "UINT8", 1},
    {DataType::kUint16, "UINT16", 2}, {DataType::kUint32, "UINT32", 4},
    {DataType::kUint64, "UINT64", 8}, {DataType::kInt8, "INT8", 1},
    {DataType::kInt16, "INT16", 2},   {DataType::kInt32, "INT32", 4},
    {DataType::kInt64, "INT64", 8},   {DataType::kFp16, "FP16", 2},
    {DataType::kBf16, "BF16", 2},     {DataType::kFp32, "FP32", 4},
    {DataType::kFp64, "FP64", 8},
};
}  // namespace

absl::StatusOr<DataType> ParseDataType(const std::string& name, const std::string& field) {
  // Triton's config spells them TYPE_FP32; accept that too (one prefix).
  std::string_view bare = name;
  if (bare.substr(0, 5) == "TYPE_") bare.remove_prefix(5);
  for (const auto& t : kTypes) {
    if (bare == t.name) return t.type;
  }
  // A request's datatype is the client's: not echoed whole.
  const std::string shown = name.size() > 40 ? name.substr(0, 40) + "..." : name;
  return absl::InvalidArgumentError(
      field + ": unknown datatype '" + shown +
      "' (expected BOOL, UINT8, UINT16, UINT32, UINT64, INT8, INT16, INT32, INT64, FP16, BF16, "
      "FP32 or FP64)");
}

const char* DataTypeName(DataType type) {
  for (const auto& t : kTypes) {
    if (t.type == type) return t.name;
  }
  return "INVALID";
}

size_t DataTypeSize(DataType type) {
  for (const auto& t : kTypes) {
    if (t.type == type) return t.size;
  }
  return 0;
}

absl::Status CheckTensorRank(size_t rank, const std::string& what) {
  if (rank <= kMaxTensorRank) return absl::OkStatus();
  return absl::InvalidArgumentError(what + " has " + std::to_string(rank) +
                                    " dimensions, more than the " +
                                    std::to_string(kMaxTensorRank) + " allowed");
}

absl::StatusOr<int64_t> ElementCount(const std::vector<int64_t>& shape, const std::string& field) {
  KILN_RETURN_IF_ERROR(CheckTensorRank(shape.size(), field + ": shape"));
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(field + ": shape " + ShapeString(shape) +
                                        " has a negative dimension");
    }
    // 8 bytes is the widest element: keep the byte size representable too, and each
    // dimension on its own (a 0 elsewhere must not let a huge one through to the model).
    if (d > std::numeric_limits<int64_t>::max() / 8 ||
        (d != 0 && n > std::numeric_limits<int64_t>::max() / 8 / d)) {
      return absl::InvalidArgumentError(field + ": shape " + ShapeString(shape) + " is too large");
    }
    n *= d;
  }
  return n;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

int64_t Tensor::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // Inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> Inf
  if (abs < 0x38800000u) {  // subnormal half (or zero)
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    int shift = 113 - static_cast<int>(abs >> 23) + 13;
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1u))) half++;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t e = (abs >> 23) - 112;
  uint32_t mant = abs & 0x7fffffu;
  uint32_t half = (e << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++;
  return static_cast<uint16_t>(sign | half);
}

float HalfToFloat(uint16_t h) {
  uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t x;
  if (e == 0) {
    if (mant == 0) {
      x = sign;
    } else {  // subnormal: normalise
      int shift = 0;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        ++shift;
      }
      mant &= 0x3ffu;
      x = sign | (static_cast<uint32_t>(113 - shift) << 23) | (mant << 13);
    }
  } else if (e == 31) {
    x = sign | 0x7f800000u | (mant << 13);
  } else {
    x = sign | ((e + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

uint16_t FloatToBf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

float Bf16ToFloat(uint16_t b) {
  uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

}  // namespace kiln
