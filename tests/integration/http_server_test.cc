// The Beast HTTP server over real loopback sockets: what it promises any client (limits,
// timeouts, keep-alive, late and dropped replies, stopping).

#include "common/http_server.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "tests/support/raw_http_client.h"

namespace kiln {
namespace {

using testing::Get;
using testing::Post;
using RawClient = testing::RawHttpClient;

// Echoes what it was sent.
void Echo(HttpRequest r, HttpReply reply) {
  std::string out = r.method + " " + r.path + " ?" + r.query + " x-test=" +
                    std::string(r.Header("X-TEST").value_or("-")) + " body=" + r.body;
  reply.Send(200, out, "text/plain");
}

std::unique_ptr<HttpServer> StartServer(HttpServer::Handler handler,
                                        HttpServer::Options options = {}) {
  options.bind_address = "127.0.0.1";
  auto server = HttpServer::Start(options, std::move(handler));
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

// A handler that keeps every reply for the test to send later, from its own thread.
class Parked {
 public:
  HttpServer::Handler Handler() {
    return [this](HttpRequest, HttpReply reply) {
      absl::MutexLock lock(&mu_);
      replies_.push_back(reply);
    };
  }
  // Waits (bounded) until a request has arrived, and returns its reply.
  std::optional<HttpReply> Next() {
    absl::MutexLock lock(&mu_);
    auto have_one = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !replies_.empty(); };
    if (!mu_.AwaitWithTimeout(absl::Condition(&have_one), absl::Seconds(10))) return std::nullopt;
    HttpReply r = replies_.front();
    replies_.erase(replies_.begin());
    return r;
  }

 private:
  absl::Mutex mu_;
  std::vector<HttpReply> replies_ ABSL_GUARDED_BY(mu_);
};

TEST(HttpServer, AnswersSeveralRequestsOnOneKeptAliveConnection) {
  auto server = StartServer(Echo);
  ASSERT_NE(server->port(), 0);
  RawClient c(server->port());
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send(Get("/a/b%20c?x=1&y=2", "x-test: hello\r\n")));
  auto r1 = c.Read();
  EXPECT_EQ(r1.code, 200);
  EXPECT_EQ(r1.body, "GET /a/b%20c ?x=1&y=2 x-test=hello body=");
  ASSERT_TRUE(c.Send(Post("/p", "payload")));
  auto r2 = c.Read();
  EXPECT_EQ(r2.code, 200);
  EXPECT_EQ(r2.body, "POST /p ? x-test=- body=payload");
  // Two pipelined requests are answered in order.
  ASSERT_TRUE(c.Send(Post("/1", "one") + Post("/2", "two")));
  EXPECT_EQ(c.Read().body, "POST /1 ? x-test=- body=one");
  EXPECT_EQ(c.Read().body, "POST /2 ? x-test=- body=two");
}

TEST(HttpServer, ConnectionCloseIsHonoured) {
  auto server = StartServer(Echo);
  RawClient c(server->port());
  ASSERT_TRUE(c.Send(Get("/", "Connection: close\r\n")));
  auto r = c.Read();
  EXPECT_EQ(r.code, 200);
  EXPECT_NE(r.head.find("Connection: close"), std::string::npos) << r.head;
  EXPECT_TRUE(c.ClosedByServer());
}

TEST(HttpServer, RefusesADeclaredOversizeBodyBeforeReadingIt) {
  HttpServer::Options o;
  o.max_body_bytes = 1000;
  std::atomic<int> handled{0};
  auto server = StartServer([&](HttpRequest, HttpReply reply) {
    handled++;
    reply.Send(200, "", "text/plain");
  }, o);
  RawClient c(server->port());
  // Only the header is sent: the answer must come without the body.
  ASSERT_TRUE(c.Send("POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n"));
  auto r = c.Read();
  EXPECT_EQ(r.code, 413);
  EXPECT_NE(r.body.find("1000000000 bytes exceeds the limit of 1000 bytes"), std::string::npos)
      << r.body;
  EXPECT_NE(r.head.find("application/json"), std::string::npos);
  EXPECT_TRUE(c.ClosedByServer());
  EXPECT_EQ(handled.load(), 0);

  // A client that sends the refused body anyway can finish sending it and then read the 413:
  // the server drops the bytes instead of resetting the connection.
  RawClient eager(server->port());
  ASSERT_TRUE(eager.Send(Post("/x", std::string(4 << 20, 'z'))));
  r = eager.Read();
  EXPECT_EQ(r.code, 413);
  EXPECT_TRUE(eager.ClosedByServer());
  EXPECT_EQ(handled.load(), 0);

  // A body at the limit is fine.
  RawClient ok(server->port());
  ASSERT_TRUE(ok.Send(Post("/x", std::string(1000, 'a'))));
  EXPECT_EQ(ok.Read().code, 200);
}

TEST(HttpServer, CutsAChunkedBodyAtTheLimit) {
  HttpServer::Options o;
  o.max_body_bytes = 100;
  auto server = StartServer(Echo, o);
  RawClient c(server->port());
  std::string chunk(80, 'a');
  ASSERT_TRUE(c.Send("POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n50\r\n" +
                     chunk + "\r\n50\r\n" + chunk + "\r\n0\r\n\r\n"));
  auto r = c.Read();
  EXPECT_EQ(r.code, 413);
  EXPECT_NE(r.body.find("exceeds the limit of 100 bytes"), std::string::npos) << r.body;
}

// A chunk-size line (its extensions) or a trailer that never ends is not buffered for ever:
// past a bound it is refused, 400.
TEST(HttpServer, RefusesAChunkSizeLineThatNeverEnds) {
  auto server = StartServer(Echo, HttpServer::Options());
  RawClient c(server->port());
  ASSERT_TRUE(c.Send("POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1;" +
                     std::string(200 * 1024, 'a')));
  auto r = c.Read();
  EXPECT_EQ(r.code, 400);
  EXPECT_NE(r.body.find("chunk-size line or the trailer"), std::string::npos) << r.body;
}

// An error reply after a HEAD on the same connection still has its body.
TEST(HttpServer, AnErrorAfterAHeadHasItsBody) {
  auto server = StartServer(Echo, HttpServer::Options());
  RawClient c(server->port());
  ASSERT_TRUE(c.Send("HEAD / HTTP/1.1\r\nHost: x\r\n\r\n"));
  ASSERT_FALSE(c.ReadHead().empty());
  ASSERT_TRUE(c.Send("GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(20000, 'b') +
                     "\r\n\r\n"));
  auto r = c.Read();
  EXPECT_EQ(r.code, 431);
  EXPECT_NE(r.body.find("header"), std::string::npos) << r.body;
}

TEST(HttpServer, DisconnectsAClientThatNeverFinishesItsHeader) {
  HttpServer::Options o;
  o.header_timeout = absl::Milliseconds(200);
  auto server = StartServer(Echo, o);
  RawClient c(server->port());
  ASSERT_TRUE(c.Send("GET / HTTP/1.1\r\nHost: x\r\n"));  // no blank line, ever
  EXPECT_TRUE(c.ClosedByServer());
  // An idle kept-alive connection is also let go after the same time.
  RawClient idle(server->port());
  ASSERT_TRUE(idle.Send(Get("/")));
  EXPECT_EQ(idle.Read().code, 200);
  EXPECT_TRUE(idle.ClosedByServer());
}

TEST(HttpServer, DisconnectsAClientWhoseBodyNeverArrives) {
  HttpServer::Options o;
  o.body_timeout = absl::Milliseconds(200);
  auto server = StartServer(Echo, o);
  RawClient c(server->port());
  ASSERT_TRUE(c.Send("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc"));
  EXPECT_TRUE(c.ClosedByServer());
}

TEST(HttpServer, RefusesAnOversizeHeaderAndMalformedRequests) {
  HttpServer::Options o;
  o.max_header_bytes = 512;
  auto server = StartServer(Echo, o);
  {
    RawClient c(server->port());
    ASSERT_TRUE(c.Send(Get("/", "X-Big: " + std::string(2000, 'b') + "\r\n")));
    auto r = c.Read();
    EXPECT_EQ(r.code, 431);
    EXPECT_NE(r.body.find("limit of 512 bytes"), std::string::npos) << r.body;
  }
  for (std::string bad : {"NOT HTTP AT ALL\r\n\r\n", "GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n",
                          "GET / HTTP/1.1\r\nbad header line\r\n\r\n"}) {
    RawClient c(server->port());
    ASSERT_TRUE(c.Send(bad));
    auto r = c.Read();
    EXPECT_EQ(r.code, 400) << bad;
    EXPECT_NE(r.body.find("malformed request"), std::string::npos) << r.body;
    EXPECT_TRUE(c.ClosedByServer());
  }
  // Still serving.
  RawClient c(server->port());
  ASSERT_TRUE(c.Send(Get("/")));
  EXPECT_EQ(c.Read().code, 200);
}

TEST(HttpServer, AnswersExpect100Continue) {
  auto server = StartServer(Echo);
  RawClient c(server->port());
  ASSERT_TRUE(c.Send("POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"));
  auto interim = c.Read();
  EXPECT_EQ(interim.code, 100);
  ASSERT_TRUE(c.Send("data"));
  auto r = c.Read();
  EXPECT_EQ(r.code, 200);
  EXPECT_EQ(r.body, "POST /e ? x-test=- body=data");
}

TEST(HttpServer, RepliesFromAnotherThreadLaterAndOnlyOnce) {
  Parked parked;
  auto server = StartServer(parked.Handler());
  RawClient c(server->port());
  ASSERT_TRUE(c.Send(Get("/late")));
  auto reply = parked.Next();
  ASSERT_TRUE(reply);
  std::thread([&] {
    HttpResponse r;
    r.code = 201;
    r.body = "first";
    r.headers = {{"kiln-version", "3"}};
    reply->Send(r);
    reply->Send(500, "second", "text/plain");  // dropped
  }).join();
  auto r = c.Read();
  EXPECT_EQ(r.code, 201);
  EXPECT_EQ(r.body, "first");
  EXPECT_NE(r.head.find("kiln-version: 3"), std::string::npos) << r.head;
  // The connection carries on with the next request.
  ASSERT_TRUE(c.Send(Get("/next")));
  reply = parked.Next();
  ASSERT_TRUE(reply);
  reply->Send(200, "again", "text/plain");
  EXPECT_EQ(c.Read().body, "again");
}

TEST(HttpServer, ARequestDroppedUnansweredGets500AndAThrowingHandlerToo) {
  auto server = StartServer([](HttpRequest r, HttpReply) {
    if (r.path == "/throw") throw std::runtime_error("boom");
  });
  RawClient c(server->port());
  ASSERT_TRUE(c.Send(Get("/drop")));
  auto r = c.Read();
  EXPECT_EQ(r.code, 500);
  EXPECT_NE(r.body.find("without an answer"), std::string::npos) << r.body;
  ASSERT_TRUE(c.Send(Get("/throw")));
  r = c.Read();
  EXPECT_EQ(r.code, 500);
  EXPECT_NE(r.body.find("boom"), std::string::npos) << r.body;
}

TEST(HttpServer, HeadGetsTheHeadersWithoutTheBodyAndBodylessCodesDropTheirs) {
  auto server = StartServer([](HttpRequest r, HttpReply reply) {
    if (r.path == "/none") {
      reply.Send(204, "ignored", "text/plain");
    } else if (r.path == "/utf8") {
      throw std::runtime_error("bad \xff\xfe bytes");
    } else if (r.path == "/odd") {
      throw 42;
    } else {
      reply.Send(200, "hello", "text/plain");
    }
  });
  RawClient c(server->port());
  ASSERT_TRUE(c.Send("HEAD /x HTTP/1.1\r\nHost: x\r\n\r\n"));
  std::string head = c.ReadHead();
  EXPECT_EQ(head.rfind("HTTP/1.1 200", 0), 0u) << head;
  EXPECT_NE(head.find("Content-Length: 5"), std::string::npos) << head;
  // Had a body followed the head, it would now sit before the next response.
  ASSERT_TRUE(c.Send(Get("/none")));
  auto none = c.Read();
  EXPECT_EQ(none.code, 204) << none.head;
  EXPECT_EQ(none.body, "");
  ASSERT_TRUE(c.Send(Get("/y")));
  auto y = c.Read();
  EXPECT_EQ(y.code, 200);
  EXPECT_EQ(y.body, "hello");
  for (const char* path : {"/utf8", "/odd"}) {
    RawClient t(server->port());
    ASSERT_TRUE(t.Send(Get(path)));
    EXPECT_EQ(t.Read().code, 500) << path;
  }
}

TEST(HttpServer, StopClosesIdleConnectionsAndLetsInFlightRepliesOut) {
  Parked parked;
  auto server = StartServer(parked.Handler());
  RawClient idle(server->port());
  RawClient busy(server->port());
  ASSERT_TRUE(busy.Send(Get("/work")));
  auto reply = parked.Next();
  ASSERT_TRUE(reply);
  auto stopped = std::async(std::launch::async, [&] { server->Stop(absl::Seconds(30)); });
  EXPECT_TRUE(idle.ClosedByServer());
  // Stop is still waiting for the busy request's reply.
  EXPECT_EQ(stopped.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  reply->Send(200, "done", "text/plain");
  auto r = busy.Read();
  EXPECT_EQ(r.code, 200);
  EXPECT_EQ(r.body, "done");
  EXPECT_NE(r.head.find("Connection: close"), std::string::npos) << r.head;
  stopped.get();
  EXPECT_TRUE(busy.ClosedByServer());
  RawClient late(server->port());
  EXPECT_FALSE(late.connected());
}

TEST(HttpServer, AConnectionMadeBeforeStopStillHasItsFirstRequestServed) {
  Parked parked;
  auto server = StartServer(parked.Handler());
  // Connected, nothing sent yet. Accepted once `busy` (connected after it) has been: the
  // kernel queues connections in order and the server accepts them one by one.
  RawClient fresh(server->port());
  ASSERT_TRUE(fresh.connected());
  RawClient busy(server->port());
  ASSERT_TRUE(busy.Send(Get("/work")));  // keeps Stop waiting
  auto held = parked.Next();
  ASSERT_TRUE(held);
  auto stopped = std::async(std::launch::async, [&] { server->Stop(absl::Seconds(30)); });
  // The server is stopping when the request comes (bounded poll: until it refuses new
  // connections): it is served all the same, and closes.
  bool refusing = false;
  for (int i = 0; i < 500 && !refusing; ++i) {
    refusing = !RawClient(server->port()).connected();
    if (!refusing) absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(refusing);
  ASSERT_TRUE(fresh.Send(Get("/late")));
  auto reply = parked.Next();
  ASSERT_TRUE(reply);
  reply->Send(200, "served", "text/plain");
  auto r = fresh.Read();
  EXPECT_EQ(r.code, 200);
  EXPECT_EQ(r.body, "served");
  EXPECT_NE(r.head.find("Connection: close"), std::string::npos) << r.head;
  held->Send(200, "done", "text/plain");
  stopped.get();
  // Connections made once it stopped accepting are refused (nothing else serves the port).
  RawClient late(server->port());
  EXPECT_FALSE(late.connected());
}

TEST(HttpServer, AReplyAfterTheServerIsGoneIsDropped) {
  Parked parked;
  auto server = StartServer(parked.Handler());
  RawClient c(server->port());
  ASSERT_TRUE(c.Send(Get("/")));
  auto reply = parked.Next();
  ASSERT_TRUE(reply);
  server->Stop(absl::Milliseconds(50));
  server.reset();
  reply->Send(200, "too late", "text/plain");
  reply.reset();  // the last copy: its 500 is dropped too
}

TEST(HttpServer, NamesTheFlagsWhenItCannotListen) {
  auto first = StartServer(Echo);
  HttpServer::Options o;
  o.bind_address = "127.0.0.1";
  o.port = first->port();
  o.flags = "--http-port";
  // SO_REUSEADDR does not allow two listeners on one port.
  auto second = HttpServer::Start(o, Echo);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("--http-port"), std::string::npos) << second.status();
  o.port = 70000;
  auto bad = HttpServer::Start(o, Echo);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--http-port: port must be in 0..65535"), std::string::npos);
  o.port = 0;
  o.bind_address = "no such host.invalid";
  bad = HttpServer::Start(o, Echo);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("cannot resolve bind address"), std::string::npos);
}

TEST(PercentDecode, DecodesEscapesAndKeepsMalformedOnes) {
  EXPECT_EQ(PercentDecode("a%20b%2Fc"), "a b/c");
  EXPECT_EQ(PercentDecode("100%"), "100%");
  EXPECT_EQ(PercentDecode("%zz%4"), "%zz%4");
  EXPECT_EQ(PercentDecode("a+b"), "a+b");
}

TEST(PercentEncodeSegment, EncodesAllButUnreservedAndRoundTrips) {
  EXPECT_EQ(PercentEncodeSegment("bge-m3_v1.2~x"), "bge-m3_v1.2~x");
  EXPECT_EQ(PercentEncodeSegment("a b/c?d%"), "a%20b%2Fc%3Fd%25");
  EXPECT_EQ(PercentEncodeSegment(std::string("\xc3\xa9\0", 3)), "%C3%A9%00");
  const std::string all = [] {
    std::string s;
    for (int c = 0; c < 256; ++c) s.push_back(static_cast<char>(c));
    return s;
  }();
  EXPECT_EQ(PercentDecode(PercentEncodeSegment(all)), all);
}

// With an idle spin the server's thread polls busily after each piece of work: it still reads
// requests, writes replies sent from other threads and accepts connections while it spins,
// it does burn CPU meanwhile, and Stop ends an hour-long spin.
TEST(HttpServer, AnIdleSpinStillServesAndStopEndsIt) {
  Parked parked;
  HttpServer::Options o;
  o.threads = 1;
  o.idle_spin = absl::Hours(1);
  auto server = StartServer(
      [&](HttpRequest r, HttpReply reply) {
        if (r.path == "/parked") return parked.Handler()(std::move(r), reply);
        Echo(std::move(r), reply);
      },
      o);
  ASSERT_NE(server, nullptr);
  RawClient c(server->port());
  ASSERT_TRUE(c.Send(Get("/one")));
  EXPECT_EQ(c.Read().body, "GET /one ? x-test=- body=");
  // The thread spins now: the next request, a second connection and a reply sent from
  // this thread are all handled by its polling.
  ASSERT_TRUE(c.Send(Get("/two")));
  EXPECT_EQ(c.Read().body, "GET /two ? x-test=- body=");
  RawClient d(server->port());
  ASSERT_TRUE(d.Send(Get("/parked")));
  std::optional<HttpReply> reply = parked.Next();
  ASSERT_TRUE(reply.has_value());
  reply->Send(200, "late", "text/plain");
  EXPECT_EQ(d.Read().body, "late");
  // Spinning, the process burns CPU while nothing comes (~200 ms of it in 200 ms; a tenth is
  // asked for, a loaded machine's share). Without the spin it would sleep.
  auto cpu_ms = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1000.0 +
           (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1000.0;
  };
  const double before = cpu_ms();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_GT(cpu_ms() - before, 20.0);
  server->Stop(absl::Seconds(1));  // returns: the spin ends when the server stops
}

}  // namespace
}  // namespace kiln
