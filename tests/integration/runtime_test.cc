// The real kiln-runtime binary on generated models, over loopback gRPC, REST and its
// control socket.
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cpprest/http_client.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <future>
#include <sstream>
#include <thread>

#include <grpcpp/create_channel.h>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "common/cpu_list.h"
#include "common/data_frames.h"
#include "inference/grpc_service.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/integration/runtime_process.h"
#include "tests/support/eventually.h"
#include "tests/support/raw_grpc.h"
#include "tests/support/raw_http_client.h"
#include "tests/support/requests.h"
#include "tests/support/shell.h"
#include "tests/support/thread_cpu.h"

namespace kiln {
namespace {

using nlohmann::json;
using testing::RuntimeProcess;

const std::string kRepo = KILN_MODEL_REPO;

json References(const std::string& version) {
  std::ifstream in(kRepo + "/encoder/reference/v" + version + ".json");
  return json::parse(in);
}

std::unique_ptr<RuntimeProcess> StartRuntime(const std::string& model, const std::string& version = "",
                                             const std::string& initial = "serving",
                                             std::vector<std::string> extra = {},
                                             const std::string& repo = kRepo) {
  RuntimeProcess::Options o;
  o.repository = repo;
  o.model = model;
  o.version = version;
  o.initial_state = initial;
  o.extra_args = std::move(extra);
  auto p = RuntimeProcess::Start(o);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::move(*p) : nullptr;
}

std::unique_ptr<inference::GRPCInferenceService::Stub> Stub(const RuntimeProcess& p) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(64 << 20);
  return inference::GRPCInferenceService::NewStub(grpc::CreateCustomChannel(
      p.grpc_address(), grpc::InsecureChannelCredentials(), args));
}

struct HttpResult {
  int code = 0;
  json body;
  std::string raw;
};

HttpResult Http(int port, const std::string& method, const std::string& path,
                const std::string& body = "") {
  web::http::client::http_client_config cfg;
  cfg.set_timeout(std::chrono::seconds(30));
  web::http::client::http_client client("http://127.0.0.1:" + std::to_string(port), cfg);
  web::http::http_request req(method);
  req.set_request_uri(path);
  if (!body.empty() || method == web::http::methods::POST) req.set_body(body, "application/json");
  HttpResult r;
  auto resp = client.request(req).get();
  r.code = resp.status_code();
  r.raw = resp.extract_utf8string(true).get();
  r.body = json::parse(r.raw, nullptr, false);
  return r;
}

// An encoder request for a reference case, in gRPC form (typed or raw).
inference::ModelInferRequest GrpcEncoderRequest(const json& c, bool raw,
                                                const std::string& version = "") {
  inference::ModelInferRequest req;
  req.set_model_name("encoder");
  req.set_model_version(version);
  req.set_id("case");
  for (const char* name : {"input_ids", "attention_mask"}) {
    auto* in = req.add_inputs();
    in->set_name(name);
    in->set_datatype("INT64");
    in->add_shape(static_cast<int64_t>(c[name].size()));
    in->add_shape(static_cast<int64_t>(c[name][0].size()));
    std::string bytes;
    for (const auto& row : c[name]) {
      for (const auto& v : row) {
        int64_t x = v.get<int64_t>();
        if (raw) {
          bytes.append(reinterpret_cast<const char*>(&x), 8);
        } else {
          in->mutable_contents()->add_int64_contents(x);
        }
      }
    }
    if (raw) req.add_raw_input_contents(bytes);
  }
  return req;
}

std::string RestEncoderBody(const json& c) {
  json body = {{"id", "rest-case"}, {"inputs", json::array()}};
  for (const char* name : {"input_ids", "attention_mask"}) {
    body["inputs"].push_back({{"name", name},
                              {"datatype", "INT64"},
                              {"shape", {c[name].size(), c[name][0].size()}},
                              {"data", c[name]}});
  }
  return body.dump();
}

std::vector<float> GrpcFloats(const inference::ModelInferResponse& r) {
  if (r.raw_output_contents_size() > 0) {
    const std::string& b = r.raw_output_contents(0);
    std::vector<float> out(b.size() / 4);
    std::memcpy(out.data(), b.data(), b.size());
    return out;
  }
  return {r.outputs(0).contents().fp32_contents().begin(),
          r.outputs(0).contents().fp32_contents().end()};
}

double MaxDiff(const std::vector<float>& got, const json& rows) {
  double worst = 0;
  size_t i = 0;
  for (const auto& row : rows) {
    for (const auto& v : row) {
      if (i >= got.size()) return 1e9;
      worst = std::max(worst, std::abs(got[i++] - v.get<double>()));
    }
  }
  return i == got.size() ? worst : 1e9;
}

std::vector<float> JsonFloats(const json& data) { return data.get<std::vector<float>>(); }

v1::RuntimeStats Stats(RuntimeProcess* rt);

// The first `cases` reference inputs of version 1, one after another, through gRPC (raw) and
// REST: each gets its reference output.
void ExpectReferenceAnswers(const RuntimeProcess& rt, size_t cases) {
  auto stub = Stub(rt);
  auto refs = References("1");
  for (size_t i = 0; i < cases; ++i) {
    const json& c = refs[i];
    grpc::ClientContext ctx;
    inference::ModelInferResponse resp;
    grpc::Status s = stub->ModelInfer(&ctx, GrpcEncoderRequest(c, true), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_LT(MaxDiff(GrpcFloats(resp), c["embedding"]), 1e-5) << i;
    HttpResult h = Http(rt.http_port(), "POST", "/v2/models/encoder/infer", RestEncoderBody(c));
    ASSERT_EQ(h.code, 200) << h.raw;
    EXPECT_LT(MaxDiff(JsonFloats(h.body["outputs"][0]["data"]), c["embedding"]), 1e-5) << i;
  }
}

// --idle-spin-us: the executions' thread waits busily after each execution, and the gRPC and
// REST threads after each piece of work; answers are the same, Stats counts the executions'
// spins and the requests they took, and the gRPC thread does spin.
TEST(RuntimeTest, AnIdleSpinKeepsTheAnswersAndIsCounted) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  if (CPU_COUNT(&allowed) < 2) GTEST_SKIP() << "a spin needs two CPUs; this test has one";
  auto rt = StartRuntime("encoder", "1", "serving", {"--idle-spin-us", "10000"});
  ASSERT_NE(rt, nullptr);
  auto stub = Stub(*rt);
  // REST's thread spins too, after each request it reads and answers.
  ExpectReferenceAnswers(*rt, 6);
  // Each request's execution is followed by a spin (the last one's begins after its reply);
  // most requests sent one after another within 10 ms are taken by one (not asserted: the VM
  // may stall a thread).
  v1::RuntimeStats stats;
  EXPECT_TRUE(kiln::testing::Eventually(
      [&] {
        stats = Stats(rt.get());
        return stats.idle_spins() >= 6;
      },
      absl::Seconds(10)))
      << stats.idle_spins();
  EXPECT_LE(stats.idle_spin_catches(), stats.idle_spins());
  EXPECT_EQ(rt->Log().find("--idle-spin-us 10000: not used"), std::string::npos) << rt->Log();
  // Each ServerLive, 12 ms apart, is followed by 10 ms of the gRPC thread polling: about 400 ms
  // of its CPU in 40 calls on an idle machine (without the spin, about 2 ms); an eighth is
  // asked for.
  const double grpc_cpu = kiln::testing::ThreadCpuMs(rt->pid(), "grpc-server");
  ASSERT_GE(grpc_cpu, 0) << "the runtime has no thread named grpc-server";
  for (int i = 0; i < 40; i++) {
    grpc::ClientContext ctx;
    inference::ServerLiveResponse live;
    ASSERT_TRUE(stub->ServerLive(&ctx, {}, &live).ok());
    absl::SleepFor(absl::Milliseconds(12));
  }
  const double grpc_cpu_after = kiln::testing::ThreadCpuMs(rt->pid(), "grpc-server");
  ASSERT_GE(grpc_cpu_after, 0);
  EXPECT_GE(grpc_cpu_after - grpc_cpu, 50);
}

// --model-cpus 1: the executions' thread runs alone on the last CPU the runtime may use, every
// other thread on the rest, and both protocols still get the reference outputs. (That REST's
// requests then go to the executions' thread is BatcherTest's.)
TEST(RuntimeTest, ModelCpusGiveTheModelACpuOfItsOwn) {
  const std::vector<int> usable = AllowedCpus();
  if (usable.size() < 2) {
    GTEST_SKIP() << "the model's CPU and the rest need two CPUs; this test has one";
  }
  const std::string model_cpu = FormatCpuList({usable.back()});
  const std::string other_cpus = FormatCpuList({usable.begin(), usable.end() - 1});
  auto rt = StartRuntime("encoder", "1", "serving", {"--model-cpus", "1", "--threads", "2"});
  ASSERT_NE(rt, nullptr);
  EXPECT_NE(rt->Log().find("the model runs alone on cpus " + model_cpu +
                           ", everything else on cpus " + other_cpus),
            std::string::npos)
      << rt->Log();
  auto state = rt->GetState();
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->model_cpus(), model_cpu);
  // One intra-op thread per model CPU: the two asked for would take turns on one.
  EXPECT_NE(rt->Log().find("--threads 2: capped at --model-cpus 1"), std::string::npos)
      << rt->Log();
  EXPECT_NE(rt->Log().find(", 1 intra-op threads"), std::string::npos) << rt->Log();
  ExpectReferenceAnswers(*rt, 3);
  std::map<std::string, std::set<std::string>> cpus_of;  // thread name -> its CPU lists
  for (const auto& t : kiln::testing::ThreadCpuLists(rt->pid())) cpus_of[t.name].insert(t.cpus);
  EXPECT_EQ(cpus_of["executions"], std::set<std::string>{model_cpu});
  for (const char* other : {"kiln-runtime", "grpc-server", "http-server", "batch-answers",
                            "batch-timeouts"}) {
    EXPECT_EQ(cpus_of[other], std::set<std::string>{other_cpus}) << other;
  }
}

TEST(RuntimeTest, BothProtocolsReturnTheReferenceOutputs) {
  auto rt = StartRuntime("encoder", "1");
  ASSERT_NE(rt, nullptr);
  auto stub = Stub(*rt);
  auto refs = References("1");
  for (size_t i = 0; i < 6; ++i) {
    const json& c = refs[i];
    for (bool raw : {false, true}) {
      grpc::ClientContext ctx;
      inference::ModelInferResponse resp;
      grpc::Status s = stub->ModelInfer(&ctx, GrpcEncoderRequest(c, raw), &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.model_version(), "1");
      EXPECT_EQ(resp.id(), "case");
      EXPECT_EQ(resp.raw_output_contents_size() > 0, raw);
      EXPECT_EQ(resp.outputs(0).name(), "embedding");
      EXPECT_EQ(resp.outputs(0).shape(1), 64);
      EXPECT_LT(MaxDiff(GrpcFloats(resp), c["embedding"]), 1e-5) << "case " << i << " raw " << raw;
    }
    HttpResult h = Http(rt->http_port(), "POST", "/v2/models/encoder/infer", RestEncoderBody(c));
    ASSERT_EQ(h.code, 200) << h.raw;
    EXPECT_EQ(h.body["id"], "rest-case");
    EXPECT_EQ(h.body["model_version"], "1");
    EXPECT_LT(MaxDiff(JsonFloats(h.body["outputs"][0]["data"]), c["embedding"]), 1e-5);
    HttpResult v = Http(rt->http_port(), "POST", "/v2/models/encoder/versions/1/infer",
                        RestEncoderBody(c));
    EXPECT_EQ(v.code, 200) << v.raw;
  }
}

TEST(RuntimeTest, APrestartedRuntimeLoadsItsModelOnDemand) {
  RuntimeProcess::Options o;
  o.prestart = true;
  auto started = RuntimeProcess::Start(o);
  ASSERT_TRUE(started.ok()) << started.status();
  auto& rt = *started;
  // Pre-started: LOADING, no model; nothing but Load (and Shutdown) does anything.
  auto st = rt->GetState();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state(), v1::LOADING);
  EXPECT_EQ(st->model_name(), "");
  {
    grpc::ClientContext ctx;
    v1::RuntimeState out;
    grpc::Status s = rt->control()->Promote(&ctx, v1::PromoteRequest(), &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(s.error_message().find("pre-started"), std::string::npos) << s.error_message();
  }
  // Bad arguments are refused naming the flag, and it stays pre-started.
  grpc::Status bad = rt->LoadArgs({"--model", "encoder"});
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.error_message().find("--model-repository"), std::string::npos)
      << bad.error_message();
  bad = rt->LoadArgs({"--model-repository", kRepo, "--model", "encoder", "--grpc-port", "99999",
                      "--control-socket", rt->control_socket()});
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.error_message().find("--grpc-port"), std::string::npos) << bad.error_message();
  bad = rt->LoadArgs({"--model-repository", kRepo, "--model", "encoder", "--no-such-flag"});
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.error_message().find("--no-such-flag"), std::string::npos) << bad.error_message();
  bad = rt->LoadArgs({"--model-repository", kRepo, "--model", "encoder"});
  EXPECT_NE(bad.error_message().find("--control-socket"), std::string::npos) << bad.error_message();
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--cpu-set", "3-1"}, {"--cpu-set", "x"}, {"--cpu-set", "99999"},
           {"--memory-node", "-2"}, {"--memory-node", "1024"}, {"--replica-id", "r 1"},
           {"--http-threads", "0"}, {"--idle-spin-us", "10001"}, {"--model-cpus", "-1"}}) {
    bad = rt->LoadArgs({"--model-repository", kRepo, "--model", "encoder", "--control-socket",
                        rt->control_socket(), flag, value});
    EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << flag << " " << value;
    EXPECT_NE(bad.error_message().find(flag), std::string::npos) << bad.error_message();
  }
  // A model the repository does not have is refused before the answer, as a cold start would
  // exit on it.
  bad = rt->LoadArgs({"--model-repository", kRepo, "--model", "nosuch", "--control-socket",
                      rt->control_socket()});
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.error_message().find("nosuch"), std::string::npos) << bad.error_message();
  EXPECT_EQ(rt->GetState()->model_name(), "");

  // A good Load: it loads, serves the reference outputs and is a normal runtime from then on.
  // Pinned to one CPU this test may use.
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  int cpu = 0;
  while (cpu < CPU_SETSIZE - 1 && !CPU_ISSET(cpu, &allowed)) ++cpu;
  grpc::Status loaded =
      rt->Load(kRepo, "encoder", "serving",
               {"--version", "1", "--cpu-set", std::to_string(cpu), "--replica-id", "enc-7.0",
                "--http-threads", "3", "--idle-spin-us", "200", "--model-cpus", "1"});
  ASSERT_TRUE(loaded.ok()) << loaded.error_message() << rt->Log();
  st = rt->GetState();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state(), v1::SERVING);
  EXPECT_EQ(st->model_name(), "encoder");
  EXPECT_EQ(st->replica_id(), "enc-7.0");
  EXPECT_EQ(st->model_cpus(), "");  // --model-cpus 1 on one CPU: not split
  EXPECT_GT(st->load_time_micros(), 0);
  auto stub = Stub(*rt);
  const json refs = References("1");
  const json& c = refs[0];
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  grpc::Status s = stub->ModelInfer(&ctx, GrpcEncoderRequest(c, true), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_LT(MaxDiff(GrpcFloats(resp), c["embedding"]), 1e-5);
  // REST on the three HTTP threads the Load asked for: concurrent requests, each its own answer.
  std::vector<std::future<HttpResult>> rest;
  for (int i = 0; i < 6; ++i) {
    rest.push_back(std::async(std::launch::async, [&] {
      return Http(rt->http_port(), "POST", "/v2/models/encoder/infer", RestEncoderBody(c));
    }));
  }
  for (auto& f : rest) {
    HttpResult h = f.get();
    ASSERT_EQ(h.code, 200) << h.raw;
    EXPECT_LT(MaxDiff(JsonFloats(h.body["outputs"][0]["data"]), c["embedding"]), 1e-5);
  }
  {
    // The Load's --idle-spin-us was read, and not used: pinned to one CPU, a spinning thread
    // would hold off the one that reads requests.
    grpc::ClientContext sctx;
    v1::RuntimeStats stats;
    ASSERT_TRUE(rt->control()->Stats(&sctx, {}, &stats).ok());
    EXPECT_EQ(stats.idle_spins(), 0u);
    EXPECT_NE(rt->Log().find("--idle-spin-us 200: not used, this runtime may run on 1 CPU"),
              std::string::npos)
        << rt->Log();
    // Nor --model-cpus: with one CPU, nothing would be left for the rest.
    EXPECT_NE(rt->Log().find("--model-cpus 1: not used, this runtime may run on 1 CPU(s) (" +
                             std::to_string(cpu) + ")"),
              std::string::npos)
        << rt->Log();
  }
  // It pinned every thread to the CPUs the Load named.
  const auto threads = kiln::testing::ThreadCpuLists(rt->pid());
  for (const auto& t : threads) EXPECT_EQ(t.cpus, std::to_string(cpu)) << t.name;
  EXPECT_GT(threads.size(), 1u);
  grpc::Status again = rt->LoadArgs({"--model", "x"});
  EXPECT_EQ(again.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST(RuntimeTest, APrestartedRuntimeStopsCleanlyWithoutALoad) {
  RuntimeProcess::Options o;
  o.prestart = true;
  o.extra_args = {"--device", "cpu"};
  auto rt = RuntimeProcess::Start(o);
  ASSERT_TRUE(rt.ok()) << rt.status();
  // Made ready for one device, it takes no model for another.
  grpc::Status other = (*rt)->LoadArgs({"--model-repository", kRepo, "--model", "encoder",
                                        "--device", "cuda:0", "--control-socket",
                                        (*rt)->control_socket()});
  EXPECT_EQ(other.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(other.error_message().find("--device: this runtime was pre-started for cpu"),
            std::string::npos)
      << other.error_message();
  (*rt)->Signal(SIGTERM);
  auto status = (*rt)->WaitExit(absl::Seconds(30));
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << (*rt)->Log();
  // --prestart needs the socket its Load arrives on.
  auto r = kiln::testing::RunToCompletion({KILN_RUNTIME_BIN, "--prestart"}, absl::Seconds(30));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--prestart: needs --control-socket"), std::string::npos) << r.output;
  r = kiln::testing::RunToCompletion({KILN_RUNTIME_BIN, "--prestart", "--control-socket",
                                      "/tmp/kiln-unused.sock", "--model", "encoder"},
                                     absl::Seconds(30));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--model: not with --prestart"), std::string::npos) << r.output;
  // Where it pins itself comes with the Load too.
  r = kiln::testing::RunToCompletion({KILN_RUNTIME_BIN, "--prestart", "--control-socket",
                                      "/tmp/kiln-unused.sock", "--cpu-set", "0"},
                                     absl::Seconds(30));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--cpu-set: not with --prestart"), std::string::npos) << r.output;
  r = kiln::testing::RunToCompletion({KILN_RUNTIME_BIN, "--prestart", "--control-socket",
                                      "/tmp/kiln-unused.sock", "--http-threads", "2"},
                                     absl::Seconds(30));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--http-threads: not with --prestart"), std::string::npos) << r.output;
}

TEST(RuntimeTest, HealthAndMetadataOnBothProtocols) {
  auto rt = StartRuntime("encoder");
  ASSERT_NE(rt, nullptr);
  auto stub = Stub(*rt);
  {
    grpc::ClientContext ctx;
    inference::ServerLiveResponse r;
    ASSERT_TRUE(stub->ServerLive(&ctx, {}, &r).ok());
    EXPECT_TRUE(r.live());
  }
  {
    grpc::ClientContext ctx;
    inference::ModelMetadataRequest req;
    req.set_name("encoder");
    inference::ModelMetadataResponse r;
    ASSERT_TRUE(stub->ModelMetadata(&ctx, req, &r).ok());
    EXPECT_EQ(r.versions(0), "2");  // the highest version without --version
    EXPECT_EQ(r.inputs(0).name(), "input_ids");
    EXPECT_EQ(r.inputs(0).shape(0), -1);
    EXPECT_EQ(r.outputs(0).shape(1), 64);
  }
  {
    grpc::ClientContext ctx;
    inference::ServerMetadataResponse r;
    ASSERT_TRUE(stub->ServerMetadata(&ctx, {}, &r).ok());
    EXPECT_EQ(r.name(), "kiln");
  }
  EXPECT_EQ(Http(rt->http_port(), "GET", "/v2/health/live").code, 200);
  EXPECT_EQ(Http(rt->http_port(), "GET", "/v2/health/ready").code, 200);
  EXPECT_EQ(Http(rt->http_port(), "GET", "/v2").body["name"], "kiln");
  auto meta = Http(rt->http_port(), "GET", "/v2/models/encoder");
  EXPECT_EQ(meta.code, 200);
  EXPECT_EQ(meta.body["versions"][0], "2");
  EXPECT_EQ(meta.body["outputs"][0]["datatype"], "FP32");
  EXPECT_EQ(Http(rt->http_port(), "GET", "/v2/models/encoder/versions/2/ready").code, 200);
  EXPECT_EQ(Http(rt->http_port(), "GET", "/v2/models/encoder/versions/1/ready").code, 404);
  auto state = rt->GetState();
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->state(), v1::SERVING);
  EXPECT_EQ(state->model_version(), "2");
  EXPECT_EQ(state->device(), "cpu");
  EXPECT_GT(state->load_time_micros(), 0);
  EXPECT_NE(rt->Log().find("grpc_port=" + std::to_string(rt->grpc_port())), std::string::npos);
  // Both gRPC servers (inference, control) are on the callback API: no synchronous service
  // brings gRPC's sync-server threads, which would poll the inference port's reads and hand
  // every request to another thread.
  for (const auto& task : std::filesystem::directory_iterator(
           "/proc/" + std::to_string(rt->pid()) + "/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    std::getline(comm, name);
    EXPECT_EQ(name.rfind("grpcpp_sync", 0), std::string::npos) << "thread " << task.path();
  }
}

TEST(RuntimeTest, SixtyFourConcurrentMixedRequestsEachGetTheirOwnAnswer) {
  auto rt = StartRuntime("encoder", "2");
  ASSERT_NE(rt, nullptr);
  auto refs = References("2");
  ASSERT_EQ(refs.size(), 64u);
  std::atomic<int> ready{0};
  std::atomic<int> correct{0};
  std::vector<std::string> failures(64);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < 64; ++i) {
    threads.emplace_back([&, i]() {
      const json& c = refs[i];
      ready++;
      // Start together (bounded spin).
      for (int k = 0; k < 5000 && ready.load() < 64; ++k) absl::SleepFor(absl::Microseconds(200));
      std::vector<float> got;
      if (i % 2 == 0) {
        auto stub = Stub(*rt);
        grpc::ClientContext ctx;
        inference::ModelInferResponse resp;
        grpc::Status s = stub->ModelInfer(&ctx, GrpcEncoderRequest(c, i % 4 == 0), &resp);
        if (!s.ok()) {
          failures[i] = s.error_message();
          return;
        }
        got = GrpcFloats(resp);
      } else {
        HttpResult h = Http(rt->http_port(), "POST", "/v2/models/encoder/infer", RestEncoderBody(c));
        if (h.code != 200) {
          failures[i] = h.raw;
          return;
        }
        got = JsonFloats(h.body["outputs"][0]["data"]);
      }
      double diff = MaxDiff(got, c["embedding"]);
      if (diff < 1e-5) {
        correct++;
      } else {
        failures[i] = "max diff " + std::to_string(diff);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < 64; ++i) EXPECT_EQ(failures[i], "") << "request " << i;
  EXPECT_EQ(correct.load(), 64);
  // A request leaves the in-flight count just after its reply is handed over: poll (bounded).
  v1::RuntimeStats stats;
  for (int i = 0; i < 1000; ++i) {
    grpc::ClientContext ctx;
    ASSERT_TRUE(rt->control()->Stats(&ctx, {}, &stats).ok());
    if (stats.in_flight() == 0) break;
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ(stats.in_flight(), 0);
  EXPECT_GE(stats.requests(), 64u);
  EXPECT_EQ(stats.errors(), 0u);
  // Concurrent requests of equal shape were combined: fewer executions than requests.
  EXPECT_LT(stats.batches(), stats.requests());
  // Each execution's model time is recorded once, and it is part of its requests' latency.
  // (A batch whose inputs could not be joined counts as a batch but never runs.)
  EXPECT_GT(stats.compute_micros().count(), 0u);
  EXPECT_LE(stats.compute_micros().count(), stats.batches());
  EXPECT_GT(stats.compute_micros().sum(), 0);
  EXPECT_LE(stats.compute_micros().sum(), stats.latency_micros().sum());
  EXPECT_GT(stats.compute_p50_micros(), 0);
}

grpc::Status Infer(inference::GRPCInferenceService::Stub* stub,
                   const inference::ModelInferRequest& req,
                   inference::ModelInferResponse* resp = nullptr) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  inference::ModelInferResponse local;
  return stub->ModelInfer(&ctx, req, resp ? resp : &local);
}

TEST(RuntimeTest, BadRequestsGetClearErrorsAndTheServerKeepsServing) {
  auto rt = StartRuntime("encoder", "", "serving", {"--max-request-bytes", "1Mi"});
  ASSERT_NE(rt, nullptr);
  auto stub = Stub(*rt);
  json c = References("2")[0];
  auto good = GrpcEncoderRequest(c, true);

  struct Case {
    std::string what;
    inference::ModelInferRequest req;
    grpc::StatusCode code;
    std::string expect;
  };
  std::vector<Case> cases;
  auto r = good;
  r.set_model_name("nope");
  cases.push_back({"unknown model", r, grpc::StatusCode::NOT_FOUND, "unknown model 'nope'"});
  r = good;
  r.set_model_version("7");
  cases.push_back({"unknown version", r, grpc::StatusCode::NOT_FOUND, "unknown version '7'"});
  r = good;
  r.mutable_inputs(0)->set_name("token_ids");
  cases.push_back({"wrong input name", r, grpc::StatusCode::INVALID_ARGUMENT,
                   "unknown input 'token_ids' (expected: input_ids, attention_mask)"});
  r = good;
  r.mutable_inputs(0)->set_datatype("INT32");
  cases.push_back({"wrong datatype", r, grpc::StatusCode::INVALID_ARGUMENT, "expected"});
  r = good;
  r.mutable_inputs(0)->clear_shape();
  r.mutable_inputs(0)->add_shape(static_cast<int64_t>(c["input_ids"][0].size()));
  cases.push_back({"wrong shape", r, grpc::StatusCode::INVALID_ARGUMENT, "expected"});
  r = good;
  r.mutable_raw_input_contents(1)->resize(8);
  cases.push_back({"wrong byte size", r, grpc::StatusCode::INVALID_ARGUMENT, "bytes"});
  r = good;
  r.mutable_inputs()->RemoveLast();
  r.mutable_raw_input_contents()->RemoveLast();
  cases.push_back({"missing input", r, grpc::StatusCode::INVALID_ARGUMENT,
                   "missing input 'attention_mask'"});
  r = good;
  r.mutable_inputs(0)->set_shape(0, 40);
  r.mutable_inputs(1)->set_shape(0, 40);
  r.mutable_raw_input_contents(0)->assign(40 * c["input_ids"][0].size() * 8, '\1');
  r.mutable_raw_input_contents(1)->assign(40 * c["input_ids"][0].size() * 8, '\1');
  cases.push_back({"batch over max", r, grpc::StatusCode::INVALID_ARGUMENT, "max_batch_size"});
  r = good;
  r.mutable_inputs(0)->set_shape(1, 100000);
  r.mutable_inputs(1)->set_shape(1, 100000);
  r.mutable_raw_input_contents(0)->assign(800000, '\0');
  r.mutable_raw_input_contents(1)->assign(800000, '\0');
  cases.push_back({"payload over the limit", r, grpc::StatusCode::RESOURCE_EXHAUSTED,
                   "is over the limit of"});
  for (const auto& k : cases) {
    grpc::Status s = Infer(stub.get(), k.req);
    EXPECT_EQ(s.error_code(), k.code) << k.what << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(k.expect), std::string::npos) << k.what << ": " << s.error_message();
  }
  // Bytes that are not the method's request, and a method the runtime does not serve.
  auto raw_call = [&](const std::string& method, const std::string& bytes) {
    return kiln::testing::RawUnaryCall(rt->grpc_address(), method, bytes);
  };
  for (const char* method : {"ModelInfer", "ModelMetadata", "ModelReady"}) {
    grpc::Status s = raw_call(std::string("/inference.GRPCInferenceService/") + method,
                              std::string("\xff\xff\xff\x0f", 4));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_NE(s.error_message().find("is not an inference."), std::string::npos)
        << method << ": " << s.error_message();
  }
  grpc::Status unknown = raw_call("/inference.GRPCInferenceService/RepositoryIndex", "");
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(unknown.error_message().find("unknown method"), std::string::npos)
      << unknown.error_message();

  int port = rt->http_port();
  auto rest = [&](const std::string& path, const std::string& body) {
    return Http(port, "POST", path, body);
  };
  std::string body = RestEncoderBody(c);
  EXPECT_EQ(rest("/v2/models/nope/infer", body).code, 404);
  EXPECT_EQ(rest("/v2/models/encoder/versions/7/infer", body).code, 404);
  auto bad_json = rest("/v2/models/encoder/infer", "{not json");
  EXPECT_EQ(bad_json.code, 400);
  EXPECT_NE(bad_json.body["error"].get<std::string>().find("not valid JSON"), std::string::npos);
  json wrong = json::parse(body);
  wrong["inputs"][0]["datatype"] = "FP32";
  auto wrong_type = rest("/v2/models/encoder/infer", wrong.dump());
  EXPECT_EQ(wrong_type.code, 400);
  EXPECT_NE(wrong_type.body["error"].get<std::string>().find("expected datatype INT64"),
            std::string::npos) << wrong_type.raw;
  wrong = json::parse(body);
  wrong["inputs"][1]["shape"] = {1, 2};
  EXPECT_EQ(rest("/v2/models/encoder/infer", wrong.dump()).code, 400);
  std::string big(2 << 20, ' ');
  auto too_big = rest("/v2/models/encoder/infer", "{" + big + "}");
  EXPECT_EQ(too_big.code, 413) << too_big.raw;
  EXPECT_EQ(Http(port, "GET", "/v2/models/encoder/infer").code, 405);
  EXPECT_EQ(Http(port, "GET", "/v3/whatever").code, 404);

  // Still serving, and every request above was answered.
  inference::ModelInferResponse resp;
  ASSERT_TRUE(Infer(stub.get(), good, &resp).ok());
  EXPECT_LT(MaxDiff(GrpcFloats(resp), c["embedding"]), 1e-5);
  EXPECT_EQ(rest("/v2/models/encoder/infer", body).code, 200);
  auto state = rt->GetState();
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->state(), v1::SERVING);
}

using kiln::testing::SlowRequest;

v1::RuntimeStats Stats(RuntimeProcess* rt) {
  grpc::ClientContext ctx;
  v1::RuntimeStats s;
  EXPECT_TRUE(rt->control()->Stats(&ctx, {}, &s).ok());
  return s;
}

// A request refused before decoding still counts, as a request and as an error, in Stats (an
// agent's error rate and a canary's analysis read them); request parameters come back with the
// answer over both protocols; the control socket is the owner's alone.
TEST(RuntimeTest, RefusedRequestsCountAndParametersComeBack) {
  auto rt = StartRuntime("encoder");
  ASSERT_NE(rt, nullptr);
  struct stat st;
  ASSERT_EQ(::stat(rt->control_socket().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto stub = Stub(*rt);
  json c = References("2")[0];
  const v1::RuntimeStats before = Stats(rt.get());
  auto short_raw = GrpcEncoderRequest(c, true);
  short_raw.mutable_raw_input_contents(0)->resize(3);  // not a whole INT64 tensor
  EXPECT_EQ(Infer(stub.get(), short_raw).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Http(rt->http_port(), "POST", "/v2/models/encoder/infer", "{not json").code, 400);
  const v1::RuntimeStats after = Stats(rt.get());
  EXPECT_EQ(after.requests() - before.requests(), 2u);
  EXPECT_EQ(after.errors() - before.errors(), 2u);

  auto with_params = GrpcEncoderRequest(c, true);
  (*with_params.mutable_parameters())["custom"].set_string_param("x");
  inference::ModelInferResponse resp;
  ASSERT_TRUE(Infer(stub.get(), with_params, &resp).ok());
  ASSERT_TRUE(resp.parameters().count("custom"));
  EXPECT_EQ(resp.parameters().at("custom").string_param(), "x");
  json body = json::parse(RestEncoderBody(c));
  body["parameters"] = {{"custom", "x"}, {"n", 3}};
  auto rest = Http(rt->http_port(), "POST", "/v2/models/encoder/infer", body.dump());
  ASSERT_EQ(rest.code, 200) << rest.raw;
  EXPECT_EQ(rest.body["parameters"]["custom"], "x") << rest.raw;
  EXPECT_EQ(rest.body["parameters"]["n"], 3) << rest.raw;
}

// Bounded poll (30 s: a loaded CI machine may take seconds to get a call going) until the
// runtime has `in_flight` requests, `queued` of them queued.
bool WaitExecuting(RuntimeProcess* rt, int64_t in_flight, int64_t queued) {
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (absl::Now() < until) {
    auto s = Stats(rt);
    if (s.in_flight() == in_flight && s.queue_depth() == queued) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

constexpr int64_t kLongWork = 6000;  // about a second of CPU on the slow model

TEST(RuntimeTest, WarmRefusesInferencePromoteServes) {
  auto rt = StartRuntime("encoder", "", "warm");
  ASSERT_NE(rt, nullptr);
  auto state = rt->GetState();
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->state(), v1::WARM);
  auto stub = Stub(*rt);
  {
    grpc::ClientContext ctx;
    inference::ServerLiveResponse r;
    ASSERT_TRUE(stub->ServerLive(&ctx, {}, &r).ok());
    EXPECT_TRUE(r.live());
  }
  {
    grpc::ClientContext ctx;
    inference::ModelReadyRequest req;
    req.set_name("encoder");
    inference::ModelReadyResponse r;
    ASSERT_TRUE(stub->ModelReady(&ctx, req, &r).ok());
    EXPECT_FALSE(r.ready());
  }
  EXPECT_EQ(Http(rt->http_port(), "GET", "/v2/health/ready").code, 400);  // the protocol's 4xx
  EXPECT_EQ(Http(rt->http_port(), "GET", "/v2/models/encoder/ready").code, 400);
  json c = References("2")[3];
  EXPECT_EQ(Infer(stub.get(), GrpcEncoderRequest(c, true)).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Http(rt->http_port(), "POST", "/v2/models/encoder/infer", RestEncoderBody(c)).code, 503);

  grpc::ClientContext ctx;
  v1::RuntimeState promoted;
  ASSERT_TRUE(rt->control()->Promote(&ctx, {}, &promoted).ok());
  EXPECT_EQ(promoted.state(), v1::SERVING);
  inference::ModelInferResponse resp;
  ASSERT_TRUE(Infer(stub.get(), GrpcEncoderRequest(c, true), &resp).ok());
  EXPECT_LT(MaxDiff(GrpcFloats(resp), c["embedding"]), 1e-5);

  grpc::ClientContext dctx;
  v1::RuntimeState demoted;
  ASSERT_TRUE(rt->control()->Demote(&dctx, {}, &demoted).ok());
  EXPECT_EQ(demoted.state(), v1::WARM);
  EXPECT_EQ(Infer(stub.get(), GrpcEncoderRequest(c, true)).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST(RuntimeTest, APowerParkedReplicaWarmsUpOnPromoteBeforeItServes) {
  auto rt = StartRuntime("encoder", "", "warm", {"--warmup-on-promote"});
  ASSERT_NE(rt, nullptr);
  grpc::ClientContext ctx;
  v1::RuntimeState promoted;
  ASSERT_TRUE(rt->control()->Promote(&ctx, {}, &promoted).ok());
  EXPECT_EQ(promoted.state(), v1::SERVING);
  EXPECT_NE(rt->Log().find("warm-up on promote:"), std::string::npos) << rt->Log();
  auto stub = Stub(*rt);
  json c = References("2")[5];
  inference::ModelInferResponse resp;
  ASSERT_TRUE(Infer(stub.get(), GrpcEncoderRequest(c, true), &resp).ok());
  EXPECT_LT(MaxDiff(GrpcFloats(resp), c["embedding"]), 1e-5);
}

TEST(RuntimeTest, DrainFinishesInFlightWorkAndRefusesNew) {
  auto rt = StartRuntime("slow");
  ASSERT_NE(rt, nullptr);
  auto stub = Stub(*rt);
  auto long_call = std::async(std::launch::async, [&]() {
    inference::ModelInferResponse resp;
    grpc::Status s = Infer(stub.get(), SlowRequest(kLongWork), &resp);
    return std::make_pair(s, resp);
  });
  ASSERT_TRUE(WaitExecuting(rt.get(), 1, 0));
  grpc::ClientContext ctx;
  v1::DrainRequest dreq;
  dreq.set_deadline_millis(60000);
  v1::DrainResponse dresp;
  ASSERT_TRUE(rt->control()->Drain(&ctx, dreq, &dresp).ok());
  EXPECT_TRUE(dresp.drained());
  EXPECT_EQ(dresp.in_flight(), 0);
  EXPECT_EQ(dresp.state().state(), v1::DRAINING);
  auto [status, resp] = long_call.get();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(resp.outputs(0).contents().fp32_contents(0), 3.0f);
  EXPECT_EQ(Infer(stub.get(), SlowRequest(1)).error_code(), grpc::StatusCode::UNAVAILABLE);

  grpc::ClientContext sctx;
  v1::ShutdownResponse sresp;
  ASSERT_TRUE(rt->control()->Shutdown(&sctx, {}, &sresp).ok());
  auto exit = rt->WaitExit(absl::Seconds(30));
  ASSERT_TRUE(exit.ok());
  EXPECT_TRUE(WIFEXITED(*exit) && WEXITSTATUS(*exit) == 0) << rt->Log();
}

// A client that keeps its connection alive with pings every 1.5 s (as the node's router does,
// every 2 s) is not cut off during a long inference, which sends nothing back meanwhile: by
// gRPC's default server policy the third such ping ends the connection, and the call.
TEST(RuntimeTest, AKeepaliveClientKeepsALongCall) {
  auto rt = StartRuntime("slow");
  ASSERT_NE(rt, nullptr);
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 1500);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  auto stub = inference::GRPCInferenceService::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(rt->grpc_port()), grpc::InsecureChannelCredentials(), args));
  inference::ModelInferResponse resp;
  // About 8 s of CPU: five or more pings while the model runs.
  grpc::Status s = Infer(stub.get(), SlowRequest(8 * kLongWork), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.outputs(0).contents().fp32_contents(0), 3.0f);
}

TEST(RuntimeTest, SigtermDrainsThenExitsCleanly) {
  auto rt = StartRuntime("slow");
  ASSERT_NE(rt, nullptr);
  auto stub = Stub(*rt);
  auto long_call = std::async(std::launch::async,
                              [&]() { return Infer(stub.get(), SlowRequest(kLongWork)); });
  ASSERT_TRUE(WaitExecuting(rt.get(), 1, 0));
  rt->Signal(SIGTERM);
  EXPECT_TRUE(long_call.get().ok());
  auto exit = rt->WaitExit(absl::Seconds(30));
  ASSERT_TRUE(exit.ok());
  EXPECT_TRUE(WIFEXITED(*exit) && WEXITSTATUS(*exit) == 0) << rt->Log();
  EXPECT_NE(rt->Log().find("DRAINING -> STOPPED"), std::string::npos);
}

// SIGTERM while an agent's Drain waits: the queued work still gets the drain deadline (it is
// served), rather than being failed because the runtime was already DRAINING.
TEST(RuntimeTest, SigtermDuringADrainStillDrains) {
  auto rt = StartRuntime("slow");
  ASSERT_NE(rt, nullptr);
  auto stub = Stub(*rt);
  auto long_call = std::async(std::launch::async,
                              [&]() { return Infer(stub.get(), SlowRequest(kLongWork)); });
  ASSERT_TRUE(WaitExecuting(rt.get(), 1, 0));
  auto queued = std::async(std::launch::async, [&]() { return Infer(stub.get(), SlowRequest(1)); });
  ASSERT_TRUE(WaitExecuting(rt.get(), 2, 1));
  auto drain = std::async(std::launch::async, [&]() {
    grpc::ClientContext ctx;
    v1::DrainRequest dreq;
    dreq.set_deadline_millis(60000);
    v1::DrainResponse dresp;
    return rt->control()->Drain(&ctx, dreq, &dresp);
  });
  for (int i = 0; i < 500; ++i) {  // bounded: until the Drain has begun
    auto st = rt->GetState();
    if (st.ok() && st->state() == v1::DRAINING) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  rt->Signal(SIGTERM);
  EXPECT_TRUE(long_call.get().ok());
  grpc::Status q = queued.get();
  EXPECT_TRUE(q.ok()) << q.error_message();
  (void)drain.get();  // ends with the process, either way
  auto exit = rt->WaitExit(absl::Seconds(30));
  ASSERT_TRUE(exit.ok());
  EXPECT_TRUE(WIFEXITED(*exit) && WEXITSTATUS(*exit) == 0) << rt->Log();
}

TEST(RuntimeTest, FullQueueIsResourceExhaustedAndTimeoutsExpire) {
  auto rt = StartRuntime("slow");  // max_queue_size: 4
  ASSERT_NE(rt, nullptr);
  auto stub = Stub(*rt);
  auto long_call = std::async(std::launch::async,
                              [&]() { return Infer(stub.get(), SlowRequest(kLongWork)); });
  ASSERT_TRUE(WaitExecuting(rt.get(), 1, 0));
  // One queued request with a 1 ms timeout: it expires behind the long one, and is answered
  // at its deadline, while the long one still runs (not when it ends).
  auto timed = std::async(std::launch::async,
                          [&]() { return Infer(stub.get(), SlowRequest(1, 1000)); });
  grpc::Status t = timed.get();
  EXPECT_EQ(t.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << t.error_message();
  EXPECT_EQ(long_call.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the timed-out request was answered only after the execution ahead of it";
  std::vector<std::future<grpc::Status>> queued;
  for (int i = 0; i < 4; ++i) {
    queued.push_back(std::async(std::launch::async, [&]() { return Infer(stub.get(), SlowRequest(1)); }));
  }
  ASSERT_TRUE(WaitExecuting(rt.get(), 5, 4));
  grpc::Status full = Infer(stub.get(), SlowRequest(1));
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << full.error_message();
  json body = {{"inputs",
                {{{"name", "x"}, {"datatype", "FP32"}, {"shape", {1, 1}}, {"data", {1.0}}},
                 {{"name", "work"}, {"datatype", "INT64"}, {"shape", {1, 1}}, {"data", {1}}}}}};
  EXPECT_EQ(Http(rt->http_port(), "POST", "/v2/models/slow/infer", body.dump()).code, 429);

  EXPECT_TRUE(long_call.get().ok());
  for (auto& q : queued) EXPECT_TRUE(q.get().ok());
  auto stats = Stats(rt.get());
  EXPECT_EQ(stats.rejected_queue_full(), 2u);
  EXPECT_EQ(stats.timed_out(), 1u);
  EXPECT_EQ(stats.idle_spins(), 0u);  // no --idle-spin-us: the executions' thread sleeps
}

// A gRPC caller's deadline bounds its request's time in the queue, as a `timeout` parameter
// does: behind a long execution, the request leaves the queue at the deadline (counted as
// timed out) instead of running afterwards for a caller that gave up.
// A short request on the slow model with a gRPC deadline `deadline` away, sent while a long one
// executes (which must succeed): its status.
grpc::Status InferBehindALongOne(RuntimeProcess* rt, std::chrono::milliseconds deadline) {
  auto stub = Stub(*rt);
  auto long_call = std::async(std::launch::async,
                              [&]() { return Infer(stub.get(), SlowRequest(kLongWork)); });
  EXPECT_TRUE(WaitExecuting(rt, 1, 0));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + deadline);
  inference::ModelInferResponse resp;
  grpc::Status s = stub->ModelInfer(&ctx, SlowRequest(1), &resp);
  EXPECT_TRUE(long_call.get().ok());
  return s;
}

TEST(RuntimeTest, AGrpcDeadlineBoundsTheQueueWait) {
  auto rt = StartRuntime("slow");
  ASSERT_NE(rt, nullptr);
  const uint64_t batches_before = Stats(rt.get()).batches();
  grpc::Status s = InferBehindALongOne(rt.get(), std::chrono::milliseconds(100));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  // Bounded poll: the server's own expiry is counted when the reaper answers it.
  v1::RuntimeStats stats;
  for (int i = 0; i < 300; ++i) {
    stats = Stats(rt.get());
    if (stats.timed_out() == 1u) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(stats.timed_out(), 1u);
  EXPECT_EQ(stats.batches(), batches_before + 1) << "the abandoned request ran after the long one";
}

// A gRPC caller's deadline only ever shortens a request's time in the queue: with a distant
// deadline, the model's default_timeout_microseconds still ends the wait.
TEST(RuntimeTest, AGrpcDeadlineKeepsTheModelsDefaultTimeout) {
  auto dir = std::filesystem::temp_directory_path() / ("kiln_deftimeout_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "slow");
  std::filesystem::copy(kRepo + "/slow", dir / "slow", std::filesystem::copy_options::recursive);
  {
    std::ofstream cfg(dir / "slow/config.yaml", std::ios::app);
    cfg << "  default_timeout_microseconds: 100000\n";  // under dynamic_batching, the last key
  }
  auto rt = StartRuntime("slow", "", "serving", {}, dir.string());
  ASSERT_NE(rt, nullptr);
  grpc::Status s = InferBehindALongOne(rt.get(), std::chrono::seconds(60));
  // The 60 s deadline cannot have passed: the server ended the wait at the model's 100 ms.
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_NE(s.error_message().find("queue"), std::string::npos) << s.error_message();
  EXPECT_EQ(Stats(rt.get()).timed_out(), 1u);
  rt.reset();
  std::filesystem::remove_all(dir);
}

// The gRPC port's one thread never runs the model, even an idle one without batching: it goes
// on answering (here ServerLive on the same connection) while a long request runs.
TEST(RuntimeTest, TheGrpcPortAnswersWhileTheModelRuns) {
  auto dir = std::filesystem::temp_directory_path() / ("kiln_grpcfree_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "slow");
  std::filesystem::copy(kRepo + "/slow", dir / "slow", std::filesystem::copy_options::recursive);
  {
    std::ofstream cfg(dir / "slow/config.yaml", std::ios::trunc);
    cfg << "name: slow\nbackend: torchscript\nmax_batch_size: 4\ninput:\n"
           "  - {name: x, datatype: FP32, dims: [1]}\n"
           "  - {name: work, datatype: INT64, dims: [1]}\n"
           "output:\n  - {name: y, datatype: FP32, dims: [1]}\n"
           // One intra-op thread: a model the batcher would otherwise run on its caller's
           // thread when idle.
           "instance: {threads: 1}\n";
  }
  auto rt = StartRuntime("slow", "", "serving", {}, dir.string());
  ASSERT_NE(rt, nullptr);
  auto stub = Stub(*rt);
  grpc::ClientContext long_ctx;
  long_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto long_req = SlowRequest(3 * kLongWork);
  inference::ModelInferResponse long_resp;
  std::atomic<bool> long_done{false};
  grpc::Status long_status;
  stub->async()->ModelInfer(&long_ctx, &long_req, &long_resp, [&](grpc::Status st) {
    long_status = st;
    long_done = true;
  });
  ASSERT_TRUE(kiln::testing::Eventually([&] { return Stats(rt.get()).in_flight() >= 1; },
                                        absl::Seconds(30)));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  inference::ServerLiveResponse live;
  ASSERT_TRUE(stub->ServerLive(&ctx, {}, &live).ok());
  EXPECT_TRUE(live.live());
  // Still running when ServerLive was answered (the answer did not wait for the model).
  EXPECT_GE(Stats(rt.get()).in_flight(), 1) << "ServerLive waited for the model";
  ASSERT_TRUE(kiln::testing::Eventually([&] { return long_done.load(); }, absl::Seconds(60)));
  EXPECT_TRUE(long_status.ok()) << long_status.error_message();
  rt.reset();
  std::filesystem::remove_all(dir);
}

TEST(RuntimeTest, RestTimeoutIs504) {
  auto rt = StartRuntime("slow");
  ASSERT_NE(rt, nullptr);
  auto stub = Stub(*rt);
  auto long_call = std::async(std::launch::async,
                              [&]() { return Infer(stub.get(), SlowRequest(kLongWork)); });
  ASSERT_TRUE(WaitExecuting(rt.get(), 1, 0));
  json body = {{"parameters", {{"timeout", 1000}}},
               {"inputs",
                {{{"name", "x"}, {"datatype", "FP32"}, {"shape", {1, 1}}, {"data", {1.0}}},
                 {{"name", "work"}, {"datatype", "INT64"}, {"shape", {1, 1}}, {"data", {1}}}}}};
  auto r = Http(rt->http_port(), "POST", "/v2/models/slow/infer", body.dump());
  EXPECT_EQ(r.code, 504) << r.raw;
  EXPECT_TRUE(long_call.get().ok());
}

TEST(RuntimeTest, ResponseCacheHitsOnRepeatedInputs) {
  auto rt = StartRuntime("addsub");
  ASSERT_NE(rt, nullptr);
  json body = {{"inputs",
                {{{"name", "INPUT0"}, {"datatype", "FP32"}, {"shape", {1, 4}}, {"data", {1, 2, 3, 4}}},
                 {{"name", "INPUT1"}, {"datatype", "FP32"}, {"shape", {1, 4}}, {"data", {1, 1, 1, 1}}}}},
               {"outputs", {{{"name", "OUTPUT1"}}}}};
  for (int i = 0; i < 3; ++i) {
    auto r = Http(rt->http_port(), "POST", "/v2/models/addsub/infer", body.dump());
    ASSERT_EQ(r.code, 200) << r.raw;
    ASSERT_EQ(r.body["outputs"].size(), 1u);
    EXPECT_EQ(r.body["outputs"][0]["name"], "OUTPUT1");
    EXPECT_EQ(r.body["outputs"][0]["data"], json({0.0, 1.0, 2.0, 3.0}));
  }
  auto stats = Stats(rt.get());
  EXPECT_EQ(stats.cache_misses(), 1u);
  EXPECT_EQ(stats.cache_hits(), 2u);
  EXPECT_EQ(stats.batches(), 1u);
  EXPECT_EQ(stats.transitions().at("SERVING"), 1u);
  EXPECT_EQ(stats.transitions().at("WARM"), 1u);
}

TEST(RuntimeTest, NoBatchDimensionModelAndDictOutputs) {
  auto rt = StartRuntime("dictout");
  ASSERT_NE(rt, nullptr);
  json body = {{"inputs", {{{"name", "x"}, {"datatype", "INT32"}, {"shape", {3}}, {"data", {4, 5, 6}}}}}};
  auto r = Http(rt->http_port(), "POST", "/v2/models/dictout/infer", body.dump());
  ASSERT_EQ(r.code, 200) << r.raw;
  EXPECT_EQ(r.body["outputs"][0]["data"], json({8, 10, 12}));
  EXPECT_EQ(r.body["outputs"][1]["datatype"], "INT64");
  EXPECT_EQ(r.body["outputs"][1]["data"], json({15}));
}

TEST(RuntimeTest, SigtermDeliversEveryRestReplyThatFinishesInTheDrain) {
  auto rt = StartRuntime("slow", "", "serving", {"--drain-timeout-ms", "60000"});
  ASSERT_NE(rt, nullptr);
  json body = {{"inputs",
                {{{"name", "x"}, {"datatype", "FP32"}, {"shape", {1, 1}}, {"data", {2.0}}},
                 {{"name", "work"}, {"datatype", "INT64"}, {"shape", {1, 1}}, {"data", {kLongWork}}}}}};
  std::vector<std::future<HttpResult>> calls;
  for (int i = 0; i < 3; ++i) {
    calls.push_back(std::async(std::launch::async, [&]() {
      return Http(rt->http_port(), "POST", "/v2/models/slow/infer", body.dump());
    }));
  }
  // Bounded poll until all three are accepted (batched or queued).
  bool accepted = false;
  for (int i = 0; i < 1000 && !accepted; ++i) {
    accepted = Stats(rt.get()).in_flight() == 3;
    if (!accepted) absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(accepted);
  rt->Signal(SIGTERM);
  for (auto& c : calls) {
    HttpResult r = c.get();
    EXPECT_EQ(r.code, 200) << r.raw;
  }
  auto exit = rt->WaitExit(absl::Seconds(60));
  ASSERT_TRUE(exit.ok());
  EXPECT_TRUE(WIFEXITED(*exit) && WEXITSTATUS(*exit) == 0) << rt->Log();
}

// One long request executing and three queued behind it, on the slow model.
struct Backlog {
  std::future<grpc::Status> running;
  std::vector<std::future<grpc::Status>> queued;
  bool started = false;
};
Backlog StartBacklog(RuntimeProcess* rt, inference::GRPCInferenceService::Stub* stub) {
  Backlog b;
  b.running = std::async(std::launch::async, [stub]() { return Infer(stub, SlowRequest(kLongWork)); });
  if (!WaitExecuting(rt, 1, 0)) return b;
  for (int i = 0; i < 3; ++i) {
    b.queued.push_back(
        std::async(std::launch::async, [stub]() { return Infer(stub, SlowRequest(kLongWork)); }));
  }
  b.started = WaitExecuting(rt, 4, 3);
  return b;
}
// Once the stop began: the executing request completes, the queued ones never run, and the
// process exits cleanly.
void ExpectQueuedFailedAndExit(RuntimeProcess* rt, Backlog* b) {
  EXPECT_TRUE(b->running.get().ok());
  for (auto& q : b->queued) EXPECT_EQ(q.get().error_code(), grpc::StatusCode::UNAVAILABLE);
  auto exit = rt->WaitExit(absl::Seconds(60));
  ASSERT_TRUE(exit.ok());
  EXPECT_TRUE(WIFEXITED(*exit) && WEXITSTATUS(*exit) == 0) << rt->Log();
}

TEST(RuntimeTest, PastTheDrainDeadlineQueuedWorkFailsInsteadOfRunning) {
  auto rt = StartRuntime("slow", "", "serving", {"--drain-timeout-ms", "200"});
  ASSERT_NE(rt, nullptr);
  auto stub = Stub(*rt);
  Backlog backlog = StartBacklog(rt.get(), stub.get());
  ASSERT_TRUE(backlog.started);
  rt->Signal(SIGTERM);
  ExpectQueuedFailedAndExit(rt.get(), &backlog);
  EXPECT_NE(rt->Log().find("drain deadline passed"), std::string::npos);
}

// A Shutdown's own deadline bounds the whole stop: past it, queued work fails instead of the
// process draining again for --drain-timeout (60 s here).
TEST(RuntimeTest, AShutdownDeadlineIsNotFollowedByTheFullDrainTimeout) {
  auto rt = StartRuntime("slow", "", "serving", {"--drain-timeout-ms", "60000"});
  ASSERT_NE(rt, nullptr);
  auto stub = Stub(*rt);
  Backlog backlog = StartBacklog(rt.get(), stub.get());
  ASSERT_TRUE(backlog.started);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::ShutdownRequest req;
  req.set_deadline_millis(100);
  v1::ShutdownResponse resp;
  grpc::Status s = rt->control()->Shutdown(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_FALSE(resp.drained());
  ExpectQueuedFailedAndExit(rt.get(), &backlog);
}

// Promotes at once (an agent's retry beside an operator's) all succeed: one warms up and
// promotes, the others find it SERVING.
TEST(RuntimeTest, ConcurrentPromotesAllSucceed) {
  auto rt = StartRuntime("encoder", "", "warm", {"--warmup-on-promote"});
  ASSERT_NE(rt, nullptr);
  std::vector<std::future<grpc::Status>> promotes;
  for (int i = 0; i < 4; ++i) {
    promotes.push_back(std::async(std::launch::async, [&]() {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      v1::PromoteRequest req;
      v1::RuntimeState resp;
      return rt->control()->Promote(&ctx, req, &resp);
    }));
  }
  for (auto& p : promotes) {
    grpc::Status s = p.get();
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  auto st = rt->GetState();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state(), v1::SERVING);
  // One promotion: SERVING entered once.
  EXPECT_EQ(Stats(rt.get()).transitions().at("SERVING"), 1u);
}

TEST(RuntimeTest, HostileRestBodiesAreRefusedAndTheServerLives) {
  auto rt = StartRuntime("addsub", "", "serving", {"--max-request-bytes", "1Mi"});
  ASSERT_NE(rt, nullptr);
  int port = rt->http_port();
  // A declared shape over the payload limit: 413 (it can never succeed), not 429.
  auto big = Http(port, "POST", "/v2/models/addsub/infer",
                  R"({"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[8,4000000],"data":[1]}]})");
  EXPECT_EQ(big.code, 413) << big.raw;
  auto overflow = Http(port, "POST", "/v2/models/addsub/infer",
                       R"({"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]},
                           {"name":"INPUT1","datatype":"FP64","shape":[1152921504606846975],"data":[1]}]})");
  EXPECT_EQ(overflow.code, 413) << overflow.raw;
  std::string deep = R"({"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,4],"data":)";
  deep += std::string(200000, '[') + "1" + std::string(200000, ']') + "}]}";
  EXPECT_EQ(Http(port, "POST", "/v2/models/addsub/infer", deep).code, 400);
  std::string deep_param = R"({"parameters":{"p":)" + std::string(200000, '[') +
                           std::string(200000, ']') + R"(},"inputs":[]})";
  EXPECT_EQ(Http(port, "POST", "/v2/models/addsub/infer", deep_param).code, 400);
  // A shape of 50,000 dimensions with data nested as deep: refused by its rank before the data
  // is walked (the walk recursed once per level and overflowed the thread's stack).
  std::string ones;
  for (int i = 0; i < 50000; ++i) ones += i ? ",1" : "1";
  std::string deep_shape = R"({"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[)" + ones +
                           R"(],"data":)" + std::string(50000, '[') + "1" +
                           std::string(50000, ']') + "}]}";
  auto rank = Http(port, "POST", "/v2/models/addsub/infer", deep_shape);
  EXPECT_EQ(rank.code, 400) << rank.raw;
  EXPECT_NE(rank.raw.find("50000 dimensions, more than the 32 allowed"), std::string::npos)
      << rank.raw;
  // A chunked body (no Content-Length) is served; one that grows past the limit is cut at it
  // (413) without the server holding more of it.
  const std::string ok_body =
      R"({"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]},)"
      R"({"name":"INPUT1","datatype":"FP32","shape":[1,4],"data":[1,1,1,1]}]})";
  {
    testing::RawHttpClient c(port);
    ASSERT_TRUE(c.Send(testing::PostChunked("/v2/models/addsub/infer", ok_body, 7)));
    auto r = c.Read();
    ASSERT_EQ(r.code, 200) << r.head << r.body;
    json out = json::parse(r.body);
    EXPECT_EQ(out["outputs"][0]["name"], "OUTPUT0");
    EXPECT_EQ(out["outputs"][0]["data"], json({2, 3, 4, 5}));
  }
  {
    testing::RawHttpClient c(port);
    std::string huge = R"({"inputs":[],"pad":")" + std::string(2 << 20, 'x') + R"("})";
    c.Send(testing::PostChunked("/v2/models/addsub/infer", huge, 64 << 10));
    EXPECT_EQ(c.Read().code, 413);
  }
  EXPECT_EQ(Http(port, "GET", "/v2/health/live").code, 200);
  auto state = rt->GetState();
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->state(), v1::SERVING);
}

TEST(RuntimeTest, PromoteAndDemoteAreRefusedWhileLoading) {
  // A copy of the encoder whose warm-up takes a while.
  auto dir = std::filesystem::temp_directory_path() / ("kiln_slowload_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "encoder/1");
  std::filesystem::copy_file(kRepo + "/encoder/1/model.pt", dir / "encoder/1/model.pt");
  std::ifstream in(kRepo + "/encoder/config.yaml");
  std::stringstream cfg;
  cfg << in.rdbuf();
  std::string text = cfg.str();
  text = text.substr(0, text.find("warmup:")) +
         "warmup:\n  - {name: long, batch_size: 32, iterations: 10, inputs: {input_ids: {dims: "
         "[128]}, attention_mask: {dims: [128]}}}\n";
  std::ofstream(dir / "encoder/config.yaml") << text;
  RuntimeProcess::Options o;
  o.repository = dir.string();
  o.model = "encoder";
  o.wait_until_loaded = false;
  auto rt = RuntimeProcess::Start(o);
  ASSERT_TRUE(rt.ok()) << rt.status();
  // Bounded poll until the control socket answers in LOADING.
  absl::StatusOr<v1::RuntimeState> st = absl::UnavailableError("not yet");
  for (int i = 0; i < 3000 && !(st.ok() && st->state() == v1::LOADING); ++i) {
    st = (*rt)->GetState();
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(st.ok());
  if (st->state() == v1::LOADING) {
    grpc::ClientContext c1;
    v1::RuntimeState r1;
    EXPECT_EQ((*rt)->control()->Demote(&c1, {}, &r1).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
    grpc::ClientContext c2;
    v1::RuntimeState r2;
    EXPECT_EQ((*rt)->control()->Promote(&c2, {}, &r2).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  // Loading still ends in SERVING, untouched (through WARM: a poll may catch it there).
  for (int i = 0; i < 12000; ++i) {
    st = (*rt)->GetState();
    if (st.ok() && st->state() != v1::LOADING && st->state() != v1::WARM) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->state(), v1::SERVING) << (*rt)->Log();
  rt->reset();
  std::filesystem::remove_all(dir);
}

// One answer frame from the data socket: tag, code, body; code -1 when the connection ended.
struct DataAnswer {
  uint64_t tag = 0;
  int code = -1;
  std::string body;
};
DataAnswer ReadAnswer(int fd) {
  DataAnswer a;
  char head[kFrameHeaderBytes];
  if (!ReadFull(fd, head, sizeof(head))) return a;
  FrameHeader h = DecodeFrameHeader(head);
  a.body.resize(h.length);
  if (h.length > 0 && !ReadFull(fd, a.body.data(), a.body.size())) return a;
  a.tag = h.tag;
  a.code = h.code;
  return a;
}
bool SendFrame(int fd, uint64_t tag, uint8_t code, int64_t deadline, const std::string& body) {
  std::string f = EncodeFrame(tag, code, deadline, body);
  return WriteFull(fd, f.data(), f.size());
}

TEST(RuntimeTest, TheDataSocketServesTheReferenceOutputsAndRefusesBadFrames) {
  auto dir = std::filesystem::temp_directory_path() / ("kiln_data_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "r.data").string();
  auto rt = StartRuntime("encoder", "1", "serving",
                         {"--data-socket", path, "--max-request-bytes", "1Mi"});
  ASSERT_NE(rt, nullptr);
  auto state = rt->GetState();
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->data_socket(), path);
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  auto fd = ConnectUnix(path);
  ASSERT_TRUE(fd.ok()) << fd.status();
  auto refs = References("1");
  // Several requests in flight on one connection; each answered once, under its own tag.
  std::map<uint64_t, std::pair<size_t, bool>> sent;  // tag -> (case, raw)
  uint64_t tag = 100;
  for (size_t i = 0; i < 3; ++i) {
    for (bool raw : {false, true}) {
      ASSERT_TRUE(SendFrame(*fd, tag, 0, 0, GrpcEncoderRequest(refs[i], raw).SerializeAsString()));
      sent[tag++] = {i, raw};
    }
  }
  for (size_t n = 0; n < 6; ++n) {
    DataAnswer a = ReadAnswer(*fd);
    ASSERT_EQ(a.code, 0) << a.body;
    auto it = sent.find(a.tag);
    ASSERT_NE(it, sent.end()) << "tag " << a.tag << " not sent or answered twice";
    inference::ModelInferResponse resp;
    ASSERT_TRUE(resp.ParseFromString(a.body));
    EXPECT_EQ(resp.id(), "case");
    EXPECT_EQ(resp.model_version(), "1");
    EXPECT_EQ(resp.raw_output_contents_size() > 0, it->second.second);
    EXPECT_LT(MaxDiff(GrpcFloats(resp), refs[it->second.first]["embedding"]), 1e-5);
    sent.erase(it);
  }

  // Bad requests: each answered with the reason, and the connection serves on.
  auto expect_error = [&](uint8_t code, int64_t deadline, const std::string& body, int want,
                          const std::string& says) {
    ASSERT_TRUE(SendFrame(*fd, 7, code, deadline, body));
    DataAnswer a = ReadAnswer(*fd);
    EXPECT_EQ(a.tag, 7u);
    EXPECT_EQ(a.code, want) << a.body;
    EXPECT_NE(a.body.find(says), std::string::npos) << a.body;
  };
  const std::string good = GrpcEncoderRequest(refs[0], true).SerializeAsString();
  expect_error(0, 0, std::string("\xff\xff\xff\xff", 4), 3, "not an inference.ModelInferRequest");
  expect_error(9, 0, good, 3, "frame code 9");
  expect_error(0, 1, good, 4, "deadline");
  inference::ModelInferRequest other = GrpcEncoderRequest(refs[0], true);
  other.set_model_name("nope");
  expect_error(0, 0, other.SerializeAsString(), 5, "unknown model 'nope'");
  inference::ModelInferRequest short_raw = GrpcEncoderRequest(refs[0], true);
  short_raw.mutable_raw_input_contents(0)->resize(3);
  expect_error(0, 0, short_raw.SerializeAsString(), 3, "expected");
  ASSERT_TRUE(SendFrame(*fd, 8, 0, 0, good));
  EXPECT_EQ(ReadAnswer(*fd).code, 0);

  // A request over --max-request-bytes is refused; the connection (other calls may be on it)
  // serves on.
  ASSERT_TRUE(SendFrame(*fd, 11, 0, 0, std::string((1 << 20) + 70 * 1024, 'x')));
  {
    DataAnswer big = ReadAnswer(*fd);
    EXPECT_EQ(big.tag, 11u);
    EXPECT_EQ(big.code, 8) << big.body;  // RESOURCE_EXHAUSTED
    EXPECT_NE(big.body.find("exceeds the payload limit"), std::string::npos) << big.body;
  }
  ASSERT_TRUE(SendFrame(*fd, 12, 0, 0, good));
  EXPECT_EQ(ReadAnswer(*fd).code, 0);
  // A frame no router would send (2 GiB) ends its connection; the socket takes new ones.
  char head[kFrameHeaderBytes];
  EncodeFrameHeader({0x7fffffffu, 9, 0, 0}, head);
  ASSERT_TRUE(WriteFull(*fd, head, sizeof(head)));
  EXPECT_EQ(ReadAnswer(*fd).code, -1);
  ::close(*fd);
  auto again = ConnectUnix(path);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(SendFrame(*again, 10, 0, 0, good));
  DataAnswer a = ReadAnswer(*again);
  EXPECT_EQ(a.tag, 10u);
  EXPECT_EQ(a.code, 0) << a.body;
  ::close(*again);

  // Stopping removes the socket file.
  rt->Signal(SIGTERM);
  auto exited = rt->WaitExit(absl::Seconds(30));
  ASSERT_TRUE(exited.ok()) << exited.status();
  EXPECT_FALSE(std::filesystem::exists(path));
  std::filesystem::remove_all(dir);
}

// The data socket's one reader reads every request of the router's connection: a request it
// read first (a lower priority) is queued, not run on that thread, so a higher-priority one
// read after it still goes first (the model: the slow one with no batching delay, 2 levels).
TEST(RuntimeTest, OnTheDataSocketAHigherPriorityIsNotHeldBehindALowerOneReadFirst) {
  auto dir = std::filesystem::temp_directory_path() / ("kiln_prio_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "slow");
  std::filesystem::copy(kRepo + "/slow", dir / "slow", std::filesystem::copy_options::recursive);
  {
    std::ifstream in(dir / "slow/config.yaml");
    std::string cfg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string delay = "max_queue_delay_microseconds: 100";
    ASSERT_NE(cfg.find(delay), std::string::npos) << cfg;
    cfg.replace(cfg.find(delay), delay.size(), "max_queue_delay_microseconds: 0");
    std::ofstream(dir / "slow/config.yaml") << cfg;
  }
  const std::string path = (dir / "r.data").string();
  auto rt = StartRuntime("slow", "", "serving", {"--data-socket", path, "--threads", "1"},
                         dir.string());
  ASSERT_NE(rt, nullptr);
  auto fd = ConnectUnix(path);
  ASSERT_TRUE(fd.ok()) << fd.status();
  auto request = [](int64_t work, int64_t priority) {
    inference::ModelInferRequest r = SlowRequest(work);
    (*r.mutable_parameters())["priority"].set_int64_param(priority);
    return r.SerializeAsString();
  };
  ASSERT_TRUE(SendFrame(*fd, 1, 0, 0, request(kLongWork, 2)));
  ASSERT_TRUE(WaitExecuting(rt.get(), 1, 0));
  ASSERT_TRUE(SendFrame(*fd, 2, 0, 0, request(1, 2)));
  ASSERT_TRUE(SendFrame(*fd, 3, 0, 0, request(1, 1)));
  // Both read and queued while the first one runs.
  EXPECT_TRUE(WaitExecuting(rt.get(), 3, 2));
  std::vector<uint64_t> order;
  for (int i = 0; i < 3; ++i) {
    DataAnswer a = ReadAnswer(*fd);
    EXPECT_EQ(a.code, 0) << a.body;
    order.push_back(a.tag);
  }
  EXPECT_EQ(order, (std::vector<uint64_t>{1, 3, 2}));
  ::close(*fd);
  rt.reset();
  std::filesystem::remove_all(dir);
}

// REST bodies over the data socket (kJsonInferFrame) get what the REST port answers, byte for
// byte, with parameters.kiln-version added to a 200; errors carry the REST port's HTTP status.
TEST(RuntimeTest, TheDataSocketAnswersRestBodiesAsTheRestPortDoes) {
  auto dir = std::filesystem::temp_directory_path() / ("kiln_jdata_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "r.data").string();
  auto rt = StartRuntime("encoder", "1", "serving",
                         {"--data-socket", path, "--max-request-bytes", "1Mi"});
  ASSERT_NE(rt, nullptr);
  auto fd = ConnectUnix(path);
  ASSERT_TRUE(fd.ok()) << fd.status();
  auto refs = References("1");
  // A frame for `body` at the path /v2/models/{model}[/versions/{version}]/infer, answered as
  // (HTTP status, JSON).
  uint64_t tag = 1;
  auto call = [&](const std::string& body, const std::string& model, const std::string& version,
                  int64_t deadline = 0) -> std::pair<int, json> {
    const uint64_t t = tag++;
    EXPECT_TRUE(SendFrame(*fd, t, kJsonInferFrame, deadline,
                          EncodeJsonInferBody(body, model, version)));
    DataAnswer a = ReadAnswer(*fd);
    EXPECT_EQ(a.tag, t);
    EXPECT_EQ(a.code, 0) << a.body;
    int status = 0;
    absl::Status d = DecodeJsonAnswer(&a.body, &status);
    EXPECT_TRUE(d.ok()) << d;
    return {status, json::parse(a.body, nullptr, false)};
  };
  for (size_t i = 0; i < 3; ++i) {
    json body = json::parse(RestEncoderBody(refs[i]));
    body["parameters"] = {{"trace", "t" + std::to_string(i)}};
    for (const std::string version : {"", "1"}) {
      auto [status, got] = call(body.dump(), "encoder", version);
      ASSERT_EQ(status, 200) << got;
      EXPECT_EQ(got["parameters"]["kiln-version"], "1");
      EXPECT_EQ(got["parameters"]["trace"], "t" + std::to_string(i));
      EXPECT_LT(MaxDiff(JsonFloats(got["outputs"][0]["data"]), refs[i]["embedding"]), 1e-5);
      // The REST port's answer, but for the version this replica adds.
      HttpResult h = Http(rt->http_port(), "POST",
                          version.empty() ? "/v2/models/encoder/infer"
                                          : "/v2/models/encoder/versions/1/infer",
                          body.dump());
      ASSERT_EQ(h.code, 200) << h.raw;
      got["parameters"].erase("kiln-version");
      EXPECT_EQ(got, h.body);
    }
  }
  // Bad requests: the REST port's status and message; the connection serves on.
  auto expect = [&](const std::string& body, const std::string& model, const std::string& version,
                    int want, const std::string& says, int64_t deadline = 0) {
    auto [status, got] = call(body, model, version, deadline);
    EXPECT_EQ(status, want) << got;
    EXPECT_NE(got.dump().find(says), std::string::npos) << got;
    HttpResult h = Http(rt->http_port(), "POST",
                        "/v2/models/" + model + (version.empty() ? "" : "/versions/" + version) +
                            "/infer",
                        body);
    if (deadline == 0) {
      EXPECT_EQ(h.code, want) << h.raw;
    }
  };
  const std::string good = RestEncoderBody(refs[0]);
  expect("{not json", "encoder", "", 400, "JSON");
  expect(good, "nope", "", 404, "unknown model 'nope'");
  expect(good, "encoder", "7", 404, "version");
  json wrong = json::parse(good);
  wrong["inputs"][0]["name"] = "token_ids";
  expect(wrong.dump(), "encoder", "", 400, "token_ids");
  json huge = json::parse(good);
  huge["inputs"][0]["shape"] = {1, 1 << 20};
  expect(huge.dump(), "encoder", "", 413, "");
  expect(good, "encoder", "", 504, "deadline", /*deadline=*/1);
  // A frame over --max-request-bytes and its framing: 413, as the REST port answers a body over
  // the limit (never 429, which a client would retry).
  {
    const std::string big = std::string((1 << 20) + 70 * 1024, ' ') + good;
    auto [status, got] = call(big, "encoder", "");
    EXPECT_EQ(status, 413) << got;
    EXPECT_NE(got.dump().find("exceeds the payload limit"), std::string::npos) << got;
    EXPECT_EQ(Http(rt->http_port(), "POST", "/v2/models/encoder/infer", big).code, 413);
  }
  // A frame too short for its trailer, or whose trailer overruns it, is refused as a frame.
  for (const std::string& bad : {std::string("abc"), std::string("{}") + std::string("\xff\xff\0\0\0\0\0\0", 8)}) {
    ASSERT_TRUE(SendFrame(*fd, 99, kJsonInferFrame, 0, bad));
    DataAnswer a = ReadAnswer(*fd);
    EXPECT_EQ(a.tag, 99u);
    EXPECT_EQ(a.code, 3) << a.body;  // INVALID_ARGUMENT
    EXPECT_NE(a.body.find("trailer"), std::string::npos) << a.body;
  }
  auto [status, again] = call(good, "encoder", "");
  EXPECT_EQ(status, 200) << again;
  ::close(*fd);
  rt.reset();
  std::filesystem::remove_all(dir);
}

// A router that stops reading answers (wedged, stopped) must not hold up the replica: its
// answers wait for it, and everyone else is still served. When it reads again, every answer
// is there, each once.
TEST(RuntimeTest, ARouterThatReadsNoAnswersDoesNotHoldUpTheReplica) {
  auto dir = std::filesystem::temp_directory_path() / ("kiln_stuck_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "r.data").string();
  auto rt = StartRuntime("encoder", "1", "serving", {"--data-socket", path});
  ASSERT_NE(rt, nullptr);
  auto fd = ConnectUnix(path);
  ASSERT_TRUE(fd.ok()) << fd.status();
  auto refs = References("1");
  const std::string good = GrpcEncoderRequest(refs[0], true).SerializeAsString();
  // Far more answers than a unix socket's buffer holds (each carries 256 bytes of embedding:
  // 375 KB against the default 208 KiB; few enough that the engine works through them well
  // inside the runtime's 10 s send stall), none read while they are sent. (Sent from a
  // thread: the runtime must go on reading them.)
  constexpr int kRequests = 1500;
  absl::Notification all_sent;
  std::thread sender([&] {
    for (int i = 0; i < kRequests; ++i) {
      if (!SendFrame(*fd, 1000 + i, 0, 0, good)) break;
    }
    all_sent.Notify();
  });
  ASSERT_TRUE(all_sent.WaitForNotificationWithTimeout(absl::Seconds(60)));
  sender.join();
  // Meanwhile a gRPC client is served: at once, or once the engine has worked through the
  // queue those requests filled (RESOURCE_EXHAUSTED until then). A blocked engine never does.
  auto stub = Stub(*rt);
  inference::ModelInferResponse resp;
  grpc::Status served;
  for (int i = 0; i < 600; ++i) {  // bounded poll
    served = Infer(stub.get(), GrpcEncoderRequest(refs[1], true), &resp);
    if (served.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(served.ok()) << served.error_code() << ": " << served.error_message();
  EXPECT_LT(MaxDiff(GrpcFloats(resp), refs[1]["embedding"]), 1e-5);
  // Now every answer arrives, each once: results, or the queue's refusals when it was full.
  std::set<uint64_t> answered;
  int ok = 0;
  for (int n = 0; n < kRequests; ++n) {
    DataAnswer a = ReadAnswer(*fd);
    ASSERT_NE(a.code, -1) << "answer " << n << " missing";
    EXPECT_TRUE(a.code == 0 || a.code == 8 || a.code == 14) << a.code << " " << a.body;
    EXPECT_TRUE(answered.insert(a.tag).second) << "tag " << a.tag << " answered twice";
    if (a.code == 0) ok++;
  }
  EXPECT_EQ(answered.size(), static_cast<size_t>(kRequests));
  EXPECT_GT(ok, 0);
  ::close(*fd);
  rt->Signal(SIGTERM);
  EXPECT_TRUE(rt->WaitExit(absl::Seconds(30)).ok());
  std::filesystem::remove_all(dir);
}

// A data socket path holding some other file is refused, and the file kept.
TEST(RuntimeTest, ADataSocketPathHoldingAFileIsNotDeleted) {
  auto dir = std::filesystem::temp_directory_path() / ("kiln_datafile_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::string path = (dir / "r.data").string();
  std::ofstream(path) << "precious";
  testing::RunResult r = testing::RunToCompletion(
      {KILN_RUNTIME_BIN, "--model-repository", kRepo, "--model", "addsub", "--grpc-port", "0",
       "--http-port", "0", "--bind-address", "127.0.0.1", "--data-socket", path},
      absl::Seconds(60));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--data-socket: " + path + " exists and is not a socket"),
            std::string::npos)
      << r.output;
  std::ifstream kept(path);
  std::string content;
  kept >> content;
  EXPECT_EQ(content, "precious");
  std::filesystem::remove_all(dir);
}

TEST(RuntimeTest, ControlSocketPathHoldingAFileIsNotDeleted) {
  auto dir = std::filesystem::temp_directory_path() / ("kiln_sockfile_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::string path = (dir / "control.sock").string();
  std::ofstream(path) << "precious";
  testing::RunResult r = testing::RunToCompletion(
      {KILN_RUNTIME_BIN, "--model-repository", kRepo, "--model", "addsub", "--grpc-port", "0",
       "--http-port", "0", "--bind-address", "127.0.0.1", "--control-socket", path},
      absl::Seconds(60));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("exists and is not a socket"), std::string::npos) << r.output;
  std::ifstream kept(path);
  std::string content;
  kept >> content;
  EXPECT_EQ(content, "precious");
  std::filesystem::remove_all(dir);
}

class BrokenRepoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("kiln_broken_repo_" + std::to_string(getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ / "encoder/1");
    std::filesystem::copy_file(kRepo + "/encoder/config.yaml", dir_ / "encoder/config.yaml");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(BrokenRepoTest, CorruptModelFileFailsTheLoadCleanly) {
  std::ofstream(dir_ / "encoder/1/model.pt") << "PK\x03\x04 definitely not a TorchScript archive";
  testing::RunResult r = testing::RunToCompletion(
      {KILN_RUNTIME_BIN, "--model-repository", dir_.string(), "--model", "encoder",
       "--grpc-port", "0", "--http-port", "0", "--bind-address", "127.0.0.1"},
      absl::Seconds(60));
  EXPECT_EQ(r.exit_code, 1) << r.output;  // an orderly exit, not a crash
  EXPECT_NE(r.output.find("not a loadable TorchScript model"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("-> FAILED"), std::string::npos) << r.output;
}

TEST_F(BrokenRepoTest, BadConfigFailsBeforeListening) {
  std::ofstream(dir_ / "encoder/1/model.pt") << "x";
  std::ofstream(dir_ / "encoder/config.yaml") << "name: encoder\nbackend: torchscript\nmax_batch_size: lots\n";
  testing::RunResult r = testing::RunToCompletion(
      {KILN_RUNTIME_BIN, "--model-repository", dir_.string(), "--model", "encoder"},
      absl::Seconds(30));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("max_batch_size: must be an integer"), std::string::npos) << r.output;
  // A misspelt backend is the config's error too, before any port is taken.
  std::ofstream(dir_ / "encoder/config.yaml")
      << "name: encoder\nbackend: torchscrpit\nmax_batch_size: 0\n"
         "input:\n  - {name: x, datatype: FP32, dims: [1]}\n"
         "output:\n  - {name: y, datatype: FP32, dims: [1]}\n";
  r = testing::RunToCompletion(
      {KILN_RUNTIME_BIN, "--model-repository", dir_.string(), "--model", "encoder"},
      absl::Seconds(30));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("encoder/config.yaml: backend: 'torchscrpit' is not a registered "
                          "backend (registered: aotinductor, torchscript)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("listening"), std::string::npos) << r.output;
}

TEST(RuntimeFlagsTest, BadFlagsNameTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string expect;
  };
  std::vector<Case> cases = {
      {{"--model", "encoder"}, "--model-repository"},
      {{"--model-repository", kRepo}, "--model"},
      {{"--model-repository", kRepo, "--model", "encoder", "--initial-state", "hot"}, "--initial-state"},
      {{"--model-repository", kRepo, "--model", "encoder", "--grpc-port", "70000"}, "--grpc-port"},
      {{"--model-repository", kRepo, "--model", "encoder", "--http-port", "abc"}, "--http-port"},
      {{"--model-repository", kRepo, "--model", "encoder", "--device", "gpu"}, "--device"},
      {{"--model-repository", kRepo, "--model", "encoder", "--version", "9"}, "--version"},
      {{"--model-repository", kRepo, "--model", "missing"}, "--model"},
      {{"--model-repository", "/nonexistent", "--model", "encoder"}, "--model-repository"},
      {{"--model-repository", kRepo, "--model", "encoder", "--max-request-bytes", "huge"}, "--max-request-bytes"},
      {{"--model-repository", kRepo, "--model", "encoder", "--log-level", "loud"}, "--log-level"},
      {{"--model-repository", kRepo, "--model", "encoder", "--replica-id", "a/b"}, "--replica-id"},
      {{"--model-repository", kRepo, "--model", "encoder", "--http-threads", "0"},
       "--http-threads: must be in 1..64, got 0"},
      {{"--model-repository", kRepo, "--model", "encoder", "--http-threads", "65"},
       "--http-threads: must be in 1..64, got 65"},
      {{"--model-repository", kRepo, "--model", "encoder", "--idle-spin-us", "-1"},
       "--idle-spin-us: must be in 0..10000, got -1"},
      {{"--model-repository", kRepo, "--model", "encoder", "--idle-spin-us", "10001"},
       "--idle-spin-us: must be in 0..10000, got 10001"},
      {{"--model-repository", kRepo, "--model", "encoder", "--idle-spin-us", "soon"},
       "--idle-spin-us"},
      {{"--model-repository", kRepo, "--model", "encoder", "--model-cpus", "-1"},
       "--model-cpus: must be in 0..1024, got -1"},
      {{"--model-repository", kRepo, "--model", "encoder", "--model-cpus", "1025"},
       "--model-cpus: must be in 0..1024, got 1025"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {KILN_RUNTIME_BIN};
    args.insert(args.end(), c.args.begin(), c.args.end());
    testing::RunResult r = testing::RunToCompletion(args, absl::Seconds(30));
    EXPECT_NE(r.exit_code, 0) << c.expect;
    EXPECT_NE(r.exit_code, -1) << c.expect << " (killed or crashed)";
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.expect << ": " << r.output;
  }
}

}  // namespace
}  // namespace kiln
