#pragma once

// A gRPC server for unary calls, on HTTP/2 in cleartext (prior knowledge, as gRPC clients
// speak it) through nghttp2, run by one thread.
//
// Why not grpc++'s own server: Debian's gRPC 1.51 hands every callback-API call between
// several threads (about 13 context switches per call were measured on a replica), which costs
// a node's router more than the whole hop it is meant to save. Here one thread reads, parses
// and hands each complete call to the handler; an answer is written to the caller's socket by
// whichever thread finishes the call, without waking this one.
//
// What it speaks (https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md):
//  - POST, content-type application/grpc[+proto|;...]; anything else is answered HTTP 415;
//  - one length-prefixed message per call, uncompressed (a compressed one is UNIMPLEMENTED),
//    at most Options::max_message_bytes (larger: RESOURCE_EXHAUSTED, refused from its prefix);
//    the unfinished requests of one connection hold at most twice that, and at least 64 MiB
//    (Options::max_connection_pending_bytes; past it, RESOURCE_EXHAUSTED for the request that
//    would go over);
//  - grpc-timeout (the call's deadline, counted from its headers: a request still coming in,
//    or a call unanswered, is answered DEADLINE_EXCEEDED and cancelled when it passes); a
//    request not whole within Options::upload_timeout of its headers is answered
//    DEADLINE_EXCEEDED whatever its deadline (none included), and its bytes let go, so a
//    stalled upload cannot hold a connection's budget for ever;
//  - custom metadata as the call's metadata, at most 16 KiB, values as sent but for a -bin
//    key's, base64-decoded (padded or not; not base64: INVALID_ARGUMENT); initial metadata
//    (a -bin key's value base64-encoded) and a status with a percent-encoded grpc-message on
//    the answer;
//  - RST_STREAM or a closed connection cancels the call; PING is answered by nghttp2, and a
//    connection sending over 100 a second is cut off (ENHANCE_YOUR_CALM);
//  - Stop sends GOAWAY, gives calls in flight a grace, then cancels them.
// With Options::idle_spin the thread polls its sockets busily for a while after each piece of
// work instead of sleeping at once (see there).
// Bytes that are not HTTP/2 end their connection (and only it).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/status.h"

namespace kiln {

class GrpcH2Server {
 public:
  struct Options {
    std::string bind_address = "0.0.0.0";
    int port = 0;  // 0: any free port (see port())
    // A listening socket to serve instead of binding (socket activation); not closed here.
    int listen_fd = -1;
    // The flag errors name ("--grpc-port").
    std::string flag = "--grpc-port";
    int64_t max_message_bytes = 4LL * 1024 * 1024;
    uint32_t max_concurrent_streams = 1024;  // per connection
    // Bytes of unfinished requests one connection may hold; 0: twice max_message_bytes, and at
    // least 64 MiB.
    int64_t max_connection_pending_bytes = 0;
    // How long a request may take to arrive whole, from its headers (as HttpServer's
    // body_timeout); zero or less: only the caller's deadline bounds it.
    absl::Duration upload_timeout = absl::Seconds(120);
    // After each piece of work (anything its sockets brought) the server's thread polls them
    // busily for up to this long before it sleeps in the kernel: a request that comes meanwhile
    // pays no wake-up, and the thread's CPU does not go idle meanwhile (what this buys a
    // runtime: bench/RESULTS.md, 2026-11-29 session 11). The cost: up to this much of a CPU
    // after each piece of work, when nothing comes. Zero (the default): it sleeps at once. At
    // most an hour (ClampIdleSpin).
    absl::Duration idle_spin = absl::ZeroDuration();
    // The server thread's name (top -H, perf; at most 15 characters kept).
    std::string thread_name = "grpc-server";
  };

  class Connection;
  class Impl;
  // One call. Finish may be called from any thread, exactly once (later calls do nothing).
  class Call {
   public:
    const std::string& method() const { return method_; }  // "/package.Service/Method"
    // The caller's metadata: lower-case keys; pseudo-headers, content-type, te and grpc-*
    // left out.
    const std::vector<std::pair<std::string, std::string>>& metadata() const { return metadata_; }
    // The first value of `key` (lower-case), or null.
    const std::string* Metadata(std::string_view key) const;
    // The caller's deadline (absl::InfiniteFuture() when it set none).
    absl::Time deadline() const { return deadline_; }
    // The request message, serialized; the handler may take it.
    std::string& message() { return message_; }

    // Sent with the answer; only before Finish. A -bin key's value is bytes (sent base64).
    void AddInitialMetadata(std::string key, std::string value);
    // Answers the call: `response` (a serialized message) when `status` is OK.
    void Finish(const grpc::Status& status, std::string response = "");
    // `f` runs once if the call ends before it is finished (the caller cancelled or went
    // away, its deadline passed, or the server stopped); at once if that happened already.
    // On whichever thread saw the end (or the caller's, when at once), never under the
    // server's locks: it must not block. A second OnCancel replaces the first.
    void OnCancel(std::function<void()> f);
    bool cancelled() const;

   private:
    friend class GrpcH2Server;
    friend class Connection;
    friend class Impl;
    Call(std::shared_ptr<Connection> conn, int32_t stream_id)
        : conn_(std::move(conn)), stream_id_(stream_id) {}
    // Marks the call cancelled and takes its cancel callback (run by the caller, unlocked).
    std::function<void()> TakeCancel();

    const std::shared_ptr<Connection> conn_;
    const int32_t stream_id_;
    std::string method_;
    std::vector<std::pair<std::string, std::string>> metadata_;
    size_t metadata_bytes_ = 0;
    absl::Time deadline_ = absl::InfiniteFuture();
    std::string message_;   // while receiving: the prefix and the message
    int64_t buffered_ = 0;  // bytes of it counted against the connection's budget
    std::string content_type_;
    std::string http_method_;
    std::string encoding_;
    std::string bad_;  // why the call was refused while its request came in
    grpc::StatusCode bad_code_ = grpc::StatusCode::OK;
    bool reset_after_answer_ = false;  // refused before its request was whole
    bool handed_ = false;    // given to the handler
    // Under the connection's lock:
    bool finished_ = false;
    bool cancelled_ = false;
    bool closed_ = false;  // the stream is gone
    std::function<void()> on_cancel_;
    std::vector<std::pair<std::string, std::string>> initial_metadata_;
    std::string out_;  // the answer's length-prefixed message
    size_t out_sent_ = 0;
    grpc::Status status_;
  };

  using Handler = std::function<void(std::shared_ptr<Call>)>;
  // Binds (or takes Options::listen_fd) and starts serving; `handler` gets each complete call on
  // the server's thread and must not block (answer later from any thread).
  static absl::StatusOr<std::unique_ptr<GrpcH2Server>> Start(Options options, Handler handler);
  ~GrpcH2Server();  // Stop(absl::ZeroDuration()) if not stopped

  int port() const { return port_; }
  // Stops taking connections at once, sends every connection GOAWAY, waits up to `grace` for
  // the calls in flight to be finished, then cancels the rest (CANCELLED to their callers)
  // and closes every connection. Idempotent.
  void Stop(absl::Duration grace);
  // Calls handed to the handler and not yet finished or cancelled.
  int64_t calls_in_flight() const;
  int64_t connections() const;

 private:
  explicit GrpcH2Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

// The call's request as a `T` (a protobuf message); false, the call answered INVALID_ARGUMENT
// naming the type, when its bytes are not one.
template <typename T>
bool ParseRequest(GrpcH2Server::Call& call, T* out) {
  if (out->ParseFromString(call.message())) return true;
  const std::string type = out->GetTypeName();
  const bool vowel = !type.empty() && std::string_view("aeiouAEIOU").find(type[0]) != std::string_view::npos;
  call.Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                           std::string("the request is not ") + (vowel ? "an " : "a ") + type));
  return false;
}

// Answers `call`: `m` serialized when `status` is OK, else `status` alone.
inline void AnswerCall(GrpcH2Server::Call& call, const grpc::Status& status,
                       const google::protobuf::MessageLite& m) {
  call.Finish(status, status.ok() ? m.SerializeAsString() : std::string());
}

// grpc-timeout's value ("100m", "5S", ...) as a duration; an error naming the header otherwise.
absl::StatusOr<absl::Duration> ParseGrpcTimeout(std::string_view value);
// grpc-message's percent-encoding.
std::string PercentEncodeGrpcMessage(std::string_view message);

}  // namespace kiln
