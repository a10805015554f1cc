#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "runtime/model_config.h"
#include "runtime/tensor.h"

namespace kiln {

// ---- The policy: pure functions, unit-tested with simulated time. ----

struct BatchPolicy {
  // Most rows one execution may take; 1 disables batching across requests.
  int64_t max_batch_size = 1;
  bool dynamic = false;  // combine requests at all
  std::vector<int64_t> preferred_batch_sizes;
  absl::Duration max_queue_delay = absl::ZeroDuration();
};
BatchPolicy MakeBatchPolicy(const ModelConfig& config);

// What Decide() sees of one queued request (queue order = arrival order).
struct PendingView {
  int64_t priority = 1;  // 1 is the highest
  absl::Time enqueued;
  absl::Time deadline = absl::InfiniteFuture();
  int64_t rows = 1;       // the request's own batch size
  std::string shape_key;  // requests batch together only when their keys match
  bool alone = false;     // runs by itself: its batch failed, and it is being run again alone
};

struct BatchDecision {
  std::vector<size_t> expired;  // queue positions past their deadline: fail them
  std::vector<size_t> batch;    // queue positions to execute now, in execution order
  absl::Time wake_at = absl::InfiniteFuture();  // when to decide again if nothing changes
};

// Picks the next batch. The oldest request of the highest waiting priority leads; it is
// joined by requests with the same shape key, higher priority first then arrival, up to
// max_batch_size rows. The batch runs now when it is full, when it reaches a preferred
// size (the largest reachable), when batching is off, or when its leader has waited
// max_queue_delay; otherwise the caller waits until wake_at. A lower priority request never
// leads while a higher one waits. A request marked `alone` neither joins nor takes others.
BatchDecision Decide(const std::vector<PendingView>& queue, absl::Time now,
                     const BatchPolicy& policy);

// Concatenates per-request inputs along dim 0. requests[r][i] is request r's input i.
absl::StatusOr<std::vector<Tensor>> ConcatBatch(const std::vector<std::vector<Tensor>*>& requests);

// Splits batched outputs back into per-request outputs of `rows[r]` rows each.
absl::StatusOr<std::vector<std::vector<Tensor>>> SplitBatch(const std::vector<Tensor>& outputs,
                                                            const std::vector<int64_t>& rows);

// ---- The executor thread that carries the policy out. ----

class Batcher {
 public:
  using Done = std::function<void(absl::StatusOr<std::vector<Tensor>>)>;
  using Executor = std::function<absl::StatusOr<std::vector<Tensor>>(std::vector<Tensor>)>;
  // Called after each execution with the number of requests and rows it held.
  using BatchObserver = std::function<void(int64_t requests, int64_t rows)>;

  struct Item {
    std::vector<Tensor> inputs;  // config input order
    int64_t rows = 1;
    int64_t priority = 1;
    absl::Time deadline = absl::InfiniteFuture();
    Done done;
    // False: never run on the caller's thread (Enqueue's fast path), always queued.
    bool may_run_inline = true;
    // Set by the batcher: when the request was queued, and whether it must run by itself.
    absl::Time enqueued = absl::InfinitePast();
    bool alone = false;
  };

  // `one_thread`: every execution runs on the executor thread, none inline (see
  // Backend::WantsOneExecutionThread).
  static absl::StatusOr<std::unique_ptr<Batcher>> Create(const ModelConfig& config,
                                                         Executor executor, Clock* clock,
                                                         BatchObserver observer,
                                                         bool one_thread = false);
  ~Batcher();

  // RESOURCE_EXHAUSTED when the queue is full (max_queue_size bounds each priority level on its
  // own, so a flood of low-priority requests never refuses a higher one); UNAVAILABLE after
  // Stop(). On OK, `done` is
  // called exactly once: from the executor thread (or, while other requests wait for it, the
  // batcher's answering thread, so the next batch need not wait for this one's replies), or
  // inline when the request would run alone anyway (no batching or no delay), the model is
  // idle, the batcher was not made with `one_thread`, its executor is not isolated and the item
  // allows it, which saves a thread hop.
  absl::Status Enqueue(Item item);
  int64_t queue_depth() const;
  // Runs `fn` on the executor thread, between executions, and waits for it; UNAVAILABLE
  // (`fn` not run) after Stop(). For work that should share the executions' thread, such as
  // warm-up with a one_thread batcher.
  absl::Status RunOnExecutor(std::function<void()> fn);
  // Fails every queued request with UNAVAILABLE and joins the threads, once the replies
  // handed off are sent. A second call waits for the first to finish. Refused (logged) from a
  // reply or task running on the batcher's own threads, which it would wait on.
  void Stop();

  // After each execution the executor thread waits busily up to `spin` for the next request
  // before it sleeps (0, the default: it sleeps at once). A request caught by the spin is
  // taken with no wake-up to pay (a futex wake and a sleeping CPU's exit, tens of
  // microseconds on a virtual machine) and on a CPU whose caches are still warm, at the cost
  // of up to `spin` of CPU time per execution. A request that may run inline (Enqueue's fast
  // path: REST without batching, say) still runs on its caller's thread while the executor
  // spins; the spin helps requests that go to the executor thread (gRPC's always do).
  // Clamped to 0..1 hour.
  void SetIdleSpin(absl::Duration spin);
  // Gives the model CPUs of its own: pins the executor thread to `cpus` (threads it starts
  // afterwards, such as LibTorch's intra-op pool, inherit them) and from then on keeps
  // everything else off it: every execution runs there (none inline on a caller's thread), and
  // its replies go to the answering thread (up to kIsolatedAnswerBacklog), so encoding and
  // sending them run elsewhere. The caller pins its other threads away from `cpus`. Served
  // work on the model's CPU (the network stack, protobuf, HTTP/2) evicts the model's code and
  // data from that CPU's caches and slows its next execution (bench/RESULTS.md, session 12).
  // Errors: `cpus` empty or out of range, or the kernel refusing them (a CPU outside the
  // cgroup's); UNAVAILABLE after Stop().
  absl::Status IsolateExecutor(const std::vector<int>& cpus);
  // Replies an isolated executor leaves waiting for the answering thread while that one is busy
  // (checked before a batch's replies are added; those being sent are not counted); past that
  // it replies itself (and so holds the queue, where max_queue_size bounds requests).
  static constexpr size_t kIsolatedAnswerBacklog = 64;
  bool executor_isolated() const { return isolated_.load(); }

  // Spins begun, and those that ended with a request or task to take.
  int64_t idle_spins() const { return idle_spins_.load(); }
  int64_t idle_spin_catches() const { return idle_spin_catches_.load(); }

 private:
  Batcher(BatchPolicy policy, int64_t max_queue_size, Executor executor, Clock* clock,
          BatchObserver observer, bool one_thread);
  void Loop();
  // Fails queued requests at their deadline while an execution holds the executor thread
  // (Loop expires them otherwise): a 1 ms timeout is not answered after a 1 s batch.
  void Reap();
  // Removes queue position `i` (both queues and the deadline count); returns its item.
  Item TakeAt(size_t i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues `item` (with its view) at the back, or at the front when it is run again.
  void Push(Item item, bool front) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Executes `items` as one batch and answers them. When a batch of several fails, nobody is
  // answered: the items come back, to be queued again and each run alone, so one bad request
  // fails only itself, and a higher-priority request arriving meanwhile still goes first.
  std::vector<Item> Run(std::vector<Item> items);
  // Sends the replies Run handed off, in order, until Stop() and none is left.
  void AnswerLoop();
  // Marks the queue (or the tasks, or stopping) changed: wakes a sleeping executor thread and
  // ends a spinning one's spin.
  void Signal() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits busily, without mu_, until a Signal after `seen` or `spin` passes; true on a Signal.
  bool SpinFor(uint64_t seen, absl::Duration spin);

  const BatchPolicy policy_;
  const bool one_thread_;
  const int64_t max_queue_size_;
  Executor executor_;
  Clock* clock_;
  BatchObserver observer_;

  mutable absl::Mutex mu_;
  struct Task {
    std::function<void()> fn;
    bool done = false;
    bool ran = false;
    std::string error;  // what `fn` threw
  };
  std::deque<Task*> tasks_ ABSL_GUARDED_BY(mu_);  // RunOnExecutor's, owned by their callers
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  std::deque<PendingView> views_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;  // Stop has finished
  bool changed_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uint64_t> signals_{0};  // Signal()s so far: what a spinning executor watches
  std::atomic<int64_t> idle_spin_nanos_{0};
  std::atomic<bool> isolated_{false};  // IsolateExecutor succeeded
  bool spun_ ABSL_GUARDED_BY(mu_) = false;  // spun since the last work taken
  std::atomic<int64_t> idle_spins_{0};
  std::atomic<int64_t> idle_spin_catches_{0};
  bool executing_ ABSL_GUARDED_BY(mu_) = false;  // one execution at a time, either path
  int64_t deadlined_ ABSL_GUARDED_BY(mu_) = 0;   // queued requests with a deadline
  std::map<int64_t, int64_t> queued_by_priority_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
  // The executor thread's id, set by the thread itself (read without racing a join).
  std::atomic<std::thread::id> executor_id_{};
  std::thread reaper_;
  // Replies handed off by the executor thread while other requests wait: their encoding and
  // sending overlaps the next execution instead of delaying it. With nothing waiting, the
  // executor thread replies itself (no thread hop for a lone request).
  absl::Mutex answer_mu_;
  std::deque<std::pair<Item, absl::StatusOr<std::vector<Tensor>>>> answers_
      ABSL_GUARDED_BY(answer_mu_);
  bool answers_stop_ ABSL_GUARDED_BY(answer_mu_) = false;
  bool answering_ ABSL_GUARDED_BY(answer_mu_) = false;  // replies taken, not all sent yet
  std::thread answerer_;
  std::atomic<std::thread::id> answerer_id_{};  // set by the answering thread itself
};

}  // namespace kiln
