#include "common/filesystem.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace kiln {

absl::Status ReplaceFile(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::PermissionDeniedError(tmp + ": cannot be written: " + std::strerror(errno));
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "nothing written";
      close(fd);
      unlink(tmp.c_str());  // a part of it is nobody's
      return absl::DataLossError(tmp + ": write failed: " + why);
    }
    done += static_cast<size_t>(n);
  }
  // On disk before it takes the old file's name, and the rename on disk before this returns:
  // a power loss leaves the old file or the new one, never an empty one.
  int synced;
  do {
    synced = fsync(fd);
  } while (synced != 0 && errno == EINTR);
  if (synced != 0) {
    const std::string why = std::strerror(errno);
    close(fd);
    unlink(tmp.c_str());
    return absl::DataLossError(tmp + ": fsync failed: " + why);
  }
  close(fd);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    unlink(tmp.c_str());
    return absl::DataLossError(path + ": rename failed: " + ec.message());
  }
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int dfd = open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)fsync(dfd);  // best effort: the file itself is whole either way
    close(dfd);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> RootedFilesystem::ReadFile(const std::string& path) const {
  std::ifstream in(Map(path), std::ios::binary);
  if (!in) return absl::NotFoundError(path + ": cannot be read");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

absl::StatusOr<std::vector<std::string>> RootedFilesystem::ListDir(const std::string& path) const {
  std::error_code ec;
  std::filesystem::directory_iterator it(Map(path), ec);
  if (ec) return absl::NotFoundError(path + ": cannot be listed");
  std::vector<std::string> out;
  for (const auto& e : it) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

bool RootedFilesystem::Exists(const std::string& path) const {
  std::error_code ec;
  return std::filesystem::exists(Map(path), ec);
}

}  // namespace kiln
