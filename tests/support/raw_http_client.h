#pragma once

// A blocking HTTP/1.1 client on a raw loopback socket, for tests that must send half a request,
// a refused body or nothing at all, and read exactly what the server wrote.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>

namespace kiln::testing {

// A blocking client on a raw socket, so a test can send half a request or nothing.
class RawHttpClient {
 public:
  // Every read is bounded by `read_timeout_s`: a hang fails the test instead of stalling it.
  explicit RawHttpClient(int port, int read_timeout_s = 10) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    timeval tv{read_timeout_s, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawHttpClient() { close(fd_); }
  bool connected() const { return connected_; }

  bool Send(const std::string& data) {
    return send(fd_, data.data(), data.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(data.size());
  }

  struct Response {
    int code = 0;  // 0: the connection closed (or the read timed out) before a response
    std::string head;
    std::string body;
  };
  // Reads one response (Content-Length framed).
  Response Read() {
    Response r;
    size_t end;
    while ((end = pending_.find("\r\n\r\n")) == std::string::npos) {
      if (!Fill()) return r;
    }
    r.head = pending_.substr(0, end + 4);
    pending_.erase(0, end + 4);
    r.code = std::stoi(r.head.substr(9, 3));
    size_t length = 0;
    auto at = r.head.find("Content-Length: ");
    if (at != std::string::npos) length = std::stoul(r.head.substr(at + 16));
    while (pending_.size() < length) {
      if (!Fill()) {
        r.code = 0;
        return r;
      }
    }
    r.body = pending_.substr(0, length);
    pending_.erase(0, length);
    return r;
  }
  // Reads a response's head only (for HEAD requests: no body follows).
  std::string ReadHead() {
    size_t end;
    while ((end = pending_.find("\r\n\r\n")) == std::string::npos) {
      if (!Fill()) return "";
    }
    std::string head = pending_.substr(0, end + 4);
    pending_.erase(0, end + 4);
    return head;
  }
  // True when the server closes the connection (as opposed to the 10 s read bound expiring).
  bool ClosedByServer() {
    char buf[256];
    for (;;) {
      ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n == 0) return true;
      if (n < 0) return errno == ECONNRESET;
    }
  }

 private:
  bool Fill() {
    char buf[4096];
    ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    if (n <= 0) return false;
    pending_.append(buf, static_cast<size_t>(n));
    return true;
  }
  int fd_;
  bool connected_ = false;
  std::string pending_;
};

// Request texts for it.
inline std::string Get(const std::string& path, const std::string& extra = "") {
  return "GET " + path + " HTTP/1.1\r\nHost: x\r\n" + extra + "\r\n";
}

inline std::string Post(const std::string& path, const std::string& body, const std::string& extra = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\n" + extra + "\r\n" + body;
}

// A POST whose body goes in chunks of `chunk` bytes (Transfer-Encoding: chunked, no length).
inline std::string PostChunked(const std::string& path, const std::string& body, size_t chunk) {
  if (chunk == 0) chunk = 1;
  static const char kHex[] = "0123456789abcdef";
  std::string out = "POST " + path + " HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  for (size_t at = 0; at < body.size(); at += chunk) {
    size_t n = std::min(chunk, body.size() - at);
    std::string size;
    for (size_t v = n; v > 0; v /= 16) size.insert(size.begin(), kHex[v % 16]);
    out += size + "\r\n" + body.substr(at, n) + "\r\n";
  }
  return out + "0\r\n\r\n";
}

}  // namespace kiln::testing
