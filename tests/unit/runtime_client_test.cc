// The agent's RuntimeControl client (agent/runtime_client.h) against a control service on a
// unix socket that stops answering, as a stopped or wedged runtime does.
#include "agent/runtime_client.h"

#include <unistd.h>

#include <atomic>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/eventually.h"
#include "tests/support/held_runtime_control.h"

namespace kiln {
namespace {

using kiln::testing::Eventually;
using kiln::testing::HeldRuntimeControl;

std::string SocketPath(const std::string& tag) {
  return ::testing::TempDir() + "/kiln_rc_" + tag + "_" + std::to_string(getpid()) + ".sock";
}

// A held runtime and a client of it with a 10 ms inline wait, connected; `late` counts the
// late answers the client told of.
struct Rig {
  Rig(const std::string& tag, v1::LifecycleState state, absl::Duration timeout)
      : runtime(SocketPath(tag), state),
        factory(timeout, absl::Milliseconds(10), [this] { ++late; }),
        client(factory.Connect(SocketPath(tag))) {}
  // Serving and answering (ASSERT_TRUE(rig.Ready())).
  bool Ready() { return runtime.server() != nullptr && client->AwaitState().ok(); }
  HeldRuntimeControl runtime;
  std::atomic<int> late{0};
  GrpcRuntimeClientFactory factory;
  std::unique_ptr<RuntimeClient> client;
};

// Once a call timed out, the next ones get a short time, until the runtime answers again; then
// the whole timeout again.
TEST(GrpcRuntimeClientTest, ARuntimeThatLetACallTimeOutIsGivenLessTimeUntilItAnswers) {
  HeldRuntimeControl runtime(SocketPath("short"));
  ASSERT_NE(runtime.server(), nullptr);
  GrpcRuntimeClientFactory factory(absl::Seconds(1));
  auto client = factory.Connect(SocketPath("short"));
  ASSERT_TRUE(client->GetState().ok());
  runtime.Hold("GetState", true);  // stopped
  EXPECT_EQ(client->GetState().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(client->GetState().status().code(), absl::StatusCode::kDeadlineExceeded);
  runtime.Hold("GetState", false);
  ASSERT_TRUE(client->GetState().ok());
  ASSERT_TRUE(client->GetState().ok());
  std::vector<absl::Duration> left = runtime.calls("GetState");
  ASSERT_EQ(left.size(), 5u);
  // The whole timeout (1 s), the whole timeout (the first to time out), then 200 ms twice (the
  // second silent call, and the one that found it answering again), then the whole timeout.
  // (The deadline crosses the wire rounded: far apart, the two are told apart.)
  EXPECT_GT(left[0], absl::Milliseconds(600));
  EXPECT_GT(left[1], absl::Milliseconds(600));
  EXPECT_LT(left[2], absl::Milliseconds(300));
  EXPECT_LT(left[3], absl::Milliseconds(300));
  EXPECT_GT(left[4], absl::Milliseconds(600));
}

// With an inline wait, a slow answer does not hold its caller: the call answers pending, stays
// the one call on its way (asking again does not pile calls up on a wedged runtime), tells
// the caller when its answer comes, and that answer is what the next call takes.
TEST(GrpcRuntimeClientTest, ASlowAnswerIsPendingAndTakenByTheNextCall) {
  Rig rig("pend", v1::SERVING, absl::Seconds(30));
  ASSERT_TRUE(rig.Ready());
  auto& runtime = rig.runtime;
  auto& client = rig.client;
  auto& late = rig.late;
  runtime.Hold("GetState", true);
  absl::StatusOr<v1::RuntimeState> st = client->GetState();
  EXPECT_TRUE(IsAnswerPending(st.status())) << st.status();
  ASSERT_TRUE(Eventually([&] { return runtime.held_now("GetState") == 1; }, absl::Seconds(10)));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(IsAnswerPending(client->GetState().status()));
  EXPECT_EQ(runtime.calls("GetState").size(), 2u);  // the first, and the one on its way
  EXPECT_EQ(late.load(), 0);
  runtime.Hold("GetState", false);
  ASSERT_TRUE(Eventually([&] { return late.load() == 1; }, absl::Seconds(10)));
  st = client->GetState();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->state(), v1::SERVING);
  EXPECT_EQ(runtime.calls("GetState").size(), 2u);  // the answer came from the call on its way
  ASSERT_TRUE(client->AwaitState().ok());
  EXPECT_EQ(runtime.calls("GetState").size(), 3u);  // then a new one
  EXPECT_EQ(late.load(), 1);  // answers waited for are not told
}

// A Load slow to answer answers pending, is never sent twice (a runtime takes one), keeps its
// answer for its caller past the staleness second, and has at least 10 s before its deadline.
TEST(GrpcRuntimeClientTest, ALoadOnItsWayIsAskedOnceAndItsAnswerKeptForItsCaller) {
  Rig rig("load", v1::LOADING, absl::Seconds(2));
  ASSERT_TRUE(rig.Ready());
  auto& runtime = rig.runtime;
  auto& client = rig.client;
  runtime.Hold("Load", true);
  absl::Status s = client->Load({"--model", "enc"});
  EXPECT_TRUE(IsAnswerPending(s)) << s;
  ASSERT_TRUE(Eventually([&] { return runtime.held_now("Load") == 1; }, absl::Seconds(10)));
  EXPECT_TRUE(IsAnswerPending(client->Load({"--model", "other"})));
  runtime.Hold("Load", false);
  ASSERT_TRUE(Eventually([&] { return rig.late.load() == 1; }, absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(1100));  // past the second an unclaimed answer is kept
  s = client->Load({"--model", "other"});
  EXPECT_TRUE(s.ok()) << s;
  ASSERT_EQ(runtime.calls("Load").size(), 1u);
  EXPECT_GT(runtime.calls("Load")[0], absl::Seconds(8));  // not the 2 s of the other calls
  EXPECT_EQ(runtime.loaded(), (std::vector<std::string>{"--model", "enc"}));
  // Taken: a Load now is a new call, which the runtime refuses.
  s = client->Load({"--model", "enc"});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(runtime.calls("Load").size(), 2u);
}

// A Promote whose answer nobody came back for is dropped once a fresh state is answered: a
// later Promote asks the runtime again instead of taking an old answer.
TEST(GrpcRuntimeClientTest, AnAnswerOvertakenByAFreshStateIsDropped) {
  Rig rig("drop", v1::WARM, absl::Seconds(30));
  ASSERT_TRUE(rig.Ready());
  auto& runtime = rig.runtime;
  auto& client = rig.client;
  auto& late = rig.late;
  runtime.Hold("Promote", true);
  EXPECT_TRUE(IsAnswerPending(client->Promote().status()));
  runtime.Hold("Promote", false);
  ASSERT_TRUE(Eventually([&] { return late.load() == 1; }, absl::Seconds(10)));
  auto st = client->AwaitState();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->state(), v1::SERVING);
  ASSERT_EQ(runtime.calls("Promote").size(), 1u);
  absl::StatusOr<v1::RuntimeState> p;
  ASSERT_TRUE(Eventually([&] { return !IsAnswerPending((p = client->Promote()).status()); },
                         absl::Seconds(10)));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(runtime.calls("Promote").size(), 2u);
}

// A failed Promote is kept for its caller to hear, fresh state or not: the next Promote
// takes the error instead of asking again (without a word, for ever).
TEST(GrpcRuntimeClientTest, AFailedAnswerIsKeptForItsCaller) {
  Rig rig("fail", v1::WARM, absl::Seconds(30));
  ASSERT_TRUE(rig.Ready());
  auto& runtime = rig.runtime;
  auto& client = rig.client;
  auto& late = rig.late;
  runtime.Hold("Promote", true);
  runtime.Refuse("Promote", grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "warm-up failed"));
  EXPECT_TRUE(IsAnswerPending(client->Promote().status()));
  runtime.Hold("Promote", false);
  ASSERT_TRUE(Eventually([&] { return late.load() == 1; }, absl::Seconds(10)));
  ASSERT_TRUE(client->AwaitState().ok());
  auto p = client->Promote();
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << p.status();
  EXPECT_EQ(runtime.calls("Promote").size(), 1u);
}

// An answer nobody came back for within a second is old news: the next call asks afresh.
TEST(GrpcRuntimeClientTest, AnAnswerNobodyCameBackForWithinASecondIsDropped) {
  Rig rig("stale", v1::WARM, absl::Seconds(30));
  ASSERT_TRUE(rig.Ready());
  auto& runtime = rig.runtime;
  auto& client = rig.client;
  auto& late = rig.late;
  runtime.Hold("Demote", true);
  EXPECT_TRUE(IsAnswerPending(client->Demote().status()));
  runtime.Hold("Demote", false);
  ASSERT_TRUE(Eventually([&] { return late.load() == 1; }, absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(1500));  // what is under test: a second after the answer
  absl::StatusOr<v1::RuntimeState> d;
  ASSERT_TRUE(Eventually([&] { return !IsAnswerPending((d = client->Demote()).status()); },
                         absl::Seconds(10)));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(runtime.calls("Demote").size(), 2u);
}

// A pending call that runs out of time ends DEADLINE_EXCEEDED, and the client then gives the
// silent runtime the short timeout, without waiting for it inline.
TEST(GrpcRuntimeClientTest, APendingCallPastItsDeadlineEndsDeadlineExceeded) {
  Rig rig("dead", v1::SERVING, absl::Seconds(1));
  ASSERT_TRUE(rig.Ready());
  auto& runtime = rig.runtime;
  auto& client = rig.client;
  runtime.Hold("GetState", true);
  absl::StatusOr<v1::RuntimeState> st = client->GetState();
  EXPECT_TRUE(IsAnswerPending(st.status()));
  ASSERT_TRUE(Eventually(
      [&] { return !IsAnswerPending((st = client->GetState()).status()); }, absl::Seconds(10)));
  EXPECT_EQ(st.status().code(), absl::StatusCode::kDeadlineExceeded) << st.status();
  EXPECT_TRUE(IsAnswerPending(client->GetState().status()));
  ASSERT_TRUE(Eventually([&] { return runtime.calls("GetState").size() == 3u; },
                         absl::Seconds(10)));
  EXPECT_GT(runtime.calls("GetState")[1], absl::Milliseconds(600));
  EXPECT_LT(runtime.calls("GetState")[2], absl::Milliseconds(300));
  // AwaitState waits a call out (the one on its way may still end DEADLINE_EXCEEDED).
  runtime.Hold("GetState", false);
  EXPECT_TRUE(Eventually([&] { return client->AwaitState().ok(); }, absl::Seconds(10)));
}

// A client destroyed with a call on its way ends the call, and its answer tells nobody (what
// the callback refers to may be gone with the client).
TEST(GrpcRuntimeClientTest, AClientGoneWithACallOnItsWayTellsNobody) {
  HeldRuntimeControl runtime(SocketPath("gone"), v1::SERVING);
  ASSERT_NE(runtime.server(), nullptr);
  std::atomic<int> late{0};
  auto factory = std::make_unique<GrpcRuntimeClientFactory>(
      absl::Seconds(30), absl::Milliseconds(10), [&late] { ++late; });
  auto client = factory->Connect(SocketPath("gone"));
  ASSERT_TRUE(client->AwaitState().ok());
  runtime.Hold("GetState", true);
  EXPECT_TRUE(IsAnswerPending(client->GetState().status()));
  ASSERT_TRUE(Eventually([&] { return runtime.held_now("GetState") == 1; }, absl::Seconds(10)));
  client.reset();
  // Cancelled: the runtime's handler sees it and lets the call go.
  ASSERT_TRUE(Eventually([&] { return runtime.held_now("GetState") == 0; }, absl::Seconds(10)));
  runtime.Hold("GetState", false);
  // The factory's completion queue goes once every call on it has ended: whatever the ended
  // call would have told has been told by then.
  factory.reset();
  EXPECT_EQ(late.load(), 0);
}

// StartStats sends the call and returns: replicas asked one after another are all asked at
// once, and AwaitStats takes the call already on its way (not a second one).
TEST(GrpcRuntimeClientTest, StartStatsAsksEveryReplicaAtOnce) {
  Rig a("sa", v1::SERVING, absl::Seconds(30));
  Rig b("sb", v1::SERVING, absl::Seconds(30));
  ASSERT_TRUE(a.Ready());
  ASSERT_TRUE(b.Ready());
  a.runtime.Hold("Stats", true);
  b.runtime.Hold("Stats", true);
  a.client->StartStats();
  b.client->StartStats();
  // Both held at once: neither start waited for its answer.
  ASSERT_TRUE(Eventually(
      [&] { return a.runtime.held_now("Stats") == 1 && b.runtime.held_now("Stats") == 1; },
      absl::Seconds(10)));
  a.client->StartStats();  // one on its way already: nothing more is sent
  a.runtime.Hold("Stats", false);
  b.runtime.Hold("Stats", false);
  // The held runtime answers how many Stats calls it has seen: the first is the started one.
  absl::StatusOr<v1::RuntimeStats> sa = a.client->AwaitStats();
  // b's answer came long before its caller is back (a slower replica was asked first): a
  // started call's answer is kept for its caller, not dropped as stale and asked again.
  ASSERT_TRUE(Eventually([&] { return b.runtime.held_now("Stats") == 0; }, absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(1500));  // what is under test: past the 1 s staleness
  absl::StatusOr<v1::RuntimeStats> sb = b.client->AwaitStats();
  ASSERT_TRUE(sa.ok()) << sa.status();
  ASSERT_TRUE(sb.ok()) << sb.status();
  EXPECT_EQ(sa->requests(), 1u);
  EXPECT_EQ(sb->requests(), 1u);
  // Without a start, AwaitStats asks and waits.
  sa = a.client->AwaitStats();
  ASSERT_TRUE(sa.ok()) << sa.status();
  EXPECT_EQ(sa->requests(), 2u);
  EXPECT_EQ(a.late.load(), 0);  // the starts were waited for, not told of
}

}  // namespace
}  // namespace kiln
