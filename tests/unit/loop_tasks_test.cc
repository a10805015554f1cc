// The agent's hand-over of work to its loop: a task the loop does not begin in time is
// withdrawn and never runs; one it began is waited for.
#include "agent/loop_tasks.h"

#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
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

TEST(LoopTasksTest, ATaskTheLoopBeganIsWaitedForUntilItEnds) {
  LoopTasks tasks;
  absl::Notification began, release;
  std::thread loop([&] {
    while (!tasks.HasPending()) std::this_thread::yield();
    tasks.RunPending();
  });
  std::thread releaser([&] {
    began.WaitForNotification();
    release.Notify();
  });
  absl::Status s = tasks.Run(
      [&] {
        began.Notify();
        release.WaitForNotification();
        return absl::OkStatus();
      },
      absl::Seconds(30));
  loop.join();
  releaser.join();
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace kiln
