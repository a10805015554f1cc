// The node router against replicas that answer in chosen ways (in-process gRPC servers on
// loopback).
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>

#include <thread>

#include "absl/synchronization/mutex.h"
#include "agent/router.h"
#include "common/http_server.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "nlohmann/json.hpp"
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
  auto router = StartRouter({{"gone.0", "1", "127.0.0.1:" + std::to_string(ports[0]), "", false},
                             {"good.0", "1", "127.0.0.1:" + std::to_string(ports[1]), "", false}});
  ASSERT_NE(router, nullptr);
  auto stub = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(router->grpc_port()), grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 20; ++i) {
    inference::ModelInferRequest req;
    req.set_model_name("encoder");
    inference::ModelInferResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status s = stub->ModelInfer(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << i << ": " << s.error_message();
  }
  EXPECT_GT(cancelling.calls_.load(), 0);  // it was tried, and its cancellations retried
  EXPECT_EQ(router->retries(), static_cast<uint64_t>(cancelling.calls_.load()));
  EXPECT_EQ(good.calls_.load(), 20);
  router->Stop();
  for (auto& s : servers) s->Shutdown();
}

// A REST forward still waiting on its replica when the router stops: Stop cancels it and
// waits for it (its continuation uses the router), and the client is answered, not left
// hanging. Before, the continuation could run on the freed router.
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
      {{"slow.0", "1", "127.0.0.1:1", "127.0.0.1:" + std::to_string((*replica)->port()), false}});
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
  EXPECT_NE(code.load(), 200);
  EXPECT_NE(code.load(), -1);
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
      {{"r.0", "1", "127.0.0.1:1", "127.0.0.1:" + std::to_string((*replica)->port()), false}});
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

}  // namespace
}  // namespace kiln
