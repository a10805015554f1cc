// The Beast HTTP client over real loopback sockets, against the project's HTTP server and
// against raw sockets that misbehave on purpose.

#include "common/http_client.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/http_server.h"
#include "tests/support/raw_server.h"

namespace kiln {
namespace {

using testing::RawServer;

// Sends and waits (bounded) for the answer.
absl::StatusOr<HttpClientResponse> SendAndWait(HttpClient& client, const std::string& address,
                                               HttpClientRequest request) {
  absl::Notification done;
  absl::StatusOr<HttpClientResponse> out = absl::UnknownError("no answer within 30 s");
  client.Send(address, std::move(request), [&](absl::StatusOr<HttpClientResponse> r) {
    out = std::move(r);
    done.Notify();
  });
  done.WaitForNotificationWithTimeout(absl::Seconds(30));
  return out;
}

// Reads one request head (and nothing after it); false when the connection ended first.
bool ReadHead(int fd) {
  std::string got;
  char c;
  while (got.find("\r\n\r\n") == std::string::npos) {
    if (read(fd, &c, 1) != 1) return false;
    got += c;
  }
  return true;
}

void WriteAll(int fd, const std::string& s) {
  (void)!send(fd, s.data(), s.size(), MSG_NOSIGNAL);
}

TEST(HttpClientTest, GetAndPostOverOneKeptAliveConnection) {
  HttpServer::Options o;
  o.bind_address = "127.0.0.1";
  auto server = HttpServer::Start(o, [](HttpRequest r, HttpReply reply) {
    HttpResponse out;
    out.code = r.method == "POST" ? 201 : 200;
    out.body = r.method + " " + r.path + " x-test=" +
               std::string(r.Header("x-test").value_or("-")) + " body=" + r.body;
    out.content_type = "text/plain";
    out.headers.emplace_back("kiln-version", "7");
    reply.Send(std::move(out));
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = "127.0.0.1:" + std::to_string((*server)->port());
  HttpClient client({});
  for (int i = 0; i < 3; ++i) {
    HttpClientRequest get;
    get.target = "/v2/models/m";
    auto r = SendAndWait(client, address, get);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->code, 200);
    EXPECT_EQ(r->body, "GET /v2/models/m x-test=- body=");
    EXPECT_EQ(r->Header("KILN-VERSION"), "7");
    EXPECT_EQ(r->Header("no-such"), std::nullopt);
    HttpClientRequest post;
    post.method = "POST";
    post.target = "/v2/models/m/infer";
    post.headers = {{"x-test", "yes"}};
    post.body = std::string(100000, 'b');
    post.content_type = "application/json";
    r = SendAndWait(client, address, post);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->code, 201);
    EXPECT_EQ(r->body, "POST /v2/models/m/infer x-test=yes body=" + std::string(100000, 'b'));
  }
  EXPECT_EQ(client.connections_made(), 1);
  EXPECT_EQ(client.idle_connections(), 1);
  client.Stop();
  EXPECT_EQ(client.idle_connections(), 0);
  (*server)->Stop(absl::Seconds(1));
}

// A kept-alive connection the peer closes while it is idle is dropped then (its descriptor
// does not linger), and the next request makes a new one.
TEST(HttpClientTest, AnIdleConnectionThePeerClosesIsDropped) {
  std::atomic<int> heads{0};
  RawServer server([&](int fd) {
    // One answer per connection, kept alive in words, then closed.
    if (!ReadHead(fd)) return;
    heads++;
    WriteAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok");
    shutdown(fd, SHUT_RDWR);
  });
  HttpClient client({});
  for (int i = 0; i < 3; ++i) {
    auto r = SendAndWait(client, server.address(), {});
    ASSERT_TRUE(r.ok()) << i << ": " << r.status();
    EXPECT_EQ(r->body, "ok");
    // Bounded poll: the client sees the close and drops the connection (the server shuts its
    // side only, so the client's socket is what closes it).
    for (int k = 0; k < 400 && client.idle_connections() > 0; ++k) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(client.idle_connections(), 0) << i;
  }
  EXPECT_EQ(client.connections_made(), 3);
  EXPECT_EQ(heads.load(), 3);  // no request was sent on a closed connection
}

// The peer closes a kept-alive connection just as a request goes on it (it read the request
// but answered nothing): the request goes once more on a new connection, unseen by the caller.
// Once any of an answer came, it is not sent again: the peer had it.
TEST(HttpClientTest, ARequestThePeerDroppedUnansweredIsSentAgainOnce) {
  std::atomic<int> heads{0};
  RawServer drops_second([&](int fd) {
    if (!ReadHead(fd)) return;
    heads++;
    WriteAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
    if (!ReadHead(fd)) return;  // the next request on it: dropped unanswered
    heads++;
    shutdown(fd, SHUT_RDWR);
  });
  HttpClient client({});
  for (int i = 0; i < 3; ++i) {
    auto r = SendAndWait(client, drops_second.address(), {});
    ASSERT_TRUE(r.ok()) << i << ": " << r.status();
    EXPECT_EQ(r->body, "ok");
  }
  // 1: new connection; 2: reused, dropped, resent on a new one; 3: the same.
  EXPECT_EQ(heads.load(), 5);
  EXPECT_EQ(drops_second.accepted(), 3);

  std::atomic<int> partial_heads{0};
  RawServer cuts_second([&](int fd) {
    if (!ReadHead(fd)) return;
    partial_heads++;
    WriteAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
    if (!ReadHead(fd)) return;
    partial_heads++;
    WriteAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab");  // then gone
    shutdown(fd, SHUT_RDWR);
  });
  ASSERT_TRUE(SendAndWait(client, cuts_second.address(), {}).ok());
  auto cut = SendAndWait(client, cuts_second.address(), {});
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kUnavailable) << cut.status();
  EXPECT_EQ(partial_heads.load(), 2);
  EXPECT_EQ(cuts_second.accepted(), 1);
}

// An answer whose body ends when the connection closes (no length, HTTP/1.0 or
// `Connection: close`) is read whole, and its connection never used again.
TEST(HttpClientTest, AnAnswerEndedByCloseIsWholeAndItsConnectionNotReused) {
  std::atomic<int> n{0};
  RawServer server([&](int fd) {
    if (!ReadHead(fd)) return;
    const int k = n++;
    if (k % 2 == 0) {
      WriteAll(fd, "HTTP/1.1 200 OK\r\n\r\nuntil-close");
    } else {
      WriteAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nclose");
    }
    shutdown(fd, SHUT_RDWR);
  });
  HttpClient client({});
  for (int i = 0; i < 4; ++i) {
    auto r = SendAndWait(client, server.address(), {});
    ASSERT_TRUE(r.ok()) << i << ": " << r.status();
    EXPECT_EQ(r->body, i % 2 == 0 ? "until-close" : "close");
    EXPECT_EQ(client.idle_connections(), 0);
  }
  EXPECT_EQ(server.accepted(), 4);
}

// Interim answers (100 Continue, 103 Early Hints) before the real one are passed over.
TEST(HttpClientTest, InterimAnswersArePassedOver) {
  RawServer server([&](int fd) {
    if (!ReadHead(fd)) return;
    WriteAll(fd, "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                 "HTTP/1.1 201 Created\r\nContent-Length: 4\r\nConnection: close\r\n\r\nmade");
    shutdown(fd, SHUT_RDWR);
  });
  HttpClient client({});
  auto r = SendAndWait(client, server.address(), {});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->code, 201);
  EXPECT_EQ(r->body, "made");
}

TEST(HttpClientTest, FailuresAreNamed) {
  HttpClient::Options o;
  o.timeout = absl::Seconds(1);
  o.max_response_bytes = 1000;
  HttpClient client(o);
  // Nothing listens there.
  int dead_port;
  {
    RawServer gone([](int) {});
    dead_port = std::stoi(gone.address().substr(10));
  }
  auto refused = SendAndWait(client, "127.0.0.1:" + std::to_string(dead_port), {});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_NE(refused.status().message().find("cannot connect"), std::string::npos);
  // Never answers.
  RawServer silent([](int fd) {
    ReadHead(fd);
    char c;
    (void)!read(fd, &c, 1);  // until the client or the test closes it
  });
  auto late = SendAndWait(client, silent.address(), {});
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  // Answers too much.
  RawServer big([](int fd) {
    if (!ReadHead(fd)) return;
    WriteAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + std::string(5000, 'x'));
  });
  auto over = SendAndWait(client, big.address(), {});
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  RawServer big_chunks([](int fd) {
    if (!ReadHead(fd)) return;
    WriteAll(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
    for (int i = 0; i < 10; ++i) WriteAll(fd, "1f4\r\n" + std::string(500, 'x') + "\r\n");
    WriteAll(fd, "0\r\n\r\n");
  });
  auto chunked = SendAndWait(client, big_chunks.address(), {});
  EXPECT_EQ(chunked.status().code(), absl::StatusCode::kResourceExhausted) << chunked.status();
  // Does not speak HTTP.
  RawServer garbage([](int fd) {
    if (!ReadHead(fd)) return;
    WriteAll(fd, "SSH-2.0-OpenSSH\r\n\r\n");
  });
  auto bad = SendAndWait(client, garbage.address(), {});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal) << bad.status();
  // Closes before answering (a replica going away).
  RawServer closing([](int fd) {
    ReadHead(fd);
    shutdown(fd, SHUT_RDWR);
  });
  auto gone = SendAndWait(client, closing.address(), {});
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable) << gone.status();
  // Not an address, not a method.
  for (const std::string address : {"nowhere", "127.0.0.1:0", "127.0.0.1:99999", ":80"}) {
    auto r = SendAndWait(client, address, {});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << address;
  }
  HttpClientRequest del;
  del.method = "DELETE";
  EXPECT_EQ(SendAndWait(client, silent.address(), del).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A name is resolved.
  RawServer named([](int fd) {
    if (!ReadHead(fd)) return;
    WriteAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nname");
  });
  auto by_name = SendAndWait(client, "localhost:" + named.address().substr(10), {});
  ASSERT_TRUE(by_name.ok()) << by_name.status();
  EXPECT_EQ(by_name->body, "name");
}

// Stop fails what is in flight (each callback once) and whatever is sent after it.
TEST(HttpClientTest, StopFailsWhatIsInFlightAndEverythingAfter) {
  RawServer silent([](int fd) {
    ReadHead(fd);
    char c;
    (void)!read(fd, &c, 1);
  });
  HttpClient client({});
  std::atomic<int> calls{0};
  std::atomic<int> unavailable{0};
  for (int i = 0; i < 4; ++i) {
    client.Send(silent.address(), {}, [&](absl::StatusOr<HttpClientResponse> r) {
      calls++;
      if (r.status().code() == absl::StatusCode::kUnavailable) unavailable++;
    });
  }
  for (int i = 0; i < 2000 && silent.accepted() < 4; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(silent.accepted(), 4);
  client.Stop();
  EXPECT_EQ(calls.load(), 4);
  EXPECT_EQ(unavailable.load(), 4);
  auto after = SendAndWait(client, silent.address(), {});
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable);
  client.Stop();  // again: nothing happens
}

}  // namespace
}  // namespace kiln
