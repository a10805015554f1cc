#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "yaml-cpp/yaml.h"

namespace kiln {

// A read-only view of one YAML node that knows its path ("dynamic_batching.max_queue_size"),
// so every error names the field and the reason. YAML is only syntax here: callers map a
// ConfigNode onto a typed struct and validate that struct.
class ConfigNode {
 public:
  ConfigNode(YAML::Node node, std::string path) : node_(std::move(node)), path_(std::move(path)) {}

  // Parses a whole document. `source` names it in errors (a file path).
  static absl::StatusOr<ConfigNode> Parse(const std::string& text, const std::string& source);
  static absl::StatusOr<ConfigNode> LoadFile(const std::string& file);

  const std::string& path() const { return path_; }
  bool IsMap() const { return node_.IsMap(); }
  bool IsSequence() const { return node_.IsSequence(); }
  bool IsNull() const { return !node_.IsDefined() || node_.IsNull(); }
  bool Has(const std::string& key) const;

  // Fails when the node is a map holding a key outside `allowed` (a typo is an error, not
  // a silently ignored field).
  absl::Status CheckKeys(std::initializer_list<const char*> allowed) const;
  absl::Status ExpectMap() const;

  absl::StatusOr<ConfigNode> Child(const std::string& key) const;  // required
  std::optional<ConfigNode> OptionalChild(const std::string& key) const;
  // As OptionalChild, but a key given with no value (`key:` or `key: ~`) is there, as a null
  // node: for sections whose presence alone turns something on.
  std::optional<ConfigNode> SectionChild(const std::string& key) const;
  absl::StatusOr<std::vector<ConfigNode>> Items() const;  // a sequence's elements
  absl::StatusOr<std::vector<std::pair<std::string, ConfigNode>>> Entries() const;  // a map's

  absl::StatusOr<std::string> AsString() const;
  absl::StatusOr<int64_t> AsInt() const;
  absl::StatusOr<double> AsDouble() const;
  absl::StatusOr<bool> AsBool() const;
  absl::StatusOr<std::vector<int64_t>> AsIntList() const;

  // Optional scalar fields: the default when the key is absent.
  absl::StatusOr<std::string> GetString(const std::string& key, const std::string& def) const;
  absl::StatusOr<int64_t> GetInt(const std::string& key, int64_t def) const;
  absl::StatusOr<bool> GetBool(const std::string& key, bool def) const;
  absl::StatusOr<std::vector<int64_t>> GetIntList(const std::string& key) const;

  absl::Status Error(const std::string& reason) const;

 private:
  std::string ChildPath(const std::string& key) const;

  YAML::Node node_;
  std::string path_;
};

// Parses a size: a plain byte count or a quantity with a binary/decimal suffix
// (64Mi, 1Gi, 500M, 4k). `field` names the value in errors.
absl::StatusOr<int64_t> ParseByteSize(const std::string& text, const std::string& field);

// Every document of a YAML stream ("---" separated), empty ones included (null nodes) so that
// callers can number them; INVALID_ARGUMENT "SOURCE: not valid YAML: ..." otherwise.
absl::StatusOr<std::vector<YAML::Node>> LoadYamlDocuments(const std::string& text,
                                                          const std::string& source);

}  // namespace kiln
