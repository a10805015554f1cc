// The agent's health probe (agent/inference_prober.h) against a real kiln-runtime: a probe runs
// the model every time, even when the model's response cache holds the answer, and leaves
// nothing in the cache.
#include <unistd.h>

#include <memory>
#include <thread>

#include "absl/synchronization/notification.h"
#include "agent/inference_prober.h"
#include "gtest/gtest.h"
#include "tests/integration/runtime_process.h"
#include "tests/support/raw_server.h"

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

// A probe of a replica that never answers ends when the prober is cancelled (the agent
// stopping), not at its timeout; a probe after that does not start.
TEST(InferenceProberTest, CancelAllEndsAProbeUnderWay) {
  // A peer that takes connections and never speaks.
  testing::RawServer silent([](int fd) {
    char c;
    while (read(fd, &c, 1) > 0) {
    }
  });
  const std::string address = silent.address();
  std::unique_ptr<InferenceProber> prober = MakeGrpcInferenceProber(absl::Seconds(120));
  absl::Status status;
  absl::Notification done;
  std::thread t([&] {
    status = prober->Probe(address, "encoder");
    done.Notify();
  });
  // The probe waits on the silent peer; cancelling ends it with CANCELLED.
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(300)));
  prober->CancelAll();
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  t.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_EQ(prober->Probe(address, "encoder").code(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace kiln
