#include "common/config_node.h"

#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/str_join.h"

namespace kiln {

absl::StatusOr<ConfigNode> ConfigNode::Parse(const std::string& text, const std::string& source) {
  try {
    YAML::Node root = YAML::Load(text);
    return ConfigNode(root, "");
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(source + ": not valid YAML: " + e.what());
  }
}

absl::StatusOr<std::vector<YAML::Node>> LoadYamlDocuments(const std::string& text,
                                                          const std::string& source) {
  try {
    return YAML::LoadAll(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(source + ": not valid YAML: " + e.what());
  }
}

absl::StatusOr<ConfigNode> ConfigNode::LoadFile(const std::string& file) {
  std::ifstream in(file);
  if (!in) return absl::NotFoundError(file + ": cannot be read");
  std::stringstream buf;
  buf << in.rdbuf();
  return Parse(buf.str(), file);
}

std::string ConfigNode::ChildPath(const std::string& key) const {
  return path_.empty() ? key : path_ + "." + key;
}

absl::Status ConfigNode::Error(const std::string& reason) const {
  return absl::InvalidArgumentError((path_.empty() ? std::string("(document)") : path_) + ": " +
                                    reason);
}

bool ConfigNode::Has(const std::string& key) const {
  return node_.IsMap() && node_[key].IsDefined() && !node_[key].IsNull();
}

absl::Status ConfigNode::ExpectMap() const {
  if (!node_.IsMap()) return Error("must be a mapping");
  return absl::OkStatus();
}

absl::Status ConfigNode::CheckKeys(std::initializer_list<const char*> allowed) const {
  if (!node_.IsMap()) return Error("must be a mapping");
  for (const auto& kv : node_) {
    std::string key;
    try {
      key = kv.first.as<std::string>();
    } catch (const YAML::Exception&) {
      return Error("has a key that is not a string");
    }
    bool ok = false;
    for (const char* a : allowed) {
      if (key == a) ok = true;
    }
    if (!ok) {
      std::vector<std::string> names(allowed.begin(), allowed.end());
      return absl::InvalidArgumentError(ChildPath(key) + ": unknown field (expected one of: " +
                                        absl::StrJoin(names, ", ") + ")");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ConfigNode> ConfigNode::Child(const std::string& key) const {
  if (!node_.IsMap()) return Error("must be a mapping");
  if (!Has(key)) return absl::InvalidArgumentError(ChildPath(key) + ": required field is missing");
  return ConfigNode(node_[key], ChildPath(key));
}

std::optional<ConfigNode> ConfigNode::OptionalChild(const std::string& key) const {
  if (!Has(key)) return std::nullopt;
  return ConfigNode(node_[key], ChildPath(key));
}

std::optional<ConfigNode> ConfigNode::SectionChild(const std::string& key) const {
  if (!node_.IsMap() || !node_[key].IsDefined()) return std::nullopt;
  return ConfigNode(node_[key], ChildPath(key));
}

absl::StatusOr<std::vector<ConfigNode>> ConfigNode::Items() const {
  if (!node_.IsSequence()) return Error("must be a list");
  std::vector<ConfigNode> out;
  for (size_t i = 0; i < node_.size(); ++i) {
    out.emplace_back(node_[i], path_ + "[" + std::to_string(i) + "]");
  }
  return out;
}

absl::StatusOr<std::vector<std::pair<std::string, ConfigNode>>> ConfigNode::Entries() const {
  if (!node_.IsMap()) return Error("must be a mapping");
  std::vector<std::pair<std::string, ConfigNode>> out;
  for (const auto& kv : node_) {
    std::string key;
    try {
      key = kv.first.as<std::string>();
    } catch (const YAML::Exception&) {
      return Error("has a key that is not a string");
    }
    out.emplace_back(key, ConfigNode(kv.second, ChildPath(key)));
  }
  return out;
}

absl::StatusOr<std::string> ConfigNode::AsString() const {
  if (!node_.IsScalar()) return Error("must be a string");
  return node_.Scalar();
}

absl::StatusOr<int64_t> ConfigNode::AsInt() const {
  if (!node_.IsScalar()) return Error("must be an integer");
  const std::string& s = node_.Scalar();
  if (s.empty()) return Error("must be an integer");
  size_t pos = 0;
  long long v = 0;
  try {
    v = std::stoll(s, &pos, 10);
  } catch (const std::exception&) {
    return Error("must be an integer, got '" + s + "'");
  }
  if (pos != s.size()) return Error("must be an integer, got '" + s + "'");
  return static_cast<int64_t>(v);
}

absl::StatusOr<double> ConfigNode::AsDouble() const {
  if (!node_.IsScalar()) return Error("must be a number");
  const std::string& s = node_.Scalar();
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    return Error("must be a number, got '" + s + "'");
  }
  if (pos != s.size() || !std::isfinite(v)) return Error("must be a number, got '" + s + "'");
  return v;
}

absl::StatusOr<bool> ConfigNode::AsBool() const {
  if (!node_.IsScalar()) return Error("must be true or false");
  const std::string& s = node_.Scalar();
  if (s == "true" || s == "True" || s == "TRUE") return true;
  if (s == "false" || s == "False" || s == "FALSE") return false;
  return Error("must be true or false, got '" + s + "'");
}

absl::StatusOr<std::vector<int64_t>> ConfigNode::AsIntList() const {
  if (!node_.IsSequence()) return Error("must be a list of integers");
  std::vector<int64_t> out;
  auto items = Items();
  if (!items.ok()) return items.status();
  for (const auto& item : *items) {
    auto v = item.AsInt();
    if (!v.ok()) return v.status();
    out.push_back(*v);
  }
  return out;
}

absl::StatusOr<std::string> ConfigNode::GetString(const std::string& key,
                                                  const std::string& def) const {
  auto c = OptionalChild(key);
  if (!c) return def;
  return c->AsString();
}

absl::StatusOr<int64_t> ConfigNode::GetInt(const std::string& key, int64_t def) const {
  auto c = OptionalChild(key);
  if (!c) return def;
  return c->AsInt();
}

absl::StatusOr<bool> ConfigNode::GetBool(const std::string& key, bool def) const {
  auto c = OptionalChild(key);
  if (!c) return def;
  return c->AsBool();
}

absl::StatusOr<std::vector<int64_t>> ConfigNode::GetIntList(const std::string& key) const {
  auto c = OptionalChild(key);
  if (!c) return std::vector<int64_t>{};
  return c->AsIntList();
}

absl::StatusOr<int64_t> ParseByteSize(const std::string& text, const std::string& field) {
  auto bad = [&]() {
    return absl::InvalidArgumentError(field + ": '" + text +
                                      "' is not a size (bytes, or a number with k, M, G, Ki, "
                                      "Mi, Gi)");
  };
  if (text.empty()) return bad();
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  if (i == 0) return bad();
  if (i > 15) return absl::InvalidArgumentError(field + ": '" + text + "' is too large");
  int64_t n = std::stoll(text.substr(0, i));
  std::string suffix = text.substr(i);
  int64_t mult = 1;
  if (suffix.empty()) {
    mult = 1;
  } else if (suffix == "k" || suffix == "K") {
    mult = 1000;
  } else if (suffix == "M") {
    mult = 1000 * 1000;
  } else if (suffix == "G") {
    mult = 1000LL * 1000 * 1000;
  } else if (suffix == "Ki") {
    mult = 1024;
  } else if (suffix == "Mi") {
    mult = 1024 * 1024;
  } else if (suffix == "Gi") {
    mult = 1024LL * 1024 * 1024;
  } else {
    return bad();
  }
  if (n > std::numeric_limits<int64_t>::max() / mult) {
    return absl::InvalidArgumentError(field + ": '" + text + "' is too large");
  }
  return n * mult;
}

}  // namespace kiln
