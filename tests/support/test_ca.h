#pragma once

// A throwaway certificate authority for TLS tests, made with the openssl command line: a CA,
// certificates it signs (EC P-256, one day) with the names asked for, and a second, unrelated
// CA for certificates no kiln side should trust.
#include <string>
#include <vector>

#include "tests/support/shell.h"

namespace kiln::testing {

struct CertFiles {
  std::string cert, key;
};

class TestCa {
 public:
  // Makes the CA under `dir` (which must exist); `ok()` says whether openssl did its part.
  TestCa(std::string dir, std::string name) : dir_(std::move(dir)), name_(std::move(name)) {
    ok_ = Run("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1"
              " -subj /CN=" + name_ + " -keyout " + Path(name_ + ".key") + " -out " + ca());
  }
  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }
  std::string ca() const { return Path(name_ + ".crt"); }

  // A certificate for `cn` with subject alternative names `sans` ("DNS:x", "IP:127.0.0.1").
  CertFiles Issue(const std::string& file, const std::string& cn,
                  const std::vector<std::string>& sans) {
    CertFiles f{Path(file + ".crt"), Path(file + ".key")};
    std::string ext = Path(file + ".ext");
    std::string san;
    for (const auto& s : sans) san += (san.empty() ? "" : ",") + s;
    Run("printf 'subjectAltName=%s\\n' '" + san + "' > " + ext);
    ok_ = ok_ &&
          Run("openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=" +
              cn + " -keyout " + f.key + " -out " + Path(file + ".csr")) &&
          Run("openssl x509 -req -days 1 -in " + Path(file + ".csr") + " -CA " + ca() +
              " -CAkey " + Path(name_ + ".key") + " -CAcreateserial -out " + f.cert +
              (san.empty() ? "" : " -extfile " + ext));
    return f;
  }

 private:
  std::string Path(const std::string& f) const { return dir_ + "/" + f; }
  bool Run(const std::string& cmd) {
    ShellResult r = Shell(cmd);
    if (r.rc != 0) error_ += cmd + ": " + r.out + "\n";
    return r.rc == 0;
  }
  std::string dir_, name_;
  bool ok_ = false;
  std::string error_;
};

}  // namespace kiln::testing
