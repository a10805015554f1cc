// The agent's RuntimeControl client (agent/runtime_client.h) against a control service on a
// unix socket that stops answering, as a stopped or wedged runtime does.
#include "agent/runtime_client.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kiln {
namespace {

// GetState answers at once while `answering`, else holds each call until the caller gives up;
// it records how much time each call had left when it came.
class Runtime final : public v1::RuntimeControl::Service {
 public:
  grpc::Status GetState(grpc::ServerContext* ctx, const v1::GetStateRequest*,
                        v1::RuntimeState* resp) override {
    {
      absl::MutexLock lock(&mu_);
      time_left_.push_back(absl::FromChrono(ctx->deadline()) - absl::Now());
    }
    // Polled (bounded): a cancellation is nothing a condition can wait on.
    for (int i = 0; i < 6000 && !answering() && !ctx->IsCancelled(); ++i) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    resp->set_state(v1::SERVING);
    return grpc::Status::OK;
  }
  bool answering() {
    absl::MutexLock lock(&mu_);
    return answering_;
  }
  void Answer(bool answering) {
    absl::MutexLock lock(&mu_);
    answering_ = answering;
  }
  std::vector<absl::Duration> time_left() {
    absl::MutexLock lock(&mu_);
    return time_left_;
  }

 private:
  absl::Mutex mu_;
  bool answering_ ABSL_GUARDED_BY(mu_) = true;
  std::vector<absl::Duration> time_left_ ABSL_GUARDED_BY(mu_);
};

// Once a call timed out, the next ones get a short time, until the runtime answers again; then
// the whole timeout again.
TEST(GrpcRuntimeClientTest, ARuntimeThatLetACallTimeOutIsGivenLessTimeUntilItAnswers) {
  const std::string path = ::testing::TempDir() + "/kiln_rc_" + std::to_string(getpid()) + ".sock";
  std::filesystem::remove(path);
  Runtime runtime;
  grpc::ServerBuilder b;
  b.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  b.RegisterService(&runtime);
  auto server = b.BuildAndStart();
  ASSERT_NE(server, nullptr);
  GrpcRuntimeClientFactory factory(absl::Seconds(1));
  auto client = factory.Connect(path);
  ASSERT_TRUE(client->GetState().ok());
  runtime.Answer(false);  // stopped
  EXPECT_EQ(client->GetState().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(client->GetState().status().code(), absl::StatusCode::kDeadlineExceeded);
  runtime.Answer(true);
  ASSERT_TRUE(client->GetState().ok());
  ASSERT_TRUE(client->GetState().ok());
  std::vector<absl::Duration> left = runtime.time_left();
  ASSERT_EQ(left.size(), 5u);
  // The whole timeout (1 s), the whole timeout (the first to time out), then 200 ms twice (the
  // second silent call, and the one that found it answering again), then the whole timeout.
  // (The deadline crosses the wire rounded: far apart, the two are told apart.)
  EXPECT_GT(left[0], absl::Milliseconds(600));
  EXPECT_GT(left[1], absl::Milliseconds(600));
  EXPECT_LT(left[2], absl::Milliseconds(300));
  EXPECT_LT(left[3], absl::Milliseconds(300));
  EXPECT_GT(left[4], absl::Milliseconds(600));
  server->Shutdown();
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace kiln
