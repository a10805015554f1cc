// kiln-demo-client: a tour of a running kiln-runtime over both Open Inference Protocol
// transports. It checks liveness, readiness and the model's metadata over gRPC, then sends the
// same three sentences (turned into token ids by a toy tokenizer) through gRPC and through
// REST, prints the start of each embedding with the served version and latency, and exits
// non-zero unless every call worked and both transports returned the same embeddings.
//
//   kiln-demo-client --grpc 127.0.0.1:8001 --http 127.0.0.1:8000 --model encoder

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/http_client.h"
#include "bench/oip.h"
#include "inference/grpc_service.grpc.pb.h"

namespace kiln::examples {
namespace {

using Clock = std::chrono::steady_clock;

constexpr double kTolerance = 1e-5;

const char* const kSentences[] = {
    "The quick brown fox jumps over the lazy dog",
    "kiln serves TorchScript models over gRPC and REST",
    "Warm replicas are promoted in milliseconds, not minutes",
};

struct Options {
  std::string grpc_address = "127.0.0.1:8001";
  std::string http_address = "127.0.0.1:8000";
  std::string model = "encoder";
  std::string model_version;
  int timeout_ms = 10000;
};

double MillisSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

std::chrono::system_clock::time_point Deadline(int timeout_ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms);
}

std::string Head(const std::vector<float>& values) {
  std::string out = "[";
  for (size_t i = 0; i < std::min<size_t>(4, values.size()); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%s%+.5f", i == 0 ? "" : ", ", values[i]);
    out += buf;
  }
  return out + (values.size() > 4 ? ", ...]" : "]");
}

void PrintResult(const char* transport, int n, const bench::InferResult& r, double ms) {
  std::printf("  %-4s #%d version=%s shape=[%s] embedding=%s  %.2f ms\n", transport, n,
              r.model_version.c_str(), absl::StrJoin(r.shape, ",").c_str(), Head(r.values).c_str(),
              ms);
}

int Run(const Options& opt) {
  bool failed = false;

  // --- gRPC: health and metadata -----------------------------------------------------------
  auto channel = grpc::CreateChannel(opt.grpc_address, grpc::InsecureChannelCredentials());
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  std::printf("gRPC %s\n", opt.grpc_address.c_str());
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(opt.timeout_ms));
    inference::ServerLiveResponse resp;
    grpc::Status s = stub->ServerLive(&ctx, inference::ServerLiveRequest(), &resp);
    if (!s.ok()) {
      std::fprintf(stderr, "ServerLive failed: %s\n", s.error_message().c_str());
      return 1;
    }
    std::printf("  ServerLive: live=%s\n", resp.live() ? "true" : "false");
    failed |= !resp.live();
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(opt.timeout_ms));
    inference::ServerReadyResponse resp;
    grpc::Status s = stub->ServerReady(&ctx, inference::ServerReadyRequest(), &resp);
    if (!s.ok()) {
      std::fprintf(stderr, "ServerReady failed: %s\n", s.error_message().c_str());
      return 1;
    }
    std::printf("  ServerReady: ready=%s\n", resp.ready() ? "true" : "false");
    failed |= !resp.ready();
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(opt.timeout_ms));
    inference::ModelMetadataRequest req;
    req.set_name(opt.model);
    req.set_version(opt.model_version);
    inference::ModelMetadataResponse resp;
    grpc::Status s = stub->ModelMetadata(&ctx, req, &resp);
    if (!s.ok()) {
      std::fprintf(stderr, "ModelMetadata failed: %s\n", s.error_message().c_str());
      return 1;
    }
    std::printf("  ModelMetadata: name=%s platform=%s versions=[%s]\n", resp.name().c_str(),
                resp.platform().c_str(), absl::StrJoin(resp.versions(), ",").c_str());
    for (const auto& t : resp.inputs()) {
      std::printf("    input  %-15s %-5s [%s]\n", t.name().c_str(), t.datatype().c_str(),
                  absl::StrJoin(t.shape(), ",").c_str());
    }
    for (const auto& t : resp.outputs()) {
      std::printf("    output %-15s %-5s [%s]\n", t.name().c_str(), t.datatype().c_str(),
                  absl::StrJoin(t.shape(), ",").c_str());
    }
  }

  // --- the same three requests over gRPC and REST ------------------------------------------
  std::vector<bench::InferResult> grpc_results;
  std::vector<bench::InferResult> rest_results;
  std::printf("inference (gRPC %s, REST %s)\n", opt.grpc_address.c_str(), opt.http_address.c_str());
  int n = 0;
  for (const char* sentence : kSentences) {
    ++n;
    bench::EncoderInput in = bench::SentenceToEncoderInput(sentence);
    std::printf("  \"%s\" -> %lld tokens\n", sentence, static_cast<long long>(in.seq_len));
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(opt.timeout_ms));
    inference::ModelInferResponse resp;
    Clock::time_point t0 = Clock::now();
    grpc::Status s = stub->ModelInfer(
        &ctx,
        bench::MakeGrpcInferRequest(opt.model, opt.model_version, absl::StrCat("demo-", n), in,
                                    /*raw=*/true),
        &resp);
    double ms = MillisSince(t0);
    if (!s.ok()) {
      std::fprintf(stderr, "  grpc #%d: ModelInfer failed: %s\n", n, s.error_message().c_str());
      failed = true;
      grpc_results.emplace_back();
      continue;
    }
    absl::StatusOr<bench::InferResult> r =
        bench::ParseGrpcInferResponse(resp, bench::kEmbeddingName);
    if (!r.ok()) {
      std::fprintf(stderr, "  grpc #%d: %s\n", n, std::string(r.status().message()).c_str());
      failed = true;
      grpc_results.emplace_back();
      continue;
    }
    PrintResult("grpc", n, *r, ms);
    grpc_results.push_back(*std::move(r));
  }

  absl::StatusOr<bench::HostPort> hp = bench::ParseHostPort(opt.http_address);
  if (!hp.ok()) {
    std::fprintf(stderr, "--http: %s\n", std::string(hp.status().message()).c_str());
    return 1;
  }
  bench::HttpClient http(*hp, std::chrono::milliseconds(opt.timeout_ms));
  const std::string path = bench::RestInferPath(opt.model, opt.model_version);
  n = 0;
  for (const char* sentence : kSentences) {
    ++n;
    bench::EncoderInput in = bench::SentenceToEncoderInput(sentence);
    Clock::time_point t0 = Clock::now();
    absl::StatusOr<bench::HttpResponse> resp =
        http.Post(path, bench::MakeRestInferBody(absl::StrCat("demo-", n), in));
    double ms = MillisSince(t0);
    if (!resp.ok()) {
      std::fprintf(stderr, "  rest #%d: POST %s failed: %s\n", n, path.c_str(),
                   std::string(resp.status().message()).c_str());
      failed = true;
      rest_results.emplace_back();
      continue;
    }
    absl::StatusOr<bench::InferResult> r =
        bench::ParseRestInferResponse(resp->status, resp->body, bench::kEmbeddingName);
    if (!r.ok()) {
      std::fprintf(stderr, "  rest #%d: %s\n", n, std::string(r.status().message()).c_str());
      failed = true;
      rest_results.emplace_back();
      continue;
    }
    PrintResult("rest", n, *r, ms);
    rest_results.push_back(*std::move(r));
  }

  // --- agreement ----------------------------------------------------------------------------
  for (size_t i = 0; i < grpc_results.size() && i < rest_results.size(); ++i) {
    const auto& g = grpc_results[i];
    const auto& r = rest_results[i];
    if (g.values.empty() || r.values.empty()) {
      continue;  // already reported
    }
    if (g.values.size() != r.values.size() || g.shape != r.shape) {
      std::printf("  #%zu MISMATCH: gRPC shape [%s] vs REST shape [%s]\n", i + 1,
                  absl::StrJoin(g.shape, ",").c_str(), absl::StrJoin(r.shape, ",").c_str());
      failed = true;
      continue;
    }
    double max_diff = 0;
    for (size_t j = 0; j < g.values.size(); ++j) {
      double d = std::fabs(static_cast<double>(g.values[j]) - static_cast<double>(r.values[j]));
      if (std::isnan(d)) {
        d = INFINITY;
      }
      max_diff = std::max(max_diff, d);
    }
    bool agree = max_diff <= kTolerance;
    std::printf("  #%zu gRPC vs REST: max |diff| = %.3g %s\n", i + 1, max_diff,
                agree ? "(agree)" : "MISMATCH");
    failed |= !agree;
  }
  if (failed) {
    std::printf("FAILED\n");
  } else {
    std::printf("OK: gRPC and REST agree to %g\n", kTolerance);
  }
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace kiln::examples

int main(int argc, char** argv) {
  kiln::examples::Options opt;
  CLI::App app{"kiln-demo-client: health, metadata and inference over gRPC and REST"};
  app.add_option("--grpc", opt.grpc_address, "gRPC HOST:PORT")->capture_default_str();
  app.add_option("--http", opt.http_address, "REST HOST:PORT")->capture_default_str();
  app.add_option("--model", opt.model, "Model name")->capture_default_str();
  app.add_option("--model-version", opt.model_version, "Model version (empty: server's choice)");
  app.add_option("--timeout-ms", opt.timeout_ms, "Per-call deadline")
      ->check(CLI::Range(1, 600000))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return kiln::examples::Run(opt);
}
