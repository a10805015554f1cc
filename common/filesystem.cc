#include "common/filesystem.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace kiln {

absl::Status ReplaceFile(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(tmp + ": cannot be written");
    out << contents;
    out.flush();
    if (!out) return absl::DataLossError(tmp + ": write failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::DataLossError(path + ": rename failed: " + ec.message());
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
