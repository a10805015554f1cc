#include "runtime/tensor.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace kiln {
namespace {

TEST(DataTypeTest, ParsesEveryNameAndRejectsUnknown) {
  for (const char* n : {"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                        "INT64", "FP16", "BF16", "FP32", "FP64"}) {
    auto t = ParseDataType(n, "f");
    ASSERT_TRUE(t.ok()) << n;
    EXPECT_STREQ(DataTypeName(*t), n);
  }
  EXPECT_EQ(*ParseDataType("TYPE_FP32", "f"), DataType::kFp32);
  auto bad = ParseDataType("FLOAT", "input 'x'");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("input 'x'"), std::string::npos);
  EXPECT_EQ(ParseDataType("BYTES", "f").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DataTypeTest, Sizes) {
  EXPECT_EQ(DataTypeSize(DataType::kBool), 1u);
  EXPECT_EQ(DataTypeSize(DataType::kFp16), 2u);
  EXPECT_EQ(DataTypeSize(DataType::kBf16), 2u);
  EXPECT_EQ(DataTypeSize(DataType::kInt32), 4u);
  EXPECT_EQ(DataTypeSize(DataType::kFp64), 8u);
  EXPECT_EQ(DataTypeSize(DataType::kUint64), 8u);
}

TEST(ElementCountTest, CountsAndRejectsNegativeAndOverflow) {
  EXPECT_EQ(*ElementCount({2, 3, 4}, "x"), 24);
  EXPECT_EQ(*ElementCount({}, "x"), 1);
  EXPECT_EQ(*ElementCount({5, 0}, "x"), 0);
  EXPECT_EQ(ElementCount({2, -1}, "x").status().code(), absl::StatusCode::kInvalidArgument);
  auto huge = ElementCount({1LL << 40, 1LL << 40}, "input 'x'");
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(huge.status().message().find("too large"), std::string::npos);
}

TEST(HalfTest, ExactValuesRoundTrip) {
  for (float f : {0.0f, 1.0f, -2.5f, 0.5f, 65504.0f, -0.000061035156f, 1024.0f}) {
    EXPECT_EQ(HalfToFloat(FloatToHalf(f)), f) << f;
  }
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
}

TEST(HalfTest, RoundsToNearestEvenAndSaturates) {
  // 1 + 2^-11 is halfway between 1 and the next half (1 + 2^-10): ties to even (1.0).
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(FloatToHalf(1e6f), 0x7c00);  // +Inf
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::numeric_limits<float>::quiet_NaN()))));
  // Subnormals.
  float tiny = std::ldexp(1.0f, -24);
  EXPECT_EQ(FloatToHalf(tiny), 0x0001);
  EXPECT_EQ(HalfToFloat(0x0001), tiny);
}

TEST(Bf16Test, RoundTripAndRounding) {
  for (float f : {0.0f, 1.0f, -3.0f, 256.0f, 0.15625f}) {
    EXPECT_EQ(Bf16ToFloat(FloatToBf16(f)), f) << f;
  }
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  float f = 1.00390625f;  // 1 + 2^-8: halfway, ties to even (1.0)
  EXPECT_EQ(FloatToBf16(f), 0x3f80);
  EXPECT_NEAR(Bf16ToFloat(FloatToBf16(3.14159f)), 3.14159f, 0.01f);
}

}  // namespace
}  // namespace kiln
