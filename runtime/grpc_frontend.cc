#include "runtime/grpc_frontend.h"

#include <chrono>
#include <cstring>
#include <limits>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/oip_parameters.h"
#include "common/status.h"

namespace kiln {

namespace {

template <typename To, typename From>
absl::Status PackChecked(const google::protobuf::RepeatedField<From>& src, const std::string& name,
                         std::string* out) {
  out->resize(src.size() * sizeof(To));
  char* p = out->data();
  for (int i = 0; i < src.size(); ++i) {
    From v = src.Get(i);
    if constexpr (!std::is_same_v<To, From> && std::is_integral_v<To>) {
      if (v < static_cast<From>(std::numeric_limits<To>::min()) ||
          v > static_cast<From>(std::numeric_limits<To>::max())) {
        return absl::InvalidArgumentError("input '" + name + "': element " + std::to_string(i) +
                                          " (" + std::to_string(v) + ") is out of range");
      }
    }
    To t = static_cast<To>(v);
    std::memcpy(p + i * sizeof(To), &t, sizeof(To));
  }
  return absl::OkStatus();
}

template <typename From, typename To>
void Unpack(const std::string& data, google::protobuf::RepeatedField<To>* dst) {
  size_t n = data.size() / sizeof(From);
  dst->Reserve(static_cast<int>(n));
  for (size_t i = 0; i < n; ++i) {
    From v;
    std::memcpy(&v, data.data() + i * sizeof(From), sizeof(From));
    dst->Add(static_cast<To>(v));
  }
}

// Number of typed elements given for a datatype, and which contents field holds them.
int64_t TypedCount(const inference::InferTensorContents& c, DataType t) {
  switch (t) {
    case DataType::kBool:
      return c.bool_contents_size();
    case DataType::kInt8:
    case DataType::kInt16:
    case DataType::kInt32:
      return c.int_contents_size();
    case DataType::kInt64:
      return c.int64_contents_size();
    case DataType::kUint8:
    case DataType::kUint16:
    case DataType::kUint32:
      return c.uint_contents_size();
    case DataType::kUint64:
      return c.uint64_contents_size();
    case DataType::kFp32:
      return c.fp32_contents_size();
    case DataType::kFp64:
      return c.fp64_contents_size();
    default:
      return -1;  // FP16 and BF16 have no typed field
  }
}

absl::Status PackTyped(const inference::InferTensorContents& c, Tensor* t) {
  switch (t->dtype) {
    case DataType::kBool: {
      t->data.resize(c.bool_contents_size());
      for (int i = 0; i < c.bool_contents_size(); ++i) t->data[i] = c.bool_contents(i) ? 1 : 0;
      return absl::OkStatus();
    }
    case DataType::kInt8:
      return PackChecked<int8_t>(c.int_contents(), t->name, &t->data);
    case DataType::kInt16:
      return PackChecked<int16_t>(c.int_contents(), t->name, &t->data);
    case DataType::kInt32:
      return PackChecked<int32_t>(c.int_contents(), t->name, &t->data);
    case DataType::kInt64:
      return PackChecked<int64_t>(c.int64_contents(), t->name, &t->data);
    case DataType::kUint8:
      return PackChecked<uint8_t>(c.uint_contents(), t->name, &t->data);
    case DataType::kUint16:
      return PackChecked<uint16_t>(c.uint_contents(), t->name, &t->data);
    case DataType::kUint32:
      return PackChecked<uint32_t>(c.uint_contents(), t->name, &t->data);
    case DataType::kUint64:
      return PackChecked<uint64_t>(c.uint64_contents(), t->name, &t->data);
    case DataType::kFp32:
      return PackChecked<float>(c.fp32_contents(), t->name, &t->data);
    case DataType::kFp64:
      return PackChecked<double>(c.fp64_contents(), t->name, &t->data);
    default:
      return absl::InvalidArgumentError("input '" + t->name + "': " + DataTypeName(t->dtype) +
                                        " must be sent in raw_input_contents");
  }
}

void UnpackTyped(const Tensor& t, inference::InferTensorContents* c) {
  switch (t.dtype) {
    case DataType::kBool:
      for (char b : t.data) c->add_bool_contents(b != 0);
      break;
    case DataType::kInt8:
      Unpack<int8_t>(t.data, c->mutable_int_contents());
      break;
    case DataType::kInt16:
      Unpack<int16_t>(t.data, c->mutable_int_contents());
      break;
    case DataType::kInt32:
      Unpack<int32_t>(t.data, c->mutable_int_contents());
      break;
    case DataType::kInt64:
      Unpack<int64_t>(t.data, c->mutable_int64_contents());
      break;
    case DataType::kUint8:
      Unpack<uint8_t>(t.data, c->mutable_uint_contents());
      break;
    case DataType::kUint16:
      Unpack<uint16_t>(t.data, c->mutable_uint_contents());
      break;
    case DataType::kUint32:
      Unpack<uint32_t>(t.data, c->mutable_uint_contents());
      break;
    case DataType::kUint64:
      Unpack<uint64_t>(t.data, c->mutable_uint64_contents());
      break;
    case DataType::kFp32:
      Unpack<float>(t.data, c->mutable_fp32_contents());
      break;
    case DataType::kFp64:
      Unpack<double>(t.data, c->mutable_fp64_contents());
      break;
    case DataType::kFp16:
    case DataType::kBf16:
      break;  // no typed field: EncodeInferResponse sends these raw
  }
}

absl::StatusOr<int64_t> IntParam(const inference::InferParameter& p, const std::string& name) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kInt64Param:
      return p.int64_param();
    case inference::InferParameter::kUint64Param:
      if (p.uint64_param() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError("parameter '" + name + "': too large");
      }
      return static_cast<int64_t>(p.uint64_param());
    default:
      return absl::InvalidArgumentError("parameter '" + name + "': must be an integer");
  }
}

}  // namespace

absl::Status ApplyRequestParameters(
    const google::protobuf::Map<std::string, inference::InferParameter>& params,
    InferRequest* request) {
  if (auto it = params.find("priority"); it != params.end()) {
    KILN_ASSIGN_OR_RETURN(request->priority, IntParam(it->second, "priority"));
  }
  if (auto it = params.find("timeout"); it != params.end()) {
    KILN_ASSIGN_OR_RETURN(request->timeout_micros, IntParam(it->second, "timeout"));
  }
  if (auto it = params.find(kSkipCacheParameter); it != params.end()) {
    if (it->second.parameter_choice_case() != inference::InferParameter::kBoolParam) {
      return absl::InvalidArgumentError(std::string("parameter '") + kSkipCacheParameter +
                                        "': must be a bool");
    }
    request->skip_cache = it->second.bool_param();
  }
  return absl::OkStatus();
}

absl::StatusOr<InferRequest> DecodeInferRequest(const inference::ModelInferRequest& req,
                                                int64_t max_bytes) {
  InferRequest r;
  r.model_name = req.model_name();
  r.model_version = req.model_version();
  r.id = req.id();
  KILN_RETURN_IF_ERROR(ApplyRequestParameters(req.parameters(), &r));
  const bool raw = req.raw_input_contents_size() > 0;
  if (raw && req.raw_input_contents_size() != req.inputs_size()) {
    return absl::InvalidArgumentError(
        "raw_input_contents has " + std::to_string(req.raw_input_contents_size()) +
        " entries but there are " + std::to_string(req.inputs_size()) + " inputs");
  }
  if (req.inputs_size() == 0) return absl::InvalidArgumentError("the request has no inputs");
  int64_t total = 0;
  for (int i = 0; i < req.inputs_size(); ++i) {
    const auto& in = req.inputs(i);
    Tensor t;
    t.name = in.name();
    KILN_ASSIGN_OR_RETURN(t.dtype, ParseDataType(in.datatype(), "input '" + in.name() + "'"));
    t.shape.assign(in.shape().begin(), in.shape().end());
    KILN_ASSIGN_OR_RETURN(int64_t n, ElementCount(t.shape, "input '" + in.name() + "'"));
    int64_t bytes = n * static_cast<int64_t>(DataTypeSize(t.dtype));
    if (bytes > max_bytes - total) {  // written so it cannot overflow
      return absl::ResourceExhaustedError("the request's tensors exceed the payload limit of " +
                                          std::to_string(max_bytes) + " bytes");
    }
    total += bytes;
    if (raw) {
      if (in.has_contents()) {
        return absl::InvalidArgumentError("input '" + in.name() +
                                          "': give contents or raw_input_contents, not both");
      }
      const std::string& data = req.raw_input_contents(i);
      if (static_cast<int64_t>(data.size()) != bytes) {
        return absl::InvalidArgumentError("input '" + in.name() + "': expected " +
                                          std::to_string(bytes) + " bytes for " +
                                          in.datatype() + " " + ShapeString(t.shape) + ", got " +
                                          std::to_string(data.size()));
      }
      if (t.dtype == DataType::kBool) {
        for (size_t b = 0; b < data.size(); ++b) {
          if (data[b] != 0 && data[b] != 1) {
            return absl::InvalidArgumentError(
                "input '" + in.name() + "': raw_input_contents byte " + std::to_string(b) +
                " is " + std::to_string(static_cast<unsigned char>(data[b])) +
                "; a BOOL is 0 or 1");
          }
        }
      }
      t.data = data;
    } else {
      int64_t got = TypedCount(in.contents(), t.dtype);
      if (got < 0) {
        KILN_RETURN_IF_ERROR(PackTyped(in.contents(), &t));  // returns the FP16/BF16 error
      }
      if (got != n) {
        return absl::InvalidArgumentError("input '" + in.name() + "': expected " +
                                          std::to_string(n) + " elements for shape " +
                                          ShapeString(t.shape) + ", got " + std::to_string(got));
      }
      KILN_RETURN_IF_ERROR(PackTyped(in.contents(), &t));
    }
    r.inputs.push_back(std::move(t));
  }
  for (int i = 0; i < req.outputs_size(); ++i) {
    const auto& o = req.outputs(i);
    if (o.parameters().count("classification")) {
      return absl::InvalidArgumentError("outputs[" + std::to_string(i) +
                                        "].parameters.classification: not supported");
    }
    r.outputs.push_back(o.name());
  }
  return r;
}

absl::Status EncodeInferResponse(const InferResponse& response, bool raw,
                                 inference::ModelInferResponse* out) {
  out->set_model_name(response.model_name);
  out->set_model_version(response.model_version);
  out->set_id(response.id);
  for (const Tensor& t : response.outputs) {
    // FP16 and BF16 have no typed contents field: such a response goes out raw.
    if (t.dtype == DataType::kFp16 || t.dtype == DataType::kBf16) raw = true;
  }
  for (const Tensor& t : response.outputs) {
    auto* o = out->add_outputs();
    o->set_name(t.name);
    o->set_datatype(DataTypeName(t.dtype));
    for (int64_t d : t.shape) o->add_shape(d);
    if (raw) {
      out->add_raw_output_contents(t.data);
    } else {
      UnpackTyped(t, o->mutable_contents());
    }
  }
  return absl::OkStatus();
}

absl::Status FillModelMetadata(const ModelHost& host, const std::string& name,
                               const std::string& version,
                               inference::ModelMetadataResponse* out) {
  if (!host.Serves(name, version)) {
    return absl::NotFoundError("unknown model '" + name + "'" +
                               (version.empty() ? "" : " version '" + version + "'"));
  }
  const ModelConfig& c = host.config();
  out->set_name(c.name);
  out->add_versions(host.version());
  out->set_platform("pytorch_libtorch");
  auto add = [&](const TensorSpec& s, inference::ModelMetadataResponse::TensorMetadata* m) {
    m->set_name(s.name);
    m->set_datatype(DataTypeName(s.dtype));
    if (c.max_batch_size > 0) m->add_shape(-1);
    for (int64_t d : s.dims) m->add_shape(d);
  };
  for (const auto& s : c.inputs) add(s, out->add_inputs());
  for (const auto& s : c.outputs) add(s, out->add_outputs());
  return absl::OkStatus();
}

void GrpcInferenceService::Serve(std::shared_ptr<GrpcH2Server::Call> call) {
  try {
    Dispatch(call);
  } catch (const std::exception& e) {
    call->Finish(grpc::Status(grpc::StatusCode::INTERNAL, std::string("internal error: ") + e.what()));
  }
}

void GrpcInferenceService::Dispatch(const std::shared_ptr<GrpcH2Server::Call>& call) {
  static constexpr char kService[] = "/inference.GRPCInferenceService/";
  const std::string& path = call->method();
  const std::string method =
      path.rfind(kService, 0) == 0 ? path.substr(sizeof(kService) - 1) : std::string();
  if (method == "ModelInfer") {
    ModelInfer(call);
  } else if (method == "ServerLive") {
    inference::ServerLiveRequest req;
    if (!ParseRequest(*call, &req)) return;
    inference::ServerLiveResponse resp;
    resp.set_live(host_->Live());
    AnswerCall(*call, grpc::Status::OK, resp);
  } else if (method == "ServerReady") {
    inference::ServerReadyRequest req;
    if (!ParseRequest(*call, &req)) return;
    inference::ServerReadyResponse resp;
    resp.set_ready(host_->ModelReady(host_->config().name, ""));
    AnswerCall(*call, grpc::Status::OK, resp);
  } else if (method == "ModelReady") {
    inference::ModelReadyRequest req;
    if (!ParseRequest(*call, &req)) return;
    if (!host_->Serves(req.name(), req.version())) {
      call->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown model '" + req.name() + "'"));
      return;
    }
    inference::ModelReadyResponse resp;
    resp.set_ready(host_->ModelReady(req.name(), req.version()));
    AnswerCall(*call, grpc::Status::OK, resp);
  } else if (method == "ServerMetadata") {
    inference::ServerMetadataRequest req;
    if (!ParseRequest(*call, &req)) return;
    inference::ServerMetadataResponse resp;
    resp.set_name("kiln");
    resp.set_version(server_version_);
    resp.add_extensions("model_repository_layout");
    resp.add_extensions("dynamic_batching");
    resp.add_extensions("response_cache");
    resp.add_extensions("priority");
    resp.add_extensions("timeout");
    AnswerCall(*call, grpc::Status::OK, resp);
  } else if (method == "ModelMetadata") {
    inference::ModelMetadataRequest req;
    if (!ParseRequest(*call, &req)) return;
    inference::ModelMetadataResponse resp;
    AnswerCall(*call, ToGrpcStatus(FillModelMetadata(*host_, req.name(), req.version(), &resp)), resp);
  } else {
    call->Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                              "unknown method " + path + ": kiln-runtime serves "
                              "inference.GRPCInferenceService"));
  }
}

absl::Status NoteCallerDeadline(int64_t deadline_unix_micros, InferRequest* request) {
  if (deadline_unix_micros < 0) {
    return absl::InvalidArgumentError("the request's deadline (" +
                                      std::to_string(deadline_unix_micros) +
                                      " unix microseconds) is negative");
  }
  if (deadline_unix_micros == 0) return absl::OkStatus();
  const int64_t left = deadline_unix_micros - absl::ToUnixMicros(absl::Now());
  if (left <= 0) {
    return absl::DeadlineExceededError("the request's deadline passed before it was queued");
  }
  request->caller_time_left_micros = left;
  return absl::OkStatus();
}

void GrpcInferenceService::ModelInfer(const std::shared_ptr<GrpcH2Server::Call>& call) {
  inference::ModelInferRequest req;
  if (!req.ParseFromString(call->message())) {
    host_->CountRefused();
    call->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              "the request is not an inference.ModelInferRequest"));
    return;
  }
  std::string().swap(call->message());  // parsed: its bytes are not needed
  auto decoded = DecodeInferRequest(req, max_request_bytes_);
  if (!decoded.ok()) {
    host_->CountRefused();
    call->Finish(ToGrpcStatus(decoded.status()));
    return;
  }
  // This thread reads every connection's next requests and answers their pings: the model
  // runs on the batcher's thread, never here.
  decoded->shared_reader = true;
  decoded->never_inline = true;
  // The caller's gRPC deadline bounds the request's timeout, as the data socket's does.
  if (call->deadline() != absl::InfiniteFuture()) {
    absl::Status bounded = NoteCallerDeadline(absl::ToUnixMicros(call->deadline()), &*decoded);
    if (!bounded.ok()) {
      host_->CountRefused();
      call->Finish(ToGrpcStatus(bounded));
      return;
    }
  }
  const bool raw = req.raw_input_contents_size() > 0;
  // Request parameters are echoed back.
  auto params = std::make_shared<google::protobuf::Map<std::string, inference::InferParameter>>(
      std::move(*req.mutable_parameters()));
  host_->Infer(std::move(*decoded), [call, raw, params](absl::StatusOr<InferResponse> r) {
    if (!r.ok()) {
      call->Finish(ToGrpcStatus(r.status()));
      return;
    }
    inference::ModelInferResponse out;
    *out.mutable_parameters() = std::move(*params);
    absl::Status encoded = EncodeInferResponse(*r, raw, &out);
    if (!encoded.ok()) {
      call->Finish(ToGrpcStatus(encoded));
      return;
    }
    std::string bytes;
    if (!out.SerializeToString(&bytes)) {
      call->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                "the answer cannot be serialized (over 2 GiB)"));
      return;
    }
    call->Finish(grpc::Status::OK, std::move(bytes));
  });
}

}  // namespace kiln
