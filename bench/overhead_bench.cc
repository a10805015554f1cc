// kiln-overhead-bench: what kiln's served path costs on top of the model itself.
//
//   BM_InProcessForward  the TorchScript backend's Execute, in this process (no server).
//   BM_GrpcServed        one synchronous gRPC ModelInfer round trip to a running kiln-runtime
//                        (KILN_GRPC_ADDRESS), same input.
//   BM_RestServed        the same over REST JSON (KILN_HTTP_ADDRESS), optional.
//   BM_GrpcServedLeanClient  BM_GrpcServed through a lean HTTP/2 client (bench/h2_grpc_client.h)
//                        instead of grpc++'s, whose own cost per call (60-90 us of CPU on the
//                        development VM) would otherwise be counted as the server's; with
//                        spin:1 the client also waits for the reply busily, so the server's
//                        send does not pay for waking it.
//   BM_GrpcTransportFloor, BM_GrpcTransportFloorLeanClient, BM_RestTransportFloor  ServerLive
//                        and GET /v2/health/live round trips: each client's floor, no model.
//
// BM_InProcessForward's idle_us sleeps that long before each forward (spin:1 waits busily
// instead), as a server's thread waits between a lone client's requests.
//
// Served minus in-process is kiln's per-request overhead (protocol, (de)serialization, queue,
// scheduling). Point the served benchmarks at a runtime *without* dynamic batching: with it, a
// lone synchronous client waits out max_queue_delay_microseconds on every request.
//
// Environment: KILN_MODEL_REPO (required for BM_InProcessForward), KILN_BENCH_MODEL (default
// encoder), KILN_BENCH_THREADS (backend threads, default: the model config's),
// KILN_GRPC_ADDRESS, KILN_HTTP_ADDRESS. A missing variable skips its benchmarks with an error.
// KILN_CONTROL_SOCKET (optional, the runtime's --control-socket): the served benchmarks then
// also report `server_compute_us`, the mean time the model itself took inside the server over
// the run (RuntimeControl Stats), which splits the overhead into the model running slower when
// served and everything else.
//
// This file must include neither spdlog nor fmt: it links LibTorch (through
// kiln_backend_torchscript), whose bundled fmt clashes with theirs.

#include <benchmark/benchmark.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bench/h2_grpc_client.h"
#include "bench/http_client.h"
#include "bench/oip.h"
#include "inference/grpc_service.grpc.pb.h"
#include "kiln/v1/runtime_control.grpc.pb.h"
#include "runtime/backend.h"
#include "runtime/model_config.h"
#include "runtime/tensor.h"
#include "runtime/torchscript_backend.h"

namespace kiln::bench {
namespace {

std::string Env(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' ? std::string(v) : fallback;
}

std::string ModelName() { return Env("KILN_BENCH_MODEL", "encoder"); }

std::string LittleEndianBytes(const std::vector<int64_t>& values) {
  std::string out;
  out.reserve(values.size() * 8);
  for (int64_t v : values) {
    uint64_t u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) {
      out.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
    }
  }
  return out;
}

EncoderInput BenchInput(int64_t batch, int64_t seq_len) {
  std::mt19937_64 rng(42);
  return RandomEncoderInput(batch, seq_len, &rng);
}

// The backend, loaded once for the whole binary.
struct LoadedBackend {
  absl::Status status;
  ModelConfig config;
  std::unique_ptr<Backend> backend;
};

const LoadedBackend& GetBackend() {
  static const LoadedBackend* loaded = [] {
    auto* l = new LoadedBackend;
    std::string repo = Env("KILN_MODEL_REPO");
    if (repo.empty()) {
      l->status = absl::FailedPreconditionError("KILN_MODEL_REPO is not set");
      return l;
    }
    absl::StatusOr<ResolvedModel> model = ResolveModel(repo, ModelName(), "");
    if (!model.ok()) {
      l->status = model.status();
      return l;
    }
    l->config = model->config;
    BackendOptions options;
    options.device = model->config.instance.device;
    options.threads = model->config.instance.threads;
    int64_t threads = 0;
    if (absl::SimpleAtoi(Env("KILN_BENCH_THREADS"), &threads)) {
      options.threads = threads;
    }
    absl::StatusOr<std::unique_ptr<Backend>> backend =
        CreateTorchScriptBackend(model->config, model->model_file, options);
    if (!backend.ok()) {
      l->status = backend.status();
      return l;
    }
    l->backend = *std::move(backend);
    return l;
  }();
  return *loaded;
}

void BM_InProcessForward(benchmark::State& state) {
  const LoadedBackend& loaded = GetBackend();
  if (!loaded.status.ok()) {
    state.SkipWithError(std::string(loaded.status.message()).c_str());
    return;
  }
  const int64_t batch = state.range(0);
  const int64_t seq_len = state.range(1);
  EncoderInput in = BenchInput(batch, seq_len);
  // Tensors in the config's input order.
  std::vector<Tensor> inputs;
  for (const TensorSpec& spec : loaded.config.inputs) {
    Tensor t;
    t.name = spec.name;
    t.dtype = DataType::kInt64;
    t.shape = {batch, seq_len};
    t.data = LittleEndianBytes(spec.name == kAttentionMaskName ? in.mask : in.ids);
    inputs.push_back(std::move(t));
  }
  // idle_us > 0: the thread sleeps that long before each forward, untimed, as a server's
  // thread waits between a lone client's requests (the CPU's caches and predictors cool).
  const int64_t idle_us = state.range(2);
  // spin: the thread waits busily instead (a thread that polls keeps its CPU awake).
  const bool spin = state.range(3) != 0;
  for (auto _ : state) {
    if (idle_us > 0 && spin) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(idle_us);
      while (std::chrono::steady_clock::now() < until) {
      }
    } else if (idle_us > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(idle_us));
    }
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<Tensor>> out = loaded.backend->Execute(inputs);
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (!out.ok()) {
      state.SkipWithError(std::string(out.status().message()).c_str());
      break;
    }
    benchmark::DoNotOptimize(out->data());
  }
  state.SetItemsProcessed(state.iterations() * batch);
}

// The runtime's model time (sum and count of its compute histogram), over its control socket
// when KILN_CONTROL_SOCKET names one.
struct ComputeSample {
  double sum = 0;
  uint64_t count = 0;
};
std::optional<ComputeSample> ServerCompute() {
  const std::string socket = Env("KILN_CONTROL_SOCKET");
  if (socket.empty()) return std::nullopt;
  static auto stub = kiln::v1::RuntimeControl::NewStub(
      grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  kiln::v1::RuntimeStats stats;
  if (!stub->Stats(&ctx, {}, &stats).ok()) return std::nullopt;
  return ComputeSample{stats.compute_micros().sum(), stats.compute_micros().count()};
}

// Sets `server_compute_us` from two samples around the timed loop.
void ReportServerCompute(benchmark::State& state, const std::optional<ComputeSample>& before) {
  std::optional<ComputeSample> after = ServerCompute();
  if (!before || !after || after->count <= before->count) return;
  state.counters["server_compute_us"] =
      (after->sum - before->sum) / static_cast<double>(after->count - before->count);
}

void BM_GrpcServed(benchmark::State& state) {
  const std::string address = Env("KILN_GRPC_ADDRESS");
  if (address.empty()) {
    state.SkipWithError("KILN_GRPC_ADDRESS is not set (HOST:PORT of a running kiln-runtime)");
    return;
  }
  const int64_t batch = state.range(0);
  const int64_t seq_len = state.range(1);
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  const inference::ModelInferRequest request =
      MakeGrpcInferRequest(ModelName(), "", "bench", BenchInput(batch, seq_len), /*raw=*/true);
  inference::ModelInferResponse response;
  // One untimed call: connects the channel and fails fast when the server is not there.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status s = stub->ModelInfer(&ctx, request, &response);
    if (!s.ok()) {
      state.SkipWithError(absl::StrCat("ModelInfer: ", s.error_message()).c_str());
      return;
    }
  }
  const std::optional<ComputeSample> before = ServerCompute();
  for (auto _ : state) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status s = stub->ModelInfer(&ctx, request, &response);
    if (!s.ok()) {
      state.SkipWithError(absl::StrCat("ModelInfer: ", s.error_message()).c_str());
      break;
    }
  }
  ReportServerCompute(state, before);
  state.SetItemsProcessed(state.iterations() * batch);
}

// The floor under any served request: a ServerLive round trip to the same runtime (loopback
// gRPC, HTTP/2 framing, the callback executor) with no tensors and no model.
void BM_GrpcTransportFloor(benchmark::State& state) {
  const std::string address = Env("KILN_GRPC_ADDRESS");
  if (address.empty()) {
    state.SkipWithError("KILN_GRPC_ADDRESS is not set (HOST:PORT of a running kiln-runtime)");
    return;
  }
  auto stub = inference::GRPCInferenceService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  inference::ServerLiveRequest request;
  inference::ServerLiveResponse response;
  for (auto _ : state) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status s = stub->ServerLive(&ctx, request, &response);
    if (!s.ok()) {
      state.SkipWithError(absl::StrCat("ServerLive: ", s.error_message()).c_str());
      break;
    }
  }
}

// The HOST:PORT in environment variable `var`, or nothing (the benchmark skipped with why).
std::optional<HostPort> Target(benchmark::State& state, const char* var) {
  const std::string address = Env(var);
  if (address.empty()) {
    state.SkipWithError(
        absl::StrCat(var, " is not set (HOST:PORT of a running kiln-runtime)").c_str());
    return std::nullopt;
  }
  absl::StatusOr<HostPort> target = ParseHostPort(address);
  if (!target.ok()) {
    state.SkipWithError(std::string(target.status().message()).c_str());
    return std::nullopt;
  }
  return *target;
}
std::optional<HostPort> GrpcTarget(benchmark::State& state) {
  return Target(state, "KILN_GRPC_ADDRESS");
}
std::optional<HostPort> RestTarget(benchmark::State& state) {
  return Target(state, "KILN_HTTP_ADDRESS");
}

// The same ModelInfer and ServerLive round trips through a lean HTTP/2 client
// (bench/h2_grpc_client.h): the request serialized once, one write per call, the reply read
// on this thread. What grpc++'s client costs per call is then left out of the served time.

// One call, checked: a transport error, a gRPC error or a reply `Response` cannot parse
// stops the benchmark with why.
template <typename Response>
bool LeanCall(benchmark::State& state, H2GrpcClient& client, const std::string& path,
              const std::string& request, Response* response) {
  absl::StatusOr<GrpcReply> reply = client.Call(path, request);
  if (!reply.ok()) {
    state.SkipWithError(absl::StrCat(path, ": ", reply.status().message()).c_str());
    return false;
  }
  if (reply->status != 0) {
    state.SkipWithError(
        absl::StrCat(path, ": grpc-status ", reply->status, ": ", reply->message).c_str());
    return false;
  }
  if (!response->ParseFromString(reply->body)) {
    state.SkipWithError(absl::StrCat(path, ": the reply does not parse").c_str());
    return false;
  }
  return true;
}

// spin: the client waits for each reply busily (H2GrpcClient's `spin`).
void BM_GrpcServedLeanClient(benchmark::State& state) {
  std::optional<HostPort> target = GrpcTarget(state);
  if (!target) return;
  const int64_t batch = state.range(0);
  const int64_t seq_len = state.range(1);
  H2GrpcClient client(*target, std::chrono::milliseconds(10000), state.range(2) != 0);
  const std::string path = "/inference.GRPCInferenceService/ModelInfer";
  const std::string request =
      MakeGrpcInferRequest(ModelName(), "", "bench", BenchInput(batch, seq_len), /*raw=*/true)
          .SerializeAsString();
  inference::ModelInferResponse response;
  if (!LeanCall(state, client, path, request, &response)) return;  // connects, untimed
  const std::optional<ComputeSample> before = ServerCompute();
  for (auto _ : state) {
    if (!LeanCall(state, client, path, request, &response)) break;
  }
  if (response.raw_output_contents_size() != 1) {
    state.SkipWithError("ModelInfer: expected one raw output");
    return;
  }
  ReportServerCompute(state, before);
  state.SetItemsProcessed(state.iterations() * batch);
}

void BM_GrpcTransportFloorLeanClient(benchmark::State& state) {
  std::optional<HostPort> target = GrpcTarget(state);
  if (!target) return;
  H2GrpcClient client(*target, std::chrono::milliseconds(10000), state.range(0) != 0);
  const std::string path = "/inference.GRPCInferenceService/ServerLive";
  const std::string request = inference::ServerLiveRequest().SerializeAsString();
  inference::ServerLiveResponse response;
  for (auto _ : state) {
    if (!LeanCall(state, client, path, request, &response)) break;
  }
  if (!response.live()) state.SkipWithError("ServerLive: the server says it is not live");
}

// The REST round trip with no model work: GET /v2/health/live on a kept-alive connection.
void BM_RestTransportFloor(benchmark::State& state) {
  std::optional<HostPort> target = RestTarget(state);
  if (!target) return;
  HttpClient client(*target, std::chrono::milliseconds(10000));
  for (auto _ : state) {
    absl::StatusOr<HttpResponse> resp = client.Get("/v2/health/live");
    if (!resp.ok() || resp->status != 200) {
      state.SkipWithError(resp.ok() ? RestErrorMessage(resp->status, resp->body).c_str()
                                    : absl::StrCat("GET: ", resp.status().message()).c_str());
      break;
    }
  }
}

void BM_RestServed(benchmark::State& state) {
  std::optional<HostPort> target = RestTarget(state);
  if (!target) return;
  const int64_t batch = state.range(0);
  const int64_t seq_len = state.range(1);
  HttpClient client(*target, std::chrono::milliseconds(10000));
  const std::string path = RestInferPath(ModelName(), "");
  const std::string body = MakeRestInferBody("bench", BenchInput(batch, seq_len));
  // One untimed request: opens the keep-alive connection and fails fast on errors.
  {
    absl::StatusOr<HttpResponse> resp = client.Post(path, body);
    if (!resp.ok() || resp->status != 200) {
      state.SkipWithError(resp.ok() ? RestErrorMessage(resp->status, resp->body).c_str()
                                    : absl::StrCat("POST: ", resp.status().message()).c_str());
      return;
    }
  }
  const std::optional<ComputeSample> before = ServerCompute();
  for (auto _ : state) {
    absl::StatusOr<HttpResponse> resp = client.Post(path, body);
    if (!resp.ok()) {
      state.SkipWithError(absl::StrCat("POST: ", resp.status().message()).c_str());
      break;
    }
    if (resp->status != 200) {
      state.SkipWithError(RestErrorMessage(resp->status, resp->body).c_str());
      break;
    }
  }
  ReportServerCompute(state, before);
  state.SetItemsProcessed(state.iterations() * batch);
}

BENCHMARK(BM_InProcessForward)
    ->ArgNames({"batch", "seq", "idle_us", "spin"})
    ->Args({1, 16, 0, 0})
    ->Args({1, 16, 150, 0})
    ->Args({1, 16, 150, 1})
    ->Args({1, 16, 300, 0})
    ->Args({8, 16, 0, 0})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GrpcServed)
    ->ArgNames({"batch", "seq"})
    ->Args({1, 16})
    ->Args({8, 16})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GrpcServedLeanClient)
    ->ArgNames({"batch", "seq", "spin"})
    ->Args({1, 16, 0})
    ->Args({1, 16, 1})
    ->Args({8, 16, 0})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GrpcTransportFloor)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GrpcTransportFloorLeanClient)
    ->ArgName("spin")
    ->Arg(0)
    ->Arg(1)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RestTransportFloor)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RestServed)
    ->ArgNames({"batch", "seq"})
    ->Args({1, 16})
    ->Args({8, 16})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kiln::bench

BENCHMARK_MAIN();
