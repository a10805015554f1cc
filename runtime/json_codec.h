#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "runtime/inference_engine.h"

namespace kiln {

// The Open Inference Protocol's REST JSON bodies.

// Decodes an infer request body for `model`/`version` (from the URL). `data` may be flat
// or nested row-major; each element must fit the datatype. Shapes are checked against
// `max_bytes` before any tensor is allocated.
absl::StatusOr<InferRequest> DecodeJsonInferRequest(const std::string& body,
                                                    const std::string& model,
                                                    const std::string& version,
                                                    int64_t max_bytes,
                                                    nlohmann::json* parameters);

// Encodes a response; `parameters` (the request's) are echoed back when not null.
std::string EncodeJsonInferResponse(const InferResponse& response,
                                    const nlohmann::json& parameters);

// The HTTP status of a REST inference error: HttpStatusFromCode, but a payload over the limit
// found while `decoding` is 413 (it can never succeed), not 429 ("retry later").
int RestErrorStatus(const absl::Status& status, bool decoding);

// Appends a tensor's elements as the text of a JSON array of numbers (or booleans), flat; a
// float as the shortest decimal that reads back as the same value, NaN and infinities as null.
void AppendTensorData(const Tensor& t, std::string* out);

}  // namespace kiln
