#pragma once

// Open Inference Protocol v2 request builders and response parsers for the `encoder` demo
// model (inputs input_ids and attention_mask, INT64 [batch, seq]; output embedding FP32
// [batch, 64]), shared by kiln-loadgen, kiln-demo-client and kiln-overhead-bench.

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "inference/grpc_service.pb.h"

namespace kiln::bench {

inline constexpr char kInputIdsName[] = "input_ids";
inline constexpr char kAttentionMaskName[] = "attention_mask";
inline constexpr char kEmbeddingName[] = "embedding";

// One request's worth of encoder input: `batch` rows of `seq_len` tokens, row-major.
struct EncoderInput {
  int64_t batch = 1;
  int64_t seq_len = 0;
  std::vector<int64_t> ids;
  std::vector<int64_t> mask;
};

// Random token ids in 1..999 and an all-ones mask.
EncoderInput RandomEncoderInput(int64_t batch, int64_t seq_len, std::mt19937_64* rng);

// A trivial tokenizer: lower-cased alphanumeric words, each hashed (FNV-1a) into 1..999.
// Batch 1, all-ones mask. An empty sentence becomes a single token.
EncoderInput SentenceToEncoderInput(const std::string& sentence);

// gRPC ModelInfer request. `raw` puts the tensors in raw_input_contents (little-endian
// bytes); otherwise in the typed int64_contents.
inference::ModelInferRequest MakeGrpcInferRequest(const std::string& model,
                                                  const std::string& version, const std::string& id,
                                                  const EncoderInput& in, bool raw);

// REST JSON body for POST /v2/models/{model}/infer.
std::string MakeRestInferBody(const std::string& id, const EncoderInput& in);

// "/v2/models/encoder/infer" or "/v2/models/encoder/versions/2/infer".
std::string RestInferPath(const std::string& model, const std::string& version);

struct InferResult {
  std::string model_version;
  std::vector<int64_t> shape;
  std::vector<float> values;  // FP32 output, row-major
};

// Extracts output `output` (FP32) from raw_output_contents or the typed contents.
absl::StatusOr<InferResult> ParseGrpcInferResponse(const inference::ModelInferResponse& resp,
                                                   const std::string& output);

// Parses an OIP REST response; a non-2xx status or an {"error": ...} body is an error
// carrying the server's message.
absl::StatusOr<InferResult> ParseRestInferResponse(int http_status, const std::string& body,
                                                   const std::string& output);

// The server's error message from a non-2xx REST response (the "error" field when the body
// is OIP JSON, else the start of the body).
std::string RestErrorMessage(int http_status, const std::string& body);

}  // namespace kiln::bench
