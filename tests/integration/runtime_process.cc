#include "tests/integration/runtime_process.h"

#include "tests/support/shell.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <grpcpp/create_channel.h>

namespace kiln::testing {

namespace {

std::string MakeTempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "kiln_rt_XXXXXX").string();
  char* d = mkdtemp(tmpl.data());
  return d ? std::string(d) : "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<RuntimeProcess>> RuntimeProcess::Start(Options o) {
  std::unique_ptr<RuntimeProcess> p(new RuntimeProcess());
  p->dir_ = MakeTempDir();
  if (p->dir_.empty()) return absl::InternalError("mkdtemp failed");
  p->socket_ = p->dir_ + "/control.sock";
  p->log_file_ = p->dir_ + "/runtime.log";
  if (o.prestart) {
    std::vector<std::string> args = {KILN_RUNTIME_BIN, "--prestart", "--control-socket",
                                     p->socket_, "--log-level", "debug"};
    args.insert(args.end(), o.extra_args.begin(), o.extra_args.end());
    p->pid_ = SpawnLogged(args, p->log_file_);
    if (p->pid_ < 0) return absl::InternalError("fork failed");
    p->control_ = v1::RuntimeControl::NewStub(
        grpc::CreateChannel("unix:" + p->socket_, grpc::InsecureChannelCredentials()));
    absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {  // bounded poll: until it answers
      int status = 0;
      if (waitpid(p->pid_, &status, WNOHANG) == p->pid_) {
        p->exited_ = true;
        p->exit_status_ = status;
        return absl::FailedPreconditionError("kiln-runtime exited while pre-starting: " + p->Log());
      }
      if (std::filesystem::exists(p->socket_) && p->GetState().ok()) return p;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return absl::DeadlineExceededError("kiln-runtime did not pre-start within 60 s: " + p->Log());
  }
  std::vector<std::string> args = {KILN_RUNTIME_BIN,
                                   "--model-repository", o.repository,
                                   "--model", o.model,
                                   "--grpc-port", "0",
                                   "--http-port", "0",
                                   "--bind-address", "127.0.0.1",
                                   "--control-socket", p->socket_,
                                   "--initial-state", o.initial_state, "--log-level", "debug"};
  if (!o.version.empty()) {
    args.push_back("--version");
    args.push_back(o.version);
  }
  args.insert(args.end(), o.extra_args.begin(), o.extra_args.end());
  p->pid_ = SpawnLogged(args, p->log_file_);
  if (p->pid_ < 0) return absl::InternalError("fork failed");
  p->control_ = v1::RuntimeControl::NewStub(
      grpc::CreateChannel("unix:" + p->socket_, grpc::InsecureChannelCredentials()));
  if (!o.wait_until_loaded) return p;

  // Bounded poll: the socket appears, then the state leaves LOADING.
  absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    int status = 0;
    if (waitpid(p->pid_, &status, WNOHANG) == p->pid_) {
      p->exited_ = true;
      p->exit_status_ = status;
      return absl::FailedPreconditionError("kiln-runtime exited during startup: " + p->Log());
    }
    if (std::filesystem::exists(p->socket_)) {
      auto s = p->GetState();
      if (s.ok() && s->state() != v1::LOADING) {
        p->grpc_port_ = s->grpc_port();
        p->http_port_ = s->http_port();
        return p;
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError("kiln-runtime did not load within 60 s: " + p->Log());
}

RuntimeProcess::~RuntimeProcess() {
  if (pid_ > 0 && !exited_) {
    kill(pid_, SIGKILL);
    int status;
    waitpid(pid_, &status, 0);
  }
  std::error_code ec;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
}

absl::StatusOr<v1::RuntimeState> RuntimeProcess::GetState() {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::RuntimeState state;
  grpc::Status s = control_->GetState(&ctx, v1::GetStateRequest(), &state);
  if (!s.ok()) return absl::UnavailableError(s.error_message());
  return state;
}

grpc::Status RuntimeProcess::LoadArgs(const std::vector<std::string>& args) {
  v1::LoadRequest req;
  for (const auto& a : args) req.add_args(a);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::LoadResponse resp;
  return control_->Load(&ctx, req, &resp);
}

grpc::Status RuntimeProcess::Load(const std::string& repository, const std::string& model,
                                  const std::string& initial_state,
                                  const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"--model-repository", repository, "--model", model,
                                   "--grpc-port", "0", "--http-port", "0",
                                   "--bind-address", "127.0.0.1", "--control-socket", socket_,
                                   "--initial-state", initial_state};
  args.insert(args.end(), extra.begin(), extra.end());
  grpc::Status s = LoadArgs(args);
  if (!s.ok()) return s;
  // The socket is served again by the loading runtime: a bounded poll, each try on a fresh
  // channel (one that found the socket missing for a moment would back off for seconds).
  absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    control_ = v1::RuntimeControl::NewStub(
        grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials()));
    auto st = GetState();
    if (st.ok() && st->state() != v1::LOADING) {
      grpc_port_ = st->grpc_port();
      http_port_ = st->http_port();
      return grpc::Status::OK;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "did not load within 60 s: " + Log());
}

absl::StatusOr<int> RuntimeProcess::WaitExit(absl::Duration timeout) {
  if (exited_) return exit_status_;
  absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      exit_status_ = status;
      return status;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::DeadlineExceededError("the process did not exit in time");
}

void RuntimeProcess::Signal(int sig) {
  if (pid_ > 0 && !exited_) kill(pid_, sig);
}

std::string RuntimeProcess::Log() const {
  std::ifstream in(log_file_);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

RunResult RunToCompletion(const std::vector<std::string>& args, absl::Duration timeout) {
  RunResult r;
  std::string dir = MakeTempDir();
  std::string log = dir + "/out.log";
  pid_t pid = SpawnLogged(args, log);
  absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  bool done = false;
  while (absl::Now() < deadline) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      done = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (!done) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  r.exit_code = done && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(log);
  std::stringstream s;
  s << in.rdbuf();
  r.output = s.str();
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return r;
}

}  // namespace kiln::testing
