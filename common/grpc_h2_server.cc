#include "common/grpc_h2_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <nghttp2/nghttp2.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <queue>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/idle_spin.h"
#include "common/logging.h"

namespace kiln {
namespace {

constexpr size_t kPrefixBytes = 5;
// Metadata a call may carry, all keys and values together (gRPC's own clients and servers
// default to 8 to 16 KiB).
constexpr size_t kMaxMetadataBytes = 16 * 1024;
// Bytes made ready for a connection before they are written (a large answer goes out in
// pieces as the socket takes them).
constexpr size_t kMaxPendingOut = 1 << 20;
// Flow-control windows offered to callers: a large request need not wait on a WINDOW_UPDATE
// every 64 KiB.
constexpr int32_t kStreamWindow = 1 << 20;
constexpr int32_t kConnectionWindow = 8 << 20;
constexpr size_t kReadChunk = 64 * 1024;
// PINGs a connection may send in a second before it is cut off (ENHANCE_YOUR_CALM): far above
// keepalive and bandwidth probes, far below a flood that keeps the server's thread busy.
constexpr int kMaxPingsPerSecond = 100;
// While accept fails for want of descriptors, the listening socket is left alone this long.
constexpr absl::Duration kAcceptPause = absl::Milliseconds(100);
constexpr int kReadsPerEvent = 4;  // then the other connections get a turn

nghttp2_nv Nv(const std::string& name, const std::string& value) {
  return {reinterpret_cast<uint8_t*>(const_cast<char*>(name.data())),
          reinterpret_cast<uint8_t*>(const_cast<char*>(value.data())), name.size(), value.size(),
          NGHTTP2_NV_FLAG_NONE};
}

bool IsReserved(std::string_view key) {
  return key == "content-type" || key == "te" || key.substr(0, 5) == "grpc-";
}

// A non-blocking listening socket bound to `addr`, or -1 with `*err` set. `dual_stack`: an
// IPv6 socket that takes IPv4 too.
int ListenOn(const sockaddr* addr, socklen_t len, bool dual_stack, int* err) {
  int fd = socket(addr->sa_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  int one = 1, zero = 0;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (dual_stack) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
  if (bind(fd, addr, len) != 0 || listen(fd, 4096) != 0) {
    *err = errno;
    close(fd);
    return -1;
  }
  return fd;
}

void RunAll(std::vector<std::function<void()>>& fs) {
  for (auto& f : fs) {
    if (f) f();
  }
  fs.clear();
}

}  // namespace

absl::StatusOr<absl::Duration> ParseGrpcTimeout(std::string_view value) {
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("grpc-timeout: '", std::string(value),
                     "' is not 1 to 8 digits followed by a unit (H, M, S, m, u or n)"));
  };
  if (value.size() < 2 || value.size() > 9) return bad();
  int64_t n = 0;
  for (size_t i = 0; i + 1 < value.size(); i++) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(value[i]))) return bad();
    n = n * 10 + (value[i] - '0');
  }
  switch (value.back()) {
    case 'H': return absl::Hours(n);
    case 'M': return absl::Minutes(n);
    case 'S': return absl::Seconds(n);
    case 'm': return absl::Milliseconds(n);
    case 'u': return absl::Microseconds(n);
    case 'n': return absl::Nanoseconds(n);
    default: return bad();
  }
}

std::string PercentEncodeGrpcMessage(std::string_view message) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(message.size());
  for (unsigned char c : message) {
    if (c >= 0x20 && c <= 0x7e && c != '%') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

// One client connection: its nghttp2 session and calls, under one lock that the server's
// thread (reading) and any thread finishing a call (writing) take in turn.
class GrpcH2Server::Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(Impl* server, int fd) : server_(server), fd_(fd) {}
  ~Connection() {
    if (session_ != nullptr) nghttp2_session_del(session_);
  }

  Impl* const server_;
  const int fd_;
  absl::Mutex mu_;
  nghttp2_session* session_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::map<int32_t, std::shared_ptr<Call>> streams_ ABSL_GUARDED_BY(mu_);
  std::string out_ ABSL_GUARDED_BY(mu_);
  size_t out_off_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;  // a write failed: the server's thread closes it
  bool want_out_ ABSL_GUARDED_BY(mu_) = false;  // EPOLLOUT armed
  // Filled by nghttp2's callbacks under mu_, taken by the server's thread after it.
  std::vector<std::shared_ptr<Call>> ready_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> cancels_ ABSL_GUARDED_BY(mu_);
  // Bytes of requests not yet whole (Options: a connection may hold so many).
  int64_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time ping_window_ ABSL_GUARDED_BY(mu_);
  int pings_ ABSL_GUARDED_BY(mu_) = 0;

  // The cancel callbacks of calls that ended under the lock, to run once it is released.
  std::vector<std::function<void()>> TakeCancels() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<std::function<void()>> out;
    out.swap(cancels_);
    return out;
  }
  // A call's request bytes leave the connection's count (whole, refused or gone).
  void Release(Call* call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    pending_bytes_ -= call->buffered_;
    call->buffered_ = 0;
  }

  // Writes what the session has to send, as far as the socket takes it.
  void Flush() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers `call` with `status` alone (no message), and stops its upload.
  // `whole`: the request has ended (END_STREAM), so there is no upload to stop.
  void Refuse(Call* call, grpc::StatusCode code, const std::string& message, bool whole,
              int http_status = 200) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SubmitAnswer(Call* call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Call* Find(int32_t stream_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = streams_.find(stream_id);
    return it == streams_.end() ? nullptr : it->second.get();
  }
};

class GrpcH2Server::Impl {
 public:
  Impl(Options options, Handler handler)
      : spin_ns_(absl::ToInt64Nanoseconds(ClampIdleSpin(options.idle_spin))),
        options_(std::move(options)),
        handler_(std::move(handler)) {}
  ~Impl() {
    if (epoll_fd_ >= 0) close(epoll_fd_);
    if (wake_fd_ >= 0) close(wake_fd_);
    if (listen_fd_ >= 0 && owns_listener_) close(listen_fd_);
    if (callbacks_ != nullptr) nghttp2_session_callbacks_del(callbacks_);
    if (session_options_ != nullptr) nghttp2_option_del(session_options_);
  }

  absl::Status Listen() {
    const std::string& flag = options_.flag;
    if (options_.listen_fd >= 0) {
      listen_fd_ = options_.listen_fd;
      owns_listener_ = false;
      int flags = fcntl(listen_fd_, F_GETFL);
      if (flags < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(flag, ": the handed-over socket is not open: ", strerror(errno)));
      }
      fcntl(listen_fd_, F_SETFL, flags | O_NONBLOCK);
    } else {
      std::string host = options_.bind_address;
      if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
        host = host.substr(1, host.size() - 2);
      }
      int fd = -1;
      int err = 0;
      if (host.empty() || host == "0.0.0.0" || host == "::") {
        // Every address: IPv6 and IPv4 on one socket where the host has IPv6 (as gRPC's own
        // server binds a wildcard), IPv4 alone where it has not.
        sockaddr_in6 a6{};
        a6.sin6_family = AF_INET6;
        a6.sin6_addr = in6addr_any;
        a6.sin6_port = htons(static_cast<uint16_t>(options_.port));
        fd = ListenOn(reinterpret_cast<sockaddr*>(&a6), sizeof(a6), /*dual_stack=*/true, &err);
        if (fd < 0 && (err == EAFNOSUPPORT || err == EADDRNOTAVAIL)) {
          sockaddr_in a4{};
          a4.sin_family = AF_INET;
          a4.sin_addr.s_addr = htonl(INADDR_ANY);
          a4.sin_port = htons(static_cast<uint16_t>(options_.port));
          fd = ListenOn(reinterpret_cast<sockaddr*>(&a4), sizeof(a4), false, &err);
        }
      } else {
        addrinfo hints{};
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
        addrinfo* res = nullptr;
        int rc = getaddrinfo(host.c_str(), std::to_string(options_.port).c_str(), &hints, &res);
        if (rc != 0 || res == nullptr) {
          return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot resolve bind address '",
                                                         options_.bind_address,
                                                         "': ", gai_strerror(rc)));
        }
        fd = ListenOn(res->ai_addr, res->ai_addrlen, false, &err);
        freeaddrinfo(res);
      }
      if (fd < 0) {
        return absl::UnavailableError(absl::StrCat(flag, ": cannot listen on ",
                                                   options_.bind_address, ":", options_.port,
                                                   ": ", strerror(err)));
      }
      listen_fd_ = fd;
      owns_listener_ = true;
    }
    sockaddr_storage a{};
    socklen_t len = sizeof(a);
    if (getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      if (a.ss_family == AF_INET) port_ = ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
      if (a.ss_family == AF_INET6) port_ = ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
    }
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (epoll_fd_ < 0 || wake_fd_ < 0) {
      return absl::InternalError(absl::StrCat(flag, ": epoll: ", strerror(errno)));
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = listen_fd_;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
    ev.data.fd = wake_fd_;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);

    nghttp2_session_callbacks_new(&callbacks_);
    nghttp2_session_callbacks_set_on_begin_headers_callback(callbacks_, &Impl::OnBeginHeaders);
    nghttp2_session_callbacks_set_on_header_callback(callbacks_, &Impl::OnHeader);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(callbacks_, &Impl::OnDataChunk);
    nghttp2_session_callbacks_set_on_frame_recv_callback(callbacks_, &Impl::OnFrameRecv);
    nghttp2_session_callbacks_set_on_stream_close_callback(callbacks_, &Impl::OnStreamClose);
    nghttp2_session_callbacks_set_on_frame_send_callback(callbacks_, &Impl::OnFrameSend);
    nghttp2_option_new(&session_options_);
    // The server's answers are short; flooding it with frames it must answer (PING,
    // SETTINGS) while not reading them ends the connection (nghttp2's default limit).
    nghttp2_option_set_max_outbound_ack(session_options_, 1000);
    return absl::OkStatus();
  }

  void Run() {
    thread_ = std::thread([this] { Loop(); });
    // Named here rather than by the thread, so the name is there once Start returns.
    pthread_setname_np(thread_.native_handle(), options_.thread_name.substr(0, 15).c_str());
  }

  // The idle spin's clock: monotonic, so a step of the wall clock cannot stretch a spin.
  static int64_t SpinClockNanos() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  int epoll_fd() const { return epoll_fd_; }

  void Stop(absl::Duration grace) {
    {
      absl::MutexLock lock(&stop_mu_);
      if (stop_requested_) {
        // A second Stop waits for the first.
        stop_mu_.Await(absl::Condition(&stopped_));
        return;
      }
      stop_requested_ = true;
      stop_grace_ = grace;
    }
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    if (thread_.joinable()) thread_.join();
    absl::MutexLock lock(&stop_mu_);
    stopped_ = true;
  }

  int port_ = 0;
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> connections_{0};
  // Options::idle_spin, clamped; and when the server's thread last had work (SpinClockNanos;
  // at first, long ago, so that a server started soon after boot does not spin before it has
  // had any).
  const int64_t spin_ns_;
  int64_t last_work_ns_ = std::numeric_limits<int64_t>::min() / 2;

  // nghttp2's callbacks: user_data is the Connection, whose lock is held.
  static int OnBeginHeaders(nghttp2_session*, const nghttp2_frame* frame, void* user_data) {
    auto* c = static_cast<Connection*>(user_data);
    if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
    c->mu_.AssertHeld();
    c->streams_[frame->hd.stream_id] =
        std::shared_ptr<Call>(new Call(c->shared_from_this(), frame->hd.stream_id));
    return 0;
  }

  static int OnHeader(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name,
                      size_t namelen, const uint8_t* value, size_t valuelen, uint8_t,
                      void* user_data) {
    auto* c = static_cast<Connection*>(user_data);
    c->mu_.AssertHeld();
    if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
    Call* call = c->Find(frame->hd.stream_id);
    if (call == nullptr) return 0;
    std::string_view k(reinterpret_cast<const char*>(name), namelen);
    std::string_view v(reinterpret_cast<const char*>(value), valuelen);
    if (k == ":path") {
      call->method_.assign(v);
    } else if (k == ":method") {
      call->http_method_.assign(v);
    } else if (k == "content-type") {
      call->content_type_.assign(v);
    } else if (k == "grpc-encoding") {
      call->encoding_.assign(v);
    } else if (k == "grpc-timeout") {
      auto d = ParseGrpcTimeout(v);
      if (!d.ok()) {
        if (call->bad_.empty()) {
          call->bad_ = std::string(d.status().message());
          call->bad_code_ = grpc::StatusCode::INVALID_ARGUMENT;
        }
      } else {
        call->deadline_ = absl::Now() + *d;
      }
    } else if (!k.empty() && k[0] != ':' && !IsReserved(k)) {
      call->metadata_bytes_ += k.size() + v.size();
      if (call->metadata_bytes_ > kMaxMetadataBytes) {
        if (call->bad_.empty()) {
          call->bad_ = absl::StrCat("metadata: over ", kMaxMetadataBytes, " bytes");
          call->bad_code_ = grpc::StatusCode::RESOURCE_EXHAUSTED;
        }
      } else if (absl::EndsWith(absl::string_view(k.data(), k.size()), "-bin")) {
        // Binary metadata travels base64-encoded, padded or not; the handler sees its bytes.
        std::string bytes;
        if (!absl::Base64Unescape(absl::string_view(v.data(), v.size()), &bytes)) {
          if (call->bad_.empty()) {
            call->bad_ = "metadata '" + std::string(k) + "': a -bin value must be base64";
            call->bad_code_ = grpc::StatusCode::INVALID_ARGUMENT;
          }
        } else {
          call->metadata_.emplace_back(std::string(k), std::move(bytes));
        }
      } else {
        call->metadata_.emplace_back(std::string(k), std::string(v));
      }
    }
    return 0;
  }

  static int OnDataChunk(nghttp2_session*, uint8_t, int32_t stream_id, const uint8_t* data,
                         size_t len, void* user_data) {
    auto* c = static_cast<Connection*>(user_data);
    c->mu_.AssertHeld();
    Call* call = c->Find(stream_id);
    if (call == nullptr || call->finished_) return 0;  // refused already: dropped
    const int64_t limit = c->server_->options_.max_message_bytes;
    const int64_t budget = c->server_->connection_budget();
    if (c->pending_bytes_ + static_cast<int64_t>(len) > budget) {
      c->Refuse(call, grpc::StatusCode::RESOURCE_EXHAUSTED,
                absl::StrCat("this connection's unfinished requests would hold over ", budget,
                             " bytes: send fewer large requests at once"),
                /*whole=*/false);
      return 0;
    }
    const bool had_prefix = call->message_.size() >= kPrefixBytes;
    call->message_.append(reinterpret_cast<const char*>(data), len);
    call->buffered_ += static_cast<int64_t>(len);
    c->pending_bytes_ += static_cast<int64_t>(len);
    if (call->message_.size() < kPrefixBytes) return 0;
    const auto* p = reinterpret_cast<const unsigned char*>(call->message_.data());
    const uint64_t length = (uint64_t{p[1]} << 24) | (uint64_t{p[2]} << 16) |
                            (uint64_t{p[3]} << 8) | uint64_t{p[4]};
    if (!had_prefix) {
      if (p[0] == 1) {
        c->Refuse(call, grpc::StatusCode::UNIMPLEMENTED,
                  absl::StrCat("compressed messages (grpc-encoding '", call->encoding_,
                               "') are not supported: send them uncompressed"),
                  /*whole=*/false);
        return 0;
      }
      if (p[0] != 0) {
        c->Refuse(call, grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("message prefix: compressed-flag ", int{p[0]}, " is not 0 or 1"),
                  /*whole=*/false);
        return 0;
      }
      if (length > static_cast<uint64_t>(limit)) {
        c->Refuse(call, grpc::StatusCode::RESOURCE_EXHAUSTED,
                  absl::StrCat("request message of ", length, " bytes is over the limit of ",
                               limit, " bytes"),
                  /*whole=*/false);
        return 0;
      }
    }
    if (call->message_.size() > kPrefixBytes + length) {
      c->Refuse(call, grpc::StatusCode::INVALID_ARGUMENT,
                "a unary call sent more than one request message", /*whole=*/false);
    }
    return 0;
  }

  static int OnFrameRecv(nghttp2_session*, const nghttp2_frame* frame, void* user_data) {
    auto* c = static_cast<Connection*>(user_data);
    c->mu_.AssertHeld();
    if (frame->hd.type == NGHTTP2_PING && (frame->hd.flags & NGHTTP2_FLAG_ACK) == 0) {
      const absl::Time now = absl::Now();
      if (now - c->ping_window_ >= absl::Seconds(1)) {
        c->ping_window_ = now;
        c->pings_ = 0;
      }
      if (++c->pings_ > kMaxPingsPerSecond) {
        GetLogger("grpc.h2")->warn("{}: a client sent over {} PINGs in a second: disconnected",
                                   c->server_->options_.flag, kMaxPingsPerSecond);
        nghttp2_session_terminate_session(c->session_, NGHTTP2_ENHANCE_YOUR_CALM);
      }
      return 0;
    }
    if (frame->hd.type != NGHTTP2_HEADERS && frame->hd.type != NGHTTP2_DATA) return 0;
    Call* call = c->Find(frame->hd.stream_id);
    if (call == nullptr || call->handed_) return 0;
    const bool whole = (frame->hd.flags & NGHTTP2_FLAG_END_STREAM) != 0;
    if (call->finished_) {
      // Refused while its body came in: no upload left to stop if this frame ended it.
      if (whole) call->reset_after_answer_ = false;
      return 0;
    }
    if (frame->hd.type == NGHTTP2_HEADERS && frame->headers.cat == NGHTTP2_HCAT_REQUEST) {
      // The request's headers, whole: refuse what cannot be a gRPC call before its body.
      if (call->http_method_ != "POST") {
        c->Refuse(call, grpc::StatusCode::UNIMPLEMENTED,
                  absl::StrCat(":method: '", call->http_method_, "': gRPC calls are POST"), whole,
                  405);
        return 0;
      }
      if (!absl::StartsWith(call->content_type_, "application/grpc")) {
        c->Refuse(call, grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("content-type: '", call->content_type_,
                               "': gRPC calls are application/grpc"),
                  whole, 415);
        return 0;
      }
      if (!call->bad_.empty()) {
        c->Refuse(call, call->bad_code_, call->bad_, whole);
        return 0;
      }
      // The deadline counts from here, the upload included.
      if (call->deadline_ != absl::InfiniteFuture()) {
        c->server_->AddDeadline(call->deadline_, c->streams_[frame->hd.stream_id]);
      }
      // So does the upload's own bound, when it comes first (and the request is not whole
      // already).
      const absl::Duration upload = c->server_->options_.upload_timeout;
      if (!whole && upload > absl::ZeroDuration() && upload != absl::InfiniteDuration()) {
        const absl::Time by = absl::Now() + upload;
        if (by < call->deadline_) {
          c->server_->AddDeadline(by, c->streams_[frame->hd.stream_id], /*upload=*/true);
        }
      }
    }
    if (!whole) return 0;
    // The request is whole.
    const std::string& m = call->message_;
    if (m.size() < kPrefixBytes) {
      c->Refuse(call, grpc::StatusCode::INVALID_ARGUMENT, "the call sent no request message",
                whole);
      return 0;
    }
    const auto* p = reinterpret_cast<const unsigned char*>(m.data());
    const uint64_t length = (uint64_t{p[1]} << 24) | (uint64_t{p[2]} << 16) |
                            (uint64_t{p[3]} << 8) | uint64_t{p[4]};
    if (m.size() != kPrefixBytes + length) {
      c->Refuse(call, grpc::StatusCode::INVALID_ARGUMENT,
                absl::StrCat("the request message was cut short: ", m.size() - kPrefixBytes,
                             " of ", length, " bytes"),
                whole);
      return 0;
    }
    c->Release(call);
    call->message_.erase(0, kPrefixBytes);
    call->handed_ = true;
    c->server_->in_flight_++;
    c->ready_.push_back(c->streams_[frame->hd.stream_id]);
    return 0;
  }

  static int OnStreamClose(nghttp2_session*, int32_t stream_id, uint32_t, void* user_data) {
    auto* c = static_cast<Connection*>(user_data);
    c->mu_.AssertHeld();
    auto it = c->streams_.find(stream_id);
    if (it == c->streams_.end()) return 0;
    std::shared_ptr<Call> call = std::move(it->second);
    c->streams_.erase(it);
    call->closed_ = true;
    c->Release(call.get());
    if (call->handed_ && !call->finished_ && !call->cancelled_) {
      c->cancels_.push_back(call->TakeCancel());
    }
    return 0;
  }

  static int OnFrameSend(nghttp2_session* session, const nghttp2_frame* frame, void* user_data) {
    auto* c = static_cast<Connection*>(user_data);
    c->mu_.AssertHeld();
    if (frame->hd.type != NGHTTP2_HEADERS || (frame->hd.flags & NGHTTP2_FLAG_END_STREAM) == 0) {
      return 0;
    }
    Call* call = c->Find(frame->hd.stream_id);
    if (call == nullptr || !call->reset_after_answer_) return 0;
    call->reset_after_answer_ = false;
    nghttp2_stream* s = nghttp2_session_find_stream(session, frame->hd.stream_id);
    if (s != nullptr && nghttp2_stream_get_state(s) != NGHTTP2_STREAM_STATE_CLOSED) {
      nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, frame->hd.stream_id, NGHTTP2_NO_ERROR);
    }
    return 0;
  }

  static ssize_t ReadAnswer(nghttp2_session* session, int32_t stream_id, uint8_t* buf,
                            size_t length, uint32_t* data_flags, nghttp2_data_source* source,
                            void*) {
    auto* call = static_cast<Call*>(source->ptr);
    const size_t n = std::min(length, call->out_.size() - call->out_sent_);
    memcpy(buf, call->out_.data() + call->out_sent_, n);
    call->out_sent_ += n;
    if (call->out_sent_ == call->out_.size()) {
      *data_flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
      std::string status = "0";
      std::string key = "grpc-status";
      nghttp2_nv trailer = Nv(key, status);
      if (nghttp2_submit_trailer(session, stream_id, &trailer, 1) != 0) {
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;  // the stream is reset instead
      }
      std::string().swap(call->out_);
    }
    return static_cast<ssize_t>(n);
  }

  // A call's deadline (the server's thread's, from nghttp2's callbacks). Answered calls'
  // entries are dropped when the queue has grown to twice what it held at the last sweep.
  // `upload`: it bounds only the request's arrival (Options::upload_timeout).
  void AddDeadline(absl::Time at, const std::shared_ptr<Call>& call, bool upload = false) {
    deadlines_.push({at, call, upload});
    if (deadlines_.size() >= sweep_at_) {
      std::vector<Deadline> live;
      while (!deadlines_.empty()) {
        if (!deadlines_.top().call.expired()) live.push_back(deadlines_.top());
        deadlines_.pop();
      }
      for (auto& d : live) deadlines_.push(std::move(d));
      sweep_at_ = std::max<size_t>(1024, 2 * deadlines_.size());
    }
  }
  // Bytes of unfinished requests one connection may hold.
  int64_t connection_budget() const {
    if (options_.max_connection_pending_bytes > 0) return options_.max_connection_pending_bytes;
    return std::max<int64_t>(2 * options_.max_message_bytes, 64LL << 20);
  }

  const Options options_;
  const Handler handler_;

 private:
  void Loop();
  void Accept();
  void Read(const std::shared_ptr<Connection>& c);
  void Close(const std::shared_ptr<Connection>& c);
  void ExpireDeadlines(absl::Time now);
  void BeginStop();
  // Calls still open at the end of the grace: answered CANCELLED and cancelled.
  void CancelAll(const std::shared_ptr<Connection>& c);

  int listen_fd_ = -1;
  bool owns_listener_ = false;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  nghttp2_session_callbacks* callbacks_ = nullptr;
  nghttp2_option* session_options_ = nullptr;
  std::thread thread_;
  std::map<int, std::shared_ptr<Connection>> conns_;  // the server's thread's
  struct Deadline {
    absl::Time at;
    std::weak_ptr<Call> call;
    bool upload = false;  // passes with nothing to do once the request is whole
    bool operator>(const Deadline& o) const { return at > o.at; }
  };
  std::priority_queue<Deadline, std::vector<Deadline>, std::greater<Deadline>> deadlines_;
  size_t sweep_at_ = 1024;
  absl::Time accept_paused_until_ = absl::InfinitePast();
  bool listening_ = true;  // the listening socket is in the epoll set

  absl::Mutex stop_mu_;
  bool stop_requested_ ABSL_GUARDED_BY(stop_mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(stop_mu_) = false;
  absl::Duration stop_grace_ ABSL_GUARDED_BY(stop_mu_);
  bool stopping_ = false;  // the server's thread's view
  absl::Time stop_deadline_;
};

// --- Connection ---

void GrpcH2Server::Connection::Flush() {
  if (closed_ || broken_) return;
  for (;;) {
    while (session_ != nullptr && out_.size() - out_off_ < kMaxPendingOut &&
           nghttp2_session_want_write(session_)) {
      const uint8_t* data = nullptr;
      ssize_t n = nghttp2_session_mem_send(session_, &data);
      if (n < 0) {
        broken_ = true;
        break;
      }
      if (n == 0) break;
      if (out_off_ == out_.size()) {
        out_.clear();
        out_off_ = 0;
      }
      out_.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n));
    }
    if (out_off_ == out_.size()) break;
    ssize_t w = send(fd_, out_.data() + out_off_, out_.size() - out_off_,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!want_out_) {
          want_out_ = true;
          epoll_event ev{};
          ev.events = EPOLLIN | EPOLLOUT;
          ev.data.fd = fd_;
          epoll_ctl(server_->epoll_fd(), EPOLL_CTL_MOD, fd_, &ev);
        }
        return;
      }
      broken_ = true;
      break;
    }
    out_off_ += static_cast<size_t>(w);
    if (out_off_ == out_.size()) {
      out_.clear();
      out_off_ = 0;
    }
  }
  if (broken_) {
    // The server's thread sees the hang-up and closes the connection.
    shutdown(fd_, SHUT_RDWR);
    return;
  }
  if (want_out_ && out_.empty()) {
    want_out_ = false;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd_;
    epoll_ctl(server_->epoll_fd(), EPOLL_CTL_MOD, fd_, &ev);
  }
}

void GrpcH2Server::Connection::Refuse(Call* call, grpc::StatusCode code,
                                      const std::string& message, bool whole, int http_status) {
  if (call->finished_ || call->cancelled_) return;
  call->finished_ = true;
  call->status_ = grpc::Status(code, message);
  Release(call);
  std::string().swap(call->message_);
  if (call->closed_ || session_ == nullptr) return;
  if (http_status != 200) {
    std::string status = std::to_string(http_status);
    std::string grpc_status = std::to_string(static_cast<int>(code));
    std::string encoded = PercentEncodeGrpcMessage(message);
    const std::string k_status = ":status", k_ct = "content-type", k_gs = "grpc-status",
                      k_gm = "grpc-message", ct = "application/grpc";
    nghttp2_nv nv[] = {Nv(k_status, status), Nv(k_ct, ct), Nv(k_gs, grpc_status),
                       Nv(k_gm, encoded)};
    if (nghttp2_submit_response(session_, call->stream_id_, nv, 4, nullptr) != 0) {
      nghttp2_submit_rst_stream(session_, NGHTTP2_FLAG_NONE, call->stream_id_,
                                NGHTTP2_INTERNAL_ERROR);
    }
  } else {
    SubmitAnswer(call);
  }
  // Whatever of the request is still to come is not wanted: RST_STREAM(NO_ERROR) once the
  // answer is out (OnFrameSend; nghttp2 would send it before the HEADERS otherwise).
  call->reset_after_answer_ = !whole;
}

void GrpcH2Server::Connection::SubmitAnswer(Call* call) {
  const std::string k_status = ":status", v_status = "200", k_ct = "content-type",
                    v_ct = "application/grpc";
  std::vector<nghttp2_nv> nv = {Nv(k_status, v_status), Nv(k_ct, v_ct)};
  for (const auto& [k, v] : call->initial_metadata_) nv.push_back(Nv(k, v));
  if (call->status_.ok()) {
    nghttp2_data_provider dp{};
    dp.source.ptr = call;
    dp.read_callback = &Impl::ReadAnswer;
    if (nghttp2_submit_response(session_, call->stream_id_, nv.data(), nv.size(), &dp) != 0) {
      nghttp2_submit_rst_stream(session_, NGHTTP2_FLAG_NONE, call->stream_id_,
                                NGHTTP2_INTERNAL_ERROR);
    }
    return;
  }
  // Trailers-Only: the status in the one HEADERS frame.
  const std::string k_gs = "grpc-status", k_gm = "grpc-message";
  std::string gs = std::to_string(static_cast<int>(call->status_.error_code()));
  std::string gm = PercentEncodeGrpcMessage(call->status_.error_message());
  nv.push_back(Nv(k_gs, gs));
  if (!gm.empty()) nv.push_back(Nv(k_gm, gm));
  if (nghttp2_submit_response(session_, call->stream_id_, nv.data(), nv.size(), nullptr) != 0) {
    nghttp2_submit_rst_stream(session_, NGHTTP2_FLAG_NONE, call->stream_id_,
                              NGHTTP2_INTERNAL_ERROR);
  }
}

// --- Call ---

const std::string* GrpcH2Server::Call::Metadata(std::string_view key) const {
  for (const auto& [k, v] : metadata_) {
    if (k == key) return &v;
  }
  return nullptr;
}

void GrpcH2Server::Call::AddInitialMetadata(std::string key, std::string value) {
  absl::MutexLock lock(&conn_->mu_);
  if (finished_ || cancelled_) return;
  key = absl::AsciiStrToLower(key);
  if (absl::EndsWith(key, "-bin")) {
    // Sent base64-encoded, unpadded (as the gRPC wire format asks).
    value = absl::Base64Escape(value);
    value.erase(value.find_last_not_of('=') + 1);
  }
  initial_metadata_.emplace_back(std::move(key), std::move(value));
}

void GrpcH2Server::Call::Finish(const grpc::Status& status, std::string response) {
  std::function<void()> unused;  // destroyed unlocked: it may hold what owns this call
  std::vector<std::function<void()>> cancels;
  {
    absl::MutexLock lock(&conn_->mu_);
    if (finished_ || cancelled_) return;  // cancelled: the answer goes nowhere
    finished_ = true;
    conn_->server_->in_flight_--;
    unused = std::move(on_cancel_);
    on_cancel_ = nullptr;
    if (closed_ || conn_->closed_ || conn_->session_ == nullptr) return;
    status_ = status;
    if (status.ok() && response.size() > std::numeric_limits<uint32_t>::max()) {
      status_ = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                             absl::StrCat("the answer of ", response.size(),
                                          " bytes is over gRPC's 4 GiB message limit"));
    } else if (status.ok()) {
      out_.resize(kPrefixBytes + response.size());
      out_[0] = 0;
      const uint32_t n = htonl(static_cast<uint32_t>(response.size()));
      memcpy(&out_[1], &n, 4);
      memcpy(&out_[kPrefixBytes], response.data(), response.size());
    }
    conn_->SubmitAnswer(this);
    conn_->Flush();
    cancels = conn_->TakeCancels();  // streams the writes closed
  }
  RunAll(cancels);
}

std::function<void()> GrpcH2Server::Call::TakeCancel() {
  cancelled_ = true;
  conn_->server_->in_flight_--;
  std::function<void()> f = std::move(on_cancel_);
  on_cancel_ = nullptr;
  return f;
}

void GrpcH2Server::Call::OnCancel(std::function<void()> f) {
  {
    absl::MutexLock lock(&conn_->mu_);
    if (finished_) return;
    if (!cancelled_) {
      on_cancel_ = std::move(f);
      return;
    }
  }
  if (f) f();
}

bool GrpcH2Server::Call::cancelled() const {
  absl::MutexLock lock(&conn_->mu_);
  return cancelled_;
}

// --- Impl: the server's thread ---

void GrpcH2Server::Impl::Loop() {
  std::vector<epoll_event> events(64);
  for (;;) {
    int timeout_ms = -1;
    const absl::Time now = absl::Now();
    absl::Time next = absl::InfiniteFuture();
    if (!deadlines_.empty()) next = deadlines_.top().at;
    if (!listening_ && !stopping_) next = std::min(next, accept_paused_until_);
    if (stopping_) next = std::min(next, std::min(stop_deadline_, now + absl::Milliseconds(20)));
    if (next != absl::InfiniteFuture()) {
      timeout_ms = static_cast<int>(std::clamp<int64_t>(
          absl::ToInt64Milliseconds(absl::Ceil(next - now, absl::Milliseconds(1))), 0, 60000));
    }
    // Spinning: poll, and sleep only once the last piece of work is spin_ns_ old.
    if (spin_ns_ > 0 && timeout_ms != 0 && SpinClockNanos() - last_work_ns_ < spin_ns_) {
      timeout_ms = 0;
    }
    int n = epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), timeout_ms);
    if (spin_ns_ > 0 && n > 0) last_work_ns_ = SpinClockNanos();
    if (n < 0 && errno != EINTR) {
      GetLogger("grpc.h2")->error("epoll_wait: {}", strerror(errno));
      absl::SleepFor(absl::Milliseconds(10));
    }
    for (int i = 0; i < n; i++) {
      const int fd = events[i].data.fd;
      if (fd == wake_fd_) {
        uint64_t v;
        (void)!read(wake_fd_, &v, sizeof(v));
        BeginStop();
        continue;
      }
      if (fd == listen_fd_) {
        if (!stopping_) Accept();
        continue;
      }
      auto it = conns_.find(fd);
      if (it == conns_.end()) continue;
      std::shared_ptr<Connection> c = it->second;
      if (events[i].events & EPOLLOUT) {
        std::vector<std::function<void()>> cancels;
        {
          absl::MutexLock lock(&c->mu_);
          c->Flush();
          cancels = c->TakeCancels();
        }
        RunAll(cancels);
      }
      if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) Read(c);
    }
    if (!listening_ && !stopping_ && absl::Now() >= accept_paused_until_) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = listen_fd_;
      epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
      listening_ = true;
    }
    ExpireDeadlines(absl::Now());
    if (stopping_) {
      // Connections with nothing open (GOAWAY sent) close now; at the end of the grace, all.
      const bool over = absl::Now() >= stop_deadline_;
      std::vector<std::shared_ptr<Connection>> all;
      for (auto& [fd, c] : conns_) all.push_back(c);
      for (auto& c : all) {
        bool idle;
        {
          absl::MutexLock lock(&c->mu_);
          idle = c->streams_.empty() && c->out_.empty();
        }
        if (over) CancelAll(c);
        if (idle || over) Close(c);
      }
      if (conns_.empty()) return;
    }
  }
}

void GrpcH2Server::Impl::Accept() {
  for (int i = 0; i < 16; i++) {
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of descriptors or memory: the connection waits in the queue; the listening
        // socket is left alone a while instead of waking this thread on every pass.
        GetLogger("grpc.h2")->warn("{}: accept: {}: new connections wait {} ms", options_.flag,
                                   strerror(errno), absl::ToInt64Milliseconds(kAcceptPause));
        epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listen_fd_, nullptr);
        listening_ = false;
        accept_paused_until_ = absl::Now() + kAcceptPause;
      }
      // EAGAIN: none left (or another process took it); ECONNABORTED: the client gave up.
      return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto c = std::make_shared<Connection>(this, fd);
    {
      absl::MutexLock lock(&c->mu_);
      nghttp2_session_server_new2(&c->session_, callbacks_, c.get(), session_options_);
      nghttp2_settings_entry iv[] = {
          {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, options_.max_concurrent_streams},
          {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, static_cast<uint32_t>(kStreamWindow)},
      };
      nghttp2_submit_settings(c->session_, NGHTTP2_FLAG_NONE, iv, 2);
      nghttp2_session_set_local_window_size(c->session_, NGHTTP2_FLAG_NONE, 0, kConnectionWindow);
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
      conns_[fd] = c;
      connections_++;
      c->Flush();
    }
  }
}

void GrpcH2Server::Impl::Read(const std::shared_ptr<Connection>& c) {
  char buf[kReadChunk];
  bool end = false;
  std::vector<std::shared_ptr<Call>> ready;
  std::vector<std::function<void()>> cancels;
  {
    absl::MutexLock lock(&c->mu_);
    if (c->closed_) return;
    for (int i = 0; i < kReadsPerEvent; i++) {
      ssize_t r = recv(c->fd_, buf, sizeof(buf), MSG_DONTWAIT);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (r <= 0) {
        end = true;
        break;
      }
      ssize_t used = nghttp2_session_mem_recv(c->session_, reinterpret_cast<uint8_t*>(buf),
                                              static_cast<size_t>(r));
      if (used < 0) {
        // Not HTTP/2, or a protocol error: nghttp2 has queued its GOAWAY; send it, then close.
        GetLogger("grpc.h2")->debug("{}: connection closed: {}", options_.flag,
                                    nghttp2_strerror(static_cast<int>(used)));
        c->Flush();
        end = true;
        break;
      }
      if (static_cast<size_t>(r) < sizeof(buf)) break;
    }
    if (!end) c->Flush();
    if (c->broken_ ||
        (!nghttp2_session_want_read(c->session_) && !nghttp2_session_want_write(c->session_) &&
         c->out_.empty())) {
      end = true;
    }
    ready.swap(c->ready_);
    cancels = c->TakeCancels();
  }
  RunAll(cancels);
  for (auto& call : ready) {
    try {
      handler_(call);
    } catch (const std::exception& e) {
      call->Finish(grpc::Status(grpc::StatusCode::INTERNAL, std::string("internal error: ") + e.what()));
    }
  }
  if (end) Close(c);
}

void GrpcH2Server::Impl::Close(const std::shared_ptr<Connection>& c) {
  std::vector<std::function<void()>> cancels;
  {
    absl::MutexLock lock(&c->mu_);
    if (c->closed_) return;
    c->closed_ = true;
    cancels = c->TakeCancels();
    for (auto& [id, call] : c->streams_) {
      call->closed_ = true;
      if (call->handed_ && !call->finished_ && !call->cancelled_) {
        cancels.push_back(call->TakeCancel());
      }
    }
    c->streams_.clear();  // each call's hold on the connection is its own
    c->ready_.clear();
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd_, nullptr);
    // Bytes the client sent that were never read would make close() reset the connection,
    // which can drop the last frames written to it (a GOAWAY, a CANCELLED): read them first.
    char sink[16384];
    for (int i = 0; i < 64 && recv(c->fd_, sink, sizeof(sink), MSG_DONTWAIT) > 0; i++) {
    }
    close(c->fd_);
    nghttp2_session_del(c->session_);
    c->session_ = nullptr;
  }
  conns_.erase(c->fd_);
  connections_--;
  RunAll(cancels);
}

void GrpcH2Server::Impl::ExpireDeadlines(absl::Time now) {
  while (!deadlines_.empty() && deadlines_.top().at <= now) {
    std::shared_ptr<Call> call = deadlines_.top().call.lock();
    const bool upload = deadlines_.top().upload;
    deadlines_.pop();
    if (!call) continue;
    std::function<void()> cancel;
    std::vector<std::function<void()>> cancels;
    {
      Connection* c = call->conn_.get();
      absl::MutexLock lock(&c->mu_);
      if (call->finished_ || call->cancelled_ || call->closed_ || c->session_ == nullptr) continue;
      if (upload && call->handed_) continue;  // it came whole in time
      if (!call->handed_) {
        // Still coming in when its time ran out.
        c->Refuse(call.get(), grpc::StatusCode::DEADLINE_EXCEEDED,
                  upload ? "the request was not whole within " +
                               absl::FormatDuration(options_.upload_timeout) +
                               " of its headers (" + options_.flag + "'s upload limit)"
                         : "deadline exceeded before the request was whole",
                  /*whole=*/false);
      } else {
        cancel = call->TakeCancel();
        call->status_ = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline exceeded");
        c->SubmitAnswer(call.get());
      }
      c->Flush();
      cancels = c->TakeCancels();
    }
    if (cancel) cancel();
    RunAll(cancels);
  }
}

void GrpcH2Server::Impl::BeginStop() {
  if (stopping_) return;
  absl::Duration grace;
  {
    absl::MutexLock lock(&stop_mu_);
    grace = stop_grace_;
  }
  stopping_ = true;
  stop_deadline_ = absl::Now() + std::max(grace, absl::ZeroDuration());
  // No new connections: they wait in the listening socket's queue (for the next server on a
  // handed-over socket) or are refused once it closes.
  if (listening_) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listen_fd_, nullptr);
  listening_ = false;
  if (owns_listener_) {
    close(listen_fd_);
    listen_fd_ = -1;
  }
  for (auto& [fd, c] : conns_) {
    std::vector<std::function<void()>> cancels;
    {
      absl::MutexLock lock(&c->mu_);
      if (c->session_ == nullptr) continue;
      nghttp2_submit_goaway(c->session_, NGHTTP2_FLAG_NONE,
                            nghttp2_session_get_last_proc_stream_id(c->session_),
                            NGHTTP2_NO_ERROR, nullptr, 0);
      c->Flush();
      cancels = c->TakeCancels();
    }
    RunAll(cancels);
  }
}

void GrpcH2Server::Impl::CancelAll(const std::shared_ptr<Connection>& c) {
  std::vector<std::function<void()>> cancels;
  {
    absl::MutexLock lock(&c->mu_);
    for (auto& [id, call] : c->streams_) {
      if (!call->handed_ || call->finished_ || call->cancelled_) continue;
      cancels.push_back(call->TakeCancel());
      if (c->session_ != nullptr && !call->closed_) {
        call->status_ = grpc::Status(grpc::StatusCode::CANCELLED, "the server is stopping");
        c->SubmitAnswer(call.get());
      }
    }
    c->Flush();
    for (auto& f : c->TakeCancels()) cancels.push_back(std::move(f));
  }
  RunAll(cancels);
}

// --- GrpcH2Server ---

GrpcH2Server::GrpcH2Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  port_ = impl_->port_;
}

absl::StatusOr<std::unique_ptr<GrpcH2Server>> GrpcH2Server::Start(Options options,
                                                                  Handler handler) {
  auto impl = std::make_unique<Impl>(std::move(options), std::move(handler));
  absl::Status s = impl->Listen();
  if (!s.ok()) return s;
  impl->Run();
  return std::unique_ptr<GrpcH2Server>(new GrpcH2Server(std::move(impl)));
}

GrpcH2Server::~GrpcH2Server() {
  if (impl_) impl_->Stop(absl::ZeroDuration());
}

void GrpcH2Server::Stop(absl::Duration grace) { impl_->Stop(grace); }

int64_t GrpcH2Server::calls_in_flight() const { return impl_->in_flight_.load(); }
int64_t GrpcH2Server::connections() const { return impl_->connections_.load(); }

}  // namespace kiln
