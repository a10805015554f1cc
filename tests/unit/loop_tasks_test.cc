// The agent's hand-over of work to its loop: a task the loop does not begin in time is
// withdrawn and never runs; one it began is waited for.
#include "agent/loop_tasks.h"

#include <atomic>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kiln {
namespace {

TEST(LoopTasksTest, ATaskTheLoopRunsAnswersWithItsOutcome) {
  int woken = 0;
  LoopTasks tasks([&woken] { ++woken; });
  std::atomic<bool> ran{false};
  std::thread loop([&] {
    while (!tasks.HasPending()) std::this_thread::yield();
    EXPECT_EQ(tasks.RunPending(), 1);
  });
  absl::Status s = tasks.Run(
      [&] {
        ran = true;
        return absl::InvalidArgumentError("replicas[0].model: unknown");
      },
      absl::Hours(1));
  loop.join();
  EXPECT_TRUE(ran);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "replicas[0].model: unknown");
  EXPECT_EQ(woken, 1);
}

TEST(LoopTasksTest, ATaskNotBegunInTimeIsWithdrawnAndNeverRuns) {
  LoopTasks tasks;
  bool ran = false;
  absl::Status s = tasks.Run(
      [&] {
        ran = true;
        return absl::OkStatus();
      },
      absl::ZeroDuration());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("was not applied"), std::string::npos) << s;
  // The loop comes round afterwards: the withdrawn task is dropped, not applied.
  EXPECT_TRUE(tasks.HasPending());
  EXPECT_EQ(tasks.RunPending(), 0);
  EXPECT_FALSE(ran);
  EXPECT_FALSE(tasks.HasPending());
}

TEST(LoopTasksTest, ATaskTheLoopBeganIsWaitedForPastTheWait) {
  LoopTasks tasks;
  std::atomic<bool> finished{false};
  std::thread loop([&] {
    while (!tasks.HasPending()) std::this_thread::yield();
    tasks.RunPending();
  });
  // The loop begins the task at once (it spins on the queue); the task outlasts the caller's
  // 200 ms wait, and its outcome is still the answer, given when it ends: the change took
  // effect, so it must not be reported as failed.
  absl::Status s = tasks.Run(
      [&] {
        absl::SleepFor(absl::Milliseconds(600));
        finished = true;
        return absl::OkStatus();
      },
      absl::Milliseconds(200));
  EXPECT_TRUE(finished);
  EXPECT_TRUE(s.ok()) << s;
  loop.join();
}

}  // namespace
}  // namespace kiln
