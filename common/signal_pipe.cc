#include "common/signal_pipe.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>

namespace kiln {
namespace {

int signal_pipe[2] = {-1, -1};

void OnSignal(int sig) {
  const int saved = errno;  // the interrupted code's (a full pipe would change it)
  char c = static_cast<char>(sig);
  [[maybe_unused]] ssize_t n = write(signal_pipe[1], &c, 1);
  errno = saved;
}

}  // namespace

bool InstallSignalPipe(std::initializer_list<int> signals) {
  if (pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return false;
  for (int sig : signals) {
    struct sigaction sa {};
    sa.sa_handler = OnSignal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | (sig == SIGCHLD ? SA_NOCLDSTOP : 0);
    if (sigaction(sig, &sa, nullptr) != 0) return false;
  }
  signal(SIGPIPE, SIG_IGN);
  return true;
}

int NextSignal(int timeout_ms) {
  pollfd pfd{signal_pipe[0], POLLIN, 0};
  if (poll(&pfd, 1, timeout_ms) <= 0) return 0;
  char sig = 0;
  return read(signal_pipe[0], &sig, 1) == 1 ? sig : 0;
}

}  // namespace kiln
