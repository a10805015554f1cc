#pragma once

// Helpers for tests that drive real binaries: run a command line, read a file whole.
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

namespace kiln::testing {

struct ShellResult {
  int rc = -1;
  std::string out;  // stdout and stderr together
};

// Runs `cmd` through /bin/sh and waits for it.
inline ShellResult Shell(const std::string& cmd) {
  ShellResult r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace kiln::testing
