#pragma once

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Propagates a non-OK absl::Status to the caller.
#define KILN_RETURN_IF_ERROR(expr)                 \
  do {                                             \
    ::absl::Status kiln_status_ = (expr);          \
    if (!kiln_status_.ok()) return kiln_status_;   \
  } while (0)

#define KILN_STATUS_CONCAT_INNER_(a, b) a##b
#define KILN_STATUS_CONCAT_(a, b) KILN_STATUS_CONCAT_INNER_(a, b)

// `KILN_ASSIGN_OR_RETURN(auto x, MakeX());` assigns the value or returns the error.
#define KILN_ASSIGN_OR_RETURN(lhs, expr) \
  KILN_ASSIGN_OR_RETURN_IMPL_(KILN_STATUS_CONCAT_(kiln_statusor_, __LINE__), lhs, expr)
#define KILN_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return std::move(tmp).status();    \
  lhs = std::move(tmp).value()

namespace kiln {

// HTTP status for a canonical status code (the mapping used by REST frontends).
int HttpStatusFromCode(absl::StatusCode code);

// Prefixes the message of a non-OK status with `context: `, keeping the code.
absl::Status Annotate(const absl::Status& status, const std::string& context);

}  // namespace kiln
