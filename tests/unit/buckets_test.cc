#include "runtime/buckets.h"

#include <cstring>

#include "gtest/gtest.h"

namespace kiln {
namespace {

SequenceBucketsConfig Buckets(std::vector<int64_t> lengths,
                              std::map<std::string, double> pad = {}) {
  SequenceBucketsConfig b;
  b.lengths = std::move(lengths);
  b.pad = std::move(pad);
  return b;
}

// ids and mask INT64 [-1], a fixed FP32 input, a per-token output and a pooled one.
ModelConfig TokenConfig(int64_t max_batch_size = 8) {
  ModelConfig c;
  c.name = "tok";
  c.backend = "fake";
  c.max_batch_size = max_batch_size;
  c.inputs = {{"ids", DataType::kInt64, {-1}},
              {"mask", DataType::kInt64, {-1}},
              {"scale", DataType::kFp32, {1}}};
  c.outputs = {{"hidden", DataType::kFp32, {-1, 3}}, {"pooled", DataType::kFp32, {64}}};
  c.sequence_buckets = Buckets({4, 8, 16}, {{"ids", 7}, {"mask", 0}});
  return c;
}

template <typename T>
Tensor Make(const std::string& name, DataType dtype, std::vector<int64_t> shape,
            const std::vector<T>& v) {
  Tensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.assign(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  return t;
}

template <typename T>
T At(const Tensor& t, int64_t i) {
  T v;
  std::memcpy(&v, t.data.data() + i * sizeof(T), sizeof(T));
  return v;
}

// rows x len INT64 with element (r, j) = base + 100 * r + j + 1 (never 0 or a pad value).
Tensor Ids(const std::string& name, int64_t rows, int64_t len, int64_t base = 0) {
  std::vector<int64_t> v;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < len; ++j) v.push_back(base + 100 * r + j + 1);
  }
  return Make(name, DataType::kInt64, {rows, len}, v);
}

Tensor Scale(int64_t rows) {
  return Make("scale", DataType::kFp32, {rows, 1}, std::vector<float>(rows, 0.25f));
}

// ---- BucketLength ----

TEST(BucketLengthTest, PicksTheSmallestBucketThatFits) {
  auto b = Buckets({4, 8, 16});
  struct Case {
    int64_t length, bucket;
  };
  for (Case c : {Case{1, 4}, Case{3, 4}, Case{4, 4}, Case{5, 8}, Case{7, 8}, Case{8, 8},
                 Case{9, 16}, Case{15, 16}, Case{16, 16}}) {
    auto got = BucketLength(b, c.length, "input 'ids'");
    ASSERT_TRUE(got.ok()) << c.length << ": " << got.status();
    EXPECT_EQ(*got, c.bucket) << "length " << c.length;
  }
}

TEST(BucketLengthTest, OneBucketTakesEverythingUpToIt) {
  auto b = Buckets({8});
  EXPECT_EQ(*BucketLength(b, 1, "f"), 8);
  EXPECT_EQ(*BucketLength(b, 8, "f"), 8);
  EXPECT_FALSE(BucketLength(b, 9, "f").ok());
}

TEST(BucketLengthTest, OverTheLargestIsInvalidArgumentNamingTheField) {
  auto got = BucketLength(Buckets({4, 8, 16}), 17, "input 'input_ids'");
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(got.status().message());
  EXPECT_EQ(msg.rfind("input 'input_ids'", 0), 0u) << msg;  // the field leads
  EXPECT_NE(msg.find("17"), std::string::npos) << msg;
  EXPECT_NE(msg.find("16"), std::string::npos) << msg;
  EXPECT_NE(msg.find("sequence_buckets.lengths"), std::string::npos) << msg;
  EXPECT_EQ(BucketLength(Buckets({4, 8, 16}), 1000, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- SequenceAxis ----

TEST(SequenceAxisTest, TheVariableDimensionCountingTheBatchDimension) {
  TensorSpec ids{"ids", DataType::kInt64, {-1}};
  EXPECT_EQ(SequenceAxis(ids, true), 1);
  EXPECT_EQ(SequenceAxis(ids, false), 0);
  TensorSpec emb{"emb", DataType::kFp32, {-1, 4}};
  EXPECT_EQ(SequenceAxis(emb, true), 1);
  EXPECT_EQ(SequenceAxis(emb, false), 0);
  TensorSpec last{"t", DataType::kFp32, {4, -1}};
  EXPECT_EQ(SequenceAxis(last, true), 2);
  EXPECT_EQ(SequenceAxis(last, false), 1);
  TensorSpec fixed{"f", DataType::kFp32, {4, 2}};
  EXPECT_EQ(SequenceAxis(fixed, true), -1);
  EXPECT_EQ(SequenceAxis(fixed, false), -1);
}

// ---- RequestSequenceLength ----

TEST(RequestSequenceLengthTest, InputsAgreeOnTheLength) {
  ModelConfig c = TokenConfig();
  auto len = RequestSequenceLength(c, {Ids("ids", 2, 5), Ids("mask", 2, 5), Scale(2)});
  ASSERT_TRUE(len.ok()) << len.status();
  EXPECT_EQ(*len, 5);
}

TEST(RequestSequenceLengthTest, DifferingLengthsNameBothInputs) {
  ModelConfig c = TokenConfig();
  auto len = RequestSequenceLength(c, {Ids("ids", 1, 3), Ids("mask", 1, 5), Scale(1)});
  ASSERT_FALSE(len.ok());
  EXPECT_EQ(len.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(len.status().message());
  EXPECT_NE(msg.find("'mask'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'ids'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("3"), std::string::npos) << msg;
}

TEST(RequestSequenceLengthTest, NoVariableInputIsMinusOne) {
  ModelConfig c;
  c.max_batch_size = 4;
  c.inputs = {{"x", DataType::kFp32, {4}}};
  auto len = RequestSequenceLength(c, {Make("x", DataType::kFp32, {1, 4}, std::vector<float>(4))});
  ASSERT_TRUE(len.ok());
  EXPECT_EQ(*len, -1);
}

TEST(RequestSequenceLengthTest, WithoutABatchDimension) {
  ModelConfig c = TokenConfig(0);
  c.inputs.pop_back();
  auto len = RequestSequenceLength(
      c, {Make("ids", DataType::kInt64, {6}, std::vector<int64_t>(6, 1)),
          Make("mask", DataType::kInt64, {6}, std::vector<int64_t>(6, 1))});
  ASSERT_TRUE(len.ok());
  EXPECT_EQ(*len, 6);
}

// ---- PadToBucket ----

TEST(PadToBucketTest, PadsEveryRowOfBatchedInt64InputsWithTheirPadValues) {
  ModelConfig c = TokenConfig();
  const int64_t rows = 3, len = 3, bucket = 8;
  std::vector<Tensor> in = {Ids("ids", rows, len), Ids("mask", rows, len, 1000), Scale(rows)};
  const std::string scale_bytes = in[2].data;
  ASSERT_TRUE(PadToBucket(c, bucket, &in).ok());

  for (int which = 0; which < 2; ++which) {
    const Tensor& t = in[which];
    const int64_t base = which == 0 ? 0 : 1000;
    const int64_t pad = which == 0 ? 7 : 0;
    EXPECT_EQ(t.dtype, DataType::kInt64);
    ASSERT_EQ(t.shape, (std::vector<int64_t>{rows, bucket})) << t.name;
    ASSERT_EQ(t.data.size(), static_cast<size_t>(rows * bucket * 8)) << t.name;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < bucket; ++j) {
        int64_t want = j < len ? base + 100 * r + j + 1 : pad;
        EXPECT_EQ(At<int64_t>(t, r * bucket + j), want) << t.name << " row " << r << " pos " << j;
      }
    }
  }
  // The fixed-shape input is not touched.
  EXPECT_EQ(in[2].shape, (std::vector<int64_t>{rows, 1}));
  EXPECT_EQ(in[2].data, scale_bytes);
}

TEST(PadToBucketTest, AnInputAlreadyAtItsBucketIsLeftAlone) {
  ModelConfig c = TokenConfig();
  std::vector<Tensor> in = {Ids("ids", 2, 8), Ids("mask", 2, 8), Scale(2)};
  const std::string before = in[0].data;
  ASSERT_TRUE(PadToBucket(c, 8, &in).ok());
  EXPECT_EQ(in[0].shape, (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(in[0].data, before);
}

TEST(PadToBucketTest, LongerThanTheBucketIsAnError) {
  ModelConfig c = TokenConfig();
  std::vector<Tensor> in = {Ids("ids", 1, 9), Ids("mask", 1, 9), Scale(1)};
  absl::Status s = PadToBucket(c, 8, &in);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'ids'"), std::string::npos) << s;
}

// A short request in a long bucket grows by the bucket's length over its own: past the payload
// limit it is refused before anything is allocated, and left as it was.
TEST(PadToBucketTest, PaddedPastThePayloadLimitIsRefused) {
  ModelConfig c = TokenConfig();
  // Padded: ids 2x8 and mask 2x8 INT64 (128 bytes each), scale 2x1 FP32 (8): 264 bytes.
  std::vector<Tensor> in = {Ids("ids", 2, 3), Ids("mask", 2, 3), Scale(2)};
  const std::vector<Tensor> before = in;
  absl::Status s = PadToBucket(c, 8, &in, 263);
  ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("sequence bucket of 8, the request would hold more than the payload "
                             "limit of 263 bytes"),
            std::string::npos)
      << s;
  EXPECT_EQ(in[0].shape, before[0].shape);
  EXPECT_EQ(in[0].data, before[0].data);
  ASSERT_TRUE(PadToBucket(c, 8, &in, 264).ok());
  EXPECT_EQ(in[0].shape, (std::vector<int64_t>{2, 8}));
}

TEST(PadToBucketTest, WithoutBucketsNothingChanges) {
  ModelConfig c = TokenConfig();
  c.sequence_buckets.reset();
  std::vector<Tensor> in = {Ids("ids", 1, 3), Ids("mask", 1, 3), Scale(1)};
  ASSERT_TRUE(PadToBucket(c, 8, &in).ok());
  EXPECT_EQ(in[0].shape, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(in[0].data.size(), 24u);
}

TEST(PadToBucketTest, SequenceAxisInTheMiddleOfA3DInput) {
  // dims [-1, 4] per row: the full shape is [rows, len, 4], the sequence is axis 1.
  ModelConfig c;
  c.name = "emb";
  c.max_batch_size = 4;
  c.inputs = {{"x", DataType::kFp32, {-1, 4}}};
  c.outputs = {{"y", DataType::kFp32, {4}}};
  c.sequence_buckets = Buckets({4, 8}, {{"x", -1.5}});
  const int64_t rows = 2, len = 3, h = 4, bucket = 4;
  std::vector<float> v;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t p = 0; p < len; ++p) {
      for (int64_t k = 0; k < h; ++k) v.push_back(static_cast<float>(100 * r + 10 * p + k + 1));
    }
  }
  std::vector<Tensor> in = {Make("x", DataType::kFp32, {rows, len, h}, v)};
  ASSERT_TRUE(PadToBucket(c, bucket, &in).ok());
  ASSERT_EQ(in[0].shape, (std::vector<int64_t>{rows, bucket, h}));
  ASSERT_EQ(in[0].data.size(), static_cast<size_t>(rows * bucket * h * 4));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t p = 0; p < bucket; ++p) {
      for (int64_t k = 0; k < h; ++k) {
        float want = p < len ? static_cast<float>(100 * r + 10 * p + k + 1) : -1.5f;
        EXPECT_EQ(At<float>(in[0], (r * bucket + p) * h + k), want)
            << "row " << r << " pos " << p << " col " << k;
      }
    }
  }
}

TEST(PadToBucketTest, SequenceAxisLastAfterAFixedDimension) {
  // dims [2, -1]: [rows, 2, len]; each of the rows * 2 lines is padded on its own.
  ModelConfig c;
  c.name = "m";
  c.max_batch_size = 4;
  c.inputs = {{"x", DataType::kInt32, {2, -1}}};
  c.outputs = {{"y", DataType::kFp32, {1}}};
  c.sequence_buckets = Buckets({4}, {{"x", -9}});
  std::vector<int32_t> v = {1, 2, 3, 4, 5, 6};  // [1, 2, 3]
  std::vector<Tensor> in = {Make("x", DataType::kInt32, {1, 2, 3}, v)};
  ASSERT_TRUE(PadToBucket(c, 4, &in).ok());
  ASSERT_EQ(in[0].shape, (std::vector<int64_t>{1, 2, 4}));
  std::vector<int32_t> want = {1, 2, 3, -9, 4, 5, 6, -9};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(At<int32_t>(in[0], i), want[i]) << i;
}

TEST(PadToBucketTest, WithoutABatchDimension) {
  ModelConfig c = TokenConfig(0);
  c.inputs.pop_back();
  std::vector<Tensor> in = {Make("ids", DataType::kInt64, {2}, std::vector<int64_t>{5, 6}),
                            Make("mask", DataType::kInt64, {2}, std::vector<int64_t>{1, 1})};
  ASSERT_TRUE(PadToBucket(c, 4, &in).ok());
  ASSERT_EQ(in[0].shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(At<int64_t>(in[0], 0), 5);
  EXPECT_EQ(At<int64_t>(in[0], 1), 6);
  EXPECT_EQ(At<int64_t>(in[0], 2), 7);
  EXPECT_EQ(At<int64_t>(in[0], 3), 7);
  EXPECT_EQ(At<int64_t>(in[1], 3), 0);
}

// Each dtype's pad value lands as that dtype's bytes, after the kept data.
struct DtypePad {
  DataType dtype;
  double pad;
  std::string bytes;  // the expected little-endian encoding of `pad`
};

std::string Bytes(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

std::vector<DtypePad> DtypePads() {
  float f32 = -1.5f;
  uint16_t f16 = 0xBE00;   // -1.5 in IEEE half
  uint16_t bf16 = 0xBFC0;  // -1.5 in bfloat16
  int32_t i32 = -7;
  uint8_t b1 = 1;
  int64_t i64 = -123456789012LL;
  double f64 = 0.1;
  int8_t i8 = -3;
  uint16_t u16 = 65535;
  return {{DataType::kFp32, -1.5, Bytes(&f32, 4)},  {DataType::kFp16, -1.5, Bytes(&f16, 2)},
          {DataType::kBf16, -1.5, Bytes(&bf16, 2)}, {DataType::kInt32, -7, Bytes(&i32, 4)},
          {DataType::kBool, 1, Bytes(&b1, 1)},      {DataType::kInt64, -123456789012.0, Bytes(&i64, 8)},
          {DataType::kFp64, 0.1, Bytes(&f64, 8)},   {DataType::kInt8, -3, Bytes(&i8, 1)},
          {DataType::kUint16, 65535, Bytes(&u16, 2)}};
}

TEST(WriteScalarTest, EncodesEachDatatypeExactlyInItsOwnWidth) {
  for (const DtypePad& d : DtypePads()) {
    const size_t n = DataTypeSize(d.dtype);
    ASSERT_EQ(d.bytes.size(), n) << DataTypeName(d.dtype);
    std::string buf(n + 2, '\x5a');  // guard bytes either side stay untouched
    WriteScalar(d.dtype, d.pad, buf.data() + 1);
    EXPECT_EQ(buf.substr(1, n), d.bytes) << DataTypeName(d.dtype);
    EXPECT_EQ(buf[0], '\x5a') << DataTypeName(d.dtype);
    EXPECT_EQ(buf[n + 1], '\x5a') << DataTypeName(d.dtype);
  }
  // The half encodings round-trip.
  uint16_t h;
  WriteScalar(DataType::kFp16, 0.5, reinterpret_cast<char*>(&h));
  EXPECT_EQ(HalfToFloat(h), 0.5f);
  WriteScalar(DataType::kBf16, 2.0, reinterpret_cast<char*>(&h));
  EXPECT_EQ(Bf16ToFloat(h), 2.0f);
  uint8_t b = 7;
  WriteScalar(DataType::kBool, 0, reinterpret_cast<char*>(&b));
  EXPECT_EQ(b, 0);
}

TEST(PadToBucketTest, PadValuesOfEveryDatatype) {
  for (const DtypePad& d : DtypePads()) {
    const size_t n = DataTypeSize(d.dtype);
    ModelConfig c;
    c.name = "m";
    c.max_batch_size = 2;
    c.inputs = {{"x", d.dtype, {-1}}};
    c.outputs = {{"y", DataType::kFp32, {1}}};
    c.sequence_buckets = Buckets({4}, {{"x", d.pad}});
    Tensor t;
    t.name = "x";
    t.dtype = d.dtype;
    t.shape = {2, 1};
    t.data = std::string(2 * n, '\x11');  // one token per row, bytes distinct from any pad
    std::vector<Tensor> in = {t};
    ASSERT_TRUE(PadToBucket(c, 4, &in).ok()) << DataTypeName(d.dtype);
    ASSERT_EQ(in[0].shape, (std::vector<int64_t>{2, 4}));
    ASSERT_EQ(in[0].data.size(), 8 * n);
    for (int64_t r = 0; r < 2; ++r) {
      EXPECT_EQ(in[0].data.substr((r * 4) * n, n), std::string(n, '\x11'))
          << DataTypeName(d.dtype) << " row " << r;
      for (int64_t p = 1; p < 4; ++p) {
        EXPECT_EQ(in[0].data.substr((r * 4 + p) * n, n), d.bytes)
            << DataTypeName(d.dtype) << " row " << r << " pos " << p;
      }
    }
  }
}

// ---- TrimToLength ----

// [rows, have, h] FP32 with element (r, p, k) = 1000 r + 10 p + k.
Tensor Hidden(int64_t rows, int64_t have, int64_t h) {
  std::vector<float> v;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t p = 0; p < have; ++p) {
      for (int64_t k = 0; k < h; ++k) v.push_back(static_cast<float>(1000 * r + 10 * p + k));
    }
  }
  return Make("hidden", DataType::kFp32, {rows, have, h}, v);
}

TEST(TrimToLengthTest, TrimsPerTokenOutputsAndLeavesFixedOnesAlone) {
  ModelConfig c = TokenConfig();
  const int64_t rows = 2, have = 8, h = 3, length = 5;
  Tensor pooled = Make("pooled", DataType::kFp32, {rows, 64}, std::vector<float>(rows * 64, 2.f));
  std::vector<Tensor> out = {Hidden(rows, have, h), pooled};
  ASSERT_TRUE(TrimToLength(c, length, &out).ok());
  const Tensor& t = out[0];
  ASSERT_EQ(t.shape, (std::vector<int64_t>{rows, length, h}));
  ASSERT_EQ(t.data.size(), static_cast<size_t>(rows * length * h * 4));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t p = 0; p < length; ++p) {
      for (int64_t k = 0; k < h; ++k) {
        EXPECT_EQ(At<float>(t, (r * length + p) * h + k), static_cast<float>(1000 * r + 10 * p + k))
            << "row " << r << " pos " << p << " col " << k;
      }
    }
  }
  EXPECT_EQ(out[1].shape, pooled.shape);
  EXPECT_EQ(out[1].data, pooled.data);
}

TEST(TrimToLengthTest, AlreadyTheRightLengthIsUntouched) {
  ModelConfig c = TokenConfig();
  std::vector<Tensor> out = {Hidden(1, 4, 3)};
  const std::string before = out[0].data;
  ASSERT_TRUE(TrimToLength(c, 4, &out).ok());
  EXPECT_EQ(out[0].shape, (std::vector<int64_t>{1, 4, 3}));
  EXPECT_EQ(out[0].data, before);
}

TEST(TrimToLengthTest, AnOutputShorterThanTheRequestIsAnError) {
  ModelConfig c = TokenConfig();
  std::vector<Tensor> out = {Hidden(1, 3, 3)};
  absl::Status s = TrimToLength(c, 5, &out);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'hidden'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("3"), std::string::npos) << s;
  EXPECT_NE(s.message().find("5"), std::string::npos) << s;
}

TEST(TrimToLengthTest, NothingToDoWithoutBucketsOrALength) {
  ModelConfig c = TokenConfig();
  std::vector<Tensor> out = {Hidden(1, 8, 3)};
  ASSERT_TRUE(TrimToLength(c, -1, &out).ok());
  EXPECT_EQ(out[0].shape, (std::vector<int64_t>{1, 8, 3}));
  c.sequence_buckets.reset();
  ASSERT_TRUE(TrimToLength(c, 2, &out).ok());
  EXPECT_EQ(out[0].shape, (std::vector<int64_t>{1, 8, 3}));
  // An output the config does not list is passed through.
  ModelConfig d = TokenConfig();
  Tensor other = Hidden(1, 8, 3);
  other.name = "unlisted";
  std::vector<Tensor> o2 = {other};
  ASSERT_TRUE(TrimToLength(d, 2, &o2).ok());
  EXPECT_EQ(o2[0].shape, (std::vector<int64_t>{1, 8, 3}));
}

TEST(TrimToLengthTest, SequenceAxisLast) {
  // dims [2, -1]: [rows, 2, len], each of the rows * 2 lines keeps its first `length`.
  ModelConfig c = TokenConfig();
  c.outputs = {{"scores", DataType::kInt32, {2, -1}}};
  std::vector<int32_t> v = {1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 16, 17, 18};
  std::vector<Tensor> out = {Make("scores", DataType::kInt32, {2, 2, 4}, v)};
  ASSERT_TRUE(TrimToLength(c, 3, &out).ok());
  ASSERT_EQ(out[0].shape, (std::vector<int64_t>{2, 2, 3}));
  std::vector<int32_t> want = {1, 2, 3, 5, 6, 7, 11, 12, 13, 15, 16, 17};
  ASSERT_EQ(out[0].data.size(), want.size() * 4);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(At<int32_t>(out[0], i), want[i]) << i;
}

TEST(TrimToLengthTest, PadThenTrimRoundTrips) {
  ModelConfig c = TokenConfig();
  c.outputs = {{"ids", DataType::kInt64, {-1}}};  // an echo of the input
  std::vector<Tensor> in = {Ids("ids", 3, 5), Ids("mask", 3, 5), Scale(3)};
  const Tensor original = in[0];
  auto len = RequestSequenceLength(c, in);
  ASSERT_TRUE(len.ok());
  auto bucket = BucketLength(*c.sequence_buckets, *len, "ids");
  ASSERT_TRUE(bucket.ok());
  EXPECT_EQ(*bucket, 8);
  ASSERT_TRUE(PadToBucket(c, *bucket, &in).ok());
  std::vector<Tensor> out = {in[0]};
  ASSERT_TRUE(TrimToLength(c, *len, &out).ok());
  EXPECT_EQ(out[0].shape, original.shape);
  EXPECT_EQ(out[0].data, original.data);
}

// ---- PlanGraphs / GraphFor ----

ModelConfig GraphConfig(int64_t max_batch_size, std::vector<int64_t> lengths) {
  ModelConfig c = TokenConfig(max_batch_size);
  if (lengths.empty()) {
    c.sequence_buckets.reset();
  } else {
    c.sequence_buckets->lengths = std::move(lengths);
  }
  c.instance.cuda_graphs.enable = true;
  return c;
}

std::string PlanString(const std::vector<GraphShape>& plan) {
  std::string s;
  for (const auto& g : plan) s += std::to_string(g.batch) + "x" + std::to_string(g.length) + " ";
  return s;
}

TEST(PlanGraphsTest, EveryBatchSizeTimesEveryBucketLargestFirst) {
  auto plan = PlanGraphs(GraphConfig(8, {4, 8, 16}));
  std::vector<GraphShape> want = {{8, 16}, {8, 8}, {4, 16}, {8, 4}, {4, 8}, {2, 16},
                                  {4, 4},  {2, 8}, {1, 16}, {2, 4}, {1, 8}, {1, 4}};
  EXPECT_EQ(plan, want) << PlanString(plan);
  for (size_t i = 1; i < plan.size(); ++i) {
    EXPECT_GE(plan[i - 1].batch * plan[i - 1].length, plan[i].batch * plan[i].length)
        << PlanString(plan);
  }
}

TEST(PlanGraphsTest, DefaultBatchSizesArePowersOfTwoPlusTheMaximum) {
  auto batches = [](const std::vector<GraphShape>& plan) {
    std::vector<int64_t> b;
    for (const auto& g : plan) {
      EXPECT_EQ(g.length, -1);
      b.push_back(g.batch);
    }
    return b;
  };
  EXPECT_EQ(batches(PlanGraphs(GraphConfig(8, {}))), (std::vector<int64_t>{8, 4, 2, 1}));
  EXPECT_EQ(batches(PlanGraphs(GraphConfig(6, {}))), (std::vector<int64_t>{6, 4, 2, 1}));
  EXPECT_EQ(batches(PlanGraphs(GraphConfig(1, {}))), (std::vector<int64_t>{1}));
  EXPECT_EQ(batches(PlanGraphs(GraphConfig(33, {}))),
            (std::vector<int64_t>{33, 32, 16, 8, 4, 2, 1}));
}

TEST(PlanGraphsTest, ConfiguredBatchSizes) {
  ModelConfig c = GraphConfig(8, {4, 8});
  c.instance.cuda_graphs.batch_sizes = {3, 5};
  auto plan = PlanGraphs(c);
  std::vector<GraphShape> want = {{5, 8}, {3, 8}, {5, 4}, {3, 4}};
  EXPECT_EQ(plan, want) << PlanString(plan);
}

TEST(PlanGraphsTest, MaxTokensDropsTheLargeShapes) {
  ModelConfig c = GraphConfig(8, {4, 8, 16});
  c.instance.cuda_graphs.max_tokens = 32;
  auto plan = PlanGraphs(c);
  std::vector<GraphShape> want = {{8, 4}, {4, 8}, {2, 16}, {4, 4}, {2, 8},
                                  {1, 16}, {2, 4}, {1, 8}, {1, 4}};
  EXPECT_EQ(plan, want) << PlanString(plan);
  // Without buckets, a row counts as one token.
  ModelConfig fixed = GraphConfig(8, {});
  fixed.instance.cuda_graphs.max_tokens = 4;
  EXPECT_EQ(PlanGraphs(fixed), (std::vector<GraphShape>{{4, -1}, {2, -1}, {1, -1}}));
}

TEST(PlanGraphsTest, NothingWhenDisabledOrUnbatched) {
  ModelConfig off = GraphConfig(8, {4, 8});
  off.instance.cuda_graphs.enable = false;
  EXPECT_TRUE(PlanGraphs(off).empty());
  ModelConfig unbatched = GraphConfig(0, {4, 8});
  EXPECT_TRUE(PlanGraphs(unbatched).empty());
}

TEST(GraphForTest, SmallestBatchThatHoldsTheRowsAtTheSameLength) {
  auto plan = PlanGraphs(GraphConfig(8, {4, 8, 16}));
  struct Case {
    int64_t rows, length, batch;
  };
  for (Case c : {Case{1, 8, 1}, Case{2, 8, 2}, Case{3, 8, 4}, Case{4, 8, 4}, Case{5, 8, 8},
                 Case{8, 8, 8}, Case{3, 4, 4}, Case{7, 16, 8}}) {
    auto g = GraphFor(plan, c.rows, c.length);
    ASSERT_TRUE(g.has_value()) << c.rows << "x" << c.length;
    EXPECT_EQ(*g, (GraphShape{c.batch, c.length})) << c.rows << "x" << c.length;
  }
}

TEST(GraphForTest, NothingWhenNoGraphFits) {
  auto plan = PlanGraphs(GraphConfig(8, {4, 8, 16}));
  EXPECT_FALSE(GraphFor(plan, 9, 8).has_value());   // more rows than any graph
  EXPECT_FALSE(GraphFor(plan, 1, 5).has_value());   // not a bucket length
  EXPECT_FALSE(GraphFor(plan, 1, -1).has_value());  // the plan has no fixed shape
  EXPECT_FALSE(GraphFor({}, 1, 4).has_value());
  // max_tokens left only batch 1 and 2 at length 16.
  ModelConfig c = GraphConfig(8, {4, 8, 16});
  c.instance.cuda_graphs.max_tokens = 32;
  auto small = PlanGraphs(c);
  EXPECT_EQ(GraphFor(small, 2, 16), (std::optional<GraphShape>(GraphShape{2, 16})));
  EXPECT_FALSE(GraphFor(small, 3, 16).has_value());
  EXPECT_EQ(GraphFor(small, 3, 4), (std::optional<GraphShape>(GraphShape{4, 4})));
  // A fixed-shape plan.
  auto fixed = PlanGraphs(GraphConfig(8, {}));
  EXPECT_EQ(GraphFor(fixed, 3, -1), (std::optional<GraphShape>(GraphShape{4, -1})));
}

}  // namespace
}  // namespace kiln

namespace chunks {

std::vector<kiln::GraphShape> Shapes(std::vector<int64_t> batches, int64_t length) {
  std::vector<kiln::GraphShape> out;
  for (int64_t b : batches) out.push_back({b, length});
  return out;
}

std::vector<int64_t> Batches(const std::vector<kiln::GraphShape>& chunks, int64_t length) {
  std::vector<int64_t> out;
  for (const auto& c : chunks) {
    EXPECT_EQ(c.length, length);
    out.push_back(c.batch);
  }
  return out;
}

TEST(PlanChunksTest, ExactSizesRunAsOneGraph) {
  auto captured = Shapes({1, 2, 4, 8, 16, 32, 48, 64}, 128);
  EXPECT_EQ(Batches(kiln::PlanChunks(captured, 32, 128), 128), (std::vector<int64_t>{32}));
  EXPECT_EQ(Batches(kiln::PlanChunks(captured, 1, 128), 128), (std::vector<int64_t>{1}));
}

TEST(PlanChunksTest, PadsOnlyWhenAtMostAQuarterIsPadding) {
  auto captured = Shapes({1, 2, 4, 8, 16, 32, 48, 64}, 128);
  // 40 -> 48 wastes 8/48: one padded graph.
  EXPECT_EQ(Batches(kiln::PlanChunks(captured, 40, 128), 128), (std::vector<int64_t>{48}));
  // 35 -> 48 would waste 13/48: 32 then 3 padded into 4.
  EXPECT_EQ(Batches(kiln::PlanChunks(captured, 35, 128), 128), (std::vector<int64_t>{32, 4}));
  // 5 -> 8 would waste 3/8: 4 then 1.
  EXPECT_EQ(Batches(kiln::PlanChunks(captured, 5, 128), 128), (std::vector<int64_t>{4, 1}));
}

TEST(PlanChunksTest, MoreRowsThanTheLargestGraphRunAsSeveral) {
  auto captured = Shapes({2, 4}, 4096);
  EXPECT_EQ(Batches(kiln::PlanChunks(captured, 11, 4096), 4096), (std::vector<int64_t>{4, 4, 4}));  // 3 left: 4 is a quarter padding
  // Fewer rows left than the smallest graph: padded into it.
  EXPECT_EQ(Batches(kiln::PlanChunks(captured, 1, 4096), 4096), (std::vector<int64_t>{2}));
}

TEST(PlanChunksTest, EveryRowIsCoveredExactlyOnce) {
  auto captured = Shapes({1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128}, 64);
  for (int64_t rows = 1; rows <= 300; ++rows) {
    auto plan = kiln::PlanChunks(captured, rows, 64);
    ASSERT_FALSE(plan.empty()) << rows;
    int64_t covered = 0;
    for (size_t i = 0; i < plan.size(); ++i) {
      int64_t take = std::min(plan[i].batch, rows - covered);
      ASSERT_GT(take, 0) << "rows " << rows << ": chunk " << i << " takes nothing";
      covered += take;
    }
    EXPECT_EQ(covered, rows);
  }
}

TEST(PlanChunksTest, NoGraphAtThisLengthMeansNoPlan) {
  auto captured = Shapes({1, 2, 4}, 128);
  EXPECT_TRUE(kiln::PlanChunks(captured, 3, 256).empty());
  EXPECT_TRUE(kiln::PlanChunks({}, 3, 128).empty());
  EXPECT_TRUE(kiln::PlanChunks(captured, 0, 128).empty());
}

}  // namespace chunks
