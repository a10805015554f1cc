#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kiln/v1/runtime_control.grpc.pb.h"

namespace kiln::testing {

// A real kiln-runtime child process for integration tests: started with port 0 and a
// control socket in its own temp directory, waited for with bounded polls, killed on exit.
class RuntimeProcess {
 public:
  struct Options {
    std::string repository;
    std::string model;
    std::string version;
    std::string initial_state = "serving";
    std::vector<std::string> extra_args;
    // Wait until the state is one of these (or the process exits).
    bool wait_until_loaded = true;
    // Start with --prestart (no model flags) and wait until it answers on its socket.
    bool prestart = false;
  };

  static absl::StatusOr<std::unique_ptr<RuntimeProcess>> Start(Options options);
  ~RuntimeProcess();

  pid_t pid() const { return pid_; }
  int grpc_port() const { return grpc_port_; }
  int http_port() const { return http_port_; }
  std::string grpc_address() const { return "127.0.0.1:" + std::to_string(grpc_port_); }
  const std::string& control_socket() const { return socket_; }
  v1::RuntimeControl::Stub* control() { return control_.get(); }

  absl::StatusOr<v1::RuntimeState> GetState();
  // A pre-started runtime: sends Load with the cold-start arguments for `model` (its
  // repository, ports 0, this process's control socket, `initial_state`) plus `extra`, then,
  // when accepted, polls (bounded) until it has loaded and records its ports.
  grpc::Status Load(const std::string& repository, const std::string& model,
                    const std::string& initial_state, const std::vector<std::string>& extra = {});
  // Sends Load with exactly `args`.
  grpc::Status LoadArgs(const std::vector<std::string>& args);
  // Polls (bounded) until the process exits; returns its wait status.
  absl::StatusOr<int> WaitExit(absl::Duration timeout);
  void Signal(int sig);
  // Everything the process wrote to stderr/stdout so far.
  std::string Log() const;

 private:
  RuntimeProcess() = default;

  pid_t pid_ = -1;
  bool exited_ = false;
  int exit_status_ = 0;
  std::string dir_;
  std::string socket_;
  std::string log_file_;
  int grpc_port_ = 0;
  int http_port_ = 0;
  std::unique_ptr<v1::RuntimeControl::Stub> control_;
};

// Builds args and runs the binary to completion (for flag-validation tests).
struct RunResult {
  int exit_code = -1;
  std::string output;
};
RunResult RunToCompletion(const std::vector<std::string>& args, absl::Duration timeout);

}  // namespace kiln::testing
