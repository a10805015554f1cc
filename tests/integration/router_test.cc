// The node router against replicas that answer in chosen ways (in-process gRPC servers on
// loopback).
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <thread>

#include "absl/synchronization/mutex.h"
#include "agent/router.h"
#include "common/http_server.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"

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

// The status code of one REST request sent on a fresh loopback connection (0: no response).
int RestStatus(int port, const std::string& request) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{30, 0};  // bounded
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int code = 0;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(request.size())) {
    char buf[512];
    ssize_t n = recv(fd, buf, sizeof(buf) - 1, 0);
    if (n > 12) code = std::atoi(std::string(buf + 9, 3).c_str());
  }
  close(fd);
  return code;
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
  const std::string body = "{}";
  std::atomic<int> code{-1};
  std::thread client([&] {
    code = RestStatus(router->http_port(),
                      "POST /v2/models/encoder/infer HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                          std::to_string(body.size()) + "\r\n\r\n" + body);
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

}  // namespace
}  // namespace kiln
