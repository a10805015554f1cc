#include "common/net_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace kiln {

absl::StatusOr<int> PickFreePort(const std::string& address) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError("'" + address + "' is not an IPv4 address");
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket() failed");
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int err = errno;
    close(fd);
    return absl::UnavailableError("cannot bind " + address + ": " + strerror(err));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

absl::StatusOr<int> OpenOnPort(const std::string& address, int port,
                               const std::function<absl::Status(int port)>& open) {
  const int attempts = port == 0 ? 5 : 1;
  absl::Status last;
  for (int i = 0; i < attempts; ++i) {
    int p = port;
    if (p == 0) {
      auto picked = PickFreePort(address);
      if (!picked.ok()) return picked.status();
      p = *picked;
    }
    last = open(p);
    if (last.ok()) return p;
  }
  return last;
}

}  // namespace kiln
