#include "bench/h2_grpc_client.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <nghttp2/nghttp2.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kiln::bench {

namespace {
using Clock = std::chrono::steady_clock;
constexpr size_t kPrefixBytes = 5;  // gRPC message prefix: compressed flag, 4-byte length
}  // namespace

struct H2GrpcClient::Session {
  nghttp2_session* h2 = nullptr;
  // The call under way.
  int32_t stream = -1;
  bool closed = false;
  uint32_t reset_code = 0;
  std::string framed;  // the request, prefixed
  size_t sent = 0;
  std::string data;  // response DATA bytes, prefixed
  std::map<std::string, std::string> headers;  // headers and trailers, last one wins

  ~Session() {
    if (h2 != nullptr) nghttp2_session_del(h2);
  }

  static int OnHeader(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name,
                      size_t namelen, const uint8_t* value, size_t valuelen, uint8_t,
                      void* user) {
    auto* s = static_cast<Session*>(user);
    if (frame->hd.stream_id != s->stream) return 0;
    s->headers[std::string(reinterpret_cast<const char*>(name), namelen)] =
        std::string(reinterpret_cast<const char*>(value), valuelen);
    return 0;
  }
  static int OnData(nghttp2_session*, uint8_t, int32_t stream_id, const uint8_t* data,
                    size_t len, void* user) {
    auto* s = static_cast<Session*>(user);
    if (stream_id == s->stream) s->data.append(reinterpret_cast<const char*>(data), len);
    return 0;
  }
  static int OnClose(nghttp2_session*, int32_t stream_id, uint32_t error_code, void* user) {
    auto* s = static_cast<Session*>(user);
    if (stream_id == s->stream) {
      s->closed = true;
      s->reset_code = error_code;
    }
    return 0;
  }
  static ssize_t Read(nghttp2_session*, int32_t, uint8_t* buf, size_t length,
                      uint32_t* data_flags, nghttp2_data_source*, void* user) {
    auto* s = static_cast<Session*>(user);
    const size_t n = std::min(length, s->framed.size() - s->sent);
    memcpy(buf, s->framed.data() + s->sent, n);
    s->sent += n;
    if (s->sent == s->framed.size()) *data_flags |= NGHTTP2_DATA_FLAG_EOF;
    return static_cast<ssize_t>(n);
  }
};

H2GrpcClient::H2GrpcClient(HostPort target, std::chrono::milliseconds timeout, bool spin)
    : target_(std::move(target)), timeout_(timeout), spin_(spin) {}

H2GrpcClient::~H2GrpcClient() { Close(); }

void H2GrpcClient::Close() {
  session_.reset();
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

absl::Status H2GrpcClient::Connect() {
  Close();
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) return absl::UnavailableError(absl::StrCat("socket: ", strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(target_.port));
  if (inet_pton(AF_INET, target_.host.c_str(), &addr.sin_addr) != 1) {
    Close();
    return absl::InvalidArgumentError(
        absl::StrCat("host '", target_.host, "': not an IPv4 address"));
  }
  // At least 1 ms: a zero SO_SNDTIMEO would mean no bound at all.
  const int64_t ms = std::max<int64_t>(1, timeout_.count());
  timeval tv{};
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));  // bounds connect and send
  if (connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    absl::Status s = absl::UnavailableError(
        absl::StrCat("connect ", target_.host, ":", target_.port, ": ", strerror(errno)));
    Close();
    return s;
  }
  int one = 1;
  setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  connects_++;
  session_ = std::make_unique<Session>();
  nghttp2_session_callbacks* cbs = nullptr;
  nghttp2_session_callbacks_new(&cbs);
  nghttp2_session_callbacks_set_on_header_callback(cbs, &Session::OnHeader);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, &Session::OnData);
  nghttp2_session_callbacks_set_on_stream_close_callback(cbs, &Session::OnClose);
  const int rv = nghttp2_session_client_new(&session_->h2, cbs, session_.get());
  nghttp2_session_callbacks_del(cbs);
  if (rv != 0) {
    Close();
    return absl::InternalError(absl::StrCat("nghttp2: ", nghttp2_strerror(rv)));
  }
  nghttp2_submit_settings(session_->h2, NGHTTP2_FLAG_NONE, nullptr, 0);
  absl::Status sent = Flush();
  if (!sent.ok()) Close();  // not left half open for the next call
  return sent;
}

absl::Status H2GrpcClient::Flush() {
  std::string out;
  for (;;) {
    const uint8_t* p = nullptr;
    const ssize_t n = nghttp2_session_mem_send(session_->h2, &p);
    if (n < 0) return absl::InternalError(absl::StrCat("nghttp2: ", nghttp2_strerror(n)));
    if (n == 0) break;
    out.append(reinterpret_cast<const char*>(p), static_cast<size_t>(n));
  }
  size_t off = 0;
  while (off < out.size()) {
    const ssize_t w = send(fd_, out.data() + off, out.size() - off, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return absl::UnavailableError(absl::StrCat("send: ", strerror(errno)));
    off += static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status H2GrpcClient::Pump(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return absl::DeadlineExceededError("no reply within the timeout");
  // Read what is there; when nothing is, poll (or, spinning, come back at once).
  char buf[16384];
  ssize_t r = recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && spin_) return absl::OkStatus();
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    pollfd p{fd_, POLLIN, 0};
    const int n = poll(&p, 1, static_cast<int>(left));
    if (n == 0) return absl::DeadlineExceededError("no reply within the timeout");
    if (n < 0 && errno != EINTR) return absl::UnavailableError(absl::StrCat("poll: ", strerror(errno)));
    return absl::OkStatus();  // read on the next pass
  }
  if (r < 0 && errno == EINTR) return absl::OkStatus();
  if (r < 0) return absl::UnavailableError(absl::StrCat("recv: ", strerror(errno)));
  if (r == 0) return absl::UnavailableError("the server closed the connection");
  const ssize_t used =
      nghttp2_session_mem_recv(session_->h2, reinterpret_cast<const uint8_t*>(buf), r);
  if (used < 0) return absl::UnavailableError(absl::StrCat("nghttp2: ", nghttp2_strerror(used)));
  return Flush();  // settings acks, window updates
}

absl::StatusOr<GrpcReply> H2GrpcClient::Call(const std::string& path, const std::string& request) {
  const Clock::time_point deadline = Clock::now() + timeout_;
  if (fd_ < 0) {
    absl::Status s = Connect();
    if (!s.ok()) return s;
  }
  Session& s = *session_;
  s.framed.assign(kPrefixBytes, '\0');
  const uint32_t len = htonl(static_cast<uint32_t>(request.size()));
  memcpy(&s.framed[1], &len, 4);
  s.framed += request;
  s.sent = 0;
  s.data.clear();
  s.headers.clear();
  s.closed = false;
  s.reset_code = 0;
  const std::string authority = absl::StrCat(target_.host, ":", target_.port);
  auto nv = [](const char* name, const std::string& value) {
    return nghttp2_nv{reinterpret_cast<uint8_t*>(const_cast<char*>(name)),
                      reinterpret_cast<uint8_t*>(const_cast<char*>(value.data())),
                      strlen(name), value.size(), NGHTTP2_NV_FLAG_NONE};
  };
  const std::string post = "POST", http = "http", grpc = "application/grpc", te = "trailers";
  const nghttp2_nv headers[] = {nv(":method", post),         nv(":scheme", http),
                                nv(":path", path),           nv(":authority", authority),
                                nv("content-type", grpc),    nv("te", te)};
  nghttp2_data_provider provider{};
  provider.read_callback = &Session::Read;
  s.stream = nghttp2_submit_request(s.h2, nullptr, headers, 6, &provider, nullptr);
  if (s.stream < 0) {
    absl::Status failed =
        absl::InternalError(absl::StrCat("nghttp2: ", nghttp2_strerror(s.stream)));
    Close();  // frees `s`
    return failed;
  }
  absl::Status st = Flush();
  while (st.ok() && !s.closed) st = Pump(deadline);
  if (!st.ok()) {
    Close();
    return st;
  }
  GrpcReply reply;
  auto status = s.headers.find("grpc-status");
  if (s.reset_code != 0 || status == s.headers.end() ||
      !absl::SimpleAtoi(status->second, &reply.status)) {
    const std::string why = s.reset_code != 0
                                ? absl::StrCat("the stream was reset (HTTP/2 error ", s.reset_code, ")")
                                : "the reply has no grpc-status";
    Close();
    return absl::UnavailableError(why);
  }
  if (auto m = s.headers.find("grpc-message"); m != s.headers.end()) reply.message = m->second;
  if (!s.data.empty()) {
    uint32_t n = 0;
    if (s.data.size() >= kPrefixBytes) memcpy(&n, &s.data[1], 4);
    n = ntohl(n);
    if (s.data.size() < kPrefixBytes || s.data[0] != 0 || s.data.size() != kPrefixBytes + n) {
      absl::Status bad = absl::UnavailableError(absl::StrCat(
          "the reply is not one uncompressed gRPC message (", s.data.size(), " bytes)"));
      Close();  // frees `s`
      return bad;
    }
    reply.body = s.data.substr(kPrefixBytes);
  }
  return reply;
}

}  // namespace kiln::bench
