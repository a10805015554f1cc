#include "agent/loop_tasks.h"

namespace kiln {

absl::Status LoopTasks::Run(std::function<absl::Status()> task, absl::Duration wait) {
  auto t = std::make_shared<Task>();
  t->fn = std::move(task);
  {
    absl::MutexLock lock(&mu_);
    queue_.push_back(t);
  }
  if (on_queued_) on_queued_();
  absl::MutexLock lock(&t->mu);
  auto began = [&t]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu) { return t->began; };
  if (!t->mu.AwaitWithTimeout(absl::Condition(&began), wait)) {
    t->withdrawn = true;
    return absl::DeadlineExceededError("the agent's loop did not take the change within " +
                                       absl::FormatDuration(wait) + "; it was not applied");
  }
  auto done = [&t]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu) { return t->done; };
  t->mu.Await(absl::Condition(&done));
  return t->result;
}

int LoopTasks::RunPending() {
  std::vector<std::shared_ptr<Task>> tasks;
  {
    absl::MutexLock lock(&mu_);
    tasks.swap(queue_);
  }
  int ran = 0;
  for (auto& t : tasks) {
    {
      absl::MutexLock lock(&t->mu);
      if (t->withdrawn) continue;
      t->began = true;
    }
    absl::Status s = t->fn();
    absl::MutexLock lock(&t->mu);
    t->result = std::move(s);
    t->done = true;
    ++ran;
  }
  return ran;
}

bool LoopTasks::HasPending() const {
  absl::MutexLock lock(&mu_);
  return !queue_.empty();
}

}  // namespace kiln
