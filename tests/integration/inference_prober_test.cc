// The agent's health probe (agent/inference_prober.h) against a real kiln-runtime: a probe runs
// the model every time, even when the model's response cache holds the answer, and leaves
// nothing in the cache.
#include <memory>

#include "agent/inference_prober.h"
#include "gtest/gtest.h"
#include "tests/integration/runtime_process.h"

namespace kiln {
namespace {

using testing::RuntimeProcess;

TEST(InferenceProberTest, AProbeRunsTheModelPastTheResponseCache) {
  RuntimeProcess::Options o;
  o.repository = KILN_MODEL_REPO;
  o.model = "addsub";  // response_cache: enable: true
  auto rt = RuntimeProcess::Start(o);
  ASSERT_TRUE(rt.ok()) << rt.status();
  auto stats = [&] {
    grpc::ClientContext ctx;
    v1::RuntimeStats s;
    EXPECT_TRUE((*rt)->control()->Stats(&ctx, {}, &s).ok());
    return s;
  };
  const uint64_t batches_before = stats().batches();
  std::unique_ptr<InferenceProber> prober = MakeGrpcInferenceProber(absl::Seconds(10));
  for (int i = 0; i < 3; ++i) {
    absl::Status s = prober->Probe((*rt)->grpc_address(), "addsub");
    ASSERT_TRUE(s.ok()) << i << ": " << s;
  }
  v1::RuntimeStats after = stats();
  EXPECT_EQ(after.cache_hits(), 0u);
  EXPECT_EQ(after.cache_misses(), 0u);  // never looked up
  EXPECT_EQ(after.cache_bytes(), 0u);   // nor stored
  EXPECT_EQ(after.batches(), batches_before + 3);
  EXPECT_EQ(after.errors(), 0u);
  // A probe of another model at the same address (its port bound by another replica since) is
  // not answered with the first model's request: it fails, naming the model.
  absl::Status wrong = prober->Probe((*rt)->grpc_address(), "nope");
  EXPECT_EQ(wrong.code(), absl::StatusCode::kNotFound) << wrong;
  EXPECT_NE(wrong.message().find("nope"), std::string::npos) << wrong;
  EXPECT_TRUE(prober->Probe((*rt)->grpc_address(), "addsub").ok());
}

}  // namespace
}  // namespace kiln
