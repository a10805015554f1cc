#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace kiln {

// Splits "host:port" (an IPv6 host in brackets, taken off), the port 1..65535 in digits.
// INVALID_ARGUMENT "address '...': expected host:port" otherwise.
absl::Status SplitHostPort(const std::string& address, std::string* host, std::string* port);

// Decodes %XX escapes (and nothing else: '+' stays '+'); a malformed escape is kept as is.
std::string PercentDecode(std::string_view text);

// Encodes `text` for one path segment: every byte but the unreserved ones (A-Z a-z 0-9 - . _ ~)
// as %XX.
std::string PercentEncodeSegment(std::string_view text);

}  // namespace kiln
