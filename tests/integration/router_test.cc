// The node router against replicas that answer in chosen ways (in-process gRPC servers on
// loopback).
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>

#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "agent/data_channel.h"
#include "agent/router.h"
#include "common/data_frames.h"
#include "common/http_server.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/support/eventually.h"
#include "tests/support/raw_grpc.h"
#include "tests/support/raw_http_client.h"

namespace kiln {
namespace {

// A replica's inference server reduced to one answer: `status`, or an output when OK.
class OneAnswerReplica : public inference::GRPCInferenceService::Service {
 public:
  explicit OneAnswerReplica(grpc::Status status) : status_(std::move(status)) {}
  grpc::Status ModelInfer(grpc::ServerContext*, const inference::ModelInferRequest*,
                          inference::ModelInferResponse* resp) override {
    calls_++;
    if (status_.ok()) resp->add_outputs()->set_name("embedding");
    return status_;
  }
  std::atomic<int> calls_{0};

 private:
  grpc::Status status_;
};

// A router on loopback ports with one route, model "encoder" version 1, to `endpoints`.
std::unique_ptr<Router> StartRouter(std::vector<RouterTable::Endpoint> endpoints) {
  Router::Options o;
  o.bind_address = "127.0.0.1";
  o.grpc_port = 0;
  o.http_port = 0;
  auto router = Router::Start(o);
  EXPECT_TRUE(router.ok()) << router.status();
  if (!router.ok()) return nullptr;
  auto table = std::make_shared<RouterTable>();
  RouterTable::Route& route = table->routes["encoder"];
  route.model = "encoder";
  route.versions = {{"1", 1}};
  route.endpoints = std::move(endpoints);
  (*router)->SetTable(table);
  return std::move(*router);
}

// A routing table: model "encoder", versions 1 and 2 weighted 50/50, to `endpoints`.
std::shared_ptr<RouterTable> HalfAndHalf(std::vector<RouterTable::Endpoint> endpoints,
                                         const std::string& sticky_parameter = "") {
  auto table = std::make_shared<RouterTable>();
  RouterTable::Route& route = table->routes["encoder"];
  route.model = "encoder";
  route.versions = {{"1", 50}, {"2", 50}};
  route.sticky_parameter = sticky_parameter;
  route.endpoints = std::move(endpoints);
  return table;
}

// A client of `router`'s gRPC port.
std::unique_ptr<inference::GRPCInferenceService::Stub> RouterStub(const Router& router) {
  return inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(router.grpc_port()), grpc::InsecureChannelCredentials()));
}

// A bare ModelInfer of model "encoder" through `stub`, with a 10 s deadline.
grpc::Status InferEncoder(inference::GRPCInferenceService::Stub* stub) {
  inference::ModelInferRequest req;
  req.set_model_name("encoder");
  inference::ModelInferResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return stub->ModelInfer(&ctx, req, &resp);
}

// `replica` served on a loopback port, written to `port`. Like a runtime's or a router's, its
// server takes the router's keepalive pings (every 2 s) during a long call.
std::unique_ptr<grpc::Server> Serve(grpc::Service* replica, int* port) {
  grpc::ServerBuilder b;
  b.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  b.RegisterService(replica);
  return b.BuildAndStart();
}

// `replica` served on a loopback port behind a router whose one endpoint, `id`, is that port
// (a local replica's without a data socket, or another node's router's), and a client of the
// router.
struct BehindRouter {
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<Router> router;
  std::unique_ptr<inference::GRPCInferenceService::Stub> stub;
};
BehindRouter ServeBehindRouter(grpc::Service* replica, const std::string& id, bool local) {
  BehindRouter b;
  int port = 0;
  b.server = Serve(replica, &port);
  EXPECT_GT(port, 0);
  b.router = StartRouter({{id, "1", "127.0.0.1:" + std::to_string(port), "", local, ""}});
  if (b.router) b.stub = RouterStub(*b.router);
  return b;
}

// A local replica's data socket (common/data_frames.h) answering each request as `answer`
// says: (code, body) for a frame carrying `request`, close the connection when it returns
// code -1, never answer that one for -2, or for -3 send a header announcing a body 1 MiB
// longer than `body` and then only `body` (an answer cut off mid-frame, the connection open). Records the deadlines it was sent. REST frames
// (kJsonInferFrame) go to the JSON answer when one is set, and are refused as an older
// runtime refuses them when not.
class FakeDataSocket {
 public:
  using Answer = std::function<std::pair<int, std::string>(const inference::ModelInferRequest&)>;
  // (code, body) for the REST body sent for `model` and `version` (as Answer).
  using JsonAnswer = std::function<std::pair<int, std::string>(
      const std::string& model, const std::string& version, const std::string& json)>;
  FakeDataSocket(std::string path, Answer answer, JsonAnswer json_answer)
      : FakeDataSocket(std::move(path), std::move(answer)) {
    absl::MutexLock lock(&mu_);
    json_answer_ = std::move(json_answer);
  }
  FakeDataSocket(std::string path, Answer answer) : path_(std::move(path)), answer_(answer) {
    auto fd = ListenUnix(path_, "test");
    EXPECT_TRUE(fd.ok()) << fd.status();
    listen_fd_ = fd.ok() ? *fd : -1;
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeDataSocket() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    {
      absl::MutexLock lock(&mu_);
      if (conn_fd_ >= 0) ::shutdown(conn_fd_, SHUT_RDWR);
    }
    thread_.join();
    ::close(listen_fd_);
    ::unlink(path_.c_str());
  }
  std::vector<int64_t> deadlines() {
    absl::MutexLock lock(&mu_);
    return deadlines_;
  }
  int requests() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(deadlines_.size());
  }
  // REST frames it was sent (answered or refused), and their deadlines.
  int json_requests() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(json_deadlines_.size());
  }
  std::vector<int64_t> json_deadlines() {
    absl::MutexLock lock(&mu_);
    return json_deadlines_;
  }

 private:
  void Serve() {
    for (;;) {
      int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) return;
      {
        absl::MutexLock lock(&mu_);
        conn_fd_ = fd;
      }
      char head[kFrameHeaderBytes];
      std::string body;
      while (ReadFull(fd, head, sizeof(head))) {
        FrameHeader h = DecodeFrameHeader(head);
        body.resize(h.length);
        if (h.length > 0 && !ReadFull(fd, body.data(), body.size())) break;
        std::pair<int, std::string> answer;
        if (h.code == kJsonInferFrame) {
          JsonAnswer json_answer;
          {
            absl::MutexLock lock(&mu_);
            json_deadlines_.push_back(h.deadline_unix_micros);
            json_answer = json_answer_;
          }
          std::string model, version;
          absl::Status d = DecodeJsonInferBody(&body, &model, &version);
          EXPECT_TRUE(d.ok()) << d;
          answer = json_answer ? json_answer(model, version, body)
                               : std::make_pair(3, "frame code 1: not a request this runtime "
                                                   "knows (0: ModelInfer)");
        } else {
          inference::ModelInferRequest req;
          EXPECT_TRUE(req.ParseFromString(body));
          {
            absl::MutexLock lock(&mu_);
            deadlines_.push_back(h.deadline_unix_micros);
          }
          answer = answer_(req);
        }
        auto [code, out] = answer;
        if (code == -2) continue;
        if (code == -3) {
          std::string frame = EncodeFrame(h.tag, 0, 0, out + std::string(1 << 20, 'x'));
          frame.resize(kFrameHeaderBytes + out.size());
          if (!WriteFull(fd, frame.data(), frame.size())) break;
          continue;
        }
        if (code < 0) break;
        std::string frame = EncodeFrame(h.tag, static_cast<uint8_t>(code), 0, out);
        if (!WriteFull(fd, frame.data(), frame.size())) break;
      }
      absl::MutexLock lock(&mu_);
      ::close(fd);
      conn_fd_ = -1;
    }
  }

  const std::string path_;
  Answer answer_;
  int listen_fd_ = -1;
  std::thread thread_;
  absl::Mutex mu_;
  int conn_fd_ ABSL_GUARDED_BY(mu_) = -1;
  std::vector<int64_t> deadlines_ ABSL_GUARDED_BY(mu_);
  JsonAnswer json_answer_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> json_deadlines_ ABSL_GUARDED_BY(mu_);
};

// A replica's data socket at `path` that reads every request and answers none.
std::unique_ptr<FakeDataSocket> SilentReplica(const std::string& path) {
  return std::make_unique<FakeDataSocket>(
      path, [](const inference::ModelInferRequest&) { return std::make_pair(-2, std::string()); });
}

// Outcome of one DataChannel call, and when it came.
struct CallOutcome {
  absl::Notification done;
  grpc::Status status;
  absl::Time at;
  inference::ModelInferResponse response;
  DataChannel::Done Callback() {
    return [this](const grpc::Status& s) {
      status = s;
      at = absl::Now();
      done.Notify();
    };
  }
};

std::string TempSocket(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("kiln-rt-" + std::to_string(getpid()) + "-" + name + ".data"))
      .string();
}

inference::ModelInferRequest EncoderRequest() {
  inference::ModelInferRequest req;
  req.set_model_name("encoder");
  req.set_id("q1");
  auto* in = req.add_inputs();
  in->set_name("input_ids");
  in->set_datatype("INT64");
  in->add_shape(1);
  in->add_shape(1);
  in->mutable_contents()->add_int64_contents(7);
  return req;
}

// ModelInfer of EncoderRequest() as `user` (the x-user sticky header), answer in `resp`.
grpc::Status InferAs(inference::GRPCInferenceService::Stub* stub, const std::string& user,
                     inference::ModelInferResponse* resp) {
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-user", user);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return stub->ModelInfer(&ctx, EncoderRequest(), resp);
}

// An answer naming output `name`, serialized.
std::string OutputNamed(const std::string& name) {
  inference::ModelInferResponse r;
  r.set_model_name("encoder");
  r.add_outputs()->set_name(name);
  return r.SerializeAsString();
}

// A local replica with a data socket is reached through it (its gRPC address goes nowhere),
// with the caller's deadline; the answer carries the version that served it.
TEST(RouterDataSocketTest, ALocalReplicaIsReachedThroughItsDataSocket) {
  std::string path = TempSocket("a");
  FakeDataSocket replica(path, [](const inference::ModelInferRequest& req) {
    EXPECT_EQ(req.id(), "q1");
    return std::make_pair(0, OutputNamed("from-data-socket"));
  });
  auto router = StartRouter({{"a.0", "1", "127.0.0.1:1", "", true, path}});
  ASSERT_NE(router, nullptr);
  auto stub = RouterStub(*router);
  for (int i = 0; i < 3; ++i) {  // one connection, used again
    grpc::ClientContext ctx;
    auto before = std::chrono::system_clock::now();
    ctx.set_deadline(before + std::chrono::seconds(30));
    inference::ModelInferResponse resp;
    grpc::Status s = stub->ModelInfer(&ctx, EncoderRequest(), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(resp.outputs_size(), 1);
    EXPECT_EQ(resp.outputs(0).name(), "from-data-socket");
    EXPECT_EQ(resp.parameters().at("kiln-version").string_param(), "1");
    int64_t sent = replica.deadlines().back();
    int64_t at = std::chrono::duration_cast<std::chrono::microseconds>(
                     (before + std::chrono::seconds(30)).time_since_epoch())
                     .count();
    EXPECT_NEAR(static_cast<double>(sent), static_cast<double>(at), 2e6);  // gRPC rounds it
  }
  EXPECT_EQ(replica.requests(), 3);
  EXPECT_EQ(router->retries(), 0u);
}

// `bytes` sent as the request of `method` on the router's gRPC port, whatever they are.
grpc::Status RawUnary(const Router& router, const std::string& method, const std::string& bytes) {
  return kiln::testing::RawUnaryCall("127.0.0.1:" + std::to_string(router.grpc_port()), method,
                                     bytes);
}

// What is not the protocol is refused saying what was expected, and the router serves on; the
// version the router adds replaces one the replica's answer carried.
TEST(RouterDataSocketTest, WhatIsNotTheProtocolIsRefusedAndTheRouterAddsItsVersion) {
  std::string path = TempSocket("proto");
  FakeDataSocket replica(path, [](const inference::ModelInferRequest&) {
    inference::ModelInferResponse r;
    r.add_outputs()->set_name("out");
    (*r.mutable_parameters())["kiln-version"].set_string_param("stale");
    (*r.mutable_parameters())["kept"].set_int64_param(7);
    return std::make_pair(0, r.SerializeAsString());
  });
  auto router = StartRouter({{"p.0", "1", "127.0.0.1:1", "", true, path}});
  ASSERT_NE(router, nullptr);
  grpc::Status s = RawUnary(*router, "/inference.GRPCInferenceService/NoSuchMethod", "");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(s.error_message().find("unknown method"), std::string::npos) << s.error_message();
  s = RawUnary(*router, "/other.Service/ModelInfer", "");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  for (const char* method : {"ModelInfer", "ModelReady", "ModelMetadata"}) {
    s = RawUnary(*router, std::string("/inference.GRPCInferenceService/") + method,
                 std::string("\xff\xff\xff\x0f", 4));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_NE(s.error_message().find("is not an inference."), std::string::npos)
        << s.error_message();
  }
  EXPECT_EQ(replica.requests(), 0);
  auto stub = RouterStub(*router);
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  s = stub->ModelInfer(&ctx, EncoderRequest(), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.parameters().at("kiln-version").string_param(), "1");
  EXPECT_EQ(resp.parameters().at("kept").int64_param(), 7);
  ASSERT_EQ(resp.outputs_size(), 1);
  EXPECT_EQ(resp.outputs(0).name(), "out");
  auto md = ctx.GetServerInitialMetadata();
  auto it = md.find("kiln-version");
  ASSERT_NE(it, md.end());
  EXPECT_EQ(std::string(it->second.data(), it->second.size()), "1");
}

// An answer larger than the reader's growth step (1 MiB) comes back whole, byte for byte, and
// a small one after it on the same connection too.
TEST(RouterDataSocketTest, ALargeAnswerComesBackWhole) {
  std::string path = TempSocket("L");
  std::string big(3 * (1 << 20) + 12345, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 + (i >> 12));
  FakeDataSocket replica(path, [&big](const inference::ModelInferRequest& req) {
    inference::ModelInferResponse r;
    r.set_model_name("encoder");
    r.add_outputs()->set_name("big");
    if (req.id() == "big") r.add_raw_output_contents(big);
    return std::make_pair(0, r.SerializeAsString());
  });
  auto router = StartRouter({{"a.0", "1", "127.0.0.1:1", "", true, path}});
  ASSERT_NE(router, nullptr);
  auto stub = RouterStub(*router);
  for (const std::string id : {"big", "small"}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    inference::ModelInferRequest req = EncoderRequest();
    req.set_id(id);
    inference::ModelInferResponse resp;
    grpc::Status s = stub->ModelInfer(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    if (id == "big") {
      ASSERT_EQ(resp.raw_output_contents_size(), 1);
      EXPECT_TRUE(resp.raw_output_contents(0) == big);
    } else {
      EXPECT_EQ(resp.raw_output_contents_size(), 0);
    }
  }
  EXPECT_EQ(replica.requests(), 2);
}

// The replica's own errors come back as they are, and are not retried elsewhere.
TEST(RouterDataSocketTest, AReplicaErrorPassesThroughUnretried) {
  std::string path = TempSocket("b");
  FakeDataSocket replica(path, [](const inference::ModelInferRequest&) {
    return std::make_pair(static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED),
                          std::string("the queue is full (1024 requests)"));
  });
  auto router = StartRouter({{"b.0", "1", "127.0.0.1:1", "", true, path}});
  ASSERT_NE(router, nullptr);
  auto stub = RouterStub(*router);
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  grpc::Status s = stub->ModelInfer(&ctx, EncoderRequest(), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(s.error_message(), "the queue is full (1024 requests)");
  EXPECT_EQ(router->retries(), 0u);
  EXPECT_EQ(replica.requests(), 1);
}

// Deadlines on a replica that never answers, each ending its call with no other event to wake
// the channel: a later call's deadline set first, then an earlier one's (the timer moved
// earlier), then the later one (the timer set again for the next deadline after the first
// passed).
TEST(RouterDataSocketTest, EachDeadlineEndsItsCallInTurn) {
  std::string path = TempSocket("dl");
  auto silent = SilentReplica(path);
  DataChannel channel(path);
  CallOutcome later, sooner;
  const absl::Time start = absl::Now();
  auto call = [&](CallOutcome& o, absl::Duration in) {
    channel.Call(EncoderRequest(), absl::ToUnixMicros(start + in), &o.response, o.Callback());
  };
  call(later, absl::Milliseconds(400));
  call(sooner, absl::Milliseconds(100));
  ASSERT_TRUE(sooner.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(later.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(sooner.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(later.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // Never before its deadline (absl::Now() may trail the kernel's clock the channel reads by a
  // microsecond or so); the sooner one first.
  EXPECT_GE(sooner.at, start + absl::Milliseconds(99));
  EXPECT_GE(later.at, start + absl::Milliseconds(399));
  EXPECT_LT(sooner.at, later.at);
  EXPECT_TRUE(channel.Idle());
  EXPECT_EQ(silent->requests(), 2);
}

// A replica that stops in the middle of an answer (frozen, say) with the connection open: the
// other calls on the connection still end at their deadlines; the reader does not wait for the
// rest of that frame.
TEST(RouterDataSocketTest, AnAnswerCutOffMidFrameHoldsNoOtherCallsDeadline) {
  std::string path = TempSocket("cut");
  FakeDataSocket replica(path, [](const inference::ModelInferRequest& req) {
    if (req.id() == "cut") return std::make_pair(-3, std::string("only this"));
    return std::make_pair(-2, std::string());  // the others are never answered
  });
  DataChannel channel(path);
  CallOutcome cut, other;
  inference::ModelInferRequest cut_req = EncoderRequest();
  cut_req.set_id("cut");
  channel.Call(cut_req, 0, &cut.response, cut.Callback());
  // It answers (the cut frame) as soon as it has read the request.
  ASSERT_TRUE(kiln::testing::Eventually([&] { return replica.requests() == 1; }, absl::Seconds(10)));
  const int64_t deadline = absl::ToUnixMicros(absl::Now() + absl::Milliseconds(200));
  channel.Call(EncoderRequest(), deadline, &other.response, other.Callback());
  ASSERT_TRUE(other.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(other.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_FALSE(cut.done.HasBeenNotified());
  channel.FailAll();
  ASSERT_TRUE(cut.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(cut.status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

// A replica stopped in the middle of an answer for longer than the stall limit has its
// connection closed: a call without a deadline on it fails UNAVAILABLE (retried elsewhere by
// the router) instead of waiting for the rest of the frame for ever.
TEST(RouterDataSocketTest, AReplicaStoppedMidAnswerPastTheStallLimitLosesItsConnection) {
  std::string path = TempSocket("stall");
  FakeDataSocket replica(path, [](const inference::ModelInferRequest&) {
    return std::make_pair(-3, std::string("only this"));
  });
  DataChannel channel(path);
  channel.set_answer_stall_limit(absl::Milliseconds(300));
  CallOutcome cut;
  channel.Call(EncoderRequest(), /*deadline_unix_micros=*/0, &cut.response, cut.Callback());
  ASSERT_TRUE(cut.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(cut.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(cut.status.error_message().find("stopped in the middle of an answer"),
            std::string::npos)
      << cut.status.error_message();
  EXPECT_EQ(replica.requests(), 1);
}

// The stall limit is for a frame begun and not finished: a connection idle between answers
// for longer than it is kept.
TEST(RouterDataSocketTest, AnIdleConnectionOutlivesTheStallLimit) {
  std::string path = TempSocket("idle");
  FakeDataSocket replica(path, [](const inference::ModelInferRequest&) {
    return std::make_pair(0, OutputNamed("y"));
  });
  DataChannel channel(path);
  channel.set_answer_stall_limit(absl::Milliseconds(50));
  for (int i = 0; i < 2; ++i) {
    CallOutcome call;
    channel.Call(EncoderRequest(), 0, &call.response, call.Callback());
    ASSERT_TRUE(call.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    EXPECT_TRUE(call.status.ok()) << call.status.error_message();
    if (i == 0) absl::SleepFor(absl::Milliseconds(200));  // idle, four limits long
  }
  EXPECT_EQ(channel.connections_made(), 1);
}

// A replica that never answers: a call past its deadline fails DEADLINE_EXCEEDED (the router
// does not keep it forever), and a stopping router fails the ones without a deadline.
TEST(RouterDataSocketTest, CallsEndAtTheirDeadlineOrWhenTheChannelCloses) {
  std::string path = TempSocket("e");
  auto silent = SilentReplica(path);
  DataChannel channel(path);
  inference::ModelInferResponse resp;
  CallOutcome late, forever;
  const int64_t deadline = absl::ToUnixMicros(absl::Now() + absl::Milliseconds(200));
  channel.Call(EncoderRequest(), deadline, &late.response, late.Callback());
  channel.Call(EncoderRequest(), 0, &forever.response, forever.Callback());
  ASSERT_TRUE(late.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_FALSE(forever.done.HasBeenNotified());
  EXPECT_FALSE(channel.Idle());
  channel.FailAll();
  ASSERT_TRUE(forever.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(forever.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  // The router ended it, not the replica, and says so.
  EXPECT_NE(forever.status.error_message().find("the router closed the connection (it is stopping)"),
            std::string::npos)
      << forever.status.error_message();
  EXPECT_TRUE(channel.Idle());
  // And after FailAll every new call fails at once.
  grpc::Status after;
  channel.Call(EncoderRequest(), 0, &resp, [&](const grpc::Status& s) { after = s; });
  EXPECT_EQ(after.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(silent->requests(), 2);
}

// A replica that goes away under a call (its connection closes before it answers), and one
// whose socket is not there at all: the call is retried once elsewhere and the client never
// sees it.
TEST(RouterDataSocketTest, AReplicaGoneFromItsDataSocketIsRetriedElsewhere) {
  OneAnswerReplica good(grpc::Status::OK);
  int port = 0;
  auto server = Serve(&good, &port);
  ASSERT_GT(port, 0);
  const std::string good_address = "127.0.0.1:" + std::to_string(port);
  {
    std::string path = TempSocket("c");
    FakeDataSocket closing(path, [](const inference::ModelInferRequest&) {
      return std::make_pair(-1, std::string());
    });
    // Both replicas local; "gone.0" sorts first and is tried first when both are idle.
    auto router = StartRouter({{"gone.0", "1", "127.0.0.1:1", "", true, path},
                               {"good.0", "1", good_address, "", false, ""}});
    ASSERT_NE(router, nullptr);
    auto stub = RouterStub(*router);
    int ok = 0;
    for (int i = 0; i < 4; ++i) {
      grpc::ClientContext ctx;
      inference::ModelInferResponse resp;
      grpc::Status s = stub->ModelInfer(&ctx, EncoderRequest(), &resp);
      EXPECT_TRUE(s.ok()) << s.error_message();
      ok += s.ok();
    }
    EXPECT_EQ(ok, 4);
    EXPECT_GE(closing.requests(), 1);
    EXPECT_EQ(router->retries(), static_cast<uint64_t>(closing.requests()));
  }
  {
    auto router = StartRouter({{"gone.0", "1", "127.0.0.1:1", "", true, TempSocket("missing")},
                               {"good.0", "1", good_address, "", false, ""}});
    ASSERT_NE(router, nullptr);
    auto stub = RouterStub(*router);
    grpc::ClientContext ctx;
    inference::ModelInferResponse resp;
    grpc::Status s = stub->ModelInfer(&ctx, EncoderRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
}

// An answer that is not a ModelInferResponse is an error, not a garbled success.
TEST(RouterDataSocketTest, AGarbledAnswerIsAnInternalError) {
  std::string path = TempSocket("d");
  FakeDataSocket replica(path, [](const inference::ModelInferRequest&) {
    return std::make_pair(0, std::string("\xff\xff\xff\xff not a message", 20));
  });
  auto router = StartRouter({{"d.0", "1", "127.0.0.1:1", "", true, path}});
  ASSERT_NE(router, nullptr);
  auto stub = RouterStub(*router);
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  grpc::Status s = stub->ModelInfer(&ctx, EncoderRequest(), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_NE(s.error_message().find("not an inference.ModelInferResponse"), std::string::npos)
      << s.error_message();
}

// A listening unix socket at `path` that never accepts (backlog `backlog`): a replica wedged
// before its accept. Closed with the object.
struct NeverAccepting {
  NeverAccepting(const std::string& path, int backlog) : path(path) {
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
    ::unlink(path.c_str());
    EXPECT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(fd, backlog), 0);
  }
  ~NeverAccepting() {
    ::close(fd);
    ::unlink(path.c_str());
  }
  std::string path;
  int fd;
};

// A replica that accepted the connection but reads nothing (stopped, wedged): the router's
// request threads do not wait on it, however large the requests, and the calls end at their
// deadlines.
TEST(RouterDataSocketTest, AReplicaThatReadsNothingNeverHoldsTheCallers) {
  std::string path = TempSocket("w");
  NeverAccepting wedged(path, 4);  // the connection sits in its backlog, never read
  DataChannel channel(path);
  inference::ModelInferRequest big = EncoderRequest();
  big.add_raw_input_contents(std::string(8 << 20, 'x'));  // far more than a socket buffer
  const int64_t deadline = absl::ToUnixMicros(absl::Now() + absl::Milliseconds(300));
  CallOutcome first, second;
  channel.Call(big, deadline, &first.response, first.Callback());  // returns: nothing waits
  channel.Call(big, deadline, &second.response, second.Callback());
  ASSERT_TRUE(first.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(second.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(first.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(channel.Idle());
}

// A replica that stopped accepting with its backlog full: the call is refused at once
// (UNAVAILABLE: the router tries another replica), not left waiting in connect.
TEST(RouterDataSocketTest, AReplicaWithAFullBacklogIsUnavailableAtOnce) {
  std::string path = TempSocket("b");
  NeverAccepting wedged(path, 0);
  // Fill its backlog the way other callers would.
  std::vector<int> held;
  for (int i = 0; i < 16; ++i) {
    auto fd = ConnectUnix(path);
    if (!fd.ok()) break;
    held.push_back(*fd);
  }
  ASSERT_LT(held.size(), 16u) << "the backlog never filled";
  DataChannel channel(path);
  CallOutcome call;
  channel.Call(EncoderRequest(), 0, &call.response, call.Callback());
  ASSERT_TRUE(call.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(call.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(call.status.error_message().find("backlog is full"), std::string::npos)
      << call.status.error_message();
  for (int fd : held) ::close(fd);
  // And a socket file nobody listens on any more is not "in use": it can be listened on again.
}

// A burst of first calls on a new channel makes one connection, not one each (which would
// fill the replica's backlog and refuse calls to a healthy replica).
// A caller that took a replica's channel (ChannelFor) just as the replica left the routing
// table: the channel is neither retired before its call is on it nor destroyed under it.
TEST(RouterDataSocketTest, AChannelLeavingTheTableKeepsTheCallJustMadeOnIt) {
  std::string path = TempSocket("ret");
  auto silent = SilentReplica(path);
  auto router = StartRouter({{"a.0", "1", "127.0.0.1:1", "", true, path}});
  ASSERT_NE(router, nullptr);
  std::shared_ptr<DataChannel> channel = router->ChannelFor(path);
  ASSERT_NE(channel, nullptr);
  auto without = std::make_shared<RouterTable>();
  router->SetTable(without);  // the replica left the table
  CallOutcome call;
  channel->Call(EncoderRequest(), 0, &call.response, call.Callback());
  channel.reset();
  router->SetTable(without);
  router->SetTable(without);
  ASSERT_TRUE(kiln::testing::Eventually([&] { return silent->requests() == 1; }, absl::Seconds(10)));
  router->SetTable(without);
  EXPECT_FALSE(call.done.HasBeenNotified()) << call.status.error_message();
  router->Stop();  // it fails now, as the router stops
  ASSERT_TRUE(call.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(call.status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST(RouterDataSocketTest, ABurstOfFirstCallsSharesOneConnection) {
  std::string path = TempSocket("u");
  FakeDataSocket replica(path, [](const inference::ModelInferRequest&) {
    return std::make_pair(0, OutputNamed("embedding"));
  });
  DataChannel channel(path);
  constexpr int kCallers = 100;
  std::vector<CallOutcome> calls(kCallers);
  std::vector<std::thread> threads;
  absl::Notification go;
  for (int i = 0; i < kCallers; ++i) {
    threads.emplace_back([&, i] {
      go.WaitForNotification();
      channel.Call(EncoderRequest(), 0, &calls[i].response, calls[i].Callback());
    });
  }
  go.Notify();
  for (auto& t : threads) t.join();
  for (int i = 0; i < kCallers; ++i) {
    ASSERT_TRUE(calls[i].done.WaitForNotificationWithTimeout(absl::Seconds(30))) << i;
    EXPECT_TRUE(calls[i].status.ok()) << i << ": " << calls[i].status.error_message();
  }
  EXPECT_EQ(replica.requests(), kCallers);
  EXPECT_EQ(channel.connections_made(), 1);
}

// A replica whose ModelMetadata answers only when the test lets it.
class HeldMetadataReplica : public inference::GRPCInferenceService::Service {
 public:
  grpc::Status ModelMetadata(grpc::ServerContext*, const inference::ModelMetadataRequest* req,
                             inference::ModelMetadataResponse* resp) override {
    arrived_++;
    release_.WaitForNotificationWithTimeout(absl::Seconds(30));
    resp->set_name(req->name());
    resp->add_versions("1");
    return grpc::Status::OK;
  }
  std::atomic<int> arrived_{0};
  absl::Notification release_;
};

// ModelMetadata is passed to the replica without holding one of the router's threads while
// the replica answers: with many metadata calls held at a slow replica, the router still
// answers other calls, and each held call gets the replica's answer once it comes.
TEST(RouterTest, ModelMetadataWaitsForTheReplicaWithoutHoldingTheRouter) {
  HeldMetadataReplica replica;
  auto [server, router, stub] = ServeBehindRouter(&replica, "m.0", true);
  ASSERT_NE(router, nullptr);
  constexpr int kHeld = 48;
  struct Call {
    grpc::ClientContext ctx;
    inference::ModelMetadataRequest req;
    inference::ModelMetadataResponse resp;
    grpc::Status status;
    absl::Notification done;
  };
  std::vector<std::unique_ptr<Call>> calls;
  for (int i = 0; i < kHeld; ++i) {
    auto c = std::make_unique<Call>();
    c->req.set_name("encoder");
    c->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    stub->async()->ModelMetadata(&c->ctx, &c->req, &c->resp, [p = c.get()](grpc::Status s) {
      p->status = s;
      p->done.Notify();
    });
    calls.push_back(std::move(c));
  }
  for (int i = 0; i < 3000 && replica.arrived_.load() < kHeld; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(replica.arrived_.load(), kHeld) << "every call reaches the replica while held";
  grpc::ClientContext live_ctx;
  live_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  inference::ServerLiveResponse live;
  EXPECT_TRUE(stub->ServerLive(&live_ctx, {}, &live).ok());
  EXPECT_TRUE(live.live());
  for (const auto& c : calls) EXPECT_FALSE(c->done.HasBeenNotified());
  replica.release_.Notify();
  for (const auto& c : calls) {
    ASSERT_TRUE(c->done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    EXPECT_TRUE(c->status.ok()) << c->status.error_message();
    EXPECT_EQ(c->resp.name(), "encoder");
  }
  router->Stop();
  server->Shutdown();
}

// The router keeps a gRPC client per address it routes to, not per address it ever routed to
// (a replica restarted on a new port, a node gone): one no longer in the table is dropped.
TEST(RouterTest, GrpcClientsOfAddressesNoLongerRoutedAreDropped) {
  OneAnswerReplica replica(grpc::Status::OK);
  int port = 0;
  auto server = Serve(&replica, &port);
  ASSERT_GT(port, 0);
  auto router = StartRouter({});
  ASSERT_NE(router, nullptr);
  auto stub = RouterStub(*router);
  // The same replica under two spellings of its address, as if it had moved each time.
  for (const std::string host : {"127.0.0.1", "localhost", "127.0.0.1", "localhost"}) {
    router->SetTable(HalfAndHalf({{"a/1", "1", host + ":" + std::to_string(port), "", false, ""},
                                  {"a/2", "2", host + ":" + std::to_string(port), "", false, ""}}));
    ASSERT_TRUE(InferEncoder(stub.get()).ok()) << host;
    EXPECT_EQ(router->stubs(), 1u) << host;
  }
  router->Stop();
  server->Shutdown();
}

// A channel that busy-polls for answers: each call gets its own answer whether it comes inside
// the spin window (quick answers; windows of 20 ms) or long after it (answers of 60 ms, which
// the channel sleeps for), a call past its deadline still fails at the deadline, some answers
// were found by spinning, and every spinner gave its slot back.
TEST(RouterDataSocketTest, ABusyPollingChannelAnswersEveryCallAndKeepsDeadlines) {
  std::string path = TempSocket("p");
  FakeDataSocket replica(path, [&](const inference::ModelInferRequest& req) {
    if (req.id() == "silent") return std::make_pair(-2, std::string());
    if (req.id().rfind("slow", 0) == 0) absl::SleepFor(absl::Milliseconds(60));
    inference::ModelInferResponse r;
    r.set_id(req.id());
    return std::make_pair(0, r.SerializeAsString());
  });
  auto slots = std::make_shared<SpinSlots>(1);
  DataChannel channel(path, /*spin_window_micros=*/20000, slots);
  auto call = [&](const std::string& id) {
    CallOutcome out;
    inference::ModelInferRequest req = EncoderRequest();
    req.set_id(id);
    channel.Call(req, 0, &out.response, out.Callback());
    ASSERT_TRUE(out.done.WaitForNotificationWithTimeout(absl::Seconds(30))) << id;
    ASSERT_TRUE(out.status.ok()) << id << ": " << out.status.error_message();
    EXPECT_EQ(out.response.id(), id);
  };
  for (int i = 0; i < 20; ++i) call("quick" + std::to_string(i));
  EXPECT_GT(channel.spins(), 0u);
  EXPECT_GT(channel.spin_answers(), 0u);
  for (int i = 0; i < 3; ++i) call("slow" + std::to_string(i));
  call("quick-again");
  EXPECT_EQ(slots->free(), 1);
  CallOutcome late;
  inference::ModelInferRequest silent = EncoderRequest();
  silent.set_id("silent");
  channel.Call(silent, absl::ToUnixMicros(absl::Now() + absl::Milliseconds(50)), &late.response,
               late.Callback());
  ASSERT_TRUE(late.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(slots->free(), 1);
}

// With no spin slot free (another reader holds it), a channel sleeps for its answers as it
// would without busy-polling.
TEST(RouterDataSocketTest, ABusyPollingChannelWithoutASlotSleeps) {
  std::string path = TempSocket("q");
  FakeDataSocket replica(path, [](const inference::ModelInferRequest&) {
    return std::make_pair(0, OutputNamed("embedding"));
  });
  auto slots = std::make_shared<SpinSlots>(1);
  ASSERT_TRUE(slots->TryAcquire());  // held elsewhere
  DataChannel channel(path, 200, slots);
  for (int i = 0; i < 10; ++i) {
    CallOutcome call;
    channel.Call(EncoderRequest(), 0, &call.response, call.Callback());
    ASSERT_TRUE(call.done.WaitForNotificationWithTimeout(absl::Seconds(30))) << i;
    ASSERT_TRUE(call.status.ok()) << call.status.error_message();
  }
  EXPECT_EQ(channel.spins(), 0u);
  slots->Release();
}

// A replica's batcher answers out of order: each answer reaches the call it belongs to.
TEST(RouterDataSocketTest, AnswersOutOfOrderReachTheirOwnCalls) {
  std::string path = TempSocket("o");
  auto listening = ListenUnix(path, "test");
  ASSERT_TRUE(listening.ok()) << listening.status();
  constexpr int kCalls = 5;
  std::thread replica([fd = *listening] {
    int conn = ::accept(fd, nullptr, nullptr);
    ASSERT_GE(conn, 0);
    std::vector<std::pair<uint64_t, std::string>> got;  // (tag, request id)
    char head[kFrameHeaderBytes];
    std::string body;
    while (got.size() < kCalls && ReadFull(conn, head, sizeof(head))) {
      FrameHeader h = DecodeFrameHeader(head);
      body.resize(h.length);
      ASSERT_TRUE(ReadFull(conn, body.data(), body.size()));
      inference::ModelInferRequest req;
      ASSERT_TRUE(req.ParseFromString(body));
      got.emplace_back(h.tag, req.id());
    }
    for (auto it = got.rbegin(); it != got.rend(); ++it) {  // last asked, first answered
      inference::ModelInferResponse r;
      r.set_id(it->second);
      std::string f = EncodeFrame(it->first, 0, 0, r.SerializeAsString());
      ASSERT_TRUE(WriteFull(conn, f.data(), f.size()));
    }
    char drain;
    while (::read(conn, &drain, 1) > 0) {
    }
    ::close(conn);
  });
  {
    DataChannel channel(path);
    CallOutcome calls[kCalls];
    for (int i = 0; i < kCalls; ++i) {
      inference::ModelInferRequest req = EncoderRequest();
      req.set_id("q" + std::to_string(i));
      channel.Call(req, 0, &calls[i].response, calls[i].Callback());
    }
    for (int i = 0; i < kCalls; ++i) {
      ASSERT_TRUE(calls[i].done.WaitForNotificationWithTimeout(absl::Seconds(30)));
      EXPECT_TRUE(calls[i].status.ok()) << calls[i].status.error_message();
      EXPECT_EQ(calls[i].response.id(), "q" + std::to_string(i));
    }
  }  // the channel closes its connection: the replica's thread ends
  replica.join();
  ::close(*listening);
  ::unlink(path.c_str());
}

// A replica whose server cancels the call as it shuts down at the end of a drain: the router
// retries elsewhere, as for a refused one, so the client never sees it.
TEST(RouterRetryTest, ACallCancelledByTheReplicaIsRetriedElsewhere) {
  OneAnswerReplica cancelling(grpc::Status(grpc::StatusCode::CANCELLED, "server shutdown"));
  OneAnswerReplica good(grpc::Status::OK);
  int ports[2] = {0, 0};
  std::unique_ptr<grpc::Server> servers[2];
  OneAnswerReplica* services[2] = {&cancelling, &good};
  for (int i = 0; i < 2; ++i) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &ports[i]);
    b.RegisterService(services[i]);
    servers[i] = b.BuildAndStart();
    ASSERT_GT(ports[i], 0);
  }
  auto router = StartRouter({{"gone.0", "1", "127.0.0.1:" + std::to_string(ports[0]), "", false, ""},
                             {"good.0", "1", "127.0.0.1:" + std::to_string(ports[1]), "", false, ""}});
  ASSERT_NE(router, nullptr);
  auto stub = RouterStub(*router);
  for (int i = 0; i < 20; ++i) {
    grpc::Status s = InferEncoder(stub.get());
    ASSERT_TRUE(s.ok()) << i << ": " << s.error_message();
  }
  EXPECT_GT(cancelling.calls_.load(), 0);  // it was tried, and its cancellations retried
  EXPECT_EQ(router->retries(), static_cast<uint64_t>(cancelling.calls_.load()));
  EXPECT_EQ(good.calls_.load(), 20);
  router->Stop();
  for (auto& s : servers) s->Shutdown();
}

// A replica's inference server whose ModelInfer holds every call until released.
class HeldInferReplica : public inference::GRPCInferenceService::Service {
 public:
  grpc::Status ModelInfer(grpc::ServerContext* ctx, const inference::ModelInferRequest*,
                          inference::ModelInferResponse* resp) override {
    arrived_.Notify();
    for (int i = 0; i < 3000 && !release_.HasBeenNotified(); ++i) {
      if (ctx->IsCancelled()) {
        cancelled_ = true;
        return grpc::Status::CANCELLED;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    resp->add_outputs()->set_name("embedding");
    return grpc::Status::OK;
  }
  absl::Notification arrived_;
  absl::Notification release_;
  std::atomic<bool> cancelled_{false};  // its caller cancelled the call
};

// A gRPC call sent on to another node that never answers, from a caller with no deadline:
// the router's stop cancels it when its grace is over, and the call sent on with it (it
// carries the caller's cancellation), so that no forward's callback outlives the router; it
// is not retried.
TEST(RouterStopTest, StopsWithAGrpcForwardToAnotherNodeInFlight) {
  HeldInferReplica other_node;
  auto [server, router, stub] = ServeBehindRouter(&other_node, "b/1", false);
  ASSERT_NE(router, nullptr);
  grpc::Status status;
  absl::Notification done;
  grpc::ClientContext ctx;  // no deadline
  inference::ModelInferRequest req;
  req.set_model_name("encoder");
  inference::ModelInferResponse resp;
  stub->async()->ModelInfer(&ctx, &req, &resp, [&](grpc::Status s) {
    status = s;
    done.Notify();
  });
  ASSERT_TRUE(other_node.arrived_.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(router->grpc_calls_out(), 1);
  router->Stop();
  // Stop returned once the forward's callback was done with the router.
  EXPECT_EQ(router->grpc_calls_out(), 0);
  // The call sent on was cancelled with the caller's: nothing of it runs on after the router.
  EXPECT_TRUE(kiln::testing::Eventually([&] { return other_node.cancelled_.load(); },
                                        absl::Seconds(10)));
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(router->retries(), 0u);
  other_node.release_.Notify();
  server->Shutdown();
}

// Another node that does not answer is left out of the retry altogether, not only the
// endpoint (version) that was tried: its other versions' endpoints are on the same router.
TEST(RouterRetryTest, ARetryAfterANodeFailedGoesToAnotherNode) {
  OneAnswerReplica good(grpc::Status::OK);
  int port = 0;
  auto server = Serve(&good, &port);
  ASSERT_GT(port, 0);
  auto router = StartRouter({});
  ASSERT_NE(router, nullptr);
  const std::string dead = "127.0.0.1:1";  // node B: nobody listens
  router->SetTable(HalfAndHalf({{"B/1", "1", dead, "", false, ""},
                                {"B/2", "2", dead, "", false, ""},
                                {"C/1", "1", "127.0.0.1:" + std::to_string(port), "", false, ""}}));
  auto stub = RouterStub(*router);
  for (int i = 0; i < 40; ++i) {
    grpc::Status s = InferEncoder(stub.get());
    ASSERT_TRUE(s.ok()) << i << ": " << s.error_message();
  }
  EXPECT_EQ(good.calls_.load(), 40);
  router->Stop();
  server->Shutdown();
}

// With no other replica to retry on, the caller gets the first try's failure, and no retry is
// counted.
TEST(RouterRetryTest, WithNowhereElseTheFirstFailureIsAnsweredAndNoRetryCounted) {
  OneAnswerReplica gone(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the replica is draining"));
  auto [server, router, stub] = ServeBehindRouter(&gone, "a.0", true);
  ASSERT_NE(router, nullptr);
  grpc::Status s = InferEncoder(stub.get());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(s.error_message(), "the replica is draining");
  EXPECT_EQ(router->retries(), 0u);
  router->Stop();
  server->Shutdown();
}

// A caller that cancels its call: the call sent on is cancelled with it, and it is not sent
// anywhere else (a retry would run the model for nobody).
TEST(RouterRetryTest, ACallerThatCancelsIsNotRetried) {
  HeldInferReplica held;
  OneAnswerReplica other(grpc::Status::OK);
  int held_port = 0, other_port = 0;
  auto held_server = Serve(&held, &held_port);
  auto other_server = Serve(&other, &other_port);
  ASSERT_GT(held_port, 0);
  ASSERT_GT(other_port, 0);
  // Equal but for their ids: "a/1" is chosen first.
  auto router = StartRouter({{"a/1", "1", "127.0.0.1:" + std::to_string(held_port), "", false, ""},
                             {"z/1", "1", "127.0.0.1:" + std::to_string(other_port), "", false, ""}});
  ASSERT_NE(router, nullptr);
  auto stub = RouterStub(*router);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  inference::ModelInferRequest req;
  req.set_model_name("encoder");
  inference::ModelInferResponse resp;
  absl::Notification done;
  grpc::Status status;
  stub->async()->ModelInfer(&ctx, &req, &resp, [&](grpc::Status s) {
    status = s;
    done.Notify();
  });
  ASSERT_TRUE(held.arrived_.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ctx.TryCancel();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(kiln::testing::Eventually([&] { return held.cancelled_.load(); }, absl::Seconds(10)));
  EXPECT_EQ(other.calls_.load(), 0);
  EXPECT_EQ(router->retries(), 0u);
  router->Stop();
  held.release_.Notify();
  held_server->Shutdown();
  other_server->Shutdown();
}

// A replica that cancels a call as its server stops, with nowhere else to retry: the caller
// gets UNAVAILABLE (what clients retry), not CANCELLED (what they take as their own doing).
TEST(RouterRetryTest, AReplicaThatWentAwayIsUnavailableToTheCaller) {
  OneAnswerReplica stopping(grpc::Status(grpc::StatusCode::CANCELLED, "server shutdown"));
  auto [server, router, stub] = ServeBehindRouter(&stopping, "b/1", false);
  ASSERT_NE(router, nullptr);
  grpc::Status s = InferEncoder(stub.get());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_EQ(s.error_message(), "the replica went away: server shutdown");
  router->Stop();
  server->Shutdown();
}

// A REST forward over HTTP still waiting on its replica when the router stops: the client is
// answered 503 before the REST server closes its connection, and Stop fails the forward and
// waits for its callback (which uses the router). Before, the continuation could run on the
// freed router.
TEST(RouterStopTest, StopsWithARestForwardInFlight) {
  absl::Mutex mu;
  std::vector<HttpReply> parked;  // the replica never answers on its own
  HttpServer::Options ho;
  ho.bind_address = "127.0.0.1";
  auto replica = HttpServer::Start(ho, [&](HttpRequest, HttpReply reply) {
    absl::MutexLock lock(&mu);
    parked.push_back(reply);
  });
  ASSERT_TRUE(replica.ok()) << replica.status();
  auto router = StartRouter(
      {{"slow.0", "1", "127.0.0.1:1", "127.0.0.1:" + std::to_string((*replica)->port()), false, ""}});
  ASSERT_NE(router, nullptr);
  std::atomic<int> code{-1};
  std::thread client([&] {
    testing::RawHttpClient c(router->http_port());
    code = c.Send(testing::Post("/v2/models/encoder/infer", "{}")) ? c.Read().code : 0;
  });
  {
    absl::MutexLock lock(&mu);
    auto arrived = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return !parked.empty(); };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&arrived), absl::Seconds(10)));
  }
  router->Stop();
  router.reset();  // nothing of the forward may run after this
  client.join();
  EXPECT_EQ(code.load(), 503);
  (*replica)->Stop(absl::Seconds(1));
}

// A REST inference whose body comes chunked (no Content-Length) reaches the replica whole; one
// with no body at all is refused by the router (400), not passed on.
TEST(RouterRestTest, AChunkedBodyIsForwardedWhole) {
  HttpServer::Options ho;
  ho.bind_address = "127.0.0.1";
  std::atomic<int> calls{0};
  auto replica = HttpServer::Start(ho, [&](HttpRequest request, HttpReply reply) {
    calls++;
    reply.Send(200, nlohmann::json{{"model_name", "encoder"}, {"received", request.body}}.dump(),
               "application/json");
  });
  ASSERT_TRUE(replica.ok()) << replica.status();
  auto router = StartRouter(
      {{"r.0", "1", "127.0.0.1:1", "127.0.0.1:" + std::to_string((*replica)->port()), false, ""}});
  ASSERT_NE(router, nullptr);
  std::string body = R"({"inputs":[{"name":"x","datatype":"INT64","shape":[1,3],"data":[1,2,3]}]})";
  testing::RawHttpClient c(router->http_port());
  ASSERT_TRUE(c.Send(testing::PostChunked("/v2/models/encoder/infer", body, 5)));
  auto r = c.Read();
  ASSERT_EQ(r.code, 200) << r.head << r.body;
  EXPECT_EQ(nlohmann::json::parse(r.body)["received"], body);
  for (const std::string& empty : {testing::Post("/v2/models/encoder/infer", ""),
                                   testing::PostChunked("/v2/models/encoder/infer", "", 4)}) {
    testing::RawHttpClient e(router->http_port());
    ASSERT_TRUE(e.Send(empty));
    auto refused = e.Read();
    EXPECT_EQ(refused.code, 400) << refused.head << refused.body;
    EXPECT_NE(refused.body.find("no body"), std::string::npos) << refused.body;
  }
  EXPECT_EQ(calls.load(), 1);
  router->Stop();
  (*replica)->Stop(absl::Seconds(1));
}

// A fake REST replica answering every call with an output named `output`; records the paths
// and forwarded-by headers it was sent.
struct FakeRestReplica {
  explicit FakeRestReplica(std::string output) {
    HttpServer::Options ho;
    ho.bind_address = "127.0.0.1";
    auto s = HttpServer::Start(ho, [this, output](HttpRequest request, HttpReply reply) {
      {
        absl::MutexLock lock(&mu);
        paths.push_back(request.path);
        auto by = request.Header(kForwardedHeader);
        forwarded_by.push_back(by ? std::string(*by) : "");
      }
      reply.Send(200,
                 nlohmann::json{{"model_name", "encoder"}, {"outputs", {{{"name", output}}}}}.dump(),
                 "application/json");
    });
    EXPECT_TRUE(s.ok()) << s.status();
    if (s.ok()) server = std::move(*s);
  }
  ~FakeRestReplica() {
    if (server) server->Stop(absl::Seconds(1));
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(server->port()); }
  std::unique_ptr<HttpServer> server;
  absl::Mutex mu;
  std::vector<std::string> paths ABSL_GUARDED_BY(mu);
  std::vector<std::string> forwarded_by ABSL_GUARDED_BY(mu);
};

// Node `name`'s table: "encoder" split 50/50 between versions 1 and 2 by the x-user header,
// `local_version` served by a local replica and the other version by `other`'s router.
std::shared_ptr<RouterTable> TwoNodeTable(const std::string& name,
                                          const std::string& local_version,
                                          const std::string& data_socket,
                                          const std::string& rest_address, const Router& other) {
  auto table = std::make_shared<RouterTable>();
  RouterTable::Route& route = table->routes["encoder"];
  route.model = "encoder";
  route.versions = {{"1", 50}, {"2", 50}};
  route.sticky_header = "x-user";
  route.endpoints.push_back(
      {name + ".r0", local_version, "127.0.0.1:1", rest_address, true, data_socket});
  route.endpoints.push_back({"other-node", local_version == "1" ? "2" : "1",
                             "127.0.0.1:" + std::to_string(other.grpc_port()),
                             "127.0.0.1:" + std::to_string(other.http_port()), false, ""});
  return table;
}

// Two nodes' routers, each serving one version of "encoder" itself and the other through the
// other node, split by a sticky header. A call sent on to the other node is served there with
// the version the first router chose (the version it reports is the one that served), the same
// version for the same key every time; a call the other node was sent is never sent back.
TEST(RouterForwardTest, TheVersionChosenHereIsTheOneServedOnTheOtherNode) {
  FakeDataSocket data1(TempSocket("fwd1"), [](const inference::ModelInferRequest&) {
    return std::make_pair(0, OutputNamed("served-by-1"));
  });
  FakeDataSocket data2(TempSocket("fwd2"), [](const inference::ModelInferRequest& req) {
    EXPECT_TRUE(req.model_version().empty() || req.model_version() == "2") << req.model_version();
    return std::make_pair(0, OutputNamed("served-by-2"));
  });
  FakeRestReplica rest1("served-by-1"), rest2("served-by-2");
  ASSERT_TRUE(rest1.server && rest2.server);
  auto a = StartRouter({});
  auto b = StartRouter({});
  ASSERT_TRUE(a && b);
  a->SetTable(TwoNodeTable("a", "1", TempSocket("fwd1"), rest1.address(), *b));
  b->SetTable(TwoNodeTable("b", "2", TempSocket("fwd2"), rest2.address(), *a));
  auto stub = RouterStub(*a);
  std::set<std::string> seen;
  for (int k = 0; k < 24; ++k) {
    const std::string user = "user-" + std::to_string(k);
    std::string first;
    for (int rep = 0; rep < 2; ++rep) {
      inference::ModelInferResponse resp;
      grpc::Status s = InferAs(stub.get(), user, &resp);
      ASSERT_TRUE(s.ok()) << user << ": " << s.error_message();
      const std::string version = resp.parameters().at("kiln-version").string_param();
      ASSERT_EQ(resp.outputs_size(), 1);
      EXPECT_EQ(resp.outputs(0).name(), "served-by-" + version) << user;
      if (rep == 0) first = version;
      EXPECT_EQ(version, first) << user << " saw two versions";
      seen.insert(version);
    }
    // The same over REST, through the same router.
    testing::RawHttpClient c(a->http_port());
    ASSERT_TRUE(c.Send(testing::Post("/v2/models/encoder/infer",
                                     R"({"inputs":[{"name":"x","datatype":"INT64","shape":[1],"data":[1]}]})",
                                     "x-user: " + user + "\r\n")));
    auto r = c.Read();
    ASSERT_EQ(r.code, 200) << r.head << r.body;
    auto doc = nlohmann::json::parse(r.body);
    EXPECT_EQ(doc["parameters"]["kiln-version"], first) << user;
    EXPECT_EQ(doc["outputs"][0]["name"], "served-by-" + first) << user;
  }
  EXPECT_EQ(seen, (std::set<std::string>{"1", "2"}));  // 24 keys split 50/50
  EXPECT_EQ(a->retries() + b->retries(), 0u);
  {
    // Node b's replica was sent node a's REST calls (the only ones it had) at the path of the
    // version node a chose, and without the routers' header.
    absl::MutexLock lock(&rest2.mu);
    ASSERT_FALSE(rest2.paths.empty());
    for (size_t i = 0; i < rest2.paths.size(); ++i) {
      EXPECT_EQ(rest2.paths[i], "/v2/models/encoder/versions/2/infer");
      EXPECT_EQ(rest2.forwarded_by[i], "") << "a router's header reached a replica";
    }
  }
  // A call node b is sent by another router for a version it serves only through another node
  // is not sent on: UNAVAILABLE, for the sender to try elsewhere. Node a's replica sees nothing.
  const int served_by_1 = data1.requests();
  auto stub_b = RouterStub(*b);
  grpc::ClientContext ctx;
  ctx.AddMetadata(kForwardedHeader, "a");
  inference::ModelInferRequest pinned = EncoderRequest();
  pinned.set_model_version("1");
  inference::ModelInferResponse resp;
  grpc::Status s = stub_b->ModelInfer(&ctx, pinned, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  {
    grpc::ClientContext mctx;
    mctx.AddMetadata(kForwardedHeader, "a");
    mctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    inference::ModelMetadataRequest mreq;
    mreq.set_name("encoder");
    mreq.set_version("1");
    inference::ModelMetadataResponse mresp;
    grpc::Status m = stub_b->ModelMetadata(&mctx, mreq, &mresp);
    EXPECT_EQ(m.error_code(), grpc::StatusCode::UNAVAILABLE) << m.error_message();
  }
  testing::RawHttpClient c(b->http_port());
  ASSERT_TRUE(c.Send(testing::Post("/v2/models/encoder/versions/1/infer",
                                   R"({"inputs":[]})", std::string(kForwardedHeader) + ": a\r\n")));
  EXPECT_EQ(c.Read().code, 503);
  EXPECT_EQ(data1.requests(), served_by_1);
  a->Stop();
  b->Stop();
}

// Node a's table is older than node b's: it still lists version 1 on node b, which no longer
// serves it (drained in a rollout). Node b answers such a call UNAVAILABLE, saying it still
// serves the model (kAnsweredByHeader), so node a rules out only that endpoint and retries on
// node b's other version instead of giving up on the node: every call is served, over both
// protocols.
TEST(RouterForwardTest, AVersionTheOtherNodeNoLongerServesIsRetriedAtItsOtherVersion) {
  FakeDataSocket data2(TempSocket("stale2"), [](const inference::ModelInferRequest& req) {
    EXPECT_TRUE(req.model_version().empty() || req.model_version() == "2") << req.model_version();
    return std::make_pair(0, OutputNamed("served-by-2"));
  });
  FakeRestReplica rest2("served-by-2");
  ASSERT_TRUE(rest2.server);
  auto a = StartRouter({});
  auto b = StartRouter({});
  ASSERT_TRUE(a && b);
  auto stale = std::make_shared<RouterTable>();
  RouterTable::Route& route = stale->routes["encoder"];
  route.model = "encoder";
  route.versions = {{"1", 50}, {"2", 50}};
  route.sticky_header = "x-user";
  const std::string b_grpc = "127.0.0.1:" + std::to_string(b->grpc_port());
  const std::string b_http = "127.0.0.1:" + std::to_string(b->http_port());
  route.endpoints.push_back({"b/1", "1", b_grpc, b_http, false, ""});
  route.endpoints.push_back({"b/2", "2", b_grpc, b_http, false, ""});
  a->SetTable(stale);
  auto fresh = std::make_shared<RouterTable>();
  fresh->routes["encoder"].model = "encoder";
  fresh->routes["encoder"].versions = {{"2", 100}};
  fresh->routes["encoder"].endpoints.push_back(
      {"b.r0", "2", "127.0.0.1:1", rest2.address(), true, TempSocket("stale2")});
  b->SetTable(fresh);
  auto stub = RouterStub(*a);
  for (int k = 0; k < 16; ++k) {
    const std::string user = "user-" + std::to_string(k);
    inference::ModelInferResponse resp;
    grpc::Status s = InferAs(stub.get(), user, &resp);
    ASSERT_TRUE(s.ok()) << user << ": " << s.error_message();
    ASSERT_EQ(resp.outputs_size(), 1);
    EXPECT_EQ(resp.outputs(0).name(), "served-by-2") << user;
    testing::RawHttpClient c(a->http_port());
    ASSERT_TRUE(c.Send(testing::Post("/v2/models/encoder/infer",
                                     R"({"inputs":[{"name":"x","datatype":"INT64","shape":[1],"data":[1]}]})",
                                     "x-user: " + user + "\r\n")));
    auto r = c.Read();
    ASSERT_EQ(r.code, 200) << user << ": " << r.head << r.body;
    EXPECT_EQ(nlohmann::json::parse(r.body)["outputs"][0]["name"], "served-by-2") << user;
  }
  // Some keys chose version 1 (16 keys split 50/50), and each of those calls was retried once.
  EXPECT_GT(a->retries(), 0u);
  EXPECT_EQ(b->retries(), 0u);
  // Once node b serves none of the model, its failures say nothing of its other versions: the
  // whole node is ruled out and the retry goes to node z (whose endpoint sorts after b's).
  OneAnswerReplica z(grpc::Status::OK);
  int z_port = 0;
  auto z_server = Serve(&z, &z_port);
  ASSERT_GT(z_port, 0);
  stale->routes["encoder"].endpoints.push_back(
      {"z/2", "2", "127.0.0.1:" + std::to_string(z_port), "", false, ""});
  a->SetTable(stale);
  fresh->routes["encoder"].endpoints.clear();
  b->SetTable(fresh);
  for (int i = 0; i < 8; ++i) {
    grpc::Status s = InferEncoder(stub.get());
    ASSERT_TRUE(s.ok()) << i << ": " << s.error_message();
  }
  EXPECT_EQ(z.calls_.load(), 8);
  a->Stop();
  b->Stop();
  z_server->Shutdown();
}

// A model split by a `parameters` entry: the same key sees the same version over gRPC (a string
// or integer parameter) and REST (the JSON `parameters` object), and both versions are used.
TEST(RouterStickyTest, AParameterKeyHoldsItsVersionOverBothProtocols) {
  FakeDataSocket v1(TempSocket("sp1"), [](const inference::ModelInferRequest&) {
    return std::make_pair(0, OutputNamed("served-by-1"));
  });
  FakeDataSocket v2(TempSocket("sp2"), [](const inference::ModelInferRequest&) {
    return std::make_pair(0, OutputNamed("served-by-2"));
  });
  FakeRestReplica rest1("served-by-1"), rest2("served-by-2");
  ASSERT_TRUE(rest1.server && rest2.server);
  auto router = StartRouter({});
  ASSERT_NE(router, nullptr);
  router->SetTable(HalfAndHalf({{"r1", "1", "127.0.0.1:1", rest1.address(), true, TempSocket("sp1")},
                                {"r2", "2", "127.0.0.1:1", rest2.address(), true, TempSocket("sp2")}},
                               "user"));
  auto stub = RouterStub(*router);
  std::set<std::string> seen;
  for (int k = 0; k < 24; ++k) {
    std::string first;
    for (int rep = 0; rep < 3; ++rep) {
      inference::ModelInferRequest req = EncoderRequest();
      if (rep == 2) {
        (*req.mutable_parameters())["user"].set_int64_param(k);  // the same key as text "k"
      } else {
        (*req.mutable_parameters())["user"].set_string_param(std::to_string(k));
      }
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      inference::ModelInferResponse resp;
      grpc::Status st = stub->ModelInfer(&ctx, req, &resp);
      ASSERT_TRUE(st.ok()) << st.error_message();
      const std::string v = resp.parameters().at("kiln-version").string_param();
      EXPECT_EQ(resp.outputs(0).name(), "served-by-" + v);
      if (first.empty()) first = v;
      EXPECT_EQ(v, first) << "key " << k << " try " << rep;
      seen.insert(v);
    }
    testing::RawHttpClient c(router->http_port());
    ASSERT_TRUE(c.Send(testing::Post(
        "/v2/models/encoder/infer",
        R"({"parameters":{"user":")" + std::to_string(k) +
            R"("},"inputs":[{"name":"x","datatype":"INT64","shape":[1],"data":[1]}]})")));
    auto r = c.Read();
    ASSERT_EQ(r.code, 200) << r.body;
    EXPECT_EQ(nlohmann::json::parse(r.body)["parameters"]["kiln-version"], first) << "key " << k;
  }
  EXPECT_EQ(seen, (std::set<std::string>{"1", "2"}));
  // A number that is not whole: gRPC's double_param and a REST body's number are one key.
  std::set<std::string> seen_doubles;
  for (int k = 0; k < 24; ++k) {
    const double key = k + 0.5;
    inference::ModelInferRequest req = EncoderRequest();
    (*req.mutable_parameters())["user"].set_double_param(key);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    inference::ModelInferResponse resp;
    ASSERT_TRUE(stub->ModelInfer(&ctx, req, &resp).ok());
    const std::string v = resp.parameters().at("kiln-version").string_param();
    seen_doubles.insert(v);
    testing::RawHttpClient c(router->http_port());
    ASSERT_TRUE(c.Send(testing::Post(
        "/v2/models/encoder/infer",
        R"({"parameters":{"user":)" + nlohmann::json(key).dump() +
            R"(},"inputs":[{"name":"x","datatype":"INT64","shape":[1],"data":[1]}]})")));
    auto r = c.Read();
    ASSERT_EQ(r.code, 200) << r.body;
    EXPECT_EQ(nlohmann::json::parse(r.body)["parameters"]["kiln-version"], v) << "key " << key;
  }
  EXPECT_EQ(seen_doubles, (std::set<std::string>{"1", "2"}));
  // The health and readiness paths: only live and ready, and a model name that is not UTF-8
  // is answered, not a server error.
  for (const auto& [path, code] : std::vector<std::pair<std::string, int>>{
           {"/v2/health/live", 200}, {"/v2/health/ready", 200}, {"/v2/health/other", 404},
           {"/v2/models/%FF%FE/ready", 400}, {"/v2/models/encoder/ready", 200}}) {
    testing::RawHttpClient c(router->http_port());
    ASSERT_TRUE(c.Send(testing::Get(path)));
    EXPECT_EQ(c.Read().code, code) << path;
  }
  router->Stop();
}

// A REST call whose replica cannot be reached is tried once more on another replica.
TEST(RouterRestTest, AnUnreachableReplicaIsRetriedOnAnother) {
  FakeRestReplica alive("served");
  ASSERT_TRUE(alive.server);
  int dead_port = 0;
  {
    // A port nothing listens on any more.
    FakeRestReplica gone("gone");
    ASSERT_TRUE(gone.server);
    dead_port = gone.server->port();
  }
  // "a.0" sorts first among equally loaded local endpoints, so it is tried first.
  auto router = StartRouter(
      {{"a.0", "1", "127.0.0.1:1", "127.0.0.1:" + std::to_string(dead_port), true, ""},
       {"b.0", "1", "127.0.0.1:1", alive.address(), true, ""}});
  ASSERT_NE(router, nullptr);
  testing::RawHttpClient c(router->http_port());
  ASSERT_TRUE(c.Send(testing::Post("/v2/models/encoder/infer",
                                   R"({"inputs":[{"name":"x","datatype":"INT64","shape":[1],"data":[1]}]})")));
  auto r = c.Read();
  ASSERT_EQ(r.code, 200) << r.body;
  EXPECT_EQ(nlohmann::json::parse(r.body)["outputs"][0]["name"], "served");
  EXPECT_EQ(router->retries(), 1u);
  router->Stop();
}

// A REST inference to a local replica with a data socket goes there (its REST address goes
// nowhere), with the path's model and version; the replica's answer comes back as it is, with
// the header saying which version served.
TEST(RouterRestDataSocketTest, ALocalReplicaIsReachedThroughItsDataSocket) {
  std::string path = TempSocket("ra");
  absl::Mutex mu;
  std::vector<std::string> seen;  // model/version/body
  FakeDataSocket replica(
      path, [](const inference::ModelInferRequest&) { return std::make_pair(0, std::string()); },
      [&](const std::string& model, const std::string& version, const std::string& json) {
        absl::MutexLock lock(&mu);
        seen.push_back(model + "/" + version + "/" + json);
        return std::make_pair(
            0, EncodeJsonAnswer(R"({"outputs":[{"name":"from-data-socket"}],"parameters":{"kiln-version":"1"}})",
                                200));
      });
  auto router = StartRouter({{"a.0", "1", "127.0.0.1:1", "127.0.0.1:1", true, path}});
  ASSERT_NE(router, nullptr);
  const std::string body = R"({"inputs":[{"name":"x","datatype":"INT64","shape":[1],"data":[1]}]})";
  for (const std::string at : {"/v2/models/encoder/infer", "/v2/models/encoder/versions/1/infer"}) {
    testing::RawHttpClient c(router->http_port());
    ASSERT_TRUE(c.Send(testing::Post(at, body)));
    auto r = c.Read();
    ASSERT_EQ(r.code, 200) << r.head << r.body;
    EXPECT_NE(r.head.find("kiln-version: 1"), std::string::npos) << r.head;
    EXPECT_EQ(r.body, R"({"outputs":[{"name":"from-data-socket"}],"parameters":{"kiln-version":"1"}})");
  }
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(seen, (std::vector<std::string>{"encoder//" + body, "encoder/1/" + body}));
  }
  // REST has no caller's deadline: the frame carries none (the replica's own queue timeout
  // applies, as on its REST port).
  EXPECT_EQ(replica.json_deadlines(), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(router->forwarded_rest_data_socket(), 2u);
  EXPECT_EQ(router->forwarded_rest_http(), 0u);
  EXPECT_EQ(router->retries(), 0u);
  router->Stop();
}

// The replica's REST errors come back with their status, unretried; a 503 (a replica no longer
// serving) or a replica gone from its socket (closed, or UNAVAILABLE) is tried once more on
// another replica; an answer without its status is a 502; a frame the replica refuses is a 400.
TEST(RouterRestDataSocketTest, ErrorsPassThroughAndAGoneReplicaIsRetriedElsewhere) {
  const std::string body = R"({"inputs":[{"name":"x","datatype":"INT64","shape":[1],"data":[1]}]})";
  // `first` answers with `code`/`answer`; "b.0" answers 200.
  auto run = [&](int code, std::string answer) {
    FakeDataSocket first(
        TempSocket("rb1"),
        [](const inference::ModelInferRequest&) { return std::make_pair(0, std::string()); },
        [&](const std::string&, const std::string&, const std::string&) {
          return std::make_pair(code, answer);
        });
    FakeDataSocket second(
        TempSocket("rb2"),
        [](const inference::ModelInferRequest&) { return std::make_pair(0, std::string()); },
        [](const std::string&, const std::string&, const std::string&) {
          return std::make_pair(0, EncodeJsonAnswer(R"({"outputs":[{"name":"second"}]})", 200));
        });
    auto router = StartRouter({{"a.0", "1", "127.0.0.1:1", "127.0.0.1:1", true, TempSocket("rb1")},
                               {"b.0", "1", "127.0.0.1:1", "127.0.0.1:1", true, TempSocket("rb2")}});
    EXPECT_NE(router, nullptr);
    testing::RawHttpClient c(router->http_port());
    EXPECT_TRUE(c.Send(testing::Post("/v2/models/encoder/infer", body)));
    auto r = c.Read();
    const uint64_t retries = router->retries();
    router->Stop();
    return std::make_tuple(r.code, r.body, retries);
  };
  // "a.0" sorts first among equally loaded local endpoints, so it is tried first.
  auto [c400, b400, r400] = run(0, EncodeJsonAnswer(R"({"error":"unexpected inference input 'y'"})", 400));
  EXPECT_EQ(c400, 400);
  EXPECT_EQ(b400, R"({"error":"unexpected inference input 'y'"})");
  EXPECT_EQ(r400, 0u);
  auto [c429, b429, r429] = run(0, EncodeJsonAnswer(R"({"error":"the queue is full"})", 429));
  EXPECT_EQ(c429, 429);
  EXPECT_EQ(r429, 0u);
  for (auto [code, answer] : {std::make_pair(0, EncodeJsonAnswer(R"({"error":"not serving"})", 503)),
                              std::make_pair(-1, std::string()),
                              std::make_pair(14, std::string("going away"))}) {
    auto [c, b, r] = run(code, answer);
    EXPECT_EQ(c, 200) << code << " " << b;
    EXPECT_EQ(b, R"({"outputs":[{"name":"second"}]})");
    EXPECT_EQ(r, 1u);
  }
  auto [cbad, bbad, rbad] = run(0, std::string("x"));  // no room for a status
  EXPECT_EQ(cbad, 502) << bbad;
  EXPECT_NE(bbad.find("status"), std::string::npos) << bbad;
  auto [cframe, bframe, rframe] = run(3, std::string("a REST inference frame's trailer names 9 bytes"));
  EXPECT_EQ(cframe, 400) << bframe;
  EXPECT_NE(bframe.find("trailer"), std::string::npos) << bframe;
  EXPECT_EQ(rframe, 0u);
}

// A replica older than its router (it refuses REST frames as a code it does not know) is sent
// REST over HTTP instead: the first call, without counting as a retry, and the ones after it
// without asking again. The binary data extension is refused by the router itself.
TEST(RouterRestDataSocketTest, AnOlderReplicaIsSentRestOverHttp) {
  std::string path = TempSocket("rc");
  FakeDataSocket old(path, [](const inference::ModelInferRequest&) {
    return std::make_pair(0, OutputNamed("grpc"));
  });
  FakeRestReplica rest("over-http");
  ASSERT_TRUE(rest.server);
  auto router = StartRouter({{"a.0", "1", "127.0.0.1:1", rest.address(), true, path}});
  ASSERT_NE(router, nullptr);
  const std::string body = R"({"inputs":[{"name":"x","datatype":"INT64","shape":[1],"data":[1]}]})";
  for (int i = 0; i < 3; ++i) {
    testing::RawHttpClient c(router->http_port());
    ASSERT_TRUE(c.Send(testing::Post("/v2/models/encoder/infer", body)));
    auto r = c.Read();
    ASSERT_EQ(r.code, 200) << r.body;
    auto doc = nlohmann::json::parse(r.body);
    EXPECT_EQ(doc["outputs"][0]["name"], "over-http");
    EXPECT_EQ(doc["parameters"]["kiln-version"], "1");
  }
  EXPECT_EQ(old.json_requests(), 1);
  EXPECT_EQ(router->forwarded_rest_data_socket(), 0u);  // the refused one went over HTTP
  EXPECT_EQ(router->forwarded_rest_http(), 3u);
  EXPECT_EQ(router->retries(), 0u);
  // gRPC still goes to its data socket.
  auto stub = RouterStub(*router);
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  ASSERT_TRUE(stub->ModelInfer(&ctx, EncoderRequest(), &resp).ok());
  EXPECT_EQ(resp.outputs(0).name(), "grpc");

  testing::RawHttpClient c(router->http_port());
  ASSERT_TRUE(c.Send(testing::Post("/v2/models/encoder/infer", body,
                                   "Inference-Header-Content-Length: 10\r\n")));
  auto r = c.Read();
  EXPECT_EQ(r.code, 400) << r.body;
  EXPECT_NE(r.body.find("binary data extension"), std::string::npos) << r.body;
  EXPECT_EQ(router->forwarded_rest_http(), 3u);
  router->Stop();
}

// A REST call waiting on a replica's data socket when the router stops is answered 503 before
// the REST server closes its connection, and nothing of it runs after the router is gone.
TEST(RouterRestDataSocketTest, StopsWithARestCallInFlight) {
  std::string path = TempSocket("rd");
  FakeDataSocket silent(
      path, [](const inference::ModelInferRequest&) { return std::make_pair(0, std::string()); },
      [](const std::string&, const std::string&, const std::string&) {
        return std::make_pair(-2, std::string());  // never answers
      });
  auto router = StartRouter({{"a.0", "1", "127.0.0.1:1", "127.0.0.1:1", true, path}});
  ASSERT_NE(router, nullptr);
  std::atomic<int> code{-1};
  std::thread client([&] {
    testing::RawHttpClient c(router->http_port());
    code = c.Send(testing::Post("/v2/models/encoder/infer", R"({"inputs":[]})")) ? c.Read().code : 0;
  });
  for (int i = 0; i < 2000 && silent.json_requests() == 0; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(silent.json_requests(), 1);
  router->Stop();
  router.reset();
  client.join();
  EXPECT_EQ(code.load(), 503);
}

}  // namespace
}  // namespace kiln
