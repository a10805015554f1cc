#include "runtime/http_frontend.h"

#include <cpprest/http_msg.h>

#include <vector>

#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/http_listener.h"
#include "common/logging.h"
#include "common/status.h"
#include "runtime/grpc_frontend.h"
#include "runtime/json_codec.h"

namespace kiln {

namespace http = web::http;
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

// Sends the one reply of an entered request and leaves the gate once it is written.
void Reply(const http::http_request& request, const Gate& gate, int code,
           const std::string& body) {
  http::http_response resp(static_cast<http::status_code>(code));
  resp.set_body(body, "application/json");
  try {
    request.reply(resp).then([gate](pplx::task<void> t) {
      try {
        t.get();
      } catch (const std::exception&) {
        // The client went away; nothing to do.
      }
      gate->Exit();
    });
  } catch (const std::exception&) {
    gate->Exit();
  }
}

void ReplyStatus(const http::http_request& request, const Gate& gate, const absl::Status& status,
                 bool decoding = false) {
  int code = HttpStatusFromCode(status.code());
  // A payload over the limit can never succeed: 413, not 429 ("retry later").
  if (decoding && status.code() == absl::StatusCode::kResourceExhausted) code = 413;
  Reply(request, gate, code, JsonError(std::string(status.message())));
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

class HttpFrontend::Impl {
 public:
  Impl(ModelHost* host, Options options)
      : host_(host), options_(std::move(options)), gate_(std::make_shared<RequestGate>()) {}

  absl::StatusOr<int> Listen() {
    auto listener = HttpListener::Start(
        options_.bind_address, options_.port, {},
        [this](http::http_request request) { Handle(std::move(request)); },
        "--http-port/--bind-address");
    if (!listener.ok()) return listener.status();
    listener_ = std::move(*listener);
    return listener_->port();
  }

  // New requests get 503; accepted ones get (bounded) time to have their replies written;
  // then the listener closes, which aborts bodies still unread, and those are waited for too.
  void Close() {
    gate_->Close();
    bool idle = gate_->WaitIdle(absl::Seconds(10));
    listener_.reset();
    if (!idle && !gate_->WaitIdle(absl::Seconds(5))) {
      GetLogger("runtime.http")->error("REST requests still open 15 s after close");
    }
  }

 private:
  void Handle(http::http_request request) {
    if (!gate_->Enter()) {
      ReplyQuietly(request, 503, JsonError("the server is shutting down"), "application/json");
      return;
    }
    try {
      Route(request);
    } catch (const std::exception& e) {
      Reply(request, gate_, 500, JsonError(std::string("internal error: ") + e.what()));
    }
  }

  void Route(http::http_request& request) {
    const std::string path = request.relative_uri().path();
    std::vector<std::string> parts = absl::StrSplit(path, '/', absl::SkipEmpty());
    const auto method = request.method();
    if (parts.empty() || parts[0] != "v2") {
      Reply(request, gate_, 404, JsonError("no such endpoint: " + path));
      return;
    }
    if (parts.size() == 1) {
      if (method != http::methods::GET) return MethodNotAllowed(request);
      json meta = {{"name", "kiln"},
                   {"version", options_.server_version},
                   {"extensions", {"model_repository_layout", "dynamic_batching",
                                   "response_cache", "priority", "timeout"}}};
      Reply(request, gate_, 200, meta.dump());
      return;
    }
    if (parts[1] == "health" && parts.size() == 3) {
      if (method != http::methods::GET) return MethodNotAllowed(request);
      if (parts[2] == "live") {
        bool live = host_->Live();
        Reply(request, gate_, live ? 200 : 503, json{{"live", live}}.dump());
        return;
      }
      if (parts[2] == "ready") {
        bool ready = host_->ModelReady(host_->config().name, "");
        Reply(request, gate_, ready ? 200 : 503, json{{"ready", ready}}.dump());
        return;
      }
    }
    if (parts[1] == "models" && parts.size() >= 3) {
      std::string model = web::uri::decode(parts[2]);
      std::string version;
      size_t next = 3;
      if (parts.size() >= 5 && parts[3] == "versions") {
        version = web::uri::decode(parts[4]);
        next = 5;
      }
      if (parts.size() == next) {
        if (method != http::methods::GET) return MethodNotAllowed(request);
        inference::ModelMetadataResponse meta;
        absl::Status s = FillModelMetadata(*host_, model, version, &meta);
        if (!s.ok()) return ReplyStatus(request, gate_, s);
        Reply(request, gate_, 200, MetadataJson(meta).dump());
        return;
      }
      if (parts.size() == next + 1 && parts[next] == "ready") {
        if (method != http::methods::GET) return MethodNotAllowed(request);
        if (!host_->Serves(model, version)) {
          Reply(request, gate_, 404, JsonError("unknown model '" + model + "'"));
          return;
        }
        bool ready = host_->ModelReady(model, version);
        Reply(request, gate_, ready ? 200 : 503, json{{"name", model}, {"ready", ready}}.dump());
        return;
      }
      if (parts.size() == next + 1 && parts[next] == "infer") {
        if (method != http::methods::POST) return MethodNotAllowed(request);
        Infer(request, model, version);
        return;
      }
    }
    Reply(request, gate_, 404, JsonError("no such endpoint: " + path));
  }

  void MethodNotAllowed(const http::http_request& request) {
    Reply(request, gate_, 405, JsonError("method " + request.method() + " is not allowed here"));
  }

  void Infer(http::http_request& request, const std::string& model, const std::string& version) {
    const auto& headers = request.headers();
    if (headers.has("Inference-Header-Content-Length")) {
      Reply(request, gate_, 400, JsonError("the binary data extension is not supported; send JSON data "
                                    "or use gRPC raw_input_contents"));
      return;
    }
    if (!headers.has(http::header_names::content_length)) {
      Reply(request, gate_, 411, JsonError("Content-Length is required"));
      return;
    }
    // The body is read only once its declared size is known to be within the limit.
    if (static_cast<int64_t>(headers.content_length()) > options_.max_request_bytes) {
      Reply(request, gate_, 413,
            JsonError("the request body of " + std::to_string(headers.content_length()) +
                      " bytes exceeds the limit of " +
                      std::to_string(options_.max_request_bytes) + " bytes"));
      return;
    }
    ModelHost* host = host_;
    Gate gate = gate_;
    int64_t max_bytes = options_.max_request_bytes;
    request.extract_utf8string(true).then(
        [request, host, gate, model, version, max_bytes](pplx::task<std::string> body_task) {
          // An exception escaping a continuation would terminate the process.
          try {
            std::string body;
            try {
              body = body_task.get();
            } catch (const std::exception& e) {
              Reply(request, gate, 400, JsonError(std::string("cannot read the body: ") + e.what()));
              return;
            }
            auto params = std::make_shared<json>();
            auto decoded = DecodeJsonInferRequest(body, model, version, max_bytes, params.get());
            if (!decoded.ok()) {
              ReplyStatus(request, gate, decoded.status(), /*decoding=*/true);
              return;
            }
            host->Infer(std::move(*decoded),
                        [request, gate, params](absl::StatusOr<InferResponse> r) {
                          if (!r.ok()) {
                            ReplyStatus(request, gate, r.status());
                            return;
                          }
                          Reply(request, gate, 200, EncodeJsonInferResponse(*r, *params));
                        });
          } catch (const std::exception& e) {
            Reply(request, gate, 500, JsonError(std::string("internal error: ") + e.what()));
          }
        });
  }

  ModelHost* host_;
  Options options_;
  Gate gate_;
  std::unique_ptr<HttpListener> listener_;
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
