#include "runtime/data_server.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "absl/time/clock.h"
#include "common/data_frames.h"
#include "common/frame_sender.h"
#include "common/logging.h"
#include "common/http_server.h"
#include "runtime/grpc_frontend.h"
#include "runtime/http_frontend.h"

namespace kiln {

namespace {

// Reads and drops `n` bytes.
bool Discard(int fd, uint32_t n) {
  char buf[64 * 1024];
  while (n > 0) {
    const size_t chunk = std::min<size_t>(n, sizeof(buf));
    if (!ReadFull(fd, buf, chunk)) return false;
    n -= static_cast<uint32_t>(chunk);
  }
  return true;
}

// A router that reads no answer for this long while answers wait is stuck: its connection is
// closed (its calls fail there and are retried elsewhere) and the answers dropped.
constexpr absl::Duration kSendStall = absl::Seconds(10);
constexpr size_t kMaxBacklogBytes = size_t{1} << 30;

}  // namespace

struct DataServer::Connection {
  explicit Connection(int fd)
      : fd(fd), sender(std::make_unique<FrameSender>(fd, kSendStall, kMaxBacklogBytes)) {}
  ~Connection() {  // the last holder: no write can reach a reused descriptor
    sender.reset();
    ::close(fd);
  }
  const int fd;
  // Answers are sent from engine threads, which must never wait on a router that stopped
  // reading: what the socket does not take at once waits here (common/frame_sender.h).
  std::unique_ptr<FrameSender> sender;

  // One whole frame, or nothing once the peer is gone.
  void Send(uint64_t tag, uint8_t code, const std::string& body) {
    if (body.size() > std::numeric_limits<uint32_t>::max()) {
      Send(tag, static_cast<uint8_t>(absl::StatusCode::kResourceExhausted),
           "the answer is too large for a frame (" + std::to_string(body.size()) + " bytes)");
      return;
    }
    (void)sender->Send(EncodeFrame(tag, code, 0, body));
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
      const int e = errno;
      if (e == EINTR || e == ECONNABORTED) continue;
      {
        absl::MutexLock lock(&mu_);
        if (stopped_) return;
      }
      if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
        // Out of descriptors or memory for now: the router's connection waits in the backlog.
        log->warn("--data-socket {}: accept: {}; trying again", path_, std::strerror(e));
        absl::SleepFor(absl::Milliseconds(50));
        continue;
      }
      // Anything else will not get better: close the socket, so that the router's connects
      // fail at once (and go elsewhere) instead of waiting in a backlog nobody reads.
      log->error("--data-socket {}: accept: {}; no longer serving it", path_, std::strerror(e));
      ::shutdown(listen_fd_, SHUT_RDWR);
      std::error_code ec;
      std::filesystem::remove(path_, ec);
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
  // Refuses the request of frame `h` before it reaches the engine: a REST one with
  // `http_status` in the JSON answer, a ModelInfer one with `code`.
  auto refuse = [&](const FrameHeader& h, int http_status, absl::StatusCode code,
                    const std::string& why) {
    host_->CountRefused();
    if (h.code == kJsonInferFrame) {
      c->Send(h.tag, 0, EncodeJsonAnswer(JsonError(why), http_status));
    } else {
      c->Send(h.tag, static_cast<uint8_t>(code), why);
    }
  };
  for (;;) {
    bool eof = false;
    if (!ReadFull(c->fd, head, sizeof(head), &eof)) break;
    FrameHeader h = DecodeFrameHeader(head);
    if (static_cast<int64_t>(h.length) > limit) {
      // Too large for this replica: that request is refused and the connection (the router's
      // only one here, with other calls on it) serves on. Past a gibibyte the peer is not a
      // router speaking the protocol: the connection ends.
      if (h.length > (1u << 30)) {
        log->warn("--data-socket {}: closing a connection: a frame of {} bytes", path_,
                  h.length);
        break;
      }
      if (!Discard(c->fd, h.length)) break;
      // As the REST port answers a body over the limit: 413, never to be retried.
      refuse(h, 413, absl::StatusCode::kResourceExhausted,
             "the request's frame of " + std::to_string(h.length) +
                 " bytes exceeds the payload limit of " + std::to_string(max_request_bytes_) +
                 " bytes (--max-request-bytes) and its framing");
      continue;
    }
    body.resize(h.length);
    if (h.length > 0 && !ReadFull(c->fd, body.data(), body.size())) break;
    if (h.code == kInferFrame || h.code == kJsonInferFrame) {
      // Nothing thrown while a request is decoded (an allocation that fails, say) ends this
      // thread, and with it the process: the request is answered with the reason.
      try {
        if (h.code == kInferFrame) {
          Serve(c, h.tag, h.deadline_unix_micros, body);
        } else {
          ServeJson(c, h.tag, h.deadline_unix_micros, &body);
        }
      } catch (const std::exception& e) {
        refuse(h, 500, absl::StatusCode::kInternal,
               std::string("the request could not be decoded: ") + e.what());
      }
      // A large request's buffer is not kept for the small ones after it.
      if (body.capacity() > (1u << 20)) body = std::string();
    } else {
      // The words the router looks for (common/data_frames.h).
      c->Send(h.tag, static_cast<uint8_t>(absl::StatusCode::kInvalidArgument),
              "frame code " + std::to_string(h.code) +
                  ": not a request this runtime knows (0: ModelInfer, 1: REST inference)");
    }
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
    host_->CountRefused();
    fail(absl::InvalidArgumentError("the frame's body is not an inference.ModelInferRequest"));
    return;
  }
  auto decoded = DecodeInferRequest(req, max_request_bytes_);
  if (!decoded.ok()) {
    host_->CountRefused();
    fail(decoded.status());
    return;
  }
  decoded->shared_reader = true;  // this thread reads the connection's next requests
  // The router's caller's deadline bounds the request's timeout.
  if (absl::Status bounded = NoteCallerDeadline(deadline_unix_micros, &*decoded);
      !bounded.ok()) {
    host_->CountRefused();
    fail(bounded);
    return;
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
    std::string bytes;
    if (!out.SerializeToString(&bytes)) {
      c->Send(tag, static_cast<uint8_t>(absl::StatusCode::kResourceExhausted),
              "the answer cannot be serialized (over 2 GiB)");
      return;
    }
    c->Send(tag, 0, bytes);
  });
}

void DataServer::ServeJson(const std::shared_ptr<Connection>& c, uint64_t tag,
                           int64_t deadline_unix_micros, std::string* body) {
  std::string model, version;
  if (absl::Status s = DecodeJsonInferBody(body, &model, &version); !s.ok()) {
    host_->CountRefused();
    c->Send(tag, static_cast<uint8_t>(s.code()), std::string(s.message()));
    return;
  }
  // Whatever the REST port would answer, with its HTTP status; the router says which version
  // served, and this replica's is the one that does.
  ServeRestInfer(host_, body, model, version, max_request_bytes_, deadline_unix_micros,
                 /*add_version=*/true, [c, tag](int http_status, std::string json) {
                   c->Send(tag, 0, EncodeJsonAnswer(std::move(json), http_status));
                 });
}

}  // namespace kiln
