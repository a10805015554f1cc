#pragma once

// Request parameters of the Open Inference Protocol that kiln gives a meaning of its own, beside
// the protocol's `priority` and `timeout`.

namespace kiln {

// A bool: true = the request is neither answered from the model's response cache nor stored in
// it. The agent's health probe sends it, so that a probe always runs the model.
inline constexpr char kSkipCacheParameter[] = "kiln-skip-cache";

// The version that served a request: a response parameter, and the node router's gRPC
// metadata and HTTP header of the same name.
inline constexpr char kVersionParameter[] = "kiln-version";

}  // namespace kiln
