#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace kiln {

// The longest error message sent in a gRPC status: it travels as the grpc-message trailer, and
// a client refuses metadata over its limit (8 KiB by default) with an error of its own, which
// would hide the code and the reason. Messages that quote a client's own long names are cut.
inline constexpr size_t kMaxGrpcMessageBytes = 2048;

// absl and gRPC share the canonical code space, so the mapping is 1:1.
inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  std::string message(status.message());
  if (message.size() > kMaxGrpcMessageBytes) {
    const size_t full = message.size();
    message.resize(kMaxGrpcMessageBytes);
    message += "... (" + std::to_string(full) + " bytes in all)";
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::move(message));
}

inline absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

}  // namespace kiln
