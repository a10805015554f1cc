#pragma once

// A small client for the Kubernetes API over cpprestsdk: bearer-token or client-certificate
// auth, the cluster's CA, JSON in and out, and watch streams read line by line as they arrive.
// Configured in-cluster (the service account's token, CA and namespace,
// KUBERNETES_SERVICE_HOST/PORT) or from a kubeconfig file (server, certificate-authority[-data],
// token, tokenFile or client-certificate[-data] with client-key[-data]).

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace kiln {

struct KubeConfig {
  std::string server;  // https://HOST:PORT (http:// only for tests on loopback)
  std::string token;            // bearer token; empty with client-certificate auth
  std::string client_cert_pem;  // client certificate (chain) and key, PEM, for TLS client auth
  std::string client_key_pem;
  std::string ca_pem;  // PEM of the API server's CA; empty: the system's roots
  bool insecure_skip_tls_verify = false;
  std::string ns = "default";

  // The service account mounted at `sa_dir` and KUBERNETES_SERVICE_HOST/PORT.
  static absl::StatusOr<KubeConfig> InCluster(
      const std::string& sa_dir = "/var/run/secrets/kubernetes.io/serviceaccount");
  // A kubeconfig file's `context` (empty: current-context). Users authenticate with a token
  // (token, tokenFile) and/or a client certificate; exec and auth-provider plugins are
  // refused with a clear error.
  static absl::StatusOr<KubeConfig> FromKubeconfig(const std::string& path,
                                                   const std::string& context = "");
};

struct KubeResponse {
  int code = 0;
  nlohmann::json body;  // null when the body was empty or not JSON
};

class KubeClient {
 public:
  explicit KubeClient(KubeConfig config);
  ~KubeClient();

  const KubeConfig& config() const { return config_; }

  // One request. UNAVAILABLE when the server cannot be reached or does not answer within
  // `timeout`; any HTTP answer (also 4xx/5xx) is returned as it is.
  absl::StatusOr<KubeResponse> Call(const std::string& method, const std::string& path,
                                    const nlohmann::json* body = nullptr,
                                    absl::Duration timeout = absl::Seconds(10),
                                    const std::string& content_type = "application/json");

  // Streams `path` (a watch URL): `on_event` gets each event object as it arrives and returns
  // false to stop. Returns OK when the server ended the stream or `on_event` stopped it,
  // UNAVAILABLE when the connection broke, went quiet for `idle_timeout` or was cancelled,
  // OUT_OF_RANGE for a 410 Gone answer (the version is too old: list again), FAILED_PRECONDITION
  // for another non-200 answer.
  absl::Status Watch(const std::string& path,
                     const std::function<bool(const nlohmann::json&)>& on_event,
                     absl::Duration idle_timeout);
  // Breaks every Watch in progress (they return UNAVAILABLE); later ones work again.
  void CancelWatches();
  // Breaks every Watch in progress, and every later one returns UNAVAILABLE at once (a Watch
  // about to start when it is called does not then run until its timeout).
  void StopWatches();

  // Kubernetes' Status body as an error message ("409 Conflict: the object has been modified").
  static std::string Describe(const KubeResponse& r);

 private:
  struct Impl;
  KubeConfig config_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln
