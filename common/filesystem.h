#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kiln {

// The one seam for reading the OS's files (sysfs, procfs, cgroupfs). Paths are absolute
// ("/sys/devices/system/node"); a rooted implementation maps them under a directory so tests
// and `--sysfs-root` can point at a fake tree.
class Filesystem {
 public:
  virtual ~Filesystem() = default;
  // The whole file; NOT_FOUND when absent.
  virtual absl::StatusOr<std::string> ReadFile(const std::string& path) const = 0;
  // Entry names (not paths) of a directory, sorted; NOT_FOUND when absent.
  virtual absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) const = 0;
  virtual bool Exists(const std::string& path) const = 0;
};

// Replaces `path` with `contents` through `path`.tmp, synced to disk and renamed over it (the
// directory synced after): a reader, a crash or a power loss finds the old file or the new
// one, never part of one.
absl::Status ReplaceFile(const std::string& path, const std::string& contents);

// Reads the real filesystem, with every path prefixed by `root` ("" = the real root).
class RootedFilesystem : public Filesystem {
 public:
  explicit RootedFilesystem(std::string root = "") : root_(std::move(root)) {}
  absl::StatusOr<std::string> ReadFile(const std::string& path) const override;
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) const override;
  bool Exists(const std::string& path) const override;

 private:
  std::string Map(const std::string& path) const { return root_ + path; }
  const std::string root_;
};

}  // namespace kiln
