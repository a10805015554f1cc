// kiln.v1.RuntimeControl on the runtime's HTTP/2 gRPC server, called by grpc++ as the agent calls
// it: a call that blocks (a drain, a model load) runs on
// a thread of its own, so the quick calls (an agent's health probe: GetState, Stats) still
// answer meanwhile; blocking calls are bounded; bad arguments are refused naming the field.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "kiln/v1/runtime_control.grpc.pb.h"
#include "runtime/control_service.h"
#include "tests/support/raw_grpc.h"

namespace kiln {
namespace {

// A target whose Drain and Load block until released.
class HeldTarget : public ControlTarget {
 public:
  v1::RuntimeState GetState() override {
    v1::RuntimeState s;
    s.set_state(v1::SERVING);
    s.set_pid(getpid());
    return s;
  }
  absl::Status Promote() override {
    if (throw_on_promote) throw std::runtime_error("out of device memory");
    if (hold_promote) {  // a warm-up that takes until released
      absl::MutexLock lock(&mu_);
      ++held_;
      mu_.Await(absl::Condition(&released_));
      --held_;
    }
    return absl::OkStatus();
  }
  bool PromoteWaits() const override { return promote_waits; }
  absl::Status Demote() override {
    if (hold_promote) {  // waits for the Promote under way, as RuntimeServer's does
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&released_));
    }
    return absl::FailedPreconditionError("cannot demote now");
  }
  absl::StatusOr<bool> Drain(absl::Duration deadline) override {
    absl::MutexLock lock(&mu_);
    ++held_;
    last_deadline_ = deadline;
    mu_.Await(absl::Condition(&released_));
    --held_;
    return true;
  }
  v1::RuntimeStats Stats() override {
    v1::RuntimeStats s;
    s.set_requests(7);
    return s;
  }
  bool Shutdown(absl::Duration) override { return true; }
  int64_t InFlight() override { return 0; }
  absl::Status Load(const std::vector<std::string>& args) override {
    absl::MutexLock lock(&mu_);
    ++held_;
    mu_.Await(absl::Condition(&released_));
    --held_;
    return args.empty() ? absl::InvalidArgumentError("--model: required") : absl::OkStatus();
  }

  int held() {
    absl::MutexLock lock(&mu_);
    return held_;
  }
  // Bounded poll: true once `n` calls are held.
  bool WaitHeld(int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return held_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(10));
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    released_ = true;
  }
  std::atomic<bool> throw_on_promote{false};
  std::atomic<bool> promote_waits{true};
  std::atomic<bool> hold_promote{false};

  absl::Duration last_deadline() {
    absl::MutexLock lock(&mu_);
    return last_deadline_;
  }

 private:
  absl::Mutex mu_;
  int held_ ABSL_GUARDED_BY(mu_) = 0;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration last_deadline_ ABSL_GUARDED_BY(mu_);
};

class ControlServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kiln-control-test-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    service_ = std::make_unique<ControlService>(&target_, absl::Seconds(30));
    auto server = StartControlServer((dir_ / "c.sock").string(), service_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = v1::RuntimeControl::NewStub(grpc::CreateChannel(
        "unix:" + (dir_ / "c.sock").string(), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    target_.Release();
    if (server_) server_->Stop(absl::Seconds(5));
    server_.reset();
    service_.reset();
    std::filesystem::remove_all(dir_);
  }
  static void Deadline(grpc::ClientContext* ctx, int seconds = 10) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  }
  // A Drain sent from a thread of its own; its status when it returns.
  std::future<grpc::Status> DrainAsync(int64_t deadline_millis) {
    return std::async(std::launch::async, [this, deadline_millis] {
      grpc::ClientContext ctx;
      Deadline(&ctx, 30);
      v1::DrainRequest req;
      req.set_deadline_millis(deadline_millis);
      v1::DrainResponse resp;
      grpc::Status s = stub_->Drain(&ctx, req, &resp);
      if (s.ok() && (!resp.drained() || resp.state().state() != v1::SERVING)) {
        return grpc::Status(grpc::StatusCode::INTERNAL, "unexpected DrainResponse");
      }
      return s;
    });
  }

  std::filesystem::path dir_;
  HeldTarget target_;
  std::unique_ptr<ControlService> service_;
  std::unique_ptr<ControlServer> server_;
  std::unique_ptr<v1::RuntimeControl::Stub> stub_;
};

TEST_F(ControlServiceTest, QuickCallsAnswerWhileADrainIsHeld) {
  std::future<grpc::Status> drain = DrainAsync(2500);
  ASSERT_TRUE(target_.WaitHeld(1));
  for (int i = 0; i < 20; ++i) {
    grpc::ClientContext ctx;
    Deadline(&ctx, 5);
    v1::RuntimeState state;
    ASSERT_TRUE(stub_->GetState(&ctx, {}, &state).ok());
    EXPECT_EQ(state.state(), v1::SERVING);
    grpc::ClientContext sctx;
    Deadline(&sctx, 5);
    v1::RuntimeStats stats;
    ASSERT_TRUE(stub_->Stats(&sctx, {}, &stats).ok());
    EXPECT_EQ(stats.requests(), 7u);
  }
  // A refused Demote carries the target's reason.
  grpc::ClientContext dctx;
  Deadline(&dctx);
  v1::RuntimeState state;
  grpc::Status demoted = stub_->Demote(&dctx, {}, &state);
  EXPECT_EQ(demoted.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(demoted.error_message(), "cannot demote now");
  EXPECT_EQ(drain.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  target_.Release();
  EXPECT_TRUE(drain.get().ok());
  EXPECT_EQ(target_.last_deadline(), absl::Milliseconds(2500));
}

TEST_F(ControlServiceTest, BlockingCallsAreBoundedAndTheRestRefusedNotQueued) {
  std::vector<std::future<grpc::Status>> drains;
  for (int i = 0; i < ControlService::kMaxBlockingCalls; ++i) drains.push_back(DrainAsync(0));
  ASSERT_TRUE(target_.WaitHeld(ControlService::kMaxBlockingCalls));
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::LoadRequest load;
  load.add_args("--model=m");
  v1::LoadResponse resp;
  grpc::Status refused = stub_->Load(&ctx, load, &resp);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("too many control calls"), std::string::npos)
      << refused.error_message();
  // Shutdown is never refused for the bound: a runtime can always be told to stop.
  grpc::ClientContext sctx;
  Deadline(&sctx);
  v1::ShutdownResponse sresp;
  EXPECT_TRUE(stub_->Shutdown(&sctx, {}, &sresp).ok());
  EXPECT_TRUE(sresp.drained());
  target_.Release();
  for (auto& d : drains) EXPECT_TRUE(d.get().ok());
  EXPECT_EQ(target_.last_deadline(), absl::Seconds(30));  // 0 = the service's default
  // Finished workers are reaped: blocking calls are taken again, and a Load's own error
  // comes back.
  for (int i = 0; i < ControlService::kMaxBlockingCalls + 2; ++i) {
    grpc::ClientContext lctx;
    Deadline(&lctx);
    v1::LoadRequest empty;
    grpc::Status s = stub_->Load(&lctx, empty, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_EQ(s.error_message(), "--model: required");
  }
}

// A Promote with no warm-up to run is a state change, answered at once: it takes no blocking
// call's place (the bound refuses one that waits while the places are full).
TEST_F(ControlServiceTest, APromoteWithNothingToWaitForIsAnsweredWhileBlockingCallsAreFull) {
  std::vector<std::future<grpc::Status>> drains;
  for (int i = 0; i < ControlService::kMaxBlockingCalls; ++i) drains.push_back(DrainAsync(0));
  ASSERT_TRUE(target_.WaitHeld(ControlService::kMaxBlockingCalls));
  target_.promote_waits = false;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::RuntimeState state;
  grpc::Status s = stub_->Promote(&ctx, {}, &state);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(state.state(), v1::SERVING);
  target_.promote_waits = true;
  grpc::ClientContext wctx;
  Deadline(&wctx);
  s = stub_->Promote(&wctx, {}, &state);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  target_.Release();
  for (auto& d : drains) EXPECT_TRUE(d.get().ok());
}

// A Demote that waits for a Promote's warm-up waits on a thread of its own: the socket's one
// server thread goes on answering health probes meanwhile.
TEST_F(ControlServiceTest, ADemoteWaitingForAPromotesWarmUpLeavesTheQuickCallsAnswering) {
  target_.hold_promote = true;
  auto call = [this](bool promote) {
    return std::async(std::launch::async, [this, promote] {
      grpc::ClientContext ctx;
      Deadline(&ctx, 30);
      v1::RuntimeState state;
      return promote ? stub_->Promote(&ctx, {}, &state) : stub_->Demote(&ctx, {}, &state);
    });
  };
  std::future<grpc::Status> promote = call(true);
  ASSERT_TRUE(target_.WaitHeld(1));
  std::future<grpc::Status> demote = call(false);
  // The Demote has had time to reach the target and wait there.
  EXPECT_EQ(demote.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  grpc::ClientContext ctx;
  Deadline(&ctx, 5);
  v1::RuntimeState state;
  grpc::Status s = stub_->GetState(&ctx, {}, &state);
  EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
  target_.Release();
  EXPECT_TRUE(promote.get().ok());
  EXPECT_EQ(demote.get().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST_F(ControlServiceTest, ABadDeadlineIsRefusedNamingTheField) {
  for (int64_t bad : {int64_t{-1}, int64_t{3'600'001}}) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::DrainRequest req;
    req.set_deadline_millis(bad);
    v1::DrainResponse resp;
    grpc::Status s = stub_->Drain(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("deadline_millis"), std::string::npos) << s.error_message();
    grpc::ClientContext sctx;
    Deadline(&sctx);
    v1::ShutdownRequest sreq;
    sreq.set_deadline_millis(bad);
    v1::ShutdownResponse sresp;
    s = stub_->Shutdown(&sctx, sreq, &sresp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  EXPECT_EQ(target_.held(), 0);
}

// The server can stop while a blocking call still runs: its Shutdown waits for the worker to
// finish the call, and the service then goes.
TEST_F(ControlServiceTest, StoppingWhileADrainIsHeldFinishesIt) {
  std::future<grpc::Status> drain = DrainAsync(1000);
  ASSERT_TRUE(target_.WaitHeld(1));
  std::thread release([this] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    target_.Release();
  });
  server_->Stop(absl::Seconds(5));
  server_.reset();
  service_.reset();
  release.join();
  grpc::Status s = drain.get();
  // The grace outlasted the drain: answered, its reply written before the socket closed.
  EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
}

// With no grace the held call is cancelled at once; the service still waits for its worker.
TEST_F(ControlServiceTest, StoppingWithNoGraceCancelsAHeldCallAndWaitsForItsWorker) {
  std::future<grpc::Status> drain = DrainAsync(1000);
  ASSERT_TRUE(target_.WaitHeld(1));
  server_->Stop(absl::ZeroDuration());
  grpc::Status s = drain.get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  std::thread release([this] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    target_.Release();
  });
  service_->JoinWorkers();
  EXPECT_EQ(target_.held(), 0);
  release.join();
}

// What no generated stub sends: a method the service does not have, and bytes that are not
// the method's request. Each is refused saying what was expected, and the socket serves on.
TEST_F(ControlServiceTest, AnUnknownMethodOrABadRequestIsRefusedSayingWhatWasExpected) {
  const std::string address = "unix:" + (dir_ / "c.sock").string();
  grpc::Status s = testing::RawUnaryCall(address, "/kiln.v1.RuntimeControl/Reboot", "");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(s.error_message().find("unknown method /kiln.v1.RuntimeControl/Reboot"),
            std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find("serves kiln.v1.RuntimeControl"), std::string::npos);
  for (const char* method : {"Drain", "GetState", "Load"}) {
    s = testing::RawUnaryCall(address, std::string("/kiln.v1.RuntimeControl/") + method,
                              "\xff\xff\xff\xff");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_EQ(s.error_message(), std::string("the request is not a kiln.v1.") + method + "Request");
  }
  EXPECT_EQ(target_.held(), 0);  // nothing reached the target
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::RuntimeState state;
  ASSERT_TRUE(stub_->GetState(&ctx, {}, &state).ok());
  EXPECT_EQ(state.state(), v1::SERVING);
}

// A blocking call that throws (a model load out of memory, say) is answered INTERNAL with the
// reason, on its own thread, and the service serves on.
TEST_F(ControlServiceTest, AThrowingCallIsAnsweredInternalAndTheServiceServesOn) {
  target_.throw_on_promote = true;
  for (int i = 0; i < 4; ++i) {
    target_.promote_waits = i % 2 == 0;  // on a thread of its own, and inline
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::RuntimeState state;
    grpc::Status s = stub_->Promote(&ctx, {}, &state);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL);
    EXPECT_EQ(s.error_message(), "internal error: out of device memory");
  }
  target_.throw_on_promote = false;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::RuntimeState state;
  EXPECT_TRUE(stub_->Promote(&ctx, {}, &state).ok());
  EXPECT_EQ(state.state(), v1::SERVING);
}

}  // namespace
}  // namespace kiln
