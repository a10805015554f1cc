#include "runtime/batcher.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <stdexcept>
#include <thread>

#include "absl/synchronization/notification.h"
#include "common/cpu_list.h"
#include "gtest/gtest.h"
#include "tests/support/eventually.h"

namespace kiln {
namespace {

constexpr absl::Duration kDelay = absl::Microseconds(2000);

class DecideTest : public ::testing::Test {
 protected:
  BatchPolicy Policy(int64_t max, std::vector<int64_t> preferred = {},
                     absl::Duration delay = kDelay) {
    BatchPolicy p;
    p.dynamic = true;
    p.max_batch_size = max;
    p.preferred_batch_sizes = std::move(preferred);
    p.max_queue_delay = delay;
    return p;
  }
  PendingView At(absl::Duration ago, int64_t priority = 1, int64_t rows = 1,
                 std::string key = "k") {
    PendingView v;
    v.enqueued = clock_.Now() - ago;
    v.priority = priority;
    v.rows = rows;
    v.shape_key = std::move(key);
    return v;
  }
  SimulatedClock clock_;
};

TEST_F(DecideTest, EmptyQueueWaitsForever) {
  BatchDecision d = Decide({}, clock_.Now(), Policy(8));
  EXPECT_TRUE(d.batch.empty());
  EXPECT_EQ(d.wake_at, absl::InfiniteFuture());
}

TEST_F(DecideTest, WaitsForMaxQueueDelayThenRunsWhatItHas) {
  std::vector<PendingView> q = {At(absl::ZeroDuration()), At(absl::ZeroDuration())};
  BatchDecision d = Decide(q, clock_.Now(), Policy(8));
  EXPECT_TRUE(d.batch.empty());
  EXPECT_EQ(d.wake_at, clock_.Now() + kDelay);

  clock_.Advance(kDelay - absl::Microseconds(1));
  EXPECT_TRUE(Decide(q, clock_.Now(), Policy(8)).batch.empty());
  clock_.Advance(absl::Microseconds(1));
  d = Decide(q, clock_.Now(), Policy(8));
  EXPECT_EQ(d.batch, (std::vector<size_t>{0, 1}));
}

TEST_F(DecideTest, FullBatchRunsAtOnce) {
  std::vector<PendingView> q;
  for (int i = 0; i < 5; ++i) q.push_back(At(absl::ZeroDuration()));
  BatchDecision d = Decide(q, clock_.Now(), Policy(4));
  EXPECT_EQ(d.batch, (std::vector<size_t>{0, 1, 2, 3}));
}

TEST_F(DecideTest, NextRequestNotFittingMakesBatchFull) {
  // 3 rows queued, the next request has 2 rows and max is 4: waiting cannot help.
  std::vector<PendingView> q = {At(absl::ZeroDuration(), 1, 3), At(absl::ZeroDuration(), 1, 2)};
  BatchDecision d = Decide(q, clock_.Now(), Policy(4));
  EXPECT_EQ(d.batch, (std::vector<size_t>{0}));
}

TEST_F(DecideTest, PreferredSizeRunsBeforeTheDelay) {
  std::vector<PendingView> q;
  for (int i = 0; i < 5; ++i) q.push_back(At(absl::ZeroDuration()));
  BatchDecision d = Decide(q, clock_.Now(), Policy(8, {2, 4}));
  // The largest preferred size reachable is 4.
  EXPECT_EQ(d.batch, (std::vector<size_t>{0, 1, 2, 3}));
  q.resize(3);
  d = Decide(q, clock_.Now(), Policy(8, {2, 4}));
  EXPECT_EQ(d.batch, (std::vector<size_t>{0, 1}));
  q.resize(1);
  d = Decide(q, clock_.Now(), Policy(8, {2, 4}));
  EXPECT_TRUE(d.batch.empty());
  EXPECT_EQ(d.wake_at, clock_.Now() + kDelay);
}

TEST_F(DecideTest, ZeroDelayWithoutPreferredRunsImmediately) {
  std::vector<PendingView> q = {At(absl::ZeroDuration())};
  BatchDecision d = Decide(q, clock_.Now(), Policy(8, {}, absl::ZeroDuration()));
  EXPECT_EQ(d.batch, (std::vector<size_t>{0}));
}

TEST_F(DecideTest, HigherPriorityLeadsAndNeverWaitsBehindLower) {
  // An older low-priority (2) request and a newer high-priority (1) one.
  std::vector<PendingView> q = {At(absl::Microseconds(1500), 2), At(absl::ZeroDuration(), 1)};
  BatchDecision d = Decide(q, clock_.Now(), Policy(1));
  EXPECT_EQ(d.batch, (std::vector<size_t>{1}));
  // With room for both, the high one is first in the batch.
  d = Decide(q, clock_.Now(), Policy(2));
  EXPECT_EQ(d.batch, (std::vector<size_t>{1, 0}));
}

TEST_F(DecideTest, LeaderDelayGovernsTheWake) {
  // The high-priority leader is new: its delay, not the old low one's, sets the deadline.
  std::vector<PendingView> q = {At(absl::Microseconds(1900), 2), At(absl::ZeroDuration(), 1)};
  BatchDecision d = Decide(q, clock_.Now(), Policy(8));
  EXPECT_TRUE(d.batch.empty());
  EXPECT_EQ(d.wake_at, clock_.Now() + kDelay);
}

TEST_F(DecideTest, DifferentShapesDoNotMix) {
  std::vector<PendingView> q = {At(kDelay, 1, 1, "a"), At(kDelay, 1, 1, "b"),
                                At(kDelay, 1, 1, "a")};
  BatchDecision d = Decide(q, clock_.Now(), Policy(8));
  EXPECT_EQ(d.batch, (std::vector<size_t>{0, 2}));
}

TEST_F(DecideTest, ExpiredRequestsAreReportedAndSkipped) {
  std::vector<PendingView> q = {At(kDelay), At(absl::ZeroDuration())};
  q[0].deadline = clock_.Now() - absl::Microseconds(1);
  q[1].deadline = clock_.Now() + absl::Microseconds(500);
  BatchDecision d = Decide(q, clock_.Now(), Policy(8));
  EXPECT_EQ(d.expired, (std::vector<size_t>{0}));
  EXPECT_TRUE(d.batch.empty());
  // The live request's own deadline comes before its batching delay.
  EXPECT_EQ(d.wake_at, clock_.Now() + absl::Microseconds(500));
}

TEST_F(DecideTest, ARequestRunAgainAloneNeitherJoinsNorTakesOthers) {
  // Three requests of one shape, the oldest marked to run alone (its batch failed).
  std::vector<PendingView> q = {At(kDelay), At(kDelay), At(kDelay)};
  q[0].alone = true;
  BatchDecision d = Decide(q, clock_.Now(), Policy(8));
  EXPECT_EQ(d.batch, (std::vector<size_t>{0}));
  // Led by another, the batch leaves it out.
  q[0].priority = 2;
  d = Decide(q, clock_.Now(), Policy(8));
  EXPECT_EQ(d.batch, (std::vector<size_t>{1, 2}));
  // And a higher priority leads it even though it is older.
  q[0].priority = 2;
  q[1].alone = true;
  q[1].priority = 3;
  q[2].priority = 1;
  d = Decide(q, clock_.Now(), Policy(8));
  EXPECT_EQ(d.batch, (std::vector<size_t>{2}));
}

TEST_F(DecideTest, BatchingOffRunsOneRequestAtATime) {
  BatchPolicy p;
  p.dynamic = false;
  p.max_batch_size = 8;
  std::vector<PendingView> q = {At(absl::ZeroDuration(), 2), At(absl::ZeroDuration(), 1)};
  BatchDecision d = Decide(q, clock_.Now(), p);
  EXPECT_EQ(d.batch, (std::vector<size_t>{1}));
}

Tensor Make(const std::string& name, std::vector<int64_t> shape, std::vector<float> values) {
  Tensor t;
  t.name = name;
  t.dtype = DataType::kFp32;
  t.shape = std::move(shape);
  t.data.resize(values.size() * 4);
  std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
}

TEST(ConcatSplitTest, RoundTripsExactly) {
  std::vector<Tensor> a = {Make("x", {1, 2}, {1, 2})};
  std::vector<Tensor> b = {Make("x", {2, 2}, {3, 4, 5, 6})};
  auto batched = ConcatBatch({&a, &b});
  ASSERT_TRUE(batched.ok()) << batched.status();
  EXPECT_EQ((*batched)[0].shape, (std::vector<int64_t>{3, 2}));
  auto split = SplitBatch(*batched, {1, 2});
  ASSERT_TRUE(split.ok());
  EXPECT_EQ((*split)[0][0].data, a[0].data);
  EXPECT_EQ((*split)[1][0].data, b[0].data);
  EXPECT_EQ((*split)[1][0].shape, (std::vector<int64_t>{2, 2}));
}

TEST(ConcatSplitTest, RejectsMismatchedShapes) {
  std::vector<Tensor> a = {Make("x", {1, 2}, {1, 2})};
  std::vector<Tensor> b = {Make("x", {1, 3}, {3, 4, 5})};
  EXPECT_EQ(ConcatBatch({&a, &b}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ConcatSplitTest, SplitRejectsWrongBatchDimension) {
  std::vector<Tensor> out = {Make("y", {2, 1}, {1, 2})};
  auto split = SplitBatch(out, {1, 2});
  EXPECT_EQ(split.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(split.status().message().find("batch of 3"), std::string::npos);
}

// An execution that answers its input as the output "y".
absl::StatusOr<std::vector<Tensor>> EchoAsY(std::vector<Tensor> in) {
  Tensor y = in[0];
  y.name = "y";
  return std::vector<Tensor>{y};
}

ModelConfig BatchingConfig(int64_t max_queue) {
  ModelConfig c;
  c.name = "m";
  c.backend = "test";
  c.max_batch_size = 4;
  c.inputs = {{"x", DataType::kFp32, {1}}};
  c.outputs = {{"y", DataType::kFp32, {1}}};
  DynamicBatchingConfig db;
  // A (tiny) delay keeps requests on the executor thread rather than the caller's.
  db.max_queue_delay_microseconds = 1;
  db.max_queue_size = max_queue;
  c.dynamic_batching = db;
  return c;
}

// Waits (bounded) until the executor took every queued request; true when it did.
bool ExecutorTookAll(Batcher& batcher) {
  for (int i = 0; i < 2000 && batcher.queue_depth() > 0; ++i) absl::SleepFor(absl::Milliseconds(1));
  return batcher.queue_depth() == 0;
}

// An executor that holds each execution until released, then echoes input x as output y.
struct HeldEcho {
  absl::Mutex mu;
  bool release ABSL_GUARDED_BY(mu) = false;
  Batcher::Executor Executor() {
    return [this](std::vector<Tensor> in) -> absl::StatusOr<std::vector<Tensor>> {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(&release));
      Tensor y = in[0];
      y.name = "y";
      return std::vector<Tensor>{y};
    };
  }
};

TEST(BatcherTest, FullQueueIsResourceExhausted) {
  RealClock clock;  // the executor thread waits out a real (1 us) delay
  absl::Mutex mu;
  bool release = false;
  auto exec = [&](std::vector<Tensor> in) -> absl::StatusOr<std::vector<Tensor>> {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&release));
    return std::vector<Tensor>{Make("y", {in[0].shape[0], 1}, std::vector<float>(in[0].shape[0]))};
  };
  auto batcher = Batcher::Create(BatchingConfig(1), exec, &clock, nullptr);
  ASSERT_TRUE(batcher.ok());
  std::atomic<int> done{0};
  auto item = [&]() {
    Batcher::Item it;
    it.inputs = {Make("x", {1, 1}, {1})};
    it.done = [&](absl::StatusOr<std::vector<Tensor>> r) { done++; };
    return it;
  };
  ASSERT_TRUE((*batcher)->Enqueue(item()).ok());
  // Wait (bounded) until the executor took the first one and is blocked in it.
  ASSERT_TRUE(ExecutorTookAll(**batcher));
  ASSERT_TRUE((*batcher)->Enqueue(item()).ok());
  absl::Status full = (*batcher)->Enqueue(item());
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  {
    absl::MutexLock lock(&mu);
    release = true;
  }
  (*batcher)->Stop();
  EXPECT_EQ(done.load(), 2);
}

// A queued request's timeout fires at its deadline even while an execution holds the executor:
// it is not answered only when the batch ahead of it ends.
TEST(BatcherTest, AQueuedRequestTimesOutWhileAnExecutionRuns) {
  RealClock clock;
  HeldEcho held;
  absl::Mutex& mu = held.mu;
  auto batcher = Batcher::Create(BatchingConfig(0), held.Executor(), &clock, nullptr);
  ASSERT_TRUE(batcher.ok());
  std::vector<absl::StatusCode> codes;  // guarded by mu
  auto item = [&](absl::Time deadline) {
    Batcher::Item it;
    it.inputs = {Make("x", {1, 1}, {1})};
    it.deadline = deadline;
    it.done = [&](absl::StatusOr<std::vector<Tensor>> r) {
      absl::MutexLock lock(&mu);
      codes.push_back(r.status().code());
    };
    return it;
  };
  ASSERT_TRUE((*batcher)->Enqueue(item(absl::InfiniteFuture())).ok());
  ASSERT_TRUE(ExecutorTookAll(**batcher));  // the executor holds the first one
  ASSERT_TRUE((*batcher)->Enqueue(item(clock.Now() + absl::Milliseconds(20))).ok());
  {
    // Answered while the first one is still held (it is released only after this).
    absl::MutexLock lock(&mu);
    auto answered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return codes.size() == 1; };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&answered), absl::Seconds(10)));
    ASSERT_EQ(codes.size(), 1u);
    EXPECT_EQ(codes[0], absl::StatusCode::kDeadlineExceeded);
    held.release = true;
  }
  (*batcher)->Stop();
  absl::MutexLock lock(&mu);
  ASSERT_EQ(codes.size(), 2u);
  EXPECT_EQ(codes[1], absl::StatusCode::kOk);
  EXPECT_EQ((*batcher)->queue_depth(), 0);
}

TEST(BatcherTest, OneBadRequestDoesNotFailTheOthersInItsBatch) {
  RealClock clock;
  ModelConfig config = BatchingConfig(0);
  absl::Mutex mu;
  bool release = false;
  std::vector<int64_t> executed;  // each execution's batch size
  // Holds the execution of the value 0 until released; fails any execution holding 13.
  auto exec = [&](std::vector<Tensor> in) -> absl::StatusOr<std::vector<Tensor>> {
    const float* f = reinterpret_cast<const float*>(in[0].data.data());
    absl::MutexLock lock(&mu);
    executed.push_back(in[0].shape[0]);
    if (f[0] == 0) mu.Await(absl::Condition(&release));
    for (int64_t i = 0; i < in[0].shape[0]; ++i) {
      if (f[i] == 13) return absl::InternalError("bad token");
    }
    Tensor y = in[0];
    y.name = "y";
    return std::vector<Tensor>{y};
  };
  std::vector<absl::StatusCode> codes;
  auto batcher = Batcher::Create(config, exec, &clock, nullptr);
  ASSERT_TRUE(batcher.ok());
  auto enqueue = [&](float v) {
    Batcher::Item it;
    it.inputs = {Make("x", {1, 1}, {v})};
    it.done = [&](absl::StatusOr<std::vector<Tensor>> r) {
      absl::MutexLock lock(&mu);
      codes.push_back(r.status().code());
    };
    ASSERT_TRUE((*batcher)->Enqueue(std::move(it)).ok());
  };
  // The executor takes the first request and is held in it; the next three wait together.
  enqueue(0);
  ASSERT_TRUE(ExecutorTookAll(**batcher));
  for (float v : {1.0f, 13.0f, 2.0f}) enqueue(v);
  ASSERT_EQ((*batcher)->queue_depth(), 3);
  {
    absl::MutexLock lock(&mu);
    release = true;
    auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return codes.size() == 4; };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all), absl::Seconds(10)));
  }
  (*batcher)->Stop();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(std::count(codes.begin(), codes.end(), absl::StatusCode::kOk), 3);
  EXPECT_EQ(std::count(codes.begin(), codes.end(), absl::StatusCode::kInternal), 1);
  // The held one, the three together (which failed), then each of them alone.
  EXPECT_EQ(executed, (std::vector<int64_t>{1, 3, 1, 1, 1}));
}

// A failed batch's requests are run again one at a time, and a higher-priority request that
// arrives meanwhile runs before the ones still waiting to be re-run.
TEST(BatcherTest, ARequestRunAgainAfterItsBatchFailedDoesNotHoldBackAHigherPriority) {
  RealClock clock;
  absl::Mutex mu;
  bool release_first = false;   // holds the execution of the value 0
  bool release_rerun = false;   // holds the lone re-run of the value 1
  bool rerun_started = false;
  std::vector<std::vector<float>> executed;  // each execution's values
  auto exec = [&](std::vector<Tensor> in) -> absl::StatusOr<std::vector<Tensor>> {
    const float* f = reinterpret_cast<const float*>(in[0].data.data());
    absl::MutexLock lock(&mu);
    executed.emplace_back(f, f + in[0].shape[0]);
    if (f[0] == 0) mu.Await(absl::Condition(&release_first));
    if (in[0].shape[0] == 1 && f[0] == 1) {
      rerun_started = true;
      mu.Await(absl::Condition(&release_rerun));
    }
    for (int64_t i = 0; i < in[0].shape[0]; ++i) {
      if (f[i] == 13) return absl::InternalError("bad token");
    }
    Tensor y = in[0];
    y.name = "y";
    return std::vector<Tensor>{y};
  };
  auto batcher = Batcher::Create(BatchingConfig(0), exec, &clock, nullptr);
  ASSERT_TRUE(batcher.ok());
  std::vector<std::pair<float, absl::StatusCode>> answers;
  auto enqueue = [&](float v, int64_t priority) {
    Batcher::Item it;
    it.inputs = {Make("x", {1, 1}, {v})};
    it.priority = priority;
    it.done = [&, v](absl::StatusOr<std::vector<Tensor>> r) {
      absl::MutexLock lock(&mu);
      answers.emplace_back(v, r.status().code());
    };
    ASSERT_TRUE((*batcher)->Enqueue(std::move(it)).ok());
  };
  enqueue(0, 2);
  ASSERT_TRUE(ExecutorTookAll(**batcher));
  for (float v : {1.0f, 13.0f, 2.0f}) enqueue(v, 2);
  {
    absl::MutexLock lock(&mu);
    release_first = true;
    // The three fail together, then the first of them is re-run alone and held there.
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&rerun_started), absl::Seconds(10)));
  }
  enqueue(5, 1);  // a higher priority, while 13 and 2 still wait to be re-run
  {
    absl::MutexLock lock(&mu);
    release_rerun = true;
    auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return answers.size() == 5; };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all), absl::Seconds(10)));
  }
  (*batcher)->Stop();
  absl::MutexLock lock(&mu);
  // The order of execution is what is under test; each request's answer is its own (replies
  // of a batch run while others waited may be sent after later batches' replies).
  EXPECT_EQ(executed, (std::vector<std::vector<float>>{{0}, {1, 13, 2}, {1}, {5}, {13}, {2}}));
  const std::vector<std::pair<float, absl::StatusCode>> want = {
      {0, absl::StatusCode::kOk},
      {1, absl::StatusCode::kOk},
      {2, absl::StatusCode::kOk},
      {5, absl::StatusCode::kOk},
      {13, absl::StatusCode::kInternal}};
  std::sort(answers.begin(), answers.end());
  EXPECT_EQ(answers, want);
}

// max_queue_size bounds each priority level on its own: low-priority requests filling their
// queue never refuse a higher one.
TEST(BatcherTest, EachPriorityLevelHasItsOwnQueueBound) {
  RealClock clock;
  HeldEcho held;
  auto batcher = Batcher::Create(BatchingConfig(2), held.Executor(), &clock, nullptr);
  ASSERT_TRUE(batcher.ok());
  std::atomic<int> ok{0};
  auto item = [&](int64_t priority) {
    Batcher::Item it;
    it.inputs = {Make("x", {1, 1}, {1})};
    it.priority = priority;
    it.done = [&](absl::StatusOr<std::vector<Tensor>> r) {
      if (r.ok()) ok++;
    };
    return it;
  };
  ASSERT_TRUE((*batcher)->Enqueue(item(2)).ok());
  ASSERT_TRUE(ExecutorTookAll(**batcher));  // the executor holds the first one
  ASSERT_TRUE((*batcher)->Enqueue(item(2)).ok());
  ASSERT_TRUE((*batcher)->Enqueue(item(2)).ok());
  absl::Status full = (*batcher)->Enqueue(item(2));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("at priority 2"), std::string::npos) << full;
  // Priority 1 has a queue of its own, bounded the same.
  EXPECT_TRUE((*batcher)->Enqueue(item(1)).ok());
  EXPECT_TRUE((*batcher)->Enqueue(item(1)).ok());
  EXPECT_EQ((*batcher)->Enqueue(item(1)).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*batcher)->queue_depth(), 4);
  {
    absl::MutexLock lock(&held.mu);
    held.release = true;
  }
  // Drained, each level takes requests again.
  for (int i = 0; i < 5000 && ok.load() < 5; ++i) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(ok.load(), 5);
  EXPECT_TRUE((*batcher)->Enqueue(item(2)).ok());
  (*batcher)->Stop();
}

TEST(BatcherTest, ALoneRequestOnAnIdleModelRunsOnTheCallersThread) {
  SimulatedClock clock;
  ModelConfig config = BatchingConfig(0);
  config.dynamic_batching.reset();  // no batching: every request runs alone
  std::thread::id ran_on;
  auto exec = [&](std::vector<Tensor> in) -> absl::StatusOr<std::vector<Tensor>> {
    ran_on = std::this_thread::get_id();
    Tensor y = in[0];
    y.name = "y";
    return std::vector<Tensor>{y};
  };
  auto batcher = Batcher::Create(config, exec, &clock, nullptr);
  ASSERT_TRUE(batcher.ok());
  bool done = false;
  Batcher::Item it;
  it.inputs = {Make("x", {1, 1}, {5})};
  it.done = [&](absl::StatusOr<std::vector<Tensor>> r) { done = r.ok(); };
  ASSERT_TRUE((*batcher)->Enqueue(std::move(it)).ok());
  EXPECT_TRUE(done);  // already answered when Enqueue returns
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  (*batcher)->Stop();
}

// An execution or a reply that throws (out of memory, say) answers its request INTERNAL and
// leaves the batcher serving: inline on the caller's thread and on the executor thread alike;
// Stop still returns.
TEST(BatcherTest, AThrowingExecutionOrReplyLeavesTheBatcherServing) {
  for (bool one_thread : {false, true}) {
    SCOPED_TRACE(one_thread ? "executor thread" : "inline");
    RealClock clock;
    ModelConfig config = BatchingConfig(0);
    config.dynamic_batching.reset();
    std::atomic<bool> throw_next{true};
    auto exec = [&](std::vector<Tensor> in) -> absl::StatusOr<std::vector<Tensor>> {
      if (throw_next.exchange(false)) throw std::bad_alloc();
      Tensor y = in[0];
      y.name = "y";
      return std::vector<Tensor>{y};
    };
    auto batcher = Batcher::Create(config, exec, &clock, nullptr, one_thread);
    ASSERT_TRUE(batcher.ok());
    struct Outcome {
      absl::Notification done;
      absl::Status status;
    };
    auto send = [&](Outcome* out, bool reply_throws) {
      Batcher::Item it;
      it.inputs = {Make("x", {1, 1}, {5})};
      it.done = [out, reply_throws](absl::StatusOr<std::vector<Tensor>> r) {
        out->status = r.status();
        out->done.Notify();
        if (reply_throws) throw std::runtime_error("the reply could not be encoded");
      };
      return (*batcher)->Enqueue(std::move(it));
    };
    Outcome first, second, third;
    ASSERT_TRUE(send(&first, false).ok());
    ASSERT_TRUE(first.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    EXPECT_EQ(first.status.code(), absl::StatusCode::kInternal) << first.status;
    ASSERT_TRUE(send(&second, /*reply_throws=*/true).ok());
    ASSERT_TRUE(second.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    EXPECT_TRUE(second.status.ok()) << second.status;
    ASSERT_TRUE(send(&third, false).ok());
    ASSERT_TRUE(third.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    EXPECT_TRUE(third.status.ok()) << third.status;
    (*batcher)->Stop();
  }
}

// A batcher made with one_thread runs even a lone request on an idle model on its executor
// thread, and every execution on that same thread.
TEST(BatcherTest, WithOneThreadEveryExecutionRunsOnTheExecutorThread) {
  RealClock clock;
  ModelConfig config = BatchingConfig(0);
  config.dynamic_batching.reset();
  absl::Mutex mu;
  std::vector<std::thread::id> ran_on;  // guarded by mu
  auto exec = [&](std::vector<Tensor> in) -> absl::StatusOr<std::vector<Tensor>> {
    absl::MutexLock lock(&mu);
    ran_on.push_back(std::this_thread::get_id());
    Tensor y = in[0];
    y.name = "y";
    return std::vector<Tensor>{y};
  };
  auto batcher = Batcher::Create(config, exec, &clock, nullptr, /*one_thread=*/true);
  ASSERT_TRUE(batcher.ok());
  int done = 0;  // guarded by mu
  for (int i = 0; i < 3; ++i) {
    Batcher::Item it;
    it.inputs = {Make("x", {1, 1}, {static_cast<float>(i)})};
    it.done = [&](absl::StatusOr<std::vector<Tensor>> r) {
      absl::MutexLock lock(&mu);
      if (r.ok()) done++;
    };
    ASSERT_TRUE((*batcher)->Enqueue(std::move(it)).ok());
    absl::MutexLock lock(&mu);
    auto answered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return done == i + 1; };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&answered), absl::Seconds(10)));
  }
  (*batcher)->Stop();
  absl::MutexLock lock(&mu);
  ASSERT_EQ(ran_on.size(), 3u);
  EXPECT_NE(ran_on[0], std::this_thread::get_id());
  EXPECT_EQ(ran_on[1], ran_on[0]);
  EXPECT_EQ(ran_on[2], ran_on[0]);
}

// An isolated executor has the model's CPUs to itself: it runs on them, every request runs
// there (none inline, though batching is off), and its replies are sent from another thread.
// CPUs it may not have are refused, and the batcher stays as it was.
TEST(BatcherTest, AnIsolatedExecutorRunsEveryRequestOnItsCpusAndRepliesElsewhere) {
  const std::vector<int> usable = AllowedCpus();
  ASSERT_FALSE(usable.empty());
  RealClock clock;
  ModelConfig config = BatchingConfig(0);
  config.dynamic_batching.reset();  // would run inline on the caller's thread
  absl::Mutex mu;
  std::vector<std::thread::id> ran_on, replied_on;  // guarded by mu
  std::vector<std::vector<int>> ran_with;           // guarded by mu: the executing thread's CPUs
  auto exec = [&](std::vector<Tensor> in) -> absl::StatusOr<std::vector<Tensor>> {
    absl::MutexLock lock(&mu);
    ran_on.push_back(std::this_thread::get_id());
    ran_with.push_back(AllowedCpus());
    Tensor y = in[0];
    y.name = "y";
    return std::vector<Tensor>{y};
  };
  auto batcher = Batcher::Create(config, exec, &clock, nullptr);
  ASSERT_TRUE(batcher.ok());

  absl::Status bad = (*batcher)->IsolateExecutor({CPU_SETSIZE + 1});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.message().find("out of range"), std::string::npos) << bad;
  EXPECT_EQ((*batcher)->IsolateExecutor({}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE((*batcher)->executor_isolated());

  const std::vector<int> model_cpu = {usable.back()};
  ASSERT_TRUE((*batcher)->IsolateExecutor(model_cpu).ok());
  EXPECT_TRUE((*batcher)->executor_isolated());
  int done = 0;  // guarded by mu
  for (int i = 0; i < 3; ++i) {
    Batcher::Item it;
    it.inputs = {Make("x", {1, 1}, {static_cast<float>(i)})};
    it.done = [&](absl::StatusOr<std::vector<Tensor>> r) {
      absl::MutexLock lock(&mu);
      replied_on.push_back(std::this_thread::get_id());
      if (r.ok()) done++;
    };
    ASSERT_TRUE((*batcher)->Enqueue(std::move(it)).ok());
    absl::MutexLock lock(&mu);
    auto answered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return done == i + 1; };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&answered), absl::Seconds(10)));
  }
  (*batcher)->Stop();
  absl::MutexLock lock(&mu);
  ASSERT_EQ(ran_on.size(), 3u);
  ASSERT_EQ(replied_on.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NE(ran_on[i], std::this_thread::get_id()) << "request " << i << " ran inline";
    EXPECT_EQ(ran_on[i], ran_on[0]);
    EXPECT_EQ(ran_with[i], model_cpu) << "request " << i;
    EXPECT_NE(replied_on[i], ran_on[i]) << "request " << i << " was replied on the model's CPU";
    EXPECT_NE(replied_on[i], std::this_thread::get_id());
  }
  // This thread keeps the CPUs it had.
  EXPECT_EQ(AllowedCpus(), usable);
}

// While the answering thread is held by a slow reply, an isolated executor leaves it up to
// kIsolatedAnswerBacklog more; past that it replies itself. Every request is answered.
TEST(BatcherTest, AnIsolatedExecutorsRepliesWaitForABusyAnswererUpToABound) {
  RealClock clock;
  ModelConfig config = BatchingConfig(0);
  config.dynamic_batching.reset();
  std::atomic<std::thread::id> executor{};
  auto exec = [&](std::vector<Tensor> in) -> absl::StatusOr<std::vector<Tensor>> {
    executor = std::this_thread::get_id();
    return EchoAsY(std::move(in));
  };
  // Declared before the batcher, so they outlive it.
  absl::Notification first_in_reply, release;
  absl::Mutex mu;
  int answered = 0, on_executor = 0;  // guarded by mu
  auto batcher = Batcher::Create(config, exec, &clock, nullptr);
  ASSERT_TRUE(batcher.ok());
  // A failed assertion below must not leave the answering thread held: the batcher's
  // destructor would wait on it.
  struct Release {
    absl::Notification* n;
    ~Release() {
      if (!n->HasBeenNotified()) n->Notify();
    }
  } release_at_exit{&release};
  ASSERT_TRUE((*batcher)->IsolateExecutor({AllowedCpus().back()}).ok());
  auto enqueue = [&](int i) {
    Batcher::Item it;
    it.inputs = {Make("x", {1, 1}, {static_cast<float>(i)})};
    it.done = [&, i](absl::StatusOr<std::vector<Tensor>> r) {
      if (i == 0) {
        first_in_reply.Notify();
        release.WaitForNotification();
      }
      absl::MutexLock lock(&mu);
      if (r.ok()) answered++;
      if (std::this_thread::get_id() == executor.load()) on_executor++;
    };
    return (*batcher)->Enqueue(std::move(it));
  };
  ASSERT_TRUE(enqueue(0).ok());
  ASSERT_TRUE(first_in_reply.WaitForNotificationWithTimeout(absl::Seconds(10)));
  const int more = static_cast<int>(Batcher::kIsolatedAnswerBacklog) + 5;
  for (int i = 1; i <= more; ++i) ASSERT_TRUE(enqueue(i).ok());
  {
    // The executor replied to the last five itself, with the answerer still held.
    absl::MutexLock lock(&mu);
    auto five = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return on_executor == 5; };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&five), absl::Seconds(10))) << on_executor;
    EXPECT_EQ(answered, 5);
  }
  release.Notify();
  {
    absl::MutexLock lock(&mu);
    auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return answered == more + 1; };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all), absl::Seconds(10))) << answered;
    EXPECT_EQ(on_executor, 5);
  }
  (*batcher)->Stop();
}

// RunOnExecutor runs its function on the executor thread and waits for it; after Stop it
// runs nothing and says so.
TEST(BatcherTest, RunOnExecutorRunsThereAndNotAfterStop) {
  RealClock clock;
  ModelConfig config = BatchingConfig(0);
  std::thread::id exec_thread;
  auto exec = [&](std::vector<Tensor> in) -> absl::StatusOr<std::vector<Tensor>> {
    exec_thread = std::this_thread::get_id();
    return in;
  };
  auto batcher = Batcher::Create(config, exec, &clock, nullptr, /*one_thread=*/true);
  ASSERT_TRUE(batcher.ok());
  std::thread::id ran_on;
  ASSERT_TRUE((*batcher)->RunOnExecutor([&] { ran_on = std::this_thread::get_id(); }).ok());
  EXPECT_NE(ran_on, std::thread::id());
  EXPECT_NE(ran_on, std::this_thread::get_id());
  absl::Notification done;
  Batcher::Item it;
  it.inputs = {Make("x", {1, 1}, {1})};
  it.done = [&](absl::StatusOr<std::vector<Tensor>> r) { done.Notify(); };
  ASSERT_TRUE((*batcher)->Enqueue(std::move(it)).ok());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(exec_thread, ran_on);
  // From the executor thread itself it runs at once; a throw becomes the call's error.
  std::thread::id nested_on;
  ASSERT_TRUE((*batcher)
                  ->RunOnExecutor([&] {
                    EXPECT_TRUE((*batcher)
                                    ->RunOnExecutor([&] { nested_on = std::this_thread::get_id(); })
                                    .ok());
                  })
                  .ok());
  EXPECT_EQ(nested_on, ran_on);
  absl::Status threw = (*batcher)->RunOnExecutor([] { throw std::runtime_error("boom"); });
  EXPECT_EQ(threw.code(), absl::StatusCode::kInternal);
  EXPECT_NE(threw.message().find("boom"), std::string::npos);
  (*batcher)->Stop();
  bool ran = false;
  absl::Status after = (*batcher)->RunOnExecutor([&] { ran = true; });
  EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(ran);
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// While other requests wait, a batch's replies are sent from the batcher's answering thread: a
// slow reply (a large answer to encode, a slow client) does not hold the next batch back. An
// answerer still busy gets no backlog: the executor replies itself meanwhile. Stop sends the
// replies handed off before it returns.
TEST(BatcherTest, ASlowReplyDoesNotHoldTheNextBatchWhileOthersWait) {
  RealClock clock;
  ModelConfig config = BatchingConfig(0);
  config.max_batch_size = 1;  // each request is its own batch
  absl::Notification first_running, release_first, release_reply;
  std::atomic<int> executions{0};
  auto exec = [&](std::vector<Tensor> in) -> absl::StatusOr<std::vector<Tensor>> {
    if (executions.fetch_add(1) == 0) {
      first_running.Notify();
      release_first.WaitForNotification();
    }
    Tensor y = in[0];
    y.name = "y";
    return std::vector<Tensor>{y};
  };
  auto batcher = Batcher::Create(config, exec, &clock, nullptr);
  ASSERT_TRUE(batcher.ok());
  // Whatever fails below, nothing is left blocked (a failed check reports, not hangs).
  struct Release {
    absl::Notification* a;
    absl::Notification* b;
    ~Release() {
      if (!a->HasBeenNotified()) a->Notify();
      if (!b->HasBeenNotified()) b->Notify();
    }
  } release{&release_first, &release_reply};
  std::atomic<int> first_replies{0};
  std::atomic<int> later_replies{0};
  auto item = [&](float v, Batcher::Done done) {
    Batcher::Item it;
    it.inputs = {Make("x", {1, 1}, {v})};
    it.may_run_inline = false;
    it.done = std::move(done);
    return it;
  };
  ASSERT_TRUE((*batcher)
                  ->Enqueue(item(1, [&](absl::StatusOr<std::vector<Tensor>> r) {
                    release_reply.WaitForNotification();
                    if (r.ok()) first_replies++;
                  }))
                  .ok());
  ASSERT_TRUE(first_running.WaitForNotificationWithTimeout(absl::Seconds(10)));
  for (float v : {2.0f, 3.0f}) {
    ASSERT_TRUE((*batcher)
                    ->Enqueue(item(v, [&](absl::StatusOr<std::vector<Tensor>> r) {
                      if (r.ok()) later_replies++;
                    }))
                    .ok());
  }
  release_first.Notify();
  // The first reply hangs on the answering thread; the other two run and are answered (the
  // second by the executor itself, though the third waited: the answerer was busy).
  EXPECT_TRUE(testing::Eventually([&] { return later_replies.load() == 2; }, absl::Seconds(10)));
  EXPECT_EQ(first_replies.load(), 0);
  std::thread stopper([&] { (*batcher)->Stop(); });
  release_reply.Notify();
  stopper.join();
  EXPECT_EQ(first_replies.load(), 1);  // sent once, and before Stop returned
  EXPECT_EQ(executions.load(), 3);
}

// Stop from a reply on the batcher's own thread is refused (it would wait on itself); a
// second Stop waits for the first; the batcher stops cleanly after both.
TEST(BatcherTest, StopFromAReplyIsRefusedAndASecondStopWaitsForTheFirst) {
  RealClock clock;
  ModelConfig config = BatchingConfig(0);
  auto batcher = Batcher::Create(config, EchoAsY, &clock, nullptr);
  ASSERT_TRUE(batcher.ok());
  std::atomic<int> replies{0};
  Batcher::Item it;
  it.inputs = {Make("x", {1, 1}, {1})};
  it.may_run_inline = false;  // replied on the executor thread
  it.done = [&](absl::StatusOr<std::vector<Tensor>> r) {
    (*batcher)->Stop();  // refused: returns at once
    if (r.ok()) replies++;
  };
  ASSERT_TRUE((*batcher)->Enqueue(std::move(it)).ok());
  ASSERT_TRUE(testing::Eventually([&] { return replies.load() == 1; }, absl::Seconds(10)));
  std::thread second([&] { (*batcher)->Stop(); });
  (*batcher)->Stop();
  second.join();
  Batcher::Item late;
  late.inputs = {Make("x", {1, 1}, {2})};
  late.done = [](absl::StatusOr<std::vector<Tensor>>) {};
  EXPECT_EQ((*batcher)->Enqueue(std::move(late)).code(), absl::StatusCode::kUnavailable);
}


// With an idle spin, the executor thread waits busily after an execution: a request queued
// then is taken by the spin (no sleep, no wake-up); a spin that ends with nothing leaves the
// thread asleep and woken as before; Stop ends a spin at once.
TEST(BatcherTest, AnIdleSpinTakesTheNextRequestAndStopEndsIt) {
  RealClock clock;
  ModelConfig config = BatchingConfig(0);
  config.dynamic_batching.reset();  // no batching: every request runs alone
  auto batcher = Batcher::Create(config, EchoAsY, &clock, nullptr);
  ASSERT_TRUE(batcher.ok());
  Batcher& b = **batcher;
  absl::Mutex mu;
  std::vector<float> answered;
  auto infer = [&](float v) {
    Batcher::Item it;
    it.inputs = {Make("x", {1, 1}, {v})};
    it.may_run_inline = false;  // to the executor thread, as the gRPC frontend sends them
    it.done = [&](absl::StatusOr<std::vector<Tensor>> r) {
      ASSERT_TRUE(r.ok()) << r.status();
      absl::MutexLock lock(&mu);
      answered.push_back(reinterpret_cast<const float*>((*r)[0].data.data())[0]);
    };
    ASSERT_TRUE(b.Enqueue(std::move(it)).ok());
    absl::MutexLock lock(&mu);
    auto got = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return !answered.empty() && answered.back() == v; };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&got), absl::Seconds(10)));
  };

  // Off (the default): the thread never spins.
  infer(1);
  EXPECT_EQ(b.idle_spins(), 0);

  // A spin far longer than the test: the next request can only be taken by it.
  b.SetIdleSpin(absl::Hours(1));
  infer(2);  // taken from sleep; its execution is followed by a spin
  ASSERT_TRUE(testing::Eventually([&] { return b.idle_spins() == 1; }, absl::Seconds(10)));
  EXPECT_EQ(b.idle_spin_catches(), 0);
  infer(3);
  EXPECT_EQ(b.idle_spin_catches(), 1);

  // A spin of a microsecond ends with nothing: the thread sleeps, and a request still wakes it.
  ASSERT_TRUE(testing::Eventually([&] { return b.idle_spins() == 2; }, absl::Seconds(10)));
  b.SetIdleSpin(absl::Microseconds(1));
  infer(4);  // ends the hour-long spin (a catch), then one of a microsecond
  ASSERT_TRUE(testing::Eventually([&] { return b.idle_spins() == 3; }, absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(b.idle_spins(), 3);  // asleep: one spin per execution, not one after another
  infer(5);
  ASSERT_TRUE(testing::Eventually([&] { return b.idle_spins() == 4; }, absl::Seconds(10)));

  // Stop during an hour-long spin returns (a spin that ignored it would hang the test).
  b.SetIdleSpin(absl::Hours(1));
  infer(6);
  ASSERT_TRUE(testing::Eventually([&] { return b.idle_spins() == 5; }, absl::Seconds(10)));
  b.Stop();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(answered, (std::vector<float>{1, 2, 3, 4, 5, 6}));
}

}  // namespace
}  // namespace kiln
