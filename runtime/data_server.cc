#include "runtime/data_server.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/time/clock.h"
#include "common/data_frames.h"
#include "common/logging.h"
#include "runtime/grpc_frontend.h"

namespace kiln {

struct DataServer::Connection {
  explicit Connection(int fd) : fd(fd) {}
  ~Connection() { ::close(fd); }  // the last holder: no write can reach a reused descriptor
  const int fd;
  absl::Mutex write_mu;

  // One whole frame, or nothing once the peer is gone.
  void Send(uint64_t tag, uint8_t code, const std::string& body) {
    std::string frame = EncodeFrame(tag, code, 0, body);
    absl::MutexLock lock(&write_mu);
    (void)WriteFull(fd, frame.data(), frame.size());
  }
};

absl::StatusOr<std::unique_ptr<DataServer>> DataServer::Start(const std::string& path,
                                                              ModelHost* host,
                                                              int64_t max_request_bytes) {
  auto fd = ListenUnix(path, "--data-socket");
  if (!fd.ok()) return fd.status();
  std::unique_ptr<DataServer> s(new DataServer(path, *fd, host, max_request_bytes));
  s->accept_thread_ = std::thread([p = s.get()] { p->AcceptLoop(); });
  return s;
}

DataServer::DataServer(std::string path, int listen_fd, ModelHost* host,
                       int64_t max_request_bytes)
    : path_(std::move(path)), listen_fd_(listen_fd), host_(host),
      max_request_bytes_(max_request_bytes) {}

DataServer::~DataServer() { Stop(); }

void DataServer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);  // wakes accept()
    for (const auto& c : connections_) ::shutdown(c->fd, SHUT_RDWR);  // wakes each read()
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  {
    absl::MutexLock lock(&mu_);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return readers_ == 0; };
    mu_.Await(absl::Condition(&done));
  }
  ::close(listen_fd_);
  std::error_code ec;
  std::filesystem::remove(path_, ec);
}

void DataServer::AcceptLoop() {
  auto log = GetLogger("runtime.data");
  for (;;) {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      absl::MutexLock lock(&mu_);
      if (!stopped_) log->error("--data-socket {}: accept: {}", path_, std::strerror(errno));
      return;
    }
    auto c = std::make_shared<Connection>(fd);
    absl::MutexLock lock(&mu_);
    if (stopped_) return;  // c closes the descriptor
    // Connections that ended are dropped here (their reader threads have returned).
    std::erase_if(connections_, [](const auto& conn) { return conn.use_count() == 1; });
    if (static_cast<int>(connections_.size()) >= kMaxConnections) {
      log->warn("--data-socket {}: refusing a connection: {} are open", path_, kMaxConnections);
      continue;
    }
    connections_.push_back(c);
    readers_++;
    std::thread([this, c] { ReadLoop(c); }).detach();  // Stop waits for it
  }
}

void DataServer::ReadLoop(std::shared_ptr<Connection> c) {
  auto log = GetLogger("runtime.data");
  // A request's frame holds its tensors and a little framing: more than that is not a request.
  const int64_t limit = max_request_bytes_ + 64 * 1024;
  char head[kFrameHeaderBytes];
  std::string body;
  for (;;) {
    bool eof = false;
    if (!ReadFull(c->fd, head, sizeof(head), &eof)) break;
    FrameHeader h = DecodeFrameHeader(head);
    if (static_cast<int64_t>(h.length) > limit) {
      log->warn("--data-socket {}: closing a connection: a frame of {} bytes is over the limit "
                "of {}", path_, h.length, limit);
      break;
    }
    body.resize(h.length);
    if (h.length > 0 && !ReadFull(c->fd, body.data(), body.size())) break;
    if (h.code != 0) {
      c->Send(h.tag, static_cast<uint8_t>(absl::StatusCode::kInvalidArgument),
              "frame code " + std::to_string(h.code) + ": a request's code must be 0");
      continue;
    }
    Serve(c, h.tag, h.deadline_unix_micros, body);
  }
  ::shutdown(c->fd, SHUT_RDWR);  // answers still in the engine fail to write, harmlessly
  absl::MutexLock lock(&mu_);
  readers_--;
}

void DataServer::Serve(const std::shared_ptr<Connection>& c, uint64_t tag,
                       int64_t deadline_unix_micros, const std::string& body) {
  auto fail = [&](const absl::Status& s) {
    c->Send(tag, static_cast<uint8_t>(s.code()), std::string(s.message()));
  };
  inference::ModelInferRequest req;
  if (!req.ParseFromString(body)) {
    fail(absl::InvalidArgumentError("the frame's body is not an inference.ModelInferRequest"));
    return;
  }
  auto decoded = DecodeInferRequest(req, max_request_bytes_);
  if (!decoded.ok()) {
    fail(decoded.status());
    return;
  }
  if (deadline_unix_micros > 0) {  // the router's caller's deadline bounds the request's timeout
    int64_t left = deadline_unix_micros - absl::ToUnixMicros(absl::Now());
    if (left <= 0) {
      fail(absl::DeadlineExceededError("the request's deadline passed before it was queued"));
      return;
    }
    if (decoded->timeout_micros == 0 || decoded->timeout_micros > left) {
      decoded->timeout_micros = left;
    }
  }
  const bool raw = req.raw_input_contents_size() > 0;
  auto params = std::make_shared<google::protobuf::Map<std::string, inference::InferParameter>>(
      req.parameters());  // echoed back, as the gRPC frontend does
  host_->Infer(std::move(*decoded), [c, tag, raw, params](absl::StatusOr<InferResponse> r) {
    if (!r.ok()) {
      c->Send(tag, static_cast<uint8_t>(r.status().code()), std::string(r.status().message()));
      return;
    }
    inference::ModelInferResponse out;
    *out.mutable_parameters() = *params;
    absl::Status encoded = EncodeInferResponse(*r, raw, &out);
    if (!encoded.ok()) {
      c->Send(tag, static_cast<uint8_t>(encoded.code()), std::string(encoded.message()));
      return;
    }
    c->Send(tag, 0, out.SerializeAsString());
  });
}

}  // namespace kiln
