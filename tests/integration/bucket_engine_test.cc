// Sequence buckets end to end: the inference engine with the real TorchScript backend on the
// generated `tokens` model (hidden = [id * mask, mask] per token, pooled = its sum over the
// sequence; buckets 4, 8, 16; pad input_ids 99, attention_mask 0).
//
// The engine runs on a SimulatedClock: queued requests wait for the batching delay in
// simulated time, so which requests share a batch is decided by the test, not by timing.
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>

#include "gtest/gtest.h"
#include "runtime/buckets.h"
#include "runtime/inference_engine.h"
#include "runtime/model_config.h"
#include "runtime/torchscript_backend.h"

namespace kiln {
namespace {

const std::string kRepo = KILN_MODEL_REPO;
constexpr int64_t kPadId = 99;

// The real backend, recording every execution's inputs (as the model received them).
class RecordingBackend : public Backend {
 public:
  explicit RecordingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  absl::StatusOr<std::vector<Tensor>> Execute(std::vector<Tensor> inputs) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      calls_.push_back(inputs);
    }
    return inner_->Execute(std::move(inputs));
  }
  std::string device() const override { return inner_->device(); }
  std::vector<std::vector<Tensor>> calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  std::unique_ptr<Backend> inner_;
  mutable std::mutex mu_;
  std::vector<std::vector<Tensor>> calls_;
};

using Rows = std::vector<std::vector<int64_t>>;

Tensor Int64Rows(const std::string& name, const Rows& rows) {
  Tensor t;
  t.name = name;
  t.dtype = DataType::kInt64;
  t.shape = {static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())};
  for (const auto& row : rows) {
    t.data.append(reinterpret_cast<const char*>(row.data()), row.size() * 8);
  }
  return t;
}

std::vector<int64_t> Int64s(const Tensor& t) {
  std::vector<int64_t> v(t.data.size() / 8);
  std::memcpy(v.data(), t.data.data(), v.size() * 8);
  return v;
}

std::vector<float> Floats(const Tensor& t) {
  std::vector<float> v(t.data.size() / 4);
  std::memcpy(v.data(), t.data.data(), v.size() * 4);
  return v;
}

const Tensor* Output(const InferResponse& r, const std::string& name) {
  for (const auto& t : r.outputs) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

// What the model must return for one request: hidden [rows, len, 2], pooled [rows, 2].
void ExpectExact(const InferResponse& r, const Rows& ids, const Rows& mask) {
  const int64_t rows = static_cast<int64_t>(ids.size());
  const int64_t len = static_cast<int64_t>(ids[0].size());
  const Tensor* hidden = Output(r, "hidden");
  const Tensor* pooled = Output(r, "pooled");
  ASSERT_NE(hidden, nullptr);
  ASSERT_NE(pooled, nullptr);
  EXPECT_EQ(hidden->dtype, DataType::kFp32);
  ASSERT_EQ(hidden->shape, (std::vector<int64_t>{rows, len, 2}));
  ASSERT_EQ(pooled->shape, (std::vector<int64_t>{rows, 2}));
  std::vector<float> h = Floats(*hidden);
  std::vector<float> p = Floats(*pooled);
  ASSERT_EQ(h.size(), static_cast<size_t>(rows * len * 2));
  for (int64_t b = 0; b < rows; ++b) {
    float sum_ids = 0, sum_mask = 0;
    for (int64_t j = 0; j < len; ++j) {
      float id = static_cast<float>(ids[b][j] * mask[b][j]);
      float m = static_cast<float>(mask[b][j]);
      EXPECT_EQ(h[(b * len + j) * 2], id) << "row " << b << " token " << j;
      EXPECT_EQ(h[(b * len + j) * 2 + 1], m) << "row " << b << " token " << j;
      sum_ids += id;
      sum_mask += m;
    }
    EXPECT_EQ(p[b * 2], sum_ids) << "row " << b;
    EXPECT_EQ(p[b * 2 + 1], sum_mask) << "row " << b;
  }
}

class BucketEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = ResolveModel(kRepo, "tokens", "");
    ASSERT_TRUE(m.ok()) << m.status();
    config_ = m->config;
    ASSERT_TRUE(config_.sequence_buckets.has_value());
    ASSERT_EQ(config_.sequence_buckets->lengths, (std::vector<int64_t>{4, 8, 16}));
    ASSERT_TRUE(config_.dynamic_batching.has_value());
    ASSERT_GT(config_.dynamic_batching->max_queue_delay_microseconds, 0);
    auto b = CreateTorchScriptBackend(config_, m->model_file, {});
    ASSERT_TRUE(b.ok()) << b.status();
    auto rec = std::make_unique<RecordingBackend>(std::move(*b));
    backend_ = rec.get();
    auto e = InferenceEngine::Create(config_, m->version, std::move(rec), &lifecycle_, &clock_);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
    ASSERT_TRUE(lifecycle_.Transition(RuntimeState::kWarm, "test").ok());
    ASSERT_TRUE(lifecycle_.Transition(RuntimeState::kServing, "test").ok());
  }

  InferRequest Request(const Rows& ids, const Rows& mask) {
    InferRequest r;
    r.model_name = "tokens";
    r.inputs = {Int64Rows("input_ids", ids), Int64Rows("attention_mask", mask)};
    return r;
  }

  std::future<absl::StatusOr<InferResponse>> Send(InferRequest r) {
    auto p = std::make_shared<std::promise<absl::StatusOr<InferResponse>>>();
    auto f = p->get_future();
    engine_->Infer(std::move(r), [p](absl::StatusOr<InferResponse> x) { p->set_value(std::move(x)); });
    return f;
  }

  // Lets the queued requests' batching delay pass (in simulated time) and waits, bounded,
  // for each reply.
  std::vector<absl::StatusOr<InferResponse>> Flush(
      std::vector<std::future<absl::StatusOr<InferResponse>>> futures) {
    clock_.Advance(absl::Microseconds(config_.dynamic_batching->max_queue_delay_microseconds));
    std::vector<absl::StatusOr<InferResponse>> out;
    for (auto& f : futures) {
      if (f.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
        ADD_FAILURE() << "no reply";
        out.push_back(absl::DeadlineExceededError("no reply"));
        continue;
      }
      out.push_back(f.get());
    }
    return out;
  }

  SimulatedClock clock_;
  Lifecycle lifecycle_{&clock_};
  ModelConfig config_;
  RecordingBackend* backend_ = nullptr;  // owned by engine_
  std::unique_ptr<InferenceEngine> engine_;
};

TEST_F(BucketEngineTest, LengthsThreeAndFourSharePaddedBucketFourAndOneBatch) {
  Rows ids_a = {{5, 6, 7}}, mask_a = {{1, 1, 1}};
  Rows ids_b = {{11, 12, 13, 14}}, mask_b = {{1, 1, 1, 0}};  // its own padded tail
  std::vector<std::future<absl::StatusOr<InferResponse>>> futures;
  futures.push_back(Send(Request(ids_a, mask_a)));
  futures.push_back(Send(Request(ids_b, mask_b)));
  // Both wait for the batching delay, which has not passed in simulated time.
  EXPECT_EQ(engine_->Stats().queue_depth, 2);
  EXPECT_TRUE(backend_->calls().empty());

  auto replies = Flush(std::move(futures));
  ASSERT_TRUE(replies[0].ok()) << replies[0].status();
  ASSERT_TRUE(replies[1].ok()) << replies[1].status();

  // One execution of both rows at the bucket length, padded with the config's pad values.
  auto calls = backend_->calls();
  ASSERT_EQ(calls.size(), 1u);
  ASSERT_EQ(calls[0].size(), 2u);
  EXPECT_EQ(calls[0][0].name, "input_ids");
  EXPECT_EQ(calls[0][0].shape, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(Int64s(calls[0][0]), (std::vector<int64_t>{5, 6, 7, kPadId, 11, 12, 13, 14}));
  EXPECT_EQ(calls[0][1].name, "attention_mask");
  EXPECT_EQ(calls[0][1].shape, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(Int64s(calls[0][1]), (std::vector<int64_t>{1, 1, 1, 0, 1, 1, 1, 0}));

  EngineStats s = engine_->Stats();
  EXPECT_EQ(s.batches, 1u);
  EXPECT_EQ(s.batch_size.count, 1u);
  EXPECT_EQ(s.batch_size.sum, 2.0);
  EXPECT_EQ(s.requests, 2u);
  EXPECT_EQ(s.errors, 0u);

  // Each reply has its own length back, with exact values; the pad did not leak into pooled.
  ExpectExact(*replies[0], ids_a, mask_a);
  ExpectExact(*replies[1], ids_b, mask_b);
  EXPECT_EQ(Floats(*Output(*replies[0], "pooled")), (std::vector<float>{18, 3}));
  EXPECT_EQ(Floats(*Output(*replies[1], "pooled")), (std::vector<float>{36, 3}));
}

TEST_F(BucketEngineTest, DifferentBucketsRunApartAndMultiRowRequestsTrimEveryRow) {
  Rows ids_a = {{1, 2, 3}}, mask_a = {{1, 1, 1}};                              // bucket 4
  Rows ids_b = {{1, 2, 3, 4, 5, 6, 7, 8, 9}}, mask_b = {{1, 1, 1, 1, 1, 1, 1, 1, 1}};  // 16
  Rows ids_c = {{21, 22, 23, 24, 25}, {31, 32, 33, 34, 35}};                   // 2 rows, bucket 8
  Rows mask_c = {{1, 1, 1, 1, 1}, {1, 1, 1, 0, 0}};
  Rows ids_d = {{41, 42, 43, 44}}, mask_d = {{1, 1, 1, 1}};                    // bucket 4
  std::vector<std::future<absl::StatusOr<InferResponse>>> futures;
  futures.push_back(Send(Request(ids_a, mask_a)));
  futures.push_back(Send(Request(ids_b, mask_b)));
  futures.push_back(Send(Request(ids_c, mask_c)));
  futures.push_back(Send(Request(ids_d, mask_d)));
  EXPECT_EQ(engine_->Stats().queue_depth, 4);
  auto replies = Flush(std::move(futures));
  for (auto& r : replies) ASSERT_TRUE(r.ok()) << r.status();

  // Bucket 4 (a and d together), then 16 (b), then 8 (c): the oldest waiting request leads.
  auto calls = backend_->calls();
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_EQ(calls[0][0].shape, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(Int64s(calls[0][0]), (std::vector<int64_t>{1, 2, 3, kPadId, 41, 42, 43, 44}));
  EXPECT_EQ(calls[1][0].shape, (std::vector<int64_t>{1, 16}));
  EXPECT_EQ(calls[2][0].shape, (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(Int64s(calls[2][1]),
            (std::vector<int64_t>{1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0}));
  EXPECT_EQ(Int64s(calls[2][0]), (std::vector<int64_t>{21, 22, 23, 24, 25, kPadId, kPadId, kPadId,
                                                       31, 32, 33, 34, 35, kPadId, kPadId, kPadId}));
  EngineStats s = engine_->Stats();
  EXPECT_EQ(s.batches, 3u);
  EXPECT_EQ(s.batch_size.sum, 5.0);

  ExpectExact(*replies[0], ids_a, mask_a);
  ExpectExact(*replies[1], ids_b, mask_b);
  ExpectExact(*replies[2], ids_c, mask_c);
  ExpectExact(*replies[3], ids_d, mask_d);
  EXPECT_EQ(Floats(*Output(*replies[2], "pooled")), (std::vector<float>{115, 5, 96, 3}));
}

TEST_F(BucketEngineTest, RequestedOutputsAreTrimmedToo) {
  InferRequest r = Request({{7, 8}}, {{1, 1}});
  r.outputs = {"hidden"};
  auto f = Send(std::move(r));
  std::vector<std::future<absl::StatusOr<InferResponse>>> futures;
  futures.push_back(std::move(f));
  auto replies = Flush(std::move(futures));
  ASSERT_TRUE(replies[0].ok()) << replies[0].status();
  ASSERT_EQ(replies[0]->outputs.size(), 1u);
  EXPECT_EQ(replies[0]->outputs[0].name, "hidden");
  EXPECT_EQ(replies[0]->outputs[0].shape, (std::vector<int64_t>{1, 2, 2}));
  EXPECT_EQ(Floats(replies[0]->outputs[0]), (std::vector<float>{7, 1, 8, 1}));
}

TEST_F(BucketEngineTest, LongestBucketIsAcceptedAndOneTokenMoreIsRejected) {
  Rows ids16 = {std::vector<int64_t>(16, 2)}, mask16 = {std::vector<int64_t>(16, 1)};
  std::vector<std::future<absl::StatusOr<InferResponse>>> futures;
  futures.push_back(Send(Request(ids16, mask16)));
  auto replies = Flush(std::move(futures));
  ASSERT_TRUE(replies[0].ok()) << replies[0].status();
  ExpectExact(*replies[0], ids16, mask16);
  ASSERT_EQ(backend_->calls().size(), 1u);
  EXPECT_EQ(backend_->calls()[0][0].shape, (std::vector<int64_t>{1, 16}));  // no padding

  // Rejected before it is queued: the reply comes back inline.
  auto too_long = engine_->InferSync(
      Request({std::vector<int64_t>(17, 2)}, {std::vector<int64_t>(17, 1)}));
  ASSERT_FALSE(too_long.ok());
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(too_long.status().message());
  EXPECT_NE(msg.find("input_ids"), std::string::npos) << msg;
  EXPECT_NE(msg.find("17"), std::string::npos) << msg;
  EXPECT_NE(msg.find("16"), std::string::npos) << msg;
  EXPECT_EQ(backend_->calls().size(), 1u);
  EXPECT_EQ(engine_->Stats().errors, 1u);
}

TEST_F(BucketEngineTest, InputsWithDifferentLengthsNameBothInputs) {
  auto r = engine_->InferSync(Request({{1, 2, 3}}, {{1, 1, 1, 1}}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(r.status().message());
  EXPECT_NE(msg.find("input_ids"), std::string::npos) << msg;
  EXPECT_NE(msg.find("attention_mask"), std::string::npos) << msg;
  EXPECT_NE(msg.find("3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("4"), std::string::npos) << msg;
  EXPECT_TRUE(backend_->calls().empty());
}

// A sequence of no tokens would be all padding (pooled outputs of nothing): refused, and a
// padded request past the payload limit too, before either reaches the model.
TEST_F(BucketEngineTest, AnEmptySequenceAndOnePaddedPastTheLimitAreRefused) {
  auto empty = engine_->InferSync(Request({{}}, {{}}));
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(empty.status().message().find("sequence length must be at least 1"), std::string::npos)
      << empty.status();
  // Two rows of 3 tokens pad to bucket 4: 2 x 4 x 8 bytes per input, 128 in all.
  engine_->SetPayloadLimit(127);
  auto padded = engine_->InferSync(Request({{1, 2, 3}, {1, 2, 3}}, {{1, 1, 1}, {1, 1, 1}}));
  ASSERT_FALSE(padded.ok());
  EXPECT_EQ(padded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(padded.status().message().find("payload limit of 127 bytes"), std::string::npos)
      << padded.status();
  EXPECT_TRUE(backend_->calls().empty());
  EXPECT_EQ(engine_->in_flight(), 0);
  engine_->SetPayloadLimit(128);
  std::vector<std::future<absl::StatusOr<InferResponse>>> futures;
  futures.push_back(Send(Request({{1, 2, 3}, {1, 2, 3}}, {{1, 1, 1}, {1, 1, 1}})));
  auto replies = Flush(std::move(futures));
  ASSERT_TRUE(replies[0].ok()) << replies[0].status();
}

TEST_F(BucketEngineTest, WarmupRunsTheSampleAtItsBucket) {
  // The config's sample is 2 rows of length 3 (zeros): warmed at bucket 4.
  ASSERT_TRUE(engine_->Warmup().ok());
  auto calls = backend_->calls();
  ASSERT_FALSE(calls.empty());
  for (const auto& call : calls) {
    EXPECT_EQ(call[0].shape, (std::vector<int64_t>{2, 4}));
    EXPECT_EQ(Int64s(call[0]), (std::vector<int64_t>{0, 0, 0, kPadId, 0, 0, 0, kPadId}));
    EXPECT_EQ(Int64s(call[1]), (std::vector<int64_t>(8, 0)));
  }
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// A config written for a GPU (cuda_graphs on) still loads and serves on cpu: graphs are a
// device concern, so the cpu runner ignores them and device preparation has nothing to do.
TEST(CudaGraphsConfigOnCpuTest, LoadsServesAndPreparesNothing) {
  auto m = ResolveModel(kRepo, "tokens", "");
  ASSERT_TRUE(m.ok()) << m.status();
  ModelConfig config = m->config;
  config.instance.cuda_graphs.enable = true;
  config.instance.cuda_graphs.batch_sizes = {1, 2, 4};
  ASSERT_TRUE(ValidateModelConfig(config).ok());
  ASSERT_EQ(PlanGraphs(config).size(), 9u);  // 3 batch sizes x 3 buckets
  BackendOptions options;
  auto backend = CreateTorchScriptBackend(config, m->model_file, options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto prepared = (*backend)->Prepare([] { return false; });
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_EQ(*prepared, "");
  EXPECT_EQ((*backend)->DeviceMemoryBytes(), 0);
  auto out = (*backend)->Execute({Int64Rows("input_ids", {{5, 6, 7, 8}}),
                                  Int64Rows("attention_mask", {{1, 1, 1, 0}})});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->at(0).shape, (std::vector<int64_t>{1, 4, 2}));
}

}  // namespace
}  // namespace kiln
