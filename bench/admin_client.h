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

// A GET of `path` as text (the metrics page): the body, or "" when the call failed (said on
// stderr).
std::string AdminText(const std::string& base, const std::string& path);

// The value of the sample `series` (a metric name with its labels, as printed) in Prometheus
// text, or -1 when the text has no such sample.
double MetricValue(const std::string& text, const std::string& series);

}  // namespace kiln::bench
