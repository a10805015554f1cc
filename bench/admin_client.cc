#include "bench/admin_client.h"

#include <iostream>

#include "cpprest/http_client.h"

namespace kiln::bench {

nlohmann::json AdminCall(const std::string& base, const web::http::method& method,
                         const std::string& path, const std::string& body) {
  try {
    web::http::client::http_client client(base);
    web::http::http_request req(method);
    req.set_request_uri(path);
    if (!body.empty()) req.set_body(body, "application/json");
    auto resp = client.request(req).get();
    std::string text = resp.extract_string().get();
    if (resp.status_code() >= 300) {
      std::cerr << method << " " << path << ": HTTP " << resp.status_code() << ": " << text << "\n";
      return nullptr;
    }
    return nlohmann::json::parse(text, nullptr, false);
  } catch (const std::exception& e) {
    std::cerr << method << " " << path << ": " << e.what() << "\n";
    return nullptr;
  }
}

std::string AdminText(const std::string& base, const std::string& path) {
  try {
    web::http::client::http_client client(base);
    auto resp = client.request(web::http::methods::GET, path).get();
    std::string text = resp.extract_string().get();
    if (resp.status_code() >= 300) {
      std::cerr << "GET " << path << ": HTTP " << resp.status_code() << ": " << text << "\n";
      return "";
    }
    return text;
  } catch (const std::exception& e) {
    std::cerr << "GET " << path << ": " << e.what() << "\n";
    return "";
  }
}

double MetricValue(const std::string& text, const std::string& series) {
  size_t at = 0;
  while ((at = text.find(series + " ", at)) != std::string::npos) {
    if (at == 0 || text[at - 1] == '\n') {
      try {
        return std::stod(text.substr(at + series.size() + 1));
      } catch (const std::exception&) {
        return -1;
      }
    }
    at += series.size();
  }
  return -1;
}

}  // namespace kiln::bench
