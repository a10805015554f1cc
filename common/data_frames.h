#pragma once

// The node-local data path between a node's router and its replicas: inference requests over
// a unix socket, without HTTP/2. A loopback gRPC hop costs the router 150-200 µs on a small
// VM; a unix-socket frame costs a write and a wake-up on each side.
//
// A connection carries many requests at once (a replica's batcher answers them out of order),
// each frame tagged:
//
//   u32 length of the body (little-endian), u64 tag, u8 code, i64 deadline, body
//
// A request's code says what its body is; its deadline is the caller's (unix microseconds;
// 0 = none):
//   kInferFrame (0): a serialized inference.ModelInferRequest. Answered with a gRPC status
//     code and a serialized inference.ModelInferResponse (code 0) or the error message.
//   kJsonInferFrame (1): a REST inference, `JSON body, model, version, u32 model length,
//     u32 version length` (a trailer, so that the receiver takes the JSON without a copy).
//     Answered with code 0 and `JSON body, u16 HTTP status` (whatever the REST frontend
//     would have answered, errors included, with parameters.kiln-version added to a 200), or
//     with a gRPC status code and the error message when the frame itself was refused.
// A response has the request's tag and deadline 0. A frame over the receiver's limit ends the
// connection (the sender sees it closed: its calls fail UNAVAILABLE); a request whose body
// does not parse is answered INVALID_ARGUMENT, and so is one of a code the receiver does not
// know, with a message that begins "frame code " (a replica older than its router: the router
// goes back to HTTP for it).

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kiln {

constexpr size_t kFrameHeaderBytes = 4 + 8 + 1 + 8;

struct FrameHeader {
  uint32_t length = 0;
  uint64_t tag = 0;
  uint8_t code = 0;
  int64_t deadline_unix_micros = 0;
};

constexpr uint8_t kInferFrame = 0;
constexpr uint8_t kJsonInferFrame = 1;

// kJsonInferFrame bodies (see above). The decoders cut `body` down to the JSON in place;
// a body too short for its trailer, or with lengths past its size, is INVALID_ARGUMENT.
std::string EncodeJsonInferBody(std::string json, const std::string& model,
                                const std::string& version);
absl::Status DecodeJsonInferBody(std::string* body, std::string* model, std::string* version);
std::string EncodeJsonAnswer(std::string json, int http_status);
absl::Status DecodeJsonAnswer(std::string* body, int* http_status);

void EncodeFrameHeader(const FrameHeader& h, char out[kFrameHeaderBytes]);
FrameHeader DecodeFrameHeader(const char in[kFrameHeaderBytes]);

// A whole frame: header then body.
std::string EncodeFrame(uint64_t tag, uint8_t code, int64_t deadline_unix_micros,
                        const std::string& body);

// Reads exactly `n` bytes (retrying on EINTR). False at end of stream or on an error; `eof` is
// set when the peer closed the connection cleanly before the first byte.
bool ReadFull(int fd, char* buf, size_t n, bool* eof = nullptr);
// Writes all of `data` (retrying on EINTR and short writes; MSG_NOSIGNAL, so a closed peer is
// an error, not SIGPIPE).
bool WriteFull(int fd, const char* data, size_t n);

// Makes way for a unix socket at `path`: a socket file no process listens on is removed; a
// live socket or any other file is an error naming `flag` (never deleted).
absl::Status ClearStaleSocket(const std::string& path, const std::string& flag);
// A unix stream socket listening on `path` (see ClearStaleSocket), mode 0600. Errors name
// `flag`.
absl::StatusOr<int> ListenUnix(const std::string& path, const std::string& flag);
// A connection to the unix socket `path` (a blocking descriptor), or UNAVAILABLE saying why.
// Never waits: a listener that stopped accepting (its backlog full) is UNAVAILABLE at once.
absl::StatusOr<int> ConnectUnix(const std::string& path);

}  // namespace kiln
