#include "controller/kube_client.h"

#include <cpprest/containerstream.h>
#include <cpprest/http_client.h>

#include <cstdlib>
#include <mutex>

#include "absl/strings/escaping.h"
#include "common/filesystem.h"
#include "common/logging.h"
#include "common/status.h"
#include "controller/crd_schema.h"

namespace kiln {

namespace {

using nlohmann::json;
namespace http = web::http;

// The whole file, errors naming `what` needed it.
absl::StatusOr<std::string> ReadWhole(const std::string& path, const std::string& what) {
  auto text = RootedFilesystem().ReadFile(path);
  if (!text.ok()) return Annotate(text.status(), what);
  return text;
}

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

// The entry of a kubeconfig list (clusters, users, contexts) named `name`.
const json* Named(const json& doc, const std::string& list, const std::string& name) {
  if (!doc.contains(list) || !doc[list].is_array()) return nullptr;
  for (const auto& e : doc[list]) {
    if (e.is_object() && e.value("name", "") == name) return &e;
  }
  return nullptr;
}

}  // namespace

absl::StatusOr<KubeConfig> KubeConfig::InCluster(const std::string& sa_dir) {
  const char* host = std::getenv("KUBERNETES_SERVICE_HOST");
  const char* port = std::getenv("KUBERNETES_SERVICE_PORT");
  if (!host || !*host || !port || !*port) {
    return absl::FailedPreconditionError(
        "in-cluster config: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set (not "
        "running in a pod? give --kubeconfig)");
  }
  KubeConfig c;
  std::string h = host;
  if (h.find(':') != std::string::npos) h = "[" + h + "]";  // IPv6
  c.server = "https://" + h + ":" + port;
  auto token = ReadWhole(sa_dir + "/token", "in-cluster config");
  if (!token.ok()) return token.status();
  c.token = Trim(*token);
  if (c.token.empty()) return absl::InvalidArgumentError("in-cluster config: " + sa_dir + "/token is empty");
  auto ca = ReadWhole(sa_dir + "/ca.crt", "in-cluster config");
  if (!ca.ok()) return ca.status();
  c.ca_pem = *ca;
  if (auto ns = ReadWhole(sa_dir + "/namespace", "in-cluster config"); ns.ok() && !Trim(*ns).empty()) {
    c.ns = Trim(*ns);
  }
  return c;
}

absl::StatusOr<KubeConfig> KubeConfig::FromKubeconfig(const std::string& path,
                                                      const std::string& context) {
  auto text = ReadWhole(path, "kubeconfig");
  if (!text.ok()) return text.status();
  auto docs = YamlDocumentsToJson(*text, path);
  if (!docs.ok()) return docs.status();
  if (docs->size() != 1 || !docs->at(0).is_object()) {
    return absl::InvalidArgumentError(path + ": not a kubeconfig (one YAML mapping)");
  }
  const json& doc = docs->at(0);
  std::string ctx_name = context.empty() ? doc.value("current-context", "") : context;
  if (ctx_name.empty()) return absl::InvalidArgumentError(path + ": current-context: not set and no context given");
  const json* ctx = Named(doc, "contexts", ctx_name);
  if (!ctx || !ctx->contains("context")) {
    return absl::InvalidArgumentError(path + ": contexts: no context named '" + ctx_name + "'");
  }
  const json& cx = (*ctx)["context"];
  KubeConfig c;
  c.ns = cx.value("namespace", "default");
  const json* cluster = Named(doc, "clusters", cx.value("cluster", ""));
  if (!cluster || !cluster->contains("cluster")) {
    return absl::InvalidArgumentError(path + ": clusters: no cluster named '" + cx.value("cluster", "") + "'");
  }
  const json& cl = (*cluster)["cluster"];
  c.server = cl.value("server", "");
  if (c.server.rfind("https://", 0) != 0 && c.server.rfind("http://", 0) != 0) {
    return absl::InvalidArgumentError(path + ": clusters[" + cx.value("cluster", "") +
                                      "].cluster.server: must be an https:// URL, got '" + c.server + "'");
  }
  c.insecure_skip_tls_verify = cl.value("insecure-skip-tls-verify", false);
  if (cl.contains("certificate-authority-data")) {
    std::string pem;
    if (!absl::Base64Unescape(cl.value("certificate-authority-data", ""), &pem) || pem.empty()) {
      return absl::InvalidArgumentError(path + ": certificate-authority-data: not base64");
    }
    c.ca_pem = pem;
  } else if (cl.contains("certificate-authority")) {
    auto pem = ReadWhole(cl.value("certificate-authority", ""), path + ": certificate-authority");
    if (!pem.ok()) return pem.status();
    c.ca_pem = *pem;
  }
  const json* user = Named(doc, "users", cx.value("user", ""));
  if (!user || !user->contains("user")) {
    return absl::InvalidArgumentError(path + ": users: no user named '" + cx.value("user", "") + "'");
  }
  const json& u = (*user)["user"];
  const std::string where = path + ": users[" + cx.value("user", "") + "].user";
  // PEM from FIELD-data (base64) or FIELD (a file), checked to hold a `kind` block.
  auto pem_field = [&](const std::string& field, const std::string& kind,
                       std::string* out) -> absl::Status {
    if (u.contains(field + "-data")) {
      if (!absl::Base64Unescape(u.value(field + "-data", ""), out) || out->empty()) {
        return absl::InvalidArgumentError(where + "." + field + "-data: not base64");
      }
    } else if (u.contains(field)) {
      auto text = ReadWhole(u.value(field, ""), where + "." + field);
      if (!text.ok()) return text.status();
      *out = *text;
    } else {
      return absl::OkStatus();
    }
    if (out->find("-----BEGIN ") == std::string::npos || out->find(kind + "-----") == std::string::npos) {
      return absl::InvalidArgumentError(where + "." + field + ": no PEM " + kind);
    }
    return absl::OkStatus();
  };
  if (auto st = pem_field("client-certificate", "CERTIFICATE", &c.client_cert_pem); !st.ok()) return st;
  if (auto st = pem_field("client-key", "PRIVATE KEY", &c.client_key_pem); !st.ok()) return st;
  if (c.client_cert_pem.empty() != c.client_key_pem.empty()) {
    return absl::InvalidArgumentError(where + (c.client_cert_pem.empty()
                                                   ? ".client-certificate: required with client-key"
                                                   : ".client-key: required with client-certificate"));
  }
  if (u.contains("token")) {
    c.token = u.value("token", "");
    if (c.token.empty()) return absl::InvalidArgumentError(where + ".token: empty");
  } else if (u.contains("tokenFile")) {
    auto t = ReadWhole(u.value("tokenFile", ""), where + ".tokenFile");
    if (!t.ok()) return t.status();
    c.token = Trim(*t);
    if (c.token.empty()) return absl::InvalidArgumentError(where + ".tokenFile: empty");
  }
  if (c.token.empty() && c.client_cert_pem.empty()) {
    return absl::InvalidArgumentError(
        where + ": no token, tokenFile or client-certificate (exec and auth-provider plugins "
                "are not supported)");
  }
  return c;
}

struct KubeClient::Impl {
  std::mutex mu;
  pplx::cancellation_token_source watches;
  bool watches_stopped = false;  // StopWatches: every Watch from now on ends at once
};

KubeClient::KubeClient(KubeConfig config) : config_(std::move(config)), impl_(std::make_unique<Impl>()) {}
KubeClient::~KubeClient() = default;

namespace {

http::client::http_client_config ClientConfig(const KubeConfig& c, absl::Duration timeout) {
  http::client::http_client_config cfg;
  cfg.set_timeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  cfg.set_validate_certificates(!c.insecure_skip_tls_verify);
  if (!c.ca_pem.empty() || !c.client_cert_pem.empty()) {
    cfg.set_ssl_context_callback([c](boost::asio::ssl::context& ctx) {
      boost::system::error_code ec;  // a bad PEM fails the handshake, which the call reports
      if (!c.ca_pem.empty()) {
        ctx.add_certificate_authority(boost::asio::buffer(c.ca_pem.data(), c.ca_pem.size()), ec);
      }
      if (!c.client_cert_pem.empty()) {
        ctx.use_certificate_chain(
            boost::asio::buffer(c.client_cert_pem.data(), c.client_cert_pem.size()), ec);
        ctx.use_private_key(boost::asio::buffer(c.client_key_pem.data(), c.client_key_pem.size()),
                            boost::asio::ssl::context::pem, ec);
      }
    });
  }
  return cfg;
}

http::http_request MakeRequest(const KubeConfig& c, const std::string& method, const std::string& path,
                               const json* body, const std::string& content_type = "application/json") {
  http::http_request req(method);
  req.set_request_uri(path);
  if (!c.token.empty()) req.headers().add("Authorization", "Bearer " + c.token);
  req.headers().add("Accept", "application/json");
  if (body) req.set_body(body->dump(), content_type);
  return req;
}

}  // namespace

absl::StatusOr<KubeResponse> KubeClient::Call(const std::string& method, const std::string& path,
                                              const json* body, absl::Duration timeout,
                                              const std::string& content_type) {
  try {
    http::client::http_client client(config_.server, ClientConfig(config_, timeout));
    http::http_response resp =
        client.request(MakeRequest(config_, method, path, body, content_type)).get();
    KubeResponse out;
    out.code = resp.status_code();
    std::string text = resp.extract_utf8string(true).get();
    if (!text.empty()) {
      out.body = json::parse(text, nullptr, false);
      if (out.body.is_discarded()) out.body = nullptr;
    }
    return out;
  } catch (const std::exception& e) {
    return absl::UnavailableError(method + " " + config_.server + path + ": " + e.what());
  }
}

absl::Status KubeClient::Watch(const std::string& path,
                               const std::function<bool(const json&)>& on_event,
                               absl::Duration idle_timeout) {
  pplx::cancellation_token token = pplx::cancellation_token::none();
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->watches_stopped) return absl::UnavailableError("watch cancelled: stopping");
    token = impl_->watches.get_token();
  }
  try {
    http::client::http_client client(config_.server, ClientConfig(config_, idle_timeout));
    http::http_response resp = client.request(MakeRequest(config_, "GET", path, nullptr), token).get();
    if (resp.status_code() != 200) {
      KubeResponse r;
      r.code = resp.status_code();
      std::string text = resp.extract_utf8string(true).get();
      r.body = json::parse(text, nullptr, false);
      if (r.body.is_discarded()) r.body = nullptr;
      if (r.code == 410) return absl::OutOfRangeError("watch " + path + ": " + Describe(r));
      return absl::FailedPreconditionError("watch " + path + ": " + Describe(r));
    }
    concurrency::streams::istream stream = resp.body();
    while (true) {
      concurrency::streams::container_buffer<std::string> line;
      size_t n = stream.read_line(line).get();
      if (token.is_canceled()) return absl::UnavailableError("watch cancelled");
      if (n == 0) {
        if (stream.is_eof()) return absl::OkStatus();
        continue;  // an empty line
      }
      json event = json::parse(line.collection(), nullptr, false);
      if (event.is_discarded() || !event.is_object()) {
        return absl::UnavailableError("watch " + path + ": a line that is not a JSON event");
      }
      if (!on_event(event)) return absl::OkStatus();
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError("watch " + path + ": " + e.what());
  }
}

void KubeClient::CancelWatches() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->watches.cancel();
  impl_->watches = pplx::cancellation_token_source();
}

void KubeClient::StopWatches() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->watches_stopped = true;
  impl_->watches.cancel();
}

std::string KubeClient::Describe(const KubeResponse& r) {
  std::string out = std::to_string(r.code);
  if (r.body.is_object()) {
    if (r.body.contains("reason") && r.body["reason"].is_string()) out += " " + r.body["reason"].get<std::string>();
    if (r.body.contains("message") && r.body["message"].is_string()) out += ": " + r.body["message"].get<std::string>();
  }
  return out;
}

}  // namespace kiln
