#include "bench/oip.h"

#include <cctype>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kiln::bench {

namespace {

using nlohmann::json;

void AppendLittleEndian(const std::vector<int64_t>& values, std::string* out) {
  out->reserve(out->size() + values.size() * sizeof(int64_t));
  for (int64_t v : values) {
    uint64_t u = static_cast<uint64_t>(v);
    char bytes[8];
    for (int i = 0; i < 8; ++i) {
      bytes[i] = static_cast<char>((u >> (8 * i)) & 0xff);
    }
    out->append(bytes, 8);
  }
}

// Appends every number of a (possibly nested) JSON array, row-major.
absl::Status Flatten(const json& node, std::vector<float>* out) {
  if (node.is_array()) {
    for (const json& child : node) {
      absl::Status s = Flatten(child, out);
      if (!s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }
  if (node.is_number()) {
    out->push_back(node.get<float>());
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("output data holds a non-number (", node.type_name(), ")"));
}

}  // namespace

EncoderInput RandomEncoderInput(int64_t batch, int64_t seq_len, std::mt19937_64* rng) {
  std::uniform_int_distribution<int64_t> token(1, 999);
  EncoderInput in;
  in.batch = batch;
  in.seq_len = seq_len;
  in.ids.resize(static_cast<size_t>(batch * seq_len));
  for (int64_t& id : in.ids) {
    id = token(*rng);
  }
  in.mask.assign(in.ids.size(), 1);
  return in;
}

EncoderInput SentenceToEncoderInput(const std::string& sentence) {
  EncoderInput in;
  std::string word;
  auto flush = [&]() {
    if (word.empty()) {
      return;
    }
    uint64_t h = 1469598103934665603ULL;  // FNV-1a
    for (unsigned char c : word) {
      h ^= c;
      h *= 1099511628211ULL;
    }
    in.ids.push_back(static_cast<int64_t>(h % 999) + 1);
    word.clear();
  };
  for (unsigned char c : sentence) {
    if (std::isalnum(c)) {
      word.push_back(static_cast<char>(std::tolower(c)));
    } else {
      flush();
    }
  }
  flush();
  if (in.ids.empty()) {
    in.ids.push_back(1);
  }
  in.batch = 1;
  in.seq_len = static_cast<int64_t>(in.ids.size());
  in.mask.assign(in.ids.size(), 1);
  return in;
}

inference::ModelInferRequest MakeGrpcInferRequest(const std::string& model,
                                                  const std::string& version, const std::string& id,
                                                  const EncoderInput& in, bool raw) {
  inference::ModelInferRequest req;
  req.set_model_name(model);
  req.set_model_version(version);
  req.set_id(id);
  const std::pair<const char*, const std::vector<int64_t>*> tensors[] = {
      {kInputIdsName, &in.ids}, {kAttentionMaskName, &in.mask}};
  for (const auto& [name, values] : tensors) {
    auto* input = req.add_inputs();
    input->set_name(name);
    input->set_datatype("INT64");
    input->add_shape(in.batch);
    input->add_shape(in.seq_len);
    if (raw) {
      AppendLittleEndian(*values, req.add_raw_input_contents());
    } else {
      auto* contents = input->mutable_contents()->mutable_int64_contents();
      contents->Reserve(static_cast<int>(values->size()));
      for (int64_t v : *values) {
        contents->Add(v);
      }
    }
  }
  req.add_outputs()->set_name(kEmbeddingName);
  return req;
}

std::string MakeRestInferBody(const std::string& id, const EncoderInput& in) {
  json body = {
      {"id", id},
      {"inputs", json::array({
                     {{"name", kInputIdsName},
                      {"shape", {in.batch, in.seq_len}},
                      {"datatype", "INT64"},
                      {"data", in.ids}},
                     {{"name", kAttentionMaskName},
                      {"shape", {in.batch, in.seq_len}},
                      {"datatype", "INT64"},
                      {"data", in.mask}},
                 })},
      {"outputs", json::array({{{"name", kEmbeddingName}}})},
  };
  return body.dump();
}

std::string RestInferPath(const std::string& model, const std::string& version) {
  if (version.empty()) {
    return absl::StrCat("/v2/models/", model, "/infer");
  }
  return absl::StrCat("/v2/models/", model, "/versions/", version, "/infer");
}

absl::StatusOr<InferResult> ParseGrpcInferResponse(const inference::ModelInferResponse& resp,
                                                   const std::string& output) {
  int index = -1;
  for (int i = 0; i < resp.outputs_size(); ++i) {
    if (resp.outputs(i).name() == output) {
      index = i;
      break;
    }
  }
  if (index < 0) {
    return absl::NotFoundError(
        absl::StrCat("response has no output '", output, "' (", resp.outputs_size(), " outputs)"));
  }
  const auto& tensor = resp.outputs(index);
  if (tensor.datatype() != "FP32") {
    return absl::InvalidArgumentError(
        absl::StrCat("output '", output, "' is ", tensor.datatype(), ", expected FP32"));
  }
  InferResult result;
  result.model_version = resp.model_version();
  result.shape.assign(tensor.shape().begin(), tensor.shape().end());
  if (resp.raw_output_contents_size() > 0) {
    if (index >= resp.raw_output_contents_size()) {
      return absl::InvalidArgumentError("raw_output_contents has fewer entries than outputs");
    }
    const std::string& bytes = resp.raw_output_contents(index);
    if (bytes.size() % sizeof(float) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("raw output '", output, "' has ", bytes.size(), " bytes"));
    }
    result.values.resize(bytes.size() / sizeof(float));
    std::memcpy(result.values.data(), bytes.data(), bytes.size());  // little-endian host
  } else {
    result.values.assign(tensor.contents().fp32_contents().begin(),
                         tensor.contents().fp32_contents().end());
  }
  int64_t expected = 1;
  for (int64_t d : result.shape) {
    expected *= d;
  }
  if (expected != static_cast<int64_t>(result.values.size())) {
    return absl::InvalidArgumentError(absl::StrCat("output '", output, "' has ",
                                                   result.values.size(), " values for its shape (",
                                                   expected, ")"));
  }
  return result;
}

std::string RestErrorMessage(int http_status, const std::string& body) {
  json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_object() && parsed.contains("error") && parsed["error"].is_string()) {
    return absl::StrCat("HTTP ", http_status, ": ", parsed["error"].get<std::string>());
  }
  return absl::StrCat("HTTP ", http_status, ": ", body.substr(0, 200));
}

absl::StatusOr<InferResult> ParseRestInferResponse(int http_status, const std::string& body,
                                                   const std::string& output) {
  if (http_status < 200 || http_status >= 300) {
    return absl::UnavailableError(RestErrorMessage(http_status, body));
  }
  json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded() || !parsed.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("response is not a JSON object: ", body.substr(0, 200)));
  }
  if (parsed.contains("error")) {
    return absl::UnavailableError(RestErrorMessage(http_status, body));
  }
  InferResult result;
  if (parsed.contains("model_version") && parsed["model_version"].is_string()) {
    result.model_version = parsed["model_version"].get<std::string>();
  }
  if (!parsed.contains("outputs") || !parsed["outputs"].is_array()) {
    return absl::InvalidArgumentError("response has no 'outputs' array");
  }
  for (const json& out : parsed["outputs"]) {
    if (!out.is_object() || !out.contains("name") || out["name"] != output) {
      continue;
    }
    if (out.contains("shape") && out["shape"].is_array()) {
      for (const json& d : out["shape"]) {
        if (!d.is_number_integer()) {
          return absl::InvalidArgumentError("output shape holds a non-integer");
        }
        result.shape.push_back(d.get<int64_t>());
      }
    }
    if (!out.contains("data")) {
      return absl::InvalidArgumentError(absl::StrCat("output '", output, "' has no data"));
    }
    absl::Status s = Flatten(out["data"], &result.values);
    if (!s.ok()) {
      return s;
    }
    return result;
  }
  return absl::NotFoundError(absl::StrCat("response has no output '", output, "'"));
}

}  // namespace kiln::bench
