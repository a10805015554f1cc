#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/grpc_h2_server.h"
#include "inference/grpc_service.grpc.pb.h"
#include "runtime/inference_engine.h"
#include "runtime/model_host.h"

namespace kiln {

// Decodes a ModelInferRequest (typed contents or raw_input_contents). Sizes are checked
// against the shapes, and against `max_bytes`, before any tensor buffer is allocated.
absl::StatusOr<InferRequest> DecodeInferRequest(const inference::ModelInferRequest& request,
                                                int64_t max_bytes);

// Encodes outputs as raw_output_contents when `raw`, else as typed contents.
absl::Status EncodeInferResponse(const InferResponse& response, bool raw,
                                 inference::ModelInferResponse* out);

// Reads the request-level `priority` and `timeout` (microseconds) parameters.
absl::Status ApplyRequestParameters(
    const google::protobuf::Map<std::string, inference::InferParameter>& params,
    InferRequest* request);

// Notes on `request` its caller's deadline (unix microseconds; 0 = none), as time left: the
// engine bounds the request's timeout (its own, else the model's default) by it, so a request
// its caller gave up on leaves the queue then instead of running for nobody.
// DEADLINE_EXCEEDED when the deadline has passed already.
absl::Status NoteCallerDeadline(int64_t deadline_unix_micros, InferRequest* request);

// The Open Inference Protocol gRPC service, on the runtime's HTTP/2 server
// (common/grpc_h2_server.h). Serve gets each whole call on that server's one thread and never
// runs the model there: ModelInfer goes to the batcher, whose thread answers it, so the server
// goes on reading (requests that come meanwhile are batched) and answering pings.
class GrpcInferenceService {
 public:
  GrpcInferenceService(ModelHost* host, int64_t max_request_bytes, std::string server_version)
      : host_(host), max_request_bytes_(max_request_bytes),
        server_version_(std::move(server_version)) {}

  void Serve(std::shared_ptr<GrpcH2Server::Call> call);

 private:
  void Dispatch(const std::shared_ptr<GrpcH2Server::Call>& call);
  void ModelInfer(const std::shared_ptr<GrpcH2Server::Call>& call);

  ModelHost* host_;
  const int64_t max_request_bytes_;
  const std::string server_version_;
};

// Fills OIP model metadata (shared by gRPC and REST).
absl::Status FillModelMetadata(const ModelHost& host, const std::string& name,
                               const std::string& version,
                               inference::ModelMetadataResponse* out);

}  // namespace kiln
