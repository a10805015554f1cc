#include "agent/runtime_client.h"

#include <grpcpp/completion_queue.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/support/async_unary_call.h>

#include <algorithm>
#include <array>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/cord.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"

namespace kiln {

namespace {
constexpr char kPendingUrl[] = "type.kiln.dev/answer-pending";
}  // namespace

absl::Status AnswerPending(const std::string& method) {
  absl::Status s = absl::UnavailableError(method + ": the runtime's answer is still on its way");
  s.SetPayload(kPendingUrl, absl::Cord("1"));
  return s;
}

bool IsAnswerPending(const absl::Status& status) {
  return status.GetPayload(kPendingUrl).has_value();
}

absl::StatusOr<v1::RuntimeState> RuntimeClient::AwaitState() { return GetState(); }

namespace {

// One call on its way: it owns what the call uses, and is kept by its completion queue tag
// until the call ends, whatever became of the client.
struct Flight {
  virtual ~Flight() = default;
  // Ends the call with what gRPC wrote to `answer`, and tells `on_late` when nobody waits for
  // it now.
  void Finish() {
    absl::MutexLock lock(&mu);
    status = answer;
    done = true;
    done_at = absl::Now();
    // Under the lock: a client going away marks its flights closed under it, so nothing runs
    // on_late once the client (and what on_late refers to) may be gone.
    if (!waited && !closed && on_late) on_late();
  }
  // True once the call has ended, waiting up to `wait` for it.
  bool Wait(absl::Duration wait) {
    absl::MutexLock lock(&mu);
    waited = true;
    mu.AwaitWithTimeout(absl::Condition(
                            +[](bool* d) { return *d; }, &done),
                        wait);
    waited = false;
    return done;
  }
  // Ended with an OK answer.
  bool AnsweredOk() {
    absl::MutexLock lock(&mu);
    return done && status.ok();
  }
  // Ended before `t`.
  bool EndedBefore(absl::Time t) {
    absl::MutexLock lock(&mu);
    return done && done_at < t;
  }
  void Close() {
    absl::MutexLock lock(&mu);
    closed = true;
  }

  std::shared_ptr<grpc::Channel> channel;  // outlives the call
  grpc::ClientContext ctx;
  grpc::Status answer;  // written by gRPC before the call's tag comes back
  std::function<void()> on_late;
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  // A caller waits for it now (or is about to): no need to tell one.
  bool waited ABSL_GUARDED_BY(mu) = false;
  absl::Time done_at ABSL_GUARDED_BY(mu);
  bool closed ABSL_GUARDED_BY(mu) = false;  // its client is gone
  grpc::Status status ABSL_GUARDED_BY(mu);
};

template <typename Req, typename Resp>
struct FlightOf : Flight {
  Req req;
  Resp resp;
  std::unique_ptr<grpc::ClientAsyncResponseReader<Resp>> reader;  // before ctx goes
};

}  // namespace

// The completion queue every call of a factory's clients ends on, and the thread that takes
// the ends. Each call's tag is a heap copy of a shared_ptr to its flight. Shared by the factory
// and its clients: it goes once none is left, after the calls still on their way have ended
// (a client going away cancels its own).
class CallQueue {
 public:
  CallQueue()
      : thread_([this] {
          void* tag = nullptr;
          bool ok = false;
          while (cq_.Next(&tag, &ok)) {
            auto* f = static_cast<std::shared_ptr<Flight>*>(tag);
            (*f)->Finish();
            delete f;
          }
        }) {}
  ~CallQueue() {
    cq_.Shutdown();
    thread_.join();
  }
  grpc::CompletionQueue* cq() { return &cq_; }

 private:
  grpc::CompletionQueue cq_;
  std::thread thread_;
};

namespace {

class GrpcRuntimeClient : public RuntimeClient {
 public:
  GrpcRuntimeClient(const std::string& socket, absl::Duration timeout, absl::Duration inline_wait,
                    std::function<void()> on_late, std::shared_ptr<CallQueue> calls)
      : calls_(std::move(calls)),
        channel_(grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(),
                                           Args())),
        stub_(v1::RuntimeControl::NewStub(channel_)),
        timeout_(timeout),
        inline_wait_(inline_wait),
        on_late_(std::move(on_late)) {}

  ~GrpcRuntimeClient() override {
    absl::MutexLock lock(&mu_);
    for (auto& f : flights_) {
      if (!f) continue;
      f->Close();
      f->ctx.TryCancel();  // it ends soon; the flight keeps what it uses until then
    }
  }

  // A starting runtime creates its socket a moment after the agent first looks: reconnect
  // quickly instead of gRPC's default of seconds.
  static grpc::ChannelArguments Args() {
    grpc::ChannelArguments a;
    a.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
    a.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
    a.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
    return a;
  }

  absl::StatusOr<v1::RuntimeState> GetState() override { return GetState(inline_wait_); }
  absl::StatusOr<v1::RuntimeState> AwaitState() override {
    return GetState(absl::InfiniteDuration());
  }
  absl::StatusOr<v1::RuntimeState> Promote() override {
    return Call<v1::PromoteRequest, v1::RuntimeState>(
        kPromote, "Promote", inline_wait_, [](auto* stub, auto* c, const auto& q, auto* cq) {
          return stub->PrepareAsyncPromote(c, q, cq);
        });
  }
  absl::StatusOr<v1::RuntimeState> Demote() override {
    return Call<v1::DemoteRequest, v1::RuntimeState>(
        kDemote, "Demote", inline_wait_, [](auto* stub, auto* c, const auto& q, auto* cq) {
          return stub->PrepareAsyncDemote(c, q, cq);
        });
  }
  absl::StatusOr<v1::RuntimeStats> Stats() override { return Stats(inline_wait_); }
  void StartStats() override {
    absl::MutexLock lock(&mu_);
    // Its caller comes back for the answer (AwaitStats): nobody need be told of it, and the
    // answer is kept for it however long the caller's other replicas take (never stale).
    absl::Duration wait = absl::InfiniteDuration();
    Begin<v1::StatsRequest, v1::RuntimeStats>(kStats, wait, StartStatsCall);
    claimed_[kStats] = true;
  }
  absl::StatusOr<v1::RuntimeStats> AwaitStats() override {
    return Stats(absl::InfiniteDuration());
  }
  absl::Status Load(const std::vector<std::string>& args) override {
    v1::LoadRequest req;
    for (const auto& a : args) req.add_args(a);
    auto answer = Call<v1::LoadRequest, v1::LoadResponse>(
        kLoad, "Load", inline_wait_,
        [](auto* stub, auto* c, const auto& q, auto* cq) {
          return stub->PrepareAsyncLoad(c, q, cq);
        },
        std::move(req));
    return answer.status();
  }

 private:
  using Stub = v1::RuntimeControl::Stub;
  enum Method { kGetState, kPromote, kDemote, kStats, kLoad, kMethods };

  static std::unique_ptr<grpc::ClientAsyncResponseReader<v1::RuntimeStats>> StartStatsCall(
      Stub* stub, grpc::ClientContext* c, const v1::StatsRequest& q, grpc::CompletionQueue* cq) {
    return stub->PrepareAsyncStats(c, q, cq);
  }
  absl::StatusOr<v1::RuntimeStats> Stats(absl::Duration wait) {
    return Call<v1::StatsRequest, v1::RuntimeStats>(kStats, "Stats", wait, StartStatsCall);
  }

  absl::StatusOr<v1::RuntimeState> GetState(absl::Duration wait) {
    return Call<v1::GetStateRequest, v1::RuntimeState>(
        kGetState, "GetState", wait, [](auto* stub, auto* c, const auto& q, auto* cq) {
          return stub->PrepareAsyncGetState(c, q, cq);
        });
  }

  // Starts a call of `method` unless one is on its way, and waits for its answer: up to
  // `wait` for a call started now, not at all for one already on its way (it was waited for
  // once), and wholly when `wait` is infinite.
  template <typename Req, typename Resp, typename Start>
  absl::StatusOr<Resp> Call(Method method, const char* name, absl::Duration wait, Start start,
                            Req req = Req()) {
    std::shared_ptr<FlightOf<Req, Resp>> f;
    {
      absl::MutexLock lock(&mu_);
      f = Begin<Req, Resp>(method, wait, start, std::move(req));
    }
    if (!f->Wait(wait)) return AnswerPending(name);
    grpc::Status s;
    {
      absl::MutexLock fl(&f->mu);
      s = f->status;
    }
    absl::MutexLock lock(&mu_);
    if (flights_[method] == f) {
      flights_[method].reset();
      claimed_[method] = false;
    }
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) silent_ = true;
    if (!s.ok()) return FromGrpcStatus(s);
    silent_ = false;
    if (method == kGetState) {
      // The state answered now says more than a Promote's or Demote's OK answer that nobody
      // came back for: such an answer is dropped, and the next call asks afresh. (A failed
      // one is kept for its caller to hear; Stats says what no state does.)
      for (Method m : {kPromote, kDemote}) {
        if (flights_[m] && flights_[m]->AnsweredOk()) flights_[m].reset();
      }
    }
    return f->resp;
  }

  // The call of `method` on its way, or one started now; `wait` becomes how long its caller
  // may wait for it.
  template <typename Req, typename Resp, typename Start>
  std::shared_ptr<FlightOf<Req, Resp>> Begin(Method method, absl::Duration& wait, Start start,
                                             Req req = Req()) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // An answer nobody came back for within kStale is old news: asked afresh (unless a
    // caller started the call to come back for it: StartStats).
    if (flights_[method] && !claimed_[method] &&
        flights_[method]->EndedBefore(absl::Now() - kStale)) {
      flights_[method].reset();
    }
    auto f = std::static_pointer_cast<FlightOf<Req, Resp>>(flights_[method]);
    const bool fresh = f == nullptr;
    if (wait != absl::InfiniteDuration() && (!fresh || silent_)) wait = absl::ZeroDuration();
    if (!fresh) return f;
    f = std::make_shared<FlightOf<Req, Resp>>();
    f->channel = channel_;
    f->on_late = on_late_;
    // Waited for from the start: an answer that comes before the wait begins wakes nobody.
    if (wait != absl::ZeroDuration()) {
      absl::MutexLock fl(&f->mu);
      f->waited = true;
    }
    // A runtime that let a call time out (stopped, wedged) is given a short time from then on,
    // until it answers again. A Load is given at least kLoadTimeout: the runtime reads the
    // model's config (and checks its files) before it answers.
    absl::Duration timeout = silent_ ? std::min(timeout_, kSilentTimeout) : timeout_;
    if (method == kLoad) timeout = std::max(timeout_, kLoadTimeout);
    f->ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    f->req = std::move(req);
    flights_[method] = f;
    // A Load is never asked twice (a runtime takes one): its answer waits for its caller
    // however long that takes.
    if (method == kLoad) claimed_[kLoad] = true;
    f->reader = start(stub_.get(), &f->ctx, f->req, calls_->cq());
    f->reader->StartCall();
    f->reader->Finish(&f->resp, &f->answer, new std::shared_ptr<Flight>(f));
    return f;
  }

  static constexpr absl::Duration kSilentTimeout = absl::Milliseconds(200);
  static constexpr absl::Duration kStale = absl::Seconds(1);
  static constexpr absl::Duration kLoadTimeout = absl::Seconds(10);
  const std::shared_ptr<CallQueue> calls_;  // outlives the channel and its calls
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<Stub> stub_;
  const absl::Duration timeout_;
  const absl::Duration inline_wait_;
  const std::function<void()> on_late_;
  absl::Mutex mu_;
  bool silent_ ABSL_GUARDED_BY(mu_) = false;  // the last call that ended timed out
  std::array<std::shared_ptr<Flight>, kMethods> flights_ ABSL_GUARDED_BY(mu_);
  // The flight of this method was started for a caller who comes back for it (StartStats).
  std::array<bool, kMethods> claimed_ ABSL_GUARDED_BY(mu_) = {};
};

}  // namespace

GrpcRuntimeClientFactory::GrpcRuntimeClientFactory(absl::Duration timeout,
                                                   absl::Duration inline_wait,
                                                   std::function<void()> on_late_answer)
    : timeout_(timeout),
      inline_wait_(inline_wait),
      on_late_answer_(std::move(on_late_answer)),
      calls_(std::make_shared<CallQueue>()) {}

GrpcRuntimeClientFactory::~GrpcRuntimeClientFactory() = default;

std::unique_ptr<RuntimeClient> GrpcRuntimeClientFactory::Connect(const std::string& socket_path) {
  return std::make_unique<GrpcRuntimeClient>(socket_path, timeout_, inline_wait_, on_late_answer_,
                                             calls_);
}

}  // namespace kiln
