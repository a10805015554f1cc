#include "agent/data_channel.h"

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>

#include "common/data_frames.h"

namespace kiln {

namespace {

// An answer holds the outputs; past this it is not an answer (the connection is dropped).
constexpr uint32_t kMaxAnswerBytes = 1u << 31;

}  // namespace

DataChannel::~DataChannel() {
  std::vector<std::pair<std::shared_ptr<Connection>, std::thread>> readers;
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    for (auto& [c, t] : readers_) ::shutdown(c->fd, SHUT_RDWR);  // ends each reader
    readers.swap(readers_);
    conn_.reset();
  }
  for (auto& [c, t] : readers) {
    if (t.joinable()) t.join();
    ::close(c->fd);
  }
}

void DataChannel::Call(const inference::ModelInferRequest& request, int64_t deadline_unix_micros,
                       inference::ModelInferResponse* response, Done done) {
  std::shared_ptr<Connection> c;
  uint64_t tag = 0;
  std::vector<std::pair<std::shared_ptr<Connection>, std::thread>> ended;
  grpc::Status refused;
  {
    absl::MutexLock lock(&mu_);
    if (closing_) {
      refused = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the router is stopping");
    } else if (!conn_ || conn_->broken) {
      auto fd = ConnectUnix(path_);
      if (!fd.ok()) {
        refused = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                               "replica data socket: " + std::string(fd.status().message()));
      } else {
        // Readers of connections that ended and have finished their calls are let go here.
        for (auto it = readers_.begin(); it != readers_.end();) {
          if (it->first->finished.load()) {
            ended.push_back(std::move(*it));
            it = readers_.erase(it);
          } else {
            ++it;
          }
        }
        conn_ = std::make_shared<Connection>();
        conn_->fd = *fd;
        readers_.emplace_back(conn_, std::thread([this, c = conn_] { ReadLoop(c); }));
      }
    }
    if (refused.ok()) {
      c = conn_;
      tag = next_tag_++;
      c->pending.emplace(tag, Pending{response, std::move(done)});
    }
  }
  for (auto& [old, t] : ended) {  // each has returned from its loop or is about to
    t.join();
    ::close(old->fd);
  }
  if (!refused.ok()) {
    done(refused);
    return;
  }
  std::string frame = EncodeFrame(tag, 0, deadline_unix_micros, request.SerializeAsString());
  bool sent;
  {
    absl::MutexLock lock(&write_mu_);
    sent = WriteFull(c->fd, frame.data(), frame.size());
  }
  // Not sent: the connection is gone; its reader fails every call on it, this one too.
  if (!sent) ::shutdown(c->fd, SHUT_RDWR);
}

bool DataChannel::Idle() {
  absl::MutexLock lock(&mu_);
  for (const auto& [c, t] : readers_) {
    if (!c->pending.empty()) return false;
  }
  return true;
}

void DataChannel::ReadLoop(std::shared_ptr<Connection> c) {
  char head[kFrameHeaderBytes];
  std::string body;
  std::string why = "the replica closed the connection";
  for (;;) {
    if (!ReadFull(c->fd, head, sizeof(head))) break;
    FrameHeader h = DecodeFrameHeader(head);
    if (h.length > kMaxAnswerBytes) {
      why = "an answer of " + std::to_string(h.length) + " bytes is over the limit";
      break;
    }
    body.resize(h.length);
    if (h.length > 0 && !ReadFull(c->fd, body.data(), body.size())) break;
    Pending p;
    {
      absl::MutexLock lock(&mu_);
      auto it = c->pending.find(h.tag);
      if (it == c->pending.end()) continue;  // no such call: nothing to answer
      p = std::move(it->second);
      c->pending.erase(it);
    }
    grpc::Status s;
    if (h.code == 0) {
      if (!p.response->ParseFromString(body)) {
        s = grpc::Status(grpc::StatusCode::INTERNAL,
                         "the replica's answer is not an inference.ModelInferResponse");
      }
    } else {
      s = grpc::Status(h.code <= 16 ? static_cast<grpc::StatusCode>(h.code)
                                    : grpc::StatusCode::UNKNOWN,
                       body);
    }
    p.done(s);
  }
  Broke(c, why);
  c->finished = true;
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
                        "replica data socket " + path_ + ": " + why));
  }
}

}  // namespace kiln
