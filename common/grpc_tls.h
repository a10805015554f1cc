#pragma once

// TLS for kiln's own gRPC links (agents <-> controller): credentials from PEM files, with
// errors that name the flag, and the identities a verified peer certificate carries.

#include <grpcpp/security/auth_context.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kiln {

// PEM files for one side of a link, each with the flag that set it (for errors).
struct TlsFiles {
  std::string cert;  // this side's certificate chain
  std::string key;   // its private key
  std::string ca;    // the CA bundle the peer's certificate must chain to
  std::string cert_flag = "--tls-cert";
  std::string key_flag = "--tls-key";
  std::string ca_flag = "--tls-ca";
  bool any() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// Server side: cert and key are required. With a CA, every client must present a certificate
// that chains to it (mutual TLS); without, clients are not asked for one.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files);

// Client side: the CA is required (the server's certificate is verified against it, and its
// name against the target's host or `server_name`); cert and key, both or neither, are this
// client's identity for mutual TLS.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& files);

// The names a verified peer certificate carries: its subject alternative names and its subject
// common name. Empty for a plaintext peer or one without a certificate.
std::vector<std::string> PeerCertificateNames(const grpc::AuthContext& auth);

}  // namespace kiln
