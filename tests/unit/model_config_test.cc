#include "runtime/model_config.h"

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

namespace kiln {
namespace {

const char* kValid = R"(name: enc
backend: torchscript
max_batch_size: 8
input:
  - {name: ids, datatype: INT64, dims: [-1]}
  - {name: mask, datatype: INT64, dims: [-1]}
output:
  - {name: emb, datatype: FP32, dims: [16]}
dynamic_batching:
  preferred_batch_size: [4, 8]
  max_queue_delay_microseconds: 100
  priority_levels: 2
  default_priority_level: 2
  max_queue_size: 16
  default_timeout_microseconds: 0
response_cache: {enable: true, max_bytes: 1Mi}
instance: {device: cpu, threads: 2, precision: bf16}
warmup:
  - {name: w, batch_size: 2, iterations: 2, inputs: {ids: {dims: [8]}, mask: {dims: [8]}}}
)";

std::string Replace(std::string s, const std::string& from, const std::string& to) {
  size_t at = s.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) s.replace(at, from.size(), to);
  return s;
}

TEST(ModelConfigTest, ParsesAValidConfig) {
  auto c = ParseModelConfig(kValid, "config.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "enc");
  EXPECT_EQ(c->max_batch_size, 8);
  ASSERT_EQ(c->inputs.size(), 2u);
  EXPECT_EQ(c->inputs[1].name, "mask");
  EXPECT_EQ(c->inputs[0].dims, (std::vector<int64_t>{-1}));
  ASSERT_TRUE(c->dynamic_batching.has_value());
  EXPECT_EQ(c->dynamic_batching->preferred_batch_size, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(c->dynamic_batching->priority_levels, 2);
  EXPECT_TRUE(c->response_cache.enable);
  EXPECT_EQ(c->response_cache.max_bytes, 1 << 20);
  EXPECT_EQ(c->instance.precision, Precision::kBf16);
  EXPECT_EQ(c->instance.threads, 2);
  ASSERT_EQ(c->warmup.size(), 1u);
  EXPECT_EQ(c->warmup[0].dims.at("ids"), (std::vector<int64_t>{8}));
}

TEST(ModelConfigTest, MinimalConfigHasNoBatching) {
  auto c = ParseModelConfig(
      "name: m\nbackend: torchscript\ninput: [{name: x, datatype: FP32, dims: [3]}]\n"
      "output: [{name: y, datatype: FP32, dims: [3]}]\n",
      "config.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_batch_size, 0);
  EXPECT_FALSE(c->dynamic_batching.has_value());
  EXPECT_EQ(c->instance.device, "cpu");
}

struct BadCase {
  std::string from;
  std::string to;
  std::string expect;  // the field the error must name
};

class BadFieldTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadFieldTest, ErrorNamesTheField) {
  const BadCase& b = GetParam();
  auto c = ParseModelConfig(Replace(kValid, b.from, b.to), "config.yaml");
  ASSERT_FALSE(c.ok()) << "accepted: " << b.to;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find(b.expect), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("config.yaml"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(
    Fields, BadFieldTest,
    ::testing::Values(
        BadCase{"name: enc\n", "", "name: required"},
        BadCase{"backend: torchscript\n", "", "backend: required"},
        BadCase{"max_batch_size: 8", "max_batch_size: -1", "max_batch_size"},
        BadCase{"max_batch_size: 8", "max_batch_size: eight", "max_batch_size"},
        BadCase{"datatype: INT64, dims: [-1]}\n  - {name: mask", "datatype: INT65, dims: [-1]}\n  - {name: mask", "input[0].datatype"},
        BadCase{"{name: mask, datatype: INT64, dims: [-1]}", "{name: ids, datatype: INT64, dims: [-1]}", "input[1].name"},
        BadCase{"{name: emb, datatype: FP32, dims: [16]}", "{name: emb, datatype: FP32, dims: [0]}", "output[0].dims"},
        BadCase{"{name: emb, datatype: FP32, dims: [16]}", "{name: emb, datatype: FP32}", "output[0].dims"},
        BadCase{"{name: emb, datatype: FP32, dims: [16]}", "{name: emb, datatype: FP32, dims: [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]}",
                "output[0].dims with the batch dimension has 33 dimensions, more than the 32 allowed"},
        BadCase{"{name: emb, datatype: FP32, dims: [16]}", "{name: emb, datatype: FP32, dims: [-1, 4611686018427387904]}",
                "output[0].dims (at max_batch_size): shape [8,1,4611686018427387904] is too large"},
        BadCase{"{name: emb, datatype: FP32, dims: [16]}", "{name: emb, datatype: FP32, dims: [16], colour: red}", "output[0].colour: unknown field"},
        BadCase{"output:\n  - {name: emb, datatype: FP32, dims: [16]}\n", "", "output: required"},
        BadCase{"preferred_batch_size: [4, 8]", "preferred_batch_size: [4, 9]", "dynamic_batching.preferred_batch_size[1]"},
        BadCase{"max_queue_delay_microseconds: 100", "max_queue_delay_microseconds: -5", "dynamic_batching.max_queue_delay_microseconds"},
        BadCase{"priority_levels: 2", "priority_levels: 0", "dynamic_batching.priority_levels"},
        BadCase{"default_priority_level: 2", "default_priority_level: 3", "dynamic_batching.default_priority_level"},
        BadCase{"max_queue_size: 16", "max_queue_size: -1", "dynamic_batching.max_queue_size"},
        BadCase{"default_timeout_microseconds: 0", "default_timeout_microseconds: -1", "dynamic_batching.default_timeout_microseconds"},
        BadCase{"max_queue_size: 16", "max_queue_sise: 16", "dynamic_batching.max_queue_sise: unknown field"},
        BadCase{"max_bytes: 1Mi", "max_bytes: lots", "response_cache.max_bytes"},
        BadCase{"enable: true", "enable: maybe", "response_cache.enable"},
        BadCase{"device: cpu", "device: tpu:0", "instance.device"},
        BadCase{"threads: 2", "threads: -2", "instance.threads"},
        BadCase{"precision: bf16", "precision: int4", "instance.precision"},
        BadCase{"batch_size: 2, iterations", "batch_size: 9, iterations", "warmup[0].batch_size"},
        BadCase{"iterations: 2", "iterations: 0", "warmup[0].iterations"},
        BadCase{"ids: {dims: [8]}", "ids: {dims: [100000000000]}", "warmup[0].inputs.ids: [2,100000000000] is over 1 GiB"},
        BadCase{"ids: {dims: [8]}", "idz: {dims: [8]}", "warmup[0].inputs.idz"},
        BadCase{"mask: {dims: [8]}", "mask: {dims: [8, 2]}", "warmup[0].inputs.mask.dims"},
        BadCase{"backend: torchscript\n", "backend: torchscript\nreplicas: 3\n", "replicas: unknown field"}));

TEST(ModelConfigTest, BatchingNeedsABatchDimension) {
  auto c = ParseModelConfig(Replace(kValid, "max_batch_size: 8", "max_batch_size: 0"), "c.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("dynamic_batching"), std::string::npos);
}

TEST(ModelConfigTest, NotYamlIsAClearError) {
  auto c = ParseModelConfig("name: [unclosed", "config.yaml");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("not valid YAML"), std::string::npos);
}

// ---- sequence_buckets and instance.cuda_graphs ----

const char* kBucketed = R"(name: tok
backend: torchscript
max_batch_size: 8
input:
  - {name: ids, datatype: INT64, dims: [-1]}
  - {name: mask, datatype: INT64, dims: [-1]}
  - {name: scale, datatype: FP32, dims: [1]}
output:
  - {name: hidden, datatype: FP32, dims: [-1, 2]}
  - {name: pooled, datatype: FP32, dims: [2]}
sequence_buckets:
  lengths: [4, 8, 16]
  pad: {ids: 3, mask: 0}
instance:
  device: cpu
  cuda_graphs: {batch_sizes: [1, 2, 8], max_tokens: 64, warmup_iterations: 2}
)";

TEST(ModelConfigTest, ParsesSequenceBucketsAndCudaGraphs) {
  auto c = ParseModelConfig(kBucketed, "config.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->sequence_buckets.has_value());
  EXPECT_EQ(c->sequence_buckets->lengths, (std::vector<int64_t>{4, 8, 16}));
  EXPECT_EQ(c->sequence_buckets->pad, (std::map<std::string, double>{{"ids", 3}, {"mask", 0}}));
  const CudaGraphsConfig& g = c->instance.cuda_graphs;
  EXPECT_TRUE(g.enable);
  EXPECT_EQ(g.batch_sizes, (std::vector<int64_t>{1, 2, 8}));
  EXPECT_EQ(g.max_tokens, 64);
  EXPECT_EQ(g.warmup_iterations, 2);
}

TEST(ModelConfigTest, BucketsAndGraphsAreOffUnlessConfigured) {
  auto c = ParseModelConfig(kValid, "config.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->sequence_buckets.has_value());
  EXPECT_FALSE(c->instance.cuda_graphs.enable);
}

TEST(ModelConfigTest, EmptyCudaGraphsTurnsThemOnWithDefaults) {
  auto c = ParseModelConfig(
      Replace(kBucketed, "{batch_sizes: [1, 2, 8], max_tokens: 64, warmup_iterations: 2}", "{}"),
      "config.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  const CudaGraphsConfig& g = c->instance.cuda_graphs;
  EXPECT_TRUE(g.enable);
  EXPECT_TRUE(g.batch_sizes.empty());
  EXPECT_EQ(g.max_tokens, 0);
  EXPECT_EQ(g.warmup_iterations, 3);
}

// A section given with no value (`dynamic_batching:` or `~`) is there, as `{}` is: on with
// defaults, never silently off.
TEST(ModelConfigTest, ASectionWithNoValueTurnsItOnWithDefaults) {
  for (const std::string empty : {"", " ~", " null"}) {
    const std::string base =
        "name: m\nbackend: torchscript\nmax_batch_size: 4\n"
        "input: [{name: x, datatype: FP32, dims: [3]}]\n"
        "output: [{name: y, datatype: FP32, dims: [3]}]\n";
    auto c = ParseModelConfig(base + "dynamic_batching:" + empty + "\n", "config.yaml");
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE(c->dynamic_batching.has_value()) << "'" << empty << "'";
    EXPECT_EQ(c->dynamic_batching->priority_levels, 1);
    auto g = ParseModelConfig(
        Replace(kBucketed, "{batch_sizes: [1, 2, 8], max_tokens: 64, warmup_iterations: 2}",
                empty.empty() ? "~" : empty),
        "config.yaml");
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_TRUE(g->instance.cuda_graphs.enable) << "'" << empty << "'";
  }
}

TEST(ModelConfigTest, CudaGraphsEnableFalseParsesOff) {
  auto c = ParseModelConfig(
      Replace(kBucketed, "{batch_sizes: [1, 2, 8], max_tokens: 64, warmup_iterations: 2}",
              "{enable: false}"),
      "config.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->instance.cuda_graphs.enable);
  // Off, graphs do not need fixed shapes: no sequence_buckets is fine.
  auto d = ParseModelConfig(
      Replace(Replace(kBucketed, "{batch_sizes: [1, 2, 8], max_tokens: 64, warmup_iterations: 2}",
                      "{enable: false}"),
              "sequence_buckets:\n  lengths: [4, 8, 16]\n  pad: {ids: 3, mask: 0}\n", ""),
      "config.yaml");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->sequence_buckets.has_value());
}

TEST(ModelConfigTest, CudaGraphsOnAFixedShapeModelNeedNoBuckets) {
  auto c = ParseModelConfig(
      "name: m\nbackend: torchscript\nmax_batch_size: 4\n"
      "input: [{name: x, datatype: FP32, dims: [3]}]\n"
      "output: [{name: y, datatype: FP32, dims: [3]}]\n"
      "instance: {cuda_graphs: {max_tokens: 2}}\n",
      "config.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->instance.cuda_graphs.enable);
  EXPECT_EQ(c->instance.cuda_graphs.max_tokens, 2);
}

TEST(ModelConfigTest, FloatInputsTakeFractionalPads) {
  auto c = ParseModelConfig(
      Replace(Replace(kBucketed, "{name: mask, datatype: INT64", "{name: mask, datatype: FP16"),
              "mask: 0}", "mask: -0.5}"),
      "config.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sequence_buckets->pad.at("mask"), -0.5);
}

TEST(ModelConfigTest, PadValuesMustFitTheInputsDatatype) {
  for (const auto& [type, pad] : std::vector<std::pair<std::string, std::string>>{
           {"UINT8", "-1"}, {"UINT8", "300"}, {"INT8", "200"}, {"INT32", "3000000000"},
           {"UINT64", "-5"}, {"BOOL", "2"}}) {
    auto c = ParseModelConfig(
        Replace(Replace(kBucketed, "{name: mask, datatype: INT64", "{name: mask, datatype: " + type),
                "mask: 0}", "mask: " + pad + "}"),
        "config.yaml");
    ASSERT_FALSE(c.ok()) << type << " pad " << pad;
    EXPECT_NE(c.status().message().find("sequence_buckets.pad.mask"), std::string::npos)
        << c.status();
  }
  auto ok = ParseModelConfig(
      Replace(Replace(kBucketed, "{name: mask, datatype: INT64", "{name: mask, datatype: UINT8"),
              "mask: 0}", "mask: 255}"),
      "config.yaml");
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST(ModelConfigTest, WarmupLongerThanTheLongestBucketIsRefused) {
  auto c = ParseModelConfig(
      std::string(kBucketed) +
          "warmup:\n  - {name: long, inputs: {ids: {dims: [32]}, mask: {dims: [32]}}}\n",
      "config.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("warmup[0].inputs.ids.dims: length 32 exceeds the longest "
                                      "bucket 16"),
            std::string::npos)
      << c.status();
}

TEST(ModelConfigTest, AtMost64Buckets) {
  std::string lengths;
  for (int i = 1; i <= 65; ++i) lengths += (i > 1 ? ", " : "") + std::to_string(i);
  auto c = ParseModelConfig(Replace(kBucketed, "lengths: [4, 8, 16]", "lengths: [" + lengths + "]"),
                            "config.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("sequence_buckets.lengths"), std::string::npos)
      << c.status();
}

class BucketFieldTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BucketFieldTest, ErrorNamesTheField) {
  const BadCase& b = GetParam();
  auto c = ParseModelConfig(Replace(kBucketed, b.from, b.to), "config.yaml");
  ASSERT_FALSE(c.ok()) << "accepted: " << b.to;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find(b.expect), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("config.yaml"), std::string::npos);
}

const char* kGraphs = "{batch_sizes: [1, 2, 8], max_tokens: 64, warmup_iterations: 2}";
const char* kBucketSection = "sequence_buckets:\n  lengths: [4, 8, 16]\n  pad: {ids: 3, mask: 0}\n";

INSTANTIATE_TEST_SUITE_P(
    Fields, BucketFieldTest,
    ::testing::Values(
        // sequence_buckets.lengths
        BadCase{"lengths: [4, 8, 16]", "lengths: [4, 16, 8]", "sequence_buckets.lengths[2]: lengths must be strictly ascending"},
        BadCase{"lengths: [4, 8, 16]", "lengths: [4, 4, 16]", "sequence_buckets.lengths[1]: lengths must be strictly ascending"},
        BadCase{"lengths: [4, 8, 16]", "lengths: [0, 8, 16]", "sequence_buckets.lengths[0]: must be in 1.."},
        BadCase{"lengths: [4, 8, 16]", "lengths: [4, -8, 16]", "sequence_buckets.lengths[1]"},
        BadCase{"lengths: [4, 8, 16]", "lengths: [4, 8, 33554432]", "sequence_buckets.lengths[2]: must be in 1..16777216"},
        BadCase{"lengths: [4, 8, 16]", "lengths: []", "sequence_buckets.lengths: must list at least one length"},
        BadCase{"  lengths: [4, 8, 16]\n", "", "sequence_buckets.lengths: must list at least one length"},
        BadCase{"lengths: [4, 8, 16]", "lengths: [4, eight]", "sequence_buckets.lengths[1]"},
        BadCase{"lengths: [4, 8, 16]", "lengths: 16", "sequence_buckets.lengths"},
        // sequence_buckets.pad
        BadCase{"pad: {ids: 3, mask: 0}", "pad: {ids: 3, mask: 0, tokens: 0}", "sequence_buckets.pad.tokens: no such input"},
        BadCase{"pad: {ids: 3, mask: 0}", "pad: {ids: 3, mask: 0, scale: 0}", "sequence_buckets.pad.scale: the input must have exactly one variable (-1) dimension"},
        BadCase{"{name: ids, datatype: INT64, dims: [-1]}", "{name: ids, datatype: INT64, dims: [-1, -1]}", "sequence_buckets.pad.ids: the input must have exactly one variable (-1) dimension"},
        BadCase{"pad: {ids: 3, mask: 0}", "pad: {ids: 3}", "sequence_buckets.pad.mask: required"},
        BadCase{"pad: {ids: 3, mask: 0}", "pad: {}", "sequence_buckets.pad.ids: required"},
        BadCase{"  pad: {ids: 3, mask: 0}\n", "", "sequence_buckets.pad: required"},
        BadCase{"pad: {ids: 3, mask: 0}", "pad: {ids: 0.5, mask: 0}", "sequence_buckets.pad.ids: INT64 input needs an integer pad value"},
        BadCase{"pad: {ids: 3, mask: 0}", "pad: {ids: pad, mask: 0}", "sequence_buckets.pad.ids: must be a number"},
        BadCase{"pad: {ids: 3, mask: 0}", "pad: {ids: 1e19, mask: 0}", "sequence_buckets.pad.ids: 10000000000000000000.000000 is outside INT64's range"},
        BadCase{"pad: {ids: 3, mask: 0}", "pad: {ids: 3, mask: .nan}", "sequence_buckets.pad.mask: must be a number"},
        BadCase{"pad: {ids: 3, mask: 0}", "pad: [ids, mask]", "sequence_buckets.pad: must be a mapping"},
        // outputs
        BadCase{"{name: hidden, datatype: FP32, dims: [-1, 2]}", "{name: hidden, datatype: FP32, dims: [-1, -1]}", "output[0].dims: with sequence_buckets an output may have at most one variable dimension"},
        // unknown keys
        BadCase{"  pad: {ids: 3, mask: 0}\n", "  pad: {ids: 3, mask: 0}\n  side: right\n", "sequence_buckets.side: unknown field"},
        BadCase{kBucketSection, "sequence_buckets: [4, 8, 16]\n", "sequence_buckets: must be a mapping"},
        // instance.cuda_graphs
        BadCase{"max_batch_size: 8", "max_batch_size: 0", "instance.cuda_graphs: needs max_batch_size > 0"},
        BadCase{kGraphs, "{batch_sizes: [1, 2, 9]}", "instance.cuda_graphs.batch_sizes[2]: must be in 1..8 (max_batch_size), got 9"},
        BadCase{kGraphs, "{batch_sizes: [0, 2]}", "instance.cuda_graphs.batch_sizes[0]: must be in 1..8"},
        BadCase{kGraphs, "{batch_sizes: [2, 1, 8]}", "instance.cuda_graphs.batch_sizes[1]: batch sizes must be strictly ascending"},
        BadCase{kGraphs, "{batch_sizes: [2, 2]}", "instance.cuda_graphs.batch_sizes[1]: batch sizes must be strictly ascending"},
        BadCase{kGraphs, "{max_tokens: -1}", "instance.cuda_graphs.max_tokens: must be >= 0"},
        BadCase{kGraphs, "{max_tokens: lots}", "instance.cuda_graphs.max_tokens"},
        BadCase{kGraphs, "{warmup_iterations: 0}", "instance.cuda_graphs.warmup_iterations: must be in 1..100"},
        BadCase{kGraphs, "{warmup_iterations: 101}", "instance.cuda_graphs.warmup_iterations: must be in 1..100"},
        BadCase{kGraphs, "{enable: maybe}", "instance.cuda_graphs.enable"},
        BadCase{kGraphs, "{capture: all}", "instance.cuda_graphs.capture: unknown field"},
        BadCase{kGraphs, "[1, 2]", "instance.cuda_graphs: must be a mapping"},
        BadCase{kBucketSection, "", "instance.cuda_graphs: input 'ids' has variable dims [-1]; graphs need fixed shapes, so configure sequence_buckets"},
        // instance.attention
        BadCase{"  device: cpu\n", "  device: cpu\n  attention: [cudnn, flashy]\n", "instance.attention[1]: unknown attention kernel 'flashy' (expected cudnn, flash, efficient or math)"},
        BadCase{"  device: cpu\n", "  device: cpu\n  attention: [flash, efficient, flash]\n", "instance.attention[2]: 'flash' is listed twice"},
        BadCase{"  device: cpu\n", "  device: cpu\n  attention: []\n", "instance.attention: must name at least one kernel"},
        BadCase{"  device: cpu\n", "  device: cpu\n  attention: cudnn\n", "instance.attention: must be a list of attention kernels"},
        BadCase{"  device: cpu\n", "  device: cpu\n  attention: {cudnn: true}\n", "instance.attention: must be a list of attention kernels"},
        BadCase{"  device: cpu\n", "  device: cpu\n  attention: [[cudnn]]\n", "instance.attention[0]"}));

TEST(ModelConfigTest, ParsesAttentionKernels) {
  auto c = ParseModelConfig(Replace(kBucketed, "  device: cpu\n",
                                    "  device: cpu\n  attention: [cudnn, efficient]\n"),
                            "config.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->instance.attention, (std::vector<std::string>{"cudnn", "efficient"}));
  auto d = ParseModelConfig(kBucketed, "config.yaml");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->instance.attention.empty());  // LibTorch's default set
  // An AOTInductor package's kernels are chosen when it is compiled.
  auto e = ParseModelConfig(
      Replace(Replace(kBucketed, "  device: cpu\n", "  device: cpu\n  attention: [cudnn]\n"),
              "backend: torchscript", "backend: aotinductor"),
      "config.yaml");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("instance.attention: applies to TorchScript models only"),
            std::string::npos)
      << e.status();
}

TEST(ModelConfigTest, BoolPadMustBeZeroOrOne) {
  std::string bool_mask = Replace(kBucketed, "{name: mask, datatype: INT64", "{name: mask, datatype: BOOL");
  auto zero = ParseModelConfig(bool_mask, "config.yaml");
  EXPECT_TRUE(zero.ok()) << zero.status();
  auto one = ParseModelConfig(Replace(bool_mask, "mask: 0}", "mask: 1}"), "config.yaml");
  EXPECT_TRUE(one.ok()) << one.status();
  auto two = ParseModelConfig(Replace(bool_mask, "mask: 0}", "mask: 2}"), "config.yaml");
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.status().message().find("sequence_buckets.pad.mask: 2.000000 is outside BOOL's range"),
            std::string::npos)
      << two.status();
}

class ResolveModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kiln_resolve_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ / "enc");
    std::ofstream(dir_ / "enc/config.yaml") << kValid;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void AddVersion(const std::string& v) {
    std::filesystem::create_directories(dir_ / "enc" / v);
    std::ofstream(dir_ / "enc" / v / "model.pt") << "x";
  }
  std::filesystem::path dir_;
};

TEST_F(ResolveModelTest, PicksTheHighestNumericVersion) {
  AddVersion("2");
  AddVersion("10");
  AddVersion("9");
  AddVersion("011");  // not a canonical version number: ignored
  std::filesystem::create_directories(dir_ / "enc/reference");
  auto m = ResolveModel(dir_.string(), "enc", "");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->version, "10");
  EXPECT_EQ(m->versions, (std::vector<std::string>{"2", "9", "10"}));
  auto two = ResolveModel(dir_.string(), "enc", "2");
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->model_file, (dir_ / "enc/2/model.pt").string());
}

TEST_F(ResolveModelTest, AnAotInductorModelIsAPackage) {
  std::string text = kValid;
  size_t at = text.find("backend: torchscript");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, std::string("backend: torchscript").size(), "backend: aotinductor");
  std::ofstream(dir_ / "enc/config.yaml") << text;
  AddVersion("1");  // model.pt only: not what this backend serves
  auto missing = ResolveModel(dir_.string(), "enc", "1");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("enc/1/model.pt2: model file is missing"),
            std::string::npos)
      << missing.status();
  std::ofstream(dir_ / "enc/1/model.pt2") << "x";
  auto m = ResolveModel(dir_.string(), "enc", "");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->config.backend, "aotinductor");
  EXPECT_EQ(m->model_file, (dir_ / "enc/1/model.pt2").string());
  EXPECT_EQ(ModelFileFor("torchscript"), "model.pt");
}

TEST_F(ResolveModelTest, ErrorsNameTheProblem) {
  EXPECT_NE(ResolveModel(dir_.string(), "enc", "").status().message().find("no numeric version"),
            std::string::npos);
  AddVersion("1");
  EXPECT_EQ(ResolveModel(dir_.string(), "enc", "7").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ResolveModel(dir_.string(), "nope", "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ResolveModel(dir_.string(), "../etc", "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveModel((dir_ / "missing").string(), "enc", "").status().code(),
            absl::StatusCode::kNotFound);
  std::filesystem::create_directories(dir_ / "enc/3");
  auto no_file = ResolveModel(dir_.string(), "enc", "3");
  EXPECT_NE(no_file.status().message().find("model file is missing"), std::string::npos);
  std::ofstream(dir_ / "enc/config.yaml") << "name: other\nbackend: torchscript\n";
  auto mismatch = ResolveModel(dir_.string(), "enc", "1");
  EXPECT_FALSE(mismatch.ok());
}

}  // namespace
}  // namespace kiln
