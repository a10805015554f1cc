#pragma once

// A CustomResourceDefinition's structural OpenAPI v3 schema, applied the way the Kubernetes API
// server applies it to a custom object: types (with x-kubernetes-int-or-string), required
// fields, enums, numeric ranges, string lengths and patterns, array bounds, and unknown fields
// rejected as with strict field validation unless x-kubernetes-preserve-unknown-fields. Null
// values of non-nullable fields are pruned first, defaults filled in, as the server does.
// CEL rules (x-kubernetes-validations) are not evaluated here: the controller's own validation
// covers them.
//
// Used by tests to keep manifests/crd.yaml and the controller's parser in agreement, and by
// the in-test Kubernetes API server to accept or refuse objects as a real one would.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace kiln {

// YAML to JSON: plain scalars become null, booleans, integers or floats where they read as
// such (YAML 1.2 core schema), quoted scalars stay strings.
nlohmann::json YamlToJson(const YAML::Node& node);
// Every document of a YAML stream, empty documents skipped.
absl::StatusOr<std::vector<nlohmann::json>> YamlDocumentsToJson(const std::string& text,
                                                                 const std::string& source);

class CrdSchema {
 public:
  // The openAPIV3Schema of `version` in a CustomResourceDefinition document.
  static absl::StatusOr<CrdSchema> FromCrd(const nlohmann::json& crd, const std::string& version);

  // Prunes nulls and fills defaults in `object`, then returns every violation as
  // "path: reason" (e.g. "spec.replicas: should be less than or equal to 10000"); empty when
  // the object is valid.
  std::vector<std::string> Validate(nlohmann::json& object) const;

  const nlohmann::json& schema() const { return schema_; }

 private:
  explicit CrdSchema(nlohmann::json schema) : schema_(std::move(schema)) {}
  nlohmann::json schema_;
};

}  // namespace kiln
