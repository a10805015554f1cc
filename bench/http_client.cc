#include "bench/http_client.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kiln::bench {

namespace {

using Clock = std::chrono::steady_clock;

std::string ErrnoText(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

}  // namespace

absl::StatusOr<HostPort> ParseHostPort(const std::string& address) {
  absl::string_view rest = address;
  if (absl::StartsWith(rest, "http://")) {
    rest.remove_prefix(7);
  }
  while (!rest.empty() && rest.back() == '/') {
    rest.remove_suffix(1);
  }
  size_t colon = rest.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("address '", address, "': expected HOST:PORT"));
  }
  HostPort hp;
  hp.host = std::string(rest.substr(0, colon));
  if (hp.host == "localhost") {
    hp.host = "127.0.0.1";
  }
  if (!absl::SimpleAtoi(rest.substr(colon + 1), &hp.port) || hp.port <= 0 || hp.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("address '", address, "': bad port"));
  }
  in_addr addr{};
  if (inet_pton(AF_INET, hp.host.c_str(), &addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("address '", address, "': host must be an IPv4 literal or localhost"));
  }
  return hp;
}

HttpClient::HttpClient(HostPort target, std::chrono::milliseconds timeout)
    : target_(std::move(target)), timeout_(timeout) {}

HttpClient::~HttpClient() { Close(); }

void HttpClient::Close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  buffer_.clear();
  buffer_pos_ = 0;
}

absl::Status HttpClient::Connect() {
  Close();
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::UnavailableError(ErrnoText("socket"));
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout_.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout_.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));

  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(target_.port));
  ::inet_pton(AF_INET, target_.host.c_str(), &addr.sin_addr);

  // Non-blocking connect bounded by the timeout, then back to blocking mode.
  int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  if (rc != 0 && errno != EINPROGRESS) {
    std::string err = ErrnoText("connect");
    ::close(fd);
    return absl::UnavailableError(err);
  }
  if (rc != 0) {
    pollfd pfd{fd, POLLOUT, 0};
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
    int n = left.count() > 0 ? ::poll(&pfd, 1, static_cast<int>(left.count())) : 0;
    if (n <= 0) {
      ::close(fd);
      return absl::DeadlineExceededError("connect: timed out");
    }
    int so_error = 0;
    socklen_t len = sizeof(so_error);
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
    if (so_error != 0) {
      ::close(fd);
      return absl::UnavailableError(absl::StrCat("connect: ", std::strerror(so_error)));
    }
  }
  ::fcntl(fd, F_SETFL, flags);
  fd_ = fd;
  ++connects_;
  return absl::OkStatus();
}

absl::Status HttpClient::SendAll(const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::send(fd_, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return absl::DeadlineExceededError("send: timed out");
      }
      return absl::UnavailableError(ErrnoText("send"));
    }
    off += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status HttpClient::ReadMore() {
  if (buffer_pos_ > 0 && buffer_pos_ == buffer_.size()) {
    buffer_.clear();
    buffer_pos_ = 0;
  }
  char chunk[16384];
  while (true) {
    // The whole request shares one deadline, so a server that trickles bytes cannot stretch
    // it.
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
    pollfd pfd{fd_, POLLIN, 0};
    int ready = left.count() > 0 ? ::poll(&pfd, 1, static_cast<int>(left.count())) : 0;
    if (ready < 0 && errno == EINTR) {
      continue;
    }
    if (ready == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("no complete response within ", timeout_.count(), " ms"));
    }
    ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
    if (n > 0) {
      buffer_.append(chunk, static_cast<size_t>(n));
      return absl::OkStatus();
    }
    if (n == 0) {
      return absl::UnavailableError("connection closed by server");
    }
    if (errno == EINTR) {
      continue;
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return absl::DeadlineExceededError(
          absl::StrCat("recv: no response within ", timeout_.count(), " ms"));
    }
    return absl::UnavailableError(ErrnoText("recv"));
  }
}

absl::StatusOr<std::string> HttpClient::ReadLine() {
  while (true) {
    size_t eol = buffer_.find("\r\n", buffer_pos_);
    if (eol != std::string::npos) {
      std::string line = buffer_.substr(buffer_pos_, eol - buffer_pos_);
      buffer_pos_ = eol + 2;
      return line;
    }
    if (buffer_.size() - buffer_pos_ > 64 * 1024) {
      return absl::InternalError("response header line too long");
    }
    absl::Status s = ReadMore();
    if (!s.ok()) {
      return s;
    }
  }
}

absl::Status HttpClient::ReadExactly(size_t n, std::string* out) {
  while (buffer_.size() - buffer_pos_ < n) {
    absl::Status s = ReadMore();
    if (!s.ok()) {
      return s;
    }
  }
  out->append(buffer_, buffer_pos_, n);
  buffer_pos_ += n;
  return absl::OkStatus();
}

absl::StatusOr<HttpResponse> HttpClient::RoundTrip(const std::string& request,
                                                   bool* sent_on_reused) {
  *sent_on_reused = fd_ >= 0;
  if (fd_ < 0) {
    absl::Status s = Connect();
    if (!s.ok()) {
      return s;
    }
  }
  // Whatever is left from an earlier response is garbage by now.
  buffer_.clear();
  buffer_pos_ = 0;
  absl::Status s = SendAll(request);
  if (!s.ok()) {
    return s;
  }

  absl::StatusOr<std::string> status_line = ReadLine();
  if (!status_line.ok()) {
    return status_line.status();
  }
  // From here on a failure is not a stale-connection failure: no retry.
  *sent_on_reused = false;
  HttpResponse resp;
  // "HTTP/1.1 200 OK"
  if (!absl::StartsWith(*status_line, "HTTP/1.")) {
    return absl::InternalError(absl::StrCat("malformed status line '", *status_line, "'"));
  }
  bool http10 = absl::StartsWith(*status_line, "HTTP/1.0");
  size_t sp = status_line->find(' ');
  if (sp == std::string::npos ||
      !absl::SimpleAtoi(absl::string_view(*status_line).substr(sp + 1, 3), &resp.status)) {
    return absl::InternalError(absl::StrCat("malformed status line '", *status_line, "'"));
  }

  int64_t content_length = -1;
  bool chunked = false;
  bool close_after = http10;
  while (true) {
    absl::StatusOr<std::string> line = ReadLine();
    if (!line.ok()) {
      return line.status();
    }
    if (line->empty()) {
      break;
    }
    size_t colon = line->find(':');
    if (colon == std::string::npos) {
      continue;
    }
    std::string key = absl::AsciiStrToLower(line->substr(0, colon));
    std::string value(absl::StripAsciiWhitespace(absl::string_view(*line).substr(colon + 1)));
    if (key == "content-length") {
      if (!absl::SimpleAtoi(value, &content_length) || content_length < 0) {
        return absl::InternalError(absl::StrCat("bad Content-Length '", value, "'"));
      }
    } else if (key == "transfer-encoding") {
      chunked = absl::StrContains(absl::AsciiStrToLower(value), "chunked");
    } else if (key == "connection") {
      if (absl::EqualsIgnoreCase(value, "close")) {
        close_after = true;
      } else if (absl::EqualsIgnoreCase(value, "keep-alive")) {
        close_after = false;
      }
    } else if (key == "content-type") {
      resp.content_type = value;
    }
  }

  bool no_body =
      resp.status == 204 || resp.status == 304 || (resp.status >= 100 && resp.status < 200);
  if (no_body) {
    // Nothing to read.
  } else if (chunked) {
    while (true) {
      absl::StatusOr<std::string> size_line = ReadLine();
      if (!size_line.ok()) {
        return size_line.status();
      }
      std::string hex = size_line->substr(0, size_line->find(';'));
      size_t size = 0;
      if (!absl::SimpleHexAtoi(absl::StripAsciiWhitespace(hex), &size)) {
        return absl::InternalError(absl::StrCat("bad chunk size '", *size_line, "'"));
      }
      if (size == 0) {
        // Trailers until the empty line.
        while (true) {
          absl::StatusOr<std::string> trailer = ReadLine();
          if (!trailer.ok()) {
            return trailer.status();
          }
          if (trailer->empty()) {
            break;
          }
        }
        break;
      }
      absl::Status rs = ReadExactly(size, &resp.body);
      if (!rs.ok()) {
        return rs;
      }
      absl::StatusOr<std::string> crlf = ReadLine();
      if (!crlf.ok()) {
        return crlf.status();
      }
    }
  } else if (content_length >= 0) {
    absl::Status rs = ReadExactly(static_cast<size_t>(content_length), &resp.body);
    if (!rs.ok()) {
      return rs;
    }
  } else {
    // Body delimited by connection close.
    while (true) {
      absl::Status rs = ReadMore();
      if (!rs.ok()) {
        if (absl::IsDeadlineExceeded(rs)) {
          return rs;
        }
        break;
      }
    }
    resp.body.assign(buffer_, buffer_pos_, std::string::npos);
    close_after = true;
  }
  if (close_after) {
    Close();
  }
  return resp;
}

absl::StatusOr<HttpResponse> HttpClient::Request(const std::string& method, const std::string& path,
                                                 const std::string& body,
                                                 const std::string& content_type) {
  std::string request;
  request.reserve(body.size() + 256);
  absl::StrAppend(&request, method, " ", path, " HTTP/1.1\r\nHost: ", target_.host, ":",
                  target_.port, "\r\nConnection: keep-alive\r\nAccept: application/json\r\n");
  if (method != "GET" || !body.empty()) {
    absl::StrAppend(&request, "Content-Type: ", content_type, "\r\nContent-Length: ", body.size(),
                    "\r\n");
  }
  request += "\r\n";
  request += body;
  deadline_ = Clock::now() + timeout_;

  for (int attempt = 0; attempt < 2; ++attempt) {
    bool sent_on_reused = false;
    absl::StatusOr<HttpResponse> resp = RoundTrip(request, &sent_on_reused);
    if (resp.ok()) {
      return resp;
    }
    Close();
    // Only a kept-alive connection the server dropped while idle earns a retry; a timeout
    // means the server is alive but slow, so it is reported, not retried.
    if (!sent_on_reused || absl::IsDeadlineExceeded(resp.status())) {
      return resp.status();
    }
  }
  return absl::UnavailableError("unreachable");
}

absl::StatusOr<HttpResponse> HttpClient::Post(const std::string& path, const std::string& body,
                                              const std::string& content_type) {
  return Request("POST", path, body, content_type);
}

absl::StatusOr<HttpResponse> HttpClient::Get(const std::string& path) {
  return Request("GET", path, "", "");
}

}  // namespace kiln::bench
