#pragma once

#include <string>
#include <string_view>

namespace kiln {

// Decodes %XX escapes (and nothing else: '+' stays '+'); a malformed escape is kept as is.
std::string PercentDecode(std::string_view text);

// Encodes `text` for one path segment: every byte but the unreserved ones (A-Z a-z 0-9 - . _ ~)
// as %XX.
std::string PercentEncodeSegment(std::string_view text);

}  // namespace kiln
