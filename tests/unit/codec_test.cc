// Request decoding (gRPC and REST JSON), response encoding, and the engine's request
// validation, with a fake in-process backend.
#include <atomic>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <random>

#include "gtest/gtest.h"
#include "runtime/grpc_frontend.h"
#include "runtime/inference_engine.h"
#include "runtime/json_codec.h"

namespace kiln {
namespace {

constexpr int64_t kLimit = 1 << 20;

TEST(GrpcDecodeTest, TypedAndRawContents) {
  inference::ModelInferRequest req;
  req.set_model_name("m");
  req.set_id("r1");
  auto* in = req.add_inputs();
  in->set_name("x");
  in->set_datatype("INT32");
  in->add_shape(1);
  in->add_shape(3);
  for (int v : {1, -2, 3}) in->mutable_contents()->add_int_contents(v);
  (*req.mutable_parameters())["priority"].set_int64_param(1);
  (*req.mutable_parameters())["timeout"].set_int64_param(5000);
  auto r = DecodeInferRequest(req, kLimit);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->priority, 1);
  EXPECT_EQ(r->timeout_micros, 5000);
  ASSERT_EQ(r->inputs[0].data.size(), 12u);
  int32_t v[3];
  std::memcpy(v, r->inputs[0].data.data(), 12);
  EXPECT_EQ(v[1], -2);

  in->clear_contents();
  req.add_raw_input_contents(std::string(reinterpret_cast<const char*>(v), 12));
  auto raw = DecodeInferRequest(req, kLimit);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(raw->inputs[0].data, std::string(reinterpret_cast<const char*>(v), 12));
}

TEST(GrpcDecodeTest, RejectsBadInputs) {
  inference::ModelInferRequest req;
  req.set_model_name("m");
  auto* in = req.add_inputs();
  in->set_name("x");
  in->set_datatype("INT8");
  in->add_shape(2);
  in->mutable_contents()->add_int_contents(1);
  in->mutable_contents()->add_int_contents(300);  // out of INT8 range
  auto s = DecodeInferRequest(req, kLimit).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("out of range"), std::string::npos);

  in->mutable_contents()->clear_int_contents();
  in->mutable_contents()->add_int_contents(1);
  s = DecodeInferRequest(req, kLimit).status();
  EXPECT_NE(s.message().find("expected 2 elements"), std::string::npos) << s;

  in->set_datatype("FP16");
  s = DecodeInferRequest(req, kLimit).status();
  EXPECT_NE(s.message().find("raw_input_contents"), std::string::npos) << s;

  in->set_datatype("STRING");
  EXPECT_EQ(DecodeInferRequest(req, kLimit).status().code(), absl::StatusCode::kInvalidArgument);

  in->set_datatype("FP32");
  in->clear_contents();
  req.add_raw_input_contents(std::string(7, '\0'));
  s = DecodeInferRequest(req, kLimit).status();
  EXPECT_NE(s.message().find("expected 8 bytes"), std::string::npos) << s;

  // A huge declared shape is refused before anything is allocated.
  in->clear_shape();
  in->add_shape(1 << 30);
  s = DecodeInferRequest(req, kLimit).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);

  in->clear_shape();
  in->add_shape(-3);
  EXPECT_EQ(DecodeInferRequest(req, kLimit).status().code(), absl::StatusCode::kInvalidArgument);

  req.add_raw_input_contents("extra");
  EXPECT_NE(DecodeInferRequest(req, kLimit).status().message().find("raw_input_contents has 2"),
            std::string::npos);

  inference::ModelInferRequest bad_param;
  bad_param.add_inputs()->set_name("x");
  (*bad_param.mutable_parameters())["priority"].set_string_param("high");
  EXPECT_NE(DecodeInferRequest(bad_param, kLimit).status().message().find("priority"),
            std::string::npos);

  // kiln-skip-cache: a bool, off unless given.
  inference::ModelInferRequest skip;
  skip.set_model_name("m");
  auto* x = skip.add_inputs();
  x->set_name("x");
  x->set_datatype("INT32");
  x->add_shape(1);
  x->mutable_contents()->add_int_contents(1);
  ASSERT_TRUE(DecodeInferRequest(skip, kLimit).ok());
  EXPECT_FALSE(DecodeInferRequest(skip, kLimit)->skip_cache);
  (*skip.mutable_parameters())["kiln-skip-cache"].set_bool_param(true);
  ASSERT_TRUE(DecodeInferRequest(skip, kLimit).ok());
  EXPECT_TRUE(DecodeInferRequest(skip, kLimit)->skip_cache);
  (*skip.mutable_parameters())["kiln-skip-cache"].set_int64_param(1);
  EXPECT_EQ(DecodeInferRequest(skip, kLimit).status().message(),
            "parameter 'kiln-skip-cache': must be a bool");
}

TEST(GrpcEncodeTest, TypedRawAndHalf) {
  InferResponse resp;
  resp.model_name = "m";
  resp.model_version = "3";
  resp.id = "r";
  Tensor t;
  t.name = "y";
  t.dtype = DataType::kFp32;
  t.shape = {1, 2};
  float f[2] = {1.5f, -2.0f};
  t.data.assign(reinterpret_cast<const char*>(f), 8);
  resp.outputs.push_back(t);
  inference::ModelInferResponse typed;
  ASSERT_TRUE(EncodeInferResponse(resp, false, &typed).ok());
  EXPECT_EQ(typed.model_version(), "3");
  ASSERT_EQ(typed.outputs(0).contents().fp32_contents_size(), 2);
  EXPECT_EQ(typed.outputs(0).contents().fp32_contents(1), -2.0f);
  EXPECT_EQ(typed.raw_output_contents_size(), 0);

  inference::ModelInferResponse raw;
  ASSERT_TRUE(EncodeInferResponse(resp, true, &raw).ok());
  EXPECT_EQ(raw.raw_output_contents(0), t.data);

  resp.outputs[0].dtype = DataType::kFp16;
  resp.outputs[0].data.resize(4);
  inference::ModelInferResponse half;
  ASSERT_TRUE(EncodeInferResponse(resp, false, &half).ok());
  EXPECT_EQ(half.raw_output_contents_size(), 1);  // FP16 has no typed field
}

TEST(JsonDecodeTest, NestedAndFlatData) {
  std::string body = R"({"id":"q","parameters":{"priority":2,"custom":"kept"},
    "inputs":[{"name":"x","shape":[2,2],"datatype":"FP32","data":[[1,2],[3,4.5]]},
              {"name":"b","shape":[2],"datatype":"BOOL","data":[true,false]},
              {"name":"h","shape":[1],"datatype":"FP16","data":[0.5]}],
    "outputs":[{"name":"y"}]})";
  nlohmann::json params;
  auto r = DecodeJsonInferRequest(body, "m", "1", kLimit, &params);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->id, "q");
  EXPECT_EQ(r->priority, 2);
  EXPECT_FALSE(r->skip_cache);
  EXPECT_EQ(params["custom"], "kept");
  float v[4];
  std::memcpy(v, r->inputs[0].data.data(), 16);
  EXPECT_EQ(v[3], 4.5f);
  EXPECT_EQ(r->inputs[1].data, std::string("\x01\x00", 2));
  uint16_t h;
  std::memcpy(&h, r->inputs[2].data.data(), 2);
  EXPECT_EQ(HalfToFloat(h), 0.5f);
  EXPECT_EQ(r->outputs, (std::vector<std::string>{"y"}));
}

// FP32's extremes as clients print them (the shortest text that rounds to them) are its
// extremes; half an ulp past the largest rounds to infinity and is refused.
TEST(JsonDecodeTest, Fp32ExtremesInTheirShortestTextAreTaken) {
  auto r = DecodeJsonInferRequest(
      R"({"inputs":[{"name":"x","shape":[3],"datatype":"FP32","data":[-3.4028235e38,3.4028235e38,3.4028235677973362e38]}]})",
      "m", "", kLimit, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  float v[3];
  std::memcpy(v, r->inputs[0].data.data(), sizeof(v));
  EXPECT_EQ(v[0], std::numeric_limits<float>::lowest());
  EXPECT_EQ(v[1], std::numeric_limits<float>::max());
  EXPECT_EQ(v[2], std::numeric_limits<float>::max());
  auto past = DecodeJsonInferRequest(
      R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[-3.4028235677973366e38]}]})",
      "m", "", kLimit, nullptr);
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.status().message().find("within FP32's range"), std::string::npos) << past.status();
}

// Data after their input's datatype and shape are decoded while the body is read; data
// before them afterwards, from the document. Both give the same tensors and the same errors.
TEST(JsonDecodeTest, DataBeforeOrAfterTheirDatatypeAndShapeDecodeTheSame) {
  struct Input {
    std::string name, datatype, shape, data;
  };
  const std::vector<Input> inputs = {
      {"x", "FP32", "[2,2]", "[[1,2],[3,4.5]]"},
      {"i", "INT64", "[3]", "[-9007199254740993,0,9223372036854775807]"},
      {"u", "UINT8", "[2]", "[0,255]"},
      {"b", "BOOL", "[2]", "[true,false]"},
      {"h", "FP16", "[1]", "0.5"},
      {"d", "FP64", "[1,2]", "[1e300,-2.5]"},
  };
  auto body = [&](bool data_first) {
    std::string b = R"({"inputs":[)";
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Input& in = inputs[i];
      const std::string meta = R"("name":")" + in.name + R"(","datatype":")" + in.datatype +
                               R"(","shape":)" + in.shape;
      b += (i ? "," : "") + std::string("{") +
           (data_first ? R"("data":)" + in.data + "," + meta : meta + R"(,"data":)" + in.data) +
           "}";
    }
    return b + "]}";
  };
  auto after = DecodeJsonInferRequest(body(false), "m", "1", kLimit, nullptr);
  auto before = DecodeJsonInferRequest(body(true), "m", "1", kLimit, nullptr);
  ASSERT_TRUE(after.ok()) << after.status();
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(after->inputs.size(), inputs.size());
  ASSERT_EQ(before->inputs.size(), inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_EQ(after->inputs[i].name, inputs[i].name);
    EXPECT_EQ(after->inputs[i].dtype, before->inputs[i].dtype) << inputs[i].name;
    EXPECT_EQ(after->inputs[i].shape, before->inputs[i].shape) << inputs[i].name;
    EXPECT_EQ(after->inputs[i].data, before->inputs[i].data) << inputs[i].name;
  }
  int64_t i64[3];
  std::memcpy(i64, after->inputs[1].data.data(), sizeof(i64));
  EXPECT_EQ(i64[0], -9007199254740993);
  EXPECT_EQ(i64[2], std::numeric_limits<int64_t>::max());
  EXPECT_EQ(after->inputs[2].data, std::string("\x00\xff", 2));

  // The same bad data, read either way, gets the same error.
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"("shape":[3],"datatype":"FP32")", "[1,2]"},
      {R"("shape":[1],"datatype":"FP32")", "[1,2]"},
      {R"("shape":[2],"datatype":"FP32")", "[[1],[2]]"},
      {R"("shape":[1],"datatype":"INT32")", "[1.5]"},
      {R"("shape":[1],"datatype":"UINT8")", "[256]"},
      {R"("shape":[1],"datatype":"INT64")", R"(["7"])"},
      {R"("shape":[1],"datatype":"BOOL")", "[1]"},
      {R"("shape":[1],"datatype":"FP32")", "[null]"},
      {R"("shape":[1],"datatype":"FP32")", R"([{"v":1}])"},
  };
  for (const auto& [meta, data] : bad) {
    auto a = DecodeJsonInferRequest(R"({"inputs":[{"name":"x",)" + meta + R"(,"data":)" + data +
                                        "}]}",
                                    "m", "", kLimit, nullptr);
    auto b = DecodeJsonInferRequest(R"({"inputs":[{"data":)" + data + R"(,"name":"x",)" + meta +
                                        "}]}",
                                    "m", "", kLimit, nullptr);
    ASSERT_FALSE(a.ok()) << meta << " " << data;
    EXPECT_EQ(a.status(), b.status()) << meta << " " << data;
  }
}

TEST(JsonDecodeTest, DataOrItsDatatypeGivenTwiceIsRefused) {
  auto twice = DecodeJsonInferRequest(
      R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1],"data":[2]}]})", "m", "",
      kLimit, nullptr);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(twice.status().message().find("inputs[0].data: given twice"), std::string::npos)
      << twice.status();
  auto twice_in_document = DecodeJsonInferRequest(
      R"({"inputs":[{"data":[1],"name":"x","shape":[1],"datatype":"FP32","data":[2]}]})", "m", "",
      kLimit, nullptr);
  EXPECT_NE(twice_in_document.status().message().find("inputs[0].data: given twice"),
            std::string::npos)
      << twice_in_document.status();
  // Two "inputs" at the root: the last is the request's, as a JSON document keeps it.
  auto last = DecodeJsonInferRequest(
      R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}],
          "inputs":[{"name":"y","shape":[1],"datatype":"FP32","data":[2]}]})",
      "m", "", kLimit, nullptr);
  ASSERT_TRUE(last.ok()) << last.status();
  ASSERT_EQ(last->inputs.size(), 1u);
  EXPECT_EQ(last->inputs[0].name, "y");
  float y;
  std::memcpy(&y, last->inputs[0].data.data(), sizeof(y));
  EXPECT_EQ(y, 2.0f);
  auto retyped = DecodeJsonInferRequest(
      R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1],"datatype":"INT32"}]})",
      "m", "", kLimit, nullptr);
  EXPECT_EQ(retyped.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(retyped.status().message().find("inputs[0]: datatype and shape must each be given once"),
            std::string::npos)
      << retyped.status();
}

// Bad data decoded while read are reported where the request's checks reach them, after the
// fields and inputs before them, as when the data are decoded from the document.
TEST(JsonDecodeTest, ErrorsInDataReadDirectlyKeepTheirPlaceInTheChecks) {
  auto id_first = DecodeJsonInferRequest(
      R"({"inputs":[{"name":"x","shape":[1],"datatype":"INT32","data":[1.5]}],"id":5})", "m", "",
      kLimit, nullptr);
  EXPECT_NE(id_first.status().message().find("id: must be a string"), std::string::npos)
      << id_first.status();
  auto limit_first = DecodeJsonInferRequest(
      R"({"inputs":[{"name":"a","shape":[100000000],"datatype":"FP32","data":[1]},
                    {"name":"b","shape":[1],"datatype":"INT32","data":[1.5]}]})",
      "m", "", kLimit, nullptr);
  EXPECT_EQ(limit_first.status().code(), absl::StatusCode::kResourceExhausted)
      << limit_first.status();
  auto earlier_input_first = DecodeJsonInferRequest(
      R"({"inputs":[{"name":"a","shape":[1],"datatype":"FP32","data":[1],"parameters":{"binary_data_size":4}},
                    {"name":"b","shape":[1],"datatype":"INT32","data":[1.5]}]})",
      "m", "", kLimit, nullptr);
  EXPECT_NE(earlier_input_first.status().message().find("binary data extension"),
            std::string::npos)
      << earlier_input_first.status();
  auto invalid_json = DecodeJsonInferRequest(
      R"({"inputs":[{"name":"b","shape":[1],"datatype":"INT32","data":[1.5]}], oops)", "m", "",
      kLimit, nullptr);
  EXPECT_NE(invalid_json.status().message().find("not valid JSON"), std::string::npos)
      << invalid_json.status();
}

TEST(JsonDecodeTest, DatatypesTakeOneTritonPrefixAndLongOnesAreNotEchoed) {
  EXPECT_EQ(*ParseDataType("TYPE_FP32", "d"), DataType::kFp32);
  EXPECT_FALSE(ParseDataType("TYPE_TYPE_FP32", "d").ok());
  std::string prefixes;
  for (int i = 0; i < 100000; ++i) prefixes += "TYPE_";
  auto deep = ParseDataType(prefixes + "FP32", "inputs[0].datatype");
  ASSERT_FALSE(deep.ok());
  EXPECT_LT(deep.status().message().size(), 300u) << deep.status().message().substr(0, 300);
  auto r = DecodeJsonInferRequest(
      R"({"inputs":[{"name":"x","shape":[1],"datatype":")" + prefixes + R"(FP32","data":[1]}]})",
      "m", "", kLimit, nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(r.status().message().size(), 300u);
}

TEST(JsonDecodeTest, RejectsBadBodies) {
  struct Case {
    std::string body;
    std::string expect;
  };
  std::vector<Case> cases = {
      {"not json", "not valid JSON"},
      {"[1,2]", "JSON object"},
      {R"({"inputs":[]})", "inputs: must be a non-empty array"},
      {R"({"inputs":[{"shape":[1],"datatype":"FP32","data":[1]}]})", "inputs[0].name"},
      {R"({"inputs":[{"name":"x","shape":[1],"data":[1]}]})", "inputs[0].datatype"},
      {R"({"inputs":[{"name":"x","shape":"1","datatype":"FP32","data":[1]}]})", "inputs[0].shape"},
      {R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP32"}]})", "inputs[0].data: is missing"},
      {R"({"inputs":[{"name":"x","shape":[3],"datatype":"FP32","data":[1,2]}]})", "expected 3 elements"},
      {R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1,2]}]})", "more than the 1"},
      {R"({"inputs":[{"name":"x","shape":[1],"datatype":"INT32","data":[1.5]}]})", "an integer"},
      {R"({"inputs":[{"name":"x","shape":[1],"datatype":"UINT8","data":[256]}]})", "range"},
      {R"({"inputs":[{"name":"x","shape":[1],"datatype":"INT64","data":["7"]}]})", "an integer"},
      {R"({"inputs":[{"name":"x","shape":[1],"datatype":"BOOL","data":[1]}]})", "true or false"},
      {R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[null]}]})", "a number"},
      {R"({"id":5,"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]})", "id: must be a string"},
      {R"({"parameters":{"timeout":"soon"},"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]})", "parameters.timeout"},
      {R"({"parameters":{"kiln-skip-cache":1},"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]})", "parameters.kiln-skip-cache: must be a boolean"},
      // A complete but bad header: its data are skipped unread (nesting deeper than any shape
      // is not what is reported), and the header is.
      {R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP99","data":[[[[[1]]]]]}]})", "FP99"},
      {R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP99","data":[1],"datatype":"FP32"}]})", "inputs[0]: datatype and shape must each be given once"},
      // More elements than the body could hold: refused before the tensor is made, whichever
      // comes first, the data or the header.
      {R"({"inputs":[{"name":"x","shape":[100000],"datatype":"FP32","data":[]}]})", "input 'x': expected 100000 elements for shape [100000], more than a body of"},
      {R"({"inputs":[{"data":[1],"name":"x","shape":[100000],"datatype":"FP32"}]})", "more than a body of"},
      // JSON has no infinities: past a float type's range is refused.
      {R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1e39]}]})", "input 'x': data[0] must be a number within FP32's range"},
      {R"({"inputs":[{"name":"x","shape":[2],"datatype":"FP16","data":[65504, 70000]}]})", "data[1] must be a number within FP16's range"},
      {R"({"inputs":[{"name":"x","shape":[1],"datatype":"BF16","data":[-1e39]}]})", "within BF16's range"},
      {R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}],"outputs":[{"name":"y","parameters":{"classification":2}}]})", "outputs[0].parameters.classification: not supported"},
      {R"({"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}],"outputs":[{"nom":"y"}]})", "outputs[0].name"},
  };
  for (const auto& c : cases) {
    auto r = DecodeJsonInferRequest(c.body, "m", "", kLimit, nullptr);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos)
        << c.body << " -> " << r.status().message();
  }
  auto huge = DecodeJsonInferRequest(
      R"({"inputs":[{"name":"x","shape":[100000000],"datatype":"FP32","data":[1]}]})", "m", "",
      kLimit, nullptr);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(JsonDecodeTest, SizesThatWouldOverflowAndDeepNestingAreRefused) {
  // The second input's byte size would overflow the running total.
  auto overflow = DecodeJsonInferRequest(
      R"({"inputs":[{"name":"a","datatype":"FP32","shape":[4],"data":[1,2,3,4]},
                    {"name":"b","datatype":"FP64","shape":[1152921504606846975],"data":[1]}]})",
      "m", "", kLimit, nullptr);
  EXPECT_EQ(overflow.status().code(), absl::StatusCode::kResourceExhausted);
  std::string deep = R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":)";
  for (int i = 0; i < 100000; ++i) deep += "[";
  deep += "1";
  for (int i = 0; i < 100000; ++i) deep += "]";
  deep += "}]}";
  auto d = DecodeJsonInferRequest(deep, "m", "", kLimit, nullptr);
  EXPECT_NE(d.status().message().find("nested deeper than its 1-dimensional shape"),
            std::string::npos) << d.status();
  auto nested_param = DecodeJsonInferRequest(
      R"({"parameters":{"x":{"y":[1]}},"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1]}]})",
      "m", "", kLimit, nullptr);
  EXPECT_NE(nested_param.status().message().find("parameters.x"), std::string::npos);
  // A rank of 33 is refused, and by its rank, before the data is walked.
  std::string rank33 = R"({"inputs":[{"name":"x","datatype":"FP32","shape":[)";
  for (int i = 0; i < 33; ++i) rank33 += i ? ",1" : "1";
  rank33 += R"(],"data":)" + std::string(33, '[') + "1" + std::string(33, ']') + "}]}";
  auto r = DecodeJsonInferRequest(rank33, "m", "", kLimit, nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("inputs[0].shape: has 33 dimensions, more than the 32"),
            std::string::npos) << r.status();
  std::string rank32 = R"({"inputs":[{"name":"x","datatype":"FP32","shape":[)";
  for (int i = 0; i < 32; ++i) rank32 += i ? ",1" : "1";
  rank32 += R"(],"data":)" + std::string(32, '[') + "1" + std::string(32, ']') + "}]}";
  EXPECT_TRUE(DecodeJsonInferRequest(rank32, "m", "", kLimit, nullptr).ok());
}

// Found by review: inputs the decoder let through to the model, or answered unclearly.
TEST(GrpcDecodeTest, BadBoolsZeroDimensionsOutputParametersAndDeadlinesAreRefused) {
  auto bools = [](const std::string& raw) {
    inference::ModelInferRequest req;
    req.set_model_name("m");
    auto* in = req.add_inputs();
    in->set_name("flags");
    in->set_datatype("BOOL");
    in->add_shape(static_cast<int64_t>(raw.size()));
    req.add_raw_input_contents(raw);
    return req;
  };
  EXPECT_TRUE(DecodeInferRequest(bools(std::string("\x00\x01\x01", 3)), kLimit).ok());
  EXPECT_EQ(DecodeInferRequest(bools(std::string("\x00\x02", 2)), kLimit).status().message(),
            "input 'flags': raw_input_contents byte 1 is 2; a BOOL is 0 or 1");

  // A zero elsewhere in the shape does not let a dimension past the size limit through.
  inference::ModelInferRequest zero;
  auto* z = zero.add_inputs();
  z->set_name("z");
  z->set_datatype("FP32");
  for (int64_t d : {1LL, 0LL, 1LL << 62, 4LL}) z->add_shape(d);
  auto zr = DecodeInferRequest(zero, kLimit);
  EXPECT_EQ(zr.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(zr.status().message().find("is too large"), std::string::npos) << zr.status();

  inference::ModelInferRequest classify = bools(std::string("\x01", 1));
  (*classify.add_outputs()->mutable_parameters())["classification"].set_int64_param(3);
  EXPECT_EQ(DecodeInferRequest(classify, kLimit).status().message(),
            "outputs[0].parameters.classification: not supported");

  InferRequest r;
  EXPECT_EQ(NoteCallerDeadline(-1, &r).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.caller_time_left_micros, 0);
}

TEST(GrpcDecodeTest, SizesThatWouldOverflowAreRefused) {
  inference::ModelInferRequest req;
  auto* a = req.add_inputs();
  a->set_name("a");
  a->set_datatype("FP32");
  a->add_shape(1);
  a->mutable_contents()->add_fp32_contents(1);
  auto* b = req.add_inputs();
  b->set_name("b");
  b->set_datatype("FP64");
  b->add_shape(1152921504606846975LL);
  EXPECT_EQ(DecodeInferRequest(req, kLimit).status().code(), absl::StatusCode::kResourceExhausted);

  inference::ModelInferRequest deep;
  auto* x = deep.add_inputs();
  x->set_name("x");
  x->set_datatype("FP32");
  for (int i = 0; i < 33; ++i) x->add_shape(1);
  x->mutable_contents()->add_fp32_contents(1);
  auto d = DecodeInferRequest(deep, kLimit);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("33 dimensions, more than the 32 allowed"),
            std::string::npos) << d.status();
}

TEST(JsonEncodeTest, EchoesIdAndParameters) {
  InferResponse resp;
  resp.model_name = "m";
  resp.model_version = "1";
  resp.id = "q";
  Tensor t;
  t.name = "y";
  t.dtype = DataType::kInt64;
  t.shape = {2};
  int64_t v[2] = {7, -9};
  t.data.assign(reinterpret_cast<const char*>(v), 16);
  resp.outputs.push_back(t);
  auto j = nlohmann::json::parse(EncodeJsonInferResponse(resp, {{"custom", 1}}));
  EXPECT_EQ(j["id"], "q");
  EXPECT_EQ(j["model_version"], "1");
  EXPECT_EQ(j["parameters"]["custom"], 1);
  EXPECT_EQ(j["outputs"][0]["datatype"], "INT64");
  EXPECT_EQ(j["outputs"][0]["data"][1], -9);
  EXPECT_EQ(j["outputs"][0]["shape"][0], 2);
}

template <typename T>
Tensor Output(const std::string& name, DataType dtype, const std::vector<T>& values) {
  Tensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = {static_cast<int64_t>(values.size())};
  t.data.assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
  return t;
}

// The response is written as text directly: each datatype's numbers, floats in their own
// shortest form (".0" kept on whole ones, as json::dump writes them), NaN and infinities as
// null, strings escaped with bytes that are not UTF-8 replaced, keys in json::dump's order.
TEST(JsonEncodeTest, WritesEachDatatypeExactly) {
  InferResponse resp;
  resp.model_name = "m";
  resp.model_version = "2";
  resp.id = std::string("a\"b\x01\xff", 5);
  const float inf = std::numeric_limits<float>::infinity();
  resp.outputs.push_back(Output<float>(
      "f32", DataType::kFp32,
      {0.1f, -0.0f, 2.0f, 1e-8f, 3.4028235e38f, std::nanf(""), -inf, 1e-45f, 16777216.0f}));
  resp.outputs.push_back(
      Output<double>("f64", DataType::kFp64, {0.1, 1e300, -2.5, 5e-324, 2.0, 1e6}));
  // Half: 1, 1/3 rounded, 65504 (the largest), infinity. Bfloat16: 1, -0.5, NaN.
  resp.outputs.push_back(
      Output<uint16_t>("f16", DataType::kFp16, {0x3C00, 0x3555, 0x7BFF, 0x7C00}));
  resp.outputs.push_back(Output<uint16_t>("bf16", DataType::kBf16, {0x3F80, 0xBF00, 0x7FC0}));
  resp.outputs.push_back(Output<int8_t>("i8", DataType::kInt8, {-128, 127}));
  resp.outputs.push_back(Output<int16_t>("i16", DataType::kInt16, {-32768, 32767}));
  resp.outputs.push_back(Output<int32_t>("i32", DataType::kInt32, {-2147483647 - 1, 7}));
  resp.outputs.push_back(Output<uint8_t>("u8", DataType::kUint8, {255, 0}));
  resp.outputs.push_back(Output<uint16_t>("u16", DataType::kUint16, {65535}));
  resp.outputs.push_back(Output<uint32_t>("u32", DataType::kUint32, {4294967295u}));
  resp.outputs.push_back(Output<int64_t>(
      "i64", DataType::kInt64, {std::numeric_limits<int64_t>::min(), 0}));
  resp.outputs.push_back(Output<uint64_t>(
      "u64", DataType::kUint64, {std::numeric_limits<uint64_t>::max()}));
  resp.outputs.push_back(Output<uint8_t>("b", DataType::kBool, {1, 0}));
  resp.outputs.back().shape = {1, 2};
  const std::string text = EncodeJsonInferResponse(resp, {{"custom", "x"}});
  EXPECT_EQ(text,
            "{\"id\":\"a\\\"b\\u0001\xef\xbf\xbd\",\"model_name\":\"m\",\"model_version\":\"2\","
            "\"outputs\":["
            "{\"data\":[0.1,-0.0,2.0,1e-08,3.4028235e+38,null,null,1e-45,16777216.0],"
            "\"datatype\":\"FP32\",\"name\":\"f32\",\"shape\":[9]},"
            "{\"data\":[0.1,1e+300,-2.5,5e-324,2.0,1e+06],\"datatype\":\"FP64\",\"name\":\"f64\","
            "\"shape\":[6]},"
            "{\"data\":[1.0,0.33325195,65504.0,null],\"datatype\":\"FP16\",\"name\":\"f16\","
            "\"shape\":[4]},"
            "{\"data\":[1.0,-0.5,null],\"datatype\":\"BF16\",\"name\":\"bf16\",\"shape\":[3]},"
            "{\"data\":[-128,127],\"datatype\":\"INT8\",\"name\":\"i8\",\"shape\":[2]},"
            "{\"data\":[-32768,32767],\"datatype\":\"INT16\",\"name\":\"i16\",\"shape\":[2]},"
            "{\"data\":[-2147483648,7],\"datatype\":\"INT32\",\"name\":\"i32\",\"shape\":[2]},"
            "{\"data\":[255,0],\"datatype\":\"UINT8\",\"name\":\"u8\",\"shape\":[2]},"
            "{\"data\":[65535],\"datatype\":\"UINT16\",\"name\":\"u16\",\"shape\":[1]},"
            "{\"data\":[4294967295],\"datatype\":\"UINT32\",\"name\":\"u32\",\"shape\":[1]},"
            "{\"data\":[-9223372036854775808,0],\"datatype\":\"INT64\",\"name\":\"i64\",\"shape\":[2]},"
            "{\"data\":[18446744073709551615],\"datatype\":\"UINT64\",\"name\":\"u64\",\"shape\":[1]},"
            "{\"data\":[true,false],\"datatype\":\"BOOL\",\"name\":\"b\",\"shape\":[1,2]}],"
            "\"parameters\":{\"custom\":\"x\"}}");
  // Without id or parameters, neither key is written; an output with no elements is [].
  InferResponse bare;
  bare.model_name = "m";
  bare.model_version = "1";
  bare.outputs.push_back(Output<float>("e", DataType::kFp32, {}));
  EXPECT_EQ(EncodeJsonInferResponse(bare, nullptr),
            "{\"model_name\":\"m\",\"model_version\":\"1\",\"outputs\":[{\"data\":[],"
            "\"datatype\":\"FP32\",\"name\":\"e\",\"shape\":[0]}]}");
}

// Every finite float and double written reads back as the same bits (random bit patterns,
// denormals included), read as most clients read JSON: a double, narrowed for FP32. Among them
// the one positive float whose shortest form would not come back that way (it would be one step
// off through the double) and its negative.
TEST(JsonEncodeTest, FloatsReadBackAsTheSameBits) {
  std::mt19937_64 rng(5);
  std::vector<float> floats;
  for (uint32_t bits : {0x15AE43FDu, 0x95AE43FDu}) {
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    floats.push_back(f);
  }
  std::vector<double> doubles;
  while (floats.size() < 20000) {
    const uint64_t bits = rng();
    float f;
    const uint32_t low = static_cast<uint32_t>(bits);
    std::memcpy(&f, &low, sizeof(f));
    double d;
    std::memcpy(&d, &bits, sizeof(d));
    if (std::isfinite(f)) floats.push_back(f);
    if (std::isfinite(d)) doubles.push_back(d);
  }
  InferResponse resp;
  resp.outputs.push_back(Output<float>("f", DataType::kFp32, floats));
  resp.outputs.push_back(Output<double>("d", DataType::kFp64, doubles));
  const auto j = nlohmann::json::parse(EncodeJsonInferResponse(resp, nullptr));
  const auto& f_out = j["outputs"][0]["data"];
  const auto& d_out = j["outputs"][1]["data"];
  ASSERT_EQ(f_out.size(), floats.size());
  ASSERT_EQ(d_out.size(), doubles.size());
  for (size_t i = 0; i < floats.size(); ++i) {
    const float back = static_cast<float>(f_out[i].get<double>());
    ASSERT_EQ(std::memcmp(&back, &floats[i], sizeof(float)), 0) << f_out[i].dump();
  }
  for (size_t i = 0; i < doubles.size(); ++i) {
    const double back = d_out[i].get<double>();
    ASSERT_EQ(std::memcmp(&back, &doubles[i], sizeof(double)), 0) << d_out[i].dump();
  }
}

// Doubles its FP32 input; counts calls.
class DoublingBackend : public Backend {
 public:
  explicit DoublingBackend(std::atomic<int>* calls) : calls_(calls) {}
  absl::StatusOr<std::vector<Tensor>> Execute(std::vector<Tensor> in) override {
    (*calls_)++;
    Tensor out = in[0];
    out.name = "y";
    auto* f = reinterpret_cast<float*>(out.data.data());
    for (int64_t i = 0; i < out.elements(); ++i) f[i] *= 2;
    return std::vector<Tensor>{out};
  }
  std::string device() const override { return "cpu"; }

 private:
  std::atomic<int>* calls_;
};

// Model "m": FP32 input x and output y of 2 per row, batches of up to 4; no batching delay,
// no cache.
ModelConfig EngineConfig() {
  ModelConfig c;
  c.name = "m";
  c.backend = "fake";
  c.max_batch_size = 4;
  c.inputs = {{"x", DataType::kFp32, {2}}};
  c.outputs = {{"y", DataType::kFp32, {2}}};
  return c;
}

// A request to model "m" with input x of `shape` holding `v`.
InferRequest FloatRequest(std::vector<int64_t> shape, std::vector<float> v) {
  InferRequest r;
  r.model_name = "m";
  Tensor t;
  t.name = "x";
  t.dtype = DataType::kFp32;
  t.shape = std::move(shape);
  t.data.assign(reinterpret_cast<const char*>(v.data()), v.size() * 4);
  r.inputs.push_back(t);
  return r;
}

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = EngineConfig();
    config_.dynamic_batching = DynamicBatchingConfig{};
    config_.response_cache.enable = true;
    auto e = InferenceEngine::Create(config_, "1", std::make_unique<DoublingBackend>(&calls_),
                                     &lifecycle_, &clock_);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
    ASSERT_TRUE(lifecycle_.Transition(RuntimeState::kWarm, "test").ok());
  }

  RealClock clock_;
  Lifecycle lifecycle_{&clock_};
  ModelConfig config_;
  std::atomic<int> calls_{0};
  std::unique_ptr<InferenceEngine> engine_;
};

TEST_F(EngineTest, WarmRefusesThenServingAnswersAndCaches) {
  auto warm = engine_->InferSync(FloatRequest({1, 2}, {1, 2}));
  EXPECT_EQ(warm.status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(lifecycle_.Transition(RuntimeState::kServing, "test").ok());
  auto r = engine_->InferSync(FloatRequest({1, 2}, {1, 2}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model_version, "1");
  EXPECT_FALSE(r->cache_hit);
  const float* y = reinterpret_cast<const float*>(r->outputs[0].data.data());
  EXPECT_EQ(y[1], 4.0f);
  auto again = engine_->InferSync(FloatRequest({1, 2}, {1, 2}));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->cache_hit);
  EXPECT_EQ(calls_.load(), 1);
  EXPECT_EQ(engine_->Stats().cache.hits, 1u);
}

// kiln-skip-cache: the request runs the model even when the cache holds its answer, and leaves
// nothing in the cache.
TEST_F(EngineTest, SkipCacheRunsTheModelAndStoresNothing) {
  ASSERT_TRUE(lifecycle_.Transition(RuntimeState::kServing, "test").ok());
  auto skipping = [] {
    InferRequest r = FloatRequest({1, 2}, {1, 2});
    r.skip_cache = true;
    return r;
  };
  for (int i = 1; i <= 2; ++i) {
    auto r = engine_->InferSync(skipping());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->cache_hit);
    EXPECT_EQ(calls_.load(), i);
  }
  // Nothing was stored: the first ordinary request misses, the next one hits.
  auto first = engine_->InferSync(FloatRequest({1, 2}, {1, 2}));
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(first->cache_hit);
  EXPECT_EQ(calls_.load(), 3);
  auto second = engine_->InferSync(FloatRequest({1, 2}, {1, 2}));
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(second->cache_hit);
  // And with the answer cached, a skipping request still runs the model.
  auto third = engine_->InferSync(skipping());
  ASSERT_TRUE(third.ok());
  EXPECT_FALSE(third->cache_hit);
  EXPECT_EQ(calls_.load(), 4);
  EXPECT_EQ(engine_->Stats().cache.hits, 1u);
  EXPECT_EQ(engine_->Stats().cache.misses, 1u);
}

TEST_F(EngineTest, ValidationErrorsSayWhatWasExpected) {
  ASSERT_TRUE(lifecycle_.Transition(RuntimeState::kServing, "test").ok());
  struct Case {
    InferRequest req;
    absl::StatusCode code;
    std::string expect;
  };
  std::vector<Case> cases;
  auto wrong_model = FloatRequest({1, 2}, {1, 2});
  wrong_model.model_name = "other";
  cases.push_back({wrong_model, absl::StatusCode::kNotFound, "unknown model 'other'"});
  auto wrong_version = FloatRequest({1, 2}, {1, 2});
  wrong_version.model_version = "9";
  cases.push_back({wrong_version, absl::StatusCode::kNotFound, "unknown version '9'"});
  auto wrong_name = FloatRequest({1, 2}, {1, 2});
  wrong_name.inputs[0].name = "z";
  cases.push_back({wrong_name, absl::StatusCode::kInvalidArgument, "unknown input 'z' (expected: x)"});
  auto wrong_type = FloatRequest({1, 2}, {1, 2});
  wrong_type.inputs[0].dtype = DataType::kInt32;
  cases.push_back({wrong_type, absl::StatusCode::kInvalidArgument, "expected datatype FP32, got INT32"});
  cases.push_back({FloatRequest({1, 3}, {1, 2, 3}), absl::StatusCode::kInvalidArgument,
                   "expected shape [-1,2] (batch dimension first), got [1,3]"});
  cases.push_back(
      {FloatRequest({2}, {1, 2}), absl::StatusCode::kInvalidArgument, "expected shape"});
  cases.push_back({FloatRequest({5, 2}, std::vector<float>(10)),
                   absl::StatusCode::kInvalidArgument, "batch size 5 is outside 1..4"});
  auto short_data = FloatRequest({1, 2}, {1, 2});
  short_data.inputs[0].data.resize(4);
  cases.push_back({short_data, absl::StatusCode::kInvalidArgument, "expected 8 bytes"});
  auto twice = FloatRequest({1, 2}, {1, 2});
  twice.inputs.push_back(twice.inputs[0]);
  cases.push_back({twice, absl::StatusCode::kInvalidArgument, "given twice"});
  auto bad_output = FloatRequest({1, 2}, {1, 2});
  bad_output.outputs = {"nope"};
  cases.push_back({bad_output, absl::StatusCode::kInvalidArgument, "unknown output 'nope'"});
  auto bad_priority = FloatRequest({1, 2}, {1, 2});
  bad_priority.priority = 7;
  cases.push_back({bad_priority, absl::StatusCode::kInvalidArgument, "priority"});
  InferRequest empty;
  empty.model_name = "m";
  cases.push_back({empty, absl::StatusCode::kInvalidArgument, "missing input 'x'"});
  for (auto& c : cases) {
    auto r = engine_->InferSync(c.req);
    ASSERT_FALSE(r.ok()) << c.expect;
    EXPECT_EQ(r.status().code(), c.code) << r.status();
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().message();
  }
  EXPECT_EQ(calls_.load(), 0);
  EXPECT_EQ(engine_->Stats().errors, cases.size());
  EXPECT_EQ(engine_->in_flight(), 0);
}

// A backend whose every execution takes `step` of simulated time.
class SlowBackend : public Backend {
 public:
  SlowBackend(SimulatedClock* clock, absl::Duration step) : clock_(clock), step_(step) {}
  absl::StatusOr<std::vector<Tensor>> Execute(std::vector<Tensor> in) override {
    clock_->Advance(step_);
    in[0].name = "y";
    return in;
  }
  std::string device() const override { return "cpu"; }

 private:
  SimulatedClock* clock_;
  absl::Duration step_;
};

// Records the shapes it is run with; fails when told to.
class ShapeRecordingBackend : public Backend {
 public:
  ShapeRecordingBackend(std::vector<std::vector<int64_t>>* shapes, bool fail)
      : shapes_(shapes), fail_(fail) {}
  absl::StatusOr<std::vector<Tensor>> Execute(std::vector<Tensor> in) override {
    for (const auto& t : in) shapes_->push_back(t.shape);
    if (fail_) return absl::InvalidArgumentError("index out of range");
    return std::vector<Tensor>{};
  }
  std::string device() const override { return "cpu"; }

 private:
  std::vector<std::vector<int64_t>>* shapes_;
  bool fail_;
};

// Without warmup samples in config.yaml, warm-up (at load, and once on a parked replica's
// promotion) runs one zero-filled request of the smallest shape; a model that refuses it is
// still served.
TEST(EngineWarmupTest, WithoutSamplesOneSmallestRequestRunsAndMayFail) {
  for (bool fail : {false, true}) {
    ModelConfig c = EngineConfig();
    c.inputs = {{"ids", DataType::kInt64, {-1}}, {"mask", DataType::kInt64, {-1, 3}}};
    std::vector<std::vector<int64_t>> shapes;
    RealClock clock;
    Lifecycle lifecycle(&clock);
    auto e = InferenceEngine::Create(c, "1", std::make_unique<ShapeRecordingBackend>(&shapes, fail),
                                     &lifecycle, &clock);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_TRUE((*e)->Warmup().ok()) << fail;
    EXPECT_EQ(shapes, (std::vector<std::vector<int64_t>>{{1, 1}, {1, 1, 3}})) << fail;
    shapes.clear();
    EXPECT_TRUE((*e)->Warmup(/*once=*/true).ok()) << fail;
    EXPECT_EQ(shapes.size(), 2u);
    (*e)->Stop();
  }
}

// Records the thread of each execution; asks for one execution thread, or not.
class ThreadRecordingBackend : public Backend {
 public:
  explicit ThreadRecordingBackend(std::vector<std::thread::id>* threads, bool one_thread = true)
      : threads_(threads), one_thread_(one_thread) {}
  absl::StatusOr<std::vector<Tensor>> Execute(std::vector<Tensor> in) override {
    threads_->push_back(std::this_thread::get_id());
    Tensor y = in[0];
    y.name = "y";
    return std::vector<Tensor>{y};
  }
  std::string device() const override { return "cpu"; }
  bool WantsOneExecutionThread() const override { return one_thread_; }

 private:
  std::vector<std::thread::id>* threads_;
  const bool one_thread_;
};

// A backend that wants one execution thread is warmed up on it, at load and on promotion,
// and serves on it: no request is the first to run there.
// Every backend, whether it asks for one execution thread or not, is warmed up on the
// executions' thread, at load and on promotion, and that thread serves queued requests: what
// LibTorch sets up per thread on a first forward is not paid by the first request.
TEST(EngineWarmupTest, EveryBackendIsWarmedUpOnTheThreadThatServesQueuedRequests) {
  for (bool one_thread : {false, true}) {
    std::vector<std::thread::id> threads;
    RealClock clock;
    Lifecycle lifecycle(&clock);
    auto e = InferenceEngine::Create(
        EngineConfig(), "1", std::make_unique<ThreadRecordingBackend>(&threads, one_thread),
        &lifecycle, &clock);
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_TRUE((*e)->Warmup().ok());
    ASSERT_TRUE((*e)->Warmup(/*once=*/true).ok());
    ASSERT_TRUE(lifecycle.Transition(RuntimeState::kWarm, "loaded").ok());
    ASSERT_TRUE(lifecycle.Transition(RuntimeState::kServing, "promoted").ok());
    InferRequest queued = FloatRequest({1, 2}, {1, 2});
    queued.never_inline = true;  // as gRPC's are
    auto r = (*e)->InferSync(std::move(queued));
    ASSERT_TRUE(r.ok()) << r.status();
    (*e)->Stop();
    ASSERT_EQ(threads.size(), 3u) << one_thread;
    EXPECT_NE(threads[0], std::this_thread::get_id()) << one_thread;
    EXPECT_EQ(threads[1], threads[0]) << one_thread;
    EXPECT_EQ(threads[2], threads[0]) << one_thread;
  }
}

// The model's time per execution is kept apart from the request's latency.
TEST(EngineComputeTest, ModelTimeIsRecordedPerExecution) {
  SimulatedClock clock;
  Lifecycle lifecycle(&clock);
  auto engine = InferenceEngine::Create(
      EngineConfig(), "1", std::make_unique<SlowBackend>(&clock, absl::Milliseconds(3)),
      &lifecycle, &clock);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_TRUE(lifecycle.Transition(RuntimeState::kWarm, "test").ok());
  ASSERT_TRUE(lifecycle.Transition(RuntimeState::kServing, "test").ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE((*engine)->InferSync(FloatRequest({1, 2}, {0, 0})).ok());
  }
  EngineStats s = (*engine)->Stats();
  EXPECT_EQ(s.compute_micros.count, 3u);
  EXPECT_DOUBLE_EQ(s.compute_micros.sum, 9000);
  EXPECT_EQ(s.latency_micros.count, 3u);
  EXPECT_GE(s.latency_micros.sum, 9000);
}

// A caller's deadline bounds a request's timeout and never lengthens it: the request leaves the
// queue at the earliest of its own timeout, the model's default and its caller's deadline.
TEST(EngineDeadlineTest, CallersDeadlineBoundsButNeverReplacesTheTimeout) {
  struct Case {
    std::string name;
    int64_t default_timeout;  // the model's, microseconds
    int64_t own_timeout;      // the request's `timeout` parameter
    int64_t caller_left;      // the caller's deadline, as time left
    bool expires;             // after 3 ms of the 20 ms batching delay
  };
  const std::vector<Case> cases = {
      {"model default earlier than caller", 2000, 0, 60'000'000, true},
      {"caller earlier than model default", 60'000'000, 0, 2000, true},
      {"caller with no model default", 0, 0, 2000, true},
      {"own timeout earlier than caller", 0, 2000, 60'000'000, true},
      {"caller earlier than own timeout", 0, 60'000'000, 2000, true},
      {"all later: served after the delay", 60'000'000, 0, 60'000'000, false},
      {"no timeouts at all", 0, 0, 0, false},
  };
  for (const Case& c : cases) {
    SimulatedClock clock;
    Lifecycle lifecycle(&clock);
    ModelConfig config = EngineConfig();
    config.dynamic_batching = DynamicBatchingConfig{};
    config.dynamic_batching->max_queue_delay_microseconds = 20000;
    config.dynamic_batching->default_timeout_microseconds = c.default_timeout;
    std::atomic<int> calls{0};
    auto e = InferenceEngine::Create(config, "1", std::make_unique<DoublingBackend>(&calls),
                                     &lifecycle, &clock);
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_TRUE(lifecycle.Transition(RuntimeState::kWarm, "test").ok());
    ASSERT_TRUE(lifecycle.Transition(RuntimeState::kServing, "test").ok());
    InferRequest r = FloatRequest({1, 2}, {1, 2});
    r.timeout_micros = c.own_timeout;
    r.caller_time_left_micros = c.caller_left;
    auto p = std::make_shared<std::promise<absl::StatusOr<InferResponse>>>();
    auto f = p->get_future();
    (*e)->Infer(std::move(r), [p](absl::StatusOr<InferResponse> x) { p->set_value(std::move(x)); });
    EXPECT_EQ((*e)->Stats().queue_depth, 1) << c.name;
    clock.Advance(absl::Milliseconds(3));
    if (!c.expires) {
      // Not expired: still queued (a bounded look), then served once the delay has passed.
      EXPECT_NE(f.wait_for(std::chrono::milliseconds(50)), std::future_status::ready) << c.name;
      clock.Advance(absl::Milliseconds(20));
    }
    ASSERT_EQ(f.wait_for(std::chrono::seconds(3)), std::future_status::ready) << c.name;
    auto reply = f.get();
    if (c.expires) {
      EXPECT_EQ(reply.status().code(), absl::StatusCode::kDeadlineExceeded) << c.name;
      EXPECT_EQ(calls.load(), 0) << c.name;
    } else {
      EXPECT_TRUE(reply.ok()) << c.name << ": " << reply.status();
      EXPECT_EQ(calls.load(), 1) << c.name;
    }
    (*e)->Stop();
  }
}

// The frontends note a caller's deadline as time left, leaving the request's own timeout alone;
// a deadline already passed is refused.
TEST(EngineDeadlineTest, NoteCallerDeadlineKeepsTheOwnTimeout) {
  InferRequest r = FloatRequest({1, 2}, {1, 2});
  r.timeout_micros = 5000;
  const int64_t now = absl::ToUnixMicros(absl::Now());
  ASSERT_TRUE(NoteCallerDeadline(now + 60'000'000, &r).ok());
  EXPECT_EQ(r.timeout_micros, 5000);
  EXPECT_GT(r.caller_time_left_micros, 50'000'000);
  EXPECT_LE(r.caller_time_left_micros, 60'000'000);
  // Without a timeout of its own, the request keeps 0 (the model's default), not the time left.
  InferRequest untimed = FloatRequest({1, 2}, {1, 2});
  ASSERT_TRUE(NoteCallerDeadline(now + 60'000'000, &untimed).ok());
  EXPECT_EQ(untimed.timeout_micros, 0);
  EXPECT_GT(untimed.caller_time_left_micros, 50'000'000);
  InferRequest none = FloatRequest({1, 2}, {1, 2});
  ASSERT_TRUE(NoteCallerDeadline(0, &none).ok());
  EXPECT_EQ(none.caller_time_left_micros, 0);
  EXPECT_EQ(NoteCallerDeadline(now - 1000, &none).code(), absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace kiln
