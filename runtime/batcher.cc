#include "runtime/batcher.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <numeric>
#include <string>

#include "common/idle_spin.h"
#include "common/logging.h"
#include "common/pinning.h"
#include "common/status.h"

namespace kiln {

namespace {

// Runs `fn`; returns what it threw, "" when it threw nothing.
std::string RunCatching(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception";
  }
  return "";
}

// Answers one request. A callback that throws (out of memory while encoding its reply, say)
// must not take the executor or the caller's thread with it: the request is lost to its
// caller's own error handling, and the batcher goes on.
void Answer(Batcher::Item& item, absl::StatusOr<std::vector<Tensor>> result) {
  const std::string thrown = RunCatching([&] { item.done(std::move(result)); });
  if (!thrown.empty()) GetLogger("batcher")->error("a request's reply failed: {}", thrown);
}

// Runs `fn`, which returns a status or a value; an exception becomes an INTERNAL error
// naming `what`.
template <typename F>
auto Guarded(const char* what, F fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return absl::InternalError(std::string(what) + ": " + e.what());
  } catch (...) {
    return absl::InternalError(std::string(what) + " failed");
  }
}

absl::Status TimedOutInQueue() {
  return absl::DeadlineExceededError("the request timed out in the queue");
}

}  // namespace

BatchPolicy MakeBatchPolicy(const ModelConfig& config) {
  BatchPolicy p;
  if (config.max_batch_size > 0 && config.dynamic_batching) {
    p.dynamic = true;
    p.max_batch_size = config.max_batch_size;
    p.preferred_batch_sizes = config.dynamic_batching->preferred_batch_size;
    std::sort(p.preferred_batch_sizes.begin(), p.preferred_batch_sizes.end());
    p.max_queue_delay = absl::Microseconds(config.dynamic_batching->max_queue_delay_microseconds);
  } else {
    p.dynamic = false;
    p.max_batch_size = std::max<int64_t>(config.max_batch_size, 1);
  }
  return p;
}

BatchDecision Decide(const std::vector<PendingView>& queue, absl::Time now,
                     const BatchPolicy& policy) {
  BatchDecision d;
  std::vector<size_t> live;
  for (size_t i = 0; i < queue.size(); ++i) {
    if (queue[i].deadline <= now) {
      d.expired.push_back(i);
    } else {
      live.push_back(i);
      d.wake_at = std::min(d.wake_at, queue[i].deadline);
    }
  }
  if (live.empty()) return d;

  // The leader: the oldest request of the highest priority present.
  size_t leader = live[0];
  for (size_t i : live) {
    if (queue[i].priority < queue[leader].priority) leader = i;
  }
  if (!policy.dynamic || queue[leader].alone) {
    d.batch = {leader};
    return d;
  }

  // Candidates with the leader's shape, higher priority first, then arrival order.
  std::vector<size_t> cand;
  for (size_t i : live) {
    if (!queue[i].alone && queue[i].shape_key == queue[leader].shape_key) cand.push_back(i);
  }
  std::stable_sort(cand.begin(), cand.end(),
                   [&](size_t a, size_t b) { return queue[a].priority < queue[b].priority; });

  // The longest prefix within max_batch_size; remember the longest prefix that hits a
  // preferred size.
  std::vector<size_t> prefix;
  int64_t rows = 0;
  size_t preferred_len = 0;
  bool full = false;
  for (size_t i : cand) {
    if (rows + queue[i].rows > policy.max_batch_size) {
      full = true;  // the next candidate does not fit: waiting cannot grow this batch
      break;
    }
    rows += queue[i].rows;
    prefix.push_back(i);
    if (std::binary_search(policy.preferred_batch_sizes.begin(),
                           policy.preferred_batch_sizes.end(), rows)) {
      preferred_len = prefix.size();
    }
  }
  if (prefix.empty()) {  // a leader larger than max_batch_size runs alone (rejected earlier)
    d.batch = {leader};
    return d;
  }
  if (rows == policy.max_batch_size) full = true;

  absl::Time leader_due = queue[leader].enqueued + policy.max_queue_delay;
  bool delay_over = now >= leader_due;
  if (full || delay_over) {
    d.batch = prefix;
  } else if (preferred_len > 0) {
    d.batch.assign(prefix.begin(), prefix.begin() + preferred_len);
  } else if (policy.max_queue_delay == absl::ZeroDuration() &&
             policy.preferred_batch_sizes.empty()) {
    d.batch = prefix;
  } else {
    d.wake_at = std::min(d.wake_at, leader_due);
  }
  return d;
}

absl::StatusOr<std::vector<Tensor>> ConcatBatch(
    const std::vector<std::vector<Tensor>*>& requests) {
  if (requests.empty()) return absl::InvalidArgumentError("empty batch");
  if (requests.size() == 1) return *requests[0];
  const auto& first = *requests[0];
  std::vector<Tensor> out(first.size());
  for (size_t i = 0; i < first.size(); ++i) {
    Tensor& t = out[i];
    t.name = first[i].name;
    t.dtype = first[i].dtype;
    t.shape = first[i].shape;
    if (t.shape.empty()) return absl::InvalidArgumentError(t.name + ": cannot batch a scalar");
    int64_t rows = 0;
    size_t bytes = 0;
    for (const auto* r : requests) {
      const Tensor& x = (*r)[i];
      if (x.dtype != t.dtype || x.shape.size() != t.shape.size() ||
          !std::equal(x.shape.begin() + 1, x.shape.end(), t.shape.begin() + 1)) {
        return absl::InvalidArgumentError(t.name + ": requests in one batch differ in shape " +
                                          ShapeString(x.shape) + " vs " + ShapeString(t.shape));
      }
      rows += x.shape[0];
      bytes += x.data.size();
    }
    t.shape[0] = rows;
    t.data.reserve(bytes);
    for (const auto* r : requests) t.data += (*r)[i].data;
  }
  return out;
}

absl::StatusOr<std::vector<std::vector<Tensor>>> SplitBatch(const std::vector<Tensor>& outputs,
                                                            const std::vector<int64_t>& rows) {
  int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
  std::vector<std::vector<Tensor>> out(rows.size());
  for (const Tensor& t : outputs) {
    if (t.shape.empty() || t.shape[0] != total) {
      return absl::InternalError("output " + t.name + ": the model returned shape " +
                                 ShapeString(t.shape) + " for a batch of " +
                                 std::to_string(total) + " rows");
    }
    size_t row_bytes = total == 0 ? 0 : t.data.size() / static_cast<size_t>(total);
    size_t offset = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      Tensor part;
      part.name = t.name;
      part.dtype = t.dtype;
      part.shape = t.shape;
      part.shape[0] = rows[r];
      size_t n = row_bytes * static_cast<size_t>(rows[r]);
      part.data.assign(t.data, offset, n);
      offset += n;
      out[r].push_back(std::move(part));
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Batcher>> Batcher::Create(const ModelConfig& config,
                                                         Executor executor, Clock* clock,
                                                         BatchObserver observer,
                                                         bool one_thread) {
  if (!executor || clock == nullptr) {
    return absl::InvalidArgumentError("batcher needs an executor and a clock");
  }
  int64_t max_queue = config.dynamic_batching ? config.dynamic_batching->max_queue_size : 0;
  return std::unique_ptr<Batcher>(new Batcher(MakeBatchPolicy(config), max_queue,
                                              std::move(executor), clock, std::move(observer),
                                              one_thread));
}

Batcher::Batcher(BatchPolicy policy, int64_t max_queue_size, Executor executor, Clock* clock,
                 BatchObserver observer, bool one_thread)
    : policy_(std::move(policy)),
      one_thread_(one_thread),
      max_queue_size_(max_queue_size),
      executor_(std::move(executor)),
      clock_(clock),
      observer_(std::move(observer)) {
  // Named for top -H and perf.
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "executions");
    executor_id_ = std::this_thread::get_id();
    Loop();
  });
  reaper_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "batch-timeouts");
    Reap();
  });
  answerer_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "batch-answers");
    answerer_id_ = std::this_thread::get_id();
    AnswerLoop();
  });
}

void Batcher::AnswerLoop() {
  for (;;) {
    std::deque<std::pair<Item, absl::StatusOr<std::vector<Tensor>>>> work;
    {
      absl::MutexLock lock(&answer_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(answer_mu_) {
        return !answers_.empty() || answers_stop_;
      };
      answering_ = false;
      answer_mu_.Await(absl::Condition(&ready));
      if (answers_.empty()) return;  // stopped, and every reply sent
      work.swap(answers_);
      answering_ = true;
    }
    for (auto& [item, result] : work) Answer(item, std::move(result));
  }
}

Batcher::Item Batcher::TakeAt(size_t i) {
  Item item = std::move(queue_[i]);
  if (views_[i].deadline != absl::InfiniteFuture()) deadlined_--;
  if (--queued_by_priority_[views_[i].priority] == 0) queued_by_priority_.erase(views_[i].priority);
  queue_.erase(queue_.begin() + static_cast<long>(i));
  views_.erase(views_.begin() + static_cast<long>(i));
  return item;
}

void Batcher::Push(Item item, bool front) {
  PendingView v;
  v.priority = item.priority;
  v.enqueued = item.enqueued;
  v.deadline = item.deadline;
  v.rows = item.rows;
  v.alone = item.alone;
  if (!item.alone) {
    for (const Tensor& t : item.inputs) {
      v.shape_key += DataTypeName(t.dtype);
      for (size_t d = 1; d < t.shape.size(); ++d) {
        v.shape_key += ',';
        v.shape_key += std::to_string(t.shape[d]);
      }
      v.shape_key += ";";
    }
  }
  if (v.deadline != absl::InfiniteFuture()) deadlined_++;
  queued_by_priority_[v.priority]++;
  if (front) {
    views_.push_front(std::move(v));
    queue_.push_front(std::move(item));
  } else {
    views_.push_back(std::move(v));
    queue_.push_back(std::move(item));
  }
  Signal();
}

void Batcher::Signal() {
  changed_ = true;
  signals_.fetch_add(1, std::memory_order_release);
}

void Batcher::SetIdleSpin(absl::Duration spin) {
  idle_spin_nanos_.store(absl::ToInt64Nanoseconds(ClampIdleSpin(spin)));
}

namespace {
// Tells the CPU this is a spin-wait loop (less power, and a sibling hardware thread runs on).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}
}  // namespace

bool Batcher::SpinFor(uint64_t seen, absl::Duration spin) {
  // Real time, not the injected clock: this bounds CPU spent, not a request's wait.
  const auto until = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(spin);
  for (;;) {
    for (int i = 0; i < 64; i++) {
      if (signals_.load(std::memory_order_acquire) != seen) return true;
      CpuRelax();
    }
    if (std::chrono::steady_clock::now() >= until) {
      return signals_.load(std::memory_order_acquire) != seen;
    }
  }
}

void Batcher::Reap() {
  for (;;) {
    std::vector<Item> expired;
    {
      absl::MutexLock lock(&mu_);
      // Asleep unless a request with a deadline waits behind a running execution: the
      // common path (nothing queued, or no timeouts) never wakes this thread.
      auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || (executing_ && deadlined_ > 0);
      };
      mu_.Await(absl::Condition(&work));
      if (stopping_) return;
      const absl::Time now = clock_->Now();
      absl::Time next = absl::InfiniteFuture();
      for (size_t i = 0; i < views_.size();) {
        if (views_[i].deadline <= now) {
          expired.push_back(TakeAt(i));
        } else {
          next = std::min(next, views_[i].deadline);
          ++i;
        }
      }
      if (expired.empty()) {
        // Until the next deadline, or until the queue or the execution changes.
        const size_t seen = views_.size();
        auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || !executing_ || views_.size() != seen;
        };
        mu_.AwaitWithTimeout(absl::Condition(&changed), next - now);
        continue;
      }
    }
    for (auto& item : expired) {
      Answer(item, TimedOutInQueue());
    }
  }
}

Batcher::~Batcher() { Stop(); }

absl::Status Batcher::Enqueue(Item item) {
  const bool alone = !one_thread_ && !isolated_.load(std::memory_order_relaxed) &&
                     item.may_run_inline &&
                     (!policy_.dynamic || (policy_.max_queue_delay == absl::ZeroDuration() &&
                                           policy_.preferred_batch_sizes.empty()));
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the model is shutting down");
    if (!(alone && queue_.empty() && !executing_)) goto queue_it;
    executing_ = true;
  }
  // The fast path: nothing to wait for and nobody to batch with, run here.
  if (item.deadline <= clock_->Now()) {
    Answer(item, TimedOutInQueue());
  } else {
    std::vector<Item> one;
    one.push_back(std::move(item));
    Run(std::move(one));
  }
  {
    absl::MutexLock lock(&mu_);
    executing_ = false;
    // Requests queued meanwhile are the executor thread's; with none, it sleeps on (waking it
    // for nothing costs a context switch per request).
    if (!queue_.empty() || !tasks_.empty()) Signal();
  }
  return absl::OkStatus();
queue_it:
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the model is shutting down");
  if (max_queue_size_ > 0) {
    auto level = queued_by_priority_.find(item.priority);
    if (level != queued_by_priority_.end() && level->second >= max_queue_size_) {
      return absl::ResourceExhaustedError(
          "the request queue is full (max_queue_size " + std::to_string(max_queue_size_) +
          " at priority " + std::to_string(item.priority) + ")");
    }
  }
  item.enqueued = clock_->Now();
  item.alone = false;
  Push(std::move(item), /*front=*/false);
  return absl::OkStatus();
}

absl::Status Batcher::IsolateExecutor(const std::vector<int>& cpus) {
  absl::Status pinned;
  KILN_RETURN_IF_ERROR(RunOnExecutor([&] { pinned = PinThisThread(cpus); }));
  if (!pinned.ok()) return pinned;
  isolated_ = true;
  return absl::OkStatus();
}

absl::Status Batcher::RunOnExecutor(std::function<void()> fn) {
  if (std::this_thread::get_id() == executor_id_.load()) {  // already there (it would wait on itself)
    const std::string thrown = RunCatching(fn);
    return thrown.empty() ? absl::OkStatus() : absl::InternalError(thrown);
  }
  Task task;
  task.fn = std::move(fn);
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the model is shutting down");
  tasks_.push_back(&task);
  Signal();
  mu_.Await(absl::Condition(&task.done));
  if (!task.error.empty()) return absl::InternalError(task.error);
  return task.ran ? absl::OkStatus() : absl::UnavailableError("the model is shutting down");
}

int64_t Batcher::queue_depth() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size());
}

void Batcher::Stop() {
  const std::thread::id self = std::this_thread::get_id();
  if (self == executor_id_.load() || self == answerer_id_.load()) {
    // From a reply or a task on the batcher's own threads: it would wait on itself.
    GetLogger("batcher")->error("Stop called from the batcher's own thread: refused");
    return;
  }
  std::deque<Item> left;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      // Stopped, or stopping on another thread: returns once that is done.
      mu_.Await(absl::Condition(&stopped_));
      return;
    }
    stopping_ = true;
    Signal();
  }
  if (thread_.joinable()) thread_.join();
  if (reaper_.joinable()) reaper_.join();
  {
    absl::MutexLock lock(&mu_);
    // Tasks the executor will not run now: their callers (a reply among them) go on.
    for (Task* t : tasks_) t->done = true;  // not run
    tasks_.clear();
  }
  {
    absl::MutexLock lock(&answer_mu_);
    answers_stop_ = true;
  }
  if (answerer_.joinable()) answerer_.join();  // the replies handed off are sent first
  {
    absl::MutexLock lock(&mu_);
    // An inline execution on a caller's thread finishes before the model can go away.
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !executing_; };
    mu_.Await(absl::Condition(&idle));
    left.swap(queue_);
    views_.clear();
    deadlined_ = 0;
    queued_by_priority_.clear();
  }
  for (auto& item : left) Answer(item, absl::UnavailableError("the model is shutting down"));
  absl::MutexLock lock(&mu_);
  stopped_ = true;
}

void Batcher::Loop() {
  for (;;) {
    std::vector<Item> batch;
    std::vector<Item> expired;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      if (executing_) {  // an inline execution is running: wait for it
        changed_ = false;
        mu_.AwaitWithTimeout(absl::Condition(&changed_), absl::Seconds(1));
        continue;
      }
      if (!tasks_.empty()) {
        Task* task = tasks_.front();
        tasks_.pop_front();
        executing_ = true;
        spun_ = false;
        mu_.Unlock();
        std::string error = RunCatching(task->fn);
        mu_.Lock();
        task->error = std::move(error);
        executing_ = false;
        task->ran = true;
        task->done = true;
        continue;
      }
      std::vector<PendingView> views(views_.begin(), views_.end());
      BatchDecision d = Decide(views, clock_->Now(), policy_);
      if (d.batch.empty() && d.expired.empty()) {
        const int64_t spin_ns = idle_spin_nanos_.load(std::memory_order_relaxed);
        if (spin_ns > 0 && !spun_ && queue_.empty() && tasks_.empty()) {
          // Once after each execution: a spin that ends with nothing sleeps until a Signal.
          spun_ = true;
          idle_spins_++;
          const uint64_t seen = signals_.load(std::memory_order_acquire);
          mu_.Unlock();
          const bool caught = SpinFor(seen, absl::Nanoseconds(spin_ns));
          mu_.Lock();
          if (caught) idle_spin_catches_++;
          continue;
        }
        changed_ = false;
        absl::Duration wait = d.wake_at == absl::InfiniteFuture()
                                  ? absl::Seconds(1)
                                  : std::max(d.wake_at - clock_->Now(), absl::ZeroDuration());
        mu_.AwaitWithTimeout(absl::Condition(&changed_), std::min(wait, absl::Seconds(1)));
        continue;
      }
      std::vector<size_t> take;
      for (size_t i : d.batch) {
        batch.push_back(std::move(queue_[i]));
        take.push_back(i);
      }
      for (size_t i : d.expired) {
        expired.push_back(std::move(queue_[i]));
        take.push_back(i);
      }
      std::sort(take.rbegin(), take.rend());
      for (size_t i : take) (void)TakeAt(i);  // already moved out, in the order decided
      if (!batch.empty()) executing_ = true;
      spun_ = false;
    }
    for (auto& item : expired) {
      Answer(item, TimedOutInQueue());
    }
    if (!batch.empty()) {
      std::vector<Item> again = Run(std::move(batch));
      absl::MutexLock lock(&mu_);
      executing_ = false;
      // Back at the head of the queue, in the order they ran: they arrived before anything
      // queued since, and Decide lets any higher priority lead them.
      for (auto it = again.rbegin(); it != again.rend(); ++it) {
        it->alone = true;
        Push(std::move(*it), /*front=*/true);
      }
    }
  }
}

std::vector<Batcher::Item> Batcher::Run(std::vector<Item> items) {
  std::vector<int64_t> rows;
  std::vector<std::vector<Tensor>*> inputs;
  int64_t total = 0;
  for (auto& item : items) {
    rows.push_back(item.rows);
    inputs.push_back(&item.inputs);
    total += item.rows;
  }
  // Nothing thrown here leaves Run: the caller resets the executing flag after it, and an
  // escaped exception would leave the batcher waiting on an execution that never ends.
  absl::StatusOr<std::vector<std::vector<Tensor>>> split =
      Guarded("the batch", [&]() -> absl::StatusOr<std::vector<std::vector<Tensor>>> {
        auto batched = ConcatBatch(inputs);
        if (!batched.ok()) return batched.status();
        auto outputs = executor_(std::move(*batched));
        if (!outputs.ok()) return outputs.status();
        if (items.size() == 1) return std::vector<std::vector<Tensor>>{std::move(*outputs)};
        return SplitBatch(*outputs, rows);
      });
  if (observer_) observer_(static_cast<int64_t>(items.size()), total);
  // One bad request (an out-of-range token, say) must not fail the requests it was batched
  // with: each is run again alone, so only the bad one gets the error. One whose deadline
  // passes meanwhile is answered as timed out.
  if (!split.ok() && items.size() > 1) return items;
  auto result = [&](size_t r) -> absl::StatusOr<std::vector<Tensor>> {
    if (split.ok()) return std::move((*split)[r]);
    return split.status();
  };
  for (auto& item : items) item.inputs = {};  // run: their memory goes now, not at the reply
  size_t r = 0;
  const bool isolated = isolated_.load(std::memory_order_relaxed);
  if (std::this_thread::get_id() == executor_id_.load() && (isolated || queue_depth() > 0)) {
    // Others wait for the executor thread: the replies go to the answering thread and the next
    // batch starts now. Only to an idle answerer: one slower than the model gets no backlog
    // (the executor replies itself meanwhile, which holds requests in the queue, where
    // max_queue_size bounds them). An isolated executor's CPU is the model's alone: its replies
    // go to the answering thread even while it is busy, up to a bounded backlog. An inline run
    // replies itself: the executor thread, not this caller's, runs what waits; and Stop joins
    // the answerer once the executor is gone.
    try {
      absl::MutexLock lock(&answer_mu_);
      if (isolated ? answers_.size() < kIsolatedAnswerBacklog : answers_.empty() && !answering_) {
        for (; r < items.size(); ++r) answers_.emplace_back(std::move(items[r]), result(r));
      }
    } catch (...) {
      // Out of memory handing off: those not handed off are answered here.
    }
  }
  for (; r < items.size(); ++r) Answer(items[r], result(r));
  return {};
}

}  // namespace kiln
