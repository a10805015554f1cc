#include "common/frame_sender.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <utility>

namespace kiln {

FrameSender::FrameSender(int fd, absl::Duration stall, size_t max_backlog_bytes)
    : fd_(fd), stall_(stall), max_backlog_bytes_(max_backlog_bytes) {}

FrameSender::~FrameSender() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    // A writer waiting for room would wait out its stall: the connection is over anyway.
    if (!backlog_.empty()) ::shutdown(fd_, SHUT_RDWR);
  }
  if (writer_.joinable()) writer_.join();
}

bool FrameSender::Send(std::string frame) {
  absl::MutexLock lock(&mu_);
  if (broken_ || stopping_) return false;
  backlog_bytes_ += frame.size();
  backlog_.push_back(std::move(frame));
  // Nothing ahead of it: written now, as far as the socket takes it. (Frames ahead of it mean
  // the writer thread owns the socket's writes until the backlog is empty.)
  if (backlog_.size() == 1 && !Drain()) {
    Break("sending to it failed", /*chosen=*/false);
    return false;
  }
  if (backlog_.empty()) return true;
  if (backlog_bytes_ > max_backlog_bytes_) {
    Break(std::to_string(backlog_bytes_) + " bytes waited for it to read them, over the limit of " +
              std::to_string(max_backlog_bytes_),
          /*chosen=*/true);
    return false;
  }
  if (!writer_.joinable()) writer_ = std::thread([this] { WriteLoop(); });
  return true;
}

size_t FrameSender::backlog_bytes() {
  absl::MutexLock lock(&mu_);
  return backlog_bytes_;
}

bool FrameSender::broken() {
  absl::MutexLock lock(&mu_);
  return broken_;
}

std::string FrameSender::why_given_up() {
  absl::MutexLock lock(&mu_);
  return chosen_ ? why_ : "";
}

void FrameSender::Break(std::string why, bool chosen) {
  broken_ = true;
  why_ = std::move(why);
  chosen_ = chosen;
  backlog_.clear();
  backlog_bytes_ = 0;
  front_sent_ = 0;
  ::shutdown(fd_, SHUT_RDWR);
}

bool FrameSender::Drain() {
  while (!backlog_.empty()) {
    const std::string& f = backlog_.front();
    ssize_t n = ::send(fd_, f.data() + front_sent_, f.size() - front_sent_,
                       MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      front_sent_ += static_cast<size_t>(n);
      backlog_bytes_ -= static_cast<size_t>(n);
      if (front_sent_ == f.size()) {
        backlog_.pop_front();
        front_sent_ = 0;
      }
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return true;
    } else {
      return false;
    }
  }
  return true;
}

void FrameSender::WriteLoop() {
  const int stall_ms = static_cast<int>(
      std::clamp<int64_t>(absl::ToInt64Milliseconds(stall_), 0, 24 * 3600 * 1000));
  absl::MutexLock lock(&mu_);
  for (;;) {
    auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !backlog_.empty() || broken_ || stopping_;
    };
    mu_.Await(absl::Condition(&work));
    if (broken_ || stopping_) return;
    if (!Drain()) {
      Break("sending to it failed", /*chosen=*/false);
      return;
    }
    if (backlog_.empty()) continue;
    // Frames wait: room is waited for with the lock let go, so that Send only appends.
    mu_.Unlock();
    pollfd p{fd_, POLLOUT, 0};
    int n;
    do {
      n = ::poll(&p, 1, stall_ms);
    } while (n < 0 && errno == EINTR);
    mu_.Lock();
    if (n == 0 && !stopping_) {
      Break("it read nothing for " + absl::FormatDuration(stall_), /*chosen=*/true);
      return;
    }
  }
}

}  // namespace kiln
