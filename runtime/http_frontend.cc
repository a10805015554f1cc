#include "runtime/http_frontend.h"

#include <vector>

#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/http_server.h"
#include "common/oip_parameters.h"
#include "common/logging.h"
#include "common/status.h"
#include "runtime/grpc_frontend.h"
#include "runtime/json_codec.h"

namespace kiln {

using nlohmann::json;

namespace {

// Counts REST requests from acceptance until their reply is sent, so that shutdown waits
// for them (and nothing they touch is freed under them).
class RequestGate {
 public:
  bool Enter() {
    absl::MutexLock lock(&mu_);
    if (closed_) return false;
    active_++;
    return true;
  }
  void Exit() {
    absl::MutexLock lock(&mu_);
    active_--;
  }
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  bool WaitIdle(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_ == 0; };
    return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
  }

 private:
  absl::Mutex mu_;
  int active_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};
using Gate = std::shared_ptr<RequestGate>;

// An entered request's hold on the gate: it leaves the gate when the last copy goes, that is
// once the request is answered or dropped (the server writes the reply out, and its Stop
// waits for that).
using Ticket = std::shared_ptr<void>;
Ticket Enter(const Gate& gate) {
  if (!gate->Enter()) return nullptr;
  return Ticket(static_cast<void*>(gate.get()), [gate](void*) { gate->Exit(); });
}

void Reply(const HttpReply& request, int code, std::string body) {
  request.Send(code, std::move(body), "application/json");
}

void ReplyStatus(const HttpReply& request, const absl::Status& status) {
  Reply(request, RestErrorStatus(status, /*decoding=*/false),
        JsonError(std::string(status.message())));
}

json MetadataJson(const inference::ModelMetadataResponse& m) {
  json out = {{"name", m.name()}, {"versions", json::array()}, {"platform", m.platform()}};
  for (const auto& v : m.versions()) out["versions"].push_back(v);
  auto tensors = [](const auto& list) {
    json arr = json::array();
    for (const auto& t : list) {
      arr.push_back({{"name", t.name()},
                     {"datatype", t.datatype()},
                     {"shape", std::vector<int64_t>(t.shape().begin(), t.shape().end())}});
    }
    return arr;
  };
  out["inputs"] = tensors(m.inputs());
  out["outputs"] = tensors(m.outputs());
  return out;
}

}  // namespace

void ServeRestInfer(ModelHost* host, std::string* body, const std::string& model,
                    const std::string& version, int64_t max_request_bytes,
                    int64_t deadline_unix_micros, bool add_version,
                    std::function<void(int http_status, std::string json)> answer) {
  auto fail = [&](const absl::Status& s, bool decoding) {
    answer(RestErrorStatus(s, decoding), JsonError(std::string(s.message())));
  };
  auto params = std::make_shared<json>();
  auto decoded = DecodeJsonInferRequest(*body, model, version, max_request_bytes, params.get());
  body->clear();
  if (!decoded.ok()) {
    host->CountRefused();
    fail(decoded.status(), /*decoding=*/true);
    return;
  }
  // The caller's deadline bounds the request's timeout.
  if (absl::Status bounded = NoteCallerDeadline(deadline_unix_micros, &*decoded);
      !bounded.ok()) {
    host->CountRefused();
    fail(bounded, /*decoding=*/false);
    return;
  }
  if (add_version) (*params)[kVersionParameter] = host->version();
  decoded->shared_reader = true;  // read by the REST server's (or data socket's) thread
  host->Infer(std::move(*decoded),
              [answer = std::move(answer), params](absl::StatusOr<InferResponse> r) {
                if (!r.ok()) {
                  answer(RestErrorStatus(r.status(), /*decoding=*/false),
                         JsonError(std::string(r.status().message())));
                  return;
                }
                answer(200, EncodeJsonInferResponse(*r, *params));
              });
}

class HttpFrontend::Impl {
 public:
  Impl(ModelHost* host, Options options)
      : host_(host), options_(std::move(options)), gate_(std::make_shared<RequestGate>()) {}

  absl::StatusOr<int> Listen() {
    HttpServer::Options o;
    o.bind_address = options_.bind_address;
    o.port = options_.port;
    o.threads = options_.threads;
    o.idle_spin = options_.idle_spin;
    o.max_body_bytes = options_.max_request_bytes;
    o.flags = "--http-port/--bind-address";
    auto server = HttpServer::Start(
        o, [this](HttpRequest request, HttpReply reply) { Handle(std::move(request), reply); });
    if (!server.ok()) return server.status();
    server_ = std::move(*server);
    return server_->port();
  }

  // New requests get 503; accepted ones get (bounded) time to have their replies sent; then
  // the server stops, giving those replies time to be written.
  void Close() {
    gate_->Close();
    if (!gate_->WaitIdle(absl::Seconds(10))) {
      GetLogger("runtime.http")->error("REST requests still unanswered 10 s after close");
    }
    server_->Stop(absl::Seconds(5));
  }

 private:
  void Handle(HttpRequest request, const HttpReply& reply) {
    Ticket ticket = Enter(gate_);
    if (!ticket) {
      reply.Send(503, JsonError("the server is shutting down"), "application/json");
      return;
    }
    try {
      Route(request, reply, ticket);
    } catch (const std::exception& e) {
      Reply(reply, 500, JsonError(std::string("internal error: ") + e.what()));
    }
  }

  void Route(HttpRequest& http_request, const HttpReply& request, const Ticket& ticket) {
    const std::string& path = http_request.path;
    std::vector<std::string> parts = absl::StrSplit(path, '/', absl::SkipEmpty());
    const std::string& method = http_request.method;
    if (parts.empty() || parts[0] != "v2") {
      Reply(request, 404, JsonError("no such endpoint: " + path));
      return;
    }
    if (parts.size() == 1) {
      if (method != "GET") return MethodNotAllowed(request, method);
      json meta = {{"name", "kiln"},
                   {"version", options_.server_version},
                   {"extensions", {"model_repository_layout", "dynamic_batching",
                                   "response_cache", "priority", "timeout"}}};
      Reply(request, 200, meta.dump());
      return;
    }
    if (parts[1] == "health" && parts.size() == 3) {
      if (method != "GET") return MethodNotAllowed(request, method);
      if (parts[2] == "live") {
        bool live = host_->Live();
        // The protocol's health answers: 200 for true, a 4xx for false (400, as Triton's).
        Reply(request, live ? 200 : 400, json{{"live", live}}.dump());
        return;
      }
      if (parts[2] == "ready") {
        bool ready = host_->ModelReady(host_->config().name, "");
        Reply(request, ready ? 200 : 400, json{{"ready", ready}}.dump());
        return;
      }
    }
    if (parts[1] == "models" && parts.size() >= 3) {
      std::string model = PercentDecode(parts[2]);
      std::string version;
      size_t next = 3;
      if (parts.size() >= 5 && parts[3] == "versions") {
        version = PercentDecode(parts[4]);
        next = 5;
      }
      if (parts.size() == next) {
        if (method != "GET") return MethodNotAllowed(request, method);
        inference::ModelMetadataResponse meta;
        absl::Status s = FillModelMetadata(*host_, model, version, &meta);
        if (!s.ok()) return ReplyStatus(request, s);
        Reply(request, 200, MetadataJson(meta).dump());
        return;
      }
      if (parts.size() == next + 1 && parts[next] == "ready") {
        if (method != "GET") return MethodNotAllowed(request, method);
        if (!host_->Serves(model, version)) {
          Reply(request, 404, JsonError("unknown model '" + model + "'"));
          return;
        }
        bool ready = host_->ModelReady(model, version);
        Reply(request, ready ? 200 : 400, json{{"name", model}, {"ready", ready}}.dump());
        return;
      }
      if (parts.size() == next + 1 && parts[next] == "infer") {
        if (method != "POST") return MethodNotAllowed(request, method);
        Infer(http_request, request, model, version, ticket);
        return;
      }
    }
    Reply(request, 404, JsonError("no such endpoint: " + path));
  }

  void MethodNotAllowed(const HttpReply& request, const std::string& method) {
    Reply(request, 405, JsonError("method " + method + " is not allowed here"));
  }

  void Infer(HttpRequest& http_request, const HttpReply& request, const std::string& model,
             const std::string& version, const Ticket& ticket) {
    if (http_request.Header("Inference-Header-Content-Length")) {
      host_->CountRefused();
      Reply(request, 400, JsonError("the binary data extension is not supported; send JSON data "
                                    "or use gRPC raw_input_contents"));
      return;
    }
    // The body arrived whole and within the limit: the server refuses a declared size over it
    // (413) before reading a byte, and cuts a chunked body at it.
    ServeRestInfer(host_, &http_request.body, model, version, options_.max_request_bytes,
                   /*deadline_unix_micros=*/0, /*add_version=*/false,
                   // `ticket` holds the gate until the reply is sent.
                   [request, ticket](int code, std::string json) {
                     Reply(request, code, std::move(json));
                   });
  }

  ModelHost* host_;
  Options options_;
  Gate gate_;
  std::unique_ptr<HttpServer> server_;
};

absl::StatusOr<std::unique_ptr<HttpFrontend>> HttpFrontend::Start(ModelHost* host,
                                                                  Options options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError("--http-port: must be in 0..65535, got " +
                                      std::to_string(options.port));
  }
  auto impl = std::make_unique<Impl>(host, options);
  auto port = impl->Listen();
  if (!port.ok()) return port.status();
  return std::unique_ptr<HttpFrontend>(new HttpFrontend(std::move(impl), *port));
}

HttpFrontend::HttpFrontend(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}

HttpFrontend::~HttpFrontend() { Stop(); }

void HttpFrontend::Stop() {
  if (impl_) {
    impl_->Close();
    impl_.reset();
  }
}

}  // namespace kiln
