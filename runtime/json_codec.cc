#include "runtime/json_codec.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common/oip_parameters.h"
#include "common/status.h"

namespace kiln {

using nlohmann::json;

namespace {

template <typename T>
void Put(std::string* out, size_t i, T v) {
  std::memcpy(out->data() + i * sizeof(T), &v, sizeof(T));
}

template <typename T>
T Get(const std::string& data, size_t i) {
  T v;
  std::memcpy(&v, data.data() + i * sizeof(T), sizeof(T));
  return v;
}

absl::Status BadElement(const std::string& name, size_t i, const std::string& what) {
  return absl::InvalidArgumentError("input '" + name + "': data[" + std::to_string(i) +
                                    "] must be " + what);
}

template <typename T>
absl::Status PutInt(const json& v, const std::string& name, size_t i, std::string* out) {
  if (!v.is_number_integer()) return BadElement(name, i, "an integer");
  if constexpr (std::is_unsigned_v<T>) {
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u > std::numeric_limits<T>::max()) return BadElement(name, i, "in the type's range");
      Put<T>(out, i, static_cast<T>(u));
      return absl::OkStatus();
    }
    int64_t s = v.get<int64_t>();
    if (s < 0 || static_cast<uint64_t>(s) > std::numeric_limits<T>::max()) {
      return BadElement(name, i, "in the type's range");
    }
    Put<T>(out, i, static_cast<T>(s));
  } else {
    if (v.is_number_unsigned() &&
        v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return BadElement(name, i, "in the type's range");
    }
    int64_t s = v.get<int64_t>();
    if (s < std::numeric_limits<T>::min() || s > std::numeric_limits<T>::max()) {
      return BadElement(name, i, "in the type's range");
    }
    Put<T>(out, i, static_cast<T>(s));
  }
  return absl::OkStatus();
}

absl::Status PutElement(const json& v, DataType t, const std::string& name, size_t i,
                        std::string* out) {
  switch (t) {
    case DataType::kBool:
      if (!v.is_boolean()) return BadElement(name, i, "true or false");
      (*out)[i] = v.get<bool>() ? 1 : 0;
      return absl::OkStatus();
    case DataType::kInt8:
      return PutInt<int8_t>(v, name, i, out);
    case DataType::kInt16:
      return PutInt<int16_t>(v, name, i, out);
    case DataType::kInt32:
      return PutInt<int32_t>(v, name, i, out);
    case DataType::kInt64:
      return PutInt<int64_t>(v, name, i, out);
    case DataType::kUint8:
      return PutInt<uint8_t>(v, name, i, out);
    case DataType::kUint16:
      return PutInt<uint16_t>(v, name, i, out);
    case DataType::kUint32:
      return PutInt<uint32_t>(v, name, i, out);
    case DataType::kUint64:
      return PutInt<uint64_t>(v, name, i, out);
    case DataType::kFp16:
    case DataType::kBf16:
    case DataType::kFp32:
    case DataType::kFp64: {
      if (!v.is_number()) return BadElement(name, i, "a number");
      double d = v.get<double>();
      if (t == DataType::kFp64) {
        Put<double>(out, i, d);
        return absl::OkStatus();
      }
      // JSON has no infinities: a number past the type's largest is a mistake, not one.
      auto out_of_range = [&] {
        return BadElement(name, i, "a number within " + std::string(DataTypeName(t)) + "'s range");
      };
      // Judged as rounded to float: -3.4028235e38, the shortest text for FP32's lowest, is a
      // little past it as a double and rounds to it. From half an ulp past FLT_MAX on a value
      // rounds to infinity (and converting it would be undefined).
      static const double kRoundsToInf = std::ldexp(2.0 - std::ldexp(1.0, -24), 127);
      if (!(std::fabs(d) < kRoundsToInf)) return out_of_range();
      const float f = static_cast<float>(d);
      if (t == DataType::kFp32) {
        Put<float>(out, i, f);
        return absl::OkStatus();
      }
      const uint16_t h = t == DataType::kFp16 ? FloatToHalf(f) : FloatToBf16(f);
      const uint16_t inf = t == DataType::kFp16 ? 0x7c00 : 0x7f80;
      if ((h & 0x7fff) == inf) return out_of_range();
      Put<uint16_t>(out, i, h);
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError("unsupported datatype");
}

absl::Status NestedTooDeep(const std::string& name, size_t max_depth) {
  return absl::InvalidArgumentError("input '" + name + "': data is nested deeper than its " +
                                    std::to_string(max_depth) + "-dimensional shape");
}

// Writes `v` as element *count of `out` and counts it; an error past `limit` elements.
absl::Status PutNext(const json& v, DataType t, const std::string& name, size_t limit,
                     size_t* count, std::string* out) {
  if (*count >= limit) {
    return absl::InvalidArgumentError("input '" + name + "': data has more than the " +
                                      std::to_string(limit) + " elements its shape holds");
  }
  KILN_RETURN_IF_ERROR(PutElement(v, t, name, *count, out));
  ++*count;
  return absl::OkStatus();
}

// Walks nested arrays in row-major order, writing each leaf. Nesting deeper than the
// shape's rank is an error (and bounds the recursion).
absl::Status Flatten(const json& node, DataType t, const std::string& name, size_t limit,
                     size_t depth, size_t max_depth, size_t* count, std::string* out) {
  if (node.is_array()) {
    if (depth >= max_depth) return NestedTooDeep(name, max_depth);
    for (const auto& child : node) {
      KILN_RETURN_IF_ERROR(Flatten(child, t, name, limit, depth + 1, max_depth, count, out));
    }
    return absl::OkStatus();
  }
  return PutNext(node, t, name, limit, count, out);
}

absl::StatusOr<int64_t> JsonInt(const json& v, const std::string& field) {
  if (!v.is_number_integer()) return absl::InvalidArgumentError(field + ": must be an integer");
  if (v.is_number_unsigned() &&
      v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(field + ": too large");
  }
  return v.get<int64_t>();
}

// An input's name, datatype and shape: the fields before its data, read and checked.
struct InputHeader {
  std::string name;
  DataType dtype = DataType::kFp32;
  std::vector<int64_t> shape;
  int64_t elements = 0;
  int64_t bytes = 0;
};

// `in` is an object; `field` names it in errors ("inputs[0]").
absl::StatusOr<InputHeader> ReadInputHeader(const json& in, const std::string& field) {
  InputHeader h;
  if (!in.contains("name") || !in["name"].is_string()) {
    return absl::InvalidArgumentError(field + ".name: must be a string");
  }
  h.name = in["name"].get<std::string>();
  if (!in.contains("datatype") || !in["datatype"].is_string()) {
    return absl::InvalidArgumentError(field + ".datatype: must be a string");
  }
  KILN_ASSIGN_OR_RETURN(h.dtype, ParseDataType(in["datatype"].get_ref<const std::string&>(),
                                               "input '" + h.name + "'"));
  if (!in.contains("shape") || !in["shape"].is_array()) {
    return absl::InvalidArgumentError(field + ".shape: must be an array of integers");
  }
  // Before the data is walked: its nesting may go as deep as the shape's rank.
  KILN_RETURN_IF_ERROR(CheckTensorRank(in["shape"].size(), field + ".shape:"));
  for (const json& d : in["shape"]) {
    KILN_ASSIGN_OR_RETURN(int64_t v, JsonInt(d, field + ".shape"));
    h.shape.push_back(v);
  }
  KILN_ASSIGN_OR_RETURN(h.elements, ElementCount(h.shape, "input '" + h.name + "'"));
  h.bytes = h.elements * static_cast<int64_t>(DataTypeSize(h.dtype));
  return h;
}

// One input's `data`, decoded into the tensor's bytes while the body is read.
struct DirectData {
  DataType dtype = DataType::kFp32;
  std::vector<int64_t> shape;
  std::string bytes;
  size_t count = 0;     // elements written
  absl::Status error;   // the first bad element or nesting; the rest of the data is skipped
};

// Reads an infer request body event by event. Everything but the inputs' `data` becomes a
// JSON document as json::parse would make it. An input whose datatype and shape came before
// its data (the order clients send) has its data written straight into the tensor's bytes:
// a body of millions of numbers is never held as millions of JSON values (about 9x its
// decoded size). Other inputs' data stay in the document, decoded afterwards as before.
// Errors in decoded data are kept with their input and reported when the request is checked
// in order, as if they had been found there.
class InferBodyReader : public nlohmann::json_sax<json> {
 public:
  InferBodyReader(int64_t max_bytes, size_t body_bytes)
      : max_bytes_(max_bytes), body_bytes_(body_bytes) {
    skipped_.error = absl::InvalidArgumentError("skipped");
  }

  json doc;
  std::map<size_t, DirectData> direct;  // by input position
  std::set<size_t> data_twice;          // inputs whose data were given more than once
  // Inputs whose data were skipped unread: their header, complete before them, refuses the
  // request (bad, or over the payload limit) whatever the data hold.
  std::set<size_t> skipped;

  bool null() override { return Value(json(nullptr)); }
  bool boolean(bool v) override { return Value(json(v)); }
  bool number_integer(number_integer_t v) override { return Value(json(v)); }
  bool number_unsigned(number_unsigned_t v) override { return Value(json(v)); }
  bool number_float(number_float_t v, const string_t&) override { return Value(json(v)); }
  bool string(string_t& v) override { return Value(json(std::move(v))); }
  bool binary(binary_t& v) override { return Value(json::binary(std::move(v))); }

  bool start_object(std::size_t) override {
    if (capturing_) {
      if (current_->error.ok()) Element(json::object());  // an object is no element
      ++depth_;
      return true;
    }
    json* o = Add(json::object());
    stack_.push_back(o);
    return true;
  }
  bool key(string_t& k) override {
    if (capturing_) return true;  // inside an object in data: already an error, skipped
    key_ = std::move(k);
    // A key of one of the inputs' objects: inputs is the root's, its objects are depth 3.
    data_next_ = key_ == "data" && stack_.size() == 3 && stack_[1] == inputs_ &&
                 stack_[2]->is_object();
    if (data_next_ && !data_seen_.insert(inputs_->size() - 1).second) {
      data_twice.insert(inputs_->size() - 1);
      data_next_ = false;  // the document takes it (and the request is refused)
    }
    return true;
  }
  bool end_object() override {
    if (capturing_) return Close();
    stack_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    if (capturing_) {
      if (current_->error.ok() && depth_ >= max_depth_) {
        current_->error = NestedTooDeep(name_, max_depth_);
      }
      ++depth_;
      return true;
    }
    if (data_next_ && Begin()) {
      depth_ = 1;
      return true;
    }
    const bool inputs = stack_.size() == 1 && key_ == "inputs";
    json* a = Add(json::array());
    if (inputs) {
      // A second "inputs" replaces the first, as json::parse keeps the last.
      inputs_ = a;
      direct.clear();
      data_twice.clear();
      skipped.clear();
      data_seen_.clear();
      total_ = 0;
    }
    stack_.push_back(a);
    return true;
  }
  bool end_array() override {
    if (capturing_) return Close();
    stack_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

 private:
  // A scalar: an element of the data being decoded, or a value of the document.
  bool Value(json v) {
    if (capturing_) {
      if (current_->error.ok()) Element(v);
      return true;
    }
    if (data_next_ && Begin()) {  // data given as one bare element
      Element(v);
      capturing_ = false;
      current_ = nullptr;
      return true;
    }
    Add(std::move(v));
    return true;
  }

  // Puts `v` into the innermost open container (or makes it the document); returns where.
  json* Add(json v) {
    data_next_ = false;
    if (stack_.empty()) {
      doc = std::move(v);
      return &doc;
    }
    json* top = stack_.back();
    if (top->is_array()) {
      top->push_back(std::move(v));
      return &top->back();
    }
    json& slot = (*top)[key_];
    slot = std::move(v);
    return &slot;
  }

  // The data of the input being read starts: decoded directly when its datatype and shape
  // are already known and fit the payload limit (then true); else false, and the data go
  // into the document (checked there, as any other).
  bool Begin() {
    data_next_ = false;
    const size_t index = inputs_->size() - 1;
    const json& in = *stack_[2];
    auto h = ReadInputHeader(in, "inputs[" + std::to_string(index) + "]");
    const bool header_given = in.contains("name") && in.contains("datatype") && in.contains("shape");
    if ((!h.ok() && header_given) || (h.ok() && h->bytes > max_bytes_ - total_)) {
      // Refused after the read at its header (bad, or tensors over the limit): the data are
      // skipped, never held as JSON values (each costs 16 bytes or more).
      skipped.insert(index);
      name_.clear();
      limit_ = 0;
      max_depth_ = std::numeric_limits<size_t>::max();
      current_ = &skipped_;
      Add(json(nullptr));
      capturing_ = true;
      return true;
    }
    // Data before their header, or more elements than the body could hold (refused after the
    // read without making their tensor): into the document.
    if (!h.ok() || static_cast<uint64_t>(h->elements) > body_bytes_) return false;
    DirectData d;
    d.dtype = h->dtype;
    d.shape = std::move(h->shape);
    d.bytes.assign(static_cast<size_t>(h->bytes), '\0');
    name_ = std::move(h->name);
    limit_ = static_cast<size_t>(h->elements);
    max_depth_ = std::max<size_t>(d.shape.size(), 1);
    auto [slot, fresh] = direct.emplace(index, std::move(d));
    if (!fresh) return false;  // cannot happen: data_seen_ lets each input's data begin once
    total_ += static_cast<int64_t>(slot->second.bytes.size());
    current_ = &slot->second;
    // The document keeps a placeholder where the data were.
    Add(json(nullptr));
    capturing_ = true;
    return true;
  }

  // One element of the data being decoded; the first bad one is kept as the input's error.
  void Element(const json& v) {
    current_->error =
        PutNext(v, current_->dtype, name_, limit_, &current_->count, &current_->bytes);
  }

  // An array or object inside the data being decoded ends; the data end with the outermost.
  bool Close() {
    if (--depth_ == 0) {
      capturing_ = false;
      current_ = nullptr;
    }
    return true;
  }

  const int64_t max_bytes_;
  const size_t body_bytes_;
  DirectData skipped_;        // where skipped data go: nowhere (its error stops every write)
  std::vector<json*> stack_;  // the open containers of the document, outermost first
  std::string key_;           // the last key read
  json* inputs_ = nullptr;    // the root's "inputs" array, once begun
  std::set<size_t> data_seen_;  // inputs whose "data" key was read
  bool data_next_ = false;    // the next value is an input's "data"
  bool capturing_ = false;    // inside data being decoded directly
  DirectData* current_ = nullptr;
  std::string name_;
  size_t limit_ = 0;      // elements the shape holds
  size_t depth_ = 0;      // arrays and objects open inside the data
  size_t max_depth_ = 1;  // the shape's rank (at least 1)
  int64_t total_ = 0;     // bytes taken by direct data so far
};

}  // namespace

absl::StatusOr<InferRequest> DecodeJsonInferRequest(const std::string& body,
                                                    const std::string& model,
                                                    const std::string& version,
                                                    int64_t max_bytes, json* parameters) {
  InferBodyReader reader(max_bytes, body.size());
  if (!json::sax_parse(body, &reader)) {
    return absl::InvalidArgumentError("the request body is not valid JSON");
  }
  json& doc = reader.doc;
  if (!doc.is_object()) return absl::InvalidArgumentError("the request body must be a JSON object");
  InferRequest r;
  r.model_name = model;
  r.model_version = version;
  if (doc.contains("id")) {
    if (!doc["id"].is_string()) return absl::InvalidArgumentError("id: must be a string");
    r.id = doc["id"].get<std::string>();
  }
  if (doc.contains("parameters")) {
    const json& p = doc["parameters"];
    if (!p.is_object()) return absl::InvalidArgumentError("parameters: must be an object");
    for (const auto& [key, value] : p.items()) {
      // The protocol's parameter values are scalars: bool, number or string.
      if (!value.is_primitive() || value.is_null()) {
        return absl::InvalidArgumentError("parameters." + key +
                                          ": must be a boolean, a number or a string");
      }
    }
    if (p.contains("priority")) {
      KILN_ASSIGN_OR_RETURN(r.priority, JsonInt(p["priority"], "parameters.priority"));
    }
    if (p.contains("timeout")) {
      KILN_ASSIGN_OR_RETURN(r.timeout_micros, JsonInt(p["timeout"], "parameters.timeout"));
    }
    if (p.contains(kSkipCacheParameter)) {
      const json& v = p[kSkipCacheParameter];
      if (!v.is_boolean()) {
        return absl::InvalidArgumentError(std::string("parameters.") + kSkipCacheParameter +
                                          ": must be a boolean");
      }
      r.skip_cache = v.get<bool>();
    }
    if (parameters) *parameters = p;
  }
  if (!doc.contains("inputs") || !doc["inputs"].is_array() || doc["inputs"].empty()) {
    return absl::InvalidArgumentError("inputs: must be a non-empty array");
  }
  int64_t total = 0;
  size_t idx = 0;
  for (const json& in : doc["inputs"]) {
    std::string field = "inputs[" + std::to_string(idx++) + "]";
    if (!in.is_object()) return absl::InvalidArgumentError(field + ": must be an object");
    KILN_ASSIGN_OR_RETURN(InputHeader h, ReadInputHeader(in, field));
    Tensor t;
    t.name = std::move(h.name);
    t.dtype = h.dtype;
    t.shape = std::move(h.shape);
    const int64_t n = h.elements;
    const int64_t bytes = h.bytes;
    if (bytes > max_bytes - total) {  // written so it cannot overflow
      return absl::ResourceExhaustedError("the request's tensors exceed the payload limit of " +
                                          std::to_string(max_bytes) + " bytes");
    }
    total += bytes;
    if (in.contains("parameters") && in["parameters"].is_object() &&
        in["parameters"].contains("binary_data_size")) {
      return absl::InvalidArgumentError("input '" + t.name +
                                        "': the binary data extension is not supported; send "
                                        "JSON data or use gRPC raw_input_contents");
    }
    if (!in.contains("data")) return absl::InvalidArgumentError(field + ".data: is missing");
    if (reader.data_twice.count(idx - 1)) {
      return absl::InvalidArgumentError(field + ".data: given twice");
    }
    if (reader.skipped.count(idx - 1)) {  // the header that refused them was given again
      return absl::InvalidArgumentError(field + ": datatype and shape must each be given once");
    }
    if (static_cast<uint64_t>(n) > body.size()) {
      // Each element takes a character at least: refused before its tensor is made.
      return absl::InvalidArgumentError("input '" + t.name + "': expected " + std::to_string(n) +
                                        " elements for shape " + ShapeString(t.shape) +
                                        ", more than a body of " + std::to_string(body.size()) +
                                        " bytes holds");
    }
    size_t count = 0;
    if (auto d = reader.direct.find(idx - 1); d != reader.direct.end()) {
      // Decoded while read; a datatype or shape given again after the data changed them.
      if (d->second.dtype != t.dtype || d->second.shape != t.shape) {
        return absl::InvalidArgumentError(field + ": datatype and shape must each be given once");
      }
      KILN_RETURN_IF_ERROR(d->second.error);
      t.data = std::move(d->second.bytes);
      count = d->second.count;
    } else {
      t.data.assign(static_cast<size_t>(bytes), '\0');
      KILN_RETURN_IF_ERROR(Flatten(in["data"], t.dtype, t.name, static_cast<size_t>(n), 0,
                                   std::max<size_t>(t.shape.size(), 1), &count, &t.data));
    }
    if (count != static_cast<size_t>(n)) {
      return absl::InvalidArgumentError("input '" + t.name + "': expected " + std::to_string(n) +
                                        " elements for shape " + ShapeString(t.shape) + ", got " +
                                        std::to_string(count));
    }
    r.inputs.push_back(std::move(t));
  }
  if (doc.contains("outputs")) {
    if (!doc["outputs"].is_array()) return absl::InvalidArgumentError("outputs: must be an array");
    size_t i = 0;
    for (const json& o : doc["outputs"]) {
      if (!o.is_object() || !o.contains("name") || !o["name"].is_string()) {
        return absl::InvalidArgumentError("outputs[" + std::to_string(i) +
                                          "].name: must be a string");
      }
      if (o.contains("parameters") && o["parameters"].is_object() &&
          o["parameters"].contains("classification")) {
        return absl::InvalidArgumentError("outputs[" + std::to_string(i) +
                                          "].parameters.classification: not supported");
      }
      r.outputs.push_back(o["name"].get<std::string>());
      ++i;
    }
  }
  return r;
}

namespace {

// A string as JSON text: quoted and escaped, bytes that are not UTF-8 replaced (U+FFFD).
void AppendJsonString(const std::string& s, std::string* out) {
  *out += json(s).dump(-1, ' ', false, json::error_handler_t::replace);
}

template <typename T>
void AppendInteger(T v, std::string* out) {
  char buf[24];  // the longest, int64's minimum and uint64's maximum, take 20
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  out->append(buf, r.ptr);
}

// A finite value as the shortest decimal that reads back as it (std::to_chars), with ".0" when
// it would otherwise read as an integer (as json::dump writes floats; "1e+06" keeps its
// exponent form); null for NaN and infinities, which JSON has no numbers for. The buffer holds
// the longest form, 24 characters for a double.
// A float's own shortest form has up to 9 digits, not its double's 17, but read the way most
// clients read JSON, as a double then narrowed, a rounding twice can move it one step
// (7.038531e-26, bits 0x15AE43FD, is the one positive float where it does): such a float is
// written in its double's form, which comes back exactly.
template <typename T>
void AppendFloating(T v, std::string* out) {
  if (!std::isfinite(v)) {
    *out += "null";
    return;
  }
  char buf[40];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  if constexpr (std::is_same_v<T, float>) {
    double back = 0;
    std::from_chars(buf, r.ptr, back);
    if (static_cast<float>(back) != v) {
      AppendFloating(static_cast<double>(v), out);
      return;
    }
  }
  const std::string_view text(buf, static_cast<size_t>(r.ptr - buf));
  out->append(text);
  if (text.find_first_of(".e") == std::string_view::npos) *out += ".0";
}

}  // namespace

void AppendTensorData(const Tensor& t, std::string* out) {
  const size_t n = t.data.size() / std::max<size_t>(DataTypeSize(t.dtype), 1);
  out->reserve(out->size() + n * 12 + 2);
  *out += '[';
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) *out += ',';
    switch (t.dtype) {
      case DataType::kBool:
        *out += t.data[i] != 0 ? "true" : "false";
        break;
      case DataType::kInt8:
        AppendInteger(Get<int8_t>(t.data, i), out);
        break;
      case DataType::kInt16:
        AppendInteger(Get<int16_t>(t.data, i), out);
        break;
      case DataType::kInt32:
        AppendInteger(Get<int32_t>(t.data, i), out);
        break;
      case DataType::kInt64:
        AppendInteger(Get<int64_t>(t.data, i), out);
        break;
      case DataType::kUint8:
        AppendInteger(Get<uint8_t>(t.data, i), out);
        break;
      case DataType::kUint16:
        AppendInteger(Get<uint16_t>(t.data, i), out);
        break;
      case DataType::kUint32:
        AppendInteger(Get<uint32_t>(t.data, i), out);
        break;
      case DataType::kUint64:
        AppendInteger(Get<uint64_t>(t.data, i), out);
        break;
      // Half-precision values are exact as floats, and read back as the same half from the
      // float's form.
      case DataType::kFp16:
        AppendFloating(HalfToFloat(Get<uint16_t>(t.data, i)), out);
        break;
      case DataType::kBf16:
        AppendFloating(Bf16ToFloat(Get<uint16_t>(t.data, i)), out);
        break;
      case DataType::kFp32:
        AppendFloating(Get<float>(t.data, i), out);
        break;
      case DataType::kFp64:
        AppendFloating(Get<double>(t.data, i), out);
        break;
    }
  }
  *out += ']';
}

int RestErrorStatus(const absl::Status& status, bool decoding) {
  if (decoding && status.code() == absl::StatusCode::kResourceExhausted) return 413;
  return HttpStatusFromCode(status.code());
}

// Written directly rather than built as a JSON document and dumped: a document holds each
// element as a 16-byte value and writes an FP32 value as its double (up to 17 digits); writing
// text is 1.5-2.0x faster (kiln-codec-bench: 1024 floats in 67 against 98 µs). Keys come in the
// order json::dump gives them (sorted).
std::string EncodeJsonInferResponse(const InferResponse& response, const json& parameters) {
  std::string out;
  out += '{';
  if (!response.id.empty()) {
    out += "\"id\":";
    AppendJsonString(response.id, &out);
    out += ',';
  }
  out += "\"model_name\":";
  AppendJsonString(response.model_name, &out);
  out += ",\"model_version\":";
  AppendJsonString(response.model_version, &out);
  out += ",\"outputs\":[";
  for (size_t i = 0; i < response.outputs.size(); ++i) {
    const Tensor& t = response.outputs[i];
    if (i > 0) out += ',';
    out += "{\"data\":";
    AppendTensorData(t, &out);
    out += ",\"datatype\":\"";
    out += DataTypeName(t.dtype);  // a fixed name: nothing to escape
    out += '"';
    out += ",\"name\":";
    AppendJsonString(t.name, &out);
    out += ",\"shape\":[";
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (d > 0) out += ',';
      AppendInteger(t.shape[d], &out);
    }
    out += "]}";
  }
  out += ']';
  if (!parameters.is_null()) {
    out += ",\"parameters\":";
    out += parameters.dump(-1, ' ', false, json::error_handler_t::replace);
  }
  out += '}';
  return out;
}

}  // namespace kiln
