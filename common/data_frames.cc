#include "common/data_frames.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/status/statusor.h"

namespace kiln {

namespace {

void PutLe(uint64_t v, int bytes, char* out) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint64_t GetLe(const char* in, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) {
    v |= static_cast<uint64_t>(static_cast<unsigned char>(in[i])) << (8 * i);
  }
  return v;
}

absl::StatusOr<sockaddr_un> UnixAddress(const std::string& path, const std::string& what) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(what + ": '" + path + "' must be 1.." +
                                      std::to_string(sizeof(addr.sun_path) - 1) + " bytes long");
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

// A connection to `path`; on failure, `*err` holds connect's errno. The connect never waits:
// a listener whose backlog is full (one that stopped accepting) fails it with EAGAIN at once.
absl::StatusOr<int> TryConnectUnix(const std::string& path, int* err) {
  auto addr = UnixAddress(path, "data socket");
  if (!addr.ok()) return absl::UnavailableError(addr.status().message());
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(std::string("socket: ") + std::strerror(errno));
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    *err = errno;
    ::close(fd);
    if (*err == EAGAIN) {
      return absl::UnavailableError("cannot connect to " + path +
                                    ": its backlog is full (the process is not accepting)");
    }
    return absl::UnavailableError("cannot connect to " + path + ": " + std::strerror(*err));
  }
  // Connected: blocking from here on, as every user of it expects.
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    *err = errno;
    ::close(fd);
    return absl::UnavailableError(std::string("fcntl: ") + std::strerror(*err));
  }
  return fd;
}

}  // namespace

void EncodeFrameHeader(const FrameHeader& h, char out[kFrameHeaderBytes]) {
  PutLe(h.length, 4, out);
  PutLe(h.tag, 8, out + 4);
  out[12] = static_cast<char>(h.code);
  PutLe(static_cast<uint64_t>(h.deadline_unix_micros), 8, out + 13);
}

FrameHeader DecodeFrameHeader(const char in[kFrameHeaderBytes]) {
  FrameHeader h;
  h.length = static_cast<uint32_t>(GetLe(in, 4));
  h.tag = GetLe(in + 4, 8);
  h.code = static_cast<uint8_t>(in[12]);
  h.deadline_unix_micros = static_cast<int64_t>(GetLe(in + 13, 8));
  return h;
}

std::string EncodeJsonInferBody(std::string json, const std::string& model,
                                const std::string& version) {
  char lengths[8];
  PutLe(model.size(), 4, lengths);
  PutLe(version.size(), 4, lengths + 4);
  json.reserve(json.size() + model.size() + version.size() + sizeof(lengths));
  json += model;
  json += version;
  json.append(lengths, sizeof(lengths));
  return json;
}

absl::Status DecodeJsonInferBody(std::string* body, std::string* model, std::string* version) {
  if (body->size() < 8) {
    return absl::InvalidArgumentError("a REST inference frame of " + std::to_string(body->size()) +
                                      " bytes is shorter than its 8-byte trailer");
  }
  const char* end = body->data() + body->size();
  const uint64_t model_len = GetLe(end - 8, 4);
  const uint64_t version_len = GetLe(end - 4, 4);
  if (model_len + version_len > body->size() - 8) {
    return absl::InvalidArgumentError("a REST inference frame's trailer names " +
                                      std::to_string(model_len + version_len) +
                                      " bytes of model and version in a body of " +
                                      std::to_string(body->size()) + " bytes");
  }
  const size_t json_len = body->size() - 8 - model_len - version_len;
  model->assign(body->data() + json_len, model_len);
  version->assign(body->data() + json_len + model_len, version_len);
  body->resize(json_len);
  return absl::OkStatus();
}

std::string EncodeJsonAnswer(std::string json, int http_status) {
  char status[2];
  PutLe(static_cast<uint64_t>(http_status), 2, status);
  json.append(status, sizeof(status));
  return json;
}

absl::Status DecodeJsonAnswer(std::string* body, int* http_status) {
  if (body->size() < 2) {
    return absl::InvalidArgumentError("a REST inference answer of " + std::to_string(body->size()) +
                                      " bytes is shorter than its 2-byte status");
  }
  const int status = static_cast<int>(GetLe(body->data() + body->size() - 2, 2));
  if (status < 100 || status > 599) {
    return absl::InvalidArgumentError("a REST inference answer's HTTP status " +
                                      std::to_string(status) + " is not in 100..599");
  }
  *http_status = status;
  body->resize(body->size() - 2);
  return absl::OkStatus();
}

std::string EncodeFrame(uint64_t tag, uint8_t code, int64_t deadline_unix_micros,
                        const std::string& body) {
  std::string out(kFrameHeaderBytes, '\0');
  EncodeFrameHeader({static_cast<uint32_t>(body.size()), tag, code, deadline_unix_micros},
                    out.data());
  out += body;
  return out;
}

bool ReadFull(int fd, char* buf, size_t n, bool* eof) {
  size_t got = 0;
  if (eof) *eof = false;
  while (got < n) {
    ssize_t r = ::read(fd, buf + got, n - got);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r == 0) {
      if (eof && got == 0) *eof = true;
      return false;
    } else if (errno != EINTR) {
      return false;
    }
  }
  return true;
}

bool WriteFull(int fd, const char* data, size_t n) {
  size_t done = 0;
  while (done < n) {
    ssize_t w = ::send(fd, data + done, n - done, MSG_NOSIGNAL);
    if (w > 0) {
      done += static_cast<size_t>(w);
    } else if (w < 0 && errno != EINTR) {
      return false;
    }
  }
  return true;
}

absl::Status ClearStaleSocket(const std::string& path, const std::string& flag) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (!S_ISSOCK(st.st_mode)) {
    return absl::AlreadyExistsError(flag + ": " + path + " exists and is not a socket");
  }
  int err = 0;
  auto live = TryConnectUnix(path, &err);
  if (live.ok() || err == EAGAIN) {  // EAGAIN: a listener with a full backlog is alive too
    if (live.ok()) ::close(*live);
    return absl::AlreadyExistsError(flag + ": " + path + " is in use by another process");
  }
  std::error_code ec;
  std::filesystem::remove(path, ec);
  return absl::OkStatus();
}

absl::StatusOr<int> ListenUnix(const std::string& path, const std::string& flag) {
  auto addr = UnixAddress(path, flag);
  if (!addr.ok()) return addr.status();
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(flag + ": socket: " + std::strerror(errno));
  if (absl::Status s = ClearStaleSocket(path, flag); !s.ok()) {
    ::close(fd);
    return s;
  }
  // Created 0600 (umask while binding), not chmod-ed after: no moment where others may connect.
  mode_t old = ::umask(0177);
  int rc = ::bind(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr));
  int bind_errno = errno;
  ::umask(old);
  if (rc == 0 && ::chmod(path.c_str(), 0600) != 0) {  // whatever the file system made of it
    bind_errno = errno;
    rc = -1;
  }
  if (rc != 0 || ::listen(fd, 64) != 0) {
    int e = rc != 0 ? bind_errno : errno;
    ::close(fd);
    return absl::UnavailableError(flag + ": cannot listen on " + path + ": " + std::strerror(e));
  }
  return fd;
}

absl::StatusOr<int> ConnectUnix(const std::string& path) {
  int e = 0;
  return TryConnectUnix(path, &e);
}

}  // namespace kiln
