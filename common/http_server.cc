#include "common/http_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <boost/asio/dispatch.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "absl/synchronization/mutex.h"
#include "common/idle_spin.h"
#include "common/logging.h"

namespace kiln {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = net::ip::tcp;

namespace {

std::chrono::steady_clock::duration Chrono(absl::Duration d) {
  return absl::ToChronoNanoseconds(d);
}

// The server's own error replies: a JSON error and a newline.
std::string ErrorBody(const std::string& message) { return JsonError(message) + "\n"; }

// The client closed, reset or timed out, or the server closed the connection: nothing to
// answer.
bool ClientGone(const beast::error_code& ec) {
  return ec == bhttp::error::end_of_stream || ec == beast::error::timeout ||
         ec == net::error::operation_aborted || ec == net::error::connection_reset ||
         ec == net::error::eof;
}

}  // namespace

class Connection;

namespace http_internal {

class ReplySlot {
 public:
  explicit ReplySlot(std::shared_ptr<Connection> connection) : connection_(std::move(connection)) {}
  ~ReplySlot();
  void Send(HttpResponse response);

 private:
  std::atomic<bool> sent_{false};
  std::shared_ptr<Connection> connection_;
};

}  // namespace http_internal

class HttpServer::State : public std::enable_shared_from_this<HttpServer::State> {
 public:
  State(Options options, Handler handler)
      : options(std::move(options)), handler(std::move(handler)), acceptor(net::make_strand(ioc)) {}

  Options options;
  Handler handler;
  net::io_context ioc;
  tcp::acceptor acceptor;
  net::steady_timer accept_retry{acceptor.get_executor()};
  // Keeps the threads running while a connection waits for a handler's reply, when no socket
  // operation is pending.
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work{ioc.get_executor()};
  std::vector<std::thread> threads;

  void Accept();
  // Runs the io_context until it stops; with an idle spin, polls busily after each handler.
  void Run() {
    if (options.idle_spin <= absl::ZeroDuration()) {
      ioc.run();
      return;
    }
    const auto spin = absl::ToChronoNanoseconds(ClampIdleSpin(options.idle_spin));
    while (ioc.run_one() > 0) {
      auto until = std::chrono::steady_clock::now() + spin;
      while (!ioc.stopped() && std::chrono::steady_clock::now() < until) {
        if (ioc.poll() > 0) until = std::chrono::steady_clock::now() + spin;
      }
    }
  }
  void Add(const std::shared_ptr<Connection>& c) {
    absl::MutexLock lock(&mu);
    connections[c.get()] = c;
  }
  void Remove(Connection* c) {
    absl::MutexLock lock(&mu);
    connections.erase(c);
  }
  bool stopping() {
    absl::MutexLock lock(&mu);
    return stopping_;
  }
  bool stopped() {
    absl::MutexLock lock(&mu);
    return stopped_;
  }

  absl::Mutex mu;
  bool stopping_ ABSL_GUARDED_BY(mu) = false;
  bool stopped_ ABSL_GUARDED_BY(mu) = false;
  std::unordered_map<Connection*, std::shared_ptr<Connection>> connections ABSL_GUARDED_BY(mu);
};

// One client connection; everything it does runs on its own strand. The server's registry
// holds it until it closes, so it lives while a handler is working on its request.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(tcp::socket socket, std::shared_ptr<HttpServer::State> state)
      : state_(std::move(state)), stream_(std::move(socket)), first_request_(stream_.get_executor()) {}

  void Start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->ReadHeader(); });
  }

  // On the strand: an idle keep-alive connection (one that has had its replies) closes now;
  // one with a request in hand closes after its reply. A connection accepted before the stop
  // that has not sent its first request yet gets one more second for it (its client connected
  // to a running server and may be sending it now), then closes.
  void OnStopping() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] {
      if ((self->reading_header_ && self->replies_ > 0) || self->lingering_) {
        self->Close();
      } else if (self->reading_header_) {
        self->first_request_.expires_after(std::chrono::seconds(1));
        self->first_request_.async_wait([self](beast::error_code ec) {
          if (!ec && self->reading_header_) self->Close();
        });
      }
    });
  }

  // After the server's threads have stopped: ends what is left.
  void CloseNow() {
    net::post(stream_.get_executor(), [self = shared_from_this()] { self->Close(); });
  }

  // From any thread, once per request; dropped once the server has stopped. From the
  // connection's own strand (a handler that answered inline) the write starts at once, on this
  // thread, instead of waking another of the server's threads for it.
  void Reply(HttpResponse response) {
    const auto* strand = stream_.get_executor().target<net::strand<net::io_context::executor_type>>();
    if (strand != nullptr && strand->running_in_this_thread()) {
      if (state_->stopped()) return;
      Write(std::move(response), /*close=*/false);
      return;
    }
    absl::MutexLock lock(&state_->mu);
    if (state_->stopped_) return;
    net::post(stream_.get_executor(), [self = shared_from_this(), r = std::move(response)]() mutable {
      self->Write(std::move(r), /*close=*/false);
    });
  }

 private:
  void ReadHeader() {
    if (closed_) return;
    if (state_->stopping() && replies_ > 0) return Close();
    parser_.emplace();
    head_ = false;  // until this request says otherwise (an error reply to it has a body)
    parser_->header_limit(static_cast<uint32_t>(state_->options.max_header_bytes));
    parser_->body_limit(static_cast<uint64_t>(state_->options.max_body_bytes));
    reading_header_ = true;
    stream_.expires_after(Chrono(state_->options.header_timeout));
    bhttp::async_read_header(stream_, buffer_, *parser_,
                             [self = shared_from_this()](beast::error_code ec, size_t) {
                               self->OnHeader(ec);
                             });
  }

  void OnHeader(beast::error_code ec) {
    reading_header_ = false;
    if (ec == bhttp::error::header_limit) {
      return Fail(431, "the request header exceeds the limit of " +
                           std::to_string(state_->options.max_header_bytes) + " bytes");
    }
    if (ClientGone(ec) || closed_) return Close();
    if (ec == bhttp::error::body_limit) {
      // Refused from the declared length alone (the parser has the header fields by now).
      auto declared = parser_->get()[bhttp::field::content_length];
      return Fail(413, "the request body of " + std::string(declared.data(), declared.size()) +
                           " bytes exceeds the limit of " +
                           std::to_string(state_->options.max_body_bytes) + " bytes");
    }
    if (ec) return Fail(400, "malformed request: " + ec.message());
    stream_.expires_after(Chrono(state_->options.body_timeout));
    auto expect = parser_->get()[bhttp::field::expect];
    if (!parser_->is_done() && beast::iequals(expect, "100-continue")) {
      static const char kContinue[] = "HTTP/1.1 100 Continue\r\n\r\n";
      net::async_write(stream_, net::buffer(kContinue, sizeof(kContinue) - 1),
                       [self = shared_from_this()](beast::error_code ec, size_t) {
                         if (ec) return self->Close();
                         self->ReadBody();
                       });
      return;
    }
    ReadBody();
  }

  void ReadBody() {
    bhttp::async_read(stream_, buffer_, *parser_,
                      [self = shared_from_this()](beast::error_code ec, size_t) { self->OnBody(ec); });
  }

  void OnBody(beast::error_code ec) {
    if (ec == bhttp::error::body_limit) {
      return Fail(413, "the request body exceeds the limit of " +
                           std::to_string(state_->options.max_body_bytes) + " bytes");
    }
    if (ec == bhttp::error::buffer_overflow) {
      return Fail(400, "malformed request: a chunk-size line or the trailer is longer than " +
                           std::to_string(kReadSlack) + " bytes");
    }
    if (ClientGone(ec) || closed_) return Close();
    if (ec) return Fail(400, "malformed request: " + ec.message());
    stream_.expires_never();
    if (state_->stopped()) return Close();  // read in the final flush: too late to answer
    auto message = parser_->release();
    parser_.reset();
    keep_alive_ = message.keep_alive();
    head_ = message.method() == bhttp::verb::head;
    HttpRequest request;
    request.method = std::string(message.method_string());
    std::string_view target(message.target().data(), message.target().size());
    size_t q = target.find('?');
    request.path = std::string(target.substr(0, q));
    if (q != std::string_view::npos) request.query = std::string(target.substr(q + 1));
    for (const auto& field : message) {
      request.headers.emplace_back(std::string(field.name_string()), std::string(field.value()));
    }
    request.body = std::move(message.body());
    HttpReply reply(std::make_shared<http_internal::ReplySlot>(shared_from_this()));
    try {
      state_->handler(std::move(request), reply);
    } catch (const std::exception& e) {
      reply.Send(500, ErrorBody(std::string("internal error: ") + e.what()), "application/json");
    } catch (...) {
      reply.Send(500, ErrorBody("internal error"), "application/json");
    }
  }

  // Answers with the server's own error and closes the connection after it.
  void Fail(int code, const std::string& message) {
    HttpResponse r;
    r.code = code;
    r.body = ErrorBody(message);
    r.content_type = "application/json";
    linger_ = true;  // the client may still be sending what was refused
    Write(std::move(r), /*close=*/true);
  }

  void Write(HttpResponse r, bool close) {
    if (closed_) return;
    response_.emplace(static_cast<bhttp::status>(r.code), 11);
    response_->set(bhttp::field::server, "kiln");
    response_->set(bhttp::field::content_type, r.content_type);
    for (auto& [name, value] : r.headers) response_->insert(name, value);
    // No body where HTTP allows none (prepare_payload would throw on one).
    if (r.code < 200 || r.code == 204 || r.code == 304) r.body.clear();
    response_->body() = std::move(r.body);
    response_->keep_alive(keep_alive_ && !close && !state_->stopping());
    response_->prepare_payload();
    if (head_) response_->body().clear();  // the headers a GET would get, without the body
    stream_.expires_after(Chrono(state_->options.write_timeout));
    bhttp::async_write(stream_, *response_,
                       [self = shared_from_this()](beast::error_code ec, size_t) {
                         self->replies_++;
                         bool again = !ec && self->response_->keep_alive();
                         self->response_.reset();
                         if (again) {
                           self->ReadHeader();
                         } else if (!ec && self->linger_) {
                           self->Linger();
                         } else {
                           self->Close();
                         }
                       });
  }

  // After the last reply: the server's side is shut, and what the client still sends (the
  // rest of a refused body) is read and thrown away for a while, so that the client reads the
  // reply instead of a connection reset.
  void Linger() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    lingering_ = true;
    stream_.expires_after(Chrono(state_->options.linger_timeout));
    DiscardSome();
  }
  void DiscardSome() {
    if (!scratch_) scratch_ = std::make_unique<std::array<char, 16384>>();
    stream_.async_read_some(net::buffer(*scratch_),
                            [self = shared_from_this()](beast::error_code ec, size_t) {
                              if (ec || self->closed_) return self->Close();
                              self->DiscardSome();
                            });
  }

  void Close() {
    if (closed_) return;
    closed_ = true;
    first_request_.cancel();
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.close();
    state_->Remove(this);
  }

  // Declared first so it goes last: the socket needs the io_context the state owns.
  std::shared_ptr<HttpServer::State> state_;  // keeps the io_context for late replies
  beast::tcp_stream stream_;
  net::steady_timer first_request_;  // while stopping: how long a fresh connection may wait
  // Bounded: the parser consumes a body as it comes, but not a chunk-size line (extensions) or a
  // trailer until its end, which a client could send for ever. Past this the read fails
  // (buffer_overflow) and the request is refused.
  beast::flat_buffer buffer_{static_cast<size_t>(state_->options.max_header_bytes) + kReadSlack};
  static constexpr size_t kReadSlack = 64 * 1024;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::optional<bhttp::response<bhttp::string_body>> response_;
  bool keep_alive_ = true;
  bool reading_header_ = false;
  int64_t replies_ = 0;  // written on this connection
  bool head_ = false;
  bool linger_ = false;  // after an error reply: drain what the client still sends
  bool lingering_ = false;
  std::unique_ptr<std::array<char, 16384>> scratch_;
  bool closed_ = false;
};

namespace http_internal {

void ReplySlot::Send(HttpResponse response) {
  if (sent_.exchange(true)) return;
  connection_->Reply(std::move(response));
  connection_.reset();
}

ReplySlot::~ReplySlot() {
  HttpResponse r;
  r.code = 500;
  r.body = ErrorBody("the server dropped the request without an answer");
  r.content_type = "application/json";
  Send(std::move(r));
}

}  // namespace http_internal

void HttpReply::Send(HttpResponse response) const { slot_->Send(std::move(response)); }

void HttpReply::Send(int code, std::string body, std::string content_type) const {
  HttpResponse r;
  r.code = code;
  r.body = std::move(body);
  r.content_type = std::move(content_type);
  slot_->Send(std::move(r));
}

void HttpServer::State::Accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
    if (ec) {
      // Out of descriptors, say: try again shortly instead of spinning.
      accept_retry.expires_after(std::chrono::milliseconds(100));
      accept_retry.async_wait([this](beast::error_code wait_ec) {
        if (!wait_ec && acceptor.is_open()) Accept();
      });
      return;
    }
    if (stopping()) {
      beast::error_code ignored;
      socket.close(ignored);
    } else {
      auto c = std::make_shared<Connection>(std::move(socket), shared_from_this());
      Add(c);
      c->Start();
    }
    Accept();
  });
}

absl::StatusOr<int> DupListener(int fd, const std::string& what) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  int type = 0, listening = 0;
  socklen_t type_len = sizeof(type), listening_len = sizeof(listening);
  if (fd < 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
      (addr.ss_family != AF_INET && addr.ss_family != AF_INET6) ||
      getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) != 0 || type != SOCK_STREAM ||
      getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &listening_len) != 0 || !listening) {
    return absl::InvalidArgumentError(what + ": the socket handed over (fd " + std::to_string(fd) +
                                      ") is not a listening TCP socket");
  }
  int dup = fcntl(fd, F_DUPFD_CLOEXEC, 3);
  if (dup < 0) {
    return absl::ResourceExhaustedError(what + ": cannot duplicate fd " + std::to_string(fd) +
                                        ": " + strerror(errno));
  }
  return dup;
}

int LocalPort(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return 0;
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return 0;
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(Options options, Handler handler) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(options.flags + ": port must be in 0..65535, got " +
                                      std::to_string(options.port));
  }
  if (options.threads < 1) options.threads = 1;
  auto state = std::make_shared<State>(options, std::move(handler));
  beast::error_code ec;
  if (options.listen_fd >= 0) {
    // Its own duplicate: closing it on Stop leaves the handed-over socket listening (and
    // queueing connections for whoever serves it next).
    auto fd = DupListener(options.listen_fd, options.flags);
    if (!fd.ok()) return fd.status();
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    getsockname(*fd, reinterpret_cast<sockaddr*>(&addr), &len);
    state->acceptor.assign(addr.ss_family == AF_INET6 ? tcp::v6() : tcp::v4(), *fd, ec);
    if (ec) {
      close(*fd);
      return absl::InvalidArgumentError(options.flags + ": the socket handed over (fd " +
                                        std::to_string(options.listen_fd) + "): " + ec.message());
    }
  } else {
    auto address = net::ip::make_address(options.bind_address, ec);
    if (ec) {
      tcp::resolver resolver(state->ioc);
      auto results = resolver.resolve(options.bind_address, "", ec);
      if (ec || results.empty()) {
        return absl::InvalidArgumentError(options.flags + ": cannot resolve bind address '" +
                                          options.bind_address + "'");
      }
      address = results.begin()->endpoint().address();
    }
    tcp::endpoint endpoint(address, static_cast<uint16_t>(options.port));
    auto fail = [&](const char* what) {
      return absl::UnavailableError(options.flags + ": cannot listen on " + options.bind_address +
                                    ":" + std::to_string(options.port) + " (" + what + ": " +
                                    ec.message() + ")");
    };
    state->acceptor.open(endpoint.protocol(), ec);
    if (ec) return fail("open");
    state->acceptor.set_option(net::socket_base::reuse_address(true), ec);
    if (ec) return fail("reuse_address");
    state->acceptor.bind(endpoint, ec);
    if (ec) return fail("bind");
    state->acceptor.listen(net::socket_base::max_listen_connections, ec);
    if (ec) return fail("listen");
  }
  int port = state->acceptor.local_endpoint().port();
  state->Accept();
  for (int i = 0; i < options.threads; ++i) {
    state->threads.emplace_back([s = state.get()] {
      pthread_setname_np(pthread_self(), "http-server");  // for top -H and perf
      for (;;) {  // a handler that throws must not take the process down
        try {
          s->Run();
          return;
        } catch (const std::exception& e) {
          GetLogger("http")->error("HTTP handler failed: {}", e.what());
        } catch (...) {
          GetLogger("http")->error("HTTP handler failed");
        }
      }
    });
  }
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(state), port));
}

HttpServer::HttpServer(std::shared_ptr<State> state, int port)
    : state_(std::move(state)), port_(port) {}

HttpServer::~HttpServer() { Stop(absl::Seconds(10)); }

void HttpServer::Stop(absl::Duration grace) {
  State* s = state_.get();
  {
    absl::MutexLock lock(&s->mu);
    if (s->stopped_ || s->stopping_) return;
  }
  // Stop accepting first, and wait for it: a connection accepted up to here is served; one
  // made from here on waits in the socket's queue (for whoever serves a handed-over socket
  // next) or is refused.
  auto closed = std::make_shared<std::promise<void>>();
  net::dispatch(s->acceptor.get_executor(), [s, closed] {
    // Stopping before the port refuses connections: a reply written once a client can see the
    // stop (a refused connect) says "Connection: close".
    {
      absl::MutexLock lock(&s->mu);
      s->stopping_ = true;
    }
    beast::error_code ignored;
    s->acceptor.close(ignored);
    s->accept_retry.cancel();
    closed->set_value();
  });
  closed->get_future().wait_for(std::chrono::seconds(5));
  std::vector<std::shared_ptr<Connection>> open;
  {
    absl::MutexLock lock(&s->mu);
    s->stopping_ = true;
    for (auto& [ptr, c] : s->connections) open.push_back(c);
  }
  for (auto& c : open) c->OnStopping();
  open.clear();
  {
    absl::MutexLock lock(&s->mu);
    auto empty = [s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return s->connections.empty(); };
    s->mu.AwaitWithTimeout(absl::Condition(&empty), grace);
    s->stopped_ = true;
  }
  s->work.reset();
  s->ioc.stop();
  for (auto& t : s->threads) t.join();
  s->threads.clear();
  // Close what is left and run the queue dry on this thread, so nothing queued keeps a
  // connection (and through it this state) alive. Replies sent from now on are dropped.
  std::unordered_map<Connection*, std::shared_ptr<Connection>> rest;
  {
    absl::MutexLock lock(&s->mu);
    rest.swap(s->connections);
  }
  for (auto& [ptr, c] : rest) c->CloseNow();
  rest.clear();
  s->ioc.restart();
  s->ioc.run();
}

std::optional<std::string_view> HttpRequest::Header(std::string_view name) const {
  for (const auto& [n, v] : headers) {
    if (beast::iequals(beast::string_view(n.data(), n.size()),
                       beast::string_view(name.data(), name.size()))) {
      return std::string_view(v);
    }
  }
  return std::nullopt;
}

std::string JsonError(const std::string& message) {
  return nlohmann::json{{"error", message}}.dump(-1, ' ', false,
                                                 nlohmann::json::error_handler_t::replace);
}

}  // namespace kiln
