#pragma once

// A loopback TCP server for tests of clients against peers that misbehave on purpose.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kiln::testing {

// A loopback TCP listener (port 0) whose every connection is handed to `serve` on its own
// thread; joined by the destructor after the listener and the connections are shut.
class RawServer {
 public:
  explicit RawServer(std::function<void(int fd)> serve) : serve_(std::move(serve)) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(fd_, 16), 0);
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    accept_ = std::thread([this] {
      for (;;) {
        int c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (c < 0) return;
        absl::MutexLock lock(&mu_);
        conns_.push_back(c);
        threads_.emplace_back([this, c] { serve_(c); });
      }
    });
  }
  ~RawServer() {
    shutdown(fd_, SHUT_RDWR);
    accept_.join();
    std::vector<std::thread> threads;
    {
      absl::MutexLock lock(&mu_);
      for (int c : conns_) shutdown(c, SHUT_RDWR);
      threads.swap(threads_);
    }
    for (auto& t : threads) t.join();
    absl::MutexLock lock(&mu_);
    for (int c : conns_) close(c);
    close(fd_);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int accepted() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(conns_.size());
  }

 private:
  std::function<void(int)> serve_;
  int fd_ = -1;
  int port_ = 0;
  std::thread accept_;
  absl::Mutex mu_;
  std::vector<int> conns_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln::testing
