#pragma once

// The simulators' client of kiln-controller's admin API (loopback only).

#include <string>

#include "cpprest/http_msg.h"
#include "nlohmann/json.hpp"

namespace kiln::bench {

inline constexpr char kDeploymentsPath[] = "/apis/serving.kiln.dev/v1alpha1/modeldeployments";

// One call to `base` (http://127.0.0.1:PORT): the response body as JSON, or null when the
// call failed (said on stderr with the status and body).
nlohmann::json AdminCall(const std::string& base, const web::http::method& method,
                         const std::string& path, const std::string& body = "");

}  // namespace kiln::bench
