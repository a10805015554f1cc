#include "agent/data_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <ctime>
#include <limits>
#include <utility>

#include "absl/time/clock.h"
#include "common/data_frames.h"

namespace kiln {

namespace {

// Past this an answer is not one (protobuf parses less than 2 GiB): the connection is dropped.
constexpr uint32_t kMaxAnswerBytes = (1u << 31) - 1;
// A reader keeps its answer buffer between frames up to this capacity.
constexpr size_t kKeptAnswerBuffer = size_t{1} << 20;
// An answer's body is read into a buffer grown this much at a time as its bytes come.
constexpr size_t kReadChunk = size_t{1} << 20;
// Frames a reader takes in one pass before it looks at the deadlines again.
constexpr int kFramesPerPass = 64;
constexpr char kReplicaClosed[] = "the replica closed the connection";

// The kernel's wall clock, the one the deadline timer fires by (absl::Now() may estimate it
// from the TSC, a microsecond or more behind: a timer seen to fire "early" must not look like
// a deadline still ahead).
int64_t NowMicros() {
  timespec ts;
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t{ts.tv_sec} * 1'000'000 + ts.tv_nsec / 1000;
}

// A REST answer (common/data_frames.h) with HTTP status 200.
bool JsonAnswerIsOk(const std::string& body) {
  return body.size() >= 2 && static_cast<unsigned char>(body[body.size() - 2]) == 200 &&
         body[body.size() - 1] == 0;
}
// Spin planning runs on the monotonic clock: a step of the wall clock moves no window.
int64_t MonoMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
// Calls looked at for a window still open (the oldest first): a slow call, or one the replica
// answers out of order, does not end the spinning for the calls behind it.
constexpr int kCallsPlannedFrom = 16;

// poll() the reader's three descriptors for at most `micros` (-1 = no limit), to the
// microsecond.
int PollFor(pollfd* fds, int64_t micros) {
  if (micros < 0) return ::ppoll(fds, 3, nullptr, nullptr);
  timespec ts{static_cast<time_t>(micros / 1'000'000), static_cast<long>(micros % 1'000'000) * 1000};
  return ::ppoll(fds, 3, &ts, nullptr);
}

// A replica that reads no request for this long while requests wait is stuck: its connection
// is closed (the calls on it fail UNAVAILABLE and are retried elsewhere).
constexpr absl::Duration kSendStall = absl::Seconds(10);
constexpr size_t kMaxBacklogBytes = size_t{1} << 30;

}  // namespace

DataChannel::Connection::Connection(int fd, int wake_read, int wake_write, int timer_fd)
    : fd(fd), wake_read(wake_read), wake_write(wake_write), timer_fd(timer_fd),
      sender(std::make_unique<FrameSender>(fd, kSendStall, kMaxBacklogBytes)) {}

DataChannel::Connection::~Connection() {
  sender.reset();
  ::close(fd);
  ::close(wake_read);
  ::close(wake_write);
  ::close(timer_fd);
}

DataChannel::~DataChannel() {
  FailAll();
  std::vector<std::pair<std::shared_ptr<Connection>, std::thread>> readers;
  {
    absl::MutexLock lock(&mu_);
    readers.swap(readers_);
    conn_.reset();
  }
  for (auto& [c, t] : readers) {
    if (t.joinable()) t.join();
  }
}

void DataChannel::FailAll() {
  absl::MutexLock lock(&mu_);
  closing_ = true;
  for (auto& [c, t] : readers_) ::shutdown(c->fd, SHUT_RDWR);  // each reader fails its calls
}

bool DataChannel::Idle() {
  absl::MutexLock lock(&mu_);
  for (const auto& [c, t] : readers_) {
    if (!c->pending.empty()) return false;
  }
  return true;
}

void DataChannel::Call(const inference::ModelInferRequest& request, int64_t deadline_unix_micros,
                       inference::ModelInferResponse* response, Done done) {
  // Serialized before the call is registered: once it is, a broken connection may finish it
  // (and the request with it) at any moment.
  std::string body;
  if (!request.SerializeToString(&body)) {
    done(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      "the request cannot be framed for the replica's data socket"));
    return;
  }
  CallRaw(kInferFrame, std::move(body), deadline_unix_micros, deadline_unix_micros,
          [response, done = std::move(done)](const grpc::Status& s, std::string* answer) {
            if (s.ok() && !response->ParseFromString(*answer)) {
              done(grpc::Status(grpc::StatusCode::INTERNAL,
                                "the replica's answer is not an inference.ModelInferResponse"));
              return;
            }
            done(s);
          });
}

void DataChannel::CallRaw(uint8_t code, std::string body, int64_t deadline_unix_micros,
                          int64_t expire_unix_micros, RawDone done) {
  if (body.size() > std::numeric_limits<uint32_t>::max()) {
    done(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      "the request cannot be framed for the replica's data socket"),
         nullptr);
    return;
  }
  // A connection is made outside the lock (a replica whose accept lags must not hold up the
  // channel's other callers); a caller that finds one made meanwhile uses that one instead.
  // One caller connects at a time (a burst of first calls would otherwise open one each, and
  // fill the replica's backlog): the others wait for its connection (the connect never
  // blocks, so they wait microseconds).
  std::shared_ptr<Connection> fresh;
  bool need_connection;
  {
    absl::MutexLock lock(&mu_);
    auto settled = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !connecting_ || closing_; };
    mu_.AwaitWithTimeout(absl::Condition(&settled), absl::Seconds(5));
    need_connection = !closing_ && !connecting_ && (!conn_ || conn_->broken);
    if (need_connection) connecting_ = true;
  }
  grpc::Status refused;
  if (need_connection) {
    auto fd = ConnectUnix(path_);
    if (fd.ok()) {
      connections_made_++;
      json_refused_ = false;  // perhaps another runtime: asked again
    }
    int wake[2] = {-1, -1};
    int timer = -1;
    if (!fd.ok()) {
      refused = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                             "replica data socket: " + std::string(fd.status().message()));
    } else if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
      ::close(*fd);
      refused = grpc::Status(grpc::StatusCode::UNAVAILABLE, "replica data socket: pipe failed");
    } else if ((timer = ::timerfd_create(CLOCK_REALTIME, TFD_CLOEXEC | TFD_NONBLOCK)) < 0) {
      ::close(*fd);
      ::close(wake[0]);
      ::close(wake[1]);
      refused = grpc::Status(grpc::StatusCode::UNAVAILABLE, "replica data socket: timerfd failed");
    } else {
      fresh = std::make_shared<Connection>(*fd, wake[0], wake[1], timer);
    }
  }
  std::shared_ptr<Connection> c;
  uint64_t tag = 0;
  std::vector<std::pair<std::shared_ptr<Connection>, std::thread>> ended;
  {
    absl::MutexLock lock(&mu_);
    if (need_connection) connecting_ = false;
    if (closing_) {
      refused = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the router is stopping");
    } else {
      if ((!conn_ || conn_->broken) && fresh) {
        // Readers of connections that ended and have finished their calls are let go here.
        for (auto it = readers_.begin(); it != readers_.end();) {
          if (it->first->finished.load()) {
            ended.push_back(std::move(*it));
            it = readers_.erase(it);
          } else {
            ++it;
          }
        }
        conn_ = fresh;
        readers_.emplace_back(conn_, std::thread([this, c = conn_] { ReadLoop(c); }));
      }
      if (conn_ && !conn_->broken) {
        refused = grpc::Status();  // another caller's connection serves this one too
        c = conn_;
        tag = next_tag_++;
        c->pending.emplace(tag, Pending{std::move(done), code, expire_unix_micros, MonoMicros()});
        // An earlier deadline re-arms the reader's timer (without waking it); when it
        // busy-polls, the reader is woken to plan its spin for a first call (it sleeps with no
        // call waiting).
        if (expire_unix_micros > 0 &&
            (c->waiting_until == 0 || expire_unix_micros < c->waiting_until)) {
          ArmTimer(*c, expire_unix_micros);
        }
        if (spin_window_micros_ > 0 && c->pending.size() == 1) {
          char one = 1;
          (void)!::write(c->wake_write, &one, 1);
        }
      } else if (refused.ok()) {
        // It broke between our look and now, and this caller made none: it goes elsewhere
        // (the router retries UNAVAILABLE once).
        refused = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                               "replica data socket " + path_ + ": the connection ended");
      }
    }
  }
  for (auto& [old, t] : ended) t.join();  // each has returned from its loop or is about to
  if (!refused.ok()) {
    done(refused, nullptr);
    return;
  }
  // Not sent (the connection broke): its reader fails every call on it, this one too.
  (void)c->sender->Send(EncodeFrame(tag, code, deadline_unix_micros, body));
}

void DataChannel::ArmTimer(Connection& c, int64_t unix_micros) {
  itimerspec at{};  // zero: disarmed
  if (unix_micros > 0) {
    at.it_value.tv_sec = static_cast<time_t>(unix_micros / 1'000'000);
    at.it_value.tv_nsec = static_cast<long>(unix_micros % 1'000'000) * 1000;
  }
  // Not armed: recorded as none, so that the next call or Expire tries again.
  c.waiting_until = ::timerfd_settime(c.timer_fd, TFD_TIMER_ABSTIME, &at, nullptr) == 0
                        ? unix_micros
                        : 0;
}

int64_t DataChannel::Expire(const std::shared_ptr<Connection>& c) {
  std::vector<Pending> expired;
  int64_t next = 0;
  {
    absl::MutexLock lock(&mu_);
    const int64_t now = NowMicros();
    for (auto it = c->pending.begin(); it != c->pending.end();) {
      const int64_t d = it->second.expire_unix_micros;
      if (d > 0 && d <= now) {
        expired.push_back(std::move(it->second));
        it = c->pending.erase(it);  // an answer that comes later finds no call: dropped
        continue;
      }
      if (d > 0 && (next == 0 || d < next)) next = d;
      ++it;
    }
    if (next != c->waiting_until) ArmTimer(*c, next);
  }
  for (auto& p : expired) {
    p.done(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        "the replica did not answer before the deadline"),
           nullptr);
  }
  return next;
}

void DataChannel::ReadLoop(std::shared_ptr<Connection> c) {
  if (spin_window_micros_ > 0) ::prctl(PR_SET_TIMERSLACK, 1UL);  // timed wake-ups on time
  char head[kFrameHeaderBytes];
  size_t head_got = 0;  // of the frame being read: its header's bytes so far,
  FrameHeader h{};      // the header once whole,
  std::string body;     // and its body,
  size_t body_got = 0;  // so far
  std::string why = kReplicaClosed;
  const int64_t stall_limit = answer_stall_micros_.load();  // mid-answer; 0 = none
  const bool stall_limited = stall_limit > 0;
  int64_t last_bytes = 0;  // when the frame being read last grew (monotonic micros)
  for (;;) {
    if (stall_limited && head_got > 0 && MonoMicros() - last_bytes >= stall_limit) {
      why = "it stopped in the middle of an answer for " +
            absl::FormatDuration(absl::Microseconds(stall_limit));
      break;
    }
    // Deadlines wake it through the timer (armed here at the nearest).
    const int64_t next = Expire(c);
    pollfd fds[3] = {{c->fd, POLLIN, 0}, {c->wake_read, POLLIN, 0}, {c->timer_fd, POLLIN, 0}};
    int n = 0;
    SpinWindow spin;
    bool from_spin = false;
    if (spin_window_micros_ > 0 && slots_) {
      absl::MutexLock lock(&mu_);
      const int64_t now = MonoMicros();
      int looked = 0;
      for (auto it = c->pending.begin(); it != c->pending.end() && looked < kCallsPlannedFrom;
           ++it, ++looked) {
        spin = PlanSpin(now, it->second.sent_micros, c->typical_micros, spin_window_micros_);
        if (spin.until > 0) break;
      }
    }
    if (spin.until > 0 && MonoMicros() < spin.from) {
      // Asleep until the window opens (paid while the replica computes), then planned again.
      n = PollFor(fds, std::max<int64_t>(spin.from - MonoMicros(), 0));
      if (n == 0) continue;
    } else if (spin.until > 0 && slots_->TryAcquire()) {
      // Until the window ends, or the nearest deadline passes.
      while ((n = ::poll(fds, 3, 0)) == 0 && MonoMicros() < spin.until &&
             (next <= 0 || NowMicros() < next)) {
      }
      slots_->Release();
      spins_++;
      if (n == 0) continue;  // not in the window: planned again (no window now), then asleep
      from_spin = true;
    } else {
      // Mid-frame, no longer than the stall limit leaves.
      n = PollFor(fds, stall_limited && head_got > 0
                           ? std::max<int64_t>(last_bytes + stall_limit - MonoMicros(), 0)
                           : -1);
      if (n == 0) continue;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      why = "poll failed";
      break;
    }
    if (fds[1].revents & POLLIN) {
      char drain[64];
      while (::read(c->wake_read, drain, sizeof(drain)) > 0) {
      }
    }
    if (fds[2].revents & POLLIN) {
      uint64_t expirations;
      (void)!::read(c->timer_fd, &expirations, sizeof(expirations));
      // Spent: Expire arms it again for whatever deadline is still ahead, even the same one
      // (a clock stepped back since it was armed, say), instead of taking it as still set.
      absl::MutexLock lock(&mu_);
      c->waiting_until = 0;
    }
    if (!(fds[0].revents & (POLLIN | POLLHUP | POLLERR))) continue;  // a deadline, or woken
    // Whatever has arrived, frame by frame, without blocking: a frame not whole yet is kept for
    // a later pass, so that a replica stopping mid-frame (frozen, say) does not stop the other
    // calls' deadlines, which the top of the loop keeps.
    // Answers that keep coming do not hold off the deadlines: at most kFramesPerPass frames,
    // then the deadlines (the socket is still readable, so poll returns at once).
    bool spun = from_spin && (fds[0].revents & POLLIN);  // the pass's first answer only
    bool closed = false;
    for (int frames = 0; frames < kFramesPerPass;) {
      const bool in_head = head_got < sizeof(head);
      // The body grows as it arrives (a header alone says nothing of what will come).
      if (!in_head && body_got == body.size()) {
        body.resize(std::min<size_t>(h.length, body_got + kReadChunk));
      }
      char* dst = in_head ? head + head_got : body.data() + body_got;
      const size_t want = in_head ? sizeof(head) - head_got : body.size() - body_got;
      const ssize_t r = ::recv(c->fd, dst, want, MSG_DONTWAIT);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;  // the rest comes later
      if (r <= 0) {
        closed = true;  // the replica closed the connection (or it failed)
        break;
      }
      last_bytes = MonoMicros();
      if (in_head) {
        head_got += static_cast<size_t>(r);
        if (head_got < sizeof(head)) continue;
        h = DecodeFrameHeader(head);
        if (h.length > kMaxAnswerBytes) {
          why = "an answer of " + std::to_string(h.length) + " bytes is over the limit";
          closed = true;
          break;
        }
        body.clear();
        body_got = 0;
        if (h.length > 0) continue;  // its body next
      } else {
        body_got += static_cast<size_t>(r);
        if (body_got < h.length) continue;
      }
      head_got = 0;  // a whole frame: the next one starts
      frames++;
      Deliver(c, h, &body, std::exchange(spun, false));
      // A large answer's buffer is not kept for the connection's life.
      if (body.capacity() > kKeptAnswerBuffer) std::string().swap(body);
    }
    if (closed) break;
  }
  // The connection ended: by the replica, unless this side ended it (stopping, or a replica
  // that stopped reading what it was sent). A reason found while reading stands.
  if (why == kReplicaClosed) {
    const std::string given_up = c->sender ? c->sender->why_given_up() : "";
    absl::MutexLock lock(&mu_);
    if (!given_up.empty()) {
      why = "the router gave up sending to it: " + given_up;
    } else if (closing_) {
      why = "the router closed the connection (it is stopping)";
    }
  }
  Broke(c, why);
  c->finished = true;
}

void DataChannel::Deliver(const std::shared_ptr<Connection>& c, const FrameHeader& h,
                          std::string* body, bool spun) {
  Pending p;
  {
    absl::MutexLock lock(&mu_);
    auto it = c->pending.find(h.tag);
    if (it == c->pending.end()) return;  // past its deadline already: nobody waits
    p = std::move(it->second);
    c->pending.erase(it);
  }
  // Answers only: a quick refusal (a REST error is one too) says nothing of how long an
  // answer takes.
  if (h.code == 0 && (p.code != kJsonInferFrame || JsonAnswerIsOk(*body))) {
    c->typical_micros = NextTypical(c->typical_micros, MonoMicros() - p.sent_micros);
  }
  if (spun) spin_answers_++;
  if (h.code == 0) {
    p.done(grpc::Status(), body);
  } else {
    p.done(grpc::Status(h.code <= 16 ? static_cast<grpc::StatusCode>(h.code)
                                     : grpc::StatusCode::UNKNOWN,
                        *body),
           nullptr);
  }
}

void DataChannel::Broke(const std::shared_ptr<Connection>& c, const std::string& why) {
  std::map<uint64_t, Pending> calls;
  {
    absl::MutexLock lock(&mu_);
    c->broken = true;
    calls.swap(c->pending);
  }
  ::shutdown(c->fd, SHUT_RDWR);
  for (auto& [tag, p] : calls) {
    p.done(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "replica data socket " + path_ + ": " + why),
           nullptr);
  }
}

}  // namespace kiln
