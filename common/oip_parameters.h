#pragma once

// Request parameters of the Open Inference Protocol that kiln gives a meaning of its own, beside
// the protocol's `priority` and `timeout`.

namespace kiln {

// A bool: true = the request is neither answered from the model's response cache nor stored in
// it. The agent's health probe sends it, so that a probe always runs the model.
inline constexpr char kSkipCacheParameter[] = "kiln-skip-cache";

}  // namespace kiln
