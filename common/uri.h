#pragma once

#include <string>
#include <string_view>

namespace kiln {

// Decodes %XX escapes (and nothing else: '+' stays '+'); a malformed escape is kept as is.
std::string PercentDecode(std::string_view text);

}  // namespace kiln
