// kiln-loadgen: an Open Inference Protocol v2 load generator for the encoder model.
//
// Closed loop (--mode closed): --concurrency requests are kept in flight; each completion
// immediately starts the next. Open loop (--mode open): requests are sent on a fixed schedule
// of --rate per second whatever the server does, and latency is measured from each request's
// *scheduled* send time, so a server that falls behind shows up as latency (no coordinated
// omission).
//
// gRPC: one CompletionQueue driver thread (--grpc-threads) keeps the requests in flight, which
// costs far less CPU than a thread per request; the generator must not compete with the
// server for the two cores it shares with it. REST: --concurrency worker threads, each with a
// blocking keep-alive HTTP/1.1 connection (bench/http_client.h).
//
// Every request has a deadline (--timeout-ms), connection failures are counted as errors, and
// the run stops by itself after --warmup-s + --duration-s (plus at most one timeout for the
// requests still in flight). Only the given address receives traffic.

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <mutex>
#include <queue>
#include <random>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "bench/http_client.h"
#include "bench/oip.h"
#include "inference/grpc_service.grpc.pb.h"
#include "nlohmann/json.hpp"

namespace kiln::bench {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::duration_cast;
using std::chrono::microseconds;
using std::chrono::milliseconds;
using std::chrono::nanoseconds;

// Distinct requests pre-built per worker and cycled, so that request construction (JSON
// serialization in particular) stays out of the measured loop.
constexpr int kRequestPool = 64;
// Back-off after a failed request in closed loop, so a dead server is not spun on.
constexpr milliseconds kErrorBackoff{10};
// Open loop: a request due before the end of the run may still be sent this long after it
// (late, with its lateness counted in its latency); later than that it is reported unsent.
constexpr milliseconds kLateIssueGrace{1000};

struct Options {
  std::string target = "grpc";
  std::string address = "127.0.0.1:8001";
  std::string model = "encoder";
  std::string model_version;
  int64_t seq_len = 16;
  int64_t batch = 1;
  std::string mode = "closed";
  int concurrency = 8;
  double rate = 0;
  double duration_s = 10;
  double warmup_s = 2;
  bool raw = false;
  bool json = false;
  int timeout_ms = 10000;
  int grpc_threads = 1;
  int max_in_flight = 4096;
  uint64_t seed = 1;
  bool allow_remote = false;
};

// The run's timeline. Requests whose reference time (send time in closed loop, scheduled
// time in open loop) falls in [measure_start, end) are measured.
struct Timeline {
  Clock::time_point start;
  Clock::time_point measure_start;
  Clock::time_point end;
  // Open loop: the k-th request (k = 0, 1, ...) of the whole run is due at start + k * period.
  nanoseconds period{0};

  Clock::time_point Scheduled(int64_t k) const { return start + period * k; }
};

struct Sample {
  int64_t ref_ns;   // reference time, relative to Timeline::start
  int64_t done_ns;  // completion time, relative to Timeline::start
  bool ok;
};

// Per worker; merged after the run. Not shared between threads.
class Recorder {
 public:
  explicit Recorder(const Timeline* timeline) : timeline_(timeline) { samples_.reserve(1 << 16); }

  void Add(Clock::time_point ref, Clock::time_point done, bool ok, const std::string* error) {
    if (ref < timeline_->measure_start || ref >= timeline_->end) {
      return;  // warmup, or the stragglers' tail
    }
    samples_.push_back({duration_cast<nanoseconds>(ref - timeline_->start).count(),
                        duration_cast<nanoseconds>(done - timeline_->start).count(), ok});
    if (!ok && first_error_.empty() && error != nullptr) {
      first_error_ = *error;
    }
  }
  void NoteVersion(const std::string& version) {
    if (model_version_.empty()) {
      model_version_ = version;
    }
  }

  const std::vector<Sample>& samples() const { return samples_; }
  const std::string& first_error() const { return first_error_; }
  const std::string& model_version() const { return model_version_; }

 private:
  const Timeline* timeline_;
  std::vector<Sample> samples_;
  std::string first_error_;
  std::string model_version_;
};

// ---------------------------------------------------------------------------------------
// gRPC: completion-queue driver.

struct GrpcCall {
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  grpc::Status status;
  Clock::time_point ref;
  std::unique_ptr<grpc::ClientAsyncResponseReader<inference::ModelInferResponse>> reader;
};

std::chrono::system_clock::time_point ToSystem(Clock::time_point t) {
  return std::chrono::system_clock::now() +
         duration_cast<std::chrono::system_clock::duration>(t - Clock::now());
}

// Drives this thread's share of the load: `concurrency` calls in closed loop, or every
// `threads`-th scheduled request starting at `index` in open loop.
void RunGrpcDriver(const Options& opt, const Timeline& tl, int index, int threads, int concurrency,
                   Recorder* rec) {
  grpc::ChannelArguments args;
  // A connection of its own per driver thread.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel(opt.address, grpc::InsecureChannelCredentials(), args);
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  channel->WaitForConnected(
      ToSystem(std::min(tl.measure_start, Clock::now() + milliseconds(5000))));

  std::mt19937_64 rng(opt.seed * 7919 + static_cast<uint64_t>(index));
  std::vector<inference::ModelInferRequest> pool;
  pool.reserve(kRequestPool);
  for (int i = 0; i < kRequestPool; ++i) {
    pool.push_back(MakeGrpcInferRequest(opt.model, opt.model_version,
                                        absl::StrCat("lg-", index, "-", i),
                                        RandomEncoderInput(opt.batch, opt.seq_len, &rng), opt.raw));
  }

  grpc::CompletionQueue cq;
  std::unordered_set<GrpcCall*> in_flight;
  size_t next_request = 0;
  const milliseconds timeout(opt.timeout_ms);
  const bool closed = opt.mode == "closed";

  auto issue = [&](Clock::time_point ref) {
    auto* call = new GrpcCall;
    call->ref = ref;
    call->ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    call->reader =
        stub->PrepareAsyncModelInfer(&call->ctx, pool[next_request++ % pool.size()], &cq);
    call->reader->StartCall();
    call->reader->Finish(&call->resp, &call->status, call);
    in_flight.insert(call);
  };

  // Closed loop: when the next call of each slot may start (min-heap).
  std::priority_queue<Clock::time_point, std::vector<Clock::time_point>, std::greater<>> starts;
  if (closed) {
    for (int i = 0; i < concurrency; ++i) {
      starts.push(tl.start);
    }
  }
  // Open loop: this thread sends requests k = index, index + threads, ...
  int64_t k = index;

  const Clock::time_point hard_stop = tl.end + timeout + milliseconds(2000);
  // Open loop: the last issue time for requests due before the end.
  const Clock::time_point issue_stop = closed ? tl.end : tl.end + kLateIssueGrace;
  while (true) {
    Clock::time_point now = Clock::now();
    if (now < issue_stop) {
      if (closed) {
        while (!starts.empty() && starts.top() <= now) {
          starts.pop();
          issue(now);
        }
      } else {
        while (tl.Scheduled(k) <= now && tl.Scheduled(k) < tl.end &&
               static_cast<int>(in_flight.size()) < opt.max_in_flight) {
          issue(tl.Scheduled(k));
          k += threads;
        }
      }
    }
    bool more = now < issue_stop && (closed ? !starts.empty() : tl.Scheduled(k) < tl.end);
    if (!more && in_flight.empty()) {
      break;
    }
    if (now >= hard_stop) {
      break;
    }
    Clock::time_point wake = hard_stop;
    if (more) {
      Clock::time_point due = closed ? starts.top() : tl.Scheduled(k);
      if (!closed && static_cast<int>(in_flight.size()) >= opt.max_in_flight) {
        due = hard_stop;  // wait for a completion
      }
      wake = std::min({wake, due, issue_stop});
    }
    void* tag = nullptr;
    bool ok = false;
    grpc::CompletionQueue::NextStatus st = cq.AsyncNext(&tag, &ok, ToSystem(wake));
    if (st == grpc::CompletionQueue::SHUTDOWN) {
      break;
    }
    if (st != grpc::CompletionQueue::GOT_EVENT) {
      continue;
    }
    auto* call = static_cast<GrpcCall*>(tag);
    Clock::time_point done = Clock::now();
    in_flight.erase(call);
    bool success = ok && call->status.ok() && call->resp.outputs_size() > 0;
    std::string error;
    if (!success) {
      if (!call->status.ok()) {
        error =
            absl::StrCat("grpc ", call->status.error_code(), ": ", call->status.error_message());
      } else {
        error = "response without outputs";
      }
    } else {
      rec->NoteVersion(call->resp.model_version());
    }
    rec->Add(call->ref, done, success, &error);
    if (closed && done < tl.end) {
      starts.push(success ? done : done + kErrorBackoff);
    }
    delete call;
  }

  // Only reached with calls left when the hard stop hit (their deadlines make that rare).
  for (GrpcCall* call : in_flight) {
    call->ctx.TryCancel();
  }
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
    auto* call = static_cast<GrpcCall*>(tag);
    if (in_flight.erase(call) > 0) {
      std::string error = "cancelled at the end of the run";
      rec->Add(call->ref, Clock::now(), false, &error);
      delete call;
    }
  }
}

// ---------------------------------------------------------------------------------------
// REST: one blocking keep-alive connection per worker thread.

void RunRestWorker(const Options& opt, const Timeline& tl, const HostPort& target, int index,
                   std::atomic<int64_t>* next_k, Recorder* rec) {
  HttpClient client(target, milliseconds(opt.timeout_ms));
  const std::string path = RestInferPath(opt.model, opt.model_version);
  std::mt19937_64 rng(opt.seed * 7919 + static_cast<uint64_t>(index));
  std::vector<std::string> bodies;
  bodies.reserve(kRequestPool);
  for (int i = 0; i < kRequestPool; ++i) {
    bodies.push_back(MakeRestInferBody(absl::StrCat("lg-", index, "-", i),
                                       RandomEncoderInput(opt.batch, opt.seq_len, &rng)));
  }
  bool version_seen = false;
  size_t next_request = 0;

  auto send = [&](Clock::time_point ref) -> bool {
    absl::StatusOr<HttpResponse> resp = client.Post(path, bodies[next_request++ % bodies.size()]);
    Clock::time_point done = Clock::now();
    if (!resp.ok()) {
      std::string error = absl::StrCat("http: ", resp.status().message());
      rec->Add(ref, done, false, &error);
      return false;
    }
    if (resp->status != 200) {
      std::string error = RestErrorMessage(resp->status, resp->body);
      rec->Add(ref, done, false, &error);
      return false;
    }
    if (!version_seen) {
      // Parse one response per worker fully: proves the payload is real and names the
      // served version. The rest are only status-checked to keep the client cheap.
      absl::StatusOr<InferResult> parsed =
          ParseRestInferResponse(resp->status, resp->body, kEmbeddingName);
      if (!parsed.ok()) {
        std::string error = absl::StrCat("bad response: ", parsed.status().message());
        rec->Add(ref, done, false, &error);
        return false;
      }
      version_seen = true;
      rec->NoteVersion(parsed->model_version);
    }
    rec->Add(ref, done, true, nullptr);
    return true;
  };

  if (opt.mode == "closed") {
    while (true) {
      Clock::time_point now = Clock::now();
      if (now >= tl.end) {
        break;
      }
      if (!send(now)) {
        std::this_thread::sleep_until(std::min(Clock::now() + kErrorBackoff, tl.end));
      }
    }
    return;
  }
  while (true) {
    int64_t k = next_k->fetch_add(1);
    Clock::time_point scheduled = tl.Scheduled(k);
    if (scheduled >= tl.end || Clock::now() >= tl.end + kLateIssueGrace) {
      break;
    }
    std::this_thread::sleep_until(scheduled);
    send(scheduled);
  }
}

// ---------------------------------------------------------------------------------------
// Results.

double Percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) {
    return 0;
  }
  // Nearest rank.
  size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size())));
  rank = std::clamp<size_t>(rank, 1, sorted.size());
  return sorted[rank - 1];
}

int Report(const Options& opt, const Timeline& tl, const std::vector<Recorder>& recorders) {
  const int64_t window_start = duration_cast<nanoseconds>(tl.measure_start - tl.start).count();
  const int64_t window_end = duration_cast<nanoseconds>(tl.end - tl.start).count();
  std::vector<double> latencies_ms;
  int64_t ok = 0;
  int64_t errors = 0;
  int64_t completed_in_window = 0;
  int64_t issued = 0;
  std::string first_error;
  std::string model_version;
  for (const Recorder& rec : recorders) {
    for (const Sample& s : rec.samples()) {
      ++issued;
      if (s.ok) {
        ++ok;
        latencies_ms.push_back(static_cast<double>(s.done_ns - s.ref_ns) / 1e6);
        if (s.done_ns >= window_start && s.done_ns < window_end) {
          ++completed_in_window;
        }
      } else {
        ++errors;
      }
    }
    if (first_error.empty()) {
      first_error = rec.first_error();
    }
    if (model_version.empty()) {
      model_version = rec.model_version();
    }
  }
  // Open loop: requests due in the window that were never sent (still not sent a grace period
  // after the end of the window: the target could not keep up).
  int64_t unsent = 0;
  if (opt.mode == "open") {
    int64_t first = static_cast<int64_t>(
        std::ceil(static_cast<double>(window_start) / static_cast<double>(tl.period.count())));
    int64_t last = static_cast<int64_t>(
        std::ceil(static_cast<double>(window_end) / static_cast<double>(tl.period.count())));
    unsent = std::max<int64_t>(0, (last - first) - issued);
  }
  std::sort(latencies_ms.begin(), latencies_ms.end());
  double mean = 0;
  for (double v : latencies_ms) {
    mean += v;
  }
  mean = latencies_ms.empty() ? 0 : mean / static_cast<double>(latencies_ms.size());
  const double rps = static_cast<double>(completed_in_window) / opt.duration_s;
  const double sps = rps * static_cast<double>(opt.batch);
  const double p50 = Percentile(latencies_ms, 0.50);
  const double p90 = Percentile(latencies_ms, 0.90);
  const double p99 = Percentile(latencies_ms, 0.99);
  const double max = latencies_ms.empty() ? 0 : latencies_ms.back();

  std::string target = opt.target == "grpc" ? (opt.raw ? "grpc(raw)" : "grpc(typed)") : "rest";
  std::string load = opt.mode == "closed" ? absl::StrCat("closed concurrency=", opt.concurrency)
                                          : absl::StrCat("open rate=", opt.rate, "/s");
  std::ostream& human = opt.json ? std::cerr : std::cout;
  char line[512];
  human << "kiln-loadgen " << target << " " << opt.address << " model=" << opt.model
        << (model_version.empty() ? "" : " version=" + model_version) << " " << load
        << " batch=" << opt.batch << " seq_len=" << opt.seq_len << " duration=" << opt.duration_s
        << "s warmup=" << opt.warmup_s << "s\n";
  std::snprintf(line, sizeof(line), "  requests: %lld ok, %lld errors%s\n",
                static_cast<long long>(ok), static_cast<long long>(errors),
                unsent > 0 ? absl::StrCat(", ", unsent, " unsent (behind schedule)").c_str() : "");
  human << line;
  std::snprintf(line, sizeof(line), "  throughput: %.1f req/s, %.1f seq/s\n", rps, sps);
  human << line;
  std::snprintf(line, sizeof(line),
                "  latency ms: p50 %.3f  p90 %.3f  p99 %.3f  max %.3f  mean %.3f\n", p50, p90, p99,
                max, mean);
  human << line;
  if (!first_error.empty()) {
    human << "  first error: " << first_error << "\n";
  }
  human.flush();

  if (opt.json) {
    nlohmann::ordered_json out = {
        {"target", opt.target},
        {"raw", opt.raw},
        {"address", opt.address},
        {"model", opt.model},
        {"model_version", model_version},
        {"mode", opt.mode},
        {"concurrency", opt.concurrency},
        {"rate", opt.rate},
        {"batch", opt.batch},
        {"seq_len", opt.seq_len},
        {"duration_s", opt.duration_s},
        {"warmup_s", opt.warmup_s},
        {"ok", ok},
        {"errors", errors},
        {"unsent", unsent},
        {"throughput_rps", rps},
        {"throughput_seq_per_s", sps},
        {"latency_ms", {{"p50", p50}, {"p90", p90}, {"p99", p99}, {"max", max}, {"mean", mean}}},
        {"first_error", first_error},
    };
    std::cout << out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace)
              << std::endl;
  }
  return ok > 0 ? 0 : 1;
}

bool IsLoopback(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.rfind("ipv4:", 0) == 0) {
    host = host.substr(5);
  }
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "[::1]";
}

int Run(const Options& opt) {
  if (!opt.allow_remote && !IsLoopback(opt.address)) {
    std::cerr << "kiln-loadgen: --address " << opt.address
              << " is not a loopback address (pass --allow-remote to load another host)\n";
    return 2;
  }
  if (opt.mode == "open" && opt.rate <= 0) {
    std::cerr << "kiln-loadgen: --mode open needs --rate > 0\n";
    return 2;
  }
  HostPort rest_target;
  if (opt.target == "rest") {
    absl::StatusOr<HostPort> hp = ParseHostPort(opt.address);
    if (!hp.ok()) {
      std::cerr << "kiln-loadgen: " << hp.status().message() << "\n";
      return 2;
    }
    rest_target = *hp;
  }

  Timeline tl;
  // A short lead time for the workers to build their requests and connect.
  tl.start = Clock::now() + milliseconds(200);
  tl.measure_start =
      tl.start + duration_cast<nanoseconds>(std::chrono::duration<double>(opt.warmup_s));
  tl.end =
      tl.measure_start + duration_cast<nanoseconds>(std::chrono::duration<double>(opt.duration_s));
  if (opt.mode == "open") {
    tl.period = duration_cast<nanoseconds>(std::chrono::duration<double>(1.0 / opt.rate));
    if (tl.period.count() <= 0) {
      tl.period = nanoseconds(1);
    }
  }

  std::vector<Recorder> recorders;
  std::vector<std::thread> threads;
  std::atomic<int64_t> next_k{0};  // REST open loop: the next scheduled request to send
  if (opt.target == "grpc") {
    const int n = std::max(
        1, opt.mode == "closed" ? std::min(opt.grpc_threads, opt.concurrency) : opt.grpc_threads);
    recorders.assign(static_cast<size_t>(n), Recorder(&tl));
    for (int i = 0; i < n; ++i) {
      int share = opt.concurrency / n + (i < opt.concurrency % n ? 1 : 0);
      threads.emplace_back(RunGrpcDriver, std::cref(opt), std::cref(tl), i, n, share,
                           &recorders[static_cast<size_t>(i)]);
    }
  } else {
    recorders.assign(static_cast<size_t>(opt.concurrency), Recorder(&tl));
    for (int i = 0; i < opt.concurrency; ++i) {
      threads.emplace_back(RunRestWorker, std::cref(opt), std::cref(tl), std::cref(rest_target), i,
                           &next_k, &recorders[static_cast<size_t>(i)]);
    }
  }
  for (std::thread& t : threads) {
    t.join();
  }
  return Report(opt, tl, recorders);
}

}  // namespace
}  // namespace kiln::bench

int main(int argc, char** argv) {
  kiln::bench::Options opt;
  CLI::App app{"kiln-loadgen: Open Inference Protocol v2 load generator (encoder model)"};
  app.add_option("--target", opt.target, "Protocol: grpc or rest")
      ->check(CLI::IsMember({"grpc", "rest"}))
      ->capture_default_str();
  app.add_option("--address", opt.address, "HOST:PORT of the server (loopback)")
      ->capture_default_str();
  app.add_option("--model", opt.model, "Model name")->capture_default_str();
  app.add_option("--model-version", opt.model_version, "Model version (empty: server's choice)");
  app.add_option("--seq-len", opt.seq_len, "Tokens per sequence")
      ->check(CLI::Range(1, 8192))
      ->capture_default_str();
  app.add_option("--batch", opt.batch, "Sequences per request")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--mode", opt.mode, "closed (fixed concurrency) or open (fixed rate)")
      ->check(CLI::IsMember({"closed", "open"}))
      ->capture_default_str();
  app.add_option("--concurrency", opt.concurrency,
                 "Closed loop: requests in flight. Open loop, REST: connections (workers)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--rate", opt.rate, "Open loop: requests per second")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--duration-s", opt.duration_s, "Measured seconds")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  app.add_option("--warmup-s", opt.warmup_s, "Unmeasured seconds before the measurement")
      ->check(CLI::Range(0.0, 600.0))
      ->capture_default_str();
  app.add_flag("--raw", opt.raw, "gRPC: send raw_input_contents instead of typed contents");
  app.add_flag("--json", opt.json, "Print one JSON line with the results on stdout");
  app.add_option("--timeout-ms", opt.timeout_ms, "Per-request deadline")
      ->check(CLI::Range(1, 600000))
      ->capture_default_str();
  app.add_option("--grpc-threads", opt.grpc_threads, "gRPC completion-queue driver threads")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--max-in-flight", opt.max_in_flight, "gRPC open loop: cap on requests in flight")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--seed", opt.seed, "Random seed for token ids")->capture_default_str();
  app.add_flag("--allow-remote", opt.allow_remote, "Allow a non-loopback --address");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return kiln::bench::Run(opt);
}
