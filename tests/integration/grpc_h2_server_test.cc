// The HTTP/2 gRPC server (common/grpc_h2_server.h) over loopback: grpc++ clients for what a
// real client sends, and a raw nghttp2 client for what no gRPC client would.

#include "common/grpc_h2_server.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <nghttp2/nghttp2.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "tests/support/eventually.h"
#include "tests/support/thread_cpu.h"

namespace kiln {
namespace {

using kiln::testing::Eventually;

constexpr char kLive[] = "/inference.GRPCInferenceService/ServerLive";
constexpr char kInfer[] = "/inference.GRPCInferenceService/ModelInfer";

// A server whose handler keeps every call for the test to answer (or answers at once).
class Served {
 public:
  explicit Served(GrpcH2Server::Options o = {}, bool answer_live = true) {
    o.bind_address = "127.0.0.1";
    auto s = GrpcH2Server::Start(o, [this, answer_live](std::shared_ptr<GrpcH2Server::Call> c) {
      if (answer_live && c->method() == kLive) {
        inference::ServerLiveResponse r;
        r.set_live(true);
        c->Finish(grpc::Status::OK, r.SerializeAsString());
        return;
      }
      if (c->method() != kInfer && c->method() != kLive) {
        c->Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "no method " + c->method()));
        return;
      }
      absl::MutexLock lock(&mu_);
      calls_.push_back(c);
    });
    EXPECT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }
  GrpcH2Server& server() { return *server_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(server_->port()); }
  std::shared_ptr<grpc::Channel> Channel(int max_receive = -1) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(max_receive);
    return grpc::CreateCustomChannel(address(), grpc::InsecureChannelCredentials(), args);
  }
  // The n-th call the handler kept, once it has come.
  std::shared_ptr<GrpcH2Server::Call> Kept(size_t n = 0) {
    std::shared_ptr<GrpcH2Server::Call> c;
    Eventually([&] {
      absl::MutexLock lock(&mu_);
      if (calls_.size() > n) c = calls_[n];
      return c != nullptr;
    }, absl::Seconds(10), absl::Milliseconds(1));
    return c;
  }
  size_t kept() {
    absl::MutexLock lock(&mu_);
    return calls_.size();
  }

 private:
  absl::Mutex mu_;
  std::vector<std::shared_ptr<GrpcH2Server::Call>> calls_;
  std::unique_ptr<GrpcH2Server> server_;
};

inference::ModelInferRequest Request(const std::string& model, size_t raw_bytes = 0) {
  inference::ModelInferRequest r;
  r.set_model_name(model);
  if (raw_bytes > 0) {
    std::string raw(raw_bytes, '\0');
    for (size_t i = 0; i < raw_bytes; i++) raw[i] = static_cast<char>(i * 131 + 7);
    r.add_raw_input_contents(std::move(raw));
  }
  return r;
}

// Answers a kept ModelInfer with a response naming its model and `tag` as id.
void AnswerInfer(GrpcH2Server::Call& c, const std::string& tag, size_t raw_bytes = 0) {
  inference::ModelInferRequest req;
  ASSERT_TRUE(req.ParseFromString(c.message()));
  inference::ModelInferResponse resp;
  resp.set_model_name(req.model_name());
  resp.set_id(tag);
  if (raw_bytes > 0) resp.add_raw_output_contents(std::string(raw_bytes, 'z'));
  c.Finish(grpc::Status::OK, resp.SerializeAsString());
}

TEST(GrpcH2ServerTest, AnswersAGrpcClientWithMetadataBothWays) {
  Served s;
  auto stub = inference::GRPCInferenceService::NewStub(s.Channel());
  {
    grpc::ClientContext ctx;
    inference::ServerLiveResponse r;
    ASSERT_TRUE(stub->ServerLive(&ctx, {}, &r).ok());
    EXPECT_TRUE(r.live());
  }
  std::thread answer([&] {
    auto c = s.Kept();
    ASSERT_NE(c, nullptr);
    ASSERT_NE(c->Metadata("x-sticky"), nullptr);
    EXPECT_EQ(*c->Metadata("x-sticky"), "user-7");
    EXPECT_EQ(c->Metadata("x-absent"), nullptr);
    EXPECT_EQ(c->deadline(), absl::InfiniteFuture());
    // Binary metadata arrives as its bytes, and goes back as bytes.
    ASSERT_NE(c->Metadata("x-key-bin"), nullptr);
    EXPECT_EQ(*c->Metadata("x-key-bin"), std::string("\0\xff\x10ab", 5));
    c->AddInitialMetadata("Kiln-Version", "3");
    c->AddInitialMetadata("x-out-bin", std::string("\xfe", 1));
    AnswerInfer(*c, "answered");
  });
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-sticky", "user-7");
  ctx.AddMetadata("x-key-bin", std::string("\0\xff\x10ab", 5));
  inference::ModelInferResponse resp;
  grpc::Status st = stub->ModelInfer(&ctx, Request("encoder", 100), &resp);
  answer.join();
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.model_name(), "encoder");
  EXPECT_EQ(resp.id(), "answered");
  auto md = ctx.GetServerInitialMetadata();
  auto it = md.find("kiln-version");
  ASSERT_NE(it, md.end());
  EXPECT_EQ(std::string(it->second.data(), it->second.size()), "3");
  it = md.find("x-out-bin");
  ASSERT_NE(it, md.end());
  EXPECT_EQ(std::string(it->second.data(), it->second.size()), std::string("\xfe", 1));
  EXPECT_EQ(s.server().calls_in_flight(), 0);
}

TEST(GrpcH2ServerTest, AnErrorReachesTheClientWithItsCodeAndExactMessage) {
  Served s;
  auto stub = inference::GRPCInferenceService::NewStub(s.Channel());
  const std::string message = "input 'ids': 100% wrong, ünïcode\nand a newline";
  std::thread answer([&] {
    auto c = s.Kept();
    ASSERT_NE(c, nullptr);
    c->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, message));
    c->Finish(grpc::Status::OK, "ignored: finished already");
  });
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  grpc::Status st = stub->ModelInfer(&ctx, Request("m"), &resp);
  answer.join();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message(), message);
  // An unknown method, answered by the handler.
  grpc::ClientContext ctx2;
  inference::ModelMetadataResponse md;
  st = stub->ModelMetadata(&ctx2, {}, &md);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(st.error_message().find("ModelMetadata"), std::string::npos);
}

TEST(GrpcH2ServerTest, LargeMessagesGoBothWaysWhole) {
  GrpcH2Server::Options o;
  o.max_message_bytes = 32 << 20;
  Served s(o);
  auto stub = inference::GRPCInferenceService::NewStub(s.Channel(64 << 20));
  const size_t in = 12 << 20, out = 20 << 20;
  std::thread answer([&] {
    auto c = s.Kept();
    ASSERT_NE(c, nullptr);
    inference::ModelInferRequest req;
    ASSERT_TRUE(req.ParseFromString(c->message()));
    ASSERT_EQ(req.raw_input_contents_size(), 1);
    EXPECT_EQ(req.raw_input_contents(0), Request("m", in).raw_input_contents(0));
    AnswerInfer(*c, "big", out);
  });
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  grpc::Status st = stub->ModelInfer(&ctx, Request("m", in), &resp);
  answer.join();
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(resp.raw_output_contents_size(), 1);
  EXPECT_EQ(resp.raw_output_contents(0), std::string(out, 'z'));
}

TEST(GrpcH2ServerTest, AMessageOverTheLimitIsRefusedFromItsPrefixAndTheServerGoesOn) {
  GrpcH2Server::Options o;
  o.max_message_bytes = 4096;
  Served s(o);
  auto stub = inference::GRPCInferenceService::NewStub(s.Channel());
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  grpc::Status st = stub->ModelInfer(&ctx, Request("m", 1 << 20), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("over the limit of 4096 bytes"), std::string::npos)
      << st.error_message();
  EXPECT_EQ(s.kept(), 0u);
  // The same connection serves on.
  std::thread answer([&] { AnswerInfer(*s.Kept(), "small"); });
  grpc::ClientContext ctx2;
  st = stub->ModelInfer(&ctx2, Request("m", 100), &resp);
  answer.join();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.id(), "small");
}

TEST(GrpcH2ServerTest, ACompressedMessageIsUnimplemented) {
  Served s;
  auto stub = inference::GRPCInferenceService::NewStub(s.Channel());
  grpc::ClientContext ctx;
  ctx.set_compression_algorithm(GRPC_COMPRESS_GZIP);
  inference::ModelInferResponse resp;
  grpc::Status st = stub->ModelInfer(&ctx, Request("m", 10000), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(st.error_message().find("gzip"), std::string::npos) << st.error_message();
  EXPECT_EQ(s.kept(), 0u);
}

TEST(GrpcH2ServerTest, ADeadlinePassedUnansweredCancelsTheCall) {
  Served s;
  auto channel = s.Channel();
  // Connected first, so that the deadline is the call's alone.
  ASSERT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  std::atomic<int> cancels{0};
  std::thread watch([&] {
    auto c = s.Kept();
    ASSERT_NE(c, nullptr);
    EXPECT_LT(c->deadline(), absl::Now() + absl::Seconds(1));
    EXPECT_GT(c->deadline(), absl::Now() - absl::Seconds(1));
    c->OnCancel([&] { cancels++; });
  });
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  inference::ModelInferResponse resp;
  grpc::Status st = stub->ModelInfer(&ctx, Request("m"), &resp);
  watch.join();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(Eventually([&] { return cancels.load() == 1; }, absl::Seconds(5)));
  auto c = s.Kept();
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(c->cancelled());
  EXPECT_EQ(s.server().calls_in_flight(), 0);
  c->Finish(grpc::Status::OK, "");  // late: goes nowhere
  EXPECT_EQ(s.server().calls_in_flight(), 0);
  // A cancel callback set after the cancellation runs at once.
  int late = 0;
  c->OnCancel([&] { late++; });
  EXPECT_EQ(late, 1);
}

TEST(GrpcH2ServerTest, TheCallerCancellingEndsTheCall) {
  Served s;
  auto stub = inference::GRPCInferenceService::NewStub(s.Channel());
  std::atomic<int> cancels{0};
  grpc::ClientContext ctx;
  inference::ModelInferResponse resp;
  absl::Notification done;
  grpc::Status st;
  auto req = Request("m");
  stub->async()->ModelInfer(&ctx, &req, &resp, [&](grpc::Status x) {
    st = x;
    done.Notify();
  });
  auto c = s.Kept();
  ASSERT_NE(c, nullptr);
  c->OnCancel([&] { cancels++; });
  EXPECT_EQ(s.server().calls_in_flight(), 1);
  ctx.TryCancel();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(Eventually([&] { return cancels.load() == 1; }, absl::Seconds(5)));
  EXPECT_EQ(s.server().calls_in_flight(), 0);
}

TEST(GrpcH2ServerTest, ManyCallsAnsweredOutOfOrderFromOtherThreadsEachGetTheirOwn) {
  Served s;
  auto stub = inference::GRPCInferenceService::NewStub(s.Channel());
  constexpr int kCalls = 64;
  std::vector<grpc::ClientContext> ctxs(kCalls);
  std::vector<inference::ModelInferRequest> reqs(kCalls);
  std::vector<inference::ModelInferResponse> resps(kCalls);
  std::vector<grpc::Status> sts(kCalls);
  std::atomic<int> left{kCalls};
  absl::Notification all;
  for (int i = 0; i < kCalls; i++) {
    reqs[i] = Request("model-" + std::to_string(i), 64 * (i + 1));
    stub->async()->ModelInfer(&ctxs[i], &reqs[i], &resps[i], [&, i](grpc::Status x) {
      sts[i] = x;
      if (--left == 0) all.Notify();
    });
  }
  ASSERT_TRUE(Eventually([&] { return s.kept() == kCalls; }, absl::Seconds(10)));
  std::vector<std::thread> answerers;
  for (int t = 0; t < 4; t++) {
    answerers.emplace_back([&, t] {
      for (int i = kCalls - 1 - t; i >= 0; i -= 4) {
        auto c = s.Kept(i);
        inference::ModelInferRequest req;
        ASSERT_TRUE(req.ParseFromString(c->message()));
        AnswerInfer(*c, req.model_name() + "/" + std::to_string(req.raw_input_contents(0).size()));
      }
    });
  }
  for (auto& t : answerers) t.join();
  ASSERT_TRUE(all.WaitForNotificationWithTimeout(absl::Seconds(10)));
  for (int i = 0; i < kCalls; i++) {
    ASSERT_TRUE(sts[i].ok()) << i << ": " << sts[i].error_message();
    EXPECT_EQ(resps[i].id(), "model-" + std::to_string(i) + "/" + std::to_string(64 * (i + 1)));
  }
  EXPECT_EQ(s.server().calls_in_flight(), 0);
}

TEST(GrpcH2ServerTest, StopGivesCallsInFlightTheirGraceThenCancelsTheRest) {
  Served s;
  auto stub = inference::GRPCInferenceService::NewStub(s.Channel());
  grpc::ClientContext ctx1, ctx2;
  inference::ModelInferResponse r1, r2;
  auto q1 = Request("finished"), q2 = Request("never");
  absl::Notification d1, d2;
  grpc::Status s1, s2;
  stub->async()->ModelInfer(&ctx1, &q1, &r1, [&](grpc::Status x) { s1 = x; d1.Notify(); });
  auto c1 = s.Kept(0);
  stub->async()->ModelInfer(&ctx2, &q2, &r2, [&](grpc::Status x) { s2 = x; d2.Notify(); });
  auto c2 = s.Kept(1);
  ASSERT_NE(c1, nullptr);
  ASSERT_NE(c2, nullptr);
  std::atomic<int> cancels{0};
  c2->OnCancel([&] { cancels++; });
  std::thread stop([&] { s.server().Stop(absl::Seconds(3)); });
  // Stopping: new connections are not taken.
  ASSERT_TRUE(Eventually(
      [&] {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(static_cast<uint16_t>(s.server().port()));
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        bool refused = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0;
        close(fd);
        return refused;
      },
      absl::Seconds(5)));
  AnswerInfer(*c1, "in the grace");
  stop.join();
  ASSERT_TRUE(d1.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(d2.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_TRUE(s1.ok()) << s1.error_message();
  EXPECT_EQ(r1.id(), "in the grace");
  EXPECT_EQ(s2.error_code(), grpc::StatusCode::CANCELLED) << s2.error_message();
  EXPECT_EQ(cancels.load(), 1);
  EXPECT_EQ(s.server().calls_in_flight(), 0);
  EXPECT_EQ(s.server().connections(), 0);
  s.server().Stop(absl::ZeroDuration());  // again: nothing
}

TEST(GrpcH2ServerTest, ServesAHandedOverSocketAndLeavesItOpen) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 16), 0);
  GrpcH2Server::Options o;
  o.listen_fd = fd;
  {
    Served s(o);
    socklen_t len = sizeof(a);
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    EXPECT_EQ(s.server().port(), ntohs(a.sin_port));
    auto stub = inference::GRPCInferenceService::NewStub(s.Channel());
    grpc::ClientContext ctx;
    inference::ServerLiveResponse r;
    ASSERT_TRUE(stub->ServerLive(&ctx, {}, &r).ok());
    EXPECT_TRUE(r.live());
  }
  // Still a listening socket: connections queue on it for the next server.
  int c = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_EQ(connect(c, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  close(c);
  close(fd);
}

// A wildcard address takes IPv4 and, where the host has it, IPv6 on the same port.
TEST(GrpcH2ServerTest, AWildcardAddressServesIpv4AndIpv6) {
  GrpcH2Server::Options o;
  o.bind_address = "0.0.0.0";
  auto server = GrpcH2Server::Start(o, [](std::shared_ptr<GrpcH2Server::Call> c) {
    inference::ServerLiveResponse r;
    r.set_live(true);
    c->Finish(grpc::Status::OK, r.SerializeAsString());
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string port = std::to_string((*server)->port());
  std::vector<std::string> addresses = {"127.0.0.1:" + port};
  int probe = socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 a6{};
  a6.sin6_family = AF_INET6;
  a6.sin6_addr = in6addr_loopback;
  if (probe >= 0 && bind(probe, reinterpret_cast<sockaddr*>(&a6), sizeof(a6)) == 0) {
    addresses.push_back("[::1]:" + port);  // this host has IPv6 loopback
  }
  if (probe >= 0) close(probe);
  for (const auto& address : addresses) {
    auto stub = inference::GRPCInferenceService::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    inference::ServerLiveResponse r;
    grpc::Status st = stub->ServerLive(&ctx, {}, &r);
    EXPECT_TRUE(st.ok()) << address << ": " << st.error_message();
  }
}

TEST(GrpcH2ServerTest, APortInUseIsAnErrorNamingTheFlag) {
  Served first;
  GrpcH2Server::Options o;
  o.bind_address = "127.0.0.1";
  o.port = first.server().port();
  o.flag = "--grpc-port";
  auto s = GrpcH2Server::Start(o, [](std::shared_ptr<GrpcH2Server::Call>) {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("--grpc-port"), std::string::npos) << s.status();
  o.port = 0;
  o.bind_address = "no such host.invalid";
  s = GrpcH2Server::Start(o, [](std::shared_ptr<GrpcH2Server::Call>) {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("bind address"), std::string::npos) << s.status();
}

// --- a raw HTTP/2 client, for requests no gRPC client sends ---

int Connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

struct RawAnswer {
  std::map<std::string, std::string> headers;  // response headers and trailers
  bool closed = false;                          // the stream ended
  uint32_t reset = 0xffffffff;                  // RST_STREAM's code, if one came first
};

// Sends one request of `headers` and `body` on a fresh connection; reads until the stream ends.
// `end_stream` false: the body is sent and the request left open. `silent_fd`: the connection's
// preface and the request go in one write, then the client falls silent (no acknowledgement,
// no window update, the answer unread) and the open socket is left in *silent_fd.
RawAnswer RawCall(int port, std::vector<std::pair<std::string, std::string>> headers,
                  const std::string& body, bool end_after_headers = false,
                  bool end_stream = true, int* silent_fd = nullptr) {
  RawAnswer ans;
  int fd = Connect(port);
  EXPECT_GE(fd, 0);
  if (fd < 0) return ans;
  nghttp2_session_callbacks* cb;
  nghttp2_session_callbacks_new(&cb);
  nghttp2_session_callbacks_set_on_header_callback(
      cb, [](nghttp2_session*, const nghttp2_frame*, const uint8_t* n, size_t nl, const uint8_t* v,
             size_t vl, uint8_t, void* u) {
        static_cast<RawAnswer*>(u)->headers[std::string(reinterpret_cast<const char*>(n), nl)] =
            std::string(reinterpret_cast<const char*>(v), vl);
        return 0;
      });
  nghttp2_session_callbacks_set_on_stream_close_callback(
      cb, [](nghttp2_session*, int32_t, uint32_t code, void* u) {
        auto* a = static_cast<RawAnswer*>(u);
        a->closed = true;
        if (a->reset == 0xffffffff) a->reset = code;
        return 0;
      });
  nghttp2_session* session;
  nghttp2_session_client_new(&session, cb, &ans);
  nghttp2_submit_settings(session, NGHTTP2_FLAG_NONE, nullptr, 0);
  std::vector<nghttp2_nv> nv;
  for (auto& [k, v] : headers) {
    nv.push_back({reinterpret_cast<uint8_t*>(k.data()), reinterpret_cast<uint8_t*>(v.data()),
                  k.size(), v.size(), NGHTTP2_NV_FLAG_NONE});
  }
  struct Body {
    const std::string* data;
    bool end = true;
    size_t off = 0;
  } src{&body, end_stream};
  nghttp2_data_provider dp{};
  dp.source.ptr = &src;
  dp.read_callback = [](nghttp2_session*, int32_t, uint8_t* buf, size_t len, uint32_t* flags,
                        nghttp2_data_source* s, void*) -> ssize_t {
    auto* b = static_cast<Body*>(s->ptr);
    size_t n = std::min(len, b->data->size() - b->off);
    if (n == 0 && !b->end) return NGHTTP2_ERR_DEFERRED;
    memcpy(buf, b->data->data() + b->off, n);
    b->off += n;
    if (b->off == b->data->size() && b->end) *flags |= NGHTTP2_DATA_FLAG_EOF;
    return static_cast<ssize_t>(n);
  };
  nghttp2_submit_request(session, nullptr, nv.data(), nv.size(),
                         end_after_headers ? nullptr : &dp, nullptr);
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (!ans.closed && absl::Now() < end) {
    // What is ready goes in one write, so that a request's HEADERS and DATA arrive together.
    std::string pending;
    const uint8_t* out;
    ssize_t n;
    while ((n = nghttp2_session_mem_send(session, &out)) > 0) {
      pending.append(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
    }
    if (!pending.empty() &&
        send(fd, pending.data(), pending.size(), MSG_NOSIGNAL) !=
            static_cast<ssize_t>(pending.size())) {
      break;
    }
    if (silent_fd != nullptr) {
      *silent_fd = fd;
      fd = -1;
      break;
    }
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    char buf[65536];
    ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r <= 0) break;
    nghttp2_session_mem_recv(session, reinterpret_cast<uint8_t*>(buf), r);
  }
  nghttp2_session_del(session);
  nghttp2_session_callbacks_del(cb);
  if (fd >= 0) close(fd);
  return ans;
}

std::string Prefixed(const std::string& message, uint8_t flag = 0) {
  std::string out(5, '\0');
  out[0] = static_cast<char>(flag);
  uint32_t n = htonl(static_cast<uint32_t>(message.size()));
  memcpy(&out[1], &n, 4);
  return out + message;
}

std::vector<std::pair<std::string, std::string>> GrpcHeaders(
    std::vector<std::pair<std::string, std::string>> more = {}) {
  std::vector<std::pair<std::string, std::string>> h = {
      {":method", "POST"}, {":scheme", "http"}, {":authority", "localhost"},
      {":path", kLive}, {"content-type", "application/grpc"}, {"te", "trailers"}};
  for (auto& m : more) {
    bool replaced = false;
    for (auto& x : h) {
      if (x.first == m.first) {
        x.second = m.second;
        replaced = true;
      }
    }
    if (!replaced) h.push_back(m);
  }
  return h;
}

// With an idle spin the server's thread polls busily after each piece of work (here, a request
// read) and sleeps once the spin is over; with a spin of an hour it still serves, and Stop ends
// the spin.
TEST(GrpcH2ServerRawTest, AnIdleSpinFollowsEachReadThenSleeps) {
  using kiln::testing::ThreadCpuMs;
  GrpcH2Server::Options o;
  o.idle_spin = absl::Milliseconds(300);
  o.thread_name = "spin-test";
  Served s(o);
  const double before = ThreadCpuMs(0, "spin-test");
  ASSERT_GE(before, 0) << "no thread named spin-test";
  // The request comes in one write, and then nothing more: no acknowledgement, no window
  // update, the answer unread. Only the read starts a spin.
  int fd = -1;
  RawCall(s.server().port(), GrpcHeaders({{":path", kInfer}}),
          Prefixed(Request("kept").SerializeAsString()), false, true, &fd);
  ASSERT_GE(fd, 0);
  auto c = s.Kept();
  ASSERT_NE(c, nullptr);
  const absl::Time read_by = absl::Now();
  // Spinning, the thread uses about 150 ms of CPU in 150 ms; a tenth is asked for, a loaded
  // machine's share (ticks are 10 ms).
  absl::SleepFor(absl::Milliseconds(150));
  const double spun = ThreadCpuMs(0, "spin-test");
  ASSERT_GE(spun, 0);
  EXPECT_GE(spun - before, 15);
  // 300 ms after the read the spin is over: the thread sleeps.
  absl::SleepFor(read_by + absl::Milliseconds(500) - absl::Now());
  const double idle_from = ThreadCpuMs(0, "spin-test");
  absl::SleepFor(absl::Milliseconds(200));
  const double idle_to = ThreadCpuMs(0, "spin-test");
  ASSERT_GE(idle_from, 0);
  ASSERT_GE(idle_to, 0);
  EXPECT_LT(idle_to - idle_from, 30);
  AnswerInfer(*c, "answered");
  close(fd);

  GrpcH2Server::Options hour;
  hour.idle_spin = absl::Hours(1);
  Served h(hour);
  auto stub = inference::GRPCInferenceService::NewStub(h.Channel());
  for (int i = 0; i < 3; i++) {
    grpc::ClientContext ctx;
    inference::ServerLiveResponse live;
    ASSERT_TRUE(stub->ServerLive(&ctx, {}, &live).ok());
    EXPECT_TRUE(live.live());
  }
  h.server().Stop(absl::Seconds(1));
}

TEST(GrpcH2ServerRawTest, TheRawClientIsAnsweredWhenTheRequestIsRight) {
  Served s;
  RawAnswer a = RawCall(s.server().port(), GrpcHeaders(), Prefixed(""));
  EXPECT_TRUE(a.closed);
  EXPECT_EQ(a.headers[":status"], "200");
  EXPECT_EQ(a.headers["grpc-status"], "0");
}

TEST(GrpcH2ServerRawTest, WhatIsNotAGrpcCallIsRefusedSayingWhy) {
  Served s;
  const int port = s.server().port();
  struct Case {
    std::string name;
    std::vector<std::pair<std::string, std::string>> headers;
    std::string body;
    std::string status;
    std::string grpc_status;
    std::string says;
  };
  const std::string big(20 * 1024, 'x');
  std::vector<Case> cases = {
      {"GET", GrpcHeaders({{":method", "GET"}}), Prefixed(""), "405", "12", ":method"},
      {"content-type", GrpcHeaders({{"content-type", "text/plain"}}), Prefixed(""), "415", "3",
       "content-type"},
      {"no content-type", {{":method", "POST"}, {":scheme", "http"}, {":authority", "x"},
                           {":path", kLive}}, Prefixed(""), "415", "3", "content-type"},
      {"grpc-timeout", GrpcHeaders({{"grpc-timeout", "soon"}}), Prefixed(""), "200", "3",
       "grpc-timeout"},
      {"grpc-timeout digits", GrpcHeaders({{"grpc-timeout", "123456789S"}}), Prefixed(""), "200",
       "3", "grpc-timeout"},
      {"no message", GrpcHeaders(), "", "200", "3", "no request message"},
      {"cut short", GrpcHeaders(), Prefixed("abcdef").substr(0, 8), "200", "3", "cut short"},
      {"two messages", GrpcHeaders(), Prefixed("") + Prefixed(""), "200", "3",
       "more than one request message"},
      {"compressed-flag", GrpcHeaders(), Prefixed("", 7), "200", "3", "compressed-flag 7"},
      {"metadata", GrpcHeaders({{"x-big-1", big.substr(0, 10000)}, {"x-big-2", big.substr(0, 10000)}}),
       Prefixed(""), "200", "8", "metadata"},
      {"-bin not base64", GrpcHeaders({{"x-key-bin", "a*b"}}), Prefixed(""), "200", "3",
       "metadata 'x-key-bin': a -bin value must be base64"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    RawAnswer a = RawCall(port, c.headers, c.body);
    EXPECT_TRUE(a.closed);
    EXPECT_EQ(a.headers[":status"], c.status);
    EXPECT_EQ(a.headers["grpc-status"], c.grpc_status);
    EXPECT_NE(a.headers["grpc-message"].find(c.says), std::string::npos)
        << a.headers["grpc-message"];
  }
  EXPECT_EQ(s.kept(), 0u);
  // Headers alone, no body: no message.
  RawAnswer a = RawCall(port, GrpcHeaders(), "", /*end_after_headers=*/true);
  EXPECT_EQ(a.headers["grpc-status"], "3");
  EXPECT_EQ(s.server().calls_in_flight(), 0);
}

TEST(GrpcH2ServerRawTest, AnUploadIsBoundedInTimeAndBytes) {
  GrpcH2Server::Options o;
  o.max_message_bytes = 1 << 20;
  o.max_connection_pending_bytes = 3000;
  Served s(o);
  const int port = s.server().port();
  // Its deadline passes while the request is still coming in.
  std::string half = Prefixed(std::string(1000, 'a')).substr(0, 600);
  RawAnswer a = RawCall(port, GrpcHeaders({{"grpc-timeout", "150m"}}), half, false,
                        /*end_stream=*/false);
  EXPECT_TRUE(a.closed);
  EXPECT_EQ(a.headers["grpc-status"], "4");
  EXPECT_NE(a.headers["grpc-message"].find("before the request was whole"), std::string::npos)
      << a.headers["grpc-message"];
  // More unfinished bytes than the connection may hold.
  a = RawCall(port, GrpcHeaders(), Prefixed(std::string(5000, 'b')));
  EXPECT_EQ(a.headers["grpc-status"], "8");
  EXPECT_NE(a.headers["grpc-message"].find("would hold over 3000 bytes"), std::string::npos)
      << a.headers["grpc-message"];
  // Under it, served; the refused bytes were given back.
  a = RawCall(port, GrpcHeaders(), Prefixed(std::string(2000, 'c')));
  EXPECT_EQ(a.headers["grpc-status"], "0");
  EXPECT_EQ(s.server().calls_in_flight(), 0);
}

// A request that stalls mid-upload is answered at the server's upload limit whatever its
// deadline (none, or a later one); one that came whole in time is not touched by the limit,
// however long its handler takes.
TEST(GrpcH2ServerRawTest, AStalledUploadIsAnsweredAtTheUploadLimit) {
  GrpcH2Server::Options o;
  o.upload_timeout = absl::Milliseconds(100);
  Served s(o);
  const int port = s.server().port();
  const std::string half = Prefixed(std::string(1000, 'a')).substr(0, 600);
  for (const auto& headers : {GrpcHeaders(), GrpcHeaders({{"grpc-timeout", "30S"}})}) {
    RawAnswer a = RawCall(port, headers, half, false, /*end_stream=*/false);
    EXPECT_TRUE(a.closed);
    EXPECT_EQ(a.headers["grpc-status"], "4");
    EXPECT_NE(a.headers["grpc-message"].find("not whole within 100ms of its headers"),
              std::string::npos)
        << a.headers["grpc-message"];
  }
  EXPECT_EQ(s.server().calls_in_flight(), 0);
  // A call that came whole (its HEADERS and DATA in one write), kept by its handler past the
  // limit, is answered as it finishes.
  std::thread answer([&] {
    auto c = s.Kept();
    ASSERT_NE(c, nullptr);
    // Past the limit: nothing to poll for, since nothing is to happen.
    absl::SleepFor(absl::Milliseconds(300));
    AnswerInfer(*c, "answered");
  });
  RawAnswer a = RawCall(port, GrpcHeaders({{":path", kInfer}}),
                        Prefixed(Request("encoder", 600).SerializeAsString()));
  answer.join();
  EXPECT_TRUE(a.closed);
  EXPECT_EQ(a.headers["grpc-status"], "0") << a.headers["grpc-message"];
}

// A -bin key's value is taken padded or not (the wire format allows both), and one sent is
// unpadded.
TEST(GrpcH2ServerRawTest, BinaryMetadataIsTakenPaddedOrNot) {
  Served s;
  const int port = s.server().port();
  for (const std::string value : {"AQ==", "AQ"}) {
    SCOPED_TRACE(value);
    const size_t n = s.kept();
    std::thread answer([&] {
      auto c = s.Kept(n);
      ASSERT_NE(c, nullptr);
      ASSERT_NE(c->Metadata("x-key-bin"), nullptr);
      EXPECT_EQ(*c->Metadata("x-key-bin"), "\x01");
      c->AddInitialMetadata("x-out-bin", "\xfe");
      AnswerInfer(*c, "answered");
    });
    RawAnswer a = RawCall(port, GrpcHeaders({{":path", kInfer}, {"x-key-bin", value}}),
                          Prefixed(Request("encoder").SerializeAsString()));
    answer.join();
    EXPECT_EQ(a.headers["grpc-status"], "0") << a.headers["grpc-message"];
    EXPECT_EQ(a.headers["x-out-bin"], "/g");
  }
}

TEST(GrpcH2ServerRawTest, APingFloodEndsItsConnection) {
  Served s;
  int fd = Connect(s.server().port());
  ASSERT_GE(fd, 0);
  struct Seen {
    uint32_t goaway = 0xffffffff;
    int acks = 0;
  } seen;
  nghttp2_session_callbacks* cb;
  nghttp2_session_callbacks_new(&cb);
  nghttp2_session_callbacks_set_on_frame_recv_callback(
      cb, [](nghttp2_session*, const nghttp2_frame* f, void* u) {
        auto* x = static_cast<Seen*>(u);
        if (f->hd.type == NGHTTP2_GOAWAY) x->goaway = f->goaway.error_code;
        if (f->hd.type == NGHTTP2_PING && (f->hd.flags & NGHTTP2_FLAG_ACK)) x->acks++;
        return 0;
      });
  nghttp2_session* session;
  nghttp2_session_client_new(&session, cb, &seen);
  nghttp2_submit_settings(session, NGHTTP2_FLAG_NONE, nullptr, 0);
  for (int i = 0; i < 300; i++) nghttp2_submit_ping(session, NGHTTP2_FLAG_NONE, nullptr);
  // All in one write: the server has them all before it cuts the connection (a write after
  // that would be reset, and could lose the GOAWAY before it is read).
  std::string flood;
  const uint8_t* out;
  ssize_t n;
  while ((n = nghttp2_session_mem_send(session, &out)) > 0) {
    flood.append(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  }
  ASSERT_EQ(send(fd, flood.data(), flood.size(), MSG_NOSIGNAL), static_cast<ssize_t>(flood.size()));
  bool ended = false;
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (!ended && absl::Now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    char buf[65536];
    ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r <= 0) {
      ended = true;
      break;
    }
    nghttp2_session_mem_recv(session, reinterpret_cast<uint8_t*>(buf), r);
  }
  EXPECT_TRUE(ended);
  EXPECT_EQ(seen.goaway, static_cast<uint32_t>(NGHTTP2_ENHANCE_YOUR_CALM));
  EXPECT_LE(seen.acks, 100);
  nghttp2_session_del(session);
  nghttp2_session_callbacks_del(cb);
  close(fd);
  // Others are served on.
  auto stub = inference::GRPCInferenceService::NewStub(s.Channel());
  grpc::ClientContext ctx;
  inference::ServerLiveResponse r;
  EXPECT_TRUE(stub->ServerLive(&ctx, {}, &r).ok());
}

TEST(GrpcH2ServerRawTest, BytesThatAreNotHttp2EndOnlyTheirConnection) {
  Served s;
  for (const std::string& garbage :
       {std::string("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), std::string(100, '\xff'),
        std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") + std::string(64, '\x01')}) {
    int fd = Connect(s.server().port());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(send(fd, garbage.data(), garbage.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(garbage.size()));
    // The server closes it: reads end (after any GOAWAY it sends).
    bool ended = false;
    const absl::Time end = absl::Now() + absl::Seconds(5);
    while (!ended && absl::Now() < end) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char buf[4096];
      ssize_t r = recv(fd, buf, sizeof(buf), 0);
      ended = r <= 0;
    }
    EXPECT_TRUE(ended);
    close(fd);
  }
  // A client that connects and goes away at once.
  int fd = Connect(s.server().port());
  close(fd);
  auto stub = inference::GRPCInferenceService::NewStub(s.Channel());
  grpc::ClientContext ctx;
  inference::ServerLiveResponse r;
  ASSERT_TRUE(stub->ServerLive(&ctx, {}, &r).ok());
  EXPECT_TRUE(Eventually([&] { return s.server().connections() == 1; }, absl::Seconds(5)));
}

TEST(GrpcH2ServerParseTest, GrpcTimeout) {
  EXPECT_EQ(*ParseGrpcTimeout("100m"), absl::Milliseconds(100));
  EXPECT_EQ(*ParseGrpcTimeout("5S"), absl::Seconds(5));
  EXPECT_EQ(*ParseGrpcTimeout("2H"), absl::Hours(2));
  EXPECT_EQ(*ParseGrpcTimeout("3M"), absl::Minutes(3));
  EXPECT_EQ(*ParseGrpcTimeout("7u"), absl::Microseconds(7));
  EXPECT_EQ(*ParseGrpcTimeout("99999999n"), absl::Nanoseconds(99999999));
  for (const char* bad : {"", "m", "5", "5s", "-5S", "123456789S", "1.5S", " 5S", "5SS"}) {
    auto d = ParseGrpcTimeout(bad);
    EXPECT_FALSE(d.ok()) << bad;
    if (!d.ok()) {
      EXPECT_NE(d.status().message().find("grpc-timeout"), std::string::npos);
    }
  }
}

TEST(GrpcH2ServerParseTest, GrpcMessagePercentEncoding) {
  EXPECT_EQ(PercentEncodeGrpcMessage("plain text: ok"), "plain text: ok");
  EXPECT_EQ(PercentEncodeGrpcMessage("100%"), "100%25");
  EXPECT_EQ(PercentEncodeGrpcMessage("a\nb"), "a%0Ab");
  EXPECT_EQ(PercentEncodeGrpcMessage("\xc3\xbc"), "%C3%BC");
}

}  // namespace
}  // namespace kiln
