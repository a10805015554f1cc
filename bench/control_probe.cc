// kiln-control-probe: times a kiln-runtime's lifecycle through its control socket
// (kiln.v1.RuntimeControl over unix:PATH).
//
//   T0=$(date +%s%6N); kiln-runtime ... --initial-state warm --control-socket /tmp/k.sock &
//   kiln-control-probe --socket /tmp/k.sock --wait-state WARM --since-unix-us $T0 --promote
//
//   kiln-runtime --prestart --control-socket /tmp/k.sock &
//   kiln-control-probe --socket /tmp/k.sock --load-args "--model-repository R --model encoder
//     --control-socket /tmp/k.sock --grpc-port 0 --http-port 0 --initial-state warm"
//     --wait-state WARM --promote
//
// --load-args hands a pre-started runtime its model (RuntimeControl Load) and times from
// there. --wait-state polls GetState until the runtime reports the state (spawn -> WARM when
// given the spawn time; Load -> WARM after --load-args). --promote then checks that inference is refused while WARM, calls Promote
// and sends ModelInfer (over an already-connected channel, as a router would hold) until the
// first one succeeds: Promote -> first served request. Every wait is bounded by --timeout-s.

#include <grpcpp/grpcpp.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "bench/oip.h"
#include "inference/grpc_service.grpc.pb.h"
#include "kiln/v1/runtime_control.grpc.pb.h"
#include "nlohmann/json.hpp"

namespace kiln::bench {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct Options {
  std::string socket;
  std::string wait_state;
  int64_t since_unix_us = 0;
  bool promote = false;
  bool shutdown = false;
  std::string model = "encoder";
  std::string grpc_address;  // default: 127.0.0.1:<grpc_port from GetState>
  int64_t seq_len = 16;
  double timeout_s = 120;
  bool json = false;
  std::string load_args;  // whitespace-separated
};

int64_t UnixMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

double MillisBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

std::chrono::system_clock::time_point DeadlineIn(milliseconds d) {
  return std::chrono::system_clock::now() + d;
}

int Fail(const Options& opt, nlohmann::ordered_json* out, const std::string& message) {
  std::cerr << "kiln-control-probe: " << message << "\n";
  if (opt.json) {
    (*out)["error"] = message;
    std::cout << out->dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace)
              << std::endl;
  }
  return 1;
}

int Run(const Options& opt) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  const Clock::time_point give_up =
      Clock::now() +
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt.timeout_s));

  // The socket appears once the runtime has bound it; poll for the file first so that the
  // channel's reconnect back-off never inflates the measurement.
  struct stat st {};
  while (::stat(opt.socket.c_str(), &st) != 0) {
    if (Clock::now() >= give_up) {
      return Fail(opt, &out, absl::StrCat("control socket ", opt.socket, " did not appear"));
    }
    std::this_thread::sleep_for(milliseconds(1));
  }
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 5);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 5);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 50);
  auto control_channel =
      grpc::CreateCustomChannel("unix:" + opt.socket, grpc::InsecureChannelCredentials(), args);
  auto control = kiln::v1::RuntimeControl::NewStub(control_channel);

  int64_t since_us = opt.since_unix_us;
  bool loading = false;
  if (!opt.load_args.empty()) {
    kiln::v1::LoadRequest load;
    std::istringstream words(opt.load_args);
    for (std::string w; words >> w;) load.add_args(w);
    since_us = UnixMicros();
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineIn(milliseconds(5000)));
    kiln::v1::LoadResponse resp;
    grpc::Status s = control->Load(&ctx, load, &resp);
    if (!s.ok()) return Fail(opt, &out, absl::StrCat("Load: ", s.error_message()));
    loading = true;
  }

  kiln::v1::RuntimeState state;
  auto get_state = [&]() -> grpc::Status {
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineIn(milliseconds(2000)));
    return control->GetState(&ctx, kiln::v1::GetStateRequest(), &state);
  };

  if (!opt.wait_state.empty()) {
    kiln::v1::LifecycleState want;
    if (!kiln::v1::LifecycleState_Parse(opt.wait_state, &want)) {
      return Fail(opt, &out, absl::StrCat("--wait-state ", opt.wait_state, " is not a state"));
    }
    std::string last_error;
    while (true) {
      grpc::Status s = get_state();
      if (s.ok() && state.state() == want) {
        break;
      }
      if (s.ok() && state.state() == kiln::v1::FAILED) {
        return Fail(opt, &out, absl::StrCat("runtime FAILED: ", state.failure_reason()));
      }
      if (!s.ok()) {
        last_error = s.error_message();
        if (loading) {  // the socket is served again by the loading runtime: reconnect now
          control_channel = grpc::CreateCustomChannel("unix:" + opt.socket,
                                                      grpc::InsecureChannelCredentials(), args);
          control = kiln::v1::RuntimeControl::NewStub(control_channel);
        }
      }
      if (Clock::now() >= give_up) {
        return Fail(opt, &out,
                    absl::StrCat("runtime did not reach ", opt.wait_state, " (last state ",
                                 kiln::v1::LifecycleState_Name(state.state()),
                                 last_error.empty() ? "" : ", last error: " + last_error, ")"));
      }
      std::this_thread::sleep_for(milliseconds(2));
    }
    int64_t seen_us = UnixMicros();
    out["state"] = kiln::v1::LifecycleState_Name(state.state());
    out["load_time_ms"] = static_cast<double>(state.load_time_micros()) / 1000.0;
    if (since_us > 0) {
      out[loading ? "load_to_state_ms" : "spawn_to_state_ms"] =
          static_cast<double>(seen_us - since_us) / 1000.0;
    }
  } else {
    grpc::Status s = get_state();
    if (!s.ok()) {
      return Fail(opt, &out, absl::StrCat("GetState: ", s.error_message()));
    }
    out["state"] = kiln::v1::LifecycleState_Name(state.state());
  }
  out["model"] = state.model_name();
  out["model_version"] = state.model_version();
  out["grpc_port"] = state.grpc_port();
  out["http_port"] = state.http_port();
  out["pid"] = state.pid();

  if (opt.promote) {
    std::string address =
        opt.grpc_address.empty() ? absl::StrCat("127.0.0.1:", state.grpc_port()) : opt.grpc_address;
    auto data_channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
    auto infer = inference::GRPCInferenceService::NewStub(data_channel);
    if (!data_channel->WaitForConnected(DeadlineIn(milliseconds(5000)))) {
      return Fail(opt, &out, absl::StrCat("could not connect to ", address));
    }
    std::mt19937_64 rng(1);
    const inference::ModelInferRequest request = MakeGrpcInferRequest(
        opt.model, "", "probe", RandomEncoderInput(1, opt.seq_len, &rng), /*raw=*/true);
    auto infer_once = [&]() -> grpc::Status {
      grpc::ClientContext ctx;
      ctx.set_deadline(DeadlineIn(milliseconds(5000)));
      inference::ModelInferResponse resp;
      grpc::Status s = infer->ModelInfer(&ctx, request, &resp);
      if (s.ok() && resp.outputs_size() == 0) {
        return grpc::Status(grpc::StatusCode::INTERNAL, "response without outputs");
      }
      return s;
    };

    // Before Promote: a WARM replica must refuse inference.
    grpc::Status before = infer_once();
    out["infer_before_promote"] = before.ok() ? std::string("OK (served while not SERVING)")
                                              : absl::StrCat("refused: code ", before.error_code(),
                                                             " ", before.error_message());

    Clock::time_point t0 = Clock::now();
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(DeadlineIn(milliseconds(10000)));
      kiln::v1::RuntimeState promoted;
      grpc::Status s = control->Promote(&ctx, kiln::v1::PromoteRequest(), &promoted);
      if (!s.ok()) {
        return Fail(opt, &out, absl::StrCat("Promote: ", s.error_message()));
      }
      out["state_after_promote"] = kiln::v1::LifecycleState_Name(promoted.state());
    }
    Clock::time_point t_promoted = Clock::now();
    int attempts = 0;
    std::string last_error;
    while (true) {
      ++attempts;
      grpc::Status s = infer_once();
      if (s.ok()) {
        break;
      }
      last_error = s.error_message();
      if (Clock::now() >= give_up) {
        return Fail(opt, &out,
                    absl::StrCat("no request served after Promote (", attempts,
                                 " attempts, last error: ", last_error, ")"));
      }
      std::this_thread::sleep_for(milliseconds(1));
    }
    Clock::time_point t_served = Clock::now();
    out["promote_rpc_ms"] = MillisBetween(t0, t_promoted);
    out["promote_to_first_ok_ms"] = MillisBetween(t0, t_served);
    out["infer_attempts_after_promote"] = attempts;
    // The same request three times more, one after another: what the first one paid for
    // being first.
    nlohmann::json next = nlohmann::json::array();
    for (int i = 0; i < 3; ++i) {
      Clock::time_point t = Clock::now();
      if (!infer_once().ok()) break;
      next.push_back(MillisBetween(t, Clock::now()));
    }
    out["next_infers_ms"] = next;
  }

  if (opt.shutdown) {
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineIn(milliseconds(15000)));
    kiln::v1::ShutdownRequest req;
    req.set_deadline_millis(5000);
    kiln::v1::ShutdownResponse resp;
    grpc::Status s = control->Shutdown(&ctx, req, &resp);
    out["shutdown"] = s.ok() ? (resp.drained() ? "drained" : "not drained")
                             : absl::StrCat("error: ", s.error_message());
  }

  if (opt.json) {
    std::cout << out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace)
              << std::endl;
  } else {
    for (const auto& [key, value] : out.items()) {
      std::cout << key << ": "
                << value.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace)
                << "\n";
    }
  }
  return 0;
}

}  // namespace
}  // namespace kiln::bench

int main(int argc, char** argv) {
  kiln::bench::Options opt;
  CLI::App app{"kiln-control-probe: time a kiln-runtime's spawn -> WARM and Promote -> served"};
  app.add_option("--socket", opt.socket, "The runtime's --control-socket path")->required();
  app.add_option("--wait-state", opt.wait_state, "Poll GetState until this state (e.g. WARM)");
  app.add_option("--since-unix-us", opt.since_unix_us,
                 "Spawn time (unix microseconds) to report spawn -> state from");
  app.add_flag("--promote", opt.promote, "Promote and time it until the first served request");
  app.add_flag("--shutdown", opt.shutdown, "Ask the runtime to shut down at the end");
  app.add_option("--model", opt.model, "Model name for the probe request")->capture_default_str();
  app.add_option("--grpc-address", opt.grpc_address,
                 "Inference gRPC HOST:PORT (default: 127.0.0.1 and the runtime's grpc_port)");
  app.add_option("--seq-len", opt.seq_len, "Probe request tokens")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--timeout-s", opt.timeout_s, "Bound on every wait")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  app.add_flag("--json", opt.json, "Print the results as one JSON line");
  app.add_option("--load-args", opt.load_args,
                 "A pre-started runtime's Load: the cold-start command line, space-separated");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return kiln::bench::Run(opt);
}
