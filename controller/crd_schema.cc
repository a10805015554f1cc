#include "controller/crd_schema.h"

#include <cmath>
#include <regex>

#include "common/config_node.h"

namespace kiln {

namespace {

using nlohmann::json;

std::string Join(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

bool IsInteger(const json& v) {
  if (v.is_number_integer()) return true;
  if (v.is_number_float()) {
    double d = v.get<double>();
    return std::isfinite(d) && std::floor(d) == d;
  }
  return false;
}

std::string Quote(const json& v) { return v.is_string() ? "\"" + v.get<std::string>() + "\"" : v.dump(); }

// RFC 3339 date-time, as the API server's "date-time" format requires.
bool IsDateTime(const std::string& s) {
  static const std::regex re(
      R"(^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$)");
  return std::regex_match(s, re);
}

// Every node needs a type unless it is int-or-string or keeps unknown fields.
absl::Status CheckStructural(const json& s, const std::string& path) {
  if (!s.is_object()) return absl::InvalidArgumentError(path + ": schema is not an object");
  bool typed = s.contains("type") && s["type"].is_string() && !s["type"].get<std::string>().empty();
  bool int_or_string = s.value("x-kubernetes-int-or-string", false);
  bool preserve = s.value("x-kubernetes-preserve-unknown-fields", false);
  if (!typed && !int_or_string && !preserve) {
    return absl::InvalidArgumentError(path + ".type: Required value: must not be empty for specified object fields");
  }
  if (s.contains("properties")) {
    for (const auto& [k, sub] : s["properties"].items()) {
      if (auto st = CheckStructural(sub, path + ".properties[" + k + "]"); !st.ok()) return st;
    }
  }
  if (s.contains("items")) {
    if (auto st = CheckStructural(s["items"], path + ".items"); !st.ok()) return st;
  }
  if (typed && s["type"] == "array" && !s.contains("items")) {
    return absl::InvalidArgumentError(path + ".items: Required value: must be specified for arrays");
  }
  return absl::OkStatus();
}

void Prune(const json& s, json& v) {
  if (v.is_object() && s.contains("properties")) {
    for (auto it = v.begin(); it != v.end();) {
      const json* sub = s["properties"].contains(it.key()) ? &s["properties"][it.key()] : nullptr;
      if (it->is_null() && !(sub && sub->value("nullable", false))) {
        it = v.erase(it);
        continue;
      }
      if (sub) Prune(*sub, *it);
      ++it;
    }
    for (const auto& [k, sub] : s["properties"].items()) {
      if (!v.contains(k) && sub.contains("default")) v[k] = sub["default"];
    }
  } else if (v.is_array() && s.contains("items")) {
    for (auto& item : v) Prune(s["items"], item);
  }
}

void Check(const json& s, const json& v, const std::string& path, std::vector<std::string>& errs) {
  const std::string where = path.empty() ? "<root>" : path;
  auto fail = [&](const std::string& why) { errs.push_back(where + ": " + why); };
  if (v.is_null()) {
    if (!s.value("nullable", false)) fail("Invalid value: null: must not be null");
    return;
  }
  std::string type = s.value("type", "");
  if (s.value("x-kubernetes-int-or-string", false)) {
    if (!IsInteger(v) && !v.is_string()) {
      fail("Invalid value: " + v.dump() + ": must be an integer or a string");
      return;
    }
  } else if (type == "object") {
    if (!v.is_object()) return fail("Invalid value: \"" + std::string(v.type_name()) + "\": must be of type object");
  } else if (type == "array") {
    if (!v.is_array()) return fail("Invalid value: \"" + std::string(v.type_name()) + "\": must be of type array");
  } else if (type == "string") {
    if (!v.is_string()) return fail("Invalid value: \"" + std::string(v.type_name()) + "\": must be of type string");
  } else if (type == "integer") {
    if (!IsInteger(v)) return fail("Invalid value: \"" + std::string(v.type_name()) + "\": must be of type integer");
  } else if (type == "number") {
    if (!v.is_number()) return fail("Invalid value: \"" + std::string(v.type_name()) + "\": must be of type number");
  } else if (type == "boolean") {
    if (!v.is_boolean()) return fail("Invalid value: \"" + std::string(v.type_name()) + "\": must be of type boolean");
  }

  if (s.contains("enum")) {
    bool found = false;
    for (const auto& e : s["enum"]) found = found || e == v;
    if (!found) {
      std::string all;
      for (const auto& e : s["enum"]) all += (all.empty() ? "" : ", ") + Quote(e);
      fail("Unsupported value: " + Quote(v) + ": supported values: " + all);
    }
  }
  if (v.is_number()) {
    double d = v.get<double>();
    if (s.contains("minimum")) {
      double m = s["minimum"].get<double>();
      bool excl = s.value("exclusiveMinimum", false);
      if (excl ? !(d > m) : !(d >= m)) {
        fail("Invalid value: " + v.dump() + ": should be greater than " +
             std::string(excl ? "" : "or equal to ") + s["minimum"].dump());
      }
    }
    if (s.contains("maximum")) {
      double m = s["maximum"].get<double>();
      bool excl = s.value("exclusiveMaximum", false);
      if (excl ? !(d < m) : !(d <= m)) {
        fail("Invalid value: " + v.dump() + ": should be less than " +
             std::string(excl ? "" : "or equal to ") + s["maximum"].dump());
      }
    }
  }
  if (v.is_string()) {
    const std::string& str = v.get_ref<const std::string&>();
    if (s.contains("minLength") && str.size() < s["minLength"].get<size_t>()) {
      fail("Invalid value: " + Quote(v) + ": should be at least " + s["minLength"].dump() + " chars long");
    }
    if (s.contains("maxLength") && str.size() > s["maxLength"].get<size_t>()) {
      fail("Too long: may not be more than " + s["maxLength"].dump() + " bytes");
    }
    if (s.contains("pattern")) {
      const std::string pattern = s["pattern"].get<std::string>();
      if (!std::regex_search(str, std::regex(pattern))) {
        fail("Invalid value: " + Quote(v) + ": should match '" + pattern + "'");
      }
    }
    if (s.value("format", "") == "date-time" && !IsDateTime(str)) {
      fail("Invalid value: " + Quote(v) + ": must be a date-time (RFC 3339)");
    }
  }
  if (v.is_array()) {
    if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) {
      fail("Invalid value: should have at least " + s["minItems"].dump() + " items");
    }
    if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) {
      fail("Too many: " + std::to_string(v.size()) + ": must have at most " + s["maxItems"].dump() + " items");
    }
    if (s.contains("items")) {
      for (size_t i = 0; i < v.size(); ++i) {
        Check(s["items"], v[i], path + "[" + std::to_string(i) + "]", errs);
      }
    }
  }
  if (v.is_object()) {
    if (s.contains("required")) {
      for (const auto& r : s["required"]) {
        if (!v.contains(r.get<std::string>())) errs.push_back(Join(path, r.get<std::string>()) + ": Required value");
      }
    }
    const bool preserve = s.value("x-kubernetes-preserve-unknown-fields", false);
    const json* props = s.contains("properties") ? &s["properties"] : nullptr;
    for (const auto& [k, sub] : v.items()) {
      if (props && props->contains(k)) {
        Check((*props)[k], sub, Join(path, k), errs);
      } else if (!preserve && props) {
        errs.push_back(Join(path, k) + ": unknown field \"" + Join(path, k) + "\"");
      }
    }
  }
}

json ScalarToJson(const YAML::Node& n) {
  const std::string& text = n.Scalar();
  if (n.Tag() != "?") return text;  // quoted or explicitly tagged: a string
  static const std::regex kInt(R"(^[-+]?[0-9]+$)");
  static const std::regex kFloat(R"(^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$)");
  if (text.empty() || text == "~" || text == "null" || text == "Null" || text == "NULL") return nullptr;
  if (text == "true" || text == "True" || text == "TRUE") return true;
  if (text == "false" || text == "False" || text == "FALSE") return false;
  if (std::regex_match(text, kInt)) {
    try {
      return std::stoll(text);
    } catch (...) {
      return text;
    }
  }
  if (std::regex_match(text, kFloat)) return std::stod(text);
  return text;
}

}  // namespace

json YamlToJson(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: {
      json out = json::object();
      for (const auto& kv : node) out[kv.first.Scalar()] = YamlToJson(kv.second);
      return out;
    }
    case YAML::NodeType::Sequence: {
      json out = json::array();
      for (const auto& item : node) out.push_back(YamlToJson(item));
      return out;
    }
    case YAML::NodeType::Scalar:
      return ScalarToJson(node);
    default:
      return nullptr;
  }
}

absl::StatusOr<std::vector<json>> YamlDocumentsToJson(const std::string& text,
                                                      const std::string& source) {
  auto docs = LoadYamlDocuments(text, source);
  if (!docs.ok()) return docs.status();
  std::vector<json> out;
  for (const auto& d : *docs) {
    if (!d.IsNull()) out.push_back(YamlToJson(d));
  }
  return out;
}

absl::StatusOr<CrdSchema> CrdSchema::FromCrd(const json& crd, const std::string& version) {
  if (!crd.is_object() || crd.value("kind", "") != "CustomResourceDefinition") {
    return absl::InvalidArgumentError("kind: not a CustomResourceDefinition");
  }
  const json versions = crd.contains("spec") ? crd["spec"].value("versions", json::array()) : json::array();
  for (size_t i = 0; i < versions.size(); ++i) {
    if (versions[i].value("name", "") != version) continue;
    std::string path = "spec.versions[" + std::to_string(i) + "].schema.openAPIV3Schema";
    if (!versions[i].contains("schema") || !versions[i]["schema"].contains("openAPIV3Schema")) {
      return absl::InvalidArgumentError(path + ": Required value");
    }
    json schema = versions[i]["schema"]["openAPIV3Schema"];
    if (auto s = CheckStructural(schema, path); !s.ok()) return s;
    return CrdSchema(std::move(schema));
  }
  return absl::NotFoundError("spec.versions: no version named '" + version + "'");
}

std::vector<std::string> CrdSchema::Validate(json& object) const {
  Prune(schema_, object);
  std::vector<std::string> errs;
  Check(schema_, object, "", errs);
  return errs;
}

}  // namespace kiln
