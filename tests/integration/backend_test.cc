// The TorchScript backend, in-process, on the generated models.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/batcher.h"
#include "runtime/model_config.h"
#include "runtime/aoti_backend.h"
#include "runtime/torchscript_backend.h"

namespace kiln {
namespace {

const std::string kRepo = KILN_MODEL_REPO;

Tensor Int64Tensor(const std::string& name, const nlohmann::json& rows) {
  Tensor t;
  t.name = name;
  t.dtype = DataType::kInt64;
  t.shape = {static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())};
  for (const auto& row : rows) {
    for (const auto& v : row) {
      int64_t x = v.get<int64_t>();
      t.data.append(reinterpret_cast<const char*>(&x), 8);
    }
  }
  return t;
}

Tensor Fp32Tensor(const std::string& name, std::vector<int64_t> shape, std::vector<float> v) {
  Tensor t;
  t.name = name;
  t.dtype = DataType::kFp32;
  t.shape = std::move(shape);
  t.data.assign(reinterpret_cast<const char*>(v.data()), v.size() * 4);
  return t;
}

nlohmann::json References(const std::string& version) {
  std::ifstream in(kRepo + "/encoder/reference/v" + version + ".json");
  return nlohmann::json::parse(in);
}

std::unique_ptr<Backend> Load(const std::string& model, const std::string& version,
                              ModelConfig* config_out = nullptr) {
  auto m = ResolveModel(kRepo, model, version);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return nullptr;
  if (config_out) *config_out = m->config;
  auto b = CreateTorchScriptBackend(m->config, m->model_file, {});
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

// Largest absolute difference between a FP32 tensor and the reference rows.
double MaxDiff(const Tensor& t, const nlohmann::json& rows) {
  const float* f = reinterpret_cast<const float*>(t.data.data());
  double worst = 0;
  size_t i = 0;
  for (const auto& row : rows) {
    for (const auto& v : row) worst = std::max(worst, std::abs(f[i++] - v.get<double>()));
  }
  return worst;
}

TEST(TorchScriptBackendTest, EncoderMatchesReferenceOutputs) {
  for (std::string version : {"1", "2"}) {
    auto backend = Load("encoder", version);
    ASSERT_NE(backend, nullptr);
    auto refs = References(version);
    for (size_t i = 0; i < 8; ++i) {
      const auto& c = refs[i];
      auto out = backend->Execute(
          {Int64Tensor("input_ids", c["input_ids"]), Int64Tensor("attention_mask", c["attention_mask"])});
      ASSERT_TRUE(out.ok()) << out.status();
      ASSERT_EQ(out->size(), 1u);
      EXPECT_EQ((*out)[0].shape, (std::vector<int64_t>{static_cast<int64_t>(c["input_ids"].size()), 64}));
      EXPECT_LT(MaxDiff((*out)[0], c["embedding"]), 1e-5) << "v" << version << " case " << i;
    }
  }
}

// A CPU model with several intra-op threads asks for one execution thread (OpenMP keeps a
// team of workers per calling thread); with one it may run on its callers' threads.
TEST(TorchScriptBackendTest, SeveralIntraOpThreadsOnCpuWantOneExecutionThread) {
  auto m = ResolveModel(kRepo, "encoder", "2");
  ASSERT_TRUE(m.ok()) << m.status();
  for (int64_t threads : {1, 2}) {
    BackendOptions options;
    options.threads = threads;
    auto b = CreateTorchScriptBackend(m->config, m->model_file, options);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ((*b)->WantsOneExecutionThread(), threads > 1) << threads << " threads";
  }
}

TEST(TorchScriptBackendTest, BatchedExecutionSplitsBackExactly) {
  auto backend = Load("encoder", "1");
  ASSERT_NE(backend, nullptr);
  auto refs = References("1");
  // Cases 1 and 30 have the same length (3 + 7*i mod 29): batch them together.
  std::vector<std::vector<Tensor>> reqs;
  std::vector<size_t> picked;
  for (size_t i = 0; i < refs.size() && picked.size() < 3; ++i) {
    if (refs[i]["input_ids"][0].size() == refs[1]["input_ids"][0].size()) picked.push_back(i);
  }
  ASSERT_GE(picked.size(), 2u);
  std::vector<int64_t> rows;
  for (size_t i : picked) {
    reqs.push_back({Int64Tensor("input_ids", refs[i]["input_ids"]),
                    Int64Tensor("attention_mask", refs[i]["attention_mask"])});
    rows.push_back(static_cast<int64_t>(refs[i]["input_ids"].size()));
  }
  std::vector<std::vector<Tensor>*> ptrs;
  for (auto& r : reqs) ptrs.push_back(&r);
  auto batched = ConcatBatch(ptrs);
  ASSERT_TRUE(batched.ok());
  auto out = backend->Execute(*batched);
  ASSERT_TRUE(out.ok()) << out.status();
  auto split = SplitBatch(*out, rows);
  ASSERT_TRUE(split.ok()) << split.status();
  for (size_t k = 0; k < picked.size(); ++k) {
    EXPECT_LT(MaxDiff((*split)[k][0], refs[picked[k]]["embedding"]), 1e-5);
  }
}

TEST(TorchScriptBackendTest, TupleOutputsInConfigOrder) {
  auto backend = Load("addsub", "");
  ASSERT_NE(backend, nullptr);
  auto out = backend->Execute({Fp32Tensor("INPUT0", {1, 4}, {1, 2, 3, 4}),
                               Fp32Tensor("INPUT1", {1, 4}, {4, 3, 2, 1})});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 2u);
  const float* sum = reinterpret_cast<const float*>((*out)[0].data.data());
  const float* diff = reinterpret_cast<const float*>((*out)[1].data.data());
  EXPECT_EQ((*out)[0].name, "OUTPUT0");
  EXPECT_EQ(sum[0], 5.0f);
  EXPECT_EQ(diff[0], -3.0f);
  EXPECT_EQ(diff[3], 3.0f);
}

TEST(TorchScriptBackendTest, DictOutputsByNameWithoutBatchDimension) {
  auto backend = Load("dictout", "");
  ASSERT_NE(backend, nullptr);
  Tensor x;
  x.name = "x";
  x.dtype = DataType::kInt32;
  x.shape = {3};
  int32_t v[3] = {1, 2, 3};
  x.data.assign(reinterpret_cast<const char*>(v), 12);
  auto out = backend->Execute({x});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 2u);
  EXPECT_EQ((*out)[0].name, "doubled");
  EXPECT_EQ(reinterpret_cast<const int32_t*>((*out)[0].data.data())[2], 6);
  EXPECT_EQ((*out)[1].dtype, DataType::kInt64);
  EXPECT_EQ(reinterpret_cast<const int64_t*>((*out)[1].data.data())[0], 6);
}

class BrokenModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("kiln_broken_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    auto m = ResolveModel(kRepo, "encoder", "1");
    ASSERT_TRUE(m.ok());
    config_ = m->config;
    good_file_ = m->model_file;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& bytes) {
    auto p = dir_ / name;
    std::ofstream(p, std::ios::binary) << bytes;
    return p.string();
  }
  std::filesystem::path dir_;
  ModelConfig config_;
  std::string good_file_;
};

TEST_F(BrokenModelTest, CorruptFileFailsCleanly) {
  auto s = CreateTorchScriptBackend(config_, Write("garbage.pt", "this is not a model"), {});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("not a loadable TorchScript model"), std::string::npos)
      << s.status();
  // A truncated real archive.
  std::ifstream in(good_file_, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto t = CreateTorchScriptBackend(config_, Write("truncated.pt", bytes.substr(0, bytes.size() / 2)), {});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  auto e = CreateTorchScriptBackend(config_, Write("empty.pt", ""), {});
  EXPECT_FALSE(e.ok());
}

TEST_F(BrokenModelTest, AotInductorPackagesNeedTheLoader) {
  ModelConfig aoti = config_;
  aoti.backend = "aotinductor";
  auto s = CreateAotiBackend(aoti, Write("model.pt2", "this is not a package"), {});
  ASSERT_FALSE(s.ok());
  if (!AotiBackendBuiltIn()) {
    // Debian's LibTorch 1.13: the backend is registered but says why it cannot load.
    EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
    EXPECT_NE(s.status().message().find("backend: aotinductor"), std::string::npos) << s.status();
    EXPECT_NE(s.status().message().find("PyTorch 2.6"), std::string::npos) << s.status();
  } else {
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find("not a loadable AOTInductor package"), std::string::npos)
        << s.status();
  }
  BackendRegistry registry;
  RegisterAotiBackend(&registry);
  auto r = registry.Create(aoti, (dir_ / "nope.pt2").string(), {});
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().find("not a registered backend"), std::string::npos) << r.status();
}

TEST_F(BrokenModelTest, MissingFileIsNotFound) {
  auto s = CreateTorchScriptBackend(config_, (dir_ / "nope.pt").string(), {});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(BrokenModelTest, ConfigThatDoesNotFitTheModel) {
  ModelConfig three = config_;
  three.inputs.push_back({"extra", DataType::kInt64, {-1}});
  auto s = CreateTorchScriptBackend(three, good_file_, {});
  EXPECT_NE(s.status().message().find("config lists 3 inputs"), std::string::npos) << s.status();

  ModelConfig wrong_out = config_;
  wrong_out.outputs[0].dtype = DataType::kInt32;
  auto b = CreateTorchScriptBackend(wrong_out, good_file_, {});
  ASSERT_TRUE(b.ok());
  nlohmann::json ids = {{1, 2, 3}};
  nlohmann::json mask = {{1, 1, 1}};
  auto out = (*b)->Execute({Int64Tensor("input_ids", ids), Int64Tensor("attention_mask", mask)});
  EXPECT_NE(out.status().message().find("config says INT32"), std::string::npos) << out.status();

  ModelConfig unsigned_in = config_;
  unsigned_in.inputs[0].dtype = DataType::kUint32;
  EXPECT_NE(CreateTorchScriptBackend(unsigned_in, good_file_, {}).status().message().find("UINT32"),
            std::string::npos);
}

TEST_F(BrokenModelTest, DevicesThisBuildCannotReach) {
  if (TorchCudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present";
  BackendOptions cuda;
  cuda.device = "cuda:0";
  auto s = CreateTorchScriptBackend(config_, good_file_, cuda);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  ModelConfig fp16 = config_;
  fp16.instance.precision = Precision::kFp16;
  auto h = CreateTorchScriptBackend(fp16, good_file_, {});
  EXPECT_NE(h.status().message().find("instance.precision"), std::string::npos) << h.status();
}

TEST_F(BrokenModelTest, Bf16KeepsLayerNormAndSoftmaxSafe) {
  ModelConfig bf16 = config_;
  bf16.instance.precision = Precision::kBf16;
  auto b = CreateTorchScriptBackend(bf16, good_file_, {});
  ASSERT_TRUE(b.ok()) << b.status();
  // 5 LayerNorms and 2 Softmaxes in the encoder (2 layers x (2 LN + 1 softmax) + embedding LN).
  EXPECT_NE((*b)->Describe().find("(7 layer_norm/softmax ops kept in fp32; deserialise"), std::string::npos)
      << (*b)->Describe();
  auto refs = References("1");
  for (size_t i = 0; i < 4; ++i) {
    const auto& c = refs[i];
    auto out = (*b)->Execute(
        {Int64Tensor("input_ids", c["input_ids"]), Int64Tensor("attention_mask", c["attention_mask"])});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ((*out)[0].dtype, DataType::kFp32);  // cast back to the config's type
    // bf16 keeps 8 bits of mantissa; the embedding entries are O(1).
    EXPECT_LT(MaxDiff((*out)[0], c["embedding"]), 0.1) << "case " << i;
  }
}

}  // namespace
}  // namespace kiln
