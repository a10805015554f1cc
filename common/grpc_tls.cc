#include "common/grpc_tls.h"

#include <grpc/grpc_security_constants.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace kiln {

namespace {

// The file's text, checked to hold the PEM block `kind` names ("CERTIFICATE", "PRIVATE KEY").
absl::StatusOr<std::string> ReadPem(const std::string& path, const std::string& flag,
                                    const std::string& kind) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(flag + ": " + path + ": cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  std::string pem = text.str();
  // "-----BEGIN PRIVATE KEY-----", "-----BEGIN RSA PRIVATE KEY-----", "-----BEGIN EC ...".
  size_t begin = pem.find("-----BEGIN ");
  bool found = false;
  while (begin != std::string::npos && !found) {
    size_t end = pem.find("-----", begin + 11);
    if (end == std::string::npos) break;
    std::string label = pem.substr(begin + 11, end - begin - 11);
    found = label.size() >= kind.size() &&
            label.compare(label.size() - kind.size(), kind.size(), kind) == 0;
    begin = pem.find("-----BEGIN ", end);
  }
  if (!found) {
    return absl::InvalidArgumentError(flag + ": " + path + ": no PEM " + kind + " in the file");
  }
  return pem;
}

absl::Status BothOrNeither(const TlsFiles& f) {
  if (f.cert.empty() != f.key.empty()) {
    return absl::InvalidArgumentError(f.cert.empty() ? f.cert_flag + ": required with " + f.key_flag
                                                     : f.key_flag + ": required with " + f.cert_flag);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files) {
  if (files.cert.empty() && files.key.empty()) {
    return absl::InvalidArgumentError(files.cert_flag + " and " + files.key_flag +
                                      ": required for TLS");
  }
  if (absl::Status s = BothOrNeither(files); !s.ok()) return s;
  auto cert = ReadPem(files.cert, files.cert_flag, "CERTIFICATE");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem(files.key, files.key_flag, "PRIVATE KEY");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions o(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  if (!files.ca.empty()) {
    auto ca = ReadPem(files.ca, files.ca_flag, "CERTIFICATE");
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = *ca;
    o.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  o.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(o);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& files) {
  if (files.ca.empty()) {
    return absl::InvalidArgumentError(files.ca_flag + ": required for TLS (the CA that signed "
                                      "the server's certificate)");
  }
  if (absl::Status s = BothOrNeither(files); !s.ok()) return s;
  auto ca = ReadPem(files.ca, files.ca_flag, "CERTIFICATE");
  if (!ca.ok()) return ca.status();
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = *ca;
  if (!files.cert.empty()) {
    auto cert = ReadPem(files.cert, files.cert_flag, "CERTIFICATE");
    if (!cert.ok()) return cert.status();
    auto key = ReadPem(files.key, files.key_flag, "PRIVATE KEY");
    if (!key.ok()) return key.status();
    o.pem_cert_chain = *cert;
    o.pem_private_key = *key;
  }
  return grpc::SslCredentials(o);
}

std::vector<std::string> PeerCertificateNames(const grpc::AuthContext& auth) {
  std::vector<std::string> names;
  if (!auth.IsPeerAuthenticated()) return names;
  for (const char* property : {GRPC_X509_SAN_PROPERTY_NAME, GRPC_X509_CN_PROPERTY_NAME}) {
    for (const grpc::string_ref& v : auth.FindPropertyValues(property)) {
      std::string name(v.data(), v.size());
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
    }
  }
  return names;
}

}  // namespace kiln
